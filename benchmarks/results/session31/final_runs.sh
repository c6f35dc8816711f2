#!/usr/bin/env bash
# The thirty-first session's runs behind docs/performance.md, from the code commit (commit.txt),
# nothing else running: `bash benchmarks/results/session31/final_runs.sh`. Overwrites only its
# own outputs in this folder.
set -euo pipefail
cd "$(dirname "$0")/../../.."
git diff --quiet HEAD || { echo "final_runs.sh: commit first (tracked files changed)" >&2; exit 1; }
OUT=benchmarks/results/session31
PY=${PY:-.venv/bin/python}
git rev-parse HEAD > $OUT/commit.txt
date -u +"started %H:%M UTC" >> $OUT/commit.txt
lscpu > $OUT/machine.txt
for T in 1 2; do
  $PY benchmarks/probes/attention_range.py $T > $OUT/attention_range_${T}t.txt
  $PY benchmarks/bench_decode.py --threads $T --force --out $OUT/decode_quick_${T}t.json \
    > $OUT/decode_quick_${T}t.md
  $PY benchmarks/bench_decode.py --threads $T --force --config configs/addition/paper/pre.toml \
    --out $OUT/decode_paper_${T}t.json > $OUT/decode_paper_${T}t.md
done
date -u +"finished %H:%M UTC" >> $OUT/commit.txt
