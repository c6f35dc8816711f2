"""One-off probe behind a twenty-seventh-session number in docs/performance.md; not make bench.

Where `native.attention` stands against SDPA's CPU kernel and the explicit path as rows grow:
causal attention, forward and backward, 4 heads of 16, about 2176 positions a call (the
training batch's, 128 x 17), T = S keys from 17 to 256; each contender's median time over 9
rounds, alternating in one process (the kernel's ratio to each, time other / kernel).
`attention.EXPLICIT_MAX_KEYS_CPU` (64) is where the explicit path, and so the kernel, stops.

    .venv/bin/python benchmarks/probes/attention_keys.py [THREADS]
"""
import statistics as st
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import probe_header, threads_from_argv

from normlab import allocator
from normlab.model import native

allocator.keep_freed_memory()
threads_from_argv("attention_keys.py")
probe_header("attention_keys.py")
h, d = 4, 16


def contenders(t: int) -> tuple[int, dict]:
    """The batch for t keys, and the three attentions' forward and backward on it."""
    b = max(1, 2176 // t)
    g = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(b, h, t, d, generator=g).requires_grad_() for _ in range(3))
    scale = torch.full((h,), d ** -0.5)
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
    gz = torch.randn(b, h, t, d, generator=g)

    def kernel() -> None:
        torch.autograd.grad(native.attention(q, k, v, scale, mask), (q, k, v), gz)

    def sdpa() -> None:
        z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d ** -0.5)
        torch.autograd.grad(z, (q, k, v), gz)

    def explicit() -> None:
        z = native.torch_attention(q, k, v, scale, mask).transpose(1, 2)
        torch.autograd.grad(z, (q, k, v), gz)

    return b, {"kernel": kernel, "sdpa": sdpa, "explicit": explicit}


print("keys, batch: kernel ms; SDPA / kernel; explicit / kernel (time, median of 9 rounds)")
for t in (17, 32, 48, 64, 96, 128, 192, 256):
    b, fns = contenders(t)
    inner = max(1, int(2e6 // (b * h * t * t)))
    for f in fns.values():
        f()
    times: dict[str, list[float]] = {n: [] for n in fns}
    for r in range(9):
        for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
            t0 = time.perf_counter()
            for _ in range(inner):
                fns[name]()
            times[name].append((time.perf_counter() - t0) / inner)
    m = {n: st.median(v) for n, v in times.items()}
    print(f"  {t:3d} keys, batch {b:3d}: kernel {1e3 * m['kernel']:.3f} ms; SDPA "
          f"{m['sdpa'] / m['kernel']:.2f}x; explicit {m['explicit'] / m['kernel']:.2f}x")
