"""One-off probe behind a thirteenth-session number in docs/performance.md; not part of make bench.

`positions.Rope` (tables widened per head count, `roll` for the rotate-half) against the
textbook rotation it replaced (`x * cos + cat(-x2, x1) * sin`, tables broadcast over heads):

    .venv/bin/python benchmarks/probes/rope.py micro [THREADS]
        one rotation of [128, 17, 4, 16] (training's q at d64), forward and forward+backward,
        median of 300 calls, each way, two rounds (the second is the one to read)
    .venv/bin/python benchmarks/probes/rope.py RULE BENCH [its arguments]
        a benchmark module (bench_train_step, bench_collapse, bench_decode, bench_mfu, or a
        probe run on import) with RULE = textbook (the code before) or fast (the current code)
"""
import importlib
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from normlab.model.positions import Rope, Rotary

FAST = Rope.__call__


def textbook(self: Rope, x: torch.Tensor) -> torch.Tensor:
    """The rotation before: broadcast [batch, pos, 1, d_head] tables, cat of negated halves."""
    h = x.shape[-1] // 2
    sin = torch.cat([self.sin[..., :h], -self.sin[..., h:]], dim=-1)  # undo the signing
    return x * self.cos + torch.cat([-x[..., h:], x[..., :h]], dim=-1) * sin


def median_us(fn: Callable[[], object], n: int = 300) -> float:
    for _ in range(10):
        fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e6 * sorted(ts)[n // 2]


def micro(threads: int) -> None:
    torch.set_num_threads(threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{torch.backends.cpu.get_cpu_capability()}; x [128, 17, 4, 16]")
    torch.manual_seed(0)
    positions = torch.randint(0, 48, (128, 17))
    x = torch.randn(128, 17, 4, 16)
    xg, g = x.clone().requires_grad_(), torch.randn_like(x)
    out = {}
    # two rounds: the process's first large allocations are slow (the first round warms up)
    for name, rule in (("textbook", textbook), ("fast", FAST)) * 2:
        Rope.__call__ = rule  # type: ignore[method-assign]
        rope = Rotary(16, 10000.0)(positions)
        out[name] = rope(x)
        fwd = median_us(lambda rope=rope: rope(x))
        fb = median_us(lambda rope=rope: torch.autograd.grad(rope(xg), xg, g))
        print(f"{name:9s} forward {fwd:7.1f} us, forward+backward {fb:7.1f} us", flush=True)
    Rope.__call__ = FAST  # type: ignore[method-assign]
    print("same numbers:", torch.equal(out["textbook"], out["fast"]))


if len(sys.argv) < 2 or sys.argv[1] not in ("micro", "textbook", "fast"):
    sys.exit("usage: rope.py micro [THREADS] | rope.py textbook|fast BENCH [its arguments]")
if sys.argv[1] == "micro":
    micro(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
else:
    if len(sys.argv) < 3:
        sys.exit("usage: rope.py textbook|fast BENCH [its arguments]")
    if sys.argv[1] == "textbook":
        Rope.__call__ = textbook  # type: ignore[method-assign]
    bench = sys.argv[2]
    sys.argv = [f"{bench}.py", *sys.argv[3:]]
    module = importlib.import_module(bench)
    if hasattr(module, "main"):
        module.main()
