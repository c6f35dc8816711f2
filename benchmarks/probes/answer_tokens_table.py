"""Markdown table of teacher-forced answer-token accuracy per cell from a run's eval.json.

`normlab eval RUN_DIR` writes `answer_tokens` (see `normlab.evaluate.answer_token_accuracy`);
this prints it for docs/results.md:

    .venv/bin/python benchmarks/probes/answer_tokens_table.py RUN_DIR [--split train]
"""
import argparse
import json
from pathlib import Path

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("run_dir", type=Path)
p.add_argument("--split", default="train")
args = p.parse_args()
ev = json.loads((args.run_dir / "eval.json").read_text())
exact = {(c["cell"], c["split"]): c["accuracy"] for c in ev["cells"]}
rows = [t for t in ev["answer_tokens"] if t["split"] == args.split]
width = max(len(t["by_position"]) for t in rows)
print(f"step {ev['checkpoint']['step']}, {rows[0]['count']} questions per cell\n")
print("| cell | greedy exact | teacher-forced exact | first token (neg / pos) | "
      + " | ".join(f"pos {j}" for j in range(width)) + " |")
print("|---" * (4 + width) + "|")
for t in rows:
    ft = t["first_token"]
    fmt = [f"{100 * a:.0f}" for a in t["by_position"]] + [""] * (width - len(t["by_position"]))
    print(f"| {t['cell']} | {100 * exact[(t['cell'], t['split'])]:.1f}% | {100 * t['exact']:.1f}% | "
          f"{100 * ft['negative']:.0f} / {100 * ft['positive']:.0f} | " + " | ".join(fmt) + " |")
