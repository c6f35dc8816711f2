"""Batched greedy decoding with (or, to check it, without) the key/value cache."""

from __future__ import annotations

import torch

from normlab.model.transformer import DecoderLM, EncoderDecoderLM, Model


def _pad(seqs: list[list[int]], pad: int, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    tokens = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        sl = slice(width - len(s), width) if left else slice(0, len(s))
        tokens[i, sl] = torch.tensor(s, dtype=torch.long)
        mask[i, sl] = True
    return tokens, mask


@torch.no_grad()
def greedy_decode(
    model: Model,
    prompts: list[list[int]],
    *,
    max_new: int,
    eos: int,
    pad: int = 0,
    bos: int = 1,
    use_cache: bool = True,
) -> list[list[int]]:
    """Generate up to `max_new` tokens per prompt; returns the new tokens, cut after `eos`.

    Decoder-only prompts are left-padded (positions count real tokens only); for an
    encoder-decoder the prompt is the source and the decoder starts from `bos`.
    """
    if not prompts:
        return []
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    b = len(prompts)
    out = torch.empty(b, 0, dtype=torch.long, device=device)
    done = torch.zeros(b, dtype=torch.bool, device=device)
    cache = model.new_cache() if use_cache else None
    if isinstance(model, EncoderDecoderLM):
        src, src_mask = (t.to(device) for t in _pad(prompts, pad, left=False))
        memory = model.encode(src, src_mask)
        seq = torch.full((b, 1), bos, dtype=torch.long, device=device)
        for _ in range(max_new):
            step_in = seq[:, -1:] if use_cache and out.shape[1] else seq
            logits = model.decode(step_in, memory, src_mask, cache=cache)
            nxt = logits[:, -1].argmax(-1)
            out, seq = torch.cat([out, nxt[:, None]], 1), torch.cat([seq, nxt[:, None]], 1)
            done |= nxt == eos
            if done.all():
                break
    else:
        assert isinstance(model, DecoderLM)
        seq, mask = (t.to(device) for t in _pad(prompts, pad, left=True))
        step_in = seq
        for _ in range(max_new):
            logits = model(step_in, attention_mask=mask, cache=cache)
            nxt = logits[:, -1].argmax(-1)
            out = torch.cat([out, nxt[:, None]], 1)
            seq = torch.cat([seq, nxt[:, None]], 1)
            mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.bool, device=device)], 1)
            step_in = nxt[:, None] if use_cache else seq
            done |= nxt == eos
            if done.all():
                break
    model.train(was_training)
    result = []
    for row in out.tolist():
        result.append(row[: row.index(eos) + 1] if eos in row else row)
    return result
