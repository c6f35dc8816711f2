"""What the analyses run on: teacher-forced evaluation batches and the model's attention sites.

Every measurement (norm spread, sparse rows, collapse, interference) is taken on *correct*
sequences fed through the model teacher-forced, so the circuits measured are the ones the model
uses on the task. A batch is described by `EvalData`: the model inputs plus, for each token
*stream* (`tokens` for a decoder-only model; `src` and `tgt` for an encoder-decoder), which
positions are real tokens and which class they belong to. Hooks know their stream from their
name (`stream_of`), so pads are skipped uniformly everywhere.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from normlab.checks import check_int, is_int
from normlab.model import DecoderLM, EncoderDecoderLM, Model
from normlab.model.attention import Attention
from normlab.model.transformer import evaluating
from normlab.tasks.addition import IGNORE_INDEX, PAD, Cell, ResolvedTask, encode, make_batch

DECODER_CLASSES = ("question", "answer")
ENC_DEC_CLASSES = ("encoder", "decoder")
INPUT_STREAMS = {"tokens": "tokens", "aux": "tokens", "src": "src", "src_mask": "src",
                 "src_aux": "src", "tgt_in": "tgt", "tgt_aux": "tgt"}
"""The stream whose positions each model input is laid along (what `subset` trims)."""
FORWARD_COST_POSITIONS = 256
"""A forward's fixed cost in positions of a batched one, for `length_buckets`: on this CPU a
batch-1 forward of the d64 model takes ~2.8 ms, a batched one ~14 us per position."""


@dataclass
class EvalData:
    """A teacher-forced batch and its bookkeeping.

    `inputs`: decoder `{"tokens"}`; encoder-decoder `{"src", "src_mask", "tgt_in"}`.
    `valid[stream]` [B, T] bool marks real tokens; `classes[stream]` [B, T] long indexes
    `class_names` (-1 on pads). `scored[stream]` [B, T] bool marks the positions whose output
    the training loss scores, where the data knows it (`from_problems`; `loss_rows`): an
    encoder's stream has no outputs of its own, hand-built data records none. `problems`/`cells`
    say where each example came from.
    """

    arch: str
    inputs: dict[str, torch.Tensor]
    valid: dict[str, torch.Tensor]
    classes: dict[str, torch.Tensor]
    class_names: tuple[str, ...]
    problems: list[tuple[str, str]] = field(default_factory=list)
    cells: list[str] = field(default_factory=list)
    scored: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def n_examples(self) -> int:
        return next(iter(self.valid.values())).shape[0]

    @property
    def lengths(self) -> dict[str, int]:
        """Padded width of each stream."""
        return {s: v.shape[1] for s, v in self.valid.items()}

    @property
    def tokens_per_copy(self) -> int:
        """Positions one copy of the batch puts through the model (to size chunks)."""
        return self.n_examples * sum(self.lengths.values())

    def repeated(self, copies: int) -> dict[str, torch.Tensor]:
        """Inputs repeated `copies` times along the batch: row `c * B + b` is example b."""
        return {k: v.repeat(copies, *([1] * (v.dim() - 1))) for k, v in self.inputs.items()}

    def loss_rows(self, stream: str, last_block: bool) -> torch.Tensor:
        """[B, T] real positions of `stream` whose attention rows reach an output the training
        loss scores: in the stream's last block a row feeds only its own position's output, so
        the scored positions; in an earlier one, every position up to an example's last scored
        one (a later scored position reads it, the stream being causal). A decoder-only
        model's rows at the final E (its target is ignored) and, in the last block, at the
        question feed nothing trained. A stream with no `scored` entry counts every real row:
        an encoder's, every row of which the decoder reads (`find_sparse_rows` refuses data
        with no entry at all, which cannot tell)."""
        valid = self.valid[stream]
        scored = self.scored.get(stream)
        if scored is None:
            return valid
        if last_block:
            return valid & scored
        pos = torch.arange(valid.shape[1])
        last = torch.where(scored.any(1), valid.shape[1] - 1 - scored.flip(1).long().argmax(1),
                           -1)
        return valid & (pos[None, :] <= last[:, None])

    def widths(self) -> torch.Tensor:
        """[B, streams] real length of every example in each stream (batches are right-padded)."""
        cols = [torch.where(v.any(1), v.shape[1] - v.flip(1).long().argmax(1), 0)
                for v in self.valid.values()]
        return torch.stack(cols, 1)

    def subset(self, idx: torch.Tensor) -> EvalData:
        """Examples `idx` (in that order), each stream cut to the widest of them.

        Cutting trailing pads is exact: pads come last and are masked (encoder) or only seen by
        later positions (causal decoder), so real positions get the same activations.
        """
        idx = torch.as_tensor(idx, dtype=torch.long)
        width = dict(zip(self.valid, self.widths()[idx].amax(0).tolist(), strict=True))

        def cut(t: torch.Tensor, stream: str) -> torch.Tensor:
            return t[idx, : max(1, width[stream])]

        return EvalData(
            self.arch,
            {k: cut(v, INPUT_STREAMS[k]) for k, v in self.inputs.items()},
            {s: cut(v, s) for s, v in self.valid.items()},
            {s: cut(v, s) for s, v in self.classes.items()},
            self.class_names,
            [self.problems[i] for i in idx.tolist()] if self.problems else [],
            [self.cells[i] for i in idx.tolist()] if self.cells else [],
            {s: cut(v, s) for s, v in self.scored.items()},
        )

    def forward(self, model: Model, copies: int = 1) -> torch.Tensor:
        """Run the model teacher-forced, exactly as training does (no extra masks)."""
        self.check_model(model)
        x = self.repeated(copies) if copies != 1 else self.inputs
        return model(**model_kwargs(self.arch, x))

    def check_model(self, model: Model) -> None:
        """Data laid out for the model's arch: the other's keywords were torch's TypeError."""
        if self.arch != model.cfg.arch:
            raise ValueError(f"data: made for arch {self.arch!r}; this model's is "
                             f"{model.cfg.arch!r}")

    @classmethod
    def from_problems(
        cls,
        problems: Sequence[tuple[str, str]],
        arch: str,
        answer_format: str = "msd",
        cells: Sequence[str] = (),
        digit_positions: bool = False,
    ) -> EvalData:
        """Correct (question, answer) pairs as `make_batch` lays them out for `arch`."""
        batch = make_batch(problems, arch, answer_format, digit_positions)
        aux = {k: batch[k] for k in ("aux", "src_aux", "tgt_aux") if k in batch}
        if arch == "decoder":
            tokens = batch["tokens"]
            valid = tokens != PAD
            q_len = torch.tensor([len(encode(q)) + 2 for q, _ in problems])  # B question E
            pos = torch.arange(tokens.shape[1])[None, :]
            classes = torch.where(pos < q_len[:, None], 0, 1).masked_fill(~valid, -1)
            return cls(arch, {"tokens": tokens, **aux}, {"tokens": valid}, {"tokens": classes},
                       DECODER_CLASSES, list(problems), list(cells),
                       {"tokens": batch["targets"] != IGNORE_INDEX})
        src_valid = batch["src_mask"].bool()
        tgt_valid = batch["tgt_in"] != PAD
        return cls(
            arch,
            {"src": batch["src"], "src_mask": src_valid, "tgt_in": batch["tgt_in"], **aux},
            {"src": src_valid, "tgt": tgt_valid},
            {"src": torch.zeros_like(batch["src"]).masked_fill(~src_valid, -1),
             "tgt": torch.ones_like(batch["tgt_in"]).masked_fill(~tgt_valid, -1)},
            ENC_DEC_CLASSES, list(problems), list(cells),
            {"tgt": batch["tgt_out"] != IGNORE_INDEX},
        )

    @classmethod
    def from_tokens(cls, tokens: torch.Tensor, valid: torch.Tensor | None = None) -> EvalData:
        """Arbitrary decoder-only sequences (e.g. hand-built tests); one class, `tokens`.

        `valid` marks real tokens; pads must come last in a row, as everywhere here (the
        forward passes no key mask: a left pad was attended to and won sparse rows)."""
        if not isinstance(tokens, torch.Tensor) or tokens.ndim != 2:  # else an IndexError below
            got = (f"shape {tuple(tokens.shape)}" if isinstance(tokens, torch.Tensor)
                   else type(tokens).__name__)
            raise ValueError(f"tokens: expected [batch, pos] ids, got {got}")
        valid = torch.ones_like(tokens, dtype=torch.bool) if valid is None else valid.bool()
        if valid.shape != tokens.shape:
            raise ValueError(f"valid: expected the shape of tokens {tuple(tokens.shape)}; got "
                             f"{tuple(valid.shape)}")
        late = (valid[:, 1:] & ~valid[:, :-1]).any(-1).nonzero().flatten().tolist()
        if late:
            raise ValueError(f"valid: expected the pads of each row last (right-padded); row "
                             f"{late[0]} has a real token after a pad")
        classes = torch.zeros_like(tokens).masked_fill(~valid, -1)
        return cls("decoder", {"tokens": tokens}, {"tokens": valid}, {"tokens": classes},
                   ("tokens",))


