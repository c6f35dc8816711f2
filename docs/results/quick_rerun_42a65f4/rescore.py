"""Score the rerun's checkpoints again with the code on PYTHONPATH and compare with the
accuracies their eval.json holds, per split and per cell:

    PYTHONPATH=SRC .venv/bin/python docs/results/quick_rerun_42a65f4/rescore.py RUNS

The twenty-second session ran it with the `lsd` reader made strict (a sign-last `63N` had
read as N36 and counted as right): `rescore.txt`, no cell differs.
"""
import json
import sys
from pathlib import Path

import torch

from normlab.evaluate import evaluate
from normlab.tasks.addition import eval_sets
from normlab.train import load_run

torch.set_num_threads(1)
if len(sys.argv) != 2:
    sys.exit("usage: rescore.py RUNS (the folder of the rerun's run folders)")
for run in sorted(Path(sys.argv[1]).iterdir()):
    if not run.is_dir():
        continue
    cfg, model, meta = load_run(run)
    task = cfg.task.resolve()
    res = evaluate(model, task, eval_sets(task))
    old = json.loads((run / "eval.json").read_text())
    diffs = [(c["cell"], c["split"], o["accuracy"], c["accuracy"])
             for c, o in zip(res["cells"], old["cells"], strict=True)
             if c["accuracy"] != o["accuracy"]]
    splits = {s: (old["splits"][s]["accuracy"], r["accuracy"]) for s, r in res["splits"].items()}
    print(run.name, task.answer_format, "split (eval.json, now):", splits,
          "cells that differ:", diffs)
