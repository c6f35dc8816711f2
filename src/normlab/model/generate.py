"""Batched greedy decoding with (or, to check it, without) the key/value cache."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Mapping, Sized
from collections.abc import Set as AbstractSet

import numpy as np
import torch

from normlab.checks import check_int, is_int
from normlab.model.transformer import DecoderLM, EncoderDecoderLM, Model, evaluating

#: New positions a decode's cache reserves up front at most. Past them its buffers double as
#: they fill (`attention.append_kv`), so a generous `max_new` that `eos` ends early costs no
#: memory it does not use: with RoPE (no table to bound it) 10**12 asked for 64 TB at once.
RESERVE_NEW = 4096

#: `aux_fn(ids, part)` -> task-supplied positions for a token row; `part` is "sequence" (a
#: decoder-only row), "question" (an encoder source) or "answer" (a decoder target row).
AuxFn = Callable[[list[int], str], list[int]]
#: `aux_next(prev_aux [batch], new_token [batch])` -> the position of each newly generated
#: token from the one before it: the same numbers as `aux_fn` on the grown rows, without
#: re-reading every row in Python at every step (which cost ~1/4 of a cached decode).
AuxNext = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _pad(seqs: list[list[int]], pad: int, left: bool, name: str = "prompts",
         high: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[batch, width] rows padded on the left or right, and the [batch, width] mask of real
    tokens. Every decode pays this in Python, so it is one flat list into one tensor, and the
    mask from the lengths, rather than a nested list of rows and one of flags. The values must
    be integers (in [0, `high`) where given), else a ValueError naming `name`[i]: a dtype
    forced on the list cut 3.9 to 3 unseen."""
    lens = [len(s) for s in seqs]
    width = max(lens)
    flat: list[int] = []
    for s, n in zip(seqs, lens, strict=True):
        fill = [pad] * (width - n)
        flat.extend(fill if left else s)
        flat.extend(s if left else fill)
    try:  # the dtype is the values' own (numpy's int32 ids too), and checked below
        rows = torch.tensor(flat)
    except (TypeError, ValueError, RuntimeError, OverflowError):  # not numbers, or too large
        rows = torch.zeros(0)
    # torch takes True among ints as 1, so a bool anywhere is refused by its type (~80 us for
    # 4096 ids, a sixth of the list's conversion)
    ints = not (rows.is_floating_point() or rows.is_complex() or rows.dtype == torch.bool
                or rows.ndim != 1 or bool in set(map(type, flat)))  # ndim: a list in a prompt
    if ints:
        rows = rows.long()
    if not ints or (high is not None and bool((rows < 0).any() | (rows >= high).any())):
        want = "integers" if high is None else f"integer ids in [0, {high})"
        for i, s in enumerate(seqs):
            bad = [t for t in s if not (is_int(t) and (high is None or 0 <= t < high))]
            if bad:
                raise ValueError(f"{name}[{i}]: expected {want}; got {bad[0]!r}")
        raise ValueError(f"{name}: expected {want}")
    rows = rows.view(len(seqs), width)
    n_real, at = torch.tensor(lens)[:, None], torch.arange(width)
    return rows, at >= width - n_real if left else at < n_real


def _aux_rows(aux_fn: AuxFn, rows: list[list[int]], part: str) -> list[list[int]]:
    """`aux_fn`'s positions for each row, one a token (a short row was padded unseen, then
    refused by the forward as a bad `aux` shape)."""
    out = [aux_fn(r, part) for r in rows]
    for i, (r, a) in enumerate(zip(rows, out, strict=True)):
        if not isinstance(a, Sized) or len(a) != len(r):
            got = f"{len(a)}" if isinstance(a, Sized) else type(a).__name__
            raise ValueError(f"aux_fn(row {i}, {part!r}): expected {len(r)} positions, one a "
                             f"token; got {got}")
    return out


