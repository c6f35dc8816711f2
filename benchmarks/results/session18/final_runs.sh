#!/bin/bash
set -e
cd /work/main
OUT=runs/s18/final
mkdir -p $OUT
for t in 1 2; do
  date
  .venv/bin/python benchmarks/run_all.py --threads $t --no-plot --out $OUT/full_${t}t.json --force > $OUT/full_${t}t.md
  .venv/bin/python benchmarks/bench_train_step.py --threads $t --repeats 15 --out $OUT/train_step_${t}t_r15.json --force > /dev/null
  .venv/bin/python benchmarks/bench_collapse.py --threads $t --repeats 9 --out $OUT/collapse_${t}t_r9.json --force > /dev/null
done
date
echo done
