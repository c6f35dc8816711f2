#!/bin/bash
set -e
cd /work/main
OUT=runs/s19/final
mkdir -p $OUT
git log -1 --format=%h > $OUT/commit.txt
for t in 1 2; do
  date
  .venv/bin/python benchmarks/probes/norm_rope_fused.py $t > $OUT/norm_rope_fused_${t}t.txt
  .venv/bin/python benchmarks/probes/dropout_skip.py $t > $OUT/dropout_skip_${t}t.txt
done
for t in 1 2; do
  date
  .venv/bin/python benchmarks/run_all.py --threads $t --no-plot --out $OUT/full_${t}t.json --force > $OUT/full_${t}t.md
  .venv/bin/python benchmarks/bench_train_step.py --threads $t --repeats 15 --out $OUT/train_step_${t}t_r15.json --force > /dev/null
  .venv/bin/python benchmarks/bench_collapse.py --threads $t --repeats 9 --out $OUT/collapse_${t}t_r9.json --force > /dev/null
done
date
echo done
