"""One-off probe behind a twenty-fifth-session note in docs/performance.md; not part of make
bench.

What the twenty-fifth session's restructuring of `Attention` (`_linear` then `_project`, in
place of one `_project` per vector) costs in float32, where it runs the same three matmuls:
the attention forward as it was at `6ded961` (copied below) against today's, switched off and
on, alternating in one process (15 rounds): a batch-1 forward of the collapse sweep's naive
loop (qkv, random weights; its per-op overhead), the cached n5d1 decode, and the `pre` and
`qkv` training steps at d64.

    .venv/bin/python benchmarks/probes/projection_refactor_ab.py [THREADS]
"""
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import N5d1Decoder, ab, probe_header, threads_from_argv
from bench_collapse import eval_data, random_model
from bench_train_step import base_config, build_contender, model_config, real_batch

from normlab import allocator
from normlab.model import native
from normlab.model.attention import (
    Attention,
    append_kv,
    explicit_by_default,
    softmax_rows,
)
from normlab.model.norms import autocast_half
from normlab.model.positions import Rope

allocator.keep_freed_memory()
threads_from_argv("projection_refactor_ab.py")
probe_header("Attention at 6ded961 against today's, float32, A/B")
NEW = (Attention._project, Attention.forward)


# ---- Attention._project and Attention.forward as they were at 6ded961 ----------------------
def old_project(
    self, x: torch.Tensor, name: str, head_major: bool = False, rope: Rope | None = None
) -> torch.Tensor:
    """x [batch, pos, d_model] -> [batch, pos, head, d_head], normalised if configured,
    then rotated by `rope` if given (its `hook_rot_*` is the caller's, so that hooks fire
    in their usual order); `head_major` asks the norm for head-major memory (a view;
    `native.norm`) when no hook reads the vector."""
    W, b = getattr(self, f"W_{name.upper()}"), getattr(self, f"b_{name.upper()}")
    h, d, e = W.shape
    y = (x @ W.transpose(0, 1).reshape(d, h * e)).unflatten(-1, (h, e))  # one matmul
    if b is not None:
        y = y + b
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

def old_forward(
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
    q = self._project(x, "q", head_major=rope is None, rope=rope)
    if memory is not None and cache is not None and "k" in cache:
        k, v = cache["k"], cache["v"]
    else:
        source = x if memory is None else memory
        k = self._project(source, "k", head_major=rope is None, rope=rope)
        v = self._project(source, "v", head_major=True)
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


def switch(on: bool) -> None:
    """on: today's code; off: 6ded961's."""
    Attention._project, Attention.forward = NEW if on else (old_project, old_forward)


names = ("6ded961", "today")
run = base_config()
sweep_run, model = random_model()
model.eval()
data = eval_data(sweep_run, 64)
tokens, aux = data.inputs["tokens"][:1], data.inputs["aux"][:1]


def batch1() -> None:
    with torch.no_grad():
        model(tokens, aux=aux)


ab("batch-1 forward (qkv)", switch, batch1, 200, rounds=15, names=names)
dec = N5d1Decoder(run)
ab("decode n5d1 cached", switch, lambda: dec.decode(True), 3, rounds=15, names=names)
batch = real_batch(run)
for placement in ("pre", "qkv"):
    _, step = build_contender("normlab", model_config(run, 64, placement), run, batch)
    for on in (False, True, False, True):
        switch(on)
        step()
    ab(f"step {placement} d64", switch, step, 5, rounds=15, names=names)
switch(True)
