"""Multi-head attention in the TransformerLens weight layout, with optional q/k/v norms.

Weights: `W_Q` [n_heads, d_model, d_head], `W_K`/`W_V` [n_kv_heads, d_model, d_head],
`W_O` [n_heads, d_head, d_model]. Whether q, k, v are normalised after the projections is
decided by the block (see `normlab.model.block`); this module only applies what it is given.

Hook points (all [batch, pos, head, d_head] unless noted):
  hook_q_pre_norm / hook_k_pre_norm / hook_v_pre_norm  projections before QK/QKV-Norm
      (only present where that vector is normalised)
  hook_q / hook_k / hook_v   the vectors actually used in scores and mixing (after the norm;
      TransformerLens' hook_q fires *before* its QK-norm, ours after)
  hook_rot_q / hook_rot_k    after RoPE (only with pos_encoding='rope'; not cross-attention)
  hook_attn_scores [batch, head, qpos, kpos]  scaled, masked, pre-softmax
  hook_pattern     [batch, head, qpos, kpos]  softmax
  hook_z           [batch, qpos, head, d_head] pattern-weighted values
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from normlab.model import native
from normlab.model.config import ModelConfig
from normlab.model.hooks import HookPoint
from normlab.model.norms import Norm, autocast_half, autocasting
from normlab.model.positions import ExactBuffers, Rope

EXPLICIT_MAX_KEYS_CPU = 64
"""Up to this many keys, attention on CPU runs the explicit scores/softmax path even when no
hook reads it, because there it beats SDPA's CPU flash kernel: forward+backward 1.4-1.7x
(one thread) and 2.2-3.4x (two threads) faster at the 17-24 keys of training. The measured
crossovers are ~48 keys (one thread) and ~96 (two); 64 sits between them
(`benchmarks/probes/attn_path.py`, Intel; on AMD EPYC the explicit path was faster at 17 keys
and slower from 32 on one thread, `benchmarks/probes/attention_keys.py`). With no hook reading
it, that path's arithmetic runs in normlab's kernel (`native.attention`, 2.6-2.7x faster
again), whose backward keeps the [batch, head, T, S] pattern (the explicit path keeps the
scores too). Longer rows take SDPA, but for the causal ones the kernel still takes
(`KERNEL_BOUNDS_CPU`); every GPU takes SDPA."""

KERNEL_BOUNDS_CPU: tuple[tuple[int, int], ...] = ((256, 8192), (512, 4096))
"""Past `EXPLICIT_MAX_KEYS_CPU` keys, a causal attention's rows (a decoder's self-attention, with or
without each row's padding) still take `native.attention` within any one of these bounds (keys, keys
x d_head): 256 keys of d_head 16 or 32, 128 of 64; 512 of d_head 8 or less (341 to 273 of 12 to 15).
There the kernel, which skips the keys a causal mask hides, was faster than SDPA's CPU kernel or
level with it, forward and backward and the forward alone, on one thread and two
(`benchmarks/probes/attention_range.py` and `attention_width_rule.py` on AMD EPYC; every cell in
docs/performance.md, twenty-ninth to thirty-first sections). At 384 keys padded rows of d_head 16
and rows of d_head 32 and 64 were mostly slower (0.69-0.98x in three runs), hence the first bound's
key count; its 8192 key floats are the eight rows' keys and values the kernel holds at once (8 x
8192 x 2 floats, 512 KiB, half of a core's L2 there). Narrow heads stay well ahead to 512 keys
(d_head 4 and 8: 1.18-4.21x, padded d_head 8 rows included; a d_head 8 decoder's training step and
forward 1.70-2.50x faster than under the first bound alone), hence the second bound, whose 4096 key
floats leave d_head 16 out (0.79-1.53x at 384 and 512 keys) and let d_head 12 to 15 reach 341 to 273
keys (1.38-2.96x from 256 keys to there). An encoder's rows and cross-attention's stop at 64 keys:
no causal mask hides keys there for the kernel to skip, and with no mask SDPA was as fast or faster
at 64 keys (0.89-0.95x) and faster beyond on one thread. The kernel's backward keeps the weights, T
x S floats a (batch, head) row (256 KiB at 256 keys, 1 MiB at 512), where SDPA keeps one float a
query."""


SOFTMAX_MIN_KEYS_CPU = 16
"""On CPU, `softmax_rows` pads rows shorter than this with -inf keys. ATen's CPU softmax over
the last dim runs 12-15 ns per element (one thread) on rows shorter than one AVX-512 vector
(16 floats) against ~1.3 ns on 16-key rows, so the padded row, up to 3x longer, is still
faster: at 5-15 keys, forward 3.9-10.7x and forward+backward 1.9-7.3x, one or two threads
(`benchmarks/probes/softmax_rows.py`). The length groups of a collapse sweep and the prompts
of decoding are that short; training's 17-key rows are not. 0 switches the padding off."""


def softmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """`scores.softmax(-1)`, with short CPU rows padded (`SOFTMAX_MIN_KEYS_CPU`).

    A padded key gets exp(-inf) = 0, so the real keys' weights are those of the unpadded row
    (up to rounding, ~1e-7: another kernel); the result is a [..., :n_keys] view.
    """
    n_keys = scores.shape[-1]
    if scores.device.type != "cpu" or n_keys >= SOFTMAX_MIN_KEYS_CPU:
        return scores.softmax(-1)
    padded = F.pad(scores, (0, SOFTMAX_MIN_KEYS_CPU - n_keys), value=float("-inf"))
    return padded.softmax(-1)[..., :n_keys]


def explicit_by_default(device: torch.device, n_keys: int) -> bool:
    """Whether rows of `n_keys` keys take the explicit path even when no hook reads it."""
    return device.type == "cpu" and n_keys <= EXPLICIT_MAX_KEYS_CPU


def pattern_formed_anyway(w: torch.Tensor, n_keys: int) -> bool:
    """Whether a layer with weights `w` forms its [batch, head, T, S] pattern on rows of `n_keys`
    keys even when no hook reads it: the explicit path, with `native.attention` not there to
    take its arithmetic (switched off or not built, weights other than float32, CPU autocast).
    Where it is not, a hook on the pattern sends the layer off SDPA or the kernel."""
    return explicit_by_default(w.device, n_keys) and not (
        native.enabled("attention") and w.dtype is torch.float32
        and not torch.is_autocast_enabled("cpu"))


def kernel_by_default(q: torch.Tensor, k: torch.Tensor, causal: bool) -> bool:
    """Whether q [batch, head, T, d_head] over k [batch, head, S, d_head] takes
    `native.attention` on CPU when no hook reads the scores or pattern (and the kernel
    applies): wherever the explicit path would run, and past it a causal attention's rows
    (`Attention.causal` self-attention: a decoder's, padded or not) within one of
    `KERNEL_BOUNDS_CPU`'s (keys, key floats) bounds."""
    n_keys = k.shape[-2]
    return explicit_by_default(q.device, n_keys) or (
        q.device.type == "cpu" and causal
        and any(n_keys <= keys and n_keys * q.shape[-1] <= floats
                for keys, floats in KERNEL_BOUNDS_CPU))


