"""One-off probe behind a twenty-first-session note in docs/performance.md; not part of make bench.

`native.attend` (one query a row, as in a decoding step) on keys and values that are not in the
caches: before every timed call 16 or 64 MiB are written elsewhere, so that they come from the
last-level cache or from memory. Shapes from decoding n5d1 (d_head 16, 19 keys, batch 256) to
longer rows and wider heads; keys and values are views of buffers one position longer, as the
decoding cache's are. Median us of 45 calls after 5; run it with and without
`attn_prefetch.patch` to compare:

    .venv/bin/python benchmarks/probes/attend_cold.py [THREADS]
"""
import statistics as st
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import probe_header, threads_from_argv

from normlab import allocator
from normlab.model import native

allocator.keep_freed_memory()  # as the benchmarks run
threads_from_argv("attend_cold.py")
probe_header("attend_cold.py")
SHAPES = ((16, 19, 256), (16, 64, 256), (16, 128, 64), (16, 512, 64), (64, 19, 256),
          (64, 64, 256), (32, 256, 64))  # (d_head, keys, batch); 4 heads
torch.manual_seed(0)
for mb in (16, 64):
    junk = torch.zeros(mb * 2**18)  # mb MiB of float32
    cells = []
    for d, t, b in SHAPES:
        q = torch.randn(b, 4, 1, d)
        k, v = (torch.randn(b, 4, t + 1, d)[:, :, :t] for _ in range(2))
        scale, mask = torch.full((4,), d**-0.5), torch.ones(b, 1, 1, t, dtype=torch.bool)
        ts = []
        for _ in range(50):
            junk.add_(1.0)
            t0 = time.perf_counter()
            native.attend(q, k, v, scale, mask)
            ts.append(time.perf_counter() - t0)
        cells.append(f"d{d} T{t} B{b} {1e6 * st.median(ts[5:]):.0f}")
    print(f"after writing {mb} MiB: " + " | ".join(cells))
