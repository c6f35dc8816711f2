"""One-off probe behind the nineteenth session's fused QK-Norm + RoPE call (docs/performance.md);
not part of make bench.

1. One forward+backward of q's QK-Norm then RoPE on bench_train_step's batch shape
   ([128, 17, 4, 16], the gradient head-major as attention hands it back): the two kernel calls
   in turn against the one fused call (`native.norm(..., rope=...)`), µs per call.
2. bench_train_step's d64 step (`pre`, `qk`, `qkv`, and the nanoGPT reference), with the fused
   call switched off (`native.norm_rope_applies` answering no) and on, alternating the switch
   every round in one process, 12 rounds of 3 steps: ms per step and the ratio to nanoGPT's
   step of the same round, then `qk`'s and `qkv`'s off / on ratio (> 1: the fused call is
   faster) with its range. `pre` has no QK-Norm: the call changes nothing there.

    .venv/bin/python benchmarks/probes/norm_rope_fused.py [THREADS]
"""
import statistics as st
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import threads_from_argv

from bench_train_step import base_config, build_contender, model_config, real_batch
from normlab.model import native
from normlab.model.norms import Norm
from normlab.model.positions import Rotary

threads_from_argv("norm_rope_fused.py")
applies = native.norm_rope_applies


def fused(on: bool) -> None:
    native.norm_rope_applies = applies if on else (lambda *a: False)


torch.manual_seed(0)
norm = Norm(16)
rope = Rotary(16, 10000.0)(torch.arange(17).expand(128, 17))
x = torch.randn(128, 17, 4, 16, requires_grad=True)
gy = torch.randn(128, 4, 17, 16).transpose(1, 2)  # head-major, as attention's backward gives
per_call: dict[bool, list[float]] = {False: [], True: []}
for r in range(21):
    for on in (False, True) if r % 2 == 0 else (True, False):
        fused(on)
        t0 = time.perf_counter()
        for _ in range(50):
            norm.rotated(x, rope).backward(gy)
        per_call[on].append((time.perf_counter() - t0) / 50 * 1e6)
print(f"1. q's norm then RoPE, forward+backward: two calls {st.median(per_call[False]):.1f} µs, "
      f"one call {st.median(per_call[True]):.1f} µs (x.grad accumulates in both)")

run = base_config()
batch = real_batch(run)
steps = {p: build_contender("normlab", model_config(run, 64, p), run, batch)[1]
         for p in ("pre", "qk", "qkv")}
steps["nanogpt"] = build_contender("nanogpt", model_config(run, 64, "pre"), run, batch)[1]
for step in steps.values():
    step()
    step()
times: dict[tuple[str, bool], list[float]] = {(k, on): [] for k in steps for on in (False, True)}
for r in range(12):
    for on in (False, True) if r % 2 == 0 else (True, False):
        fused(on)
        for k, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(3):
                step()
            times[(k, on)].append((time.perf_counter() - t0) / 3 * 1e3)
fused(True)
print("2. training step, ms (ratio to nanoGPT's step in the same round), median of 12 rounds:")
for on in (False, True):
    ref = times[("nanogpt", on)]
    cells = [f"{k} {st.median(times[(k, on)]):.2f} "
             f"({st.median([a / b for a, b in zip(times[(k, on)], ref, strict=True)]):.3f})"
             for k in steps]
    print(f"  {'one call ' if on else 'two calls'}: " + ", ".join(cells))
for k in ("qk", "qkv"):
    r = [a / b for a, b in zip(times[(k, False)], times[(k, True)], strict=True)]
    print(f"  {k}: two calls / one call {st.median(r):.3f} [{min(r):.3f}, {max(r):.3f}]")
