"""One-off probe behind a seventeenth-session note in docs/performance.md; not part of make bench.

Where a cached greedy decode of bench_decode's n5d1 cell spends its time (`pre`, random
weights, its 256 questions, forced to max_new; one thread): `greedy_decode` with max_new 1
(the prompt forward and one token), 2 and 4, cached, against the uncached decode, median of 9;
then the torch.profiler op self time of the three single-token steps (max_new 4 minus max_new
1, per decode), by op and input shape:

    .venv/bin/python benchmarks/probes/decode_steps.py [THREADS]
"""
import statistics as st
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import n5d1_prompts
from bench_train_step import base_config, model_config

from normlab import build_model
from normlab.model import native
from normlab.model.generate import greedy_decode
from normlab.tasks.addition import aux_positions, next_aux_position

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
run = base_config()
prompts, _ = n5d1_prompts(run)
torch.manual_seed(0)
model = build_model(model_config(run, run.model.d_model, "pre")).eval()


def decode(max_new: int, cached: bool) -> None:
    greedy_decode(model, prompts, max_new=max_new, eos=-1, aux_fn=aux_positions,
                  aux_next=next_aux_position, use_cache=cached)


print(f"{torch.get_num_threads()} thread(s); kernels: {native.describe()}")
for n in (1, 2, 4):
    decode(n, True)
for n, cached in ((1, True), (2, True), (4, True), (1, False), (4, False)):
    ts = []
    for _ in range(9):
        t0 = time.perf_counter()
        decode(n, cached)
        ts.append(time.perf_counter() - t0)
    print(f"max_new {n}, {'cached' if cached else 'uncached'}: {st.median(ts) * 1e3:.1f} ms")
ops = {}
for n in (1, 4):
    with torch.profiler.profile(record_shapes=True) as prof:
        for _ in range(5):
            decode(n, True)
    ops[n] = {(e.key, str(e.input_shapes)[:80]): e.self_cpu_time_total / 5e3
              for e in prof.key_averages(group_by_input_shape=True)}
steps = {k: ops[4].get(k, 0.0) - ops[1].get(k, 0.0) for k in set(ops[1]) | set(ops[4])}
print(f"the three steps' op self time: {sum(steps.values()):.2f} ms a decode; largest:")
for k, ms in sorted(steps.items(), key=lambda kv: -kv[1])[:12]:
    print(f"  {ms:6.3f} ms  {k[0]:16s} {k[1]}")
