"""The study report: the paper's headline claims beside ours, with CIs over seeds and verdicts.

Verdict rules (computed, never set by hand; `normlab.stats`):
- H1 norm spread: h90 of Pre-Norm models (90% of norm-input ratios lie within 1 ± h90, pooled
  over every norm input). `agrees` if the 95% CI over seeds lies in [0.10, 0.40] (a factor 2
  around the paper's 0.20), `disagrees` if it misses that band, else `inconclusive`. The seeds'
  variance is floored at each seed's own, over its examples (`norms.h90_var`: thousands of
  ratios, but from a few hundred questions whose tokens move together), where every seed's
  norms.json records one (those written before it did not: no floor).
- H2 circuit collapse: Pre-Norm collapse rate at sigma = 0.1. Band [0.005, 0.02] (factor 2
  around 1%), same rule. The seeds' variance is floored as H3's is, over each seed's row-draws
  (sparse rows x draws), so seeds that both see no flip do not give an interval of zero width.
- H3 in-distribution parity: per-seed difference qkv - pre of train-cell accuracy. `agrees` if
  the CI lies in [-0.02, +0.02], `disagrees` if it misses it. The seeds' variance is floored at
  the differences' mean binomial variance (each accuracy's, Agresti-Coull's p~(1 - p~) / n~
  with n~ = questions + 4 and p~ = (right + 2) / n~), so seeds that happen to agree exactly, or
  score 100%, do not give an interval of zero width.
- H4 out-of-distribution gap: per-seed difference qkv - pre of held-out accuracy (mean over
  the held-out splits). `agrees` if the CI is below 0 (QKV-Norm worse), `disagrees` if above.
  The same binomial floor as H3.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from normlab.checks import is_fraction, is_int, is_real, is_seconds
from normlab.evaluate import EVAL_RESULT, is_eval_result
from normlab.io import atomic_write_text, provenance, read_json, save_figure, write_json
from normlab.stats import mean_ci, percent, verdict_band, verdict_sign
from normlab.train import DONE, DONE_RECORD, RUNS_ON

SIGMA_H2 = 0.1
CLAIMS = {
    "H1": "norm spread in trained Pre-Norm models: about ±20% for 90% of embeddings",
    "H2": "Pre-Norm circuit collapse: about 1% of sparse rows at norm noise ≲ 10%",
    "H3": "Pre-Norm vs QKV-Norm in distribution: comparable accuracy",
    "H4": "Pre-Norm vs QKV-Norm out of distribution: QKV-Norm worse",
}


def verdict_rules() -> list[str]:
    """The rules of the module docstring, one Markdown bullet per claim."""
    text = (__doc__ or "").split("\n- ", 1)[1]
    return ["- " + " ".join(item.split()) for item in text.split("\n- ")]


def _norms_ok(doc: Any) -> bool:
    every = doc.get("summary", {}).get("all") if isinstance(doc, dict) and isinstance(
        doc.get("summary"), dict) else None
    if not isinstance(every, dict):
        return False
    return all(v is None or (is_real(v) and 0 <= v < math.inf)
               for v in (every.get("h90"), every.get("h90_var")))


def _collapse_ok(doc: Any) -> bool:
    """The per-sigma columns the claims and figures read: rates and accuracies in [0, 1] (None:
    no sparse rows), as many as the sigmas; `params`, where recorded, an object."""
    if not isinstance(doc, dict) or not isinstance(doc.get("sigmas"), list):
        return False
    n = len(doc["sigmas"])
    columns = [doc.get(k) for k in ("collapse_rate", "predicted_rate", "accuracy")]
    draws = doc.get("draws_per_sigma")
    return (all(is_real(x) for x in doc["sigmas"]) and isinstance(columns[0], list)
            and is_int(doc.get("n_sparse_rows")) and doc["n_sparse_rows"] >= 0
            and isinstance(draws, list) and len(draws) == n
            and all(is_int(x) and x >= 0 for x in draws)
            and all(c is None or (isinstance(c, list) and len(c) == n
                                  and all(x is None or is_fraction(x) for x in c)) for c in columns)
            and isinstance(doc.get("params", {}), dict))


def _eval_ok(doc: Any) -> bool:
    return is_eval_result(doc) and isinstance(doc.get("checkpoint"), dict)


#: Each file of a run the report reads: what it must hold, in words and as a test. The sweep
#: takes a result as done only if it passes the same test (`read_result`).
RESULT_FILES: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "eval.json": (EVAL_RESULT + " and its checkpoint", _eval_ok),
    "analysis/norms.json": ("normlab norm spread (summary.all with its h90 and h90_var, "
                            "numbers >= 0)",
                            _norms_ok),
    "analysis/collapse.json": ("normlab collapse results (sigmas and per-sigma columns as "
                               "long, of rates in [0, 1]; n_sparse_rows and draws_per_sigma, "
                               "counts)", _collapse_ok),
    "timings.json": ("an object of step name -> seconds (finite, >= 0)",
                     lambda d: isinstance(d, dict) and all(map(is_seconds, d.values()))),
    DONE: DONE_RECORD,
}


def _load(run_dir: Path, name: str) -> Any:
    """One of a run's files (a key of `RESULT_FILES`), None if absent; a damaged one is one
    line naming it."""
    path = Path(run_dir) / name
    return read_json(path, *RESULT_FILES[name]) if path.is_file() else None


def read_result(run_dir: Path, name: str) -> Any:
    """`run_dir`'s file `name` if it holds what the report reads from it; None if it is absent
    or does not (for the sweep, which makes such a file again rather than taking it as done)."""
    try:
        return _load(run_dir, name)
    except ValueError:
        return None


def collect(run_dirs: list[Path]) -> dict[str, dict[int, dict[str, Any]]]:
    """placement -> seed -> {eval, norms, collapse, timings, done, dir} for finished runs."""
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for d in run_dirs:
        ev = _load(d, "eval.json")
        if ev is None:
            continue
        cfg = ev["config"]
        placement, seed = cfg["model"]["norm_placement"], cfg["train"]["seed"]
        if seed in runs.get(placement, {}):  # a claim's mean over seeds would lose one
            raise ValueError(f"{str(d)!r}: a second {placement} run with seed {seed} (the first "
                             f"is {str(runs[placement][seed]['dir'])!r}); expected one run per "
                             "placement and seed")
        runs.setdefault(placement, {})[seed] = {
            "dir": d, "eval": ev, "norms": _load(d, "analysis/norms.json"),
            "collapse": _load(d, "analysis/collapse.json"),
            "timings": _load(d, "timings.json") or {}, "done": _load(d, "train_done.json"),
        }
    _check_comparable([r for by in runs.values() for r in by.values()])
    return runs


#: The train settings runs a report pools may differ in: the seed, and how each ran, not what
#: it trained (where, on how many threads, how often it logged and saved).
HOW_IT_RAN = ("seed", "threads", "log_every", "checkpoint_every", *RUNS_ON)


def _settings(run: dict[str, Any]) -> dict[str, Any]:
    """What must be the same in every run a report pools: the task, the model but its
    placement, the training recipe but its seed and how it ran (`HOW_IT_RAN`), the evaluation's
    examples per cell, and the analysis settings (a record lacking one is not compared on it).
    The claims compare placements over seeds; runs picked by hand from two sweeps (another
    width, another learning rate) would be compared without a word."""
    from normlab.analysis.report import recorded_splits

    cfg = run["eval"]["config"]
    out = {"task": cfg.get("task")}
    for table, free in (("model", ("norm_placement",)), ("train", HOW_IT_RAN)):
        out |= {f"{table}.{k}": v for k, v in cfg[table].items() if k not in free}
    if "limit" in run["eval"]:  # recorded since normlab's twenty-second session
        out["eval limit"] = run["eval"]["limit"]
    if run["collapse"] and "params" in run["collapse"]:
        params = dict(run["collapse"]["params"])
        for derived in ("n_examples_used", "per_cell"):  # follow from the task and n_examples
            params.pop(derived, None)
        params["splits"] = recorded_splits(params.get("splits"))
        params.setdefault("rows", "all")  # what a record from before `rows` counted
        out |= {f"analysis {k}": v for k, v in params.items()}
    return out


def _check_comparable(runs: list[dict[str, Any]], made: str = "was made") -> dict[str, Any]:
    """Claims pool runs over seeds and placements: runs made with other settings (another
    grid, another threshold or sigma list) would be averaged without a word. Returns the
    settings they share (each as the runs recording it have it)."""
    ref: dict[str, tuple[Any, Path]] = {}  # each setting as the first run recording it has it
    for run in runs:  # every pair compared, not only with the first run's settings
        for key, value in _settings(run).items():
            seen, where = ref.setdefault(key, (value, run["dir"]))
            if value != seen:
                raise ValueError(f"{str(run['dir'])!r} {made} with {key} = {value!r}, "
                                 f"{str(where)!r} with {seen!r}; a report pools runs of one "
                                 "task, model, recipe, evaluation and analysis setting")
    return {key: value for key, (value, _) in ref.items()}


def check_poolable(configs: dict[str, dict[str, Any]]) -> None:
    """Run configs (name -> config dict) a report could pool, refused before anything trains:
    a profile whose configs differ past placement and seed trained every run, then failed at
    its report."""
    _check_comparable([{"dir": name, "eval": {"config": cfg}, "collapse": None}
                       for name, cfg in configs.items()], made="would train")


def held_out(ev: dict[str, Any]) -> float:
    """Mean accuracy over the held-out splits (every split but `train`); NaN if none."""
    accs = [r["accuracy"] for s, r in ev["splits"].items() if s != "train"]
    return sum(accs) / len(accs) if accs else math.nan


def _ac_var(p: float, n: int) -> float:
    """A proportion's sampling variance over n trials, Agresti-Coull's p~ (1 - p~) / n~ with
    n~ = n + 4 and p~ = (p n + 2) / n~: p (1 - p) / n is 0 at 0% or 100%, and gave a placement
    right on every question of both seeds an interval of zero width."""
    if not n:
        return 0.0
    n_t = n + 4
    p_t = (p * n + 2) / n_t
    return p_t * (1 - p_t) / n_t


def _binomial_var(split: dict[str, Any]) -> float:
    """An accuracy's sampling variance over its questions (`_ac_var`)."""
    return _ac_var(split["accuracy"], split["count"])


