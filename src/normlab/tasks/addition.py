"""Integer addition: the one place problems are sampled, split and turned into tensors.

PAPER.md section 4: a question is a sum of ``n`` signed integers of exactly ``d`` digits joined
by ``+``/``-``, a negative number carries its own sign token ``N`` (distinct from the ``-``
operator), and the target is the exact result, e.g. ``N6774-N71+5814-6016+45+N976`` -> ``N7836``.

Everything string-shaped lives here so trainers and models only ever see id tensors. Choices the
paper does not make are ours: the grid presets, the answer format (``reverse_answer``,
``complement_answer``: both off, as in the paper) and ``train_weights`` (uniform) are
parameters; that a 1-digit number may be ``0`` and that zero is never signed are fixed.
"""

from __future__ import annotations

import operator
import random
import re
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

import numpy as np
import torch

from normlab.checks import check_int, check_seed, did_you_mean

__all__ = [
    "ANSWER_FORMATS",
    "ARCHS",
    "BOS",
    "EOS",
    "GRIDS",
    "IGNORE_INDEX",
    "NEG",
    "PAD",
    "TRAIN_WEIGHTS",
    "VOCAB",
    "VOCAB_SIZE",
    "Cell",
    "ResolvedTask",
    "Rng",
    "TaskConfig",
    "TrainStream",
    "aux_positions",
    "cell_weights",
    "check_answer_format",
    "decode",
    "encode",
    "eval_sets",
    "format_answer",
    "grid_preset",
    "make_batch",
    "make_prompts",
    "max_lengths",
    "max_seq_len",
    "parse_answer",
    "read_answer",
    "reverse_digits",
    "sample_problem",
]

# --------------------------------------------------------------------------- vocabulary

VOCAB = "MBEN0123456789+-"
"""Token ids are positions in this string (the first author's earlier vocabulary)."""
VOCAB_SIZE = len(VOCAB)
PAD, BOS, EOS, NEG = 0, 1, 2, 3
IGNORE_INDEX = -100
"""Target id that ``torch.nn.functional.cross_entropy`` skips by default."""
_ZERO = 4  # id of "0"; digits are ids 4..13
ARCHS = ("decoder", "encoder_decoder")
ANSWER_FORMATS = ("msd", "lsd", "lsd_complement")
"""How an answer is written for the model: most significant digit first (the paper), least
significant first with the sign first, or least significant first in ten's complement with the
sign last (`format_answer`)."""
TRAIN_WEIGHTS = ("uniform", "length")

_CHAR_TO_ID = {ch: i for i, ch in enumerate(VOCAB)}

Rng = random.Random | np.random.Generator
"""Either source of randomness; problems are reproducible from either."""


def encode(s: str) -> list[int]:
    """Map a string over ``VOCAB`` to ids; a stray character is a bug, so fail loudly."""
    try:
        return [_CHAR_TO_ID[ch] for ch in s]
    except KeyError:
        pos = next(i for i, ch in enumerate(s) if ch not in _CHAR_TO_ID)
        raise ValueError(
            f"character {s[pos]!r} at position {pos} is not in the addition vocabulary {VOCAB!r}"
        ) from None


def decode(ids: Sequence[int] | torch.Tensor | np.ndarray) -> str:
    """Map ids (list or 1-D tensor/array) back to a string, e.g. for logging model outputs."""
    if isinstance(ids, torch.Tensor | np.ndarray):
        if ids.ndim != 1:
            raise ValueError(f"decode expects a 1-D sequence of ids, got shape {tuple(ids.shape)}")
        ids = ids.tolist()
    out = []
    for pos, i in enumerate(ids):
        i = operator.index(i)
        if not 0 <= i < VOCAB_SIZE:
            raise ValueError(
                f"id {i} at position {pos} is outside the vocabulary 0..{VOCAB_SIZE - 1}"
            )
        out.append(VOCAB[i])
    return "".join(out)


_ANSWER_RE = re.compile(r"0|N?[1-9][0-9]*")  # an answer as `_fmt_int` writes it


def _fmt_int(v: int) -> str:
    """Write an integer with the ``N`` sign token; zero is ``0``, never ``N0``."""
    return f"N{-v}" if v < 0 else str(v)


def reverse_digits(answer: str) -> str:
    """Reverse an answer's digits, keeping a leading ``N`` first (``N7836`` <-> ``N6387``).

    Its own inverse. Least-significant-first answers let a left-to-right decoder emit each
    digit after the carries it depends on; an option, off by default as in the paper.
    """
    if answer.startswith("N"):
        return "N" + answer[:0:-1]
    return answer[::-1]


def _complement(answer: str) -> str:
    """``N37`` -> ``36N`` (100 - 37 = 63, units first, then the sign); ``37`` -> ``73``.

    A negative result ``v`` is written as the ``w`` digits of ``10**w + v`` for the smallest
    ``w >= 1`` with ``10**w >= -v`` (zero-padded), units first, then ``N``. Every digit is then a
    column sum plus a signed carry from the column below, and the sign is the last carry: no
    digit waits on the global comparison that a sign-first answer must make up front.
    """
    v = int(answer.replace("N", "-"))
    if v >= 0:
        return answer[::-1]
    w = len(str(-v - 1))
    return str(10**w + v).zfill(w)[::-1] + "N"


