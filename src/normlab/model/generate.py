"""Batched greedy decoding with (or, to check it, without) the key/value cache."""

from __future__ import annotations

from collections.abc import Callable

import torch

from normlab.checks import check_int
from normlab.model.transformer import DecoderLM, EncoderDecoderLM, Model, evaluating

#: `aux_fn(ids, part)` -> task-supplied positions for a token row; `part` is "sequence" (a
#: decoder-only row), "question" (an encoder source) or "answer" (a decoder target row).
AuxFn = Callable[[list[int], str], list[int]]
#: `aux_next(prev_aux [batch], new_token [batch])` -> the position of each newly generated
#: token from the one before it: the same numbers as `aux_fn` on the grown rows, without
#: re-reading every row in Python at every step (which cost ~1/4 of a cached decode).
AuxNext = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _pad(seqs: list[list[int]], pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, width] rows padded on the left or right, and the [batch, width] mask of real
    tokens. Every decode pays this in Python, so it is one flat list into one tensor, and the
    mask from the lengths, rather than a nested list of rows and one of flags."""
    lens = [len(s) for s in seqs]
    width = max(lens)
    flat: list[int] = []
    for s, n in zip(seqs, lens, strict=True):
        fill = [pad] * (width - n)
        flat.extend(fill if left else s)
        flat.extend(s if left else fill)
    rows = torch.tensor(flat, dtype=torch.long).view(len(seqs), width)
    n_real, at = torch.tensor(lens)[:, None], torch.arange(width)
    return rows, at >= width - n_real if left else at < n_real


def _next_aux(
    aux_fn: AuxFn, aux_next: AuxNext | None, rows: list[list[int]], part: str,
    prev: torch.Tensor, nxt: torch.Tensor, n_places: int,
) -> torch.Tensor:
    """[batch, 1] positions of the tokens `nxt` just appended to `rows` (after `prev`), at
    most the model's last place: a generated run of digits longer than its table (longer
    than any answer the task has, so already wrong) is fed back at the last place rather
    than ending the decode in an IndexError. A prompt's own positions are never clamped."""
    if aux_next is not None:
        new = aux_next(prev, nxt)[:, None]
    else:
        for r, t in zip(rows, nxt.tolist(), strict=True):
            r.append(t)
        new = torch.tensor([[aux_fn(r, part)[-1]] for r in rows], dtype=torch.long,
                           device=nxt.device)
    return new.clamp(max=n_places - 1) if n_places > 0 else new


def greedy_decode(
    model: Model,
    prompts: list[list[int]],
    *,
    max_new: int,
    eos: int,
    pad: int = 0,
    bos: int = 1,
    use_cache: bool = True,
    aux_fn: AuxFn | None = None,
    aux_next: AuxNext | None = None,
) -> list[list[int]]:
    """Generate up to `max_new` tokens per prompt; returns the new tokens, cut after `eos`.

    Decoder-only prompts are left-padded (positions count real tokens only); for an
    encoder-decoder the prompt is the source and the decoder starts from `bos`. Models with
    task-supplied positions (`n_aux_positions > 0`) need `aux_fn`; with `aux_next` too, the
    positions of generated tokens are computed incrementally (tensor ops) instead of by
    calling `aux_fn` on every row at every step.
    """
    max_new = check_int(max_new, "max_new", what="a number of tokens >= 0")
    if not prompts:
        return []
    for i, prompt in enumerate(prompts):
        if not len(prompt):  # its row would be read from the padding alone (or attend to nothing)
            raise ValueError(f"prompts[{i}]: expected at least one token, got an empty prompt")
    with evaluating(model):  # every module's mode as it was afterwards, also after an error
        out = _decode(model, prompts, max_new, eos, pad, bos, use_cache, aux_fn, aux_next)
    result = []
    for row in out.tolist():
        result.append(row[: row.index(eos) + 1] if eos in row else row)
    return result


def _decode(
    model: Model, prompts: list[list[int]], max_new: int, eos: int, pad: int, bos: int,
    use_cache: bool, aux_fn: AuxFn | None, aux_next: AuxNext | None,
) -> torch.Tensor:
    """`greedy_decode`'s loop (the model in eval mode, no autograd): [batch, generated] new
    tokens."""
    device = next(model.parameters()).device
    b = len(prompts)
    out = torch.empty(b, 0, dtype=torch.long, device=device)
    rows = [list(p) for p in prompts]
    done = torch.zeros(b, dtype=torch.bool, device=device)
    if isinstance(model, EncoderDecoderLM):
        src, src_mask = (t.to(device) for t in _pad(prompts, pad, left=False))
        src_aux = None
        if aux_fn is not None:
            src_aux = _pad([aux_fn(p, "question") for p in prompts], 0, left=False)[0].to(device)
        memory = model.encode(src, src_mask, src_aux)
        # the reserve holds what is fed, never the last generated token: bos + max_new - 1
        cache = model.new_cache(max_new) if use_cache else None
        seq = torch.full((b, 1), bos, dtype=torch.long, device=device)
        tgt_rows = [[bos] for _ in range(b)]
        aux = None
        if aux_fn is not None:
            aux = torch.tensor([aux_fn(r, "answer") for r in tgt_rows], device=device)
        for _ in range(max_new):
            cached = use_cache and out.shape[1] > 0
            step_in = seq[:, -1:] if cached else seq
            step_aux = None if aux is None else (aux[:, -1:] if cached else aux)
            logits = model.decode(step_in, memory, src_mask, cache=cache, aux=step_aux)
            nxt = logits[:, -1].argmax(-1)
            out, seq = torch.cat([out, nxt[:, None]], 1), torch.cat([seq, nxt[:, None]], 1)
            if aux is not None:
                new_aux = _next_aux(aux_fn, aux_next, tgt_rows, "answer", aux[:, -1], nxt,
                                    model.cfg.n_aux_positions)
                aux = torch.cat([aux, new_aux], 1)
            done |= nxt == eos
            if done.all():
                break
    else:
        assert isinstance(model, DecoderLM)
        seq, mask = (t.to(device) for t in _pad(prompts, pad, left=True))
        # the prompt and every generated token but the last, which is never fed back: the
        # buffers are as long as the decode fills them, with no position left unused
        cache = model.new_cache(seq.shape[1] + max_new - 1) if use_cache else None
        aux = None
        if aux_fn is not None:
            aux = _pad([aux_fn(p, "sequence") for p in prompts], 0, left=True)[0].to(device)
        step_in, step_aux = seq, aux
        for _ in range(max_new):
            logits = model(step_in, attention_mask=mask, cache=cache, aux=step_aux)
            nxt = logits[:, -1].argmax(-1)
            out = torch.cat([out, nxt[:, None]], 1)
            seq = torch.cat([seq, nxt[:, None]], 1)
            mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.bool, device=device)], 1)
            if aux is not None:
                new_aux = _next_aux(aux_fn, aux_next, rows, "sequence", aux[:, -1], nxt,
                                    model.cfg.n_aux_positions)
                aux = torch.cat([aux, new_aux], 1)
            step_in = nxt[:, None] if use_cache else seq
            if aux is not None:
                step_aux = new_aux if use_cache else aux
            done |= nxt == eos
            if done.all():
                break
    return out
