"""How much the rows no scored output reads weigh in H2: each run's analysis again with
`rows="loss"` (docs/science.md, "Which query positions count"), beside its own.

For every run folder under RUNS with checkpoints and an analysis, runs `analyze_run` with the
settings its collapse.json records and `rows="loss"` into OUT/<run>/, then prints per run the
valid and sparse rows and the collapse rate at each sigma (95% CI), both ways.
Usage: `python docs/results/rows_loss.py results/quick/runs OUT [--sigma 0.1]`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from normlab.analysis.report import ANALYSIS_DEFAULTS, analyze_run

#: what a collapse.json's params record that `analyze_run` does not take as it is
DERIVED = ("n_examples_used", "per_cell", "rows")


def main(runs: Path, out: Path, sigma: float) -> None:
    if not runs.is_dir():
        raise SystemExit(f"{str(runs)!r}: expected a folder of run folders")
    found = [p for p in sorted(runs.iterdir()) if (p / "checkpoints").is_dir()
             and (p / "analysis" / "collapse.json").is_file()]
    if not found:
        raise SystemExit(f"{str(runs)!r}: no run folder with checkpoints/ and an analysis")
    for run in found:  # before any analysis: a sigma a run lacks failed after the first's
        sigmas = json.loads((run / "analysis" / "collapse.json").read_text())["sigmas"]
        if sigma not in sigmas:
            raise SystemExit(f"--sigma: expected one of {run.name}'s sigmas {sigmas}; got {sigma}")
    for run in found:
        done = run / "analysis" / "collapse.json"
        all_rows = json.loads(done.read_text())
        params = {k: v for k, v in all_rows["params"].items()
                  if k in ANALYSIS_DEFAULTS and k not in DERIVED}
        again = out / run.name
        if not (again / "collapse.json").is_file():
            analyze_run(run, again, seed=all_rows["seed"], rows="loss", figures=False,
                        **params)
        loss_rows = json.loads((again / "collapse.json").read_text())
        i = all_rows["sigmas"].index(sigma)
        for name, c in (("all", all_rows), ("loss", loss_rows)):
            head = f"{run.name} rows={name}: {c['n_sparse_rows']:,} sparse of {c['n_rows']:,} rows"
            if not c["n_sparse_rows"]:  # no rate to give (it is None)
                print(f"{head}; no collapse rate")
                continue
            lo, hi = c["collapse_ci95"][i]
            print(f"{head}; collapse at sigma {sigma}: {100 * c['collapse_rate'][i]:.3f}% "
                  f"[{100 * lo:.3f}, {100 * hi:.3f}]")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--sigma", type=float, default=0.1)
    a = ap.parse_args()
    main(a.runs, a.out, a.sigma)
