"""One-off probe behind a fourteenth-session note in docs/performance.md; not part of make bench.

A key/value cache allocated once at the decode's full length (prompt + new tokens) and
written in place, against the committed cache that concatenates at every step (the tenth
session's buffer doubled when full; this one knows its length). Needs
`benchmarks/probes/kv_capacity.patch` applied (`git apply`; `git checkout
src/normlab/model/attention.py` afterwards), which adds the buffer behind the switch
`attention.KV_CAPACITY`; both run in one process, alternating per repeat, with the uncached
decode as the reference, on one of bench_decode's cells (random weights, the cell's 256 eval
questions in one batch, forced to max_new):

    .venv/bin/python benchmarks/probes/kv_capacity.py pre|qkv n5d1|n2d3 [THREADS] [ROUNDS]
"""
import statistics as st
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_train_step import base_config, model_config
from normlab import build_model
from normlab.model import attention
from normlab.model.generate import greedy_decode
from normlab.tasks.addition import (
    aux_positions,
    eval_sets,
    make_prompts,
    max_lengths,
    next_aux_position,
)

USAGE = "usage: kv_capacity.py pre|qkv n5d1|n2d3 [THREADS] [ROUNDS]"
if not hasattr(attention, "KV_CAPACITY"):
    sys.exit("kv_capacity.py: apply benchmarks/probes/kv_capacity.patch first (see the docstring)")
if len(sys.argv) < 3 or sys.argv[1] not in ("pre", "qkv") or not all(
        a.isdigit() and int(a) > 0 for a in sys.argv[3:5]):
    sys.exit(USAGE)
placement, cell_name = sys.argv[1], sys.argv[2]
threads = int(sys.argv[3]) if len(sys.argv) > 3 else 1
rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 15
torch.set_num_threads(threads)
run = base_config()
sets = eval_sets(run.validate())
cells = {c.label: c for c in sets["extrapolation"]}
if cell_name not in cells:
    sys.exit(f"kv_capacity.py: unknown cell {cell_name!r}; expected one of {', '.join(cells)}")
cell = cells[cell_name]
prompts = make_prompts([q for q, _ in sets["extrapolation"][cell][:256]], "decoder")
max_new = max_lengths([cell])[1] + 1
capacity = max(len(p) for p in prompts) + max_new
torch.manual_seed(0)
model = build_model(model_config(run, run.model.d_model, placement)).eval()


def decode(cached: bool) -> list[list[int]]:
    return greedy_decode(model, prompts, max_new=max_new, eos=-1, aux_fn=aux_positions,
                         aux_next=next_aux_position, use_cache=cached)


times: dict[str, list[float]] = {"cat": [], "buffer": [], "uncached": []}
outs = {}
for _ in range(rounds):
    for mode, cap in (("cat", 0), ("buffer", capacity)):
        attention.KV_CAPACITY[0] = cap
        t0 = time.perf_counter()
        outs[mode] = decode(True)
        times[mode].append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    outs["uncached"] = decode(False)
    times["uncached"].append(time.perf_counter() - t0)
ref = st.median(times["uncached"])
print(f"{placement} {cell_name}, {torch.get_num_threads()} thread(s), {rounds} rounds, "
      f"batch {len(prompts)}, capacity {capacity}; median ms (uncached / this):")
for mode, ts in times.items():
    same = outs[mode] == outs["uncached"]
    print(f"  {mode:8s} {1e3 * st.median(ts):7.2f} ms  {ref / st.median(ts):5.2f}x  "
          f"same tokens as uncached: {same}")
