"""One-off probe behind a twenty-second-session note in docs/performance.md; not part of make
bench.

Does `torch.compile` take the Python and dispatch out of a cached decoding step? bench_decode's
n5d1 cell (a `pre` decoder of the quick-grid size, random weights, 256 prompts, 4 new tokens),
decoded greedily with and without the key/value cache: first eager (median of 11, after one
warm-up), then with the model's forward compiled (inductor, dynamic shapes, as a user would
write `model.forward = torch.compile(model.forward, dynamic=True)`; the first calls, which
compile, are timed apart). normlab's own CPU kernels step aside under compile, and the cache's
bookkeeping in `append_kv` breaks the graph; dynamo's graph and graph-break counts are printed.

    .venv/bin/python benchmarks/probes/decode_compile.py [THREADS]
"""
import statistics as st
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import N5d1Decoder, probe_header, threads_from_argv
from bench_train_step import base_config

from normlab import allocator

allocator.keep_freed_memory()
threads_from_argv("decode_compile.py")
probe_header("decode_compile.py")
cell = N5d1Decoder(base_config())


def median_ms(cached: bool, n: int = 11) -> float:
    cell.decode(cached)  # warm-up
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        cell.decode(cached)
        times.append(time.perf_counter() - t0)
    return 1e3 * st.median(times)


with torch.no_grad():
    eager = {c: median_ms(c) for c in (True, False)}
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = 64  # the growing cache gives many shapes
    cell.model.forward = torch.compile(cell.model.forward, dynamic=True)
    first = {}
    for c in (True, False):
        t0 = time.perf_counter()
        cell.decode(c)
        first[c] = time.perf_counter() - t0
    compiled = {c: median_ms(c) for c in (True, False)}
stats = torch._dynamo.utils.counters["stats"]
breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
print(f"n5d1, {len(cell.prompts)} prompts, {cell.max_new} new tokens; median ms of 11")
for name, t in (("eager", eager), ("compiled", compiled)):
    print(f"  {name:8s} cached {t[True]:6.1f}, uncached {t[False]:6.1f}, "
          f"speed-up {t[False] / t[True]:.2f}")
print(f"  compiled cached against eager uncached: {eager[False] / compiled[True]:.2f}")
print(f"  first compiled decodes (compiling): cached {first[True]:.1f} s, "
      f"uncached {first[False]:.1f} s")
print(f"  dynamo: {stats['unique_graphs']} graphs, {stats['calls_captured']} calls captured, "
      f"{breaks} graph breaks")
