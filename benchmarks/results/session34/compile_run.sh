#!/usr/bin/env bash
# The thirty-fourth session's `--compile` run: every training-step contender eager and under
# torch.compile, side by side, one thread, with make bench's Headlines (the eager steps judged
# against the fastest eager reference), from the code commit (commit.txt), nothing else
# running: `bash benchmarks/results/session34/compile_run.sh`. Overwrites only its own outputs
# in this folder (--force on its own files).
set -euo pipefail
cd "$(dirname "$0")/../../.."
git diff --quiet HEAD || { echo "compile_run.sh: commit first (tracked files changed)" >&2; exit 1; }
OUT=benchmarks/results/session34
PY=${PY:-.venv/bin/python}
git rev-parse HEAD > $OUT/commit.txt
date -u +"started %H:%M UTC" >> $OUT/commit.txt
lscpu > $OUT/machine.txt
$PY benchmarks/run_all.py --compile --only train_step --threads 1 \
  --out $OUT/compile_1t.json --force > $OUT/compile_1t.md
date -u +"finished %H:%M UTC" >> $OUT/commit.txt
