"""One-off probe behind a twenty-first-session note in docs/performance.md; not part of make bench.

The benchmarks time with Python's garbage collector off (`common.paired_timing`, since the
twentieth session), so a contender that left reference cycles behind would not pay for their
collection inside its timed calls. This probe runs every benchmark of `make bench` in its
`--quick` form, one thread, with `paired_timing` wrapped: after each timed call (the collector
off), `gc.collect()` says how many unreachable objects the call left, garbage that a collection
would have had to find (so the times here are not the benchmarks'). Prints one line a
contender; nothing is written:

    .venv/bin/python benchmarks/probes/gc_cycles.py
"""
import argparse
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402  (patched before the benchmarks import paired_timing from it)

timing = common.paired_timing
found: dict[tuple[str, str], list[int]] = {}
current = ["?"]


def checked(contenders, **kw):
    """`paired_timing`, each call in its timed loop (collector off) followed by a collection
    whose count of unreachable objects is that call's cyclic garbage."""
    def counted(name, fn):
        def call():
            out = fn()
            if not gc.isenabled():  # a timed call, not a warm-up
                found.setdefault((current[0], name), []).append(gc.collect())
            return out
        return call
    return timing({name: counted(name, fn) for name, fn in contenders.items()}, **kw)


common.paired_timing = checked
import bench_collapse  # noqa: E402
import bench_decode  # noqa: E402
import bench_hooks  # noqa: E402
import bench_mfu  # noqa: E402
import bench_packing  # noqa: E402
import bench_scaling  # noqa: E402
import bench_train_step  # noqa: E402
from abtime import probe_header  # noqa: E402

for module in (bench_collapse, bench_decode, bench_hooks, bench_mfu, bench_packing,
               bench_scaling, bench_train_step):
    module.paired_timing = checked  # each did `from common import paired_timing`

common.setup_threads(1)
probe_header("gc_cycles.py")
args = argparse.Namespace(quick=True, threads=1, repeats=None, run=None, widths=None)
for module in (bench_train_step, bench_mfu, bench_decode, bench_collapse, bench_scaling,
               bench_hooks, bench_packing):
    current[0] = module.__name__
    module.run(args)
print("unreachable objects a call, left with the collector off (0: no cyclic garbage):")
for (bench, name), counts in found.items():
    print(f"  {bench:18s} {name:28s} {max(counts)} at most, in {len(counts)} calls: {counts[:8]}")
