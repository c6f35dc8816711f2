"""Figures from benchmark results: every target at a glance, and how cost grows.

    python benchmarks/plot.py RESULTS.json [MORE.json ...] --out DIR [--format png,pdf] [--force]

Each RESULTS file is what `run_all.py --out` writes, or one benchmark's `--out`. Several files
(one and two threads, two hosts, before and after a change) are drawn side by side, one marker
per file, labelled by CPU, thread count and commit, so a figure compares like with like only
where its legend says so. Two figures:

- `targets`: the training-step time ratio to the fastest eager reference per placement (and `qkv` /
  `pre`), MFU, decoding's and the collapse sweep's speed-ups, each with the performance
  issue's target drawn as a line and the CI of each median as a bar;
- `scaling`: time and peak memory of a training step and of the collapse sweep as sequence
  length, width and batch grow ×2 and ×4, against the FLOP count's growth (dashed).

A panel whose benchmark is in none of the files says so instead of vanishing. `run_all.py`
draws them next to the JSON it writes, each only if a benchmark it shows ran (`filled`).
"""

from __future__ import annotations

import argparse
import io
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

import targets
from bench_train_step import PLACEMENTS, eager_comparison  # PLACEMENTS: the results' order
from normlab.io import atomic_write_bytes, refuse_overwrite

BENCHMARKS = ("train_step", "mfu", "packing", "decode", "collapse", "scaling", "hooks")
FIGURES = ("targets", "scaling")
#: what a benchmark's JSON holds besides its results (all a skipped one holds; bench_scaling's
#: "skipped" is None, or names the part skipped beside the rest's results)
NOT_RESULTS = {"benchmark", "info", "skipped", "load_note"}
#: the benchmarks each figure draws
DRAWS = {"targets": ("train_step", "mfu", "decode", "collapse"), "scaling": ("scaling",)}
FORMATS = ("png", "pdf", "svg")
SCALED = ("seq_len", "d_model", "batch", "n", "d")  # n, d: real problems' integers, digits
SCALED_BASE = {"n": "problems n4 d2", "d": "problems n4 d2"}  # else "base" (bench_scaling)
MARKERS = ("o", "s", "^", "D", "v", "P")
COLOURS = {"seq_len": "tab:blue", "d_model": "tab:orange", "batch": "tab:green",
           "n": "tab:red", "d": "tab:purple"}


class ResultsError(ValueError):
    """Bad input, already a one-line message that names its file."""


@dataclass
class Source:
    """One results file: its label and its benchmarks by name."""

    path: Path
    label: str
    results: dict[str, dict[str, Any]]


def _short_cpu(cpu: str) -> str:
    cpu = re.sub(r"\((R|TM)\)|\bProcessor\b|\bCPU\b|\d+-Core|@.*$", "", cpu)
    return " ".join(cpu.split()[:3]) or "unknown CPU"


def label_for(info: dict[str, Any]) -> str:
    """'Intel Xeon, 1 thread, 612c6d0' ('NVIDIA H100 80GB HBM3, 612c6d0' for a GPU run):
    enough to tell the files in one legend apart."""
    threads = info.get("threads")
    gpu = info.get("gpu")
    parts = [gpu["name"] if gpu else _short_cpu(str(info.get("cpu", "")))]
    if threads is not None and not gpu:  # a GPU run's host threads only feed it
        parts.append(f"{threads} thread{'s' if threads != 1 else ''}")
    if info.get("git"):
        parts.append(str(info["git"])[:7] + ("-dirty" if "dirty" in str(info["git"]) else ""))
    return ", ".join(parts)


def load(path: Path) -> Source:
    """A run_all.py or single-benchmark JSON; anything else is a one-line ResultsError."""
    if not path.is_file():
        raise ResultsError(f"{str(path)!r}: no such results file")
    try:
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ResultsError(f"{str(path)!r}: not JSON ({err})") from None
    if isinstance(obj, dict) and isinstance(obj.get("results"), dict):
        results = {k: v for k, v in obj["results"].items()
                   if k in BENCHMARKS and isinstance(v, dict) and "error" not in v}
        info = obj.get("info", {})
    elif isinstance(obj, dict) and obj.get("benchmark") in BENCHMARKS:
        results, info = {obj["benchmark"]: obj}, obj.get("info", {})
    else:
        raise ResultsError(f"{str(path)!r}: expected the JSON of run_all.py --out or of one "
                         f"benchmark's --out (a 'results' or 'benchmark' key)")
    if not results:
        raise ResultsError(f"{str(path)!r}: holds no benchmark results (all failed or skipped?)")
    first = next(iter(results.values()))
    return Source(path, label_for(first.get("info", info)), results)


