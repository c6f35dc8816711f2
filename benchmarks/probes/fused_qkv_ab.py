"""One-off probe behind a twenty-fifth-session note in docs/performance.md; not part of make
bench.

q, k and v from one matmul, the weights side by side (nanoGPT's `c_attn`), against one
matmul each, in float32 and under bfloat16 autocast. `Attention._linear` does the first
under autocast and the second otherwise; here each way is forced in both precisions, switched
off and on, alternating in one process (11 rounds): the training step
(`bench_train_step.build_contender`, normlab, the training batch) of `pre` and `qkv` at d64
and d128; and, in float32, the collapse sweep (bench_collapse's set-up) and the cached and
uncached greedy decode of n5d1.

    .venv/bin/python benchmarks/probes/fused_qkv_ab.py [THREADS]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import N5d1Decoder, Sweep, ab, probe_header, threads_from_argv
from bench_train_step import base_config, build_contender, model_config, real_batch

from normlab import allocator
from normlab.model.attention import Attention

allocator.keep_freed_memory()
threads_from_argv("fused_qkv_ab.py")
probe_header("q/k/v from one matmul against one each, A/B")
LIBRARY = Attention._linear


def one_matmul(self: Attention, x: torch.Tensor, names: str) -> list[torch.Tensor]:
    """`_linear`'s autocast path, in any precision."""
    Ws = [getattr(self, f"W_{n.upper()}") for n in names]
    W_all = torch.cat([W.transpose(0, 1) for W in Ws], dim=1).flatten(1)
    ys = (x @ W_all).split([W.shape[0] * W.shape[2] for W in Ws], dim=-1)
    return [y.unflatten(-1, (W.shape[0], W.shape[2])) for W, y in zip(Ws, ys, strict=True)]


def one_each(self: Attention, x: torch.Tensor, names: str) -> list[torch.Tensor]:
    """`_linear` one name at a time: one matmul each."""
    return [LIBRARY(self, x, n)[0] for n in names]


def switch(on: bool) -> None:
    Attention._linear = one_matmul if on else one_each


names = ("one each", "one")
run = base_config()
assert not run.model.attn_bias  # one_matmul adds no biases
batch = real_batch(run)
for precision in ("float32", "bfloat16"):
    for d in (64, 128):
        for placement in ("pre", "qkv"):
            _, step = build_contender("normlab", model_config(run, d, placement), run, batch,
                                      precision=precision)
            for on in (False, True, False, True):
                switch(on)
                step()
            ab(f"step {placement} d{d} {precision}", switch, step, 5, rounds=11, names=names)
s = Sweep()
ab("collapse sweep", switch, s.vectorised, 1, rounds=11, names=names)
dec = N5d1Decoder(run)
ab("decode n5d1 cached", switch, lambda: dec.decode(True), 3, rounds=11, names=names)
ab("decode n5d1 uncached", switch, lambda: dec.decode(False), 1, rounds=11, names=names)
Attention._linear = LIBRARY
