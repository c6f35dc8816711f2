"""Positional encodings: learned table, sinusoidal table, or rotary (RoPE) on q and k."""

from __future__ import annotations

import math

import torch
from torch import nn

from normlab.model.config import ModelConfig


def sinusoidal_table(max_len: int, d: int) -> torch.Tensor:
    pos = torch.arange(max_len, dtype=torch.float32)[:, None]
    freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
    table = torch.zeros(max_len, d)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)[:, : d // 2]
    return table


class PosEmbed(nn.Module):
    """Additive position table [max_len, d_model] (learned `W_pos` or fixed sinusoidal)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.max_len = cfg.max_len
        if cfg.pos_encoding == "learned":
            self.W_pos = nn.Parameter(torch.empty(cfg.max_len, cfg.d_model))
        else:
            self.register_buffer(
                "W_pos", sinusoidal_table(cfg.max_len, cfg.d_model), persistent=False
            )

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        top = int(positions.max()) if positions.numel() else 0
        if top >= self.max_len:
            raise ValueError(
                f"position {top} is beyond ModelConfig.max_len={self.max_len}; "
                "raise max_len or use pos_encoding='rope'"
            )
        return self.W_pos[positions]


class Rotary(nn.Module):
    """RoPE in the rotate-half layout (GPT-NeoX / Llama / Qwen): pairs (i, i + d/2)."""

    def __init__(self, d_head: int, theta: float) -> None:
        super().__init__()
        inv = 1.0 / theta ** (torch.arange(0, d_head, 2, dtype=torch.float32) / d_head)
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [batch, pos, 1, d_head] for integer positions [batch, pos]."""
        angles = positions[..., None].float() * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
        return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [batch, pos, head, d_head]; norm-preserving, so q/k norms are unchanged."""
    h = x.shape[-1] // 2
    rotated = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos + rotated * sin
