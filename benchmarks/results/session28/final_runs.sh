#!/bin/bash
# The twenty-eighth session's runs (AMD EPYC VM) at its code commit, from /work/wtA, nothing
# else running:
# 1. attention_range.py (the kernel against SDPA past 64 keys), one thread and two;
# 2. native_rev_ab.py 4f95945 (native.c before the session against the session's, one process);
# 3. bench_scaling.py at 4f95945 (/work/wt_before, the code before the session) and at the
#    session's code, one after the other per thread count.
set -e
OUT=/work/main/runs/s28/final2  # its files copied to benchmarks/results/session28/
mkdir -p $OUT/before
PY=/work/main/.venv/bin/python
git -C /work/wtA log -1 --format=%h > $OUT/commit.txt
lscpu > $OUT/machine.txt
cd /work/wtA
export PYTHONPATH=/work/wtA/src
for t in 1 2; do
  date -u
  $PY benchmarks/probes/attention_range.py $t > $OUT/attention_range_${t}t.txt 2>&1
  $PY benchmarks/probes/native_rev_ab.py 4f95945 $t > $OUT/native_rev_ab_${t}t.txt 2>&1
done
for t in 1 2; do
  date -u
  (cd /work/wt_before && PYTHONPATH=/work/wt_before/src $PY benchmarks/bench_scaling.py --threads $t --out $OUT/before/scaling_${t}t.json --force > $OUT/before/scaling_${t}t.md)
  date -u
  $PY benchmarks/bench_scaling.py --threads $t --out $OUT/scaling_${t}t.json --force > $OUT/scaling_${t}t.md
done
date -u
echo done