def held_out_var(ev: dict[str, Any]) -> float:
    """The sampling variance of `held_out`, a mean of independent split accuracies."""
    vs = [_binomial_var(r) for s, r in ev["splits"].items() if s != "train"]
    return sum(vs) / len(vs) ** 2 if vs else 0.0


def _at_sigma(col: dict[str, Any], key: str, sigma: float) -> Any:
    for s, v in zip(col["sigmas"], col[key], strict=True):
        if abs(s - sigma) < 1e-9:
            return v
    return None


def _collapse_var(col: dict[str, Any], sigma: float) -> float:
    """A seed's collapse rate's own sampling variance at `sigma`, Agresti-Coull's over its
    row-draws (sparse rows x draws; flips cluster by example, so this is a floor): two seeds
    that both saw 0 flips in 48 row-draws gave H2 the interval [0, 0] and "disagrees", where
    0 of 96 allows up to 3.8%."""
    return _ac_var(_at_sigma(col, "collapse_rate", sigma),
                   col["n_sparse_rows"] * _at_sigma(col, "draws_per_sigma", sigma))


def claims_table(runs: dict[str, dict[int, dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per claim: paper figure, our mean and CI over seeds, the verdict."""
    pre, qkv = runs.get("pre", {}), runs.get("qkv", {})
    rows = []

    def row(cid: str, paper: str, values: list[float], verdict_fn: Any, unit: str,
            support: tuple[float, float], within_var: list[float] | None = None) -> None:
        if not values:
            rows.append({"id": cid, "claim": CLAIMS[cid], "paper": paper, "ours": None,
                         "ci95": None, "n_seeds": 0, "verdict": "inconclusive", "unit": unit})
            return
        m, ci = mean_ci(values, within_var, support)
        # one seed: no interval (JSON has no infinity; the report prints "—")
        rows.append({"id": cid, "claim": CLAIMS[cid], "paper": paper, "ours": m,
                     "ci95": [x if math.isfinite(x) else None for x in ci],
                     "n_seeds": len(values), "verdict": verdict_fn(ci), "unit": unit,
                     "per_seed": values})

    h1_all = [r["norms"]["summary"]["all"] for r in pre.values()
              if r["norms"] and r["norms"]["summary"]["all"].get("h90") is not None]
    v1 = [a.get("h90_var") for a in h1_all]
    row("H1", "±0.20 (h90)", [a["h90"] for a in h1_all], lambda ci: verdict_band(ci, 0.10, 0.40),
        "h90", (0, math.inf), v1 if all(v is not None for v in v1) else None)
    h2_cols = [r["collapse"] for r in pre.values() if r["collapse"]
               and _at_sigma(r["collapse"], "collapse_rate", SIGMA_H2) is not None]
    row("H2", "≈1% at σ ≤ 0.1", [_at_sigma(c, "collapse_rate", SIGMA_H2) for c in h2_cols],
        lambda ci: verdict_band(ci, 0.005, 0.02), f"collapse rate at σ={SIGMA_H2}", (0, 1),
        [_collapse_var(c, SIGMA_H2) for c in h2_cols])
    seeds = sorted(set(pre) & set(qkv))
    h3 = [qkv[s]["eval"]["splits"]["train"]["accuracy"] - pre[s]["eval"]["splits"]["train"]
          ["accuracy"] for s in seeds]
    v3 = [_binomial_var(qkv[s]["eval"]["splits"]["train"])
          + _binomial_var(pre[s]["eval"]["splits"]["train"]) for s in seeds]
    row("H3", "comparable", h3, lambda ci: verdict_band(ci, -0.02, 0.02),
        "qkv − pre, train-cell accuracy", (-1, 1), v3)
    # seeds where both runs were evaluated on held-out splits (a task without any has none:
    # no number, rather than NaN in the summary)
    ho = {s: (held_out(qkv[s]["eval"]), held_out(pre[s]["eval"])) for s in seeds}
    both = [s for s in seeds if not any(math.isnan(a) for a in ho[s])]
    h4 = [ho[s][0] - ho[s][1] for s in both]
    v4 = [held_out_var(qkv[s]["eval"]) + held_out_var(pre[s]["eval"]) for s in both]
    row("H4", "QKV-Norm worse", h4, lambda ci: verdict_sign(ci, expect_negative=True),
        "qkv − pre, held-out accuracy", (-1, 1), v4)
    return rows


def split_table(runs: dict[str, dict[int, dict[str, Any]]]) -> list[list[str]]:
    splits = list(dict.fromkeys(s for by in runs.values() for r in by.values()
                                for s in r["eval"]["splits"]))
    rows = [["placement", "seeds", *splits]]
    for p, by in runs.items():
        cells = []
        for s in splits:
            got = [r["eval"]["splits"][s] for r in by.values() if s in r["eval"]["splits"]]
            if not got:  # no run of this placement has the split
                cells.append("—")
                continue
            # floored at the accuracies' own binomial variance, as the claims are: two equal
            # accuracies gave an interval of zero width
            m, (lo, hi) = mean_ci([g["accuracy"] for g in got], [_binomial_var(g) for g in got],
                                  (0, 1))
            cells.append(_pct(m, lo, hi))
        rows.append([p, str(len(by)), *cells])
    return rows


def _pct(m: float, lo: float, hi: float) -> str:
    if math.isinf(lo):
        return percent(m, 1)
    return f"{percent(m, 1)} [{percent(lo, 1)}, {percent(hi, 1)}]"


def _fmt(v: float | None, unit: str) -> str:
    """A claim's value in its unit: a difference of accuracies in signed percentage points, a
    rate or accuracy in %, anything else (h90) as a number."""
    if v is None:
        return "—"
    if unit.startswith("qkv − pre"):
        return f"{100 * v:+.2f} points"
    return f"{100 * v:.2f}%" if "rate" in unit or "accuracy" in unit else f"{v:.3f}"


def _sigma_grid(cols: list[dict[str, Any]]) -> list[float]:
    """Every sigma any seed was analysed at, ascending: a figure shows them all, not only
    the first seed's."""
    grid: list[float] = []
    for sigma in sorted(s for c in cols for s in c["sigmas"]):
        if not grid or abs(sigma - grid[-1]) >= 1e-9:  # `_at_sigma`'s tolerance
            grid.append(sigma)
    return grid


def _seed_values(cols: list[dict[str, Any]], key: str, sigma: float) -> list[float]:
    return [v for c in cols if c.get(key) for v in [_at_sigma(c, key, sigma)] if v is not None]


def _seed_mean(cols: list[dict[str, Any]], key: str, sigmas: list[float]) -> list[float]:
    """Mean over seeds at each of `sigmas`, matched by value (a seed analysed over other
    sigmas, or in another order, is read at the same sigma, or left out where it has none);
    None entries (no sparse rows) are skipped, all-None is NaN."""
    out = []
    for sigma in sigmas:
        vals = _seed_values(cols, key, sigma)
        out.append(sum(vals) / len(vals) if vals else math.nan)
    return out


def _seed_range(cols: list[dict[str, Any]], key: str, sigmas: list[float]
                ) -> tuple[list[float], list[float]]:
    """Lowest and highest seed at each of `sigmas` (NaN where none), the figure's band."""
    vals = [_seed_values(cols, key, sigma) for sigma in sigmas]
    return ([min(v) if v else math.nan for v in vals], [max(v) if v else math.nan for v in vals])


def figures(runs: dict[str, dict[int, dict[str, Any]]], folder: Path) -> dict[str, Path]:
    """Collapse and accuracy vs sigma per placement (mean over seeds) and the norm spread."""
    import matplotlib

    from normlab.analysis.report import recorded_splits

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    out: dict[str, Path] = {}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    splits: set[str] = set()  # the splits the perturbed accuracy was measured on
    thetas: set[float] = set()  # the sparse-row threshold (one, as `collect` checks)
    for p, by in runs.items():
        cols = [r["collapse"] for r in by.values() if r["collapse"]]
        if not cols:
            continue
        sig = _sigma_grid(cols)
        splits |= {s for c in cols
                   for s in (recorded_splits(c.get("params", {}).get("splits")) or ["all splits"])}
        mean, pred, acc = (_seed_mean(cols, k, sig) for k in ("collapse_rate",
                                                               "predicted_rate", "accuracy"))
        # the seeds' mean, and their range as a band: a mean alone gave no sense of spread
        line = ax1.plot(sig, mean, "o-", label=f"{p} measured ({len(cols)} seeds; band: range)")[0]
        ax1.fill_between(sig, *_seed_range(cols, "collapse_rate", sig), color=line.get_color(),
                         alpha=0.2, lw=0)
        ax1.plot(sig, pred, "--", color=line.get_color(), label=f"{p} predicted")
        ax2.plot(sig, acc, "o-", color=line.get_color(), label=p)
        ax2.fill_between(sig, *_seed_range(cols, "accuracy", sig), color=line.get_color(),
                         alpha=0.2, lw=0)
        thetas |= {c["threshold"] for c in cols if "threshold" in c}
    ax1.set_xlabel("σ (relative norm noise)")
    theta = f" (max weight ≥ {thetas.pop():g})" if len(thetas) == 1 else ""
    ax1.set_ylabel(f"collapse rate of sparse rows{theta}", fontsize=8)
    _legend(ax1)
    ax2.set_xlabel("σ")
    ax2.set_ylabel(f"exact-match accuracy ({' + '.join(sorted(splits)) or 'all splits'})")
    _legend(ax2)
    fig.tight_layout()
    out["collapse"] = folder / "collapse_vs_sigma.png"
    save_figure(fig, out["collapse"])

    fig, ax = plt.subplots(figsize=(5, 3.2))
    for i, by in enumerate(runs.values()):
        vals = [r["norms"]["summary"]["all"] for r in by.values()
                if r["norms"] and r["norms"]["summary"]["all"].get("h90") is not None]
        if vals:
            h = [v["h90"] for v in vals]
            m = sum(h) / len(h)  # the whisker spans the seeds' range, lowest to highest
            ax.bar(i, m, yerr=[[m - min(h)], [max(h) - m]], capsize=4)
    ax.axhline(0.2, color="k", ls="--", lw=1, label="paper: ±20%")
    ax.set_xticks(range(len(runs)), list(runs))
    ax.set_ylabel("h90 of norm-input ratios")  # the whisker in the title: the label was cut
    ax.set_title("bar: mean over seeds; whisker: their range", fontsize=8)
    _legend(ax)
    fig.tight_layout()
    out["norms"] = folder / "norm_spread.png"
    save_figure(fig, out["norms"])
    return out


def _setting(value: Any) -> str:
    """A setting as the report prints it: lists joined, None as "all"."""
    if value is None:
        return "all"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_setting(v) for v in value) + "]"
    return str(value)


def write_report(out: Path, run_dirs: list[Path], profile: str, machine: str = "",
                 failed: dict[str, str] | None = None) -> dict:
    """Write summary.json, report.md and a self-contained report.html into `out`.

    `failed` (run folder name -> error) names the runs that failed in this pass: their
    folders may still hold an older attempt's results, which must not count in the claims.
    """
    failed = failed or {}
    runs = collect([d for d in run_dirs if Path(d).name not in failed])
    claims = claims_table(runs)
    figs = figures(runs, out / "figures")
    heatmaps = {f"{p}-s{s}": r["dir"] / "heatmap.png" for p, by in runs.items()
                for s, r in sorted(by.items()) if (r["dir"] / "heatmap.png").is_file()}
    run_info = []
    for p, by in runs.items():
        for s, r in sorted(by.items()):
            run_info.append({
                "run": r["dir"].name, "placement": p, "seed": s,
                "steps": (r["done"] or {}).get("step"),
                "train_s": (r["done"] or {}).get("elapsed_s"),
                "wall_s": r["timings"], "checkpoint": r["eval"]["checkpoint"],
                "provenance": r["eval"].get("provenance"), "config": r["eval"]["config"],
                # the versions and commit training ran at (the evaluation's may be later:
                # `reproduce` evaluates again a run whose eval.json is missing or stale)
                "trained_provenance": (r["done"] or {}).get("provenance"),
            })
    # the analysis settings every pooled run shares (checked by `collect`): H2's rate means
    # little without its threshold, draws and questions (smoke's θ = 0.5, quick's 0.9)
    shared = _check_comparable([r for by in runs.values() for r in by.values()])
    analysis = {k.removeprefix("analysis "): v for k, v in shared.items()
                if k.startswith("analysis ")}
    summary = {"profile": profile, "claims": claims, "analysis": analysis,
               "splits": split_table(runs), "runs": run_info, "failed": failed,
               "provenance": provenance(), "rules": __doc__}
    write_json(out / "summary.json", summary)

    prov = summary["provenance"]
    md = [f"# normlab reproduction — profile `{profile}`", "",
          f"Machine: {machine or prov['machine']}; torch {prov['torch']}; normlab's CPU kernels "
          f"{prov['native']}; commit {prov['git_commit'] or 'unknown (not a git checkout)'}.",
          *([""] + [f"- **Left out: run {name} failed** ({' '.join(str(err).split())}); "
                      "rerun to retry it." for name, err in failed.items()] if failed else []),
          "", "## The paper's headline claims beside ours", "",
          "| claim | paper | ours (mean [95% CI over seeds]) | seeds | verdict |",
          "|---|---|---|---|---|"]
    for c in claims:
        ours = "—" if c["ours"] is None else (
            f"{_fmt(c['ours'], c['unit'])} [{_fmt(c['ci95'][0], c['unit'])}, "
            f"{_fmt(c['ci95'][1], c['unit'])}]")
        md.append(f"| **{c['id']}** {c['claim']} ({c['unit']}) | {c['paper']} | {ours} | "
                  f"{c['n_seeds']} | **{c['verdict']}** |")
    if analysis:
        shown = ", ".join(f"{k} {_setting(v)}" for k, v in analysis.items())
        md += ["", f"Analysis settings of every run (H1, H2 and the figures): {shown}."]
    md += ["", "Verdict rules (computed by `normlab.report`, not set by hand):", "",
           *verdict_rules(), "",
           "## Exact-match accuracy per split (%, mean [95% CI over seeds])", ""]
    table = summary["splits"]
    md += ["| " + " | ".join(table[0]) + " |", "|" + "---|" * len(table[0])]
    md += ["| " + " | ".join(r) + " |" for r in table[1:]]
    md += ["", "## Figures", ""]
    for name, path in figs.items():
        md.append(f"![{name}]({path.relative_to(out)})")
    for name, path in heatmaps.items():
        md.append(f"![{name}]({_rel(path, out)})")
    md += ["", "## Runs", "", "| run | placement | seed | steps | train s | eval s | analysis s |"
           " trained at | evaluated at |", "|---|---|---|---|---|---|---|---|---|"]
    for r in run_info:
        t = r["wall_s"]
        md.append(f"| {r['run']} | {r['placement']} | {r['seed']} | {r['steps']} | "
                  f"{_num(r['train_s'])} | {_num(t.get('eval'))} | {_num(t.get('analyze'))} | "
                  f"{(r['trained_provenance'] or {}).get('git_commit') or '—'} | "
                  f"{(r['provenance'] or {}).get('git_commit') or '—'} |")
    md += ["", "Each run's full config, versions and machine are in `summary.json` (training's "
           "under `trained_provenance`) and in the run folder's `eval.json` and "
           "`train_done.json`."]
    atomic_write_text(out / "report.md", "\n".join(md) + "\n")
    atomic_write_text(out / "report.html", _html("\n".join(md), out))
    return summary


def _legend(ax: Any) -> None:
    """A legend where a line was drawn: with none (every run failed) matplotlib warned twice,
    with its source lines, before the report's one-line error."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def _num(v: float | None) -> str:
    return "—" if v is None else f"{v:.0f}"


def _rel(path: Path, base: Path) -> str:
    try:
        return str(path.relative_to(base))
    except ValueError:
        return str(path)


def _html(md: str, base: Path) -> str:
    """A self-contained HTML page from our simple Markdown (tables, bullet lists, headings,
    images). Consecutive rows make one table and consecutive bullets one list: bullets were
    `<li>` with no `<ul>`, not valid HTML."""
    body, opened = [], ""  # the element ("table", "ul") the lines before this one are in
    for line in md.splitlines():
        within = "table" if line.startswith("|") else "ul" if line.startswith("- ") else ""
        if within != opened:  # close what the lines before were in, open this line's
            if opened:
                body.append(f"</{opened}>")
            if within:
                body.append(f"<{within}>")
            opened = within
        if within == "table":
            cells = [c.strip() for c in line.strip("|").split("|")]
            if not set("".join(cells)) <= set("-"):  # not the header's |---| line
                body.append("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in cells) + "</tr>")
        elif within == "ul":
            body.append(f"<li>{_inline(line[2:])}</li>")
        elif line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            body.append(f"<h{level}>{_inline(line[level:].strip())}</h{level}>")
        elif line.startswith("!["):
            alt, src = line[2:].split("](", 1)
            path = Path(src.rstrip(")"))
            path = path if path.is_absolute() else base / path
            if path.is_file():
                data = base64.b64encode(path.read_bytes()).decode()
                body.append(f'<figure><img alt="{html.escape(alt)}" '
                            f'src="data:image/png;base64,{data}"><figcaption>'
                            f"{html.escape(alt)}</figcaption></figure>")
        elif line.strip():
            body.append(f"<p>{_inline(line)}</p>")
    if opened:
        body.append(f"</{opened}>")
    style = ("body{font-family:sans-serif;max-width:60em;margin:auto}table{border-collapse:"
             "collapse}td{border:1px solid #ccc;padding:2px 6px}img{max-width:100%}"
             "figure{display:inline-block;margin:4px}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>normlab report</title>"
            f"<style>{style}</style></head><body>{''.join(body)}</body></html>")


def _inline(text: str) -> str:
    out = html.escape(text)
    parts = out.split("**")
    out = "".join(f"<b>{p}</b>" if i % 2 else p for i, p in enumerate(parts))
    parts = out.split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(parts))
