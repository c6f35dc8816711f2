"""One-off probe behind a twenty-sixth-session note in docs/performance.md; not part of make bench.

Two changes to evaluation's forwards, each A/B against the code as it is, in one process:
1. `torch.inference_mode()` around greedy decoding and the collapse sweep instead of only
   `torch.no_grad()` (as `evaluating` has it): ATen skips its autograd bookkeeping per op;
2. the MLP's GELU written in place over its pre-activation (`torch._C._nn.gelu_`) when no
   autograd records and no hook reads the pre-activation, saving a fresh output tensor.
Contenders: bench_decode's n5d1 cell (`pre`, cached and uncached) and bench_collapse's
set-up (the naive loop and `measure_collapse`); ms per call, medians of alternating rounds.

    .venv/bin/python benchmarks/probes/eval_mode_ab.py [THREADS]
"""
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import N5d1Decoder, Sweep, ab, probe_header, threads_from_argv
from bench_train_step import base_config

from normlab import allocator
from normlab.model.mlp import MLP

allocator.keep_freed_memory()
threads_from_argv("eval_mode_ab.py")
probe_header("eval_mode_ab.py")
cell = N5d1Decoder(base_config())
sweep = Sweep()
mode = {"inference": False}


def in_mode(fn: Callable[[], object]) -> Callable[[], None]:
    def call() -> None:
        with torch.inference_mode(mode["inference"]):
            fn()
    return call


def switch_mode(on: bool) -> None:
    mode["inference"] = on


plain_forward = MLP.forward


def gelu_in_place(self: MLP, x: torch.Tensor) -> torch.Tensor:
    if (torch.is_grad_enabled() or self.hook_pre.fns or not self.linear_gelu
            or self.b_in is not None):
        return plain_forward(self, x)
    post = torch._C._nn.gelu_(x @ self.W_in)
    out = self.hook_post(post) @ self.W_out
    return out if self.b_out is None else out + self.b_out


def switch_gelu(on: bool) -> None:
    MLP.forward = gelu_in_place if on else plain_forward


contenders = {"decode n5d1 cached": lambda: cell.decode(True),
              "decode n5d1 uncached": lambda: cell.decode(False),
              "naive loop": sweep.naive, "measure_collapse": sweep.vectorised}
rounds = {"naive loop": 7}
print("1. torch.no_grad() vs torch.inference_mode():")
for label, fn in contenders.items():
    ab(label, switch_mode, in_mode(fn), 1, rounds=rounds.get(label, 15),
       names=("no_grad", "inference"))
print("2. F.gelu vs GELU in place:")
for label, fn in contenders.items():
    ab(label, switch_gelu, fn, 1, rounds=rounds.get(label, 15), names=("F.gelu", "in place"))
