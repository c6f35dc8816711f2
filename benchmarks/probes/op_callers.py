"""One-off probe behind a seventeenth-session number in docs/performance.md; not part of make
bench.

Where does the collapse sweep's time go, by the normlab source line that calls each torch
function? One `measure_collapse` of bench_collapse's set-up (qkv, random weights, 64 examples,
16 draws, sigma 0.3) under a `TorchFunctionMode` that times the functions named (wall time
around each call, so small ops carry the mode's overhead too), one thread:

    .venv/bin/python benchmarks/probes/op_callers.py [FUNCTIONS]

FUNCTIONS is comma-separated torch function names (default: the elementwise and matmul ones);
run it with NORMLAB_NATIVE_ROPE=0 and without to see RoPE's lines before and after the kernel.
"""
import collections
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import Sweep

from normlab.model import native

DEFAULT = ("mul,add,roll,cat,matmul,gelu,softmax,pad,flatten,reshape,contiguous,transpose,"
           "addcmul")
want = set((sys.argv[1] if len(sys.argv) > 1 else DEFAULT).split(","))
torch.set_num_threads(1)
sweep = Sweep()
for _ in range(3):
    sweep.vectorised()
spent: dict[tuple[str, str], list[float]] = collections.defaultdict(lambda: [0.0, 0])


class Timed(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        name = getattr(func, "__name__", str(func))
        if name not in want:
            return func(*args, **(kwargs or {}))
        t0 = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        dt = time.perf_counter() - t0
        ours = [f for f in traceback.extract_stack()[:-1] if "normlab" in f.filename]
        where = f"{Path(ours[-1].filename).name}:{ours[-1].lineno}" if ours else "?"
        spent[(name, where)][0] += dt
        spent[(name, where)][1] += 1
        return out


with Timed():
    t0 = time.perf_counter()
    res = sweep.vectorised()
    call = time.perf_counter() - t0
print(f"kernels: {native.describe()}")
print(f"measure_collapse under the mode: {call * 1e3:.1f} ms, of which the sweep "
      f"{res['sweep_seconds'] * 1e3:.1f} ms")
for (name, where), (t, n) in sorted(spent.items(), key=lambda kv: -kv[1][0])[:25]:
    print(f"  {t * 1e3:7.2f} ms {100 * t / call:5.1f}%  {n:4d} calls  {name:10s} {where}")
