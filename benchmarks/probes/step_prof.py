"""One-off probe behind a number in docs/performance.md (third session); not part of make bench.

torch.profiler op table of one training step (forward + backward + AdamW) of normlab's `pre`
decoder and of the nanoGPT reference, d_model 64, the real quick-grid batch, one thread:

    .venv/bin/python benchmarks/probes/step_prof.py [pre|qkv|...] [THREADS]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_train_step import base_config, build_contender, model_config, real_batch  # noqa: E402

torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
placement = sys.argv[1] if len(sys.argv) > 1 else "pre"
run = base_config()
batch = real_batch(run)
for kind in ("normlab", "nanogpt"):
    cfg = model_config(run, 64, placement if kind == "normlab" else "pre")
    step = build_contender(kind, cfg, run, batch)[1]
    for _ in range(3):
        step()
    with torch.profiler.profile() as prof:
        for _ in range(5):
            step()
    ka = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in ka) / 5e3
    print(f"== {kind} ({placement if kind == 'normlab' else 'pre'}): {total:.1f} ms/step, "
          f"{sum(e.count for e in ka) // 5} ops/step")
    print(ka.table(sort_by="self_cpu_time_total", row_limit=22))
