#!/bin/bash
set -e
cd /work/main
OUT=runs/s19/recheck
for t in 1 2; do
  date
  .venv/bin/python benchmarks/bench_train_step.py --threads $t --repeats 15 --out $OUT/train_step_${t}t_r15.json --force > /dev/null
  .venv/bin/python benchmarks/bench_decode.py --threads $t --out $OUT/decode_${t}t.json --force > /dev/null
done
date
echo done
