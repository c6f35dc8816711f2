"""One-off probe behind a twenty-third-session note in docs/performance.md; not part of make
bench.

The collapse sweep scales q and k at `hook_q`/`hook_k`, after QK-Norm and before RoPE. A hook
there makes the model normalise and rotate in two kernel calls, writing q and k in the
token-major layout between them (`Attention._project`). RoPE rotates within each head, so a
factor per position (and head) commutes with it: scaling at `hook_rot_q`/`hook_rot_k` instead
is the same perturbation up to rounding, and leaves the one fused call. Would it speed the
sweep up? bench_collapse's set-up (`qkv`, RoPE, random weights, 64 examples, 16 draws), the
sweep's `sweep_seconds` with the hooks where they are and moved, alternating in one process,
median of 11 rounds; and how many flips each counts.

    .venv/bin/python benchmarks/probes/collapse_rot_hooks.py [THREADS]
"""
import statistics as st
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import Sweep, probe_header, threads_from_argv

from normlab import allocator
from normlab.analysis import collapse

allocator.keep_freed_memory()
threads_from_argv("collapse_rot_hooks.py")
probe_header("collapse sweep: q, k scaled before / after RoPE")
hooks = collapse.Perturbation.hooks


def moved(self, tables):  # the same functions, attached after the rotation
    return [(name.replace(".hook_q", ".hook_rot_q").replace(".hook_k", ".hook_rot_k"), fn)
            for name, fn in hooks(self, tables)]


sweep = Sweep()
times: dict = {False: [], True: []}
flips = {}
for r in range(13):
    for after in (False, True) if r % 2 == 0 else (True, False):
        collapse.Perturbation.hooks = moved if after else hooks
        res = sweep.vectorised()
        if r >= 2:  # two rounds of warm-up
            times[after].append(res["sweep_seconds"])
        flips[after] = float(res["rows"]["rate"].sum()) * 16
collapse.Perturbation.hooks = hooks
off, on = (1e3 * st.median(times[b]) for b in (False, True))
print(f"sweep_seconds: before RoPE {off:.2f} ms, after RoPE {on:.2f} ms, after / before "
      f"{on / off:.3f}; flips {flips[False]:.0f} / {flips[True]:.0f}")
