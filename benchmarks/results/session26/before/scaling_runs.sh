#!/bin/bash
# The twenty-sixth session's rerun of cost growth (as the twenty-third's scaling_runs.sh): a
# detached worktree at main's head, nothing else heavy running.
set -e
cd /work/wt_runs
OUT=/work/main/runs/s26/scaling
mkdir -p $OUT
git log -1 --format=%h > $OUT/commit.txt
PY=/work/main/.venv/bin/python
export PYTHONPATH=/work/wt_runs/src
for t in 1 2; do
  date -u
  $PY benchmarks/bench_scaling.py --threads $t --out $OUT/scaling_${t}t.json --force > $OUT/scaling_${t}t.md
done
date -u
echo done
