#!/bin/bash
# The twenty-second session's runs, as they ran (paths are this VM's: /work/main the checkout
# at the session's last code commit, /work/wt22old a worktree of c76dee5, the code before this
# session).
# 1. The probes behind the twenty-second section: torch.compile on the cached decode, what a
#    cached prompt forward pays for its cache, and the q/k/v weight layout kept between calls.
# 2. The collapse sweep A/B in alternating processes, before (c76dee5) against after (HEAD):
#    attaching a hook now checks that its point is still the model's (hooks.py), and the
#    sweep's naive baseline attaches 16 for every batch-1 forward.
# 3. bench_decode A/B the same way: the decoding path changed by two argument checks.
set -e
cd /work/main
OUT=runs/s22/final
mkdir -p $OUT/ab
git log -1 --format=%h > $OUT/commit.txt
PY=/work/main/.venv/bin/python
for t in 1 2; do
  date
  $PY benchmarks/probes/decode_compile.py $t > $OUT/decode_compile_${t}t.txt 2> $OUT/decode_compile_${t}t.err
  $PY benchmarks/probes/prefill_cache.py $t > $OUT/prefill_cache_${t}t.txt
  $PY benchmarks/probes/proj_weight_cache.py $t > $OUT/proj_weight_cache_${t}t.txt
done
for round in 1 2 3; do
  for t in 1 2; do
    date
    (cd /work/wt22old && PYTHONPATH=/work/wt22old/src $PY benchmarks/bench_collapse.py --threads $t --repeats 9 --out /work/main/$OUT/ab/collapse_before_${t}t_$round.json --force > /dev/null)
    $PY benchmarks/bench_collapse.py --threads $t --repeats 9 --out $OUT/ab/collapse_after_${t}t_$round.json --force > /dev/null
    (cd /work/wt22old && PYTHONPATH=/work/wt22old/src $PY benchmarks/bench_decode.py --threads $t --out /work/main/$OUT/ab/decode_before_${t}t_$round.json --force > /dev/null)
    $PY benchmarks/bench_decode.py --threads $t --out $OUT/ab/decode_after_${t}t_$round.json --force > /dev/null
  done
done
$PY benchmarks/probes/ab_summary.py $OUT/ab before after > $OUT/ab/summary.txt
date
echo done
