#!/usr/bin/env bash
# The twenty-ninth session's runs behind docs/performance.md, from a worktree of the code commit
# (commit.txt), nothing else running: `bash benchmarks/results_session29/final_runs.sh`.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=benchmarks/results_session29
PY=${PY:-.venv/bin/python}
git rev-parse HEAD > $OUT/commit.txt
lscpu > $OUT/machine.txt
for T in 1 2; do
  $PY benchmarks/probes/attention_range.py $T > $OUT/attention_range_${T}t.txt
  $PY benchmarks/probes/attention_width_rule.py $T > $OUT/attention_width_rule_${T}t.txt
  $PY benchmarks/probes/collapse_row_winners.py $T > $OUT/collapse_row_winners_${T}t.txt
  $PY benchmarks/probes/step_matmul_context.py $T > $OUT/step_matmul_context_${T}t.txt
done
date -u +"finished %H:%M UTC" >> $OUT/commit.txt
