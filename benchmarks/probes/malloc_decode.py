"""One-off probe behind a twentieth-session note in docs/performance.md; not part of make bench.

What glibc's trimming costs normlab's inference, and what `normlab.allocator` (glibc told to
keep freed memory) buys back. For each setting, in its own fresh process (the setting is
process-wide): a `pre` decoder of the quick-grid size (random weights), bench_decode's n5d1
cell (256 questions, 4 new tokens), greedy decodes in three orders, cached only ("C", as
`normlab eval` runs them), uncached only ("U") and alternating ("CU", as bench_decode times
them), then `evaluate` on every quick-grid cell as `normlab eval` calls it; median ms and
minor page faults per call. Processes alternate, ROUNDS of each:

    .venv/bin/python benchmarks/probes/malloc_decode.py [THREADS] [ROUNDS]
"""
import json
import os
import resource
import statistics as st
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import N5d1Decoder, probe_header
from bench_train_step import base_config

from normlab import allocator
from normlab.evaluate import evaluate
from normlab.tasks.addition import eval_sets

USAGE = "usage: malloc_decode.py [THREADS] [ROUNDS], each >= 1"


def child(threads: int) -> dict:
    """This process's medians: {order: {path: (ms, faults)}, "evaluate": (ms, faults)}."""
    applied = allocator.keep_freed_memory()
    torch.set_num_threads(threads)
    run = base_config()
    cell = N5d1Decoder(run)
    model, decode = cell.model, cell.decode
    task = run.validate()
    sets = eval_sets(task)

    def timed(fn) -> tuple[float, int]:
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t0), resource.getrusage(
            resource.RUSAGE_SELF).ru_minflt - f0

    out: dict = {"malloc": allocator.describe(), "applied": applied}
    for order in ("C", "U", "CU"):
        got: dict[str, list[tuple[float, int]]] = {}
        for i in range(12):
            for path in order:
                res = timed(lambda path=path: decode(path == "C"))
                if i >= 4:  # four warm-up passes of the order
                    got.setdefault(path, []).append(res)
        out[order] = {p: (st.median(t for t, _ in v), st.median(f for _, f in v))
                      for p, v in got.items()}
    evaluate(model, task, sets)
    ev = [timed(lambda: evaluate(model, task, sets)) for _ in range(5)]
    out["evaluate"] = (st.median(t for t, _ in ev), st.median(f for _, f in ev))
    return out


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--child"]:
        print(json.dumps(child(int(args[1]))))
        return
    if len(args) > 2 or not all(a.isdigit() and int(a) >= 1 for a in args):
        sys.exit(USAGE)
    threads = int(args[0]) if args else 1
    rounds = int(args[1]) if len(args) > 1 else 2
    torch.set_num_threads(threads)
    probe_header("malloc_decode.py", f"{rounds} process(es) a setting")
    results: dict[str, list[dict]] = {"keep": [], "default": []}
    for _ in range(rounds):
        for setting in results:
            env = {**os.environ, allocator.ENV: setting}
            proc = subprocess.run([sys.executable, __file__, "--child", str(threads)], env=env,
                                  capture_output=True, text=True, check=True)
            results[setting].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    for setting, runs in results.items():
        print(f"{setting}: {runs[0]['malloc']}; each process's median ms (minor page faults)")
        for order in ("C", "U", "CU"):
            for path in order:
                cells = ", ".join(f"{r[order][path][0]:.1f} ({r[order][path][1]:.0f})"
                                  for r in runs)
                name = "cached" if path == "C" else "uncached"
                print(f"  order {order:2s} {name:8s} decode: {cells}")
        print("  evaluate (quick grid): "
              + ", ".join(f"{r['evaluate'][0]:.0f} ({r['evaluate'][1]:.0f})" for r in runs))
        speedups = [r["CU"]["U"][0] / r["CU"]["C"][0] for r in runs]
        print("  order CU speed-up (uncached / cached): "
              + ", ".join(f"{s:.2f}" for s in speedups))


if __name__ == "__main__":
    main()
