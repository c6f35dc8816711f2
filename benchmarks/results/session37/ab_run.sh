#!/usr/bin/env bash
# Did the thirty-seventh session's kernel changes cost a training step or a decode anything?
# Every CPU kernel's gate now also turns away a lazily negated tensor (`_plain`, one more test a
# call), and the norms split their rows between threads at multiples of eight. The session's
# first commit's parent (OLD, default 097a642) against this commit: the training step (d64, 15
# repeats) and the decoding benchmark (7 repeats), old then new, ROUNDS times a thread count, in
# one sitting: `bash benchmarks/results/session37/ab_run.sh`. The old code runs from a git
# worktree (WT, default ../ab-$OLD) with PYTHONPATH at its src/, so one .venv runs both; its
# kernels compile into their own cache entry. `benchmarks/probes/ab_summary.py OUT old new`
# prints every run's medians and their median (summary.txt). THREADS (default "1 2") and
# BENCHES (default "train decode") narrow a later sitting, e.g. THREADS=2 BENCHES=train
# ROUNDS="5 6 7 8". OUT (default this folder's ab/) lets a later session A/B its own change
# with the same procedure (the thirty-eighth: OLD=1268c01 BENCHES=decode
# OUT=benchmarks/results/session38/ab).
set -euo pipefail
cd "$(dirname "$0")/../../.."
git diff --quiet HEAD || { echo "ab_run.sh: commit first (tracked files changed)" >&2; exit 1; }
ROOT=$(pwd)
OUT=${OUT:-benchmarks/results/session37/ab}
OLD=${OLD:-097a642}
WT=${WT:-../ab-$OLD}
PY=$ROOT/.venv/bin/python
mkdir -p $OUT
[ -d "$WT" ] || git worktree add -q --detach "$WT" "$OLD"
{ echo "new $(git rev-parse HEAD)"; echo "old $(git -C "$WT" rev-parse HEAD)"; } >> $OUT/commits.txt
BENCHES=${BENCHES:-train decode}
date -u +"started %H:%M UTC (rounds ${ROUNDS:-1 2}, threads ${THREADS:-1 2}, $BENCHES)" \
  >> $OUT/commits.txt
for T in ${THREADS:-1 2}; do
  for round in ${ROUNDS:-1 2}; do
    for side in old new; do
      dir=$([ $side = old ] && echo "$WT" || echo "$ROOT")
      if [[ " $BENCHES " == *" train "* ]]; then
        (cd "$dir" && PYTHONPATH=src $PY benchmarks/bench_train_step.py --threads $T \
          --repeats 15 --widths 64 --force --out "$ROOT/$OUT/train_${side}_${T}t_$round.json" \
          > /dev/null)
      fi
      if [[ " $BENCHES " == *" decode "* ]]; then
        (cd "$dir" && PYTHONPATH=src $PY benchmarks/bench_decode.py --threads $T --force \
          --out "$ROOT/$OUT/decode_${side}_${T}t_$round.json" > /dev/null)
      fi
    done
  done
done
date -u +"finished %H:%M UTC" >> $OUT/commits.txt
$PY benchmarks/probes/ab_summary.py $OUT old new | tee $OUT/summary.txt