def _uncomplement(text: str) -> str:
    """Inverse of `_complement`; a non-canonical string maps to ``?text`` (never an answer)."""
    body = text[:-1] if text.endswith("N") else text
    if not body.isdigit():
        return "?" + text
    v = int(body[::-1]) - (10 ** len(body) if text.endswith("N") else 0)
    answer = _fmt_int(v)
    return answer if _complement(answer) == text else "?" + text


def _same(text: str) -> str:
    return text


def _unreverse(text: str) -> str:
    """Inverse of `reverse_digits` on the texts it writes; any other text (``63N``, the sign
    last, which reversing whole would read as ``N36``) maps to ``?text``, never an answer."""
    answer = reverse_digits(text)
    return answer if reverse_digits(answer) == text else "?" + text


# format -> (true answer -> model text, model text -> answer)
_WRITE_READ = {
    "msd": (_same, _same),
    "lsd": (reverse_digits, _unreverse),
    "lsd_complement": (_complement, _uncomplement),
}


def check_answer_format(fmt: Any) -> str:
    """``fmt`` if it is one of `ANSWER_FORMATS`, else a one-line ``ValueError``."""
    if fmt not in ANSWER_FORMATS:
        raise ValueError(
            f"answer format must be one of {', '.join(ANSWER_FORMATS)}; got {fmt!r}"
        )
    return fmt


def format_answer(answer: str, fmt: str = "msd") -> str:
    """Write a true answer (``N7836``) in answer format ``fmt`` (one of `ANSWER_FORMATS`).

    ``lsd`` lets a left-to-right decoder emit each digit after the carries it depends on but
    still needs the sign first; ``lsd_complement`` moves the sign decision to the end (our
    options; the paper writes ``msd``). Only an answer as `_fmt_int` writes it is taken:
    ``-5`` (the minus operator as a sign), ``N0`` or ``N05`` were written, each format its
    own way, and some did not read back as themselves.
    """
    if not isinstance(answer, str) or not _ANSWER_RE.fullmatch(answer):
        raise ValueError(f"answer: expected an integer as N?digits, no leading zeros and no "
                         f"N0; got {answer!r}")
    return _WRITE_READ[check_answer_format(fmt)][0](answer)


def read_answer(text: str, fmt: str = "msd") -> str:
    """Inverse of `format_answer`: model text in format ``fmt`` -> the answer it stands for."""
    return _WRITE_READ[check_answer_format(fmt)][1](text)


# --------------------------------------------------------------------------- sampling


def _index(x: object) -> int:
    """An int, strictly: `operator.index`, but a bool (an int to Python) is not one here."""
    if isinstance(x, bool):
        raise TypeError(f"{x!r} is a bool")
    return operator.index(x)


def _digit_choices(d: int | Iterable[int], name: str = "d") -> tuple[int, ...]:
    """Normalise ``d`` (an int or a collection of ints) to a sorted tuple of digit counts."""
    try:
        ds = tuple(sorted({_index(x) for x in d})) if isinstance(d, Iterable) else (_index(d),)
    except TypeError:
        raise ValueError(f"{name} must be an int or a collection of ints, got {d!r}") from None
    if not ds:
        raise ValueError(f"{name} must not be empty")
    if ds[0] < 1:
        raise ValueError(f"{name} must be >= 1, got {ds[0]}")
    return ds


def _randint(rng: Rng, lo: int, hi: int) -> int:
    """Uniform integer in ``[lo, hi]`` from either kind of rng (``hi - lo < 2**62``)."""
    if isinstance(rng, random.Random):
        return rng.randint(lo, hi)
    return int(rng.integers(lo, hi + 1))


def _draw_number(rng: Rng, d: int) -> int:
    """Uniform over the non-negative integers written with exactly ``d`` digits, no leading 0."""
    if d == 1:
        return _randint(rng, 0, 9)
    if isinstance(rng, random.Random) or d <= 18:
        return _randint(rng, 10 ** (d - 1), 10**d - 1)
    # numpy draws int64 only: build long numbers from a leading digit and 18-digit chunks.
    value, left = _randint(rng, 1, 9), d - 1
    while left:
        k = min(18, left)
        value = value * 10**k + _randint(rng, 0, 10**k - 1)
        left -= k
    return value


def _coin(rng: Rng) -> bool:
    return rng.random() < 0.5


def sample_problem(n: int, d: int | Iterable[int], rng: Rng) -> tuple[str, str]:
    """Sample one ``(question, answer)`` pair of ``n`` integers with ``d`` digits each.

    Each integer is uniform over the numbers written with exactly ``d`` digits and no leading
    zero, so for ``d == 1`` that is ``0..9`` (our choice: ``0`` is the one 1-digit way to write
    zero). It is negative (prefix ``N``) with probability 1/2, except that zero is always ``0``.
    Operators are ``+`` or ``-`` with probability 1/2. If ``d`` is a collection, each integer
    draws its digit count uniformly from it ("mixed digits" cells). The answer is the exact
    value with the same sign convention.
    """
    try:  # True sampled as n = 1 and 2.0 was a bare TypeError; `Cell` refuses both
        n = _index(n)
    except TypeError:
        raise ValueError(f"n must be an int, got {n!r}") from None
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    ds = _digit_choices(d)
    parts: list[str] = []
    total = 0
    for i in range(n):
        di = ds[0] if len(ds) == 1 else ds[_randint(rng, 0, len(ds) - 1)]
        value = _draw_number(rng, di)
        if _coin(rng):
            value = -value
        if i == 0:
            total = value
        elif _coin(rng):
            parts.append("+")
            total += value
        else:
            parts.append("-")
            total -= value
        parts.append(_fmt_int(value))
    return "".join(parts), _fmt_int(total)