def load_all(paths: Sequence[Path]) -> list[Source]:
    """Every file, with its name added to any label another file shares (one legend entry each)."""
    sources = [load(Path(p)) for p in paths]
    labels = [s.label for s in sources]
    for s in sources:
        if labels.count(s.label) > 1:
            s.label = f"{s.label} ({s.path.stem})"
    return sources


def _with(sources: Sequence[Source], name: str) -> list[tuple[int, Source]]:
    return [(i, s) for i, s in enumerate(sources) if name in s.results]


def _empty(ax: Axes, title: str, name: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.text(0.5, 0.5, f"no {name} results in the inputs", ha="center", va="center",
            transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def _points(
    ax: Axes, sources: Sequence[Source], name: str, categories: list[str],
    value: Callable[[dict[str, Any], str], Any], title: str, ylabel: str,
) -> bool:
    """Median with its CI per category, one marker per file, dodged sideways.

    `value(result, category)` gives the benchmark's ratio statistics (a dict with `median`
    and `ci`) or a bare number, or None where that file lacks the category.
    """
    have = _with(sources, name)
    if not have:
        _empty(ax, title, name)
        return False
    width = 0.7 / max(len(sources), 1)
    for i, src in have:
        xs, ys, lo, hi = [], [], [], []
        for k, cat in enumerate(categories):
            v = value(src.results[name], cat)
            if v is None:
                continue
            med = v["median"] if isinstance(v, dict) else float(v)
            ci = v.get("ci", [med, med]) if isinstance(v, dict) else [med, med]
            if not ci[0] <= med <= ci[1]:
                raise ResultsError(f"{str(src.path)!r}: {name} {cat}: median {med:g} lies "
                                 f"outside its CI [{ci[0]:g}, {ci[1]:g}]")
            xs.append(k + (i - (len(sources) - 1) / 2) * width)
            ys.append(med)
            lo.append(med - ci[0])
            hi.append(ci[1] - med)
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt=MARKERS[i % len(MARKERS)], color=f"C{i}",
                    capsize=3, label=src.label)
    ax.set_xticks(range(len(categories)), categories, fontsize=8)
    ax.set_xlim(-0.6, len(categories) - 0.4)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    return True


def _target(ax: Axes, y: float, text: str, x0: float | None = None,
            x1: float | None = None) -> None:
    kw = {"color": "black", "linestyle": "--", "linewidth": 1}
    if x0 is None or x1 is None:
        ax.axhline(y, **kw)
        x_text = ax.get_xlim()[0]
    else:
        ax.plot([x0, x1], [y, y], **kw)
        x_text = x0
    ax.annotate(text, (x_text, y), xytext=(2, 2), textcoords="offset points", fontsize=7)


def _step_width(result: dict[str, Any]) -> str:
    widths = result.get("widths", {})
    return targets.DEFAULT_WIDTH if targets.DEFAULT_WIDTH in widths else next(iter(widths), "")


def _widths(sources: Sequence[Source], name: str) -> str:
    """', d64' (or ', d64/d128' across files): the width each file's panel shows."""
    widths = sorted({_step_width(s.results[name]) for _, s in _with(sources, name)} - {""})
    return f", d{'/'.join(widths)}" if widths else ""


def targets_figure(sources: Sequence[Source]) -> Figure:
    """Four panels, one per timed target, each with its target line."""
    fig = Figure(figsize=(11, 7.5), layout="constrained")
    (a, b), (c, d) = fig.subplots(2, 2)

    cats = [*PLACEMENTS, "qkv / pre"]

    def step(res: dict[str, Any], cat: str) -> Any:
        w = res.get("widths", {}).get(_step_width(res))
        if w is None:
            return None
        if cat == "qkv / pre":
            return w.get("qkv_over_pre")
        return eager_comparison(w, f"normlab-{cat}")[1]

    title = f"1. Training step{_widths(sources, 'train_step')}: time / fastest eager reference"
    if _points(a, sources, "train_step", cats, step, title, "time ratio (lower = faster)"):
        _target(a, targets.STEP_RATIO.bound, f"target: {targets.STEP_RATIO}", -0.5,
                len(PLACEMENTS) - 0.5)
        _target(a, targets.QKV_OVER_PRE.bound, str(targets.QKV_OVER_PRE), len(PLACEMENTS) - 0.4,
                len(PLACEMENTS) + 0.4)

    mfu_names: list[str] = []
    for _, s in _with(sources, "mfu"):
        w = s.results["mfu"]["widths"].get(_step_width(s.results["mfu"]), {})
        mfu_names += [n for n in w.get("contenders", {}) if n not in mfu_names]

    def mfu(res: dict[str, Any], cat: str) -> Any:
        c = res["widths"].get(_step_width(res), {}).get("contenders", {}).get(cat)
        if c is None:
            return None
        ci = [100 * x for x in c.get("mfu_ci", [c["mfu"]] * 2)]  # results before mfu_ci: none
        return {"median": 100 * c["mfu"], "ci": ci}

    # "nanogpt-manual" beside "x-transformers" would overlap: the references on two lines
    short = [n.replace("normlab-", "").replace("-", "-\n") for n in mfu_names]
    title = f"2. Model FLOP utilisation{_widths(sources, 'mfu')}"
    if _points(b, sources, "mfu", mfu_names, mfu, title, "% of the measured matmul peak"):
        b.set_xticks(range(len(short)), short, fontsize=8)
        _target(b, targets.MFU_PCT.bound, f"target: {targets.MFU_PCT}%")
        b.set_ylim(0, max(b.get_ylim()[1], targets.MFU_PCT.bound * 1.15))

    cells: list[str] = []
    for _, s in _with(sources, "decode"):
        cells += [f"{r['placement']} {r['cell']}" for r in s.results["decode"]["results"]
                  if f"{r['placement']} {r['cell']}" not in cells]

    def decode(res: dict[str, Any], cat: str) -> Any:
        return next((r["speedup"] for r in res["results"]
                     if f"{r['placement']} {r['cell']}" == cat), None)

    if _points(c, sources, "decode", cells, decode, "3. Greedy decoding: uncached / cached",
               "speed-up (higher = faster)"):
        _target(c, targets.DECODE.bound, f"target: {targets.DECODE}x")

    sweep_cats = ["perturbed forwards", "whole call"]
    keys = {"perturbed forwards": "speedup_sweep", "whole call": "speedup_call"}
    if _points(d, sources, "collapse", sweep_cats, lambda r, k: r.get(keys[k]),
               "4. Collapse sweep: naive loop / vectorised", "speed-up (higher = faster)"):
        _target(d, targets.SWEEP.bound, f"target: {targets.SWEEP}x")
        d.set_ylim(0, max(d.get_ylim()[1], targets.SWEEP.bound * 1.15))

    legend: dict[str, Any] = {}  # one entry per file, whichever panel drew it first
    for ax in (a, b, c, d):
        for handle, lab in zip(*ax.get_legend_handles_labels(), strict=True):
            legend.setdefault(lab, handle)
    if legend:
        fig.legend(list(legend.values()), list(legend), loc="outside lower center",
                   ncol=min(len(legend), 3), fontsize=8)
    return fig


def _scaled(kind: dict[str, Any], dim: str, key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    base = SCALED_BASE.get(dim, "base")
    for factor, row in ((1, base), (2, f"{dim} x2"), (4, f"{dim} x4")):
        if row in kind and kind[row].get(key) is not None:
            xs.append(factor)
            ys.append(kind[row][key])
    return xs, ys


def scaling_figure(sources: Sequence[Source]) -> Figure:
    """Time and peak memory growth (solid; colour = what grows, marker = file) against FLOPs."""
    fig = Figure(figsize=(10, 7.5), layout="constrained")
    axes = fig.subplots(2, 2)
    have = _with(sources, "scaling")
    rows = (("train", "training step (pre)"), ("collapse", "collapse sweep (qkv)"))
    for r, (kind_name, what) in enumerate(rows):
        kinds = [(i, s.results["scaling"].get("kinds", {}).get(kind_name)) for i, s in have]
        kinds = [(i, k) for i, k in kinds if k]
        for c, (key, quantity) in enumerate((("time_ratio", "time"),
                                             ("memory_ratio", "peak memory"))):
            ax = axes[r][c]
            title = f"5. {what}: {quantity} relative to base"
            if not kinds:
                _empty(ax, title, f"scaling ({kind_name})")
                continue
            for i, kind in kinds:
                for dim in SCALED:
                    xs, ys = _scaled(kind, dim, key)
                    if xs:  # files before the twenty-third session have no problem rows
                        ax.plot(xs, ys, marker=MARKERS[i % len(MARKERS)], color=COLOURS[dim])
            if key == "time_ratio":
                # each dim's count from the file with the most of its rows: a --quick file has
                # no x4 rows (the sweep's counts also differ a little between files, by n_draws)
                for dim in SCALED:
                    xs, ys = max((_scaled(k, dim, "flop_ratio") for _, k in kinds),
                                 key=lambda xy: len(xy[0]))
                    if xs:
                        ax.plot(xs, ys, color=COLOURS[dim], linestyle="--", linewidth=1)
            else:
                ax.plot([1, 4], [1, 4], color="grey", linestyle=":", linewidth=1)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.set_xticks([1, 2, 4], ["base", "×2", "×4"])
            ticks = [t for t in (0.5, 1, 2, 4, 8, 16) if ax.get_ylim()[0] <= t <= ax.get_ylim()[1]]
            ax.set_yticks(ticks, [f"{t:g}" for t in ticks])
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("seq len, d_model, batch, or a problem's n or d, relative to base",
                          fontsize=9)
            ax.grid(alpha=0.3, which="both")
    if have:
        names = {"n": "n (problems)", "d": "d (problems)"}
        handles = [Line2D([], [], color=COLOURS[d], label=names.get(d, d)) for d in SCALED]
        handles += [Line2D([], [], color="black", marker=MARKERS[i % len(MARKERS)],
                           linestyle="none", label=s.label) for i, s in have]
        handles += [Line2D([], [], color="black", linestyle="--", linewidth=1,
                           label="FLOPs (time panels)"),
                    Line2D([], [], color="grey", linestyle=":", linewidth=1,
                           label="linear (memory panels)")]
        fig.legend(handles=handles, loc="outside lower center", ncol=4, fontsize=8)
    return fig


LAYOUT_ERRORS = (KeyError, TypeError, IndexError, AttributeError, ValueError)


def filled(results: dict[str, Any]) -> list[str]:
    """The figures a run's results fill: those showing a benchmark that ran (neither failed
    nor skipped), so a run of `--only hooks` draws none and a failed scaling run no empty one."""
    ran = {name for name, r in results.items()  # a skipped one holds no more than its record
           if isinstance(r, dict) and "error" not in r and set(r) - NOT_RESULTS}
    return [f for f in FIGURES if ran & set(DRAWS[f])]


def draw(sources: Sequence[Source], figures: Sequence[str] = FIGURES) -> dict[str, Figure]:
    """The figures asked for; a file whose JSON lacks what they read is a one-line error
    naming it."""
    makers = {"targets": targets_figure, "scaling": scaling_figure}
    try:
        return {name: makers[name](sources) for name in figures}
    except LAYOUT_ERRORS as err:
        if isinstance(err, ResultsError):
            raise
        for src in sources:  # which file: the first that fails alone
            try:
                for name in figures:
                    makers[name]([src])
            except LAYOUT_ERRORS as alone:
                raise ResultsError(f"{str(src.path)!r}: not the layout this script reads "
                                 f"({type(alone).__name__}: {alone})") from None
        raise


def save(fig: Figure, path: Path) -> None:
    """Atomic, so an interrupted run leaves the old figure or the new one."""
    buf = io.BytesIO()
    fig.savefig(buf, format=path.suffix[1:], dpi=150)
    atomic_write_bytes(path, buf.getvalue())


def outputs(folder: Path, stem: str, formats: Sequence[str],
            figures: Sequence[str] = FIGURES) -> dict[Path, str]:
    """Each file to write -> the figure it holds."""
    prefix = f"{stem}_" if stem else ""
    return {folder / f"{prefix}{name}.{fmt}": name for name in figures for fmt in formats}


def write_figures(paths: Sequence[Path], folder: Path, stem: str = "",
                  formats: Sequence[str] = ("png",), force: bool = False,
                  figures: Sequence[str] = FIGURES) -> list[Path]:
    """Load the results, refuse to replace existing figures unless `force`, draw and save
    `figures` (both by default; one, to draw it from other files than the other)."""
    if folder.exists() and not folder.is_dir():
        raise ResultsError(f"--out: {str(folder)!r} is a file; expected a folder for the figures")
    sources = load_all(paths)
    paths_out = outputs(folder, stem, formats, figures)
    for t in paths_out:
        refuse_overwrite(t.parent, t.name, force)
    figs = draw(sources, figures)
    folder.mkdir(parents=True, exist_ok=True)
    for path, name in paths_out.items():
        save(figs[name], path)
    return list(paths_out)


def _subset(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        items = [f.strip() for f in text.split(",") if f.strip()]
        bad = [f for f in items if f not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated subset of {', '.join(allowed)}; got {text!r}")
        return items
    return parse


_formats = _subset(FORMATS)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="+", type=Path, help="results JSON file(s)")
    parser.add_argument("--out", type=Path, required=True, help="folder for the figures")
    parser.add_argument("--format", type=_formats, default=["png"],
                        help=f"comma-separated, from {', '.join(FORMATS)} (default png)")
    parser.add_argument("--figures", type=_subset(FIGURES), default=list(FIGURES),
                        help=f"comma-separated, from {', '.join(FIGURES)} (default both)")
    parser.add_argument("--force", action="store_true", help="replace existing figures")
    args = parser.parse_args(argv)
    try:
        written = write_figures(args.results, args.out, formats=args.format, force=args.force,
                                figures=args.figures)
    except ValueError as err:
        parser.error(str(err).splitlines()[0])
    for p in written:
        print(p)


if __name__ == "__main__":
    main()
