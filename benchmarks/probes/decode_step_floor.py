"""One-off probe behind notes in the thirtieth and thirty-second sections of
docs/performance.md; not part of make bench.

How cheap could a cached decoding step get without a kernel for the whole block? bench_decode's
n5d1 cell (`pre`, the quick-grid size, random weights, seed 0; glibc keeping freed memory, as
the benchmarks run): the model's single-token step against a `floor` step written out by hand
from the same weights, with nothing but the arithmetic left: no modules, hook points,
checks or masks built; q, k and v from one matmul over weights concatenated beforehand; each
residual added inside its matmul (`addmm`); the same kernels for the norms, RoPE and the
decoding attention. Both take the second of the three steps, alternating, median of 41 rounds
(after 5), in one process, with Python's garbage collector off as the benchmarks time; the
floor's logits must match the model's (within 1e-4). Then the whole cached and uncached decodes
(median of 21 after 5), and the speed-up the cached decode would reach if each of its three
steps took the floor's time instead, or no time at all.

Last (thirty-second session), both steps again on the cell's first prompt alone: a batch of
one row, whose arithmetic is next to nothing, so its time is about what the step pays per call
(Python, dispatch) at any batch. Only about: at one row the norms and RoPE take torch's small
ops, below their kernels' MIN_ROWS, where the full batch pays the kernels' ctypes calls
(`native.py`: those cost more). The floor's time at the full batch less its time at one row
is then roughly what a kernel for the whole step would still pay if it cost nothing per call
and ran the same arithmetic as fast as torch's ops and normlab's kernels do; the speed-up such
steps would give is printed last:

    .venv/bin/python benchmarks/probes/decode_step_floor.py [THREADS]
"""
import gc
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import N5d1Decoder, probe_header, threads_from_argv

from bench_train_step import base_config
from common import median, paired_timing
from normlab import allocator
from normlab.model import native
from normlab.model.generate import _pad
from normlab.model.transformer import KVCache
from normlab.tasks.addition import aux_positions, next_aux_position

allocator.keep_freed_memory()
cell = N5d1Decoder(base_config())
model, prompts, max_new = cell.model, cell.prompts, cell.max_new
cfg = model.cfg  # what the floor's arithmetic assumes
assert (cfg.norm_placement == "pre" and cfg.pos_encoding == "rope" and cfg.act == "gelu"
        and cfg.mlp_type == "standard" and cfg.n_kv_heads == cfg.n_heads and not cfg.attn_bias
        and not cfg.mlp_bias), "decode_step_floor.py: the floor is written for this cell's model"
h, e = model.blocks[0].attn.n_heads, model.blocks[0].attn.d_head
layers = [
    (blk.ln1, torch.cat([w.transpose(0, 1).flatten(1) for w in (blk.attn.W_Q, blk.attn.W_K,
                                                                   blk.attn.W_V)], 1).contiguous(),
     blk.attn.W_O.flatten(0, 1).contiguous(), blk.attn.scale, blk.ln2, blk.mlp.W_in,
     blk.mlp.W_out)
    for blk in model.blocks
]
Step = tuple[KVCache, torch.Tensor, torch.Tensor, torch.Tensor]


def second_step(rows: list[list[int]]) -> Step:
    """A cache holding the prompts `rows` and the first new token, and the second step's
    inputs (token, key mask, digit position), as greedy decoding makes them."""
    seq, mask = _pad(rows, 0, left=True)
    aux = _pad([aux_positions(p, "sequence") for p in rows], 0, left=True)[0]
    b = seq.shape[0]
    cache = model.new_cache(seq.shape[1] + max_new - 1)
    logits = model(seq, attention_mask=mask, cache=cache, aux=aux)
    nxt = logits[:, -1].argmax(-1)
    m = torch.cat([mask, torch.ones(b, 1, dtype=torch.bool)], 1)
    a = next_aux_position(aux[:, -1], nxt)
    logits = model(nxt[:, None], attention_mask=m, cache=cache, aux=a[:, None])  # the first
    nxt = logits[:, -1].argmax(-1)
    return cache, nxt, torch.cat([m, torch.ones(b, 1, dtype=torch.bool)], 1), \
        next_aux_position(a, nxt)