# --------------------------------------------------------------------------- cells

_LABEL_RE = re.compile(r"n(\d+)d(\d+)(?:-(\d+)|((?:_\d+)+))?")


@dataclass(frozen=True)
class Cell:
    """One (n, d) cell of the evaluation grid; ``d`` a tuple means mixed digit counts.

    ``d`` is normalised (sorted, deduplicated, a single count becomes an int) so equal cells
    compare and hash equal however they were written.
    """

    n: int
    d: int | tuple[int, ...]

    def __post_init__(self) -> None:
        try:
            n = _index(self.n)
        except TypeError:
            raise ValueError(f"n must be an int, got {self.n!r}") from None
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        ds = _digit_choices(self.d)
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "d", ds[0] if len(ds) == 1 else ds)

    @property
    def digits(self) -> tuple[int, ...]:
        """The digit counts an integer of this cell can have."""
        return self.d if isinstance(self.d, tuple) else (self.d,)

    @property
    def label(self) -> str:
        """Stable short name (``n3d2``, ``n3d1-3``, ``n3d1_4``) for metrics keys and paths."""
        ds = self.digits
        if len(ds) == 1:
            dl = str(ds[0])
        elif ds == tuple(range(ds[0], ds[-1] + 1)):
            dl = f"{ds[0]}-{ds[-1]}"
        else:
            dl = "_".join(map(str, ds))
        return f"n{self.n}d{dl}"

    def __str__(self) -> str:
        return self.label

    @classmethod
    def parse(cls, label: str) -> Cell:
        """Inverse of ``label``, for reading metrics back."""
        m = _LABEL_RE.fullmatch(label)
        if m is None:
            raise ValueError(f"{label!r} is not a cell label like 'n3d2' or 'n3d1-2'")
        n, d0, hi, rest = m.groups()
        try:
            if hi is not None:
                cell = cls(int(n), tuple(range(int(d0), int(hi) + 1)))
            elif rest is not None:
                cell = cls(int(n), (int(d0), *map(int, rest[1:].split("_"))))
            else:
                cell = cls(int(n), int(d0))
        except ValueError:
            cell = None
        if cell is None or cell.label != label:  # n3d1-1, n03d1, n3d3-1: no cell's label
            raise ValueError(f"{label!r} is not a cell label like 'n3d2' or 'n3d1-2'")
        return cell

    @classmethod
    def from_pair(cls, pair: Any, where: str = "cell") -> Cell:
        """Build from a config ``[n, d]`` (``d`` may be a list for mixed digits)."""
        if isinstance(pair, Cell):
            return pair
        if isinstance(pair, str) or not isinstance(pair, Sequence) or len(pair) != 2:
            raise ValueError(f"{where}: expected [n, d], got {pair!r}")
        try:
            return cls(pair[0], pair[1])
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def sample(self, rng: Rng) -> tuple[str, str]:
        """One problem from this cell."""
        return sample_problem(self.n, self.d, rng)


def max_lengths(cells: Iterable[Cell]) -> tuple[int, int]:
    """Exact worst-case ``(question, answer)`` lengths in characters (no ``B``/``E``).

    Worst case: every integer negative with the largest digit count (``n * (d + 1)`` chars plus
    ``n - 1`` operators); the largest magnitude is ``n * (10**d - 1)``, reached by all-9 numbers
    of one sign, plus the ``N``. Both are attained, so the bound is tight.
    """
    q_max = a_max = 0
    for cell in cells:
        d = max(cell.digits)
        q_max = max(q_max, cell.n * (d + 1) + cell.n - 1)
        a_max = max(a_max, _sum_digits(cell) + 1)
    if q_max == 0:
        raise ValueError("max_lengths needs at least one cell")
    return q_max, a_max


def _digits(x: int) -> int:
    """Decimal digits of an int x >= 1, counted without `str` (which refuses past 4300)."""
    k = max(1, int(x.bit_length() * 0.30102999566398120))  # log10(2): exact or one short
    return k + 1 if x >= 10**k else k


def _sum_digits(cell: Cell) -> int:
    """Digits of the largest |sum| a cell has, n (10**d - 1), without building 10**d where d
    is large (a cell [1, 10**9] hung validation; `str` refused [1, 5000], naming no field).
    Where 10**d > n, n 10**d - n has the digits of n 10**d, d + digits(n), but for one fewer
    where n is a power of ten (999 = 1000 - 1)."""
    n, d = cell.n, max(cell.digits)
    k = _digits(n)
    if d < k:  # 10**d <= n: small enough to compute
        return _digits(n * (10**d - 1))
    return d + k - (n == 10 ** (k - 1))


def max_seq_len(cells: Iterable[Cell], arch: str) -> int:
    """Positions a model of ``arch`` needs for these cells: the longest question beside the
    longest answer, of any cells. No training row is that long (a row holds one cell's
    question and answer), but greedy evaluation feeds it: every prompt may generate up to the
    task's longest answer (`ResolvedTask.max_new`)."""
    _check_arch(arch)
    q, a = max_lengths(cells)
    if arch == "decoder":
        return q + a + 3  # B question E answer E
    return max(q + 2, a + 1)  # src: B question E; tgt_in: B answer; tgt_out: answer E


