"""One-off probe behind a twenty-fourth-session note in docs/performance.md; not part of make
bench.

Would bfloat16 mixed precision (`torch.autocast("cpu", torch.bfloat16)` around the step, as
nanoGPT's `dtype = "bfloat16"`) speed up normlab's training step on a CPU with AMX? The
train-step benchmark's own step (bench_train_step.build_contender: forward, loss, backward,
clipping, AdamW; float32 weights), `pre` and `qkv`, at the default width d64 and at d128 and
d256, float32 and under autocast alternating, 7 rounds after 3 warm-ups each; and the
float32 and bfloat16 matmul peaks (best of 5 2048^2 products). Autocast here wraps the whole
step; `train.precision` wraps the forward and loss (`normlab.train.autocast`): the backward
follows the forward's dtypes either way, and clipping and AdamW run no matmul.

    .venv/bin/python benchmarks/probes/bf16_autocast.py [THREADS]
"""
import statistics as st
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import probe_header, threads_from_argv
from bench_train_step import base_config, build_contender, model_config, real_batch

from normlab import allocator

allocator.keep_freed_memory()
threads_from_argv("bf16_autocast.py")
probe_header("bf16 autocast, training step", f"AMX: {'amx_bf16' in open('/proc/cpuinfo').read()}")
run = base_config()
batch = real_batch(run)
for placement, d in [(p, d) for p in ("pre", "qkv") for d in (64, 128, 256)]:
    _, step = build_contender("normlab", model_config(run, d, placement), run, batch)

    def bf16(step=step) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            step()

    ways = {"float32": step, "bf16 autocast": bf16}
    for fn in ways.values():
        for _ in range(3):
            fn()
    times: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(7):
        for name in ways if r % 2 == 0 else reversed(ways):
            t0 = time.perf_counter()
            ways[name]()
            times[name].append(time.perf_counter() - t0)
    ms = {k: 1e3 * st.median(v) for k, v in times.items()}
    f32, b16 = ms["float32"], ms["bf16 autocast"]
    print(f"  {placement} d{d}: float32 {f32:.1f} ms, bf16 autocast {b16:.1f} ms, "
          f"float32 / bf16 {f32 / b16:.2f}")
a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
for dtype in (torch.float32, torch.bfloat16):
    x, y = a.to(dtype), b.to(dtype)
    x @ y
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        x @ y
        best = min(best, time.perf_counter() - t0)
    print(f"  matmul peak {str(dtype).removeprefix('torch.')}: {2 * 2048**3 / best / 1e9:.0f} "
          "GFLOP/s")
