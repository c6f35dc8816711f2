"""The measured and predicted collapse of docs/results.md §2 (H2), from each run's collapse.json.

Prints, per run and sigma, measured / predicted (Monte Carlo) and union bound / Monte Carlo;
the run's predicted rate at sigma = 0.2; then at sigma = 0.2 each layer's sparse rows, measured
and predicted collapse (%) and their ratio, its heads weighted by their sparse rows.
Usage: `python docs/results/h2_theory.py docs/results/quick/runs`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(runs: Path, at: float = 0.2) -> None:
    for run in sorted(p for p in runs.iterdir() if (p / "analysis/collapse.json").is_file()):
        c = json.loads((run / "analysis/collapse.json").read_text())
        ratios = [(s, m / p, u / p) for s, m, p, u in zip(
            c["sigmas"], c["collapse_rate"], c["predicted_rate"], c["predicted_union"],
            strict=True) if p]
        print(run.name, " ".join(f"σ={s}: {r:.2f} (union {u:.2f})" for s, r, u in ratios))
        i = c["sigmas"].index(at)
        print(f"  σ={at}: {100 * c['predicted_rate'][i]:.3f}% predicted, "
              f"{100 * c['collapse_rate'][i]:.3f}% measured")
        layers: dict[str, list[float]] = {}
        for h in c["per_head"]:
            if h["n_sparse"]:
                n, got = h["n_sparse"], layers.setdefault(h["site"], [0, 0.0, 0.0])
                got[0] += n
                got[1] += n * h["collapse_rate"][i]
                got[2] += n * (h["predicted_rate"][i] or 0.0)
        for site, (n, measured, predicted) in layers.items():
            ratio = f"{measured / predicted:.2f}x" if predicted else "-"
            print(f"  {site} σ={at}: {int(n)} sparse rows, {100 * measured / n:.2f}% measured, "
                  f"{100 * predicted / n:.3f}% predicted ({ratio})")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
