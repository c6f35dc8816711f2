#!/usr/bin/env bash
# The thirty-sixth session's rerun of the top table's AMD cells at the code commit
# (full_commit.txt), nothing else running, as the thirty-first session's full_runs.sh ran them:
# full runs (run_all.py) and the 15-repeat training step and 9-repeat collapse sweep, one and
# two threads. `benchmarks/results/session26/cells.py benchmarks/results/session36` prints the
# cells. `bash benchmarks/results/session36/full_runs.sh`; overwrites only its own outputs here.
set -euo pipefail
cd "$(dirname "$0")/../../.."
git diff --quiet HEAD || { echo "full_runs.sh: commit first (tracked files changed)" >&2; exit 1; }
OUT=${OUT:-benchmarks/results/session36}  # a second reading: OUT=.../session36/b
PY=${PY:-.venv/bin/python}
lscpu > $OUT/machine.txt
git rev-parse HEAD > $OUT/full_commit.txt
date -u +"started %H:%M UTC" >> $OUT/full_commit.txt
for T in 1 2; do
  $PY benchmarks/run_all.py --threads $T --no-plot --force --out $OUT/full_${T}t.json \
    > $OUT/full_${T}t.md
  $PY benchmarks/bench_train_step.py --threads $T --repeats 15 --force \
    --out $OUT/train_step_${T}t_r15.json > /dev/null
  $PY benchmarks/bench_collapse.py --threads $T --repeats 9 --force \
    --out $OUT/collapse_${T}t_r9.json > /dev/null
  date -u +"threads $T done %H:%M UTC" >> $OUT/full_commit.txt
done
date -u +"finished %H:%M UTC" >> $OUT/full_commit.txt
