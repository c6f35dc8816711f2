"""One-off probe behind a fifteenth-session number in docs/performance.md; not part of make bench.

What did reading hook points through `nn.Module.__getattr__` cost, before `setup_hooks` bound
each one as a plain attribute of its parent? One process, one model per placement, the
binding switched off (the points popped from their parents' `__dict__`, so every read goes
through `nn.Module.__getattr__` again, as before) and on, alternating, 15 rounds:

- the forward of bench_hooks (eval, no_grad) at batch 1 and 128,
- a cached greedy decode of bench_decode's n5d1 cell (256 questions, 4 tokens),
- a training step of bench_train_step (d64, batch 128),
- bench_collapse's two contenders (qkv, random weights, 64 examples, 16 draws): the naive
  loop of batch-1 forwards and `measure_collapse` (9 rounds),
- and first, one point in a tight loop: ns per `self.hook_x(x)` read as forwards read them,
  unbound and bound, against the same method without the point.

    .venv/bin/python benchmarks/probes/hook_lookup.py [THREADS]
"""
import statistics as st
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import Sweep, ab, n5d1_prompts

from bench_hooks import PointHolder
from bench_train_step import base_config, build_contender, model_config, real_batch
from normlab import build_model
from normlab.model.generate import greedy_decode
from normlab.model.hooks import HookedModule
from normlab.tasks.addition import (
    aux_positions,
    next_aux_position,
)

if len(sys.argv) > 2 or (len(sys.argv) == 2 and not sys.argv[1].isdigit()):
    sys.exit("usage: hook_lookup.py [THREADS]")
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
run = base_config()
full = real_batch(run)
prompts, max_new = n5d1_prompts(run)


def binder(model: HookedModule) -> Callable[[bool], None]:
    """bind(False) pops every hook point from its parent's __dict__; bind(True) puts it back."""
    points = []
    for name, hp in model.hook_points().items():
        parent, _, attr = name.rpartition(".")
        points.append((vars(model.get_submodule(parent)), attr, hp))

    def bind(on: bool) -> None:
        for d, attr, hp in points:
            if on:
                d[attr] = hp
            else:
                d.pop(attr, None)
    return bind


holder, x1 = PointHolder(), torch.zeros(1)
ns: dict[str, list[float]] = {"unbound": [], "bound": [], "no point": []}
for _ in range(7):
    for label in ns:
        binder(holder)(label != "unbound")
        fn = holder.without_point if label == "no point" else holder.through_point
        t0 = time.perf_counter()
        for _ in range(200_000):
            fn(x1)
        ns[label].append((time.perf_counter() - t0) / 200_000 * 1e9)
binder(holder)(True)
med = {k: st.median(v) for k, v in ns.items()}
print(f"tight loop, ns per read of one unhooked point (median of 7 x 200,000): unbound "
      f"{med['unbound']:.0f}, bound {med['bound']:.0f}, without the point {med['no point']:.0f}")
print(f"{torch.get_num_threads()} thread(s); medians of 15 alternating rounds")
for placement in ("pre", "qkv"):
    cfg = model_config(run, run.model.d_model, placement)
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    bind = binder(model)
    print(f"{placement}: {len(model.hook_points())} hook points")
    with torch.no_grad():
        for b, inner in ((1, 200), (128, 10)):
            tokens, aux = full["tokens"][:b], full["aux"][:b]
            ab(f"forward, batch {b}", bind, lambda t=tokens, a=aux, m=model: m(t, aux=a),
               inner)
        ab("cached decode n5d1", bind, lambda m=model: greedy_decode(
            m, prompts, max_new=max_new, eos=-1, aux_fn=aux_positions,
            aux_next=next_aux_position), 2)
    trained, step = build_contender("normlab", cfg, run, full)
    ab("training step, batch 128", binder(trained), step, 3)

sweep = Sweep()
print(f"collapse sweep (qkv, {len(sweep.rows)} sparse rows x 16 draws), 9 rounds")
sweep.ab(binder(sweep.model), ("unbound", "bound"))
