#!/usr/bin/env bash
# The thirty-third session's full runs, with make bench's new Headlines (targets and verdicts),
# from the code commit (commit.txt), nothing else running:
# `bash benchmarks/results/session33/full_runs.sh`. One thread, then two. Overwrites only its
# own outputs in this folder (--force on its own files).
set -euo pipefail
cd "$(dirname "$0")/../../.."
git diff --quiet HEAD || { echo "full_runs.sh: commit first (tracked files changed)" >&2; exit 1; }
OUT=benchmarks/results/session33
PY=${PY:-.venv/bin/python}
git rev-parse HEAD > $OUT/commit.txt
date -u +"started %H:%M UTC" >> $OUT/commit.txt
lscpu > $OUT/machine.txt
for T in 1 2; do
  $PY benchmarks/run_all.py --threads $T --out $OUT/full_${T}t.json --force > $OUT/full_${T}t.md
done
date -u +"finished %H:%M UTC" >> $OUT/commit.txt
