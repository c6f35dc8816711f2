"""One-off probe behind a number in docs/performance.md (twelfth session); not part of make bench.

ATen's CPU softmax over short last dims, as `attention.softmax_rows` pads them
(`SOFTMAX_MIN_KEYS_CPU`) against plain `softmax(-1)`: causal [N, 4, T, T] scores, ~1.2M
elements per call, forward and forward + backward, median of 30 (15) calls, T = 5..33:

    .venv/bin/python benchmarks/probes/softmax_rows.py [THREADS]
"""
import sys
import time

import torch

from normlab.model.attention import softmax_rows


def timed(fn, n: int) -> float:
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[n // 2]


torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
      f"{torch.backends.cpu.get_cpu_capability()}")


def row(T: int) -> str:
    N = max(1, int(1.2e6 / (4 * T * T)))
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    s = torch.randn(N, 4, T, T).masked_fill(~causal, float("-inf"))
    torch.testing.assert_close(softmax_rows(s), s.softmax(-1))
    x, g = s.clone().requires_grad_(), torch.randn_like(s)
    plain = timed(lambda: s.softmax(-1), 30)
    padded = timed(lambda: softmax_rows(s), 30)
    plain_fb = timed(lambda: torch.autograd.grad(x.softmax(-1), x, g), 15)
    padded_fb = timed(lambda: torch.autograd.grad(softmax_rows(x), x, g), 15)
    return (f"T={T:2d}: forward {1e9 * plain / s.numel():5.2f} ns/element plain, "
            f"{1e9 * padded / s.numel():5.2f} padded, plain/padded {plain / padded:5.2f}; "
            f"forward+backward plain/padded {plain_fb / padded_fb:5.2f}")


for T in range(5, 34):
    print(row(T), flush=True)
