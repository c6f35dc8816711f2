"""Accuracy and sparse-row collapse under norm noise by what is perturbed (q, k and v; q and k;
v), per run, from the collapse.json files `run.sh` copied here: docs/results.md §2 (H2). Then,
at sigma = 0.1, the accuracy each lost (points), the parts' sum less the whole, the sampling
error of one accuracy (binomial, one noise draw a question), and with q and k alone the sparse
rows a question that flip (`n_sparse_rows` / `n_examples` x `collapse_rate`): the most points
flips could cost, were each to fail its question.

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

    print()
    print("| run | points lost at σ = 0.1: q, k, v / q, k / v | (q, k) + (v) − all | "
          "sampling error | q, k flips a question | at most points |")
    print("|---|---|---|---|---|---|")
    for run in sorted(p.name for p in (HERE / "qkv").iterdir()):
        lost, flips, error = {}, 0.0, 0.0
        for targets in ("qkv", "qk", "v"):
            c = json.loads((HERE / targets / run / "collapse.json").read_text())
            at = dict(zip(c["sigmas"], zip(c["accuracy"], c["collapse_rate"], strict=True),
                          strict=True))
            lost[targets] = 100 * (at[0.0][0] - at[0.1][0])
            if targets == "qkv":
                p = at[0.1][0]
                error = 100 * (p * (1 - p) / c["accuracy_examples"]) ** 0.5
            if targets == "qk":
                flips = c["n_sparse_rows"] / c["n_examples"] * at[0.1][1]
        print(f"| {run} | {lost['qkv']:.1f} / {lost['qk']:.1f} / {lost['v']:.1f} | "
              f"{lost['qk'] + lost['v'] - lost['qkv']:+.1f} | {error:.1f} | {flips:.4f} | "
              f"{100 * flips:.1f} |")


if __name__ == "__main__":
    main()