class HeadNorm(Norm):
    """QK/QKV-Norm on [batch, pos, head, d_head]: per head (`head`) or whole projection (`all`).

    Per head, the gain [d_head] is shared by all heads (as Qwen3/Gemma 3); over the whole
    projection (`all`, as OLMo 2) the gain is [n_heads * d_head].
    """

    def __init__(self, cfg: ModelConfig, n_heads: int) -> None:
        dim = cfg.d_head if cfg.qkv_norm_scope == "head" else n_heads * cfg.d_head
        super().__init__(dim, cfg.norm_type, cfg.norm_eps, cfg.norm_bias, cfg.norm_gain_offset)
        self.scope = cfg.qkv_norm_scope

    def forward(self, x: torch.Tensor, head_major: bool = False) -> torch.Tensor:
        if self.scope == "head":
            return super().forward(x, head_major)
        return super().forward(x.flatten(-2)).unflatten(-1, x.shape[-2:])

    def rotated(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        return super().rotated(x, rope) if self.scope == "head" else rope(self(x))


def learned_scale_init(cfg: ModelConfig) -> float:
    """Initial logit scale for normalised q, k (*our choice*, after Henry et al. 2020).

    Normalised q and k have norm ~sqrt(d_head), so q.k lies in [-d_head, d_head]. We start
    the scale at log2(L^2 - L) / d_head (L = max_len): the largest logit is then
    log2(L^2 - L), large enough that a head can put nearly all its mass on one of L keys.
    """
    length = max(cfg.max_len, 2)
    return math.log2(length * length - length) / cfg.d_head


class Attention(ExactBuffers):
    def __init__(
        self, cfg: ModelConfig, *, causal: bool, qk_norm: bool = False, v_norm: bool = False,
        rotary: bool = True,
    ) -> None:
        """`rotary=False` for cross-attention, which RoPE never rotates: it then has no
        `hook_rot_*`, which would be listed and never fire."""
        super().__init__()
        h, kvh, d, e = cfg.n_heads, cfg.n_kv_heads, cfg.d_model, cfg.d_head
        self.n_heads, self.n_kv_heads, self.d_head, self.causal = h, kvh, e, causal
        self.W_Q = nn.Parameter(torch.empty(h, d, e))
        self.W_K = nn.Parameter(torch.empty(kvh, d, e))
        self.W_V = nn.Parameter(torch.empty(kvh, d, e))
        self.W_O = nn.Parameter(torch.empty(h, e, d))
        if cfg.attn_bias:
            self.b_Q = nn.Parameter(torch.zeros(h, e))
            self.b_K = nn.Parameter(torch.zeros(kvh, e))
            self.b_V = nn.Parameter(torch.zeros(kvh, e))
            self.b_O = nn.Parameter(torch.zeros(d))
        else:
            self.b_Q = self.b_K = self.b_V = self.b_O = None
        self.q_norm = HeadNorm(cfg, h) if qk_norm else None
        self.k_norm = HeadNorm(cfg, kvh) if qk_norm else None
        self.v_norm = HeadNorm(cfg, kvh) if v_norm else None
        if qk_norm and cfg.attn_scale == "learned":
            self.scale = nn.Parameter(torch.full((h,), learned_scale_init(cfg)))
        else:  # exact in the model's dtype (a float64 model's was float32's cast up, 2e-8 off)
            self.register_exact("scale", torch.full((h,), 1.0 / math.sqrt(e), dtype=torch.float64))
        self.dropout = cfg.dropout
        self.fused = True  # SDPA allowed when no hook reads the scores or the pattern
        for name in ("q", "k", "v"):
            if getattr(self, f"{name}_norm") is not None:
                setattr(self, f"hook_{name}_pre_norm", HookPoint())
        self.hook_q, self.hook_k, self.hook_v = HookPoint(), HookPoint(), HookPoint()
        if cfg.pos_encoding == "rope" and rotary:
            self.hook_rot_q, self.hook_rot_k = HookPoint(), HookPoint()
        self.hook_attn_scores = HookPoint()
        self.hook_pattern = HookPoint()
        self.hook_z = HookPoint()

    def _linear(self, x: torch.Tensor, names: str) -> list[torch.Tensor]:
        """x [batch, pos, d_model] -> the projections `names` ("qkv", "kv" or one letter),
        each [batch, pos, head, d_head], with its bias if configured.

        Under autocast (`train.precision = "bfloat16"`) they come from one matmul with the
        weights side by side, as nanoGPT's `c_attn`: x is cast to bfloat16 once, not once per
        projection, and x's gradient is one matmul, not three and their sum: a bfloat16
        training step ran 4.5-7.3% faster. Not where a hook reads a projection or its norm's
        input: it then gets the tensor its own matmul made, as before (the one matmul's are
        views of one output, which an in-place hook could not change under autograd). In
        float32 one matmul gained nothing on CPU (the split views cost QK/QKV-Norm a copy
        each; `benchmarks/probes/fused_qkv_ab.py`), so there each projection keeps its own.
        """
        Ws = [getattr(self, f"W_{n.upper()}") for n in names]  # each [head, d_model, d_head]
        if len(Ws) > 1 and autocasting(x.device) and not self._read_as_made(names):
            W_all = torch.cat([W.transpose(0, 1) for W in Ws], dim=1).flatten(1)
            ys = (x @ W_all).split([W.shape[0] * W.shape[2] for W in Ws], dim=-1)
        else:
            ys = [x @ W.transpose(0, 1).flatten(1) for W in Ws]
        out = []
        for n, W, y in zip(names, Ws, ys, strict=True):
            y = y.unflatten(-1, (W.shape[0], W.shape[2]))
            b = getattr(self, f"b_{n.upper()}")
            out.append(y if b is None else y + b)
        return out

    def _read_as_made(self, names: str) -> bool:
        """Whether a hook reads one of these projections as its matmul made it: `hook_{n}`,
        or `hook_{n}_pre_norm` where a norm follows."""
        points = [getattr(self, f"hook_{n}{at}", None) for n in names for at in ("", "_pre_norm")]
        return any(p is not None and p.fns for p in points)

    def _project(
        self, y: torch.Tensor, name: str, head_major: bool = False, rope: Rope | None = None
    ) -> torch.Tensor:
        """A projection y [batch, pos, head, d_head] (`_linear`'s) -> normalised if configured,
        then rotated by `rope` if given (its `hook_rot_*` is the caller's, so that hooks fire
        in their usual order); `head_major` asks the norm for head-major memory (a view;
        `native.norm`) when no hook reads the vector."""
        norm, hook = getattr(self, f"{name}_norm"), getattr(self, f"hook_{name}")
        if norm is not None:
            y = getattr(self, f"hook_{name}_pre_norm")(y)
            if rope is not None and not hook.fns:
                # nobody reads the vector between its norm and its rotation: one kernel call
                # does both where the kernels run (`Norm.rotated`)
                return norm.rotated(y, rope)
            # a hook on the vector gets it contiguous, as it always did (`.view` works on it)
            y = norm(y, head_major and not hook.fns)
        y = hook(y)
        return y if rope is None else rope(y)

    def forward(
        self,
        x: torch.Tensor,
        *,
        memory: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        rope: Rope | None = None,
        cache: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x [batch, qpos, d_model] -> [batch, qpos, d_model].

        `memory` makes this cross-attention (keys/values from the encoder output).
        `mask` is boolean, True where a query may attend, broadcastable to
        [batch, head, qpos, kpos]. `cache` holds keys/values of earlier steps (decoding),
        head-major: [batch, head, kpos, d_head].
        """
        # q, k, v come out of the kernels head-major, as attention reads them: normalised v
        # from the norm's; q and k from RoPE's, or from the norm's without RoPE, or from the
        # norm's call that also rotates them (QK-Norm with RoPE).
        if memory is None:  # self-attention
            yq, yk, yv = self._linear(x, "qkv")
        else:
            (yq,) = self._linear(x, "q")
        q = self._project(yq, "q", head_major=rope is None, rope=rope)
        if memory is not None and cache is not None and "k" in cache:
            k, v = cache["k"], cache["v"]
        else:
            if memory is not None:
                yk, yv = self._linear(memory, "kv")
            k = self._project(yk, "k", head_major=rope is None, rope=rope)
            v = self._project(yv, "v", head_major=True)
            if rope is not None:
                k = self.hook_rot_k(k)
            # Keys/values go head-major, [batch, head, kpos, d_head], as the kernels read them;
            # the cache keeps them in that layout, so a decoding step appends to it and reads
            # it with no transposed copy.
            k, v = k.transpose(1, 2), v.transpose(1, 2)
            if cache is not None and memory is None:
                k, v = append_kv(cache, k, v)
            elif cache is not None:
                cache["k"], cache["v"] = k, v = k.contiguous(), v.contiguous()
        if rope is not None:
            q = self.hook_rot_q(q)
        q = q.transpose(1, 2)  # [batch, head, qpos, d_head]
        scale = self.scale.to(q.dtype)
        p_drop = self.dropout if self.training else 0.0
        hooked = not self.fused or self.hook_attn_scores.fns or self.hook_pattern.fns
        if not hooked and not p_drop and native.attend_applies(q, k, v, scale, mask):
            # one query a row (a decoding step): one pass in normlab's kernel, grouped
            # key/value heads read in place
            return self._out(native.attend(q, k, v, scale, mask))
        if self.n_kv_heads != self.n_heads:
            rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if (not hooked and not p_drop and kernel_by_default(q, k, self.causal and memory is None)
                and native.attention_applies(q, k, v, scale, mask)):
            # the explicit path's short CPU rows (and longer causal ones), no hook reading
            # them: its eight ops forward and back in one kernel pass each, eight rows side
            # by side (`native.attention`)
            return self._out(native.attention(q, k, v, scale, mask))
        if not (hooked or explicit_by_default(q.device, k.shape[-2])):
            if isinstance(self.scale, nn.Parameter):  # a scale per head: fold it into q
                q, sdpa_scale = q * scale[:, None, None], 1.0
            else:  # one fixed scale: SDPA applies it in its kernel, no extra pass over q
                sdpa_scale = 1.0 / math.sqrt(self.d_head)
            z = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p_drop, scale=sdpa_scale
            )
        else:
            scores = q @ k.transpose(-1, -2)
            if autocast_half(scores):  # mixed precision: scale, mask, softmax in float32
                scores, scale = scores.float(), self.scale.float()  # (`autocast_half`: why)
            if mask is None:
                scores = scores * scale[:, None, None]
            else:  # scale and mask in one pass; + 0 / + -inf equals a masked_fill bit for bit
                bias = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
                bias.masked_fill_(~mask, float("-inf"))
                scores = torch.addcmul(bias, scores, scale[:, None, None])
            scores = self.hook_attn_scores(scores)
            pattern = self.hook_pattern(softmax_rows(scores))
            if p_drop:
                pattern = F.dropout(pattern, p_drop)
            z = pattern @ v
        return self._out(z)

    def _out(self, z: torch.Tensor) -> torch.Tensor:
        """z [batch, head, qpos, d_head] -> hook_z -> W_O: [batch, qpos, d_model]."""
        z = self.hook_z(z.transpose(1, 2))  # [batch, qpos, head, d_head]
        out = z.flatten(-2) @ self.W_O.flatten(0, 1)
        return out if self.b_O is None else out + self.b_O


def append_kv(
    cache: dict[str, torch.Tensor], k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Append keys/values [batch, head, new, d_head] to a block's cache; return all of them.

    They live in buffers with room to grow, and `cache["k"]`, `cache["v"]` are views of the
    filled part, so a decoding step writes its one position in place where `torch.cat` would
    copy the whole cache (and fault in fresh pages) in every block at every step. A buffer holds
    `cache["reserve"]` positions when one is set (`KVCache.empty(n, capacity)`: greedy decoding
    knows its final length), else twice what it is first given, and doubles when full. A step
    writes in place only at the buffer's frontier (`cache["filled"]`, shared by shallow copies
    of the dict), so a copied cache extended twice, two continuations of one prompt, gets a
    buffer of its own instead of overwriting the other's; and only while `cache["k"]` and
    `cache["v"]` are still the buffers' views, so keys a caller put in their place (a beam
    reordered, keys patched) are the ones extended. Under autograd (a differentiable decode)
    the cache concatenates instead: earlier steps' views must stay as autograd saved them.
    """
    past = cache.get("k")
    if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
        # autograd keeps the views earlier steps read, so nothing is written into them: a
        # differentiable decode concatenates, as before the buffers
        if past is not None:
            k, v = torch.cat([past, k], 2), torch.cat([cache["v"], v], 2)
        for key in ("buf_k", "buf_v", "filled"):
            cache.pop(key, None)
        cache["k"], cache["v"] = k, v = k.contiguous(), v.contiguous()
        return k, v
    n = 0 if past is None else past.shape[2]
    end = n + k.shape[2]
    buf_k, buf_v, filled = cache.get("buf_k"), cache.get("buf_v"), cache.get("filled")
    fits = (buf_k is not None and buf_v is not None and filled is not None
            and int(filled) == n and past is not None
            # still the buffers' heads: a caller may have put other keys in their place
            # (a beam reordered, keys patched), which a step must extend, not ignore
            and _head_of(past, buf_k) and _head_of(cache["v"], buf_v)
            and buf_k.shape[2] >= end and buf_k.shape[:2] == k.shape[:2]
            and buf_k.shape[3] == k.shape[3] and buf_k.dtype == k.dtype
            # inference tensors cannot be written outside inference mode
            and (torch.is_inference_mode_enabled() or not buf_k.is_inference()))
    if not fits:
        reserve = int(cache["reserve"]) if "reserve" in cache and buf_k is None else 0
        size = reserve if reserve >= end else 2 * end
        b, h, _, e = k.shape
        buf_k, buf_v = k.new_empty(b, h, size, e), v.new_empty(b, h, size, e)
        if past is not None:
            buf_k[:, :, :n], buf_v[:, :, :n] = past, cache["v"]
        filled = torch.zeros((), dtype=torch.long)
        cache["buf_k"], cache["buf_v"], cache["filled"] = buf_k, buf_v, filled
    assert buf_k is not None and buf_v is not None and filled is not None
    buf_k[:, :, n:end], buf_v[:, :, n:end] = k, v
    filled.fill_(end)
    cache["k"], cache["v"] = buf_k[:, :, :end], buf_v[:, :, :end]
    return cache["k"], cache["v"]


def _head_of(t: torch.Tensor, buf: torch.Tensor) -> bool:
    """Whether t is still the view `buf[:, :, :n]` that `append_kv` left in the cache."""
    return (t.data_ptr() == buf.data_ptr() and t.stride() == buf.stride()
            and t.device == buf.device and t.shape[:2] == buf.shape[:2])
