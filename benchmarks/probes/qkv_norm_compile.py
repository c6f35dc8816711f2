"""One-off probe behind the eighth session's notes in docs/performance.md; not part of make bench.

Would compiling only QKV-Norm's per-head LayerNorms (inductor's fused C++ kernels, the rest
of the model eager) close the gap between the `qkv` and `pre` training steps at d64?

1. The three per-head norms alone, forward + backward, on the default step's shapes
   ([2176, 4, 16] each): eager `F.layer_norm` against the same function under torch.compile.
2. The whole training step (bench_train_step's contenders, d64, one thread): `pre`, `qkv`,
   `qkv` with every `HeadNorm` module compiled (`module.compile()`), nanoGPT; alternating
   repeats, medians.

    .venv/bin/python benchmarks/probes/qkv_norm_compile.py
"""
import statistics as st
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_train_step import base_config, build_contender, model_config, real_batch  # noqa: E402

from normlab.model.attention import HeadNorm  # noqa: E402

torch.set_num_threads(1)
N, h, e = 2176, 4, 16
xs = [torch.randn(N, h, e, requires_grad=True) for _ in range(3)]
gains = [torch.ones(e, requires_grad=True) for _ in range(3)]
biases = [torch.zeros(e, requires_grad=True) for _ in range(3)]
grads = [torch.randn(N, h, e) for _ in range(3)]


def three(xs, gains, biases):
    return [F.layer_norm(x, (e,), g, b, 1e-5) for x, g, b in zip(xs, gains, biases)]


compiled = torch.compile(three)


def norms(f, n: int = 60) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        torch.autograd.backward(f(xs, gains, biases), grads)
        ts.append(time.perf_counter() - t0)
    return 1e6 * st.median(ts)


norms(compiled, 5)
for _ in range(3):
    print(f"three per-head norms, fwd+bwd: eager {norms(three):.0f} us, "
          f"compiled {norms(compiled):.0f} us")

run = base_config()
batch = real_batch(run)
steps = {}
for name, kind, placement, region in [("pre", "normlab", "pre", False),
                                       ("qkv", "normlab", "qkv", False),
                                       ("qkv, norms compiled", "normlab", "qkv", True),
                                       ("nanogpt", "nanogpt", "pre", False)]:
    model, step = build_contender(kind, model_config(run, 64, placement), run, batch)
    if region:
        for m in model.modules():
            if isinstance(m, HeadNorm):
                m.compile()
    step(), step()
    steps[name] = step
times = {k: [] for k in steps}
for _ in range(9):
    for k, step in steps.items():
        t0 = time.perf_counter()
        step(), step(), step()
        times[k].append((time.perf_counter() - t0) / 3)
ref = st.median(times["nanogpt"])
for k, v in times.items():
    print(f"step {k:20s} {1e3 * st.median(v):6.1f} ms  / nanogpt {st.median(v) / ref:.3f}")
