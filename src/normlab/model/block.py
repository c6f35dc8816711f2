"""Where do norms go? This file is the whole answer.

`norm_placement` picks one row of `PLACEMENTS`; `Block` applies it. With N a LayerNorm or
RMSNorm, f the attention or MLP sub-layer, and W_Q/W_K/W_V a head's projections:

| placement | attention sub-layer                         | MLP sub-layer      | final norm |
|-----------|---------------------------------------------|--------------------|------------|
| none      | x + f(x)                                    | x + f(x)           | no         |
| post      | N(x + f(x))                                 | N(x + f(x))        | no         |
| pre       | x + f(N(x))                                 | x + f(N(x))        | yes        |
| qk        | x + f(x), q = N(W_Q x), k = N(W_K x)        | x + f(N(x)) (pre)  | yes        |
| qkv       | x + f(x), q, k, v = N(W_Q x), N(W_K x), N(W_V x) | x + f(N(x)) (pre) | yes   |
| pre_qk    | x + f(N(x)), and q = N(W_Q .), k = N(W_K .) | x + f(N(x))        | yes        |

`pre_qk` is not in the paper: it is Pre-Norm plus QK-Norm, as in Qwen3, so that Qwen3 models
can be loaded (`normlab.interop`) and compared.

Cross-attention (encoder-decoder) follows its sub-layer's row: under `pre` the decoder
side is N(x) and the memory side is the encoder output (already through the encoder's
final norm); under `post` the sum is normalised; under `qk`/`qkv` the decoder's q and the
memory's k (and v) are normalised after their projections. The MLP keeping a Pre-Norm
under `qk`/`qkv` and the per-head scope are *our choices*, not the paper's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from normlab.model.attention import Attention
from normlab.model.config import ModelConfig
from normlab.model.hooks import HookPoint, torch_hooked
from normlab.model.mlp import MLP
from normlab.model.norms import Norm, make_norm
from normlab.model.positions import Rope


@dataclass(frozen=True)
class Placement:
    """attn/mlp: 'pre' = x + f(N(x)), 'post' = N(x + f(x)), None = x + f(x)."""

    attn: str | None
    mlp: str | None
    qk_norm: bool
    v_norm: bool
    final: bool


PLACEMENTS: dict[str, Placement] = {
    "none": Placement(attn=None, mlp=None, qk_norm=False, v_norm=False, final=False),
    "post": Placement(attn="post", mlp="post", qk_norm=False, v_norm=False, final=False),
    "pre": Placement(attn="pre", mlp="pre", qk_norm=False, v_norm=False, final=True),
    "qk": Placement(attn=None, mlp="pre", qk_norm=True, v_norm=False, final=True),
    "qkv": Placement(attn=None, mlp="pre", qk_norm=True, v_norm=True, final=True),
    "pre_qk": Placement(attn="pre", mlp="pre", qk_norm=True, v_norm=False, final=True),
}


def residual(
    x: torch.Tensor, f: Callable[[torch.Tensor], torch.Tensor], norm: Norm | None, where: str | None
) -> torch.Tensor:
    """One residual sub-layer with its norm placed `where` ('pre', 'post' or None)."""
    if where == "post":
        return norm(x + f(x))
    if where == "pre":
        return x + f(norm(x))
    return x + f(x)


def dropped(drop: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
    """`drop(x)`, skipped where it is the identity (eval mode, or p = 0, where torch's dropout
    returns x and draws no random numbers) and no PyTorch hook is registered on it: nine such
    module calls and `F.dropout`s were 3-5% of a batch-1 forward
    (`benchmarks/probes/dropout_skip.py`; docs/performance.md, nineteenth session)."""
    return drop(x) if (drop.training and drop.p) or torch_hooked(drop) else x


class Block(nn.Module):
    """One layer: self-attention, optional cross-attention, MLP, norms per `PLACEMENTS`."""

    def __init__(self, cfg: ModelConfig, *, causal: bool, cross: bool = False) -> None:
        super().__init__()
        self.placement = p = PLACEMENTS[cfg.norm_placement]
        self.ln1 = make_norm(cfg, cfg.d_model) if p.attn else None
        self.attn = Attention(cfg, causal=causal, qk_norm=p.qk_norm, v_norm=p.v_norm)
        if cross:
            self.ln_cross = make_norm(cfg, cfg.d_model) if p.attn else None
            self.cross_attn = Attention(cfg, causal=False, qk_norm=p.qk_norm, v_norm=p.v_norm,
                                        rotary=False)
            self.hook_cross_attn_out = HookPoint()
            self.hook_resid_mid_cross = HookPoint()
        else:
            self.cross_attn = None
        self.ln2 = make_norm(cfg, cfg.d_model) if p.mlp else None
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.hook_resid_pre = HookPoint()
        self.hook_attn_out = HookPoint()
        self.hook_resid_mid = HookPoint()
        self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()

    def forward(
        self,
        x: torch.Tensor,
        *,
        mask: torch.Tensor | None = None,
        rope: Rope | None = None,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        cache: dict[str, dict[str, torch.Tensor]] | None = None,
    ) -> torch.Tensor:
        p = self.placement
        x = self.hook_resid_pre(x)

        def attend(h: torch.Tensor) -> torch.Tensor:
            kv = None if cache is None else cache.setdefault("self", {})
            out = self.attn(h, mask=mask, rope=rope, cache=kv)
            return self.hook_attn_out(dropped(self.drop, out))

        x = self.hook_resid_mid(residual(x, attend, self.ln1, p.attn))
        if self.cross_attn is not None:
            assert memory is not None, "a decoder block with cross-attention needs `memory`"

            def cross(h: torch.Tensor) -> torch.Tensor:
                kv = None if cache is None else cache.setdefault("cross", {})
                out = self.cross_attn(h, memory=memory, mask=memory_mask, cache=kv)
                return self.hook_cross_attn_out(dropped(self.drop, out))

            x = self.hook_resid_mid_cross(residual(x, cross, self.ln_cross, p.attn))

        def mlp(h: torch.Tensor) -> torch.Tensor:
            return self.hook_mlp_out(dropped(self.drop, self.mlp(h)))

        x = residual(x, mlp, self.ln2, p.mlp)
        return self.hook_resid_post(x)
