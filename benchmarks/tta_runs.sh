#!/usr/bin/env bash
# Train the default `pre` and `qkv` quick recipes for seeds 0-2 until 99% on the train cells
# (early stop), two runs at a time with one thread each, then report time to accuracy:
#   bash benchmarks/tta_runs.sh [OUT_DIR=runs/tta]
# About 30 minutes on a 2-core machine. Runs that exist are resumed (`--resume`), so a killed
# script can be started again.
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
  train pre "$seed" & train qkv "$seed" & wait
done
# tta.json is a summary of the runs above, recomputed from them on every (re)start
"$bin/python" benchmarks/time_to_accuracy.py "$out"/pre-s*/ "$out"/qkv-s*/ --json "$out/tta.json" \
  --force