def model_kwargs(arch: str, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """Keyword arguments of a model call for a teacher-forced batch (aux positions included)."""
    if arch == "decoder":
        return {"tokens": x["tokens"], "aux": x.get("aux")}
    return {"src": x["src"], "tgt": x["tgt_in"], "src_mask": x["src_mask"],
            "src_aux": x.get("src_aux"), "tgt_aux": x.get("tgt_aux")}


def select_problems(
    task: ResolvedTask,
    sets: dict[str, dict[Cell, list[tuple[str, str]]]],
    n_examples: int,
    splits: Sequence[str] | None = ("train",),
    warn: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
) -> tuple[dict[str, dict[Cell, list[tuple[str, str]]]], int]:
    """The first `per_cell` problems of every cell of `splits` (None: all splits).

    `per_cell = ceil(n_examples / n_cells)`, so the cells are balanced and the very same
    problems serve the collapse sweep and `evaluate(..., limit=per_cell)`. Returns the reduced
    sets and `per_cell`. Deterministic: the eval sets are already fixed per cell. Past what the
    sets hold, `per_cell` is their largest cell's count, and one line to `warn` (default:
    stderr) says how many are used; it names the count, not the parameter, which the command
    line calls `--examples`.
    """
    n_examples = check_int(n_examples, "n_examples", low=1)
    if isinstance(splits, str):  # one name, not its letters
        splits = [splits]
    names = list(sets) if splits is None else list(splits)
    for name in names:
        if name not in sets:
            raise ValueError(f"unknown split {name!r}; expected one of {', '.join(sets)}")
    if len(set(names)) != len(names):  # a split twice would count its cells twice
        raise ValueError(f"splits: expected each split once, got {names}")
    n_cells = sum(len(sets[s]) for s in names)
    if n_cells == 0:
        raise ValueError("the selected splits have no cells")
    per_cell = math.ceil(n_examples / n_cells)
    chosen = {s: {c: probs[:per_cell] for c, probs in sets[s].items()} for s in names}
    per_cell = max(len(probs) for by_cell in chosen.values() for probs in by_cell.values())
    used = sum(len(probs) for by_cell in chosen.values() for probs in by_cell.values())
    if used < n_examples:
        warn(f"warning: {n_examples} examples asked for, but the eval sets of the selected "
             f"splits hold {used} problems ({n_cells} cells, up to {per_cell} each); analysing "
             f"those {used}")
    return chosen, per_cell


def data_from_sets(
    sets: dict[str, dict[Cell, list[tuple[str, str]]]], arch: str, answer_format: str = "msd",
    digit_positions: bool = False,
) -> EvalData:
    """All problems of (already reduced) eval sets as one teacher-forced batch."""
    problems, cells = [], []
    for by_cell in sets.values():
        for cell, probs in by_cell.items():
            problems += probs
            cells += [cell.label] * len(probs)
    return EvalData.from_problems(problems, arch, answer_format, cells, digit_positions)


# --------------------------------------------------------------------------- sites


@dataclass(frozen=True)
class Site:
    """One attention module: its name, which stream its queries and keys come from."""

    name: str
    module: Attention
    q_stream: str
    kv_stream: str

    @property
    def cross(self) -> bool:
        return self.name.endswith("cross_attn")

    @property
    def n_heads(self) -> int:
        return self.module.n_heads

    @property
    def n_kv_heads(self) -> int:
        return self.module.n_kv_heads


def last_block_sites(model: Model) -> set[str]:
    """The attention sites in the last block of their stack (`blocks.{L-1}.attn`; an
    encoder-decoder's last encoder block and last decoder block's self- and cross-attention).
    A decoder stack's last-block rows feed only their own positions' outputs
    (`EvalData.loss_rows`); an encoder's feed every decoder position, which its stream having
    no `scored` entry already says."""
    stacks: dict[str, list[tuple[int, str]]] = {}
    for name in attention_sites(model):
        stack, _, rest = name.rpartition("blocks.")
        stacks.setdefault(stack, []).append((int(rest.split(".")[0]), name))
    return {n for found in stacks.values() for i, n in found if i == max(j for j, _ in found)}


def stream_of(name: str) -> str:
    """Which token stream a hook's position axis runs over, from its dotted name."""
    if ".cross_attn.k_norm" in name or ".cross_attn.v_norm" in name:
        return "src"
    if name.startswith("encoder."):
        return "src"
    if name.startswith("decoder."):
        return "tgt"
    return "tokens"


def attention_sites(model: Model) -> dict[str, Site]:
    """Every attention module by name (`blocks.0.attn`, `decoder.blocks.1.cross_attn`, ...)."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, Attention):
            q = stream_of(name)
            kv = "src" if name.endswith("cross_attn") else q
            out[name] = Site(name, mod, q, kv)
    return out


def group_seed(seed: int, *group: int) -> int:
    """A seed of its own for one group (a site's head, by the site's place among all the
    model's sites), fixed by `seed` and the group: numpy's `SeedSequence` mixes them, so nearby
    seeds and groups give unrelated streams, and a group's draws do not depend on which other
    groups an analysis selected. It pads the words to four with zeros, so give every group of
    one analysis a key of the same length ((s, i) and (s, i, 0) are one seed). A seed of 2**32
    or more is split into two words, so its groups can meet a smaller seed's: (2**32 + 7, 0) is
    (7, 1, 0)."""
    return int(np.random.SeedSequence([seed, *group]).generate_state(1)[0])


def resolve_sites(
    model: Model, sites: Sequence[str] | None = None, heads: Sequence[int] | None = None
) -> tuple[list[Site], list[int] | None]:
    """Validate a site/head selection (None: all); one-line ValueError on unknown names."""
    known = attention_sites(model)
    if isinstance(sites, str):
        sites = [sites]
    chosen = list(known.values())
    if sites is not None:
        chosen = []
        for s in sites:
            if s not in known:
                raise ValueError(f"unknown attention site {s!r}; expected one of "
                                 f"{', '.join(known)}")
            if any(c.name == s for c in chosen):  # perturbed twice, its rows counted twice
                raise ValueError(f"sites: expected each attention site once, got {s!r} twice")
            chosen.append(known[s])
        if not chosen:
            raise ValueError("sites: expected at least one attention site")
    if heads is not None:
        if is_int(heads):  # one head, as `sites` takes one name
            heads = [heads]
        try:
            heads = list(heads)
        except TypeError:  # not a collection (True, 1.5, a 0-d tensor): checked as one head
            heads = [heads]
        n = min(s.n_heads for s in chosen)
        for h in heads:
            if not is_int(h) or not 0 <= h < n:
                raise ValueError(f"unknown head {h!r}; expected an int in [0, {n})")
        heads = [int(h) for h in heads]
        if len(set(heads)) < len(heads):  # reported twice, and recorded so
            raise ValueError(f"heads: expected each head once; got {heads}")
        if not heads:
            raise ValueError("heads: expected at least one head")
    return chosen, heads


def block_of(model: Model, site: str) -> tuple[str, int]:
    """(`prefix`, layer) of a site: `decoder.blocks.1.cross_attn` -> (`decoder.`, 1)."""
    head, _, rest = site.partition("blocks.")
    return head, int(rest.split(".")[0])


def stack_of(model: Model, prefix: str) -> torch.nn.Module:
    if isinstance(model, EncoderDecoderLM):
        return getattr(model, prefix.rstrip("."))
    assert isinstance(model, DecoderLM)
    return model


# --------------------------------------------------------------------------- helpers


class _Collected(Exception):
    """Raised by `collect` once every activation it waits for is in hand."""


def collect(
    model: Model,
    data: EvalData,
    take: dict[str, Callable[[torch.Tensor], torch.Tensor]],
    *,
    hooks: Sequence[tuple[str, Callable[..., torch.Tensor | None]]] = (),
    copies: int = 1,
) -> dict[str, torch.Tensor]:
    """`take[name](activation)` for each hook name, with `hooks` attached, in eval mode.

    The forward stops as soon as the last of them has fired: nothing computed later can
    change them, and skipping the rest (the last MLP, the unembedding, the layers after the
    last site asked for) is what keeps a sweep over many noise draws cheap. `hooks` are
    attached first, so a name both perturbed and taken is seen after the perturbation.
    """
    got: dict[str, torch.Tensor] = {}

    def keep(x: torch.Tensor, hook: object) -> None:
        name = hook.name  # type: ignore[attr-defined]
        got[name] = take[name](x)
        if len(got) == len(take):
            raise _Collected

    attached = [*hooks, *((n, keep) for n in take)]
    with evaluating(model), model.hooks(attached), contextlib.suppress(_Collected):
        data.forward(model, copies=copies)
    missing = sorted(set(take) - set(got))
    if missing:
        raise ValueError(f"hook point(s) {', '.join(missing)} did not fire in the forward")
    return got


def length_buckets(data: EvalData, overhead: float = FORWARD_COST_POSITIONS) -> list[torch.Tensor]:
    """Split the examples into groups of similar length that are cheapest to run separately.

    Each group is run at its own width, so the cost of a grouping is the padded positions
    `sum(len(group) * width(group))` plus `overhead` (a forward's fixed cost, in positions)
    per group. Examples are sorted by length and the best split into contiguous runs is found
    exactly by dynamic programming over the distinct lengths. Returns example indices per
    group, shortest first; one group when splitting does not pay.
    """
    w = [tuple(r) for r in data.widths().tolist()]
    order = sorted(range(len(w)), key=lambda b: (sum(w[b]), w[b], b))
    units: list[list[int]] = []  # runs of examples with the same widths
    for b in order:
        if units and w[units[-1][0]] == w[b]:
            units[-1].append(b)
        else:
            units.append([b])
    K = len(units)
    best, cut = [0.0] + [math.inf] * K, [0] * (K + 1)
    for j in range(1, K + 1):
        count, top = 0, w[units[j - 1][0]]
        for i in range(j - 1, -1, -1):  # group = units[i:j]
            count += len(units[i])
            top = tuple(map(max, top, w[units[i][0]]))
            cost = best[i] + count * sum(top) + overhead
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], K
    while j > 0:
        i = cut[j]
        groups.append(torch.tensor([b for u in units[i:j] for b in u]))
        j = i
    return groups[::-1]


def chunk_copies(data: EvalData, max_tokens: int, wanted: int) -> int:
    """How many batch copies fit in `max_tokens` positions per forward (at least 1)."""
    return max(1, min(wanted, max_tokens // max(1, data.tokens_per_copy)))


def sweep_groups(data: EvalData, max_tokens: int, n_draws: int) -> list[torch.Tensor]:
    """The groups of examples a sweep of `n_draws` copies runs, each at its own width: the
    length groups (`length_buckets`) for the fixed cost of a forward of as many copies as fit
    in `max_tokens`, or the whole batch as one group."""
    chunk = chunk_copies(data, max_tokens, n_draws)
    groups = length_buckets(data, FORWARD_COST_POSITIONS / chunk)
    return groups if len(groups) > 1 else [torch.arange(data.n_examples)]
