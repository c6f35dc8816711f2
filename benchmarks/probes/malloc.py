"""One-off probe behind a thirteenth-session note in docs/performance.md; not part of make bench.

Does telling glibc's malloc to keep freed memory (`mallopt`: trim threshold 1 GiB, mmap
threshold 32 MiB, so multi-MB activations are reused instead of handed back to the kernel and
faulted in again) speed normlab up? Tried in `76be745` as a CLI-wide setting and dropped:

    .venv/bin/python benchmarks/probes/malloc.py on|off faults
        minor page faults per step of three 8 MiB tensors written and freed
    .venv/bin/python benchmarks/probes/malloc.py on|off analyze [THREADS]
        `measure_collapse` as `normlab analyze` runs it (default sigmas and draws, 256
        examples) on the bench_collapse model, three calls
    .venv/bin/python benchmarks/probes/malloc.py on|off BENCH [its arguments]
        a benchmark module (bench_collapse, ...) or a probe run on import (collapse_prof)
"""
import ctypes
import importlib
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if len(sys.argv) < 3 or sys.argv[1] not in ("on", "off"):
    sys.exit("usage: malloc.py on|off faults | analyze [THREADS] | BENCH [its arguments]")
if sys.argv[1] == "on":
    mallopt = ctypes.CDLL(None).mallopt
    ok = mallopt(-1, 1 << 30) and mallopt(-3, 32 << 20)  # M_TRIM_THRESHOLD, M_MMAP_THRESHOLD
    print(f"mallopt applied: {bool(ok)}")
what = sys.argv[2]
if what == "faults":
    torch.set_num_threads(1)

    def step() -> None:
        xs = [torch.empty(2 << 20).fill_(1.0) for _ in range(3)]
        del xs

    for _ in range(3):
        step()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        step()
    print(f"faults per step {(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 10}")
elif what == "analyze":
    torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    from bench_collapse import eval_data, random_model
    from normlab.analysis.collapse import measure_collapse

    run, model = random_model()
    model.eval()
    data = eval_data(run, 256)
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        res = measure_collapse(model, data)
        ts.append(time.perf_counter() - t0)
    print(f"call s {[round(t, 3) for t in ts]}; last sweep s {res['sweep_seconds']:.3f}; "
          f"rows {res['n_sparse_rows']}")
else:
    sys.argv = [f"{what}.py", *sys.argv[3:]]
    module = importlib.import_module(what)
    if hasattr(module, "main"):
        module.main()
