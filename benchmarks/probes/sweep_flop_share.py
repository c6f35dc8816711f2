"""One-off probe behind a twenty-third-session note in docs/performance.md; not part of make
bench.

bench_scaling counts a sweep's FLOPs as whole forwards, while `measure_collapse` stops each
forward after the last attention pattern (`analysis.data.collect`). How much of the count runs?
For each collapse row of bench_scaling whose rows stay at or below 64 keys (the explicit
attention path, whose matmuls torch's FLOP counter sees; the x4 rows past it run SDPA, which it
does not), the matmul FLOPs `torch.utils.flop_counter` records during one sweep, over
`bench_scaling.flops`. One thread, random weights, seeded as bench_scaling builds them.

    .venv/bin/python benchmarks/probes/sweep_flop_share.py
"""
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_scaling as S
from abtime import probe_header

torch.set_num_threads(1)
probe_header("sweep: executed matmul FLOPs over bench_scaling's count")
N_DRAWS = 8  # bench_scaling's full runs
for name, mult in S.configs(quick=False):
    s = S.shape("collapse", mult)
    work, n_mm, widths = S.make_work("collapse", s, N_DRAWS)
    if max(t for _, t in widths) > 64:
        print(f"  {name:16s} skipped: rows past 64 keys run SDPA, which the counter misses")
        continue
    with FlopCounterMode(display=False) as counter:
        work()
    counted = S.flops("collapse", widths, s["d_model"], n_mm, N_DRAWS)
    print(f"  {name:16s} executed / counted {counter.get_total_flops() / counted:.3f}")
