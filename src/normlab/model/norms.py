"""LayerNorm and RMSNorm with TransformerLens hook points.

`hook_scale` is the divisor (std or RMS, shape [..., 1]): the quantity whose spread across
tokens is the paper's subspace interference. `hook_normalized` is the output after the gain.
Where norms go is `block.py`'s business; how they are computed fast on CPU, `native.py`'s.
"""

from __future__ import annotations

import torch
from torch import nn

from normlab.model import native
from normlab.model.config import ModelConfig
from normlab.model.hooks import HookPoint, torch_hooked
from normlab.model.positions import Rope

_HALF = (torch.bfloat16, torch.float16)


def autocast_half(x: object) -> bool:
    """Whether `x` is a half-precision tensor made under autocast (`train.precision =
    "bfloat16"`): a matmul's output, which the norms' statistics and attention's scores and
    softmax read in float32, so that the quantities this project compares across placements
    have one precision whatever the placement (an fx Proxy is no Tensor)."""
    return isinstance(x, torch.Tensor) and x.dtype in _HALF and autocasting(x.device)


def autocasting(device: torch.device) -> bool:
    """Whether autocast is on for `device`'s type (never for a type it does not know, such as
    `meta`, where asking would raise)."""
    kind = device.type
    return torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)


class Norm(nn.Module):
    """N(x) over the last dim: `layer` centres first, `rms` does not."""

    def __init__(
        self,
        dim: int,
        kind: str = "layer",
        eps: float = 1e-5,
        bias: bool = True,
        gain_offset: bool = False,
    ) -> None:
        super().__init__()
        self.kind, self.eps, self.gain_offset = kind, eps, gain_offset
        self.w = nn.Parameter(torch.zeros(dim) if gain_offset else torch.ones(dim))
        self.b = nn.Parameter(torch.zeros(dim)) if kind == "layer" and bias else None
        self.hook_scale = HookPoint()
        self.hook_normalized = HookPoint()
        self.native_min = native.MIN_ROWS[False] * dim  # fewest elements for the kernel

    def forward(self, x: torch.Tensor, head_major: bool = False) -> torch.Tensor:
        """`head_major` (x [B, T, H, D]): where the CPU kernel runs, the result is a view of
        head-major memory, which attention reads without a copy (`native.norm`); elsewhere it
        changes nothing."""
        return self._norm(x, head_major, None)

    def rotated(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        """`rope(self(x))`, QK-Norm then RoPE: one kernel call where both kernels would run
        (`native.norm_rope_applies`), one pass over q or k each way instead of two. PyTorch
        hooks registered on this norm still see its call: with one, the two run apart."""
        if torch_hooked(self):
            return rope(self(x))
        return self._norm(x, False, rope)

    def _norm(self, x: torch.Tensor, head_major: bool, rope: Rope | None) -> torch.Tensor:
        if autocast_half(x) and self.w.dtype is torch.float32:
            # Mixed precision hands QK/QKV-Norm the bfloat16 output of a matmul: its
            # statistics, the scale this project studies, are float32 all the same, as every
            # other norm's (they read the float32 residual). A model whose own weights are
            # half precision keeps its precision.
            x = x.float()
        if not (self.hook_scale.fns or self.hook_normalized.fns):
            # fused kernels when nobody reads the scale: same numbers to ~1e-7, 3-7x faster;
            # on CPU, normlab's own kernel where it is built (native.py: why and how)
            gain = (1.0 + self.w) if self.gain_offset else self.w
            center = self.kind == "layer"
            # (size first: it turns away a batch-1 forward's small inputs in ~0.1 µs; an fx
            # Proxy is no Tensor)
            if (isinstance(x, torch.Tensor) and x.numel() >= self.native_min
                    and native.norm_applies(x, gain)):
                if rope is not None and native.norm_rope_applies(x, rope.cos, rope.sin):
                    return native.norm(x, gain, self.b, self.eps, center,
                                       rope=(rope.cos, rope.sin))
                y = native.norm(x, gain, self.b, self.eps, center, head_major)
            else:
                y = native.torch_norm(x, gain, self.b, self.eps, center)
        else:
            if self.kind == "layer":
                x = x - x.mean(-1, keepdim=True)
            scale = self.hook_scale((x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt())
            y = x / scale * ((1.0 + self.w) if self.gain_offset else self.w)
            if self.b is not None:
                y = y + self.b
            y = self.hook_normalized(y)
        return y if rope is None else rope(y)

    def extra_repr(self) -> str:
        return f"{self.kind}, dim={self.w.shape[0]}, eps={self.eps}"


def make_norm(cfg: ModelConfig, dim: int) -> Norm:
    return Norm(dim, cfg.norm_type, cfg.norm_eps, cfg.norm_bias, cfg.norm_gain_offset)
