"""Does a training step make the host wait for the GPU? A check for benchmarks/gpu/run.sh.

A read of a tensor's value on the host (`bool`, `int`, `.item()`), or a blocking copy to the
device, makes the host wait for all the work queued before it; normlab's training loop reads
only at its log, evaluation and checkpoint steps (docs/performance.md, twenty-fifth section;
tested on the CPU by counting reads, `tests/test_train.py`). Here CUDA's own count:
`torch.cuda.set_sync_debug_mode("warn")` warns at every synchronising call PyTorch makes
(not at waits inside the CUDA driver), and two runs of the default `pre` recipe, of 10 and
of 20 steps, each logging, evaluating and checkpointing only at its last step, should warn
equally often outside evaluation (whose decoding reads what the model writes). Run for the
recipe (RoPE) and with learned positions (`PosEmbed`'s bound). An encoder-decoder still
reads one value a step (its source-mask check) and is not run. One line per variant; exit
status 1 if any pair differs.

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


VARIANTS = {"recipe": [], "learned positions": ["model.pos_encoding='learned'"]}


def synchronising_calls(steps: int, device: str, scratch: Path, extra: list[str]) -> int:
    """PyTorch's synchronisation warnings in a `steps`-step run of the `pre` recipe with the
    `extra` overrides, evaluation's left out."""
    every = [f"train.{k}={steps}" for k in ("log_every", "eval_every", "checkpoint_every")]
    cfg = load_config(ROOT / "configs/addition/pre.toml",
                      [f"train.steps={steps}", f"train.device='{device}'", "train.eval_examples=8",
                       *every, *extra])
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
                out = scratch / f"{len(list(scratch.iterdir()))}-steps{steps}"
                tr.train(cfg, out, progress=False, log=lambda s: None)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        tr.evaluate = evaluate
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (skips)")
    args = p.parse_args()
    if torch.device(args.device).type != "cuda" or not torch.cuda.is_available():
        print("sync_check: skipped (CUDA's sync debug mode needs a GPU)")
        return 0
    ok = True
    with tempfile.TemporaryDirectory() as d:
        for name, extra in VARIANTS.items():
            n10, n20 = (synchronising_calls(s, args.device, Path(d), extra) for s in (10, 20))
            ok &= n10 == n20
            print(f"sync_check ({name}): synchronising calls outside evaluation, 10 steps {n10}, "
                  f"20 steps {n20}: "
                  + ("none per step" if n10 == n20 else f"{(n20 - n10) / 10:g} per step"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
