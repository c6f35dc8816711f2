#!/usr/bin/env bash
# The thirteenth session's allocator before/after runs: alternating processes, glibc's default
# allocator (NORMLAB_TUNE_MALLOC=0) then the tuned one (=1, what the benchmarks and the CLI now
# do), three rounds, one and two threads. Run from the repository root:
#   bash benchmarks/results/session13_malloc/run_ab.sh
set -euo pipefail
out=benchmarks/results/session13_malloc
py=.venv/bin/python
for round in 1 2 3; do
  for t in 1 2; do
    for rule in default tuned; do
      if [ $rule = default ]; then export NORMLAB_TUNE_MALLOC=0; else export NORMLAB_TUNE_MALLOC=1; fi
      $py benchmarks/bench_train_step.py --threads $t --repeats 7 --widths 64 \
        --out $out/train_${rule}_${t}t_${round}.json
      $py benchmarks/bench_collapse.py --threads $t --repeats 5 \
        --out $out/collapse_${rule}_${t}t_${round}.json
      $py benchmarks/bench_decode.py --threads $t --out $out/decode_${rule}_${t}t_${round}.json
    done
  done
done
