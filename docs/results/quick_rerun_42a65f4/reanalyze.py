"""Analyse finished run folders again, with whichever normlab is on PYTHONPATH, into OUT/RUN:
the same settings each run's recorded `analysis/collapse.json` holds (`params`), no figures.

    PYTHONPATH=SRC .venv/bin/python docs/results/quick_rerun_42a65f4/reanalyze.py OUT RUN_DIR...

The twenty-second session ran it twice on this session's quick runs, once with the code
before the session (c76dee5) and once after (see README.md here): the same trained models,
so what moves is what the analysis code changed.
"""
import json
import sys
from pathlib import Path

import torch

from normlab.analysis.report import analyze_run

if len(sys.argv) < 3:
    sys.exit("usage: reanalyze.py OUT RUN_DIR...")
torch.set_num_threads(1)
out_root = Path(sys.argv[1])
for run in map(Path, sys.argv[2:]):
    params = json.loads((run / "analysis" / "collapse.json").read_text())["params"]
    for derived in ("n_examples_used", "per_cell"):
        params.pop(derived, None)
    analyze_run(run, out_root / run.name, figures=False, **params)
    print(f"{run.name}: {out_root / run.name}", flush=True)
