"""One-off probe behind a seventeenth-session number in docs/performance.md; not part of make
bench.

The layout copies (and other elementwise ops) in one training step of bench_train_step's
normlab decoder (d64, batch 128), by input shape: torch.profiler self time per step, 5 steps.
Attention reads q, k, v head-major ([batch, head, pos, d_head]) and the projections write them
token-major, so each change of layout is a `copy_`:

    .venv/bin/python benchmarks/probes/step_copies.py [PLACEMENT] [THREADS]

Run it with NORMLAB_NATIVE_ROPE=0 and without to see what the RoPE kernel's head-major output
saves.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_train_step import base_config, build_contender, model_config, real_batch
from normlab.model import native

OPS = ("aten::copy_", "aten::clone", "aten::cat", "aten::add_", "aten::add", "aten::mul",
       "aten::fill_", "aten::zero_")
placement = sys.argv[1] if len(sys.argv) > 1 else "qkv"
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
run = base_config()
step = build_contender("normlab", model_config(run, 64, placement), run, real_batch(run))[1]
for _ in range(3):
    step()
with torch.profiler.profile(record_shapes=True) as prof:
    for _ in range(5):
        step()
ka = prof.key_averages(group_by_input_shape=True)
total = sum(e.self_cpu_time_total for e in ka)
print(f"{placement}, {torch.get_num_threads()} thread(s), kernels: {native.describe()}; "
      f"profiled {total / 5e3:.1f} ms a step")
copies = [e for e in ka if e.key == "aten::copy_"]
print(f"all copy_: {sum(e.self_cpu_time_total for e in copies) / 5e3:.2f} ms, "
      f"{sum(e.count for e in copies) / 5:.0f} calls a step")
for e in sorted(ka, key=lambda e: -e.self_cpu_time_total):
    if e.key in OPS and e.self_cpu_time_total > 0.002 * total:
        print(f"  {e.key:12s} {e.self_cpu_time_total / 5e3:6.3f} ms {e.count / 5:5.1f} calls  "
              f"{str(e.input_shapes)[:100]}")
