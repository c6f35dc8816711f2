#!/bin/bash
# The twenty-sixth session's runs at its code commit (AMD EPYC VM), a detached worktree:
# 1. the GELU kernel on and off in one process (benchmarks/probes/linear_gelu_ab.py), and two
#    changes to evaluation tried (benchmarks/probes/eval_mode_ab.py);
# 2. full runs and the 15-/9-repeat training-step and collapse runs (the top table);
# 3. the times to accuracy (benchmarks/tta_runs.sh, one run at a time).
set -e
cd /work/wt_runs
OUT=/work/main/runs/s26/final2
mkdir -p $OUT
git log -1 --format=%h > $OUT/commit.txt
PY=/work/main/.venv/bin/python
export PYTHONPATH=/work/wt_runs/src
for t in 1 2; do
  date -u
  $PY benchmarks/probes/linear_gelu_ab.py $t > $OUT/linear_gelu_ab_${t}t.txt 2>&1
  $PY benchmarks/probes/eval_mode_ab.py $t > $OUT/eval_mode_ab_${t}t.txt 2>&1
done
for t in 1 2; do
  date -u
  $PY benchmarks/run_all.py --threads $t --no-plot --out $OUT/full_${t}t.json --force > $OUT/full_${t}t.md
  $PY benchmarks/bench_train_step.py --threads $t --repeats 15 --out $OUT/train_step_${t}t_r15.json --force > /dev/null
  $PY benchmarks/bench_collapse.py --threads $t --repeats 9 --out $OUT/collapse_${t}t_r9.json --force > /dev/null
done
date -u
echo runs done
# the times to accuracy: tta_runs.sh runs .venv/bin/normlab from the checkout (a link to main's
# environment; PYTHONPATH above puts this worktree's source first)
ln -sfn /work/main/.venv /work/wt_runs/.venv
bash benchmarks/tta_runs.sh $OUT/tta > $OUT/tta_runs.log 2>&1
date -u
echo done
