"""One-off probe behind a twenty-first-session note in docs/performance.md; not part of make bench.

Where a cached decoding step's attention time goes. bench_decode's n5d1 cell (`pre`, 256
questions, 4 new tokens, memory kept as the benchmarks keep it) decodes with the cache, 20
times after 5, with `native.attend` timed at each of its calls (3 steps x 4 layers a decode).
The last step's attention is then called again on the same tensors: over and over (its keys
and values hot in the caches), and after writing 4, 16 and 64 MB elsewhere (so that they come
from further away); and reading those keys and values alone (`k.sum(); v.sum()`) after the same
writes gives the rate memory delivers them at, cold:

    .venv/bin/python benchmarks/probes/decode_memory.py [THREADS]
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
from normlab.model import native

allocator.keep_freed_memory()
threads_from_argv("decode_memory.py")
probe_header("decode_memory.py")
cell = N5d1Decoder(base_config())

calls: list[tuple[float, tuple]] = []
attend = native.attend


def timed_attend(*args: torch.Tensor) -> torch.Tensor:
    t0 = time.perf_counter()
    z = attend(*args)
    calls.append((time.perf_counter() - t0, args))
    return z


native.attend = timed_attend  # Attention looks it up on the module at every call
for i in range(25):
    if i == 5:
        calls.clear()
    cell.decode(True)
native.attend = attend
per_decode = 3 * len(cell.model.blocks)
assert len(calls) == 20 * per_decode, len(calls)
by_call = [st.median(calls[j][0] for j in range(c, len(calls), per_decode)) * 1e6
           for c in range(per_decode)]
q, k, v, scale, mask = calls[-1][1]
bytes_kv = 2 * k.numel() * k.element_size()  # the filled positions, keys and values


def median_us(fn, before=None, n: int = 60) -> float:
    ts = []
    for _ in range(n):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e6 * st.median(ts[10:])


print(f"n5d1, batch {q.shape[0]}, {q.shape[1]} heads, d_head {q.shape[3]}; the last step reads "
      f"{k.shape[2]} positions: {bytes_kv / 2**20:.2f} MiB of keys and values a layer")
print("  native.attend in the decodes, median us a call, step by step (rows) and layer by "
      "layer (columns):")
for s in range(3):
    print("    " + "  ".join(f"{t:6.1f}" for t in by_call[s * len(cell.model.blocks):]
                              [: len(cell.model.blocks)]))
print(f"  the last step's call again, hot: {median_us(lambda: attend(q, k, v, scale, mask)):.1f}")
for mb in (4, 16, 64):
    junk = torch.zeros(mb * 2**18)  # mb MiB of float32

    def evict(junk: torch.Tensor = junk) -> None:
        junk.add_(1.0)

    us = median_us(lambda: attend(q, k, v, scale, mask), evict)
    read = median_us(lambda: (k.sum(), v.sum()), evict)
    print(f"  after writing {mb:2d} MiB elsewhere: the call {us:6.1f}; reading its keys and "
          f"values alone {read:6.1f} ({bytes_kv / read / 1e3:.1f} GB/s)")
