"""normlab: normalisation placement, semantic subspaces and circuit collapse in transformers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from normlab.model import KVCache, ModelConfig, build_model

__version__ = "0.1.0"
__all__ = ["KVCache", "ModelConfig", "__version__", "build_model"]


def __getattr__(name: str) -> Any:
    """The model's names, imported on first use: importing them here imported torch before the
    `normlab` command could parse its arguments (`--help` took seconds, and a Ctrl-C in them
    printed a traceback)."""
    if name in ("KVCache", "ModelConfig", "build_model"):
        import normlab.model

        return getattr(normlab.model, name)
    raise AttributeError(f"module 'normlab' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The lazy names too, for tab completion."""
    return sorted({*__all__, *(n for n in globals() if n.startswith("__"))})
