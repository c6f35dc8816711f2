#!/bin/bash
# The twenty-first session's runs, as they ran (paths are this VM's: /work/main the checkout
# at the session's last code commit, /work/wtB a worktree of d29de50, the code before this
# session, /work/wtPF a worktree of the same commit as /work/main with
# benchmarks/probes/attn_prefetch.patch applied, made below).
# 1. A/B in alternating processes: before (d29de50) against after (HEAD: this session's code,
#    the exact cache reserve and the new input checks among it), and after against after +
#    the prefetch patch (tried, not kept).
# 2. The probes behind the twenty-first section, and the full runs for the top table.
set -e
cd /work/main
OUT=runs/s21/final
mkdir -p $OUT/ab
git log -1 --format=%h > $OUT/commit.txt
git worktree remove --force /work/wtPF 2>/dev/null || true
git worktree add -q --detach /work/wtPF HEAD
git -C /work/wtPF apply /work/main/benchmarks/probes/attn_prefetch.patch
PY=/work/main/.venv/bin/python
for round in 1 2 3; do
  for t in 1 2; do
    date
    (cd /work/wtB && PYTHONPATH=/work/wtB/src $PY benchmarks/bench_decode.py --threads $t --out /work/main/$OUT/ab/decode_before_${t}t_$round.json --force > /dev/null)
    $PY benchmarks/bench_decode.py --threads $t --out $OUT/ab/decode_after_${t}t_$round.json --force > /dev/null
    (cd /work/wtPF && PYTHONPATH=/work/wtPF/src $PY benchmarks/bench_decode.py --threads $t --out /work/main/$OUT/ab/decode_prefetch_${t}t_$round.json --force > /dev/null)
  done
done
for t in 1 2; do
  for r in 1 2; do
    $PY benchmarks/probes/decode_memory.py $t > $OUT/decode_memory_${t}t_$r.txt
    (cd /work/wtPF && PYTHONPATH=/work/wtPF/src $PY benchmarks/probes/decode_memory.py $t) > $OUT/decode_memory_prefetch_${t}t_$r.txt
  done
  $PY benchmarks/probes/attend_cold.py $t > $OUT/attend_cold_${t}t.txt
  (cd /work/wtPF && PYTHONPATH=/work/wtPF/src $PY benchmarks/probes/attend_cold.py $t) > $OUT/attend_cold_prefetch_${t}t.txt
  $PY benchmarks/probes/decode_budget.py $t > $OUT/decode_budget_${t}t.txt
done
date
$PY benchmarks/probes/gc_cycles.py > $OUT/gc_cycles.txt
for t in 1 2; do
  date
  $PY benchmarks/run_all.py --threads $t --no-plot --out $OUT/full_${t}t.json --force > $OUT/full_${t}t.md
  $PY benchmarks/bench_train_step.py --threads $t --repeats 15 --out $OUT/train_step_${t}t_r15.json --force > /dev/null
  $PY benchmarks/bench_collapse.py --threads $t --repeats 9 --out $OUT/collapse_${t}t_r9.json --force > /dev/null
done
$PY benchmarks/probes/ab_summary.py $OUT/ab before after > $OUT/ab/summary.txt
$PY benchmarks/probes/ab_summary.py $OUT/ab after prefetch > $OUT/ab/summary_prefetch.txt
git worktree remove --force /work/wtPF
date
echo done
