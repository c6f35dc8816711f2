"""One-off probe behind a sixteenth-session note in docs/performance.md; not part of make bench.

Inside a real training step (bench_train_step's, d64, batch 128), what do the norms cost?

1. With the kernel used for every width (`MAX_GRAD_WIDTH` lifted), `qkv`: how long the kernel's
   calls take and how long its whole backward (the Python around the kernel: the copy of a
   strided incoming gradient, allocations), median µs per call over 10 steps, by row width
   (16: the head norms; 64: the block norms); and how the incoming gradients are laid out.
2. For `pre` and `qkv`, the norms' forward and backward per step (torch.profiler self time,
   ms, 10 steps, twice each): torch's kernels, the kernel as shipped (16-float rows only under
   autograd), and the kernel for every width. This is what sets `MAX_GRAD_WIDTH`.

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
from normlab.model import native

if len(sys.argv) > 2 or (len(sys.argv) == 2 and not sys.argv[1].isdigit()):
    sys.exit("usage: native_norm_in_step.py [THREADS]")
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
print(f"{torch.get_num_threads()} thread(s); kernel: {native.describe()}")
run = base_config()
batch = real_batch(run)
native.MAX_GRAD_WIDTH, shipped_width = 1 << 30, native.MAX_GRAD_WIDTH
lib = native.load()
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
    nl_rope = lib.nl_rope  # RoPE's kernel (seventeenth session), untimed here


backward = native._NormFn.backward


def timed_backward(ctx: Any, gy: torch.Tensor) -> Any:
    layouts[(tuple(gy.shape), gy.stride(), gy.is_contiguous())] += 1
    t0 = time.perf_counter()
    out = backward(ctx, gy)
    times[f"whole backward D={gy.shape[-1]}"].append(time.perf_counter() - t0)
    return out


step = build_contender("normlab", model_config(run, run.model.d_model, "qkv"), run, batch)[1]
for _ in range(3):
    step()
native._lib = TimedLib()  # type: ignore[assignment]
native._NormFn.backward = staticmethod(timed_backward)  # type: ignore[method-assign]
print("1. every width through the kernel, qkv:")
times.clear()
layouts.clear()
for _ in range(10):
    step()
for key, ts in sorted(times.items()):
    print(f"  {key:24s} {st.median(ts) * 1e6:7.1f} µs  ({len(ts) // 10} calls a step)")
print("incoming gradients (shape, stride, contiguous): calls a step")
for layout, n in sorted(layouts.items()):
    print(f"  {layout}: {n // 10}")
native._lib = lib
native._NormFn.backward = backward  # type: ignore[method-assign]

FORWARD = ("_NormFn", "aten::native_layer_norm", "aten::_fused_rms_norm")
BACKWARD = ("_NormFnBackward", "aten::native_layer_norm_backward",
            "aten::_fused_rms_norm_backward")
print("2. norms' self time per step, ms (forward / backward / sum), two profiles each:")
for placement in ("pre", "qkv"):
    step = build_contender("normlab", model_config(run, run.model.d_model, placement), run,
                           batch)[1]
    for mode, on, width in (("torch", False, shipped_width), ("as shipped", True, shipped_width),
                            ("every width", True, 1 << 30)):
        native.set_enabled(on, "norm")
        native.MAX_GRAD_WIDTH = width
        cells = []
        for _ in range(2):
            for _ in range(2):
                step()
            with torch.profiler.profile() as prof:
                for _ in range(10):
                    step()
            ev = prof.key_averages()
            fwd = sum(e.self_cpu_time_total for e in ev if e.key in FORWARD) / 10e3
            bwd = sum(e.self_cpu_time_total for e in ev if e.key in BACKWARD) / 10e3
            cells.append(f"{fwd:.2f} / {bwd:.2f} / {fwd + bwd:.2f}")
        print(f"  {placement:4s} {mode:12s} {cells[0]:20s} {cells[1]}")
native.set_enabled(True, "norm")
native.MAX_GRAD_WIDTH = shipped_width
