"""`from_hf`: a Hugging Face causal LM as a normlab `DecoderLM` with the same weights.

Each supported family is a config translation plus a weight mapping into the
TransformerLens layout; every architectural feature lives in the normlab model itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from normlab.model import DecoderLM, ModelConfig, build_model

HF_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
          "relu": "relu", "silu": "silu"}


def _act(name: str) -> str:
    if name not in HF_ACT:
        raise ValueError(f"activation {name!r} is not supported; expected one of {sorted(HF_ACT)}")
    return HF_ACT[name]


def _gpt2(hf: Any) -> DecoderLM:
    c = hf.config
    d, h = c.n_embd, c.n_head
    e = d // h
    cfg = ModelConfig(
        arch="decoder", vocab_size=c.vocab_size, d_model=d, n_heads=h, n_layers=c.n_layer,
        d_mlp=c.n_inner or 4 * d, max_len=c.n_positions, pos_encoding="learned",
        norm_placement="pre", norm_type="layer", norm_eps=c.layer_norm_epsilon,
        attn_bias=True, mlp_bias=True, act=_act(c.activation_function), tie_embeddings=True,
    )
    model = build_model(cfg)
    sd = hf.state_dict()
    new: dict[str, torch.Tensor] = {
        "embed.W_E": sd["transformer.wte.weight"],
        "pos_embed.W_pos": sd["transformer.wpe.weight"],
        "ln_final.w": sd["transformer.ln_f.weight"],
        "ln_final.b": sd["transformer.ln_f.bias"],
    }
    for i in range(c.n_layer):
        src, dst = f"transformer.h.{i}.", f"blocks.{i}."
        W = sd[src + "attn.c_attn.weight"]  # Conv1D: [d, 3d]
        bias = sd[src + "attn.c_attn.bias"]
        for j, name in enumerate("QKV"):
            new[dst + f"attn.W_{name}"] = W[:, j * d:(j + 1) * d].reshape(d, h, e).permute(1, 0, 2)
            new[dst + f"attn.b_{name}"] = bias[j * d:(j + 1) * d].reshape(h, e)
        new[dst + "attn.W_O"] = sd[src + "attn.c_proj.weight"].reshape(h, e, d)
        new[dst + "attn.b_O"] = sd[src + "attn.c_proj.bias"]
        for k in ("1", "2"):
            new[dst + f"ln{k}.w"] = sd[src + f"ln_{k}.weight"]
            new[dst + f"ln{k}.b"] = sd[src + f"ln_{k}.bias"]
        new[dst + "mlp.W_in"] = sd[src + "mlp.c_fc.weight"]
        new[dst + "mlp.b_in"] = sd[src + "mlp.c_fc.bias"]
        new[dst + "mlp.W_out"] = sd[src + "mlp.c_proj.weight"]
        new[dst + "mlp.b_out"] = sd[src + "mlp.c_proj.bias"]
    model.load_state_dict(new, strict=True)
    return model


CONVERTERS: dict[str, Callable[[Any], DecoderLM]] = {"GPT2LMHeadModel": _gpt2}


def from_hf(hf_model: Any) -> DecoderLM:
    """Convert a loaded Hugging Face causal LM; the output is in float32 eval mode."""
    name = type(hf_model).__name__
    if name not in CONVERTERS:
        raise ValueError(
            f"architecture {name!r} is not supported; expected one of {', '.join(CONVERTERS)}"
        )
    with torch.no_grad():
        model = CONVERTERS[name](hf_model.float())
    return model.eval()
