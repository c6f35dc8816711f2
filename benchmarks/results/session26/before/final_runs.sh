#!/bin/bash
# The twenty-sixth session's reruns of the targets (as the twenty-third's final_runs.sh, without
# the times to accuracy), on the AMD EPYC VM: a detached worktree at main's head.
set -e
cd /work/wt_runs
OUT=/work/main/runs/s26/final
mkdir -p $OUT
git log -1 --format=%h > $OUT/commit.txt
PY=/work/main/.venv/bin/python
export PYTHONPATH=/work/wt_runs/src
for t in 1 2; do
  date -u
  $PY benchmarks/run_all.py --threads $t --no-plot --out $OUT/full_${t}t.json --force > $OUT/full_${t}t.md
  $PY benchmarks/bench_train_step.py --threads $t --repeats 15 --out $OUT/train_step_${t}t_r15.json --force > /dev/null
  $PY benchmarks/bench_collapse.py --threads $t --repeats 9 --out $OUT/collapse_${t}t_r9.json --force > /dev/null
done
date -u
echo done
