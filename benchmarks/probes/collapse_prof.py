"""One-off probe behind a number in docs/performance.md (third session); not part of make bench.

Profiles the perturbed forwards of `measure_collapse` on the bench_collapse setup (qkv, random
weights, init_std 0.2, 64 examples, 16 draws, sigma 0.3, one thread):

    .venv/bin/python benchmarks/probes/collapse_prof.py [--table]
"""
import statistics as st
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_collapse import eval_data, random_model  # noqa: E402

from normlab.analysis.collapse import measure_collapse  # noqa: E402

torch.set_num_threads(1)
run, model = random_model()
model.eval()
data = eval_data(run, 64)


def sweep(max_tokens: int = 1 << 15) -> float:
    res = measure_collapse(model, data, sigmas=[0.3], n_draws=16, threshold=0.9, theory_draws=1,
                           max_tokens=max_tokens)
    return res["sweep_seconds"]


sweep()
for mt in (1 << 15, 1 << 13, 1 << 12, 1 << 11):
    times, calls = [], []
    for _ in range(7):
        t0 = time.perf_counter()
        times.append(sweep(mt))
        calls.append(time.perf_counter() - t0)
    print(f"max_tokens {mt}: sweep {1e3 * st.median(times):.1f} ms, "
          f"call {1e3 * st.median(calls):.1f} ms")
if "--table" in sys.argv:
    with torch.profiler.profile() as prof:
        sweep()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
