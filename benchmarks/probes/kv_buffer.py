"""One-off probe behind a number in docs/performance.md (tenth session); not part of make bench.

Would a preallocated key/value cache speed up cached greedy decoding? Needs
`benchmarks/probes/kv_buffer.patch` applied (`git apply`; `git checkout
src/normlab/model/attention.py` afterwards): it makes the cache a buffer with room to spare,
written in place at each step (doubling when full), and keeps the old `torch.cat` path behind
a switch, so both run side by side in one process, alternating per repeat, on bench_decode's
cells (pre or qkv, random weights, the cell's eval questions in one batch, forced to max_new):

    .venv/bin/python benchmarks/probes/kv_buffer.py THREADS [pre|qkv] [--profile]

With --profile it also prints, per mode, the self CPU time of `cat`, `copy_` and `bmm` in
five profiled decodes of each cell, and their share of the total.
"""
import statistics as st
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_train_step import base_config, model_config
from normlab import build_model
from normlab.model import attention
from normlab.model.generate import greedy_decode
from normlab.tasks.addition import (
    aux_positions,
    eval_sets,
    make_prompts,
    max_lengths,
    next_aux_position,
)

if not hasattr(attention, "_CAT"):
    sys.exit("kv_buffer.py: apply benchmarks/probes/kv_buffer.patch first (see the docstring)")
threads = int(sys.argv[1]) if len(sys.argv) > 1 else 1
placement = sys.argv[2] if len(sys.argv) > 2 and not sys.argv[2].startswith("-") else "pre"
torch.set_num_threads(threads)
run = base_config()
task = run.validate()
sets = eval_sets(task)
torch.manual_seed(0)
model = build_model(model_config(run, run.model.d_model, placement)).eval()
for n, d in ((5, 1), (2, 3)):
    cell = next(c for c in sets["extrapolation"] if (c.n, c.d) == (n, d))
    prompts = make_prompts([q for q, _ in sets["extrapolation"][cell]], "decoder")
    max_new = max_lengths([cell])[1] + 1

    def dec(
        cat: bool, prompts: list[list[int]] = prompts, max_new: int = max_new
    ) -> list[list[int]]:
        attention._CAT[0] = cat
        return greedy_decode(model, prompts, max_new=max_new, eos=-1, aux_fn=aux_positions,
                             aux_next=next_aux_position, use_cache=True)

    assert dec(True) == dec(False) == greedy_decode(
        model, prompts, max_new=max_new, eos=-1, aux_fn=aux_positions, use_cache=False)
    res: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(25):
        for cat in (True, False):
            t0 = time.perf_counter()
            dec(cat)
            res[cat].append(time.perf_counter() - t0)
    ratio = st.median(b / c for c, b in zip(res[True], res[False], strict=True))
    print(f"{threads} thread(s) {placement} {cell.label} batch {len(prompts)} max_new {max_new}: "
          f"cat {1e3 * st.median(res[True]):.1f} ms, buffer {1e3 * st.median(res[False]):.1f} "
          f"ms, buffer/cat {ratio:.3f} (median of 25 paired ratios)")
    if "--profile" in sys.argv:
        for cat in (True, False):
            for _ in range(3):
                dec(cat)
            with torch.profiler.profile() as prof:
                for _ in range(5):
                    dec(cat)
            ops = {e.key: e.self_cpu_time_total / 5e3 for e in prof.key_averages()}
            total = sum(ops.values())
            print(f"  {'cat' if cat else 'buffer'}: {total:.1f} ms/decode under the profiler; "
                  + ", ".join(f"{op} {ops.get('aten::' + op, 0.0):.1f} ms "
                              f"({100 * ops.get('aten::' + op, 0.0) / total:.0f}%)"
                              for op in ("cat", "copy_", "bmm")))
