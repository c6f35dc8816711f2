"""One-off probe behind a sixteenth-session number in docs/performance.md; not part of make bench.

What did `evaluating` cost the collapse sweep when it called `model.eval()` and
`model.train(was)` on every entry (before it left a model already in eval mode alone)? On
bench_collapse's set-up (qkv, random weights, 64 examples, 16 draws, one thread): the time of
one `eval()` + `train(False)` walk, and `measure_collapse` with the old and the new
`evaluating`, alternating, 9 rounds (whole call, and the sweep_seconds it reports).

    .venv/bin/python benchmarks/probes/evaluating_cost.py [THREADS]
"""
import contextlib
import statistics as st
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import Sweep, ab

from normlab.analysis import collapse, data

if len(sys.argv) > 2 or (len(sys.argv) == 2 and not sys.argv[1].isdigit()):
    sys.exit("usage: evaluating_cost.py [THREADS]")
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
sweep = Sweep()
model = sweep.model
new = data.evaluating


@contextlib.contextmanager
def old(m: torch.nn.Module) -> Iterator[None]:
    """`evaluating` as it was up to the fifteenth session."""
    was = m.training
    m.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        m.train(was)


def use(on: bool) -> None:
    data.evaluating = collapse.evaluating = new if on else old


walks = []
for _ in range(200):
    t0 = time.perf_counter()
    model.eval()
    model.train(False)
    walks.append(time.perf_counter() - t0)
print(f"{torch.get_num_threads()} thread(s); {len(list(model.modules()))} modules; one eval() + "
      f"train(False): {st.median(walks) * 1e6:.0f} µs (median of 200)")
sweeps: dict[bool, list[float]] = {False: [], True: []}


def call() -> None:
    sweeps[data.evaluating is new].append(sweep.vectorised()["sweep_seconds"] * 1e3)


print("measure_collapse, 9 rounds:")
ab("whole call", use, call, 1, rounds=9, names=("old", "new"))
print(f"  sweep_seconds            old {st.median(sweeps[False]):8.3f} ms, new "
      f"{st.median(sweeps[True]):8.3f} ms")
