"""One-off probe behind a twenty-seventh-session number in docs/performance.md; not make bench.

`native.attention` (explicit attention's ops in one kernel pass each way, for rows of at most
64 keys) on and off, A/B in one process: bench_train_step's normlab `pre` and `qkv` steps (the
benchmark's batch, 3 steps a call), the attention alone, forward and backward, at the step's
shape, and bench_decode's n5d1 cell decoded with and without the cache (`pre`). Each line
prints the medians and off / on as median [min, max] over the rounds.

    .venv/bin/python benchmarks/probes/attention_ab.py [THREADS]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import N5d1Decoder, ab, probe_header, threads_from_argv

from bench_train_step import base_config, build_contender, model_config, real_batch
from normlab import allocator
from normlab.model import native

allocator.keep_freed_memory()
threads_from_argv("attention_ab.py")
probe_header("attention_ab.py")
names = ("torch", "kernel")


def switch(on: bool) -> None:
    native.set_enabled(on, "attention")


run = base_config()
batch = real_batch(run)
print("training step, 3 steps a call (ms per call):")
for placement in ("pre", "qkv"):
    step = build_contender("normlab", model_config(run, 64, placement), run, batch)[1]
    for _ in range(3):
        step()
    ab(f"{placement} step", switch, step, 3, rounds=15, names=names)

print("attention alone at the step's shape, q, k, v [128, 4, 17, 16] (ms per call):")
torch.manual_seed(0)
b, h, t, d = 128, 4, 17, 16
qkv = [torch.randn(b, h, t, d, requires_grad=True) for _ in range(3)]
scale = torch.full((h,), d ** -0.5)
mask = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
g = torch.randn(b, t, h * d)


def fwd_bwd() -> None:
    """The kernel, or torch's ops (`native.torch_attention`: matmul, scale, masked_fill,
    softmax, matmul; `Attention`'s explicit path applies scale and mask in one `addcmul`
    instead), then the output projection's flatten; forward and backward."""
    q, k, v = qkv
    if native.attention_applies(q, k, v, scale, mask):
        z = native.attention(q, k, v, scale, mask).transpose(1, 2)
    else:
        z = native.torch_attention(q, k, v, scale, mask)
    z.flatten(-2).backward(g)


for _ in range(3):
    fwd_bwd()
ab("fwd + bwd", switch, fwd_bwd, 10, rounds=9, names=names)

print("greedy decoding, bench_decode's n5d1 cell, pre (ms per call):")
cell = N5d1Decoder(run)
for cached in (True, False):
    cell.decode(cached)
    ab(f"{'cached' if cached else 'uncached'} decode", switch,
       lambda cached=cached: cell.decode(cached), 1, rounds=15, names=names)
