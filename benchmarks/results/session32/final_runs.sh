#!/usr/bin/env bash
# The thirty-second session's runs behind docs/performance.md, from the code commit
# (commit.txt), nothing else running: `bash benchmarks/results/session32/final_runs.sh`.
# Three rounds, each probe at one thread then two, for the VM's drift. Overwrites only its own
# outputs in this folder.
set -euo pipefail
cd "$(dirname "$0")/../../.."
git diff --quiet HEAD || { echo "final_runs.sh: commit first (tracked files changed)" >&2; exit 1; }
OUT=benchmarks/results/session32
PY=${PY:-.venv/bin/python}
git rev-parse HEAD > $OUT/commit.txt
date -u +"started %H:%M UTC" >> $OUT/commit.txt
lscpu > $OUT/machine.txt
for R in 1 2 3; do
  for T in 1 2; do
    $PY benchmarks/probes/decode_step_floor.py $T > $OUT/decode_step_floor_${T}t_${R}.txt
    $PY benchmarks/probes/decode_step_kernel.py $T > $OUT/decode_step_kernel_${T}t_${R}.txt
  done
done
date -u +"finished %H:%M UTC" >> $OUT/commit.txt
