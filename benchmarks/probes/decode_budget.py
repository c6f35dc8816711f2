"""One-off probe behind a twentieth-session note in docs/performance.md; not part of make bench.

What 3x on bench_decode's n5d1 cell would ask of a cached decoding step. A `pre` decoder of
the quick-grid size (random weights) with glibc keeping freed memory, as the benchmarks run:
the whole cached and uncached greedy decodes of the cell's 256 questions (4 new tokens), the
prompt forward with and without a cache, and each of the three single-token steps, timed
apart (median of 21, after 5 warm-ups); the same step at batch 1, which is Python and
dispatch with next to no arithmetic; then the step time that 3x would allow if the rest of
the cached decode stayed as it is:

    .venv/bin/python benchmarks/probes/decode_budget.py [THREADS]
"""
import statistics as st
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import N5d1Decoder, probe_header, threads_from_argv
from bench_train_step import base_config
from common import median, paired_timing

from normlab import allocator
from normlab.model.generate import _pad
from normlab.tasks.addition import aux_positions, next_aux_position

allocator.keep_freed_memory()
threads_from_argv("decode_budget.py")
probe_header("decode_budget.py")
cell = N5d1Decoder(base_config())
model, prompts, max_new, decode = cell.model, cell.prompts, cell.max_new, cell.decode


def parts(rows: list[list[int]]) -> tuple[float, float, float]:
    """Median ms of the cached prompt forward, one cached step, the uncached prompt forward."""
    seq, mask = _pad(rows, 0, left=True)
    aux = _pad([aux_positions(p, "sequence") for p in rows], 0, left=True)[0]
    b = seq.shape[0]
    prompt, steps, plain = [], [], []
    for i in range(26):
        cache = model.new_cache(seq.shape[1] + max_new)
        t0 = time.perf_counter()
        logits = model(seq, attention_mask=mask, cache=cache, aux=aux)
        t1 = time.perf_counter()
        m, a = mask, aux[:, -1]
        for _ in range(max_new - 1):
            nxt = logits[:, -1].argmax(-1)
            m = torch.cat([m, torch.ones(b, 1, dtype=torch.bool)], 1)
            a = next_aux_position(a, nxt)
            s0 = time.perf_counter()
            logits = model(nxt[:, None], attention_mask=m, cache=cache, aux=a[:, None])
            if i >= 5:
                steps.append(time.perf_counter() - s0)
        u0 = time.perf_counter()
        model(seq, attention_mask=mask, aux=aux)
        if i >= 5:
            prompt.append(t1 - t0)
            plain.append(time.perf_counter() - u0)
    return tuple(1e3 * st.median(x) for x in (prompt, steps, plain))


def median_ms(fn) -> float:
    """Median of 21 calls after 5, in ms (`common.paired_timing`)."""
    return 1e3 * median(paired_timing({"fn": fn}, repeats=21, warmup=5)["fn"])


with torch.no_grad():
    cached, uncached = median_ms(lambda: decode(True)), median_ms(lambda: decode(False))
    p_cached, step, p_plain = parts(prompts)
    step_b1 = parts(prompts[:1])[1]
# 3x if the steps alone got cheaper: the whole cached decode must lose (cached - uncached / 3)
allowed = step - (cached - uncached / 3) / (max_new - 1)
print(f"n5d1, 256 prompts of {max(len(p) for p in prompts)} tokens, {max_new} new tokens; "
      "median ms (the parts are timed apart, so they need not add up to the whole)")
print(f"  cached decode {cached:.1f}: its prompt forward with the cache {p_cached:.1f}, "
      f"{max_new - 1} steps of {step:.2f}")
print(f"  uncached decode {uncached:.1f}; the prompt forward without a cache {p_plain:.1f}")
print(f"  speed-up {uncached / cached:.2f}; 3x needs the cached decode <= {uncached / 3:.1f}, "
      f"so steps of <= {allowed:.2f} ms if the rest stayed")
print(f"  the same step at batch 1 (Python and dispatch): {step_b1:.2f} ms")