# --------------------------------------------------------------------------- grids

_GRID_DATA: dict[str, dict[str, Any]] = {
    "paper": {
        "train": [[n, d] for n in (1, 2, 4, 5) for d in (1, 2, 3, 4)],
        "splits": {
            "interpolation": [[3, d] for d in (1, 2, 3, 4)],
            "extrapolation": [[6, d] for d in (1, 2, 3, 4)] + [[n, 5] for n in (1, 2, 4, 5)],
        },
    },
    "quick": {
        "train": [[1, 1], [2, 1], [4, 1], [1, 2], [2, 2]],
        "splits": {
            "interpolation": [[3, 1]],
            "extrapolation": [[5, 1], [1, 3], [2, 3]],
        },
    },
    "quick_square": {
        "train": [[n, d] for n in (1, 2, 4) for d in (1, 2)],
        "splits": {
            "interpolation": [[3, d] for d in (1, 2)],
            "extrapolation": [[5, d] for d in (1, 2)] + [[n, 3] for n in (1, 2)],
        },
    },
    "smoke": {
        "train": [[1, 1], [3, 1]],
        "splits": {"interpolation": [[2, 1]], "extrapolation": [[4, 1], [1, 2]]},
    },
}
GRIDS: Mapping[str, Mapping[str, Any]] = MappingProxyType(_GRID_DATA)
"""Named presets as plain ``[n, d]`` data: ``paper`` (train n in {1,2,4,5}, as PAPER.md
section 4's example, and d in 1..4, our choice; n = 3 interpolates, n = 6 or d = 5
extrapolates, PAPER.md giving "n = 6, or more digits" as examples); ``quick`` (CPU-sized,
same structure: n in {1,2,4} with 1 digit plus n in {1,2} with 2 digits, so it includes sums
of two signed 2-digit integers; n = 3 interpolates, n = 5 or d = 3 extrapolates);
``quick_square`` (n in {1,2,4} x d in {1,2}: adds the much harder 4 x 2-digit cell, which our
CPU recipe does not learn in 20 minutes, see docs/results.md) and ``smoke`` (tiny, for plumbing
tests). The grids are our choice."""


def grid_preset(name: str) -> tuple[list[Cell], dict[str, list[Cell]]]:
    """The ``(train_cells, held_out_splits)`` of a named preset, as fresh lists."""
    if name not in _GRID_DATA:
        raise ValueError(f"unknown grid {name!r} (allowed: {', '.join(sorted(_GRID_DATA))})")
    data = _GRID_DATA[name]
    train = [Cell(n, d) for n, d in data["train"]]
    splits = {k: [Cell(n, d) for n, d in v] for k, v in data["splits"].items()}
    return train, splits


# --------------------------------------------------------------------------- config


@dataclass
class ResolvedTask:
    """A validated task: the cells to train on and the cells each eval split reports.

    ``eval_splits`` always starts with ``"train"`` (the train cells, on fixed eval samples, so
    in-distribution accuracy is measured the same way as the held-out splits).
    """

    train_cells: list[Cell]
    eval_splits: dict[str, list[Cell]]
    eval_size: int = 256
    eval_seed: int = 1234
    reverse_answer: bool = False
    train_weights: str = "uniform"
    digit_positions: bool = False
    pack: bool = False
    complement_answer: bool = False

    @property
    def answer_format(self) -> str:
        """The answer format models of this task read and write (`ANSWER_FORMATS`)."""
        if not self.reverse_answer:
            return "msd"
        return "lsd_complement" if self.complement_answer else "lsd"

    @property
    def all_cells(self) -> list[Cell]:
        """Every cell in the task, train first, without repeats."""
        return list(dict.fromkeys(c for cells in self.eval_splits.values() for c in cells))

    def max_lengths(self) -> tuple[int, int]:
        """Worst-case lengths over every cell a model will see (train and eval)."""
        return max_lengths(self.all_cells)

    def max_new(self) -> int:
        """Tokens greedy decoding generates at most: the longest answer and its ``E`` (so an
        answer that does not stop reads as wrong, not cut to a right one), and one step more
        than that needs. The spare step is kept: `perturbed_predictor`'s noise draws are sized
        by it, so dropping it would change every recorded accuracy under noise."""
        return self.max_lengths()[1] + 2

    def max_seq_len(self, arch: str) -> int:
        """Positions a model of ``arch`` needs for every cell of the task."""
        return max_seq_len(self.all_cells, arch)


