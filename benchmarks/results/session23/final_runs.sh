#!/bin/bash
# The twenty-third session's runs, as they ran (/work/main is the checkout at the session's
# last code commit). After the fairness audit of the benchmarks (docs/performance.md,
# twenty-third section): the collapse sweep's naive loop stops after its last pattern as
# measure_collapse does, nanoGPT's explicit attention is a reference (nanogpt-manual) and
# x-transformers runs its default attention.
# 1. Full runs (`run_all.py`) on one and two threads, and the 15- and 9-repeat training-step
#    and collapse runs, for the top table of docs/performance.md.
# 2. The times to accuracy (`tta_runs.sh`, two runs at a time), not rerun since the
#    nineteenth session.
set -e
cd /work/main
OUT=runs/s23/final
mkdir -p $OUT
git log -1 --format=%h > $OUT/commit.txt
PY=/work/main/.venv/bin/python
for t in 1 2; do
  date
  $PY benchmarks/run_all.py --threads $t --no-plot --out $OUT/full_${t}t.json --force > $OUT/full_${t}t.md
  $PY benchmarks/bench_train_step.py --threads $t --repeats 15 --out $OUT/train_step_${t}t_r15.json --force > /dev/null
  $PY benchmarks/bench_collapse.py --threads $t --repeats 9 --out $OUT/collapse_${t}t_r9.json --force > /dev/null
done
date
bash benchmarks/tta_runs.sh $OUT/tta > $OUT/tta_runs.log 2>&1
date
echo done
