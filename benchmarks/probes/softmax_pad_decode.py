"""One-off probe behind a twelfth-session number in docs/performance.md; not part of make bench.

bench_decode's cells (pre and qkv, random weights, all the cell's eval questions in one batch,
not bench_decode's first 256, forced to max_new), cached and uncached, with
`attention.SOFTMAX_MIN_KEYS_CPU` 0 (no padding) and 16 (the current rule) alternating in one
process, 5 rounds, one thread; prints the key lengths the softmax saw and the median times
(ms):

    .venv/bin/python benchmarks/probes/softmax_pad_decode.py
"""
import statistics as st
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import normlab.model.attention as A
from bench_train_step import base_config, model_config
from normlab import build_model
from normlab.model.generate import greedy_decode
from normlab.tasks.addition import (
    aux_positions,
    eval_sets,
    make_prompts,
    max_lengths,
    next_aux_position,
)

torch.set_num_threads(1)
run = base_config()
sets = eval_sets(run.validate())
seen: set[int] = set()
orig = A.softmax_rows


def spy(s: torch.Tensor) -> torch.Tensor:
    seen.add(s.shape[-1])
    return orig(s)


A.softmax_rows = spy
for placement in ("qkv", "pre"):
    torch.manual_seed(0)
    model = build_model(model_config(run, run.model.d_model, placement)).eval()
    for (n, d) in ((5, 1), (2, 3)):
        cell = next(c for c in sets["extrapolation"] if (c.n, c.d) == (n, d))
        prompts = make_prompts([q for q, _ in sets["extrapolation"][cell]], "decoder")
        max_new = max_lengths([cell])[1] + 1
        res = {0: {True: [], False: []}, 16: {True: [], False: []}}
        for rep in range(5):
            for K in (0, 16):
                A.SOFTMAX_MIN_KEYS_CPU = K
                for cached in (True, False):
                    seen.clear()
                    t0 = time.perf_counter()
                    greedy_decode(model, prompts, max_new=max_new, eos=-1,
                                  aux_fn=aux_positions, aux_next=next_aux_position,
                                  use_cache=cached)
                    res[K][cached].append(1e3 * (time.perf_counter() - t0))
                    if rep == 0 and K == 16:
                        print(placement, cell.label, "cached" if cached else "uncached",
                              "key lengths", sorted(seen))
        med = {K: {("cached" if c else "uncached"): round(st.median(v), 1) for c, v in r.items()}
               for K, r in res.items()}
        print(placement, cell.label, f"batch {len(prompts)}, max_new {max_new}, median ms by KEYS:",
              med, flush=True)
