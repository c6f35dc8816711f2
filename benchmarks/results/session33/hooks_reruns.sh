#!/usr/bin/env bash
# Three reruns of the hooks benchmark on one thread, after the full run's batch-1 `pre` row read
# 1.05 [1.01, 1.15]: `bash benchmarks/results/session33/hooks_reruns.sh`, nothing else running.
# Overwrites only its own outputs in this folder.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=benchmarks/results/session33
PY=${PY:-.venv/bin/python}
git rev-parse HEAD > $OUT/hooks_commit.txt
git diff --quiet HEAD || echo "tracked files changed (docs only, see git status)" >> $OUT/hooks_commit.txt
git status --short >> $OUT/hooks_commit.txt
for R in 1 2 3; do
  $PY benchmarks/bench_hooks.py --threads 1 --out $OUT/hooks_1t_$R.json --force > $OUT/hooks_1t_$R.md
done
