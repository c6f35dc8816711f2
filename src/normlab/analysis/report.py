"""`analyze_run`: every analysis of one trained run, written to `RUN_DIR/analysis/`.

Files: `norms.json` + `norms.png` (H1 norm spread), `collapse.json` + `collapse.png` (H2 circuit
collapse, accuracy under noise, theory beside it), `collapse_rows.npz` (per sparse row: site
index, head, example, query position, winning key, weight, collapse frequency per sigma; `meta`,
the record and the SHA-256 of the collapse.json beside it) and
`interference.json` + `interference.png` (per-head probe and the synthetic demonstration). Every
JSON carries `provenance()`, the run config, the seed and the analysis parameters.

Defaults and their cost (our choices): 256 teacher-forced sequences of the `train` split (the
first ceil(256 / n_cells) fixed eval problems of each train cell, so every cell counts equally
and the same problems serve accuracy), 32 noise draws per sigma over 8 sigmas (sigma = 0 is run
once), 256 Monte Carlo draws for the theory, 4 null-space directions per head. Measured on one
CPU thread of a busy 2-core machine: about 50 s for a 4-layer d_model = 64 decoder (0.2M
parameters) and 56 s for a 2+2-layer d_model = 128 encoder-decoder (0.9M); the vectorised
collapse sweep is about 70% of it. Cost scales with n_examples * n_draws * len(sigmas).
"""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from normlab.analysis.collapse import (
    DEFAULT_SIGMAS,
    MODES,
    NOISES,
    ROWS,
    _check_choice,
    check_targets,
    check_threshold,
    measure_collapse,
    perturbed_accuracy,
    plot_collapse,
)
from normlab.analysis.data import (
    data_from_sets,
    resolve_sites,
    select_problems,
)
from normlab.analysis.interference import (
    check_alpha,
    interference_probe,
    plot_interference,
    synthetic_interference,
)
from normlab.analysis.norms import norm_spread, plot_norm_spread
from normlab.checks import check_int, check_seed, check_sigmas, did_you_mean, is_int
from normlab.io import (
    atomic_write_bytes,
    provenance,
    refuse_overwrite,
    write_json,
    written_together,
)

if TYPE_CHECKING:
    from normlab.analysis.data import EvalData
    from normlab.config import RunConfig
    from normlab.model import Model


def _checked(
    sigmas: Sequence[float], threshold: float, targets: Sequence[str] | str, mode: str,
    noise: str, n_draws: int, n_examples: int, seed: int, alpha: float, rows: str = "all",
) -> tuple[list[float], float, tuple[str, ...], int]:
    """`analyze_run`'s checks before any work (sites and heads wait for the model): a bad
    value is one line naming it, not an error after the sweep it would have spoiled."""
    _check_choice(mode, MODES, "mode")
    _check_choice(noise, NOISES, "noise")
    _check_choice(rows, ROWS, "rows")
    n_draws = check_int(n_draws, "n_draws", low=1)
    n_examples = check_int(n_examples, "n_examples", low=1)
    check_alpha(alpha)
    return (check_sigmas(sigmas), check_threshold(threshold), check_targets(targets),
            check_seed(seed))


def _recorded(sigmas: Sequence[float], n_draws: int, threshold: float, mode: str,
              targets: Sequence[str] | str, noise: str, n_examples: int,
              splits: Sequence[str] | str | None, sites: Sequence[str] | None,
              heads: Sequence[int] | None, alpha: float, rows: str = "all") -> dict[str, Any]:
    """The settings as the result files record them (`params`), from checked values."""
    splits, sites, heads = (_one_as_list(v) for v in (splits, sites, heads))
    return {"sigmas": list(sigmas), "n_draws": n_draws, "threshold": threshold, "mode": mode,
            "targets": list(targets), "noise": noise, "n_examples": n_examples,
            "splits": None if splits is None else list(splits), "sites": sites, "heads": heads,
            "alpha": alpha, "rows": rows}


def _one_as_list(value: Any) -> Any:
    """One split or site name, or one head, as a list of one; anything else as it is."""
    return [value] if isinstance(value, str) or is_int(value) else value


