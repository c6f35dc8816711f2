"""One-off probe behind a twenty-sixth-session number in docs/performance.md; not part of make bench.

`native.linear_gelu` (the MLP's first matmul and GELU in one Function whose backward's GELU is
one multiply) on and off, A/B in one process:
1. bench_train_step's normlab `pre` and `qkv` steps (the benchmark's batch, 3 steps a call);
2. an MLP's forward and backward alone (d_model 64, d_mlp 256) at 17 to 2176 rows (x 256
   elements of its pre-activation), where `native.GELU_MIN_ELEMENTS` comes from.

    .venv/bin/python benchmarks/probes/linear_gelu_ab.py [THREADS]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import ab, probe_header, threads_from_argv
from bench_train_step import base_config, build_contender, model_config, real_batch

from normlab import allocator
from normlab.model import native
from normlab.model.config import ModelConfig
from normlab.model.mlp import MLP

allocator.keep_freed_memory()
threads_from_argv("linear_gelu_ab.py")
probe_header("linear_gelu_ab.py")
names = ("torch", "kernel")


def switch(on: bool) -> None:
    native.set_enabled(on, "gelu")


run = base_config()
batch = real_batch(run)
print("training step, 3 steps a call (ms per call):")
for placement in ("pre", "qkv"):
    step = build_contender("normlab", model_config(run, 64, placement), run, batch)[1]
    for _ in range(3):
        step()
    ab(f"{placement} step", switch, step, 3, rounds=15, names=names)

print("MLP forward + backward alone, d_model 64, d_mlp 256 (ms per call):")
torch.manual_seed(0)
mlp = MLP(ModelConfig(d_model=64, n_heads=4, d_mlp=256))
for p in mlp.parameters():
    torch.nn.init.normal_(p, std=0.1)
for rows in (17, 34, 68, 136, 272, 544, 1088, 2176):
    x = torch.randn(rows, 64, requires_grad=True)
    g = torch.randn(rows, 64)

    def fwd_bwd(x: torch.Tensor = x, g: torch.Tensor = g) -> None:
        mlp(x).backward(g)

    inner = max(1, 20000 // rows)
    for _ in range(3):
        fwd_bwd()
    ab(f"{rows} rows ({rows * 256} el.)", switch, fwd_bwd, inner, rounds=9, names=names)
