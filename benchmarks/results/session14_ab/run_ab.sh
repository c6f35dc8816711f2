#!/usr/bin/env bash
# Fourteenth session: table[ids] (index) vs F.embedding (embedding) lookups, alternating
# processes, three rounds per thread count, the d64 training step (7 repeats x 3 steps).
# The committed results are never replaced unless asked: FORCE=1 to run it again over them.
#   bash benchmarks/results/session14_ab/run_ab.sh
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=benchmarks/results/session14_ab
for round in 1 2 3; do
  for t in 1 2; do
    for rule in index embedding; do
      .venv/bin/python benchmarks/probes/embedding_backward.py "$rule" bench_train_step \
        --threads "$t" --widths 64 --out "$out/train_${rule}_${t}t_${round}.json" ${FORCE:+--force} \
        > /dev/null
    done
  done
done
