"""Print what the twenty-second session's analysis fixes change on the same trained models:
for each run, `reanalyze.py`'s results with the code before (c76dee5) and after, side by side.

    python docs/results/quick_rerun_42a65f4/compare.py docs/results/quick_rerun_42a65f4/reanalyze
"""
import json
import sys
from pathlib import Path

root = Path(sys.argv[1]) if len(sys.argv) == 2 else sys.exit("usage: compare.py DIR")


def load(code: str, run: str, what: str) -> dict:
    return json.loads((root / code / run / f"{what}.json").read_text())


for run in sorted(p.name for p in (root / "after").iterdir()):
    b, a = load("before", run, "collapse"), load("after", run, "collapse")
    sig = a["sigmas"]
    same = b["collapse_rate"] == a["collapse_rate"] and b["n_sparse_rows"] == a["n_sparse_rows"]
    print(f"{run}: {a['n_sparse_rows']} sparse rows; measured collapse identical before and "
          f"after: {same}")
    for s in (0.1, 0.2, 0.3):
        i = sig.index(s)
        print(f"  sigma {s}: measured {100 * a['collapse_rate'][i]:.3f}%; predicted "
              f"{100 * b['predicted_rate'][i]:.3f}% +- {100 * b['predicted_rate_se'][i]:.4f} "
              f"before, {100 * a['predicted_rate'][i]:.3f}% +- "
              f"{100 * a['predicted_rate_se'][i]:.4f} after")
    pb = load("before", run, "interference")["probe"]
    pa = load("after", run, "interference")["probe"]
    print(f"  interference TV mean {pb['tv_mean']:.4g} -> {pa['tv_mean']:.4g}, max "
          f"{pb['tv_max']:.4g} -> {pa['tv_max']:.4g}; rows a head averages over "
          f"{pb['per_head'][0]['n_rows']} -> {pa['per_head'][0]['n_rows']}")
