#!/usr/bin/env bash
# The thirtieth session's runs behind docs/performance.md, from the code commit (commit.txt),
# nothing else running: `bash benchmarks/results/session30/final_runs.sh`. Overwrites only its
# own outputs in this folder.
set -euo pipefail
cd "$(dirname "$0")/../../.."
git diff --quiet HEAD || { echo "final_runs.sh: commit first (tracked files changed)" >&2; exit 1; }
OUT=benchmarks/results/session30
PY=${PY:-.venv/bin/python}
git rev-parse HEAD > $OUT/commit.txt
date -u +"started %H:%M UTC" >> $OUT/commit.txt
lscpu > $OUT/machine.txt
for T in 1 2; do
  $PY benchmarks/probes/attention_range.py $T > $OUT/attention_range_${T}t.txt
  $PY benchmarks/probes/attention_width_rule.py $T > $OUT/attention_width_rule_${T}t.txt
  $PY benchmarks/probes/decode_step_floor.py $T > $OUT/decode_step_floor_${T}t.txt
done
date -u +"finished %H:%M UTC" >> $OUT/commit.txt
