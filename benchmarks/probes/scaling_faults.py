"""One-off probe behind a thirty-first-session note in docs/performance.md; not make bench.

Why do bench_scaling's largest training rows (the longest sequence and the largest batch) read
far above their FLOP count on one thread in some runs and not in others? The benchmark builds
every row's model and optimizer in one process and times their steps alternating. This probe
does the same for the training rows (glibc keeping freed memory, as the benchmarks run), with
one warm-up call a row as the benchmark had until it got its WARMUP_ROUNDS (thirty-first
session), then ROUNDS rounds (default 8), and prints each
row's median step time, then each round's step time and minor page faults (`getrusage`):
memory the heap had to fault in because no freed block in it fitted.

    .venv/bin/python benchmarks/probes/scaling_faults.py [THREADS] [ROUNDS]
"""
import gc
import resource
import statistics as st
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import probe_header

import bench_scaling
from normlab import allocator
from normlab.model import native

args = sys.argv[1:]
if len(args) > 2 or not all(a.isdecimal() and int(a) >= 1 for a in args):
    sys.exit("usage: scaling_faults.py [THREADS] [ROUNDS], both >= 1")
torch.set_num_threads(int(args[0]) if args else 1)
rounds = int(args[1]) if len(args) > 1 else 8
print(f"{torch.get_num_threads()} thread(s); kernels: {native.describe()}")
allocator.keep_freed_memory()
probe_header("scaling_faults.py")
steps = {name: bench_scaling.make_work("train", bench_scaling.shape("train", mult), 8)[0]
         for name, mult in bench_scaling.configs(False)}
for step in steps.values():  # one warm-up call a row, as the benchmark had
    step()
gc.collect()
gc.disable()  # as `common.paired_timing` times
times: dict[str, list[float]] = {name: [] for name in steps}
faults: dict[str, list[int]] = {name: [] for name in steps}
for r in range(rounds):
    for name, step in (list(steps.items()) if r % 2 == 0 else list(steps.items())[::-1]):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        step()
        times[name].append(time.perf_counter() - t0)
        faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
gc.enable()
print(f"training rows, one warm-up call each, then {rounds} alternating rounds: median ms; "
      "each round's ms (minor page faults)")
for name in steps:
    rows = ", ".join(f"{1e3 * t:.0f} ({f})" for t, f in zip(times[name], faults[name],
                                                            strict=True))
    print(f"  {name:16s} {1e3 * st.median(times[name]):7.1f} ms; {rows}")
