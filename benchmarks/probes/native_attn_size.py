"""One-off probe behind the eighteenth session's decoding-attention kernel (docs/performance.md);
not part of make bench.

One decoding step's attention (`Attention` of a d64, 4-head model, eval, no_grad: x [B, 1, 64]
against a cache of T keys, as `greedy_decode` leaves it: buffers with room to grow) with
normlab's `attn` kernel against torch's explicit path (two batched matmuls, a bias, a scale and
a softmax), by B and T. The module's projections, RoPE and output projection are in both. One
process, the kernel switched on and off, alternating, 11 rounds (`abtime.ab`): ms per call,
and torch / kernel (> 1: the kernel is faster) with its range over the rounds.

    .venv/bin/python benchmarks/probes/native_attn_size.py [THREADS]
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import ab, threads_from_argv

from normlab import ModelConfig
from normlab.model import native
from normlab.model.attention import Attention
from normlab.model.positions import Rotary

threads_from_argv("native_attn_size.py")
cfg = ModelConfig(d_model=64, n_heads=4, pos_encoding="rope")
torch.manual_seed(0)
attn = Attention(cfg, causal=True).eval()
for p in attn.parameters():
    torch.nn.init.normal_(p, std=0.3)


def rows(b: int, t: int) -> None:
    """The A/B of one step of `b` rows against `t` keys."""
    with torch.no_grad():
        cache: dict[str, torch.Tensor] = {"reserve": torch.tensor(t + 1)}
        positions = torch.arange(t)[None].expand(b, -1)
        attn(torch.randn(b, t - 1, 64), rope=Rotary(16, 1e4)(positions[:, :-1]), cache=cache)
        x, rope = torch.randn(b, 1, 64), Rotary(16, 1e4)(positions[:, -1:])
        mask = torch.ones(b, 1, 1, t, dtype=torch.bool)
        filled = t - 1

        def step() -> None:
            # back to t - 1 keys: the step rewrites the same position every call
            cache["k"] = cache["buf_k"][:, :, :filled]
            cache["v"] = cache["buf_v"][:, :, :filled]
            cache["filled"].fill_(filled)
            attn(x, mask=mask, rope=rope, cache=cache)

        inner = max(10, 20_000 // (b * t))
        ab(f"B {b:3d}, T {t:3d}", lambda on: native.set_enabled(on, "attn"), step, inner,
           rounds=11, names=("torch", "kernel"))


for b in (1, 16, 256):
    for t in (8, 20, 64, 256):
        rows(b, t)
