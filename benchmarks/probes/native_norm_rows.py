"""One-off probe behind `native.MIN_ROWS` (sixteenth session); not part of make bench.

From how many rows does normlab's native norm kernel beat `F.layer_norm`? Median µs of 300
calls each, on [rows, D] float32 for D = 16 (QKV-Norm's head rows) and 64 (d_model), without
autograd (a forward) and with it (forward + backward through `torch.autograd.grad`):

    .venv/bin/python benchmarks/probes/native_norm_rows.py [THREADS]
"""
import statistics as st
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from normlab.model import native

if len(sys.argv) > 2 or (len(sys.argv) == 2 and not sys.argv[1].isdigit()):
    sys.exit("usage: native_norm_rows.py [THREADS]")
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
print(f"{torch.get_num_threads()} thread(s); kernel: {native.describe()}")


def us(fn: Callable[[], object], n: int = 300) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return st.median(ts) * 1e6


def row(d: int, rows: int) -> str:
    torch.manual_seed(0)
    x = torch.randn(rows, d, requires_grad=True)
    w, b = torch.randn(d, requires_grad=True), torch.randn(d, requires_grad=True)
    gy = torch.randn(rows, d)

    def ours() -> torch.Tensor:
        return native.norm(x, w, b, 1e-5, True)

    def theirs() -> torch.Tensor:
        return F.layer_norm(x, (d,), w, b, 1e-5)

    with torch.no_grad():
        fwd = us(ours), us(theirs)
    both = [us(lambda f=f: torch.autograd.grad(f(), (x, w, b), gy)) for f in (ours, theirs)]
    return (f"{d:<5d} {rows:5d}   {fwd[0]:7.1f} / {fwd[1]:7.1f}"
            f"                   {both[0]:7.1f} / {both[1]:7.1f}")


print("D     rows   forward: native / torch µs   forward+backward: native / torch µs")
for d in (16, 64):
    for rows in (64, 256, 512, 1024, 2048, 4096, 8192):
        print(row(d, rows))
