"""Bring models normlab did not train into normlab (same weights, same hook names)."""

from normlab.interop.hf import from_hf

__all__ = ["from_hf"]
