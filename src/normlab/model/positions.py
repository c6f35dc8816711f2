"""Positional encodings: learned table, sinusoidal table, or rotary (RoPE) on q and k; and
`lookup`, the one way every embedding table is read (token and digit-position tables too)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from normlab.model import native
from normlab.model.config import ModelConfig


def lookup(table: torch.Tensor, ids: torch.Tensor, what: str = "ids") -> torch.Tensor:
    """Rows `table[ids]` of an embedding table [n, d] for integer ids [...] -> [..., d].

    `F.embedding`, not `table[ids]`: the same forward, but on CPU the backward of indexing is
    a parallel `index_put_(accumulate=True)` that, with more than one thread, adds the many
    gradients of a small vocabulary (16 tokens, 8 digit positions) in a varying order, so
    training was not bitwise reproducible, and took 5-7x longer than `F.embedding`'s backward
    (0.69-0.92 ms against 0.13 ms on a [128, 17] batch, two threads;
    `benchmarks/probes/embedding_backward.py`). On one thread both give the same gradients.
    An id outside [0, n) is an IndexError naming `what` (indexing wrapped negative ids round),
    ids that are not integers a ValueError naming it (torch's error named an "argument #1").
    """
    try:
        return F.embedding(ids, table)
    except IndexError as err:
        raise IndexError(f"{what}: expected ids in [0, {table.shape[0]}), got values from "
                         f"{int(ids.min())} to {int(ids.max())}") from err
    except RuntimeError as err:
        if ids.dtype in (torch.long, torch.int):
            raise
        raise ValueError(f"{what}: expected integer ids (int64 or int32); got {ids.dtype}") from err


def sinusoidal_table(max_len: int, d: int) -> torch.Tensor:
    """Vaswani et al.'s table in float64, for a model to round to its dtype: in float32 the
    angle `pos * freq` drifted from the formula as positions grew (1.5e-4 at 4096 positions of
    width 64, 3e-8 once rounded from this)."""
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]
    freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float64) * (-math.log(10000.0) / d))
    table = torch.zeros(max_len, d, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * freq)
    table[:, 1::2] = torch.cos(pos * freq)[:, : d // 2]
    return table


class ExactBuffers(nn.Module):
    """A module whose fixed buffers follow its device and dtype from their float64 values: a
    cast rounded a buffer, so a float64 model read float32's values (the sinusoidal table, the
    logit scale 1/sqrt(d_head), RoPE's frequencies), and a round trip through bfloat16 kept
    bfloat16's."""

    def __init__(self) -> None:
        super().__init__()
        self._exact: dict[str, torch.Tensor] = {}  # float64 values, by buffer name

    def register_exact(self, name: str, values: torch.Tensor) -> None:
        """A buffer (not saved) of float64 `values`, in the default dtype (as the parameters
        are made) until the module is cast: a model built under a float64 default reads them
        exact."""
        self._exact[name] = values
        self.register_buffer(name, values.to(torch.get_default_dtype()), persistent=False)

    def _apply(self, fn: Any, recurse: bool = True) -> ExactBuffers:
        super()._apply(fn, recurse)
        for name, values in self._exact.items():
            buf = getattr(self, name)
            setattr(self, name, values.to(buf.device, buf.dtype))
        return self


class PosEmbed(ExactBuffers):
    """Additive position table [max_len, d_model] (learned `W_pos` or fixed sinusoidal)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.max_len = cfg.max_len
        if cfg.pos_encoding == "learned":
            self.W_pos = nn.Parameter(torch.empty(cfg.max_len, cfg.d_model))
        else:
            self.register_exact("W_pos", sinusoidal_table(cfg.max_len, cfg.d_model))

    def forward(self, positions: torch.Tensor, bound: int | None = None) -> torch.Tensor:
        """The table's rows for integer positions [batch, pos]; one past its end is a one-line
        error, not an IndexError. `bound`, when the caller knows one, is an upper bound on the
        positions: below the table's end it spares reading their largest back from the device
        (a GPU would wait there for all the work queued before this forward)."""
        if bound is not None and bound < self.max_len:
            return lookup(self.W_pos, positions, "positions")
        top = int(positions.max()) if positions.numel() else 0
        if top >= self.max_len:
            raise ValueError(
                f"position {top} is beyond ModelConfig.max_len={self.max_len}; "
                "raise max_len or use pos_encoding='rope'"
            )
        return lookup(self.W_pos, positions, "positions")


class Rope:
    """One forward's rotary tables, and the rotation of q or k by them.

    `cos` and `sin` are [batch, pos, 1, d_head] (rotate-half layout, so each is two copies of
    a d_head/2 table). On CPU the rotation runs normlab's native kernel (`native.rope`: one
    pass, bitwise these torch ops) wherever it is built, from ROPE_MIN_ELEMENTS up. The kernel
    writes q and k head-major (a [batch, pos, head, d_head] view of [batch, head, pos, d_head]
    memory), so attention's matmuls read them, and its backward reads their gradients, without
    a copy. torch's ops (`native.torch_rope`) are the reference and the path everywhere else;
    two layout choices make them cheap on CPU, with the very same numbers as the textbook
    `x * cos + cat(-x2, x1) * sin` (`tests/test_positions.py`):

    - the tables are widened to [batch, pos, heads, d_head] once per head count per forward
      (every layer's q and k reuse them): a multiply broadcast over the head dim leaves ATen
      a 16-float inner loop, 3.4x slower than a same-shape one at d_head 16;
    - `cat(-x2, x1) * sin` is computed as `roll(x * sin', d_head/2)` with `sin' = cat(s, -s)`:
      one roll instead of a negation and a cat of strided halves, and a cheaper backward.
    Together: forward+backward of one rotation 2.2x (one thread) and 2.9x (two) faster on
    [128, 17, 4, 16] (`benchmarks/probes/rope.py`).
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        h = sin.shape[-1] // 2
        self.cos, self.sin = cos, torch.cat([sin[..., :h], -sin[..., h:]], dim=-1)
        self._wide: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [batch, pos, head, d_head]; norm-preserving, so q/k norms are unchanged."""
        if native.rope_applies(x, self.cos, self.sin):
            return native.rope(x, self.cos, self.sin, head_major=True)
        n = x.shape[-2]
        if n not in self._wide:
            shape = (*self.cos.shape[:-2], n, self.cos.shape[-1])
            self._wide[n] = (self.cos.expand(shape).contiguous(),
                             self.sin.expand(shape).contiguous())
        return native.torch_rope(x, *self._wide[n])


class Rotary(ExactBuffers):
    """RoPE in the rotate-half layout (GPT-NeoX / Llama / Qwen): pairs (i, i + d/2)."""

    def __init__(self, d_head: int, theta: float) -> None:
        super().__init__()
        self.d_head, self.theta = d_head, theta
        self._float32: dict[torch.device, torch.Tensor] = {}  # float32 frequencies per device
        # the buffer follows the model's device and dtype (the tables' dtype); float64 models
        # take their frequencies from it (computed in float64), the others from float32's
        exponents = torch.arange(0, d_head, 2, dtype=torch.float64, device="cpu") / d_head
        self.register_exact("inv_freq", 1.0 / theta**exponents)

    def _float32_inv_freq(self, device: torch.device) -> torch.Tensor:
        """The frequencies computed in float32, as every float32 model's tables always were."""
        if device not in self._float32:
            e = torch.arange(0, self.d_head, 2, dtype=torch.float32, device=device) / self.d_head
            self._float32[device] = 1.0 / self.theta**e
        return self._float32[device]

    def forward(self, positions: torch.Tensor) -> Rope:
        """The rotation for integer positions [batch, pos] (tables [batch, pos, 1, d_head]).
        The angles are float32 (float64 for a float64 model) from frequencies no cast has
        rounded: `model.to(bfloat16)` rounds the buffer, which put position 1000 off by
        radians, and a round trip back to float32 kept it so; a float64 model's were float32's
        cast up (6e-8 off, position 4000's angles 8e-6 rad). A half-precision model gets
        its tables in its own dtype (float32 ones promoted q and k but not v)."""
        buf = self.inv_freq
        inv = buf if buf.dtype == torch.float64 else self._float32_inv_freq(buf.device)
        angles = positions[..., None].float() * inv
        angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
        cos, sin = angles.cos(), angles.sin()
        half = buf.dtype in (torch.float16, torch.bfloat16)
        return Rope(cos.to(buf.dtype), sin.to(buf.dtype)) if half else Rope(cos, sin)
