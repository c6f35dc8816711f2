"""One-off probe behind sixteenth- and seventeenth-session numbers in docs/performance.md; not
part of make bench.

What does one of normlab's native CPU kernels (`normlab.model.native`: `norm`, the default, or
`rope`) change? One process, that kernel switched off (torch's ops) and on, alternating, 15
rounds (the other kernel stays on; in the sixteenth session there was no RoPE kernel):

- a training step of bench_train_step (d64, batch 128) for `pre`, `qk` and `qkv`, with
  nanoGPT's step timed in the same rounds, so each is also a ratio to nanoGPT, and `qkv` to `pre`,
- the forward of bench_hooks (eval, no_grad) at batch 1 and 128,
- a cached and an uncached greedy decode of bench_decode's n5d1 cell (256 questions),
- bench_collapse's two contenders (qkv, random weights, 64 examples, 16 draws), 9 rounds.

    .venv/bin/python benchmarks/probes/native_norm_ab.py [THREADS] [norm|rope]
"""
import statistics as st
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import Sweep, ab, n5d1_prompts

from bench_train_step import base_config, build_contender, model_config, real_batch
from normlab import build_model
from normlab.model import native
from normlab.model.generate import greedy_decode
from normlab.tasks.addition import (
    aux_positions,
    next_aux_position,
)

args = sys.argv[1:]
if len(args) > 2 or (args and not args[0].isdigit()) or args[1:] not in ([], ["norm"], ["rope"]):
    sys.exit("usage: native_norm_ab.py [THREADS] [norm|rope]")
torch.set_num_threads(int(args[0]) if args else 1)
KERNEL = args[1] if len(args) > 1 else "norm"
NAMES = ("torch", "native")


def switch(on: bool) -> None:
    native.set_enabled(on, KERNEL)


print(f"{torch.get_num_threads()} thread(s); A/B of the {KERNEL} kernel; kernels: "
      f"{native.describe()}")
run = base_config()
full = real_batch(run)

# training steps: every contender in every round, the kernel flipped for normlab's
steps = {p: build_contender("normlab", model_config(run, run.model.d_model, p), run, full)[1]
         for p in ("pre", "qk", "qkv")}
nano = build_contender("nanogpt", model_config(run, run.model.d_model, "pre"), run, full)[1]
times: dict[str, list[float]] = {}
for fn in (*steps.values(), nano):
    fn()
for r in range(15):
    for on in (False, True) if r % 2 == 0 else (True, False):
        switch(on)
        for name, fn in [*((f"{p}-{NAMES[on]}", f) for p, f in steps.items()), ("nanogpt", nano)]:
            if name == "nanogpt" and on:
                continue
            t0 = time.perf_counter()
            for _ in range(3):
                fn()
            times.setdefault(name, []).append((time.perf_counter() - t0) / 3 * 1e3)
switch(True)


def ratio(a: str, b: str) -> str:
    rs = [x / y for x, y in zip(times[a], times[b], strict=True)]
    return f"{st.median(rs):.3f} [{min(rs):.3f}, {max(rs):.3f}]"


print("training step, d64, batch 128, ms (median of 15 rounds; ratios paired per round):")
print(f"  nanoGPT {st.median(times['nanogpt']):.2f}")
for p in steps:
    t, n = p + "-torch", p + "-native"
    print(f"  {p:4s} torch {st.median(times[t]):.2f}, native {st.median(times[n]):.2f}; "
          f"native / torch {ratio(n, t)}; vs nanoGPT: torch {ratio(t, 'nanogpt')}, "
          f"native {ratio(n, 'nanogpt')}")
print(f"  qkv / pre: torch {ratio('qkv-torch', 'pre-torch')}, "
      f"native {ratio('qkv-native', 'pre-native')}")

prompts, max_new = n5d1_prompts(run)
print("eval-mode calls (torch / native):")
for placement in ("pre", "qkv"):
    torch.manual_seed(0)
    model = build_model(model_config(run, run.model.d_model, placement)).eval()
    print(f" {placement}:")
    with torch.no_grad():
        for b, inner in ((1, 200), (128, 10)):
            tokens, aux = full["tokens"][:b], full["aux"][:b]
            ab(f"forward, batch {b}", switch, lambda t=tokens, a=aux, m=model: m(t, aux=a),
               inner, names=NAMES)
        for cached in (True, False):
            ab(f"{'cached' if cached else 'uncached'} decode n5d1", switch,
               lambda m=model, c=cached: greedy_decode(
                   m, prompts, max_new=max_new, eos=-1, aux_fn=aux_positions,
                   aux_next=next_aux_position, use_cache=c), 2, names=NAMES)

sweep = Sweep()
print(f"collapse sweep (qkv, {len(sweep.rows)} sparse rows x 16 draws), 9 rounds:")
sweep.ab(switch, NAMES)
