"""Does a training step make the host wait for the GPU? A check for benchmarks/gpu/run.sh.

A read of a tensor's value on the host (`bool`, `int`, `.item()`), or a blocking copy to the
device, makes the host wait for all the work queued before it; normlab's training loop reads
only at its log, evaluation and checkpoint steps (docs/performance.md, twenty-fifth section;
tested on the CPU by counting reads, `tests/test_train.py`). Here CUDA's own count:
`torch.cuda.set_sync_debug_mode("warn")` warns at every synchronising call, and two runs of
the default `pre` recipe, of 10 and of 20 steps, each logging, evaluating and checkpointing
only at its last step, should warn equally often outside evaluation (whose decoding reads
what the model writes). Prints one line; exit status 1 if the runs differ.

    python benchmarks/gpu/sync_check.py [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

import torch

import normlab.train as tr
from normlab.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def synchronising_calls(steps: int, device: str, scratch: Path) -> int:
    """CUDA's synchronisation warnings in a `steps`-step run, evaluation's left out."""
    every = [f"train.{k}={steps}" for k in ("log_every", "eval_every", "checkpoint_every")]
    cfg = load_config(ROOT / "configs/addition/pre.toml",
                      [f"train.steps={steps}", f"train.device='{device}'", "train.eval_examples=8",
                       *every])
    counting = {"on": True}
    evaluate = tr.evaluate

    def quiet_evaluate(*args, **kwargs):  # evaluation's reads are not the step's
        counting["on"] = False
        try:
            return evaluate(*args, **kwargs)
        finally:
            counting["on"] = True

    n = 0

    def count(message, category, *args, **kwargs) -> None:
        nonlocal n
        n += counting["on"] and "synchroniz" in str(message)

    tr.evaluate = quiet_evaluate
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = count
            torch.cuda.set_sync_debug_mode("warn")
            try:
                tr.train(cfg, scratch / f"steps{steps}", progress=False, log=lambda s: None)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        tr.evaluate = evaluate
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = p.parse_args()
    if args.device != "cuda" or not torch.cuda.is_available():
        print("sync_check: skipped (CUDA's sync debug mode needs a GPU)")
        return 0
    with tempfile.TemporaryDirectory() as d:
        n10, n20 = (synchronising_calls(s, args.device, Path(d)) for s in (10, 20))
    same = n10 == n20
    print(f"sync_check: synchronising calls outside evaluation, 10 steps {n10}, 20 steps {n20}: "
          + ("none per step" if same else f"{(n20 - n10) / 10:g} per step"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
