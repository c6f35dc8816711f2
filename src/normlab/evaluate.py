"""Exact-match accuracy per cell and split, by batched greedy decoding with the KV cache."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from normlab.checks import check_int, check_on_cpu, is_fraction, is_int
from normlab.io import save_figure
from normlab.model import Model
from normlab.model.generate import greedy_decode
from normlab.stats import percent, wilson_ci
from normlab.tasks.addition import (
    EOS,
    IGNORE_INDEX,
    Cell,
    ResolvedTask,
    aux_positions,
    check_answer_format,
    make_batch,
    make_prompts,
    max_lengths,
    next_aux_position,
    parse_answer,
)

#: what `is_eval_result` asks of an eval.json, as its readers' errors say it
EVAL_RESULT = ("normlab eval results (splits, train among them, each with a count >= 1 of "
               "questions, an accuracy that count can give and its Wilson ci95; "
               "config.model.norm_placement, config.train.seed)")


def is_eval_result(doc: Any) -> bool:
    """`doc` holds what `normlab compare` and the study report read from an `eval.json`, with
    those types: a damaged or foreign file is then one line naming it, not a KeyError."""

    def split_ok(v: Any) -> bool:
        # what `evaluate` writes holds by construction: right answers over a count, inside
        # their Wilson interval; else `compare` printed "10.0 [98.3, 99.4]" as measured
        ci = v.get("ci95") if isinstance(v, dict) else None
        if not (isinstance(v, dict) and is_fraction(v.get("accuracy")) and is_int(v.get("count"))
                and v["count"] >= 1 and isinstance(ci, list) and len(ci) == 2
                and all(is_fraction(x) for x in ci)):
            return False
        right = v["accuracy"] * v["count"]
        if abs(right - round(right)) >= 1e-6:
            return False
        # the interval of that count: an edited 100 of 6000 kept 1 of 60's [0.3%, 8.9%]. To
        # 1e-5: files from before z was exact (1.96) are up to 1.1e-6 off the interval now
        want = wilson_ci(round(right), v["count"])
        return all(abs(a - b) < 1e-5 for a, b in zip(ci, want, strict=True))

    cfg = doc.get("config") if isinstance(doc, dict) else None
    model, train = ((cfg.get("model"), cfg.get("train")) if isinstance(cfg, dict)
                    else (None, None))
    return (isinstance(doc, dict) and isinstance(doc.get("splits"), dict)
            and "train" in doc["splits"]  # every task's first split, which the report reads
            and all(split_ok(v) for v in doc["splits"].values())
            and isinstance(model, dict) and isinstance(model.get("norm_placement"), str)
            and isinstance(train, dict) and is_int(train.get("seed")))


def predict(
    model: Model,
    questions: list[str],
    arch: str,
    answer_format: str,
    max_new: int,
    batch_size: int = 1024,
    digit_positions: bool = False,
    use_cache: bool = True,
) -> list[str]:
    """The model's greedy answers, as strings comparable with the true answers."""
    check_answer_format(answer_format)  # not swallowed below as one wrong answer
    check_batch_size(batch_size)
    out: list[str] = []
    aux_fn = aux_positions if digit_positions else None
    for i in range(0, len(questions), batch_size):
        prompts = make_prompts(questions[i : i + batch_size], arch)
        for ids in greedy_decode(
            model, prompts, max_new=max_new, eos=EOS, aux_fn=aux_fn, use_cache=use_cache,
            aux_next=next_aux_position if aux_fn else None,
        ):
            try:
                out.append(parse_answer(ids, answer_format))
            except ValueError:
                out.append("?")
    return out


