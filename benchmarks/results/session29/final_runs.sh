#!/usr/bin/env bash
# The twenty-ninth session's runs behind docs/performance.md, from a worktree of the code commit
# (commit.txt), nothing else running: `bash benchmarks/results/session29/final_runs.sh`.
# The collapse benchmark also runs at the commit before the session (BEFORE, in a detached
# worktree beside this one), one after the other per thread count, so both see the same hour.
set -euo pipefail
cd "$(dirname "$0")/../../.."
git diff --quiet HEAD || { echo "final_runs.sh: commit first (tracked files changed)" >&2; exit 1; }
OUT=benchmarks/results/session29
PY=${PY:-.venv/bin/python}
BEFORE=${BEFORE:-ad0eb1f}
WT=$(realpath ..)/normlab_before_$BEFORE
[ -d "$WT" ] || git worktree add --detach "$WT" "$BEFORE" > /dev/null
git rev-parse HEAD > $OUT/commit.txt
lscpu > $OUT/machine.txt
mkdir -p $OUT/before
for T in 1 2; do
  $PY benchmarks/probes/attention_range.py $T > $OUT/attention_range_${T}t.txt
  $PY benchmarks/probes/attention_width_rule.py $T > $OUT/attention_width_rule_${T}t.txt
  $PY benchmarks/probes/collapse_row_winners.py $T > $OUT/collapse_row_winners_${T}t.txt
  NORMLAB_NATIVE_ATTENTION=0 $PY benchmarks/probes/collapse_row_winners.py $T \
    > $OUT/collapse_row_winners_kernel_off_${T}t.txt
  $PY benchmarks/probes/step_matmul_context.py $T > $OUT/step_matmul_context_${T}t.txt
  PYTHONPATH=$WT/src $PY $WT/benchmarks/bench_collapse.py --threads $T --repeats 9 \
    --out $OUT/before/collapse_${T}t_r9.json --force > /dev/null
  $PY benchmarks/bench_collapse.py --threads $T --repeats 9 --out $OUT/collapse_${T}t_r9.json \
    --force > /dev/null
done
date -u +"finished %H:%M UTC" >> $OUT/commit.txt
