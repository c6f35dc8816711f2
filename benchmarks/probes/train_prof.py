"""One-off probe behind a fourteenth-session number in docs/performance.md; not part of make bench.

Profiles five training steps (after five warm-up steps) of one bench_train_step contender on
the benchmark's batch and prints the operators with the most self CPU time, per step. Runs on
import, so `embedding_backward.py index|embedding train_prof ...` profiles either lookup:

    .venv/bin/python benchmarks/probes/train_prof.py none|post|pre|qk|qkv|nanogpt [THREADS]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_train_step import PLACEMENTS, base_config, build_contender, model_config, real_batch

USAGE = "usage: train_prof.py none|post|pre|qk|qkv|nanogpt [THREADS]"
if len(sys.argv) < 2 or sys.argv[1] not in (*PLACEMENTS, "nanogpt") or (
        len(sys.argv) > 2 and not sys.argv[2].isdigit()):
    sys.exit(USAGE)
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
run = base_config()
batch = real_batch(run)
kind = "nanogpt" if sys.argv[1] == "nanogpt" else "normlab"
placement = "pre" if kind == "nanogpt" else sys.argv[1]
_, step = build_contender(kind, model_config(run, run.model.d_model, placement), run, batch)
for _ in range(5):
    step()
with torch.profiler.profile() as prof:
    for _ in range(5):
        step()
events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
total = sum(e.self_cpu_time_total for e in events)
print(f"{sys.argv[1]}, {torch.get_num_threads()} thread(s), d_model {run.model.d_model}: "
      f"profiled self CPU {total / 5e3:.1f} ms per step")
for e in events[:15]:
    print(f"  {e.key:45s} {e.self_cpu_time_total / 5e3:7.2f} ms/step  {e.count / 5:5.0f} calls/step"
          f"  {e.self_cpu_time_total / max(e.count, 1) / 1e3:7.3f} ms/call")