def recorded_splits(value: Any) -> Any:
    """A record's `params.splits` as a list of split names, also from older records: one name
    alone, or one name as its letters (analyze_run(splits="train") recorded ['t', 'r', ...])."""
    value = _one_as_list(value)
    if isinstance(value, list) and value and all(isinstance(x, str) and len(x) == 1
                                                 for x in value):
        return ["".join(value)]
    return value


def check_same_analysis(folder: Path, args: dict[str, Any]) -> None:
    """A run's finished analysis (`folder/collapse.json`) must be the one `args` ask for: a
    sweep whose `[run.analysis]` changed kept the old results without a word."""
    path = Path(folder) / "collapse.json"
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return  # no readable record to compare (an analysis from before params were kept)
    if not isinstance(doc, dict) or "params" not in doc:
        return
    a = ANALYSIS_DEFAULTS | args
    sigmas, threshold, targets, seed = _checked(a["sigmas"], a["threshold"], a["targets"],
                                                a["mode"], a["noise"], a["n_draws"],
                                                a["n_examples"], a["seed"], a["alpha"], a["rows"])
    want = _recorded(sigmas, a["n_draws"], threshold, a["mode"], targets, a["noise"],
                     a["n_examples"], a["splits"], a["sites"], a["heads"], a["alpha"], a["rows"])
    want = json.loads(json.dumps(want | {"seed": seed}))
    # a record from before `rows` was kept counted every row
    have = {"rows": "all"} | doc["params"] | {"seed": doc.get("seed")}
    # `want` comes normalised from `_recorded`; records written before it may hold one name
    # (or head) alone, or one split name as its letters (`recorded_splits`)
    for key in ("sites", "heads"):
        if key in have:
            have[key] = _one_as_list(have[key])
    if "splits" in have:
        have["splits"] = recorded_splits(have["splits"])
    for key, value in want.items():
        if key in have and have[key] != value:
            raise ValueError(f"{str(folder)!r} holds an analysis with {key} = {have[key]!r}, "
                             f"where {value!r} is asked; delete it to redo the analysis")


def check_analysis_args(args: dict[str, Any], where: str = "analysis") -> None:
    """Arguments for `analyze_run` given ahead of the run (a sweep's `[run.analysis]`): the
    keys must be its keyword arguments, and the values pass the checks it makes first."""
    for key in args:
        if key not in ANALYSIS_DEFAULTS:
            raise ValueError(f"{where}.{key}: unknown key{did_you_mean(key, ANALYSIS_DEFAULTS)}"
                             f"; expected one of {', '.join(ANALYSIS_DEFAULTS)}")
    a = ANALYSIS_DEFAULTS | args
    if not isinstance(a["figures"], bool):
        raise ValueError(f"{where}.figures: expected true or false; got {a['figures']!r}")
    for name, kind in (("splits", str), ("sites", str), ("heads", int)):
        v = a[name]  # names are checked against the task and the model when those exist
        if not (v is None or (isinstance(v, kind) and not isinstance(v, bool)) or (isinstance(
                v, list | tuple) and all(isinstance(x, kind) and not isinstance(x, bool)
                                         for x in v))):
            raise ValueError(f"{where}.{name}: expected a {kind.__name__} or a list of them; "
                             f"got {v!r}")
    try:
        _checked(a["sigmas"], a["threshold"], a["targets"], a["mode"], a["noise"], a["n_draws"],
                 a["n_examples"], a["seed"], a["alpha"], a["rows"])
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def write_collapse(out: Path, collapse: dict[str, Any], rows: dict[str, Any]) -> list[str]:
    """`collapse.json` and its per-row columns, `collapse_rows.npz`; returns their paths. The
    npz's `meta` (a JSON string) records what every result file does (the seed, parameters,
    config, versions and commit) and the SHA-256 of the collapse.json written with it, so a
    copied npz still says where it came from."""
    write_json(out / "collapse.json", collapse)
    meta = {k: collapse[k] for k in ("seed", "params", "checkpoint_step", "run_dir", "config",
                                     "provenance", "hf_dir", "hf", "input") if k in collapse}
    meta["collapse_json_sha256"] = hashlib.sha256((out / "collapse.json").read_bytes()).hexdigest()
    buf = io.BytesIO()  # written as atomically as the JSON beside it
    np.savez_compressed(buf, sites=np.array(collapse["sites"]),
                        sigmas=np.array(collapse["sigmas"]), meta=np.array(json.dumps(meta)),
                        **{k: v.numpy() for k, v in rows.items()})
    atomic_write_bytes(out / "collapse_rows.npz", buf.getvalue())
    return [str(out / "collapse.json"), str(out / "collapse_rows.npz")]


