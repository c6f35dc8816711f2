#!/usr/bin/env bash
# Train the default `pre` and `qkv` quick recipes for seeds 0-2 until 99% on the train cells
# (early stop), one run at a time on one thread, then report time to accuracy:
#   bash benchmarks/tta_runs.sh [OUT_DIR=runs/tta]
# About 25 minutes on a 2-core machine. Runs that exist are resumed (`--resume`), so a killed
# script can be started again. One at a time, so that every run's steps cost the same: until
# the twenty-third session two ran side by side, and a run whose partner stopped early ran its
# last steps alone and faster (docs/performance.md, twenty-third section).
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-runs/tta}
bin=.venv/bin
mkdir -p "$out"
train() {  # placement seed
  local dir="$out/$1-s$2"
  local extra=()
  [ -f "$dir/config.toml" ] && extra=(--resume)
  "$bin/normlab" train --config "configs/addition/$1.toml" --out "$dir" --seed "$2" \
    --set train.early_stop_accuracy=0.99 "${extra[@]}" > "$dir.log" 2>&1
}
for seed in 0 1 2; do
  train pre "$seed"
  train qkv "$seed"
done
# tta.json is a summary of the runs above, recomputed from them on every (re)start
"$bin/python" benchmarks/time_to_accuracy.py "$out"/pre-s*/ "$out"/qkv-s*/ --json "$out/tta.json" \
  --force