@dataclass
class TaskConfig:
    """The ``[task]`` table of a run config; only plain types, so TOML maps onto it 1:1.

    ``train`` / ``splits`` left empty are filled from the ``grid`` preset (each on its own).
    Cells are ``[n, d]`` pairs; ``d`` may be a list of digit counts for a mixed-digits cell.
    ``reverse_answer`` and ``train_weights`` (``uniform`` over cells, or ``length``: proportional
    to the cell's longest question) are our options; the defaults follow the paper.
    """

    grid: str = "quick"
    train: list[list[Any]] = field(default_factory=list)
    splits: dict[str, list[list[Any]]] = field(default_factory=dict)
    eval_size: int = 256
    eval_seed: int = 1234
    reverse_answer: bool = False
    train_weights: str = "uniform"
    # Feed each digit's significance as a second position index (Abacus embeddings, McLeish
    # et al. 2024): our extension, not the paper's. Needs reverse_answer and a model with
    # n_aux_positions >= max(longest answer, max digits) + 1.
    digit_positions: bool = False
    # Pack several training problems into each row (decoder only; attention and positions
    # restart per problem), so a batch carries almost no padding: same problems per step,
    # fewer positions. Our option; training only, evaluation is unchanged.
    pack: bool = False
    # Write negative answers in ten's complement, units first, with the sign last (``N37`` ->
    # ``36N``), so the sign is decided after the digits instead of before them. Needs
    # reverse_answer. Our option; exact match is still on the true result.
    complement_answer: bool = False

    @classmethod
    def from_dict(cls, table: Mapping[str, Any]) -> TaskConfig:
        """Build from a parsed ``[task]`` table, rejecting unknown keys (typos fail early)."""
        allowed = [f.name for f in fields(cls)]
        for key in table:
            if key not in allowed:
                raise ValueError(f"task: unknown key {key!r}{did_you_mean(key, allowed)} "
                                 f"(allowed: {', '.join(allowed)})")
        return cls(**dict(table))

    def resolve(self) -> ResolvedTask:
        """Fill cells from the grid and validate; errors are one line naming the field."""
        if not isinstance(self.grid, str) or self.grid not in _GRID_DATA:  # ['quick']: TypeError
            allowed = ", ".join(sorted(_GRID_DATA))
            raise ValueError(f"task.grid: unknown grid {self.grid!r} (allowed: {allowed})")
        grid_train, grid_splits = grid_preset(self.grid)
        # numpy's ints too, as every other count takes them; below 2**63, as TOML writes them
        # kept as Python ints, as the train and model configs keep theirs: config.toml is
        # written from these fields
        self.eval_size = check_int(self.eval_size, "task.eval_size", low=1, high=2**63,
                                   what="an int >= 1 (and < 2**63)")
        self.eval_seed = check_seed(self.eval_seed, "task.eval_seed")  # every seed's range
        if not isinstance(self.splits, dict):  # a list of cells: an AttributeError on .items
            raise ValueError(f"task.splits: expected a table of split name -> cells; got "
                             f"{self.splits!r}")
        for name in ("pack", "reverse_answer", "complement_answer", "digit_positions"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"task.{name}: must be true or false, got {getattr(self, name)!r}")
        if self.train_weights not in TRAIN_WEIGHTS:
            raise ValueError(
                f"task.train_weights: unknown weighting {self.train_weights!r} "
                f"(allowed: {', '.join(TRAIN_WEIGHTS)})"
            )

        if self.digit_positions and not self.reverse_answer:
            raise ValueError("task.digit_positions: needs task.reverse_answer = true (answer "
                             "digits must come least significant first to know their place)")
        if self.complement_answer and not self.reverse_answer:
            raise ValueError("task.complement_answer: needs task.reverse_answer = true (the "
                             "complement is written least significant digit first)")
        train = _cells_from(self.train, "task.train") if self.train else grid_train
        if not train:
            raise ValueError("task.train: no train cells")
        from_grid = "" if self.splits else f" (splits from grid {self.grid!r})"
        if self.splits:
            splits = {str(k): _cells_from(v, f"task.splits.{k}") for k, v in self.splits.items()}
        else:
            splits = grid_splits

        train_set = set(train)
        owner: dict[Cell, str] = {}
        for name, cells in splits.items():
            where = f"task.splits.{name}"
            if not name.strip():  # an unlabelled row in eval, an empty column in compare
                raise ValueError(f"task.splits.{name!r}: expected a split name, not a blank one")
            if name == "train":
                raise ValueError(f"{where}: the split name 'train' is reserved for the train cells")
            if not cells:
                raise ValueError(f"{where}: no cells")
            for cell in cells:
                if cell in train_set:
                    raise ValueError(f"{where}: cell {cell} is also a train cell{from_grid}")
                # n2d1 is inside n2d1-2: a held-out question could be a training one
                shared = _sharing(cell, train)
                if shared is not None:
                    raise ValueError(f"{where}: cell {cell} shares problems with train cell "
                                     f"{shared}{from_grid}")
                if cell in owner:
                    raise ValueError(
                        f"{where}: cell {cell} is also in split {owner[cell]!r}{from_grid}"
                    )
                owner[cell] = name
        return ResolvedTask(
            train_cells=train,
            eval_splits={"train": list(train), **splits},
            eval_size=self.eval_size,
            eval_seed=self.eval_seed,
            reverse_answer=self.reverse_answer,
            train_weights=self.train_weights,
            digit_positions=self.digit_positions,
            pack=self.pack,
            complement_answer=self.complement_answer,
        )

    def check_given(self) -> ResolvedTask:
        """`resolve`, and the rules a config given now keeps on top of it: split names eval's
        rows and compare's columns can show (' train', 'x|y' and a newline garbled them), and
        no two cells sharing a problem, as no cell may be listed twice (n2d1-2 beside n2d2 in
        train drew 2 x 2-digit sums 62.5% of the time; a question in two splits was scored in
        both). Checked where a config is given (a file, --set, a sweep, a new training), not
        where a stored one is read back: a run trained before these rules still evaluates,
        analyses and resumes."""
        for name in map(str, self.splits if isinstance(self.splits, dict) else ()):
            if not _SPLIT_NAME_RE.fullmatch(name):
                raise ValueError(f"task.splits.{name!r}: expected a split name of letters, "
                                 f"digits, '_', '.' or '-'")
        task = self.resolve()
        given = [("task.train", task.train_cells)] if self.train else []  # grids share none
        given += [(f"task.splits.{k}", task.eval_splits[str(k)]) for k in self.splits]
        owner: dict[Cell, str] = {}  # a held-out cell's split
        for where, cells in given:
            for i, cell in enumerate(cells):
                if (shared := _sharing(cell, cells[:i])) is not None:
                    raise ValueError(f"{where}[{i}]: cell {cell} shares problems with cell "
                                     f"{shared}")
            if where == "task.train":  # one sharing a held-out cell: `resolve` refuses it
                continue
            for cell in cells:
                if (shared := _sharing(cell, owner)) is not None:
                    raise ValueError(f"{where}: cell {cell} shares problems with cell {shared} "
                                     f"of split {owner[shared]!r}")
            owner |= dict.fromkeys(cells, where.removeprefix("task.splits."))
        return task


