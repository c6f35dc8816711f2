#!/usr/bin/env bash
# docs/results.md §2 (H2): where the accuracy lost under norm noise comes from. Each run of a
# `make reproduce` output is analysed twice more, with the default settings but only q and k
# (`--targets q,k`) or only v (`--targets v`) perturbed, on a copy of its folder without its
# analysis; then the three collapse.json files of each run (q, k and v from the reproduce run
# itself) are copied here and `table.py` prints them.
# Usage: bash docs/results/noise_targets/run.sh RESULTS WORK   (RESULTS: e.g. results/quick;
# WORK: a scratch folder for the copies, which hold checkpoints)
set -euo pipefail
results=$1 work=$2
here=$(cd "$(dirname "$0")" && pwd)
normlab=${NORMLAB:-.venv/bin/normlab}
for run_dir in "$results"/runs/*/; do
  run=$(basename "$run_dir")
  mkdir -p "$here/qkv/$run"
  cp "$run_dir/analysis/collapse.json" "$here/qkv/$run/"
  for t in qk v; do
    copy="$work/$t/$run"
    rm -rf "$copy" && mkdir -p "$(dirname "$copy")"
    cp -r "$run_dir" "$copy" && rm -rf "$copy/analysis"
    "$normlab" analyze "$copy" --targets "$([ $t = qk ] && echo q,k || echo v)" --threads 1
    mkdir -p "$here/$t/$run"
    cp "$copy/analysis/collapse.json" "$here/$t/$run/"
  done
done
cp "$results/summary.json" "$here/summary.json"
