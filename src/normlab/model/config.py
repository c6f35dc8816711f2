"""`ModelConfig`: every architectural choice of a normlab transformer in one small dataclass."""

from __future__ import annotations

import math
import struct
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from normlab.checks import check_int, check_real, did_you_mean, is_int

ARCHS = ("decoder", "encoder_decoder")
PLACEMENTS = ("none", "post", "pre", "qk", "qkv", "pre_qk")
NORM_TYPES = ("layer", "rms")
NORM_SCOPES = ("head", "all")
ATTN_SCALES = ("learned", "fixed")
POS_ENCODINGS = ("learned", "sinusoidal", "rope", "none")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu", "silu")
MLP_TYPES = ("standard", "gated")


@dataclass
class ModelConfig:
    """Shape and options of one model.

    `norm_placement` is the whole story of where norms go; see `normlab.model.block`.
    Defaults marked *our choice* are not from the paper and stay configurable.
    """

    arch: str = "decoder"
    vocab_size: int = 16
    d_model: int = 128
    n_heads: int = 4
    d_head: int | None = None  # default d_model // n_heads
    n_layers: int = 4  # decoder-only depth
    n_encoder_layers: int = 2
    n_decoder_layers: int = 2
    d_mlp: int | None = None  # default 4 * d_model
    max_len: int = 64
    dropout: float = 0.0
    pos_encoding: str = "learned"
    rope_theta: float = 10000.0
    norm_placement: str = "pre"
    norm_type: str = "layer"
    norm_eps: float = 1e-5
    norm_bias: bool = True  # LayerNorm bias (ignored by RMSNorm)
    qkv_norm_scope: str = "head"  # per head over d_head (our default) or whole projection
    attn_scale: str = "learned"  # only used where q and k are normalised
    attn_bias: bool = False
    mlp_bias: bool = False
    act: str = "gelu"
    mlp_type: str = "standard"
    n_kv_heads: int | None = None  # grouped-query attention; default n_heads
    norm_gain_offset: bool = False  # gain stored as w and applied as (1 + w), Gemma style
    tie_embeddings: bool = False
    # A second, task-supplied position index with its own learned table, added to the
    # embedding: e.g. digit significance (Abacus embeddings, McLeish et al. 2024). 0 = off.
    n_aux_positions: int = 0
    init_std: float = 0.02

    #: sizes `__post_init__` derives, where unset, from the fields named (a diff of two
    #: configs names the source before the size that followed it)
    DERIVED: ClassVar[dict[str, tuple[str, ...]]] = {
        "d_head": ("d_model", "n_heads"), "d_mlp": ("d_model",), "n_kv_heads": ("n_heads",)}

    def __post_init__(self) -> None:
        # derived sizes only from ints, as Python ints (numpy's uint8 200 * 4 would wrap):
        # anything else is left for `validate` to name
        d, h = (int(v) if is_int(v) else v for v in (self.d_model, self.n_heads))
        if self.d_head is None and is_int(d) and is_int(h) and h > 0 and d % h == 0:
            self.d_head = d // h
        if self.d_mlp is None and is_int(d):
            self.d_mlp = 4 * d
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        self.validate()

    def validate(self) -> None:
        """Raise a one-line ValueError naming the first bad field."""
        choices = {
            "arch": ARCHS,
            "norm_placement": PLACEMENTS,
            "norm_type": NORM_TYPES,
            "qkv_norm_scope": NORM_SCOPES,
            "attn_scale": ATTN_SCALES,
            "pos_encoding": POS_ENCODINGS,
            "act": ACTIVATIONS,
            "mlp_type": MLP_TYPES,
        }
        for name, allowed in choices.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(
                    f"ModelConfig.{name}: expected one of {', '.join(allowed)}; got {value!r}"
                )
        for name in (
            "vocab_size",
            "d_model",
            "n_heads",
            "n_layers",
            "n_encoder_layers",
            "n_decoder_layers",
            "d_mlp",
            "max_len",
            "n_kv_heads",
        ):
            # a tensor's sizes are int64: 2**63 is torch's "Overflow when unpacking long"
            setattr(self, name, check_int(getattr(self, name), f"ModelConfig.{name}", low=1,
                                          high=2**63, what="a positive integer below 2**63"))
        if self.d_head is None:
            raise ValueError(
                f"ModelConfig.d_model: expected a multiple of n_heads={self.n_heads} when d_head "
                f"is not given; got {self.d_model}"
            )
        self.d_head = check_int(self.d_head, "ModelConfig.d_head", low=1, high=2**63,
                                what="a positive integer below 2**63")
        if self.pos_encoding == "rope" and self.d_head % 2:
            raise ValueError(
                f"ModelConfig.d_head: expected an even number with pos_encoding='rope'; "
                f"got {self.d_head}"
            )
        self.n_aux_positions = check_int(self.n_aux_positions, "ModelConfig.n_aux_positions",
                                         what="an integer >= 0")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"ModelConfig.n_kv_heads: expected a divisor of n_heads={self.n_heads}; "
                f"got {self.n_kv_heads}"
            )
        # numpy's too, kept as a plain float for TOML and JSON
        self.dropout = check_real(self.dropout, "ModelConfig.dropout", what="a number in [0, 1)",
                                  ok=lambda v: 0 <= v < 1)
        for name in ("norm_eps", "rope_theta", "init_std"):  # NaN or inf: no model at all
            # as float32 holds it: 1e39 is inf there, and 1e-60 is 0 (an eps of 0 is 0/0)
            setattr(self, name, check_real(
                getattr(self, name), f"ModelConfig.{name}",
                what="a positive number float32 holds (1.4e-45 to 3.4e38)",
                ok=lambda v: 0 < _float32(v) < math.inf))
        for name in ("norm_bias", "attn_bias", "mlp_bias", "norm_gain_offset", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):  # "false" would be true
                raise ValueError(f"ModelConfig.{name}: expected true or false; got "
                                 f"{getattr(self, name)!r}")

    @property
    def normalises_qk(self) -> bool:
        return self.norm_placement in ("qk", "qkv", "pre_qk")

    @property
    def position_table(self) -> bool:
        """Positions are rows of a table of `max_len` (learned or sinusoidal): no position past
        it can be read, where RoPE and none have no bound."""
        return self.pos_encoding in ("learned", "sinusoidal")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Build from a plain dict, rejecting unknown keys with a one-line error."""
        known = {f.name for f in fields(cls)}
        for key in data:
            if key not in known:
                allowed = ", ".join(sorted(known))
                raise ValueError(f"ModelConfig: unknown field {key!r}"
                                 f"{did_you_mean(key, known)}; expected one of {allowed}")
        return cls(**data)


def _float32(value: float) -> float:
    """`value` rounded to float32: 0.0 below its smallest subnormal, inf past its largest."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.inf