_SPLIT_NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")
"""A split name, as eval's rows and compare's (markdown) columns can show it."""


def _sharing(cell: Cell, others: Iterable[Cell]) -> Cell | None:
    """The first of `others` that can draw a problem `cell` draws (same n, a digit count in
    common: n2d1 lies inside n2d1-2), or None."""
    return next((c for c in others if c.n == cell.n and set(c.digits) & set(cell.digits)), None)


def _cells_from(pairs: Any, where: str) -> list[Cell]:
    """Parse a list of ``[n, d]`` pairs, rejecting repeats (they would skew weights/metrics;
    cells sharing some problems are refused where a config is given: `check_given`)."""
    if isinstance(pairs, str) or not isinstance(pairs, Sequence):
        raise ValueError(f"{where}: expected a list of [n, d] pairs, got {pairs!r}")
    cells: list[Cell] = []
    limit = sys.get_int_max_str_digits()  # 0: no limit
    for i, pair in enumerate(pairs):
        cell = Cell.from_pair(pair, f"{where}[{i}]")
        if cell in cells:
            raise ValueError(f"{where}[{i}]: cell {cell} is listed twice")
        width = _sum_digits(cell)
        if limit and width > limit:  # sampling failed at a random step, naming no field
            raise ValueError(f"{where}[{i}]: cell {cell} has sums of up to {width} digits; "
                             f"Python writes at most {limit}-digit integers as text")
        cells.append(cell)
    return cells


# --------------------------------------------------------------------------- tensors


def _check_arch(arch: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r} (allowed: {', '.join(ARCHS)})")


def _pad(rows: list[list[int]], fill: int) -> torch.Tensor:
    width = max(len(r) for r in rows)
    out = np.full((len(rows), width), fill, dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out)


def aux_positions(ids: Sequence[int], part: str) -> list[int]:
    """Digit significance of each token (units 1, tens 2, ...; 0 for non-digits).

    `part` says what `ids` is: "question" (digits count back from the end of their number),
    "answer" (a reversed answer: digits count forward, so it stays causal while decoding) or
    "sequence" (a decoder row: question up to the first E, answer after it). Digits of the
    same place line up across numbers and the answer, which is what addition needs.
    """
    if part not in ("question", "answer", "sequence"):
        raise ValueError(f"aux_positions: part must be question, answer or sequence; got {part!r}")
    ids = list(ids)
    split = len(ids)
    if part == "answer":
        split = 0
    elif part == "sequence" and EOS in ids:
        split = ids.index(EOS) + 1
    is_digit = [_ZERO <= t <= _ZERO + 9 for t in ids]
    out = [0] * len(ids)
    i = 0
    while i < split:  # question: count back from each number's last digit
        if is_digit[i]:
            j = i
            while j < split and is_digit[j]:
                j += 1
            for k in range(i, j):
                out[k] = j - k
            i = j
        else:
            i += 1
    run = 0
    for k in range(split, len(ids)):  # answer: count forward
        run = run + 1 if is_digit[k] else 0
        out[k] = run
    return out


