"""One-off probe behind a twenty-second-session note in docs/performance.md; not part of make
bench.

A q/k/v projection lays its weight, [head, d_model, d_head], out as [d_model, head * d_head]
for its one matmul (`Attention._project`): a copy, 12 a decoding step at 4 layers. Would keeping
that layout between calls speed decoding up? The probe stores each q/k/v weight in memory laid
out [d_model, head, d_head] (the parameter a transposed view of it, same values), which makes
the copy a free view, against the usual contiguous weights; `_project` runs unchanged, and so
do the values of every product. bench_decode's n5d1 cell (a `pre` decoder of the quick-grid
size, random weights, 256 prompts, 4 new tokens), cached and uncached greedy decodes with
either layout, every round in a new random order (median of 25 rounds, after two warm-ups).

    .venv/bin/python benchmarks/probes/proj_weight_cache.py [THREADS]
"""
import statistics as st
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import N5d1Decoder, probe_header, shuffled, threads_from_argv
from bench_train_step import base_config

from normlab import allocator
from normlab.model.attention import Attention
from normlab.tasks.addition import aux_positions

allocator.keep_freed_memory()
threads_from_argv("proj_weight_cache.py")
probe_header("proj_weight_cache.py")
cell = N5d1Decoder(base_config())
attns = [m for m in cell.model.modules() if isinstance(m, Attention)]


def lay_out(kept: bool) -> None:
    """Every q/k/v weight contiguous as [head, d_model, d_head] or, `kept`, a view of memory
    laid out [d_model, head, d_head] (whose transpose(0, 1) `_project` then reshapes free)."""
    for attn in attns:
        for name in ("W_Q", "W_K", "W_V"):
            W = getattr(attn, name).detach()
            W = W.transpose(0, 1).contiguous().transpose(0, 1) if kept else W.contiguous()
            setattr(attn, name, nn.Parameter(W, requires_grad=False))


def decode(kept: bool, cached: bool):  # noqa: ANN201
    def fn() -> None:
        lay_out(kept)
        cell.decode(cached)
    return fn


ways = {(kept, cached): decode(kept, cached) for kept in (False, True) for cached in (True, False)}
with torch.no_grad():
    prompt = cell.prompts[0]
    x = {"tokens": torch.tensor([prompt]),
         "aux": torch.tensor([aux_positions(prompt, "sequence")])}
    lay_out(True)
    logits = cell.model(**x)
    lay_out(False)
    assert torch.equal(logits, cell.model(**x))  # the same values either way
    times = shuffled(ways, rounds=25)
ms = {k: 1e3 * st.median(t) for k, t in times.items()}
print(f"n5d1, {len(cell.prompts)} prompts, {cell.max_new} new tokens; median ms of 25 shuffled "
      "rounds")
for kept in (False, True):
    label = "layout kept" if kept else "as it is   "
    print(f"  {label}: cached {ms[(kept, True)]:6.2f}, uncached {ms[(kept, False)]:6.2f}, "
          f"speed-up {ms[(kept, False)] / ms[(kept, True)]:.3f}")
