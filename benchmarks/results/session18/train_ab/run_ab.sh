#!/bin/bash
# training step, 15 repeats: before (96b0342, worktree) and after (main HEAD), alternating, 1 then 2 threads
set -e
OUT=/work/main/runs/s18/train_ab
mkdir -p $OUT
for round in 2 3 4; do for t in 1 2; do
  (cd /work/wt18_before && PYTHONPATH=/work/wt18_before/src /work/main/.venv/bin/python benchmarks/bench_train_step.py --threads $t --repeats 15 --out $OUT/train_before_${t}t_$round.json --force > /dev/null)
  (cd /work/main && /work/main/.venv/bin/python benchmarks/bench_train_step.py --threads $t --repeats 15 --out $OUT/train_after_${t}t_$round.json --force > /dev/null)
  date
done; done
echo done
