"""One-off probe behind a twentieth-session note in docs/performance.md; not part of make bench.

Until the twentieth session the benchmarks' timing (`common.paired_timing`) ran `gc.collect()`
before every timed call, so that a collection would not land inside one (it now turns the
collector off while it times, as `timeit` does). In bench_decode's process the collector walks
~170,000 objects (the eval sets' questions among them) for tens of ms, and the call after it
starts with cold caches. This probe times bench_decode's n5d1 decodes (`pre`, 256 questions,
memory kept as the benchmarks keep it) with and without a `gc.collect()` just before, all
four interleaved, 35 rounds after 5:

    .venv/bin/python benchmarks/probes/decode_gc.py [THREADS]
"""
import gc
import statistics as st
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import N5d1Decoder, probe_header, threads_from_argv
from bench_train_step import base_config

from normlab import allocator
from normlab.tasks.addition import eval_sets

allocator.keep_freed_memory()
threads_from_argv("decode_gc.py")
probe_header("decode_gc.py")
run = base_config()
sets = eval_sets(run.validate())  # held, as bench_decode holds them
decode = N5d1Decoder(run).decode


times: dict[tuple[bool, bool], list[float]] = {}
collect: list[float] = []
for r in range(40):
    for cached in (True, False):
        for gc_first in (False, True):
            if gc_first:
                t0 = time.perf_counter()
                gc.collect()
                collect.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            decode(cached)
            if r >= 5:
                times.setdefault((cached, gc_first), []).append(time.perf_counter() - t0)
ms = {k: 1e3 * st.median(v) for k, v in times.items()}
print(f"gc.collect() {1e3 * st.median(collect):.1f} ms over {len(gc.get_objects())} objects; "
      "median ms of 35 decodes:")
for gc_first in (False, True):
    label = "after gc.collect()" if gc_first else "no gc.collect()   "
    print(f"  {label} cached {ms[True, gc_first]:.1f}, uncached {ms[False, gc_first]:.1f}, "
          f"speed-up {ms[False, gc_first] / ms[True, gc_first]:.2f}")
