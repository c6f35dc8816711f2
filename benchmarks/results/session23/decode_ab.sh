#!/bin/bash
# After the final runs, greedy decoding gained a clamp of the fed-back digit positions (one
# [batch, 1] op a step; c6c3a1b). bench_decode before (bac9489, the final runs' code, a git
# worktree at /work/wt23old) against after (HEAD), alternating processes, three rounds of
# each thread count; summary by benchmarks/probes/ab_summary.py.
set -e
cd /work/main
OUT=runs/s23/decode_ab
mkdir -p $OUT
git worktree remove --force /work/wt23old 2>/dev/null || true
git worktree add -q --detach /work/wt23old bac9489
PY=/work/main/.venv/bin/python
for round in 1 2 3; do
  for t in 1 2; do
    (cd /work/wt23old && PYTHONPATH=/work/wt23old/src $PY benchmarks/bench_decode.py --threads $t --out /work/main/$OUT/decode_before_${t}t_$round.json --force > /dev/null)
    $PY benchmarks/bench_decode.py --threads $t --out $OUT/decode_after_${t}t_$round.json --force > /dev/null
  done
done
$PY benchmarks/probes/ab_summary.py $OUT before after > $OUT/summary.txt
git worktree remove --force /work/wt23old
date