def _aux_tensor(aux_fn: AuxFn, rows: list[list[int]], part: str, left: bool, n_places: int,
                name: str | None = None) -> torch.Tensor:
    """[batch, width] `aux_fn` positions of `rows` (padded with 0 on the left or right), each
    in the model's table [0, `n_places`), else a ValueError naming `aux_fn` and the row
    (`name`[i], or its ids): the forward's IndexError named its own `aux` argument. Unlike a
    generated token's, a given row's positions are never clamped."""
    aux = _pad(_aux_rows(aux_fn, rows, part), 0, left, "aux_fn's positions")[0]
    if bool((aux < 0).any() | (aux >= n_places).any()):
        i, j = ((aux < 0) | (aux >= n_places)).nonzero()[0].tolist()
        row = f"{name}[{i}]" if name is not None else f"{rows[i]}"
        raise ValueError(f"aux_fn({row}, {part!r}): expected places in [0, {n_places}); got "
                         f"{int(aux[i, j])}")
    return aux


def _next_aux(
    aux_fn: AuxFn, aux_next: AuxNext | None, rows: list[list[int]], part: str,
    prev: torch.Tensor, nxt: torch.Tensor, n_places: int,
) -> torch.Tensor:
    """[batch, 1] positions of the tokens `nxt` just appended to `rows` (after `prev`), at
    most the model's last place: a generated run of digits longer than its table (longer
    than any answer the task has, so already wrong) is fed back at the last place rather
    than ending the decode in an IndexError. A prompt's own positions are never clamped."""
    if aux_next is not None:
        new = aux_next(prev, nxt)
        # every step: metadata, and one min (a negative place failed in the next forward,
        # named as its `aux`; larger ones are clamped below)
        if not (isinstance(new, torch.Tensor) and new.shape == prev.shape
                and new.device == prev.device and not new.is_floating_point()
                and not new.is_complex() and new.dtype != torch.bool):
            got = (f"shape {tuple(new.shape)}, {new.dtype} on {new.device}"
                   if isinstance(new, torch.Tensor) else type(new).__name__)
            raise ValueError(f"aux_next: expected a [batch] integer tensor (shape "
                             f"{tuple(prev.shape)}, on {prev.device}); got {got}")
        if new.numel() and int(new.min()) < 0:
            raise ValueError(f"aux_next: expected places >= 0; got {int(new.min())}")
        new = new.long()[:, None]
    else:
        for r, t in zip(rows, nxt.tolist(), strict=True):
            r.append(t)
        new = torch.tensor([[aux_fn(r, part)[-1]] for r in rows], dtype=torch.long,
                           device=nxt.device)
    return new.clamp(max=n_places - 1) if n_places > 0 else new


