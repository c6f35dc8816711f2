#!/bin/bash
# alternating processes: before (96b0342, worktree) and after (main HEAD), 1 and 2 threads
set -e
OUT=/work/main/runs/s18/decode_ab
mkdir -p $OUT
for round in 1 2 3; do
  for t in 1 2; do
    (cd /work/wt18_before && PYTHONPATH=/work/wt18_before/src /work/main/.venv/bin/python benchmarks/bench_decode.py --threads $t --out $OUT/before_${t}t_$round.json --force > /dev/null)
    (cd /work/main && /work/main/.venv/bin/python benchmarks/bench_decode.py --threads $t --out $OUT/after_${t}t_$round.json --force > /dev/null)
  done
done
echo done
