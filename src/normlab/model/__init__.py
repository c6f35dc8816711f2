"""The normlab transformer: one model, every normalisation placement, TransformerLens hooks."""

from normlab.model.block import PLACEMENTS, Block, Placement
from normlab.model.config import ModelConfig
from normlab.model.hooks import HookedModule, HookPoint
from normlab.model.transformer import DecoderLM, EncoderDecoderLM, KVCache, Model, build_model

__all__ = [
    "PLACEMENTS",
    "Block",
    "DecoderLM",
    "EncoderDecoderLM",
    "HookPoint",
    "HookedModule",
    "KVCache",
    "Model",
    "ModelConfig",
    "Placement",
    "build_model",
]
