"""One-off probe behind a twenty-third-session note in docs/performance.md; not part of make
bench.

The MLP by row blocks, tried and not kept: `benchmarks/probes/mlp_blocks.patch` adds
`normlab.model.mlp.BLOCK_HIDDEN_FLOATS_CPU`; apply it in a worktree (`git apply`) and run this
there, with `PYTHONPATH` on its `src/`. It switches the blocks off and on, alternating in one
process: bench_collapse's vectorised sweep (its `sweep_seconds`, and the flips it counts)
and bench_decode's n5d1 and n2d3 cells (`pre`, 256 prompts, cached and uncached, speed-up).
Median of 11 rounds each way.

    .venv/bin/python benchmarks/probes/mlp_blocks_ab.py [THREADS]
"""
import statistics as st
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import N5d1Decoder, Sweep, cell_prompts, probe_header, threads_from_argv
from bench_train_step import base_config

from normlab import allocator
from normlab.model import mlp
from normlab.model.generate import greedy_decode
from normlab.tasks.addition import aux_positions, next_aux_position

allocator.keep_freed_memory()
threads_from_argv("mlp_blocks_ab.py")
probe_header("MLP by row blocks: off / on")
ON = mlp.BLOCK_HIDDEN_FLOATS_CPU
run = base_config()
sweep = Sweep()
n5d1 = N5d1Decoder(run)
n2d3, n2d3_new = cell_prompts(run, "n2d3")


def decode(prompts: list[list[int]], max_new: int, cached: bool) -> None:
    greedy_decode(n5d1.model, prompts, max_new=max_new, eos=-1, aux_fn=aux_positions,
                  aux_next=next_aux_position, use_cache=cached)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


ways = {
    "n5d1 cached": lambda: timed(lambda: decode(n5d1.prompts, n5d1.max_new, True)),
    "n5d1 uncached": lambda: timed(lambda: decode(n5d1.prompts, n5d1.max_new, False)),
    "n2d3 cached": lambda: timed(lambda: decode(n2d3, n2d3_new, True)),
    "n2d3 uncached": lambda: timed(lambda: decode(n2d3, n2d3_new, False)),
    "sweep": lambda: sweep.vectorised()["sweep_seconds"],
}
times: dict = {(name, on): [] for name in ways for on in (False, True)}
flips = {}
for on in (False, True):  # warm-up, and the flips each way
    mlp.BLOCK_HIDDEN_FLOATS_CPU = ON if on else 0
    for fn in ways.values():
        fn()
    flips[on] = sweep.vectorised()["rows"]["rate"]
for r in range(11):
    for on in (False, True) if r % 2 == 0 else (True, False):
        mlp.BLOCK_HIDDEN_FLOATS_CPU = ON if on else 0
        for name, fn in ways.items():
            times[(name, on)].append(fn())
mlp.BLOCK_HIDDEN_FLOATS_CPU = ON
print(f"flips equal off / on: {torch.equal(flips[False], flips[True])}")
for name in ways:
    off, on = (1e3 * st.median(times[(name, b)]) for b in (False, True))
    print(f"  {name:14s} off {off:8.2f} ms, on {on:8.2f} ms, on / off {on / off:.3f}")
for c in ("n5d1", "n2d3"):
    for on in (False, True):
        ratios = [u / k for u, k in zip(times[(f"{c} uncached", on)], times[(f"{c} cached", on)],
                                        strict=True)]
        print(f"  {c} speed-up {'on ' if on else 'off'} {st.median(ratios):.3f}")
