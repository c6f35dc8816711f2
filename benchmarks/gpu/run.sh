#!/usr/bin/env bash
# The GPU table's one prepared command (issue 6: "if a GPU is available, add one table of the
# same benchmarks on it, from a single prepared script"). Run from the repository root on the
# GPU machine, after benchmarks/gpu/fetch_wheels.sh here; .whl/ is git-ignored, so the device
# tool's call must carry it (`carry: [".whl"]`), or normlab cannot write its TOML there:
#   bash benchmarks/gpu/run.sh                 # writes to $OUT (the device tool's) or runs/gpu
#   PYTHON=.venv/bin/python DEVICE=cpu QUICK=1 bash benchmarks/gpu/run.sh   # the same steps on
#                                             # a CPU, to check them, with this project's venv
# PYTHON is the interpreter with torch (default python3, the GPU image's). An OUT that already
# holds files is refused, unless FORCE=1 (the device tool's $OUT starts empty).
# It writes five files (the device tool brings back at most eight, two folders down):
#   nvidia-smi.txt; gpu_full.json and gpu_full.md (run_all.py: train step, MFU, packing,
#   decoding and hooks; the collapse sweep and the scaling runs are CPU-only and say so);
#   tta.json (time to 99% on the train cells, default recipes, SEEDS, default one seed each:
#   three would not fit a 15-minute lease; each run stopped after TTA_LIMIT seconds, default
#   120, so that the summary is written within the device tool's 10-minute call: a run stopped
#   there reads "not reached"); run.log (everything printed; after the benchmarks,
#   sync_check.py's line: does a training step make the host wait for the GPU?).
# About 5 minutes on an H100 is the plan; nothing here has run on a GPU yet (no GPU has been
# lent to this project so far), so read run.log first.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-runs/gpu}
device=${DEVICE:-cuda}
seeds=${SEEDS:-0}
limit=${TTA_LIMIT:-120}
if ! [[ "$limit" =~ ^[1-9][0-9]*$ ]]; then  # else `timeout` refused each run, after the benchmarks
  echo "run.sh: TTA_LIMIT=$limit: expected whole seconds >= 1"
  exit 2
fi
quick=()
[ -n "${QUICK:-}" ] && quick=(--quick)
if [ -z "${FORCE:-}" ] && compgen -G "$out/*" > /dev/null; then
  echo "run.sh: $out already holds results; set OUT to another folder, or FORCE=1 to replace them"
  exit 2
fi
mkdir -p "$out"
exec > >(tee "$out/run.log") 2>&1
tee_pid=$!
finish() {  # bash does not wait for tee: close its input and wait, so run.log is whole
  exec >&- 2>&-
  wait "$tee_pid"
  exit "$1"
}
py=${PYTHON:-python3}
"$py" -c "import torch" 2> /dev/null || {
  echo "run.sh: $py has no torch; set PYTHON to the interpreter that has it"; finish 1; }
if compgen -G ".whl/*.whl" > /dev/null; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/normlab-site .whl/*.whl || finish 1
  export PYTHONPATH=/tmp/normlab-site
fi
export PYTHONPATH="$PWD/src:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$py" -c "import tomli_w" 2> /dev/null || {
  echo "run.sh: tomli-w is missing (normlab writes TOML): run benchmarks/gpu/fetch_wheels.sh" \
       "where pip works, and carry .whl"; finish 1; }
(nvidia-smi || echo "no nvidia-smi") > "$out/nvidia-smi.txt" 2>&1
"$py" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__,
  'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))"
date -u
status=0
"$py" benchmarks/run_all.py --device "$device" --only train_step,mfu,packing,decode,hooks \
  "${quick[@]}" --no-plot --force --out "$out/gpu_full.json" > "$out/gpu_full.md" || status=1
cat "$out/gpu_full.md"
# before the training runs, which a lease may cut short
"$py" benchmarks/gpu/sync_check.py --device "$device" || status=1
date -u
# time to accuracy: the runs go to a scratch folder (too many files to bring back), then
# one summary; one run at a time, as benchmarks/tta_runs.sh does on the CPU
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
steps=()
[ -n "${QUICK:-}" ] && steps=(--set train.steps=20 --set train.eval_every=10 \
  --set train.checkpoint_every=10 --set train.eval_examples=8)
for seed in $seeds; do
  for placement in pre qkv; do
    # Ctrl-C at the limit (normlab closes its log; KILL 10 s later if it did not stop)
    timeout -s INT -k 10 "$limit" "$py" -m normlab.cli train \
      --config "configs/addition/$placement.toml" \
      --out "$runs/$placement-s$seed" --seed "$seed" --device "$device" \
      --set train.early_stop_accuracy=0.99 "${steps[@]}"
    rc=$?
    [ "$rc" = 124 ] && echo "run.sh: $placement-s$seed stopped at TTA_LIMIT=$limit s"
    [ "$rc" = 0 ] || [ "$rc" = 124 ] || status=1  # stopped at the limit: read as not reached
  done
done
"$py" benchmarks/time_to_accuracy.py "$runs"/*/ --json "$out/tta.json" --force || status=1
date -u
finish $status
