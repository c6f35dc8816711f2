"""normlab: normalisation placement, semantic subspaces and circuit collapse in transformers."""

from normlab.model import KVCache, ModelConfig, build_model

__version__ = "0.1.0"
__all__ = ["KVCache", "ModelConfig", "__version__", "build_model"]
