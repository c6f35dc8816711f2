#!/usr/bin/env bash
# The thirty-seventh session's full runs, with its verdict rules (hooks held to 1.0 by the
# three-way rule; MFU with its step time's CI) and counts (FLOPs also over the causal triangle;
# hook points a forward calls): `bash benchmarks/results/session37/full_runs.sh`, nothing else
# running. Every benchmark at one thread and at two (run_all.py, 7 repeats for the training step
# and decoding, 3 for the sweep and the scaling rows), lscpu beside them.
set -euo pipefail
cd "$(dirname "$0")/../../.."
git diff --quiet HEAD || { echo "full_runs.sh: commit first (tracked files changed)" >&2; exit 1; }
OUT=${OUT:-benchmarks/results/session37}
mkdir -p "$OUT"
lscpu > "$OUT/machine.txt"
git rev-parse HEAD > "$OUT/full_commit.txt"
for T in 1 2; do
  date -u +"full ${T}t started %H:%M:%S UTC" >> "$OUT/full_commit.txt"
  .venv/bin/python benchmarks/run_all.py --threads $T --force --no-plot \
    --out "$OUT/full_${T}t.json" > "$OUT/full_${T}t.md"
done
date -u +"finished %H:%M:%S UTC" >> "$OUT/full_commit.txt"
