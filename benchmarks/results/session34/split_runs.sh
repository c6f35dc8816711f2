#!/usr/bin/env bash
# The thirty-fourth session's runs of benchmarks/probes/decode_split_threads.py, three in a
# row, from the code commit (split_commit.txt), nothing else running:
# `bash benchmarks/results/session34/split_runs.sh`. Overwrites only its own outputs here.
set -euo pipefail
cd "$(dirname "$0")/../../.."
git diff --quiet HEAD || { echo "split_runs.sh: commit first (tracked files changed)" >&2; exit 1; }
OUT=benchmarks/results/session34
PY=${PY:-.venv/bin/python}
git rev-parse HEAD > $OUT/split_commit.txt
date -u +"started %H:%M UTC" >> $OUT/split_commit.txt
for i in 1 2 3; do
  $PY benchmarks/probes/decode_split_threads.py > $OUT/decode_split_threads_$i.txt
done
date -u +"finished %H:%M UTC" >> $OUT/split_commit.txt
