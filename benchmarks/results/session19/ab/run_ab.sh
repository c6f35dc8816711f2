#!/bin/bash
# alternating processes: before (43c484c, worktree) and after (main HEAD), 1 and 2 threads
set -e
OUT=/work/main/runs/s19/ab
mkdir -p $OUT
for round in 1 2 3 4; do
  for t in 1 2; do
    date
    (cd /work/wt19_before && PYTHONPATH=/work/wt19_before/src /work/main/.venv/bin/python benchmarks/bench_train_step.py --threads $t --repeats 15 --out $OUT/train_before_${t}t_$round.json --force > /dev/null)
    (cd /work/main && /work/main/.venv/bin/python benchmarks/bench_train_step.py --threads $t --repeats 15 --out $OUT/train_after_${t}t_$round.json --force > /dev/null)
  done
done
for round in 1 2 3; do
  for t in 1 2; do
    date
    (cd /work/wt19_before && PYTHONPATH=/work/wt19_before/src /work/main/.venv/bin/python benchmarks/bench_decode.py --threads $t --out $OUT/decode_before_${t}t_$round.json --force > /dev/null)
    (cd /work/main && /work/main/.venv/bin/python benchmarks/bench_decode.py --threads $t --out $OUT/decode_after_${t}t_$round.json --force > /dev/null)
  done
done
date
echo done
