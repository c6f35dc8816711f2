"""A minimal plain-PyTorch nanoGPT-style decoder, the speed reference for normlab's Pre-Norm.

Same shapes as a normlab `pre` decoder: learned token and position embeddings (with
`rope=True`: no position table, rotary q/k in the rotate-half layout as normlab's
`pos_encoding = "rope"`), Pre-LN blocks (LayerNorm with bias), one fused qkv Linear, causal
attention, a GELU MLP, final LayerNorm, untied unembedding; no biases in Linear layers
(normlab's defaults `attn_bias = mlp_bias = False`). Attention is nanoGPT's two ways: `flash`
(its default when torch has it) `F.scaled_dot_product_attention`, else the explicit scores,
causal mask, softmax and weighted sum, which is normlab's own path on short CPU rows; the
benchmarks time both and hold normlab to the faster. Parameter counts match a
normlab `pre` decoder with learned positions exactly; with RoPE, normlab's digit-position table
(`n_aux_positions x d_model`, when used) has no counterpart here.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def rope_tables(
    t: int, d_head: int, theta: float = 10000.0, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [t, d_head] for positions 0..t-1, rotate-half layout, on `device` (the
    tokens'; tables on the CPU would not mix with a GPU's q and k)."""
    inv = 1.0 / theta ** (torch.arange(0, d_head, 2, dtype=torch.float32, device=device) / d_head)
    angles = torch.arange(t, dtype=torch.float32, device=device)[:, None] * inv
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., h:], x[..., :h]], dim=-1) * sin


Rope = tuple[torch.Tensor, torch.Tensor]


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, flash: bool = True) -> None:
        super().__init__()
        self.n_heads, self.flash = n_heads, flash
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.proj = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor, rope: Rope | None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (y.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for y in (q, k, v))
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if self.flash:
            z = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.shape[-1]))
            causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            z = att.masked_fill(~causal, float("-inf")).softmax(-1) @ v
        return self.proj(z.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, d_mlp: int, flash: bool = True) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, flash)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, d_mlp, bias=False)
        self.out = nn.Linear(d_mlp, d_model, bias=False)

    def forward(self, x: torch.Tensor, rope: Rope | None) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), rope)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class NanoGPT(nn.Module):
    def __init__(
        self, vocab: int, d_model: int, n_layers: int, n_heads: int, d_mlp: int, max_len: int,
        rope: bool = False, flash: bool = True,
    ) -> None:
        super().__init__()
        self.d_head = d_model // n_heads
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = None if rope else nn.Embedding(max_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, d_mlp, flash)
                                    for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        out_std = 0.02 / math.sqrt(2 * n_layers)
        for name, p in self.named_parameters():
            if p.ndim == 2:
                std = out_std if name.endswith(("proj.weight", "out.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        x = self.wte(tokens)
        rope = None
        if self.wpe is None:
            rope = rope_tables(t, self.d_head, device=tokens.device)
        else:
            x = x + self.wpe(torch.arange(t, device=tokens.device))
        for block in self.blocks:
            x = block(x, rope)
        return self.head(self.ln_f(x))
