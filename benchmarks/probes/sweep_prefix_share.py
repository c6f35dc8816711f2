"""One-off probe behind a twenty-fifth-session note in docs/performance.md; not part of make
bench.

How much of the collapse sweep's perturbed forwards is layer 0 up to its noise hooks
(embedding, norms, q/k/v projections): work identical in every noise copy.

    .venv/bin/python benchmarks/probes/sweep_prefix_share.py [THREADS]
"""
import statistics as st
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import Sweep, probe_header, threads_from_argv

from normlab import allocator
from normlab.analysis.data import chunk_copies, collect, sweep_groups

allocator.keep_freed_memory()
threads_from_argv("sweep_prefix_share.py")
probe_header("collapse sweep: layer 0's prefix share")
s = Sweep()
groups = sweep_groups(s.data, 1 << 13, 16)
parts = [(s.data.subset(g), chunk_copies(s.data.subset(g), 1 << 13, 16)) for g in groups]
last = max(s.rows.sites, key=lambda n: int(n.split(".")[1]))
full_take = {f"{last}.hook_pattern": lambda x: x[:1]}
prefix_take = {"blocks.0.attn.hook_v": lambda x: x[:1]}


def run(take, copies_scale=1):
    t0 = time.perf_counter()
    for part, c in parts:
        for done in range(0, 16, c):
            n = min(c, 16 - done)
            collect(s.model, part, take, copies=max(1, n // copies_scale))
    return time.perf_counter() - t0


for _ in range(2):
    run(full_take), run(prefix_take)
full, pre, once = [], [], []
for _ in range(9):
    full.append(run(full_take))
    pre.append(run(prefix_take))
    once.append(run(prefix_take, copies_scale=1000))
f, p, o = st.median(full), st.median(pre), st.median(once)
print(f"groups {[len(g) for g in groups]}, copies {[c for _, c in parts]}")
print(f"forwards to {last}.hook_pattern: {f*1e3:.1f} ms; to blocks.0.attn.hook_v: {p*1e3:.1f} "
      f"ms ({100*p/f:.1f}%); the prefix once per group: {o*1e3:.1f} ms; saving "
      f"{100*(p-o)/f:.1f}%")
