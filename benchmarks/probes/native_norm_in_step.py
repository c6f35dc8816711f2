"""One-off probe behind a sixteenth-session note in docs/performance.md; not part of make bench.

Inside a real training step (bench_train_step's `qkv`, d64, batch 128), how long do the native
norm kernel's calls take, and how long its whole backward (the Python around the kernel: the
copy of a strided incoming gradient, allocations)? Median µs per call over 10 steps, by row
width (16: the head norms; 64: the block norms). Also how the incoming gradients are laid out.

    .venv/bin/python benchmarks/probes/native_norm_in_step.py [THREADS]
"""
import statistics as st
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_train_step import base_config, build_contender, model_config, real_batch
from normlab.model import native_norm

if len(sys.argv) > 2 or (len(sys.argv) == 2 and not sys.argv[1].isdigit()):
    sys.exit("usage: native_norm_in_step.py [THREADS]")
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
print(f"{torch.get_num_threads()} thread(s); kernel: {native_norm.describe()}")
run = base_config()
lib = native_norm.load()
assert lib is not None, "no kernel built"
times: dict[str, list[float]] = defaultdict(list)
layouts: Counter = Counter()


class Timed:
    """Stands in for the loaded library: times each kernel call by its row width."""

    def __init__(self, name: str, width_arg: int) -> None:
        self.fn, self.name, self.width_arg = getattr(lib, name), name, width_arg

    def __call__(self, *args: Any) -> None:
        t0 = time.perf_counter()
        self.fn(*args)
        times[f"{self.name} D={args[self.width_arg]}"].append(time.perf_counter() - t0)


class TimedLib:
    nl_norm_fwd = Timed("nl_norm_fwd", 7)
    nl_norm_bwd = Timed("nl_norm_bwd", 9)


backward = native_norm._NormFn.backward


def timed_backward(ctx: Any, gy: torch.Tensor) -> Any:
    layouts[(tuple(gy.shape), gy.stride(), gy.is_contiguous())] += 1
    t0 = time.perf_counter()
    out = backward(ctx, gy)
    times[f"whole backward D={gy.shape[-1]}"].append(time.perf_counter() - t0)
    return out


step = build_contender("normlab", model_config(run, run.model.d_model, "qkv"), run,
                       real_batch(run))[1]
for _ in range(3):
    step()
native_norm._lib = TimedLib()  # type: ignore[assignment]
native_norm._NormFn.backward = staticmethod(timed_backward)  # type: ignore[method-assign]
times.clear()
layouts.clear()
for _ in range(10):
    step()
for key, ts in sorted(times.items()):
    print(f"  {key:24s} {st.median(ts) * 1e6:7.1f} µs  ({len(ts) // 10} calls a step)")
print("incoming gradients (shape, stride, contiguous): calls a step")
for layout, n in sorted(layouts.items()):
    print(f"  {layout}: {n // 10}")
