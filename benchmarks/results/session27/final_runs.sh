#!/bin/bash
# The twenty-seventh session's runs at its code commit (AMD EPYC VM), from a detached worktree:
# 1. the short-row attention kernel on and off in one process (benchmarks/probes/attention_ab.py);
# 2. full runs and the 15-/9-repeat training-step and collapse runs, with the kernel off
#    (NORMLAB_NATIVE_ATTENTION=0: the code as it was) and on, one after the other per thread
#    count, so that both see the same hour of the VM;
# 3. the times to accuracy (benchmarks/tta_runs.sh, one run at a time).
set -e
cd /work/wt_runs
OUT=/work/main/runs/s27/final
mkdir -p $OUT/off
git log -1 --format=%h > $OUT/commit.txt
PY=/work/main/.venv/bin/python
export PYTHONPATH=/work/wt_runs/src
for t in 1 2; do
  date -u
  $PY benchmarks/probes/attention_ab.py $t > $OUT/attention_ab_${t}t.txt 2>&1
done
for t in 1 2; do
  for setting in off on; do
    date -u
    dir=$OUT
    [ $setting = off ] && dir=$OUT/off
    env NORMLAB_NATIVE_ATTENTION=$([ $setting = off ] && echo 0 || echo 1) \
      $PY benchmarks/run_all.py --threads $t --no-plot --out $dir/full_${t}t.json --force > $dir/full_${t}t.md
    env NORMLAB_NATIVE_ATTENTION=$([ $setting = off ] && echo 0 || echo 1) \
      $PY benchmarks/bench_train_step.py --threads $t --repeats 15 --out $dir/train_step_${t}t_r15.json --force > /dev/null
    env NORMLAB_NATIVE_ATTENTION=$([ $setting = off ] && echo 0 || echo 1) \
      $PY benchmarks/bench_collapse.py --threads $t --repeats 9 --out $dir/collapse_${t}t_r9.json --force > /dev/null
  done
done
date -u
echo runs done
# the times to accuracy: tta_runs.sh runs .venv/bin/normlab from the checkout (a link to main's
# environment; PYTHONPATH above puts this worktree's source first)
ln -sfn /work/main/.venv /work/wt_runs/.venv
bash benchmarks/tta_runs.sh $OUT/tta > $OUT/tta_runs.log 2>&1
date -u
echo done
