"""One-off probe behind a number in docs/performance.md (third session); not part of make bench.

What the digit-position table (`n_aux_positions`) costs in a training step, side by side with
the nanoGPT reference (which has no such table), at d_model 64, one thread:

    .venv/bin/python benchmarks/probes/aux_cost.py
"""
import copy
import statistics as st
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_train_step import base_config, build_contender, model_config, real_batch  # noqa: E402
from common import paired_timing  # noqa: E402

torch.set_num_threads(1)
run = base_config()
batch = real_batch(run)
steps = {}
for p in ("pre", "qkv"):
    cfg = model_config(run, 64, p)
    steps[f"{p}+aux"] = build_contender("normlab", cfg, run, batch)[1]
    cfg0 = copy.deepcopy(cfg)
    cfg0.n_aux_positions = 0
    steps[f"{p}"] = build_contender("normlab", cfg0, run, batch)[1]
steps["nanogpt"] = build_contender("nanogpt", model_config(run, 64, "pre"), run, batch)[1]
times = paired_timing(steps, repeats=9, inner=3, warmup=1)
ref = times["nanogpt"]
for name, ts in times.items():
    r = st.median(a / b for a, b in zip(ts, ref, strict=True))
    print(f"{name:10s} {1e3 * st.median(ts):7.1f} ms/step  /nanogpt {r:.3f}")
