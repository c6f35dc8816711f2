#!/usr/bin/env bash
# Is qkv/pre's wider reading at the thirty-sixth session's code (docs/performance.md, thirty-sixth
# section) a regression since the thirty-first session's run? The training-step benchmark (d64,
# 15 repeats) at that run's commit and at this one, alternating, twice a thread count, in one
# sitting: `bash benchmarks/results/session36/ab_qkv.sh`. The old code runs from a git worktree
# (WT, default ../ab-3359fb3 beside the checkout) with PYTHONPATH pointing at its src/, so the
# same .venv runs both; its CPU kernels compile into their own cache entry (keyed by source).
set -euo pipefail
cd "$(dirname "$0")/../../.."
git diff --quiet HEAD || { echo "ab_qkv.sh: commit first (tracked files changed)" >&2; exit 1; }
OUT=benchmarks/results/session36/ab
OLD=${OLD:-3359fb3}
WT=${WT:-../ab-$OLD}
PY=$(pwd)/.venv/bin/python
mkdir -p $OUT
[ -d "$WT" ] || git worktree add -q --detach "$WT" "$OLD"
{ echo "new $(git rev-parse HEAD)"; echo "old $(git -C "$WT" rev-parse HEAD)"; } >> $OUT/commits.txt
date -u +"started %H:%M UTC (rounds ${ROUNDS:-1 2})" >> $OUT/commits.txt
for T in 1 2; do
  for round in ${ROUNDS:-1 2}; do  # more rounds later: ROUNDS="3 4"
    (cd "$WT" && PYTHONPATH=src $PY benchmarks/bench_train_step.py --threads $T --repeats 15 \
      --widths 64 --force --out "$OLDPWD/$OUT/old_${T}t_$round.json" > /dev/null)
    $PY benchmarks/bench_train_step.py --threads $T --repeats 15 --widths 64 --force \
      --out $OUT/new_${T}t_$round.json > /dev/null
  done
done
date -u +"finished %H:%M UTC" >> $OUT/commits.txt
$PY - <<'PY'
import json
from pathlib import Path
out = Path("benchmarks/results/session36/ab")
for f in sorted(out.glob("*.json")):
    w = json.loads(f.read_text())["widths"]["64"]
    q = w["qkv_over_pre"]
    c = w["contenders"]
    print(f"{f.stem}: qkv/pre {q['median']:.3f} [{q['ci'][0]:.3f}, {q['ci'][1]:.3f}]; ms pre "
          f"{c['normlab-pre']['median_s'] * 1e3:.1f}, qkv {c['normlab-qkv']['median_s'] * 1e3:.1f}"
          f", nanogpt-manual {c['nanogpt-manual']['median_s'] * 1e3:.1f}")
PY
