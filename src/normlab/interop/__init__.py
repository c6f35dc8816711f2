"""Bring models normlab did not train into normlab (same weights, same hook names)."""

from normlab.interop.hf import CONVERTERS, from_hf, from_hf_pretrained

__all__ = ["CONVERTERS", "from_hf", "from_hf_pretrained"]