def greedy_decode(
    model: Model,
    prompts: list[list[int]] | torch.Tensor,
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

    `prompts` is a list (or any iterable) of token lists (Python or numpy ints), or a [batch,
    pos] tensor or numpy array.
    Decoder-only prompts are left-padded (positions count real tokens only); for an
    encoder-decoder the prompt is the source and the decoder starts from `bos`. Models with
    task-supplied positions (`n_aux_positions > 0`) need `aux_fn`; with `aux_next` too, the
    positions of generated tokens are computed incrementally (tensor ops) instead of by
    calling `aux_fn` on every row at every step.
    """
    max_new = check_int(max_new, "max_new", what="a number of tokens >= 0")
    # "no" decoded with the cache
    if not isinstance(use_cache, bool):
        raise ValueError(f"use_cache: expected True or False; got {use_cache!r}")
    # no weights to decode with: torch's error came after a whole forward. The first weight
    # only (the decode's device is read from it): walking them all cost ~0.3 ms a call
    if next(model.parameters()).is_meta:
        empty = [k for k, v in itertools.chain(model.named_parameters(), model.named_buffers())
                 if v.is_meta]
        raise ValueError(f"model: {empty[0]} ({len(empty)} tensors in all) is on the meta "
                         "device; expected a model with its weights loaded (not offloaded or "
                         "empty-initialised)")
    cfg = model.cfg
    vocab = cfg.vocab_size
    for name, token in (("pad", pad), ("bos", bos)):  # else read as a bad id of `tokens`
        check_int(token, name, high=vocab, what=f"a token id in [0, {vocab})")
    check_int(eos, "eos", low=-(2**63), high=2**63,
              what="an int in [-2**63, 2**63) (a token id; -1 never ends)")
    want = "a list of token lists or a [batch, pos] tensor"
    # [batch, pos] ids, as TransformerLens users have them (a numpy array too)
    if isinstance(prompts, torch.Tensor | np.ndarray):
        if prompts.ndim != 2:
            raise ValueError(f"prompts: expected {want}; got shape {tuple(prompts.shape)}")
        if isinstance(prompts, torch.Tensor) and prompts.is_meta:  # torch's "Cannot copy out"
            raise ValueError("prompts: on the meta device, no ids to read; expected a tensor "
                             "with data")
        prompts = prompts.tolist()
    not_a_sequence = str | bytes | Mapping | AbstractSet  # a dict or set has no order
    if isinstance(prompts, not_a_sequence) or not isinstance(prompts, Iterable):
        raise ValueError(f"prompts: expected {want}; got {type(prompts).__name__}")
    prompts = list(prompts)  # a generator or tuple of prompts too
    if not prompts:
        return []
    for i, prompt in enumerate(prompts):
        # one flat prompt: its ids (ints, or 0-d tensors and arrays, which are Sized but
        # have no len) where token lists should be
        if (isinstance(prompt, not_a_sequence) or not isinstance(prompt, Sized)
                or getattr(prompt, "ndim", 1) == 0):
            raise ValueError(f"prompts[{i}]: expected a list of token ids; got {prompt!r}")
        if not len(prompt):  # its row would be read from the padding alone (or attend to nothing)
            raise ValueError(f"prompts[{i}]: expected at least one token, got an empty prompt")
    # named as greedy_decode takes them: the forward's own errors spoke of its `aux` argument
    if aux_fn is None and cfg.n_aux_positions:
        raise ValueError("aux_fn: this model has ModelConfig.n_aux_positions > 0; expected an "
                         "aux_fn(ids, part) giving a row's positions (see "
                         "normlab.tasks.addition.aux_positions)")
    if aux_fn is not None and not cfg.n_aux_positions:
        raise ValueError("aux_fn: this model takes no aux positions (ModelConfig."
                         "n_aux_positions = 0); expected None")
    if not max_new:  # nothing to generate: an encoder-decoder ran its encoder on the prompts
        _pad(prompts, pad, True, "prompts", vocab)  # the ids still checked
        return [[] for _ in prompts]
    if cfg.position_table:
        _check_room(prompts, max_new, cfg.max_len, isinstance(model, EncoderDecoderLM))
    with evaluating(model):  # every module's mode as it was afterwards, also after an error
        out = _decode(model, prompts, max_new, eos, pad, bos, use_cache, aux_fn, aux_next)
    result = []
    for row in out.tolist():
        result.append(row[: row.index(eos) + 1] if eos in row else row)
    return result


def _check_room(prompts: list[list[int]], max_new: int, max_len: int, enc_dec: bool) -> None:
    """A table of `max_len` positions must hold every position the decode feeds, checked
    before it starts: past them, a forward partway through failed and the tokens written so far
    were lost. A decoder-only row feeds its prompt and every new token but the last; an
    encoder-decoder its source to the encoder, and `bos` and the new tokens but the last to the
    decoder."""
    i = max(range(len(prompts)), key=lambda k: len(prompts[k]))
    n = len(prompts[i])
    if n > max_len:
        raise ValueError(f"prompts[{i}]: expected at most ModelConfig.max_len={max_len} "
                         f"tokens; got {n}")
    need = max_new if enc_dec else n + max_new - 1
    if need > max_len:
        fed = (f"bos and {max_new - 1} new tokens" if enc_dec
               else f"prompts[{i}]'s {n} tokens and {max_new - 1} new ones")
        raise ValueError(f"max_new: {fed} need {need} positions, more than "
                         f"ModelConfig.max_len={max_len}; expected max_new <= "
                         f"{max_new - (need - max_len)}")


def _decode(
    model: Model, prompts: list[list[int]], max_new: int, eos: int, pad: int, bos: int,
    use_cache: bool, aux_fn: AuxFn | None, aux_next: AuxNext | None,
) -> torch.Tensor:
    """`greedy_decode`'s loop (the model in eval mode, no autograd): [batch, generated] new
    tokens."""
    device = next(model.parameters()).device
    vocab, n_places = model.cfg.vocab_size, model.cfg.n_aux_positions
    b = len(prompts)
    out = torch.empty(b, 0, dtype=torch.long, device=device)
    rows = [list(p) for p in prompts]
    done = torch.zeros(b, dtype=torch.bool, device=device)
    if isinstance(model, EncoderDecoderLM):
        src, src_mask = (t.to(device) for t in _pad(prompts, pad, False, "prompts", vocab))
        src_aux = None
        if aux_fn is not None:
            src_aux = _aux_tensor(aux_fn, prompts, "question", False, n_places,
                                  "prompts").to(device)
        memory = model.encode(src, src_mask, src_aux)
        # the reserve holds what is fed, never the last generated token: bos + max_new - 1
        cache = model.new_cache(min(max_new, RESERVE_NEW)) if use_cache else None
        seq = torch.full((b, 1), bos, dtype=torch.long, device=device)
        tgt_rows = [[bos] for _ in range(b)]
        aux = None
        if aux_fn is not None:
            aux = _aux_tensor(aux_fn, tgt_rows, "answer", False, n_places).to(device)
        for _ in range(max_new):
            cached = use_cache and out.shape[1] > 0
            step_in = seq[:, -1:] if cached else seq
            step_aux = None if aux is None else (aux[:, -1:] if cached else aux)
            logits = model.decode(step_in, memory, src_mask, cache=cache, aux=step_aux)
            nxt = logits[:, -1].argmax(-1)
            out, seq = torch.cat([out, nxt[:, None]], 1), torch.cat([seq, nxt[:, None]], 1)
            if aux is not None:
                new_aux = _next_aux(aux_fn, aux_next, tgt_rows, "answer", aux[:, -1], nxt,
                                    n_places)
                aux = torch.cat([aux, new_aux], 1)
            done |= nxt == eos
            if done.all():
                break
    else:
        assert isinstance(model, DecoderLM)
        seq, mask = (t.to(device) for t in _pad(prompts, pad, True, "prompts", vocab))
        # the prompt and every generated token but the last, which is never fed back: the
        # buffers are as long as the decode fills them, with no position left unused
        cache = model.new_cache(seq.shape[1] + min(max_new - 1, RESERVE_NEW)) if use_cache else None
        aux = None
        if aux_fn is not None:
            aux = _aux_tensor(aux_fn, prompts, "sequence", True, n_places, "prompts").to(device)
        step_in, step_aux = seq, aux
        for _ in range(max_new):
            logits = model(step_in, attention_mask=mask, cache=cache, aux=step_aux)
            nxt = logits[:, -1].argmax(-1)
            out = torch.cat([out, nxt[:, None]], 1)
            seq = torch.cat([seq, nxt[:, None]], 1)
            mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.bool, device=device)], 1)
            if aux is not None:
                new_aux = _next_aux(aux_fn, aux_next, rows, "sequence", aux[:, -1], nxt,
                                    n_places)
                aux = torch.cat([aux, new_aux], 1)
            step_in = nxt[:, None] if use_cache else seq
            if aux is not None:
                step_aux = new_aux if use_cache else aux
            done |= nxt == eos
            if done.all():
                break
    return out