def next_aux_position(prev: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """`aux_positions` of a token appended to an answer, from the position before it.

    In the answer part positions count forward (a digit is one more than the token before
    it, anything else is 0), so a decoder can extend them with tensor ops instead of
    re-reading whole rows (`greedy_decode(..., aux_next=next_aux_position)`). Valid for
    tokens after the question's E, which is where decoding starts.
    """
    is_digit = (token >= _ZERO) & (token <= _ZERO + 9)
    return torch.where(is_digit, prev + 1, torch.zeros_like(prev))


def _aux_rows(rows: list[list[int]], part: str) -> torch.Tensor:
    return _pad([aux_positions(r, part) for r in rows], 0)


def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """First-fit decreasing: indices of sequences per row, each row's total length <= width.

    Deterministic (ties keep the input order), so a packed stream resumes bit for bit.
    """
    if any(n > width for n in lengths):
        raise ValueError(f"pack_rows: a sequence of {max(lengths)} tokens is wider than {width}")
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    return rows


def _check_digit_positions(answer_format: str, digit_positions: object) -> None:
    """Digit positions count an answer's digits from its units, which comes first only in a
    reversed format: with ``msd`` the hundreds digit of 633 was labelled as units. A bool only,
    as `pack` ("no" was read as true)."""
    if not isinstance(digit_positions, bool):
        raise ValueError(f"digit_positions: expected true or false; got {digit_positions!r}")
    if digit_positions and check_answer_format(answer_format) == "msd":
        raise ValueError("digit_positions: needs a least-significant-first answer format "
                         "(lsd or lsd_complement), not msd")


def _check_pack(pack: object, arch: str) -> bool:
    """`pack` as a bool, only for a decoder (`TrainStream` took an encoder-decoder's and
    failed at its first batch, and "no" as true)."""
    if not isinstance(pack, bool):
        raise ValueError(f"pack: expected true or false; got {pack!r}")
    if pack and arch != "decoder":
        raise ValueError(f"pack needs arch 'decoder'; got {arch!r}")
    return pack


def make_batch(
    problems: Sequence[tuple[str, str]],
    arch: str,
    answer_format: str = "msd",
    digit_positions: bool = False,
    pack: bool = False,
) -> dict[str, torch.Tensor]:
    """Turn ``(question, answer)`` pairs into right-padded id tensors for ``arch``.

    ``decoder``: ``tokens`` = ``B question E answer E`` (the first ``E`` plays ``=``), and
    ``targets`` holds the next token only where that token is an answer digit/sign or the final
    ``E``, ``IGNORE_INDEX`` elsewhere, so the loss never rewards predicting the random question.
    With ``pack``, problems are concatenated into rows as wide as the longest one, placed
    first-fit decreasing (`pack_rows`: deterministic, not always the fewest rows), and
    ``segments`` numbers them per row (1, 2, ...; 0 on padding), which the decoder uses to keep
    attention and positions inside each problem.
    ``encoder_decoder``: ``src`` = ``B question E`` with ``src_mask`` (True on real tokens),
    ``tgt_in`` = ``B answer`` (PAD-padded) and ``tgt_out`` = ``answer E`` (IGNORE_INDEX-padded).
    """
    _check_arch(arch)
    _check_digit_positions(answer_format, digit_positions)
    if not problems:
        raise ValueError("make_batch needs at least one problem")
    _check_pack(pack, arch)
    for i, pair in enumerate(problems):  # a bare string was "too many values to unpack"
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise ValueError(f"problems[{i}]: expected a (question, answer) pair; got "
                             f"{pair!r:.60}")
    qs = [encode(q) for q, _ in problems]
    ans = [encode(format_answer(a, answer_format)) for _, a in problems]
    if arch == "decoder":
        seqs = [[BOS, *q, EOS, *a, EOS] for q, a in zip(qs, ans, strict=True)]
        tgts = [
            [IGNORE_INDEX] * (len(q) + 1) + [*a, EOS] + [IGNORE_INDEX]
            for q, a in zip(qs, ans, strict=True)
        ]
        auxs = [aux_positions(r, "sequence") for r in seqs] if digit_positions else None
        if pack:
            rows = pack_rows([len(r) for r in seqs], max(len(r) for r in seqs))

            def joined(parts: list[list[int]]) -> list[list[int]]:
                return [[t for i in row for t in parts[i]] for row in rows]

            segs = [[k + 1 for k, i in enumerate(row) for _ in seqs[i]] for row in rows]
            seqs, tgts = joined(seqs), joined(tgts)
            auxs = None if auxs is None else joined(auxs)
        batch = {"tokens": _pad(seqs, PAD), "targets": _pad(tgts, IGNORE_INDEX)}
        if auxs is not None:
            batch["aux"] = _pad(auxs, 0)
        if pack:
            batch["segments"] = _pad(segs, 0)
        return batch
    srcs, tgts_in = [[BOS, *q, EOS] for q in qs], [[BOS, *a] for a in ans]
    batch = {
        "src": _pad(srcs, PAD),
        "src_mask": _pad([[1] * (len(q) + 2) for q in qs], 0).bool(),
        "tgt_in": _pad(tgts_in, PAD),
        "tgt_out": _pad([[*a, EOS] for a in ans], IGNORE_INDEX),
    }
    if digit_positions:
        batch["src_aux"] = _aux_rows(srcs, "question")
        batch["tgt_aux"] = _aux_rows(tgts_in, "answer")
    return batch


def make_prompts(questions: Sequence[str], arch: str) -> list[list[int]]:
    """Generation prompts: ``B question E`` for both archs.

    For ``decoder`` it is the prefix the model continues; for ``encoder_decoder`` it is the
    source, and decoding starts from ``[BOS]``.
    """
    _check_arch(arch)
    return [[BOS, *encode(q), EOS] for q in questions]


def parse_answer(
    ids: Sequence[int] | torch.Tensor, answer_format: str = "msd", *, after_bos: bool = False
) -> str:
    """Generated answer ids -> answer string comparable with the true answer.

    Reads up to the first ``E`` (excluded; all of ``ids`` if there is none), then undoes
    ``answer_format`` (`read_answer`). Malformed output decodes to a string that won't match;
    a generated ``B`` is malformed. ``after_bos=True`` takes an encoder-decoder's whole
    target row, which starts with the ``B`` it was fed, and skips that ``B``.
    """
    if isinstance(ids, torch.Tensor | np.ndarray):
        if ids.ndim != 1:  # a batch's rows: one row at a time (its .tolist() was a TypeError)
            raise ValueError(f"ids: expected one row of token ids; got shape "
                             f"{tuple(ids.shape)}")
        ids = ids.tolist()
    ids = list(ids)
    if after_bos:
        if not ids or ids[0] != BOS:
            raise ValueError(f"after_bos=True: expected ids starting with B ({BOS}), got "
                             f"{ids[:1]}")
        ids = ids[1:]
    if EOS in ids:
        ids = ids[: ids.index(EOS)]
    text = decode(ids)
    return read_answer(text, answer_format)


# --------------------------------------------------------------------------- data sources


def cell_weights(cells: Sequence[Cell], weights: str = "uniform") -> np.ndarray:
    """Probability of drawing each cell in training: ``uniform``, or ``length`` (proportional
    to the cell's longest question, so long problems are not swamped by trivial ones)."""
    if not cells:
        raise ValueError("cell_weights needs at least one cell")
    if weights == "uniform":
        w = np.ones(len(cells))
    elif weights == "length":
        w = np.array([max_lengths([c])[0] for c in cells], dtype=float)
    else:
        raise ValueError(
            f"unknown train weighting {weights!r} (allowed: {', '.join(TRAIN_WEIGHTS)})"
        )
    return w / w.sum()


class TrainStream(Iterator[dict[str, torch.Tensor]]):
    """Endless batches of fresh training problems, resumable bit for bit.

    One numpy ``PCG64(seed)`` drives everything (cell choice, then the problem), so saving
    ``state_dict()`` with a checkpoint and loading it continues the exact same stream.
    ``batch_size`` counts problems; with ``pack`` they fill fewer rows (the same problems).
    """

    def __init__(
        self,
        cells: Sequence[Cell],
        seed: int,
        batch_size: int,
        arch: str,
        answer_format: str = "msd",
        weights: str = "uniform",
        digit_positions: bool = False,
        pack: bool = False,
    ) -> None:
        _check_arch(arch)
        _check_digit_positions(answer_format, digit_positions)
        batch_size = check_int(batch_size, "batch_size", low=1)
        # config pairs as `Cell.from_pair` takes them elsewhere (they failed at the first batch)
        self.cells = [Cell.from_pair(c, f"cells[{i}]") for i, c in enumerate(cells)]
        if len(set(self.cells)) < len(self.cells):  # weights skewed toward the repeated one
            raise ValueError(f"cells: expected each cell once; got {[str(c) for c in cells]}")
        self.probabilities = cell_weights(self.cells, weights)
        self.batch_size = batch_size
        self.arch = arch
        self.answer_format = check_answer_format(answer_format)
        self.weights = weights
        self.digit_positions = digit_positions
        self.pack = _check_pack(pack, arch)
        self._rng = np.random.Generator(np.random.PCG64(check_seed(seed)))

    def problems(self, count: int) -> list[tuple[str, str]]:
        """The next ``count`` problems of the stream, as strings."""
        idx = self._rng.choice(len(self.cells), size=count, p=self.probabilities)
        return [self.cells[i].sample(self._rng) for i in idx.tolist()]

    def __next__(self) -> dict[str, torch.Tensor]:
        return make_batch(self.problems(self.batch_size), self.arch, self.answer_format,
                          self.digit_positions, self.pack)

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position in the stream (plus what it was built from, to check)."""
        return {
            "bit_generator": self._rng.bit_generator.state,
            "cells": [c.label for c in self.cells],
            "weights": self.weights,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from ``state_dict()``; refuses a state saved for different cells/weights."""
        saved = (list(state["cells"]), state["weights"])
        if saved != ([c.label for c in self.cells], self.weights):
            raise ValueError(
                f"TrainStream state was saved for cells {saved[0]} with {saved[1]!r} weights, "
                f"not {[c.label for c in self.cells]} with {self.weights!r}"
            )
        self._rng.bit_generator.state = dict(state["bit_generator"])


def _cell_rng(seed: int, cell: Cell) -> np.random.Generator:
    """Independent stream per cell: ``[seed, n, d]``, or ``[seed, n, 0, *ds]`` when mixed.

    The 0 marks a mixed cell (d >= 1 otherwise), so no two cells share an entropy list.
    """
    key = [seed, cell.n, cell.d] if isinstance(cell.d, int) else [seed, cell.n, 0, *cell.d]
    return np.random.default_rng(key)


def eval_sets(task: ResolvedTask | TaskConfig) -> dict[str, dict[Cell, list[tuple[str, str]]]]:
    """Fixed eval problems: ``{split: {cell: [(question, answer), ...]}}``.

    Each cell draws ``eval_size`` problems from its own rng keyed by ``(eval_seed, cell)``, so
    every model sees identical questions and adding or removing a split changes nothing else.
    Eval problems are not excluded from training (small cells have few distinct problems).
    """
    if isinstance(task, TaskConfig):
        task = task.resolve()
    if not isinstance(task, ResolvedTask):  # a dict failed as an AttributeError
        raise ValueError(f"task: expected a TaskConfig or its resolve(); got {task!r:.60}")

    def draw(cell: Cell) -> list[tuple[str, str]]:
        rng = _cell_rng(task.eval_seed, cell)
        return [cell.sample(rng) for _ in range(task.eval_size)]

    return {name: {cell: draw(cell) for cell in cells} for name, cells in task.eval_splits.items()}
