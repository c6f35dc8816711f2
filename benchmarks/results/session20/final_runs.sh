#!/bin/bash
# The twentieth session's runs, as they ran (paths are this VM's: /work/main the checkout).
# 1. A/B of the allocator setting in alternating processes, same code: NORMLAB_MALLOC=default
#    (glibc's own thresholds, as before this session) against keep (normlab.allocator).
# 2. The probe behind the allocator's docstring.
# 3. The full runs for the top table of docs/performance.md.
set -e
cd /work/main
OUT=runs/s20/final
mkdir -p $OUT/ab
git log -1 --format=%h > $OUT/commit.txt
for round in 1 2 3; do
  for t in 1 2; do
    date
    for m in default keep; do
      NORMLAB_MALLOC=$m .venv/bin/python benchmarks/bench_decode.py --threads $t --out $OUT/ab/decode_${m}_${t}t_$round.json --force > /dev/null
    done
  done
done
for round in 1 2; do
  for t in 1 2; do
    date
    for m in default keep; do
      NORMLAB_MALLOC=$m .venv/bin/python benchmarks/bench_train_step.py --threads $t --repeats 7 --out $OUT/ab/train_${m}_${t}t_$round.json --force > /dev/null
      NORMLAB_MALLOC=$m .venv/bin/python benchmarks/bench_collapse.py --threads $t --repeats 5 --out $OUT/ab/collapse_${m}_${t}t_$round.json --force > /dev/null
    done
  done
done
for t in 1 2; do
  date
  .venv/bin/python benchmarks/probes/malloc_decode.py $t 2 > $OUT/malloc_decode_${t}t.txt
done
for t in 1 2; do
  date
  .venv/bin/python benchmarks/run_all.py --threads $t --no-plot --out $OUT/full_${t}t.json --force > $OUT/full_${t}t.md
  .venv/bin/python benchmarks/bench_train_step.py --threads $t --repeats 15 --out $OUT/train_step_${t}t_r15.json --force > /dev/null
  .venv/bin/python benchmarks/bench_collapse.py --threads $t --repeats 9 --out $OUT/collapse_${t}t_r9.json --force > /dev/null
done
.venv/bin/python benchmarks/probes/ab_summary.py $OUT/ab default keep > $OUT/ab/summary.txt
date
echo done
