"""One-off probe behind a twenty-fourth-session note in docs/performance.md; not part of make
bench.

Where normlab's bfloat16 training step differs from nanoGPT's explicit-attention one: both
contenders' steps (bench_train_step.build_contender, `pre`, d128, `precision="bfloat16"`)
under `torch.profiler`, 5 steps after 3 warm-ups; the ops by self CPU time, per step, with
their calls per step. The profiler's overhead inflates small ops: read the call counts and
the shares, not the totals, against the benchmark's timings.

    .venv/bin/python benchmarks/probes/bf16_step_prof.py [THREADS]
"""
import sys
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import probe_header, threads_from_argv
from bench_train_step import base_config, build_contender, model_config, real_batch

from normlab import allocator

allocator.keep_freed_memory()
threads_from_argv("bf16_step_prof.py")
probe_header("bf16 training step, profiled: normlab pre vs nanogpt-manual, d128")
run = base_config()
batch = real_batch(run)
for kind in ("normlab", "nanogpt-manual"):
    _, step = build_contender(kind, model_config(run, 128, "pre"), run, batch,
                              precision="bfloat16")
    for _ in range(3):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            step()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in events) / 5e3
    print(f"{kind}: {total:.1f} ms self CPU a step")
    for e in events[:14]:
        print(f"  {e.key:34s} {e.count / 5:6.1f} calls {e.self_cpu_time_total / 5e3:7.2f} ms")