def measure_norms_and_collapse(
    model: Model, data: EvalData, common: dict[str, Any], seconds: dict[str, float],
    timer: str, **collapse_args: Any,
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The two measurements a run's analysis and a Hugging Face model's share: norms.json's
    document and the collapse sweep's (its per-row columns apart, for collapse_rows.npz), each
    timed into `seconds` (the sweep under `timer`)."""
    t0 = time.perf_counter()
    norms = norm_spread(model, data) | common | {"provenance": provenance()}
    seconds["norms"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    collapse = measure_collapse(model, data, **collapse_args)
    rows = collapse.pop("rows")
    seconds[timer] = time.perf_counter() - t0
    return norms, collapse, rows


def write_analysis(stage: Path, title: str, norms: dict[str, Any], collapse: dict[str, Any],
                   rows: dict[str, Any], interference: dict[str, Any] | None = None, *,
                   figures: bool = True) -> list[str]:
    """One analysis's result files (and its figures, titled `title`) into `stage`, the folder
    `io.written_together` moves into place; returns their names. A run's analysis and a
    Hugging Face model's (no interference) write the same files by this one function."""
    names = ["norms.json"]
    write_json(stage / "norms.json", norms)
    names += [Path(f).name for f in write_collapse(stage, collapse, rows)]
    if interference is not None:
        write_json(stage / "interference.json", interference)
        names.append("interference.json")
    if figures:
        plot_norm_spread(norms, stage / "norms.png", f"{title}: scale / layer median, 5-95%")
        plot_collapse(collapse, stage / "collapse.png", f"{title}: circuit collapse")
        names += ["norms.png", "collapse.png"]
        if interference is not None:
            plot_interference(interference, stage / "interference.png", title)
            names.append("interference.png")
    return names


def check_analysis_fits(args: dict[str, Any], cfg: RunConfig, where: str = "analysis") -> None:
    """`args` against one run's config before it trains (a sweep's runs): splits against its
    task, sites and heads against its model, by the very checks `analyze_run` makes on the
    trained run. The model is built on the meta device: its modules without memory or weights."""
    import torch

    from normlab.model import build_model
    from normlab.tasks.addition import eval_sets

    a = ANALYSIS_DEFAULTS | args
    with torch.device("meta"):
        model = build_model(cfg.model)
    task = cfg.task.resolve()
    checks: dict[str, Callable[[], Any]] = {
        # the fit only: a count past the eval sets is said by each run's analysis, not here
        # once for each model of a sweep's grid too
        "splits": lambda: select_problems(task, eval_sets(task), a["n_examples"], a["splits"],
                                          warn=lambda s: None),
        "sites": lambda: resolve_sites(model, a["sites"]),
        "heads": lambda: resolve_sites(model, a["sites"], a["heads"]),  # sites checked above
    }
    for key, check in checks.items():
        try:
            check()
        except ValueError as err:
            raise ValueError(f"{where}.{key}: {str(err).removeprefix(key + ': ')}") from None


def analyze_run(
    run_dir: Path,
    out: Path | None = None,
    *,
    sigmas: Sequence[float] = DEFAULT_SIGMAS,
    n_draws: int = 32,
    threshold: float = 0.9,
    mode: str = "token",
    targets: Sequence[str] | str = ("q", "k", "v"),
    noise: str = "normal",
    n_examples: int = 256,
    seed: int = 0,
    splits: Sequence[str] | None = ("train",),
    sites: Sequence[str] | None = None,
    heads: Sequence[int] | None = None,
    alpha: float = 0.5,
    figures: bool = True,
    rows: str = "all",
    overwrite: bool = True,
) -> dict[str, Any]:
    """Run norm spread, collapse (+ accuracy and theory) and interference on one run folder.

    `out` defaults to `run_dir/analysis`. `splits` picks the eval splits the problems come from
    (None: all); `sites`/`heads` restrict the perturbed and measured attention sites and heads
    (collapse only; the norm spread and probe cover the whole model unless `sites`/`heads` are
    given, which then also restrict the probe). `alpha` is the probe's injected norm fraction.
    `rows` picks the query rows that may count as sparse (`collapse.ROWS`; the collapse sweep
    and its theory only: the norm spread and the probe read every real position).
    `overwrite=False` (the CLI without --force) refuses an `out` holding the analysis's JSON
    files (a figure without them is a killed command's, replaced), once the scalar arguments
    and the run folder have passed their checks (`sites`, `heads` and `splits` are checked
    after, against the loaded run).
    Returns the three JSON documents plus `files` and `seconds`.
    """
    from normlab.tasks.addition import eval_sets
    from normlab.train import ANALYSIS_FILES, check_run_folder, load_run

    # the seed comes back an int for the result files, whatever integer was given
    sigmas, threshold, targets, seed = _checked(sigmas, threshold, targets, mode, noise,
                                                n_draws, n_examples, seed, alpha, rows)
    run_dir = Path(run_dir)
    out = run_dir / "analysis" if out is None else Path(out)
    check_run_folder(run_dir)  # before the lock, which makes the analysis folder
    # its result files (a figure without them is a killed command's, replaced: README)
    refuse_overwrite(out, [n for n in ANALYSIS_FILES if n.endswith(".json")], overwrite)
    # the folder locked first (a second analysis refused before it loads anything); the files
    # land together once all are made, interference.json last (the sweep's mark of a whole
    # analysis): a failure or kill part way leaves the folder as it was
    with written_together(out, "interference.json", name="analysis folder") as stage:
        cfg, model, meta = load_run(run_dir)
        resolve_sites(model, sites, heads)  # fail on a bad selection before any work
        task = cfg.task.resolve()
        sets, per_cell = select_problems(task, eval_sets(task), n_examples, splits)
        data = data_from_sets(sets, cfg.model.arch, task.answer_format, task.digit_positions)
        params = _recorded(sigmas, n_draws, threshold, mode, targets, noise, n_examples, splits,
                           sites, heads, alpha, rows) | {"n_examples_used": data.n_examples,
                                                         "per_cell": per_cell}
        common = {"run_dir": str(run_dir), "checkpoint_step": meta.get("step"), "seed": seed,
                  "params": params, "config": cfg.to_dict()}
        seconds: dict[str, float] = {}
        norms, collapse, row_columns = measure_norms_and_collapse(
            model, data, common, seconds, "collapse_sweep", sigmas=sigmas, n_draws=n_draws,
            threshold=threshold, mode=mode, targets=targets, noise=noise, sites=sites,
            heads=heads, seed=seed, rows=rows)
        t0 = time.perf_counter()
        collapse |= perturbed_accuracy(model, task, sets, sigmas=sigmas, limit=per_cell,
                                       mode=mode, targets=targets, noise=noise, sites=sites,
                                       heads=heads, seed=seed)
        seconds["accuracy"] = time.perf_counter() - t0
        collapse |= common | {"provenance": provenance()}

        t0 = time.perf_counter()
        interference = {
            "probe": interference_probe(model, data, alpha=alpha, sites=sites, heads=heads,
                                        seed=seed),
            "synthetic": synthetic_interference(seed=seed),
        } | common | {"provenance": provenance()}
        seconds["interference"] = time.perf_counter() - t0

        names = write_analysis(stage, f"{run_dir.name} ({cfg.model.arch}, "
                               f"{cfg.model.norm_placement})", norms, collapse, row_columns,
                               interference, figures=figures)
    files = [str(out / n) for n in names]
    return {"out": str(out), "files": files, "seconds": seconds, "norms": norms,
            "collapse": collapse, "interference": interference}


#: `analyze_run`'s keyword arguments and their defaults: what a sweep's `[run.analysis]` may set
ANALYSIS_DEFAULTS: dict[str, Any] = {
    n: p.default for n, p in inspect.signature(analyze_run).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY}
