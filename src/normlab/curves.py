"""Learning curves of several runs side by side, read from their `metrics.jsonl`.

What a recipe comparison needs: accuracy of one split at every periodic evaluation, with the
training wall time it took (`elapsed_s`, the training loop only), as a table or a plot. Runs
need not be finished or evaluated; a run still writing its log is read up to its last full line.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from normlab.io import read_metrics, save_figure
from normlab.stats import percent

if TYPE_CHECKING:
    from normlab.config import RunConfig


@dataclass
class Curve:
    """One run's evaluations of one split: `steps[i]`, `elapsed_s[i]`, `accuracy[i]`."""

    name: str
    steps: list[int]
    elapsed_s: list[float | None]
    accuracy: list[float]


def learning_curve(run_dir: Path, split: str = "train",
                   log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> Curve:
    """The periodic evaluations of `split` in one run; a split it never logged is an error.

    A run that has not logged yet (started, or killed, before its first log step) has no
    points, as one with an empty log, and `log` says so: it was refused as no run folder, and
    took the other runs' curves with it."""
    if not (Path(run_dir) / "metrics.jsonl").exists() and _config(Path(run_dir)) is not None:
        log(f"{str(run_dir)!r}: no metrics.jsonl yet (no step logged): no points")
        records = []
    else:
        records = [r for r in read_metrics(run_dir) if "accuracy" in r]
    if records and not any(split in r["accuracy"] for r in records):
        logged = ", ".join(sorted({s for r in records for s in r["accuracy"]}))
        raise ValueError(f"{str(run_dir)!r}: no split {split!r} in metrics.jsonl "
                         f"(logged: {logged})")
    if not records:  # before its first evaluation: a misspelt split gave an empty table
        names = _split_names(Path(run_dir))
        if names is not None and split not in names:
            raise ValueError(f"{str(run_dir)!r}: no split {split!r} in the run's task "
                             f"(config.toml's splits: {', '.join(names)})")
    rows = [r for r in records if split in r["accuracy"]]
    return Curve(Path(run_dir).name, [r["step"] for r in rows],
                 [r.get("elapsed_s") for r in rows], [float(r["accuracy"][split]) for r in rows])


def _config(run_dir: Path) -> RunConfig | None:
    """The config a run trained with (`train.trained_config`); None where it has none, or one
    that does not read (it gives a title's count and a misspelt split's hint, never what the
    table holds)."""
    from normlab.config import RunConfig
    from normlab.train import trained_config

    try:
        saved = trained_config(Path(run_dir))
        return None if saved is None else RunConfig.from_dict(saved)
    except ValueError:
        return None


def _split_names(run_dir: Path) -> list[str] | None:
    """The splits a run evaluates, from its config.toml; None where it has none to read."""
    cfg = _config(run_dir)
    return None if cfg is None else list(cfg.task.resolve().eval_splits)


def check_same_split(run_dirs: Sequence[Path], split: str) -> None:
    """Runs side by side on one split's curve hold that split's same cells (as `compare`'s
    columns must): runs of two grids were drawn as one "train" column. A run whose config does
    not read, or that has no such split, is left to `learning_curve` to report."""
    first: tuple[list[str], Path] | None = None
    for d in run_dirs:
        cfg = _config(Path(d))
        try:
            cells = None if cfg is None else cfg.validate().eval_splits.get(split)
        except ValueError:
            cells = None
        if cells is None:
            continue
        names = sorted(str(c) for c in cells)
        if first is None:
            first = (names, Path(d))
        elif names != first[0]:
            raise ValueError(f"{str(d)!r}: split {split!r} holds cells {', '.join(names)}, "
                             f"{str(first[1])!r}'s {', '.join(first[0])}; expected one split's "
                             "runs to share its cells (compare --curve draws them as one)")


def periodic_questions(run_dir: Path) -> int | None:
    """Questions a cell in a run's periodic evaluations, its first `train.eval_examples`, where
    those are fewer than `task.eval_size` (a curve's last point can then differ from `normlab
    eval`'s accuracy of the same checkpoint, which asks every question); None where they ask
    every question, or the run has no config to tell."""
    cfg = _config(run_dir)
    if cfg is None or cfg.train.eval_examples >= cfg.task.eval_size:
        return None
    return cfg.train.eval_examples


def run_labels(run_dirs: Sequence[Path | str]) -> list[str]:
    """Names for runs side by side: each folder's name, or as many trailing path parts as
    tell them apart (`a/pre-s0`, `b/pre-s0` from two sweeps, where both were `pre-s0`)."""
    paths = [Path(d).resolve() for d in run_dirs]
    for k in range(1, max((len(p.parts) for p in paths), default=0) + 1):
        labels = ["/".join(p.parts[-k:]) for p in paths]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]  # a folder given twice


def curve_table(curves: Sequence[Curve]) -> tuple[list[str], list[list[str]]]:
    """Rows per evaluated step (union over runs): `accuracy % (elapsed s)` per run, `-` if none."""
    header = ["step", *(c.name for c in curves)]
    steps = sorted({s for c in curves for s in c.steps})
    rows = []
    for s in steps:
        row = [str(s)]
        for c in curves:
            if s not in c.steps:
                row.append("-")
                continue
            i = c.steps.index(s)
            t = c.elapsed_s[i]
            row.append(percent(c.accuracy[i], 1) + ("" if t is None else f" ({t:.0f} s)"))
        rows.append(row)
    return header, rows


def plot_curves(curves: Sequence[Curve], path: Path, split: str = "train") -> None:
    """Accuracy against step and against wall time, one line per run (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for c in curves:
        acc = [100 * a for a in c.accuracy]
        line = ax1.plot(c.steps, acc, "o-", ms=3, label=c.name)[0]
        timed = [(t, a) for t, a in zip(c.elapsed_s, acc, strict=True) if t is not None]
        if timed:
            ax2.plot([t / 60 for t, _ in timed], [a for _, a in timed], "o-", ms=3,
                     color=line.get_color())
    ax1.set_xlabel("step")
    ax1.set_ylabel(f"exact match on {split} (%)")
    ax2.set_xlabel("training wall time (min)")
    for ax in (ax1, ax2):
        ax.set_ylim(0, 100)
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, Path(path))
