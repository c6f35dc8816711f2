#!/bin/bash
# The twentieth session's second set of runs, as they ran (paths are this VM's: /work/main
# the checkout, /work/wtB a worktree of d73dc3e, the code before the timing change).
# 1. A/B of the benchmarks' timing in alternating processes: before (d73dc3e: a gc.collect()
#    before every timed call) against after (HEAD: the collector off while timing).
# 2. The probes behind the twentieth section, and the full runs for the top table.
set -e
cd /work/main
OUT=runs/s20/final3
mkdir -p $OUT/ab_gc
git log -1 --format=%h > $OUT/commit.txt
for round in 1 2 3; do
  for t in 1 2; do
    date
    (cd /work/wtB && PYTHONPATH=/work/wtB/src /work/main/.venv/bin/python benchmarks/bench_decode.py --threads $t --out /work/main/$OUT/ab_gc/decode_collect_${t}t_$round.json --force > /dev/null)
    .venv/bin/python benchmarks/bench_decode.py --threads $t --out $OUT/ab_gc/decode_off_${t}t_$round.json --force > /dev/null
  done
done
for round in 1 2; do
  for t in 1 2; do
    date
    (cd /work/wtB && PYTHONPATH=/work/wtB/src /work/main/.venv/bin/python benchmarks/bench_train_step.py --threads $t --repeats 7 --out /work/main/$OUT/ab_gc/train_collect_${t}t_$round.json --force > /dev/null)
    .venv/bin/python benchmarks/bench_train_step.py --threads $t --repeats 7 --out $OUT/ab_gc/train_off_${t}t_$round.json --force > /dev/null
    (cd /work/wtB && PYTHONPATH=/work/wtB/src /work/main/.venv/bin/python benchmarks/bench_collapse.py --threads $t --repeats 5 --out /work/main/$OUT/ab_gc/collapse_collect_${t}t_$round.json --force > /dev/null)
    .venv/bin/python benchmarks/bench_collapse.py --threads $t --repeats 5 --out $OUT/ab_gc/collapse_off_${t}t_$round.json --force > /dev/null
  done
done
for t in 1 2; do
  date
  .venv/bin/python benchmarks/probes/decode_gc.py $t > $OUT/decode_gc_${t}t.txt
  .venv/bin/python benchmarks/probes/malloc_decode.py $t 2 > $OUT/malloc_decode_${t}t.txt
done
for r in 1 2 3 4; do
  for t in 1 2; do
    .venv/bin/python benchmarks/probes/decode_budget.py $t > $OUT/decode_budget_${t}t_$r.txt
  done
done
for t in 1 2; do
  date
  .venv/bin/python benchmarks/run_all.py --threads $t --no-plot --out $OUT/full_${t}t.json --force > $OUT/full_${t}t.md
  .venv/bin/python benchmarks/bench_train_step.py --threads $t --repeats 15 --out $OUT/train_step_${t}t_r15.json --force > /dev/null
  .venv/bin/python benchmarks/bench_collapse.py --threads $t --repeats 9 --out $OUT/collapse_${t}t_r9.json --force > /dev/null
done
.venv/bin/python benchmarks/probes/ab_summary.py $OUT/ab_gc collect off > $OUT/ab_gc/summary.txt
date
echo done