def model_step(cache: KVCache, nxt: torch.Tensor, m: torch.Tensor, a: torch.Tensor
               ) -> torch.Tensor:
    """The step as greedy decoding runs it: logits [b, vocab]."""
    return model(nxt[:, None], attention_mask=m, cache=cache, aux=a[:, None])[:, 0]


def floor_step(cache: KVCache, nxt: torch.Tensor, m: torch.Tensor, a: torch.Tensor
               ) -> torch.Tensor:
    """The same step by hand: logits [b, vocab]."""
    n, b = cache.length, nxt.shape[0]
    x = model.embed.W_E[nxt] + model.W_aux[a]  # [b, d_model]
    rope = model.rotary((m.sum(-1) - 1)[:, None])
    key_mask = m[:, None, None, :]
    for i, (ln1, w_qkv, w_o, scale, ln2, w_in, w_out) in enumerate(layers):
        kv = cache.layers[i]["self"]
        y = (ln1(x) @ w_qkv).view(b, 1, 3, h, e)
        q, k = rope(y[:, :, 0]), rope(y[:, :, 1])
        kv["buf_k"][:, :, n], kv["buf_v"][:, :, n] = k[:, 0], y[:, 0, 2]
        z = native.attend(q.transpose(1, 2), kv["buf_k"][:, :, :n + 1],
                          kv["buf_v"][:, :, :n + 1], scale, key_mask)  # raises where it cannot
        x = torch.addmm(x, z.view(b, h * e), w_o)
        x = torch.addmm(x, F.gelu(ln2(x) @ w_in), w_out)
    return model.unembed(model.ln_final(x))


Way = tuple[str, Callable[..., torch.Tensor]]


def step_times(rows: list[list[int]], ways: tuple[Way, ...] = (("model", model_step),
                                                              ("floor", floor_step))
               ) -> dict[str, float]:
    """Median ms of each way's second step on `rows`, the ways in turn, starting one later
    each round (two ways: alternating)."""
    times: dict[str, list[float]] = {name: [] for name, _ in ways}
    gc.collect()
    gc.disable()  # as `common.paired_timing` times
    for r in range(46):
        for name, fn in ways[r % len(ways):] + ways[:r % len(ways)]:
            inputs = second_step(rows)
            t0 = time.perf_counter()
            fn(*inputs)
            if r >= 5:
                times[name].append(time.perf_counter() - t0)
    gc.enable()
    return {n: 1e3 * median(ts) for n, ts in times.items()}


def main() -> None:
    threads_from_argv("decode_step_floor.py")
    probe_header("decode_step_floor.py")
    with torch.no_grad():
        diff = (model_step(*second_step(prompts)) - floor_step(*second_step(prompts))
                ).abs().max().item()
        assert diff < 1e-4, f"decode_step_floor.py: the floor's logits are {diff} off the model's"
        full = step_times(prompts)
        decodes = paired_timing({"cached": lambda: cell.decode(True),
                                 "uncached": lambda: cell.decode(False)}, repeats=21, warmup=5)
        one = step_times(prompts[:1])
    b = len(prompts)
    step, floor = full["model"], full["floor"]
    cached, uncached = (1e3 * median(decodes[n]) for n in ("cached", "uncached"))
    with_floor = cached - (max_new - 1) * (step - floor)
    print(f"n5d1, {b} prompts, {max_new} new tokens; median ms; the floor's logits within "
          f"{diff:.1e} of the model's")
    print(f"  one step: model {step:.2f}, floor {floor:.2f} (floor / model {floor / step:.3f})")
    print(f"  cached decode {cached:.1f}, uncached {uncached:.1f}: speed-up "
          f"{uncached / cached:.2f}")
    print(f"  with the floor's steps the cached decode would take {with_floor:.1f}: speed-up "
          f"{uncached / with_floor:.2f}")
    free = cached - (max_new - 1) * step
    print(f"  with steps that cost nothing, {free:.1f}: speed-up {uncached / free:.2f}")
    per_call = one["floor"]
    bound = cached - (max_new - 1) * (step - (floor - per_call))
    print(f"  one step on one prompt: model {one['model']:.2f}, floor {per_call:.2f}")
    print(f"  with steps that cost the floor's time less its time on one prompt "
          f"({floor - per_call:.2f}), {bound:.1f}: speed-up {uncached / bound:.2f}")


if __name__ == "__main__":
    main()
