#!/usr/bin/env bash
# The thirty-first session's runs on bench_scaling's warm-up, from the code commit
# (scaling_commit.txt), nothing else running: the page faults of the training rows round by
# round (probe), then the scaling benchmark with its warm-up rounds, twice on one thread and
# once on two. `bash benchmarks/results/session31/scaling_runs.sh`; overwrites only its own
# outputs here.
set -euo pipefail
cd "$(dirname "$0")/../../.."
git diff --quiet HEAD || { echo "scaling_runs.sh: commit first (tracked files changed)" >&2; exit 1; }
OUT=benchmarks/results/session31
PY=${PY:-.venv/bin/python}
git rev-parse HEAD > $OUT/scaling_commit.txt
date -u +"started %H:%M UTC" >> $OUT/scaling_commit.txt
for T in 1 2; do
  $PY benchmarks/probes/scaling_faults.py $T 8 > $OUT/scaling_faults_${T}t.txt
done
for RUN in 1t_a 1t_b 2t_a; do
  $PY benchmarks/bench_scaling.py --threads ${RUN%%t_*} --force --out $OUT/scaling_warm_${RUN}.json \
    > $OUT/scaling_warm_${RUN}.md
done
date -u +"finished %H:%M UTC" >> $OUT/scaling_commit.txt
