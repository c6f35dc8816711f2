#!/bin/bash
# The times to accuracy again, one run at a time (benchmarks/tta_runs.sh as changed after a
# review found that the paired runs of final_runs.sh favoured a run whose partner stopped
# early; docs/performance.md, twenty-third section). Nothing else ran meanwhile.
set -e
cd /work/main
OUT=runs/s23/tta_alone
mkdir -p $OUT
git log -1 --format=%h > $OUT/commit.txt
date
bash benchmarks/tta_runs.sh $OUT/tta > $OUT/tta_runs.log 2>&1
date
echo done
