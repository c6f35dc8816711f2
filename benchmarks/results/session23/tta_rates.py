"""ms a training step of each time-to-accuracy run, before and after step 3500 (where pre-s2
stopped early, leaving qkv-s2 to train alone in the paired runs), from the runs' metrics.jsonl
copied into tta_metrics/:

    .venv/bin/python benchmarks/results/session23/tta_rates.py
"""
import json
from pathlib import Path

here = Path(__file__).parent / "tta_metrics"
for path in sorted(here.glob("*.jsonl")):
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    at = {r["step"]: r["elapsed_s"] for r in recs if "elapsed_s" in r}
    last = max(at)
    before = 1e3 * at[3500] / 3500 if 3500 in at else None
    after = 1e3 * (at[last] - at[3500]) / (last - 3500) if 3500 in at and last > 3500 else None
    fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    print(f"{path.stem:16s} last step {last}: ms a step to 3500 {fmt(before)}, "
          f"after {fmt(after)}")
