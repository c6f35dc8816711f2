"""One-off probe behind a twenty-fifth-session note in docs/performance.md; not part of make
bench.

The collapse sweep's noise written into q, k and v in place (`collapse._scale_hook`, where
`_may_overwrite` allows it) against a new tensor per call, switched off and on, alternating
in one process (15 rounds), for both of bench_collapse's contenders: `measure_collapse`
(its `sweep_seconds`) and the naive loop (`naive_sweep(in_place=...)`). The flips are
checked equal both ways.

    .venv/bin/python benchmarks/probes/sweep_noise_in_place.py [THREADS]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import Sweep, ab, probe_header, threads_from_argv
from bench_collapse import SIGMA, naive_sweep

import normlab.analysis.collapse as collapse
from normlab import allocator

allocator.keep_freed_memory()
threads_from_argv("sweep_noise_in_place.py")
probe_header("collapse sweep: the noise in place or into a new tensor, A/B")
ALLOWED = collapse._may_overwrite
s = Sweep()
state = {"on": True}
flips: dict = {}


def switch(on: bool) -> None:
    state["on"] = on
    collapse._may_overwrite = ALLOWED if on else (lambda *args: False)


def vectorised() -> float:
    out = s.vectorised()
    flips[("sweep", state["on"])] = out["rows"]["rate"]
    return out["sweep_seconds"]


def naive() -> None:
    flips[("naive", state["on"])] = naive_sweep(s.model, s.data, s.rows, s.pert, SIGMA, 16,
                                                s.chunk, in_place=state["on"])


sweep_times: dict = {False: [], True: []}


def timed_sweep() -> None:
    t = vectorised()
    sweep_times[state["on"]].append(t)


names = ("new tensor", "in place")
ab("measure_collapse (call)", switch, timed_sweep, 1, rounds=15, names=names)
ratios = [a / b for a, b in zip(sweep_times[False], sweep_times[True], strict=True)]
ratios.sort()
print(f"  measure_collapse sweep_seconds: new tensor / in place median "
      f"{ratios[len(ratios) // 2]:.3f} [{ratios[0]:.3f}, {ratios[-1]:.3f}]")
ab("naive loop", switch, naive, 1, rounds=15, names=names)
switch(True)
for who in ("sweep", "naive"):
    assert torch.equal(flips[(who, False)], flips[(who, True)]), who
print("  flips equal both ways, for both contenders")
