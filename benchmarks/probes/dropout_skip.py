"""One-off probe behind the nineteenth session's dropout skip (docs/performance.md); not part
of make bench.

`block.dropped` skips a dropout module where it is the identity (eval mode, or p = 0). Against
calling it every time (`drop(x)`, the code before), in one process, alternating, 15 rounds
(`abtime.ab`): bench_train_step's d64 `pre` and `qkv` decoders (random weights, eval,
no_grad) on a batch-1 forward of 17 tokens, and the cached greedy decode of bench_decode's
n5d1 cell (256 prompts, `pre`). ms per call; called / skipped > 1: the skip is faster.

    .venv/bin/python benchmarks/probes/dropout_skip.py [THREADS]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import ab, n5d1_prompts, threads_from_argv

from bench_train_step import base_config, model_config
from normlab import build_model
from normlab.model import block, transformer
from normlab.model.generate import greedy_decode
from normlab.tasks.addition import aux_positions, next_aux_position

threads_from_argv("dropout_skip.py")
skip = block.dropped


def skipped(on: bool) -> None:
    fn = skip if on else (lambda drop, x: drop(x))
    block.dropped = transformer.dropped = fn  # both modules' call sites


run = base_config()
prompts, max_new = n5d1_prompts(run)
tokens = torch.randint(3, 14, (1, 17))
aux = aux_positions(prompts[0], "sequence")[-1:] * 17  # any valid positions
with torch.no_grad():
    for placement in ("pre", "qkv"):
        torch.manual_seed(0)
        model = build_model(model_config(run, run.model.d_model, placement)).eval()
        ab(f"{placement} batch-1 forward", skipped,
           lambda model=model: model(tokens, aux=torch.tensor([aux])), inner=50,
           names=("called", "skipped"))
    torch.manual_seed(0)
    model = build_model(model_config(run, run.model.d_model, "pre")).eval()
    ab("pre cached n5d1 decode", skipped,
       lambda: greedy_decode(model, prompts, max_new=max_new, eos=-1, aux_fn=aux_positions,
                             aux_next=next_aux_position), inner=3, names=("called", "skipped"))
