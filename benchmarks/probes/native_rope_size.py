"""One-off probe behind `native.ROPE_MIN_ELEMENTS` (seventeenth session); not part of make bench.

`Rope(x)` for x [B, P, 4, 16] (d_head 16, 4 heads, as the benchmarks' d64 models) with
normlab's RoPE kernel (its size bar lifted, so at every size) against torch's ops, by B * P, in eval (no_grad: a forward) and under
autograd (forward + backward). One process, the kernel switched on and off, alternating,
11 rounds; µs per call, and torch / kernel (> 1: the kernel is faster).

    .venv/bin/python benchmarks/probes/native_rope_size.py [THREADS]
"""
import statistics as st
import sys
import time

import torch

from normlab.model import native
from normlab.model.positions import Rotary

if len(sys.argv) > 2 or (len(sys.argv) == 2 and not sys.argv[1].isdigit()):
    sys.exit("usage: native_rope_size.py [THREADS]")
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
native.ROPE_MIN_ELEMENTS = 0  # the kernel at every size: this probe is what sets the bar
print(f"{torch.get_num_threads()} thread(s); kernels: {native.describe()}")
print(f"{'B x P':>12s} {'elements':>9s}  {'eval: torch':>11s} {'kernel':>8s} {'ratio':>6s}"
      f"  {'autograd: torch':>15s} {'kernel':>8s} {'ratio':>6s}")
for b, p in ((1, 1), (1, 17), (4, 17), (16, 17), (64, 17), (256, 1), (128, 17), (256, 16)):
    rope = Rotary(16, 10000.0)(torch.arange(p)[None].expand(b, -1))
    x = torch.randn(b, p, 4, 16)
    xg = x.clone().requires_grad_()
    gy = torch.randn_like(x)
    inner = max(20, 200_000 // x.numel())

    def forward() -> None:
        with torch.no_grad():
            rope(x)

    def both() -> None:
        torch.autograd.grad(rope(xg), xg, gy)

    row = []
    for fn in (forward, both):
        times: dict[bool, list[float]] = {False: [], True: []}
        for r in range(11):
            for on in (False, True) if r % 2 == 0 else (True, False):
                native.set_enabled(on, "rope")
                fn()
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn()
                times[on].append((time.perf_counter() - t0) / inner * 1e6)
        native.set_enabled(True, "rope")
        ratios = [a / k for a, k in zip(times[False], times[True], strict=True)]
        row.append(f"{st.median(times[False]):11.1f} {st.median(times[True]):8.1f} "
                   f"{st.median(ratios):6.2f}")
    print(f"{f'{b} x {p}':>12s} {x.numel():9d}  {row[0]}  {row[1]:>31s}")
