#!/bin/bash
# How cost grows, with the task's own sequence lengths (bench_scaling's problem rows, added
# after a review found that "sequence length" was random tokens of exact lengths only), on one
# and two threads, after the times to accuracy (nothing else running); then the scaling figure
# from these two runs and the thirteenth session's AMD full runs.
set -e
cd /work/main
OUT=runs/s23/scaling
mkdir -p $OUT
git log -1 --format=%h > $OUT/commit.txt
PY=/work/main/.venv/bin/python
for t in 1 2; do
  date
  $PY benchmarks/bench_scaling.py --threads $t --out $OUT/scaling_${t}t.json --force > $OUT/scaling_${t}t.md
done
date
echo done
