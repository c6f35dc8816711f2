"""Accuracy and sparse-row collapse under norm noise by what is perturbed (q, k and v; q and k;
v), per run, from the collapse.json files `run.sh` copied here: docs/results.md §2 (H2).

Usage: `python docs/results/noise_targets/table.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
SIGMAS = (0.1, 0.2, 0.3)


def main() -> None:
    print("| run | perturbed | accuracy, σ = 0 / " + " / ".join(map(str, SIGMAS))
          + " | sparse rows collapsed (%), σ = " + " / ".join(map(str, SIGMAS)) + " |")
    print("|---|---|---|---|")
    for run in sorted(p.name for p in (HERE / "qkv").iterdir()):
        for targets in ("qkv", "qk", "v"):
            c = json.loads((HERE / targets / run / "collapse.json").read_text())
            at = dict(zip(c["sigmas"], zip(c["accuracy"], c["collapse_rate"], strict=True),
                          strict=True))
            acc = " / ".join(f"{100 * at[s][0]:.1f}" for s in (0.0, *SIGMAS))
            rate = " / ".join(f"{100 * at[s][1]:.3f}" for s in SIGMAS)
            print(f"| {run} | {', '.join(c['targets'])} | {acc} | {rate} |")


if __name__ == "__main__":
    main()
