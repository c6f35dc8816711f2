"""One-off probe behind a number in docs/performance.md (third session); not part of make bench.

Times and profiles cached greedy decoding on the bench_decode n=5 d=1 cell (pre, random
weights, 256 questions, forced to max_new tokens, one thread):

    .venv/bin/python benchmarks/probes/decode_prof.py [--table]
"""
import statistics as st
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_train_step import base_config, model_config  # noqa: E402

from normlab import build_model  # noqa: E402
from normlab.model.generate import greedy_decode  # noqa: E402
from normlab.tasks.addition import (  # noqa: E402
    aux_positions,
    eval_sets,
    make_prompts,
    max_lengths,
    next_aux_position,
)

torch.set_num_threads(1)
run = base_config()
task = run.validate()
sets = eval_sets(task)
cell = next(c for c in sets["extrapolation"] if c.n == 5)
prompts = make_prompts([q for q, _ in sets["extrapolation"][cell][:256]], "decoder")
max_new = max_lengths([cell])[1] + 1
placement = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "pre"
torch.manual_seed(0)
model = build_model(model_config(run, run.model.d_model, placement)).eval()


def dec(cached: bool) -> list[list[int]]:
    return greedy_decode(model, prompts, max_new=max_new, eos=-1, aux_fn=aux_positions,
                         aux_next=next_aux_position, use_cache=cached)


assert dec(True) == dec(False)
res: dict[bool, list[float]] = {True: [], False: []}
for _ in range(9):
    for c in (True, False):
        t0 = time.perf_counter()
        dec(c)
        res[c].append(time.perf_counter() - t0)
ratios = [u / c for c, u in zip(res[True], res[False])]
print(f"{placement} {cell.label} batch {len(prompts)} prompt {max(map(len, prompts))} max_new "
      f"{max_new}: cached {1e3 * st.median(res[True]):.1f} ms, uncached "
      f"{1e3 * st.median(res[False]):.1f} ms, speed-up {st.median(ratios):.2f}x")
if "--table" in sys.argv:
    with torch.profiler.profile() as prof:
        dec(True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
