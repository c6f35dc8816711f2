#!/usr/bin/env bash
# The thirteenth session's RoPE before/after runs: alternating processes, textbook then fast,
# three rounds, one and two threads. Run from the repository root:
#   bash benchmarks/results/session13_ab/run_ab.sh
set -euo pipefail
out=benchmarks/results/session13_ab
py=.venv/bin/python
for round in 1 2 3; do
  for t in 1 2; do
    for rule in textbook fast; do
      $py benchmarks/probes/rope.py $rule bench_train_step --threads $t --repeats 7 \
        --widths 64 --out $out/train_${rule}_${t}t_${round}.json
      $py benchmarks/probes/rope.py $rule bench_collapse --threads $t --repeats 5 \
        --out $out/collapse_${rule}_${t}t_${round}.json
      $py benchmarks/probes/rope.py $rule bench_decode --threads $t \
        --out $out/decode_${rule}_${t}t_${round}.json
    done
  done
done