def forward_batch(
    model: Model, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Teacher-forced `(logits, targets, n_real_tokens)` of a `make_batch` batch, either arch.

    `targets` is `IGNORE_INDEX` except where the next token is part of the answer.
    `n_real_tokens` is a 0-d tensor on the batch's device, not an int: reading it back would
    make a GPU wait for the forward at every training step (the loop sums it, and reads the
    sum at its log steps).
    """
    if "tokens" in batch:
        packed = {"segments": batch["segments"]} if "segments" in batch else {}
        logits, targets = model(batch["tokens"], aux=batch.get("aux"), **packed), batch["targets"]
        n_tok = (batch["tokens"] != 0).sum()
    else:
        logits = model(batch["src"], batch["tgt_in"], batch["src_mask"], batch.get("src_aux"),
                       batch.get("tgt_aux"))
        targets = batch["tgt_out"]
        n_tok = batch["src_mask"].sum() + (batch["tgt_out"] != IGNORE_INDEX).sum()
    return logits, targets, n_tok


@torch.no_grad()
def answer_token_accuracy(
    model: Model,
    problems: list[tuple[str, str]],
    *,
    answer_format: str,
    digit_positions: bool = False,
    batch_size: int = 1024,
) -> dict[str, Any]:
    """Teacher-forced accuracy of each answer token, to see *where* in the answer a model fails.

    Position j is the j-th token an answer writes in `answer_format`, whatever it is: position 0
    the sign `N` for a negative result, else the first digit (the units digit under
    ``lsd_complement``, whose sign comes last); each answer's closing `E` is counted at its own
    last position, so where a cell's answers differ in length or sign a position mixes digits
    and `E`s (`position_counts` says how many answers reach it). `exact` is the share of
    answers with every token right under teacher forcing (an upper bound on greedy exact
    match, which can also derail after a mistake). `first_token` splits position 0 by the
    sign of the true result.
    """
    check_on_cpu(model)
    if not problems:
        raise ValueError("answer_token_accuracy needs at least one problem")
    check_batch_size(batch_size)
    was = model.training
    model.eval()
    hits: list[torch.Tensor] = []
    real: list[torch.Tensor] = []
    exact = 0
    try:
        for i in range(0, len(problems), batch_size):
            chunk = problems[i : i + batch_size]
            batch = make_batch(chunk, model.cfg.arch, answer_format, digit_positions)
            logits, targets, _ = forward_batch(model, batch)
            is_real = targets != IGNORE_INDEX
            ok = (logits.argmax(-1) == targets) & is_real
            exact += int((ok | ~is_real).all(1).sum())
            # Answer tokens packed to the left: column j is the j-th answer token of each row.
            order = torch.argsort((~is_real).int(), dim=1, stable=True)
            width = int(is_real.sum(1).max())
            hits.append(ok.gather(1, order)[:, :width])
            real.append(is_real.gather(1, order)[:, :width])
    finally:
        model.train(was)
    width = max(h.shape[1] for h in hits)
    ok = torch.cat([torch.nn.functional.pad(h, (0, width - h.shape[1])) for h in hits])
    rl = torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1])) for r in real])
    counts = rl.sum(0)
    neg = torch.tensor([a.startswith("N") for _, a in problems])
    first = ok[:, 0].float()
    return {
        "count": len(problems),
        "exact": exact / len(problems),
        # divided as Python ints: float32's 2/29 was written 0.06896551698...
        "by_position": [int(ok[:, j].sum()) / int(counts[j]) for j in range(width)],
        "position_counts": [int(c) for c in counts],
        "first_token": {
            "negative": int(first[neg].sum()) / int(neg.sum()) if neg.any() else None,
            "positive": int(first[~neg].sum()) / int((~neg).sum()) if (~neg).any() else None,
        },
    }


def check_batch_size(batch_size: object) -> None:
    """Questions a forward: an int >= 1 (-1 gave `predict` no answers, and no error)."""
    check_int(batch_size, "batch_size", low=1, what="an int >= 1 questions a forward")


def check_limit(limit: object) -> None:
    """`limit` examples per cell: None (all) or an int >= 1 (a slice's 0 or -1 would
    silently evaluate none, or all but the last)."""
    if limit is not None:
        check_int(limit, "limit", low=1, what="an int >= 1 examples per cell")


def _check_cells_fit(
    task: ResolvedTask, sets: dict[str, dict[Cell, list[tuple[str, str]]]]
) -> None:
    """Every cell's questions and answers fit the task's longest: decoding stops after the
    task's `max_new` tokens, so a longer answer was cut to a wrong one, and an answer exactly
    that long was read without its E (one that never stopped scored right)."""
    q_max, a_max = task.max_lengths()
    for split, by_cell in sets.items():
        for cell in by_cell:
            if not isinstance(cell, Cell):
                raise ValueError(f"sets[{split!r}]: expected Cell keys; got {cell!r}")
            q, a = max_lengths([cell])
            if q > q_max or a > a_max:
                raise ValueError(
                    f"sets[{split!r}]: cell {cell} has questions up to {q} and answers up to "
                    f"{a} characters, past the task's {q_max} and {a_max}; expected cells "
                    "no longer than the task's (add it to a split of the task)"
                )


def evaluate(
    model: Model,
    task: ResolvedTask,
    sets: dict[str, dict[Cell, list[tuple[str, str]]]],
    *,
    limit: int | None = None,
    batch_size: int = 1024,
    predictor: Callable[[list[str]], list[str]] | None = None,
) -> dict[str, Any]:
    """Accuracy per split (with 95% CI) and per cell; `limit` caps examples per cell. Cells
    must be `Cell`s no longer than the task's longest (decoding stops after its `max_new`
    tokens); others are refused in one line."""
    check_limit(limit)
    check_batch_size(batch_size)
    if not sets:  # {'splits': {}} was returned, no eval.json a reader takes
        raise ValueError("sets: expected at least one split of problems; got none")
    _check_cells_fit(task, sets)
    arch = model.cfg.arch
    max_new = task.max_new()
    predictor = predictor or (
        lambda qs: predict(
            model, qs, arch, task.answer_format, max_new, batch_size, task.digit_positions
        )
    )
    splits: dict[str, Any] = {}
    cells: list[dict[str, Any]] = []
    for split, by_cell in sets.items():
        items = [(cell, q, a) for cell, probs in by_cell.items() for q, a in probs[:limit]]
        if not items:  # an accuracy of 0.0 would be read as a measured one
            raise ValueError(f"sets[{split!r}]: expected at least one problem; got none")
        preds = predictor([q for _, q, _ in items])
        hits: dict[Cell, list[int]] = {}
        for (cell, _, a), p in zip(items, preds, strict=True):
            hits.setdefault(cell, []).append(int(p == a))
        correct = sum(sum(h) for h in hits.values())
        count = sum(len(h) for h in hits.values())
        splits[split] = {
            "accuracy": correct / count,
            "ci95": list(wilson_ci(correct, count)),
            "count": count,
        }
        for cell, h in hits.items():
            cells.append(
                {
                    "n": cell.n,
                    "d": cell.d if isinstance(cell.d, int) else list(cell.d),
                    "cell": str(cell),
                    "split": split,
                    "accuracy": sum(h) / len(h),
                    "count": len(h),
                }
            )
    return {"splits": splits, "cells": cells}


def heatmap(result: dict[str, Any], train_cells: list[Cell], path: Path, title: str = "") -> None:
    """Accuracy over the (n, d) grid; train cells outlined. Mixed-digit cells are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    cells = [c for c in result["cells"] if isinstance(c["d"], int)]
    if not cells:  # an empty grid drew a blank figure and three matplotlib warnings
        fig, ax = plt.subplots(figsize=(4, 1.2))
        ax.axis("off")
        ax.text(0.5, 0.5, "no cell of one digit count to draw;\nmixed-digit cells: eval.json",
                ha="center", va="center", fontsize=9)
        ax.set_title(title or "exact match %", fontsize=9)
        save_figure(fig, path)
        return
    ns = sorted({c["n"] for c in cells})
    ds = sorted({c["d"] for c in cells})
    grid = torch.full((len(ns), len(ds)), float("nan"))
    for c in cells:
        grid[ns.index(c["n"]), ds.index(c["d"])] = 100 * c["accuracy"]  # %, as the cells read
    # at least 2.6 inches: one column's 1.8 left a wrapped title no room beside the y label
    fig, ax = plt.subplots(figsize=(max(2.6, 1.0 + 0.8 * len(ds)), 1.0 + 0.6 * len(ns)))
    im = ax.imshow(grid.numpy(), vmin=0, vmax=100, cmap="viridis", origin="lower")
    train = {(c.n, c.d) for c in train_cells}
    for i, n in enumerate(ns):
        for j, d in enumerate(ds):
            v = grid[i, j].item()
            if not math.isnan(v):
                ax.text(
                    j,
                    i,
                    percent(v / 100, 0),
                    ha="center",
                    va="center",
                    color="black" if v > 50 else "white",
                    fontsize=8,
                )
            if (n, d) in train:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=2, ec="red"))
    ax.set_xticks(range(len(ds)), [str(d) for d in ds])
    ax.set_yticks(range(len(ns)), [str(n) for n in ns])
    ax.set_xlabel("digits per integer (d)")
    ax.set_ylabel("integers per sum (n)")
    # wrapped to the figure's width: on a small grid the line ran off both edges, cutting off
    # the placement and seed, what heatmaps are told apart by (~13 characters an inch at 9 pt)
    width = int(13 * fig.get_figwidth())
    ax.set_title(textwrap.fill(title or "exact match % (red: train cells)", width), fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046).set_label("exact match (%)", fontsize=8)
    fig.tight_layout()
    save_figure(fig, path)
