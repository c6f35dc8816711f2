"""One-off probe behind a twenty-ninth-session note in docs/performance.md; not make bench.

MFU counts a training step's matmuls against the same machine's large-matmul peak. This probe
asks how fast one of those matmuls runs inside the step and alone: the MLP's input projection
(`x @ W_in`, [128, 17, 64] @ [64, 256], in `native._LinearGeluFn.forward`) of bench_train_step's
`pre` step on its batch (d64), timed around that one call in 20 steps (80 calls: 4 layers),
and then alone on the last step's own x and W_in, 80 times in a row: the same call (its output
allocated, as in the step), the call into one output buffer (`torch.mm(..., out=)`: x, W_in
and the output in cache), and that call cycling through 24 copies of x and of the output
buffer (66 MB, twice the L3, so neither stays in cache between calls). The last two differ
only in where their data are. Medians in microseconds; the step's time beside them. Garbage collector off, glibc keeping freed memory, as the benchmarks run.

    .venv/bin/python benchmarks/probes/step_matmul_context.py [THREADS]
"""
import gc
import statistics as st
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import probe_header, threads_from_argv

from bench_train_step import base_config, build_contender, model_config, real_batch
from normlab import allocator
from normlab.model import native

allocator.keep_freed_memory()
threads_from_argv("step_matmul_context.py")
probe_header("step_matmul_context.py")
in_step: list[float] = []
seen: list[tuple[torch.Tensor, torch.Tensor]] = []
forward = native._LinearGeluFn.forward


def timed_forward(ctx: object, x: torch.Tensor, w: torch.Tensor,
                  b: torch.Tensor | None) -> torch.Tensor:
    """The Function's forward with its one matmul, `x @ w`, timed."""
    matmul = torch.Tensor.__matmul__

    def timed(a: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        out = matmul(a, m)
        in_step.append(time.perf_counter() - t0)
        seen[:] = [(a, m)]
        return out

    torch.Tensor.__matmul__ = timed  # type: ignore[method-assign]
    try:
        return forward(ctx, x, w, b)
    finally:
        torch.Tensor.__matmul__ = matmul  # type: ignore[method-assign]


native._LinearGeluFn.forward = staticmethod(timed_forward)  # type: ignore[method-assign]
run = base_config()
batch = real_batch(run)
_, step = build_contender("normlab", model_config(run, 64, "pre"), run, batch)
for _ in range(5):
    step()
gc.disable()
in_step.clear()
t0 = time.perf_counter()
for _ in range(20):
    step()
step_ms = (time.perf_counter() - t0) / 20 * 1e3
x, w = (t.detach() for t in seen[0])
xs = [x.reshape(-1, x.shape[-1]).clone() for _ in range(24)]
outs = [torch.zeros(xs[0].shape[0], w.shape[1]) for _ in range(24)]
calls = {"alone": lambda i: x @ w,
         "alone, out=": lambda i: torch.mm(xs[0], w, out=outs[0]),
         "alone, out=, cycling 66 MB": lambda i: torch.mm(xs[i % 24], w, out=outs[i % 24])}
alone: dict[str, list[float]] = {}
for name, call in calls.items():
    alone[name] = []
    for i in range(80):
        t0 = time.perf_counter()
        call(i)
        alone[name].append(time.perf_counter() - t0)
gc.enable()
print(f"x {tuple(x.shape)} @ W_in {tuple(w.shape)}, median us: in the step "
      f"{1e6 * st.median(in_step):.0f} ({len(in_step)} calls), "
      + ", ".join(f"{name} {1e6 * st.median(t):.0f}" for name, t in alone.items())
      + f"; the step {step_ms:.2f} ms")
