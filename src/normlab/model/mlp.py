"""Position-wise MLP: standard (GPT) or gated (Llama/Qwen SwiGLU), TransformerLens layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from normlab.model import native
from normlab.model.config import ModelConfig
from normlab.model.hooks import HookPoint

ACT = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}


class MLP(nn.Module):
    """`W_in` [d_model, d_mlp], `W_out` [d_mlp, d_model]; gated adds `W_gate` [d_model, d_mlp]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, m = cfg.d_model, cfg.d_mlp
        self.act = ACT[cfg.act]
        self.gated = cfg.mlp_type == "gated"
        # exact GELU after W_in: a training step may take `native.linear_gelu`
        self.linear_gelu = cfg.act == "gelu" and not self.gated
        self.W_in = nn.Parameter(torch.empty(d, m))
        self.W_out = nn.Parameter(torch.empty(m, d))
        self.W_gate = nn.Parameter(torch.empty(d, m)) if self.gated else None
        self.b_in = nn.Parameter(torch.zeros(m)) if cfg.mlp_bias else None
        self.b_out = nn.Parameter(torch.zeros(d)) if cfg.mlp_bias else None
        self.hook_pre = HookPoint()  # pre-activation (the gate's, when gated)
        if self.gated:
            self.hook_pre_linear = HookPoint()
        self.hook_post = HookPoint()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (self.linear_gelu and not self.hook_pre.fns
                and native.linear_gelu_applies(x, self.W_in, self.b_in)):
            # under autograd on CPU: one Function whose backward's GELU is one multiply
            # (`native.linear_gelu`); nobody reads the pre-activation it does not return
            post = native.linear_gelu(x, self.W_in, self.b_in)
        else:
            h = x @ self.W_in
            if self.b_in is not None:
                h = h + self.b_in
            if self.gated:
                post = self.act(self.hook_pre(x @ self.W_gate)) * self.hook_pre_linear(h)
            else:
                post = self.act(self.hook_pre(h))
        out = self.hook_post(post) @ self.W_out
        return out if self.b_out is None else out + self.b_out
