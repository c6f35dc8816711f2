"""Are the twenty-fifth session's time-to-accuracy runs the twenty-third's, step for step?

Compares each run's metrics (`tta_metrics/`, copied from the runs' `metrics.jsonl`) with the
twenty-third session's (`../session23/tta_metrics/alone_*.jsonl`): the logged steps,
losses, learning rates and accuracies must be equal, bit for bit; the times need not be.

    .venv/bin/python benchmarks/results/session25/tta_same_as_session23.py
"""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
OLD = HERE.parent / "session23" / "tta_metrics"
KEYS = ("step", "loss", "lr", "accuracy")


def lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


for placement in ("pre", "qkv"):
    for seed in (0, 1, 2):
        old = lines(OLD / f"alone_{placement}-s{seed}.jsonl")
        new = lines(HERE / "tta_metrics" / f"{placement}-s{seed}.jsonl")
        same = len(old) == len(new) and all(
            o.get(k) == n.get(k) for o, n in zip(old, new, strict=True) for k in KEYS)
        print(f"{placement} seed {seed}: {len(new)} log lines, last step {new[-1]['step']}, "
              f"{new[-1]['elapsed_s']:.1f} s (twenty-third session {old[-1]['elapsed_s']:.1f} s); "
              f"steps, losses, learning rates and accuracies identical: {same}")
