"""Summarise the twelfth session's softmax-padding A/B runs (`benchmarks/results/session12_ab/`).

Prints, per thread count and rule (KEYS = 0: no padding; 16: the current rule), each run's
sweep and naive-loop medians and their ratio, and the decoding cells' cached and uncached
times and speed-ups:

    .venv/bin/python benchmarks/probes/softmax_pad_summary.py [DIR]
"""
import json
import statistics as st
import sys
from pathlib import Path

root = Path(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/session12_ab")
for t in (1, 2):
    for k in (0, 16):
        col = [json.loads(p.read_text()) for p in sorted(root.glob(f"collapse_k{k}_{t}t_*.json"))]
        dec = [json.loads(p.read_text()) for p in sorted(root.glob(f"decode_k{k}_{t}t_*.json"))]
        if not col:
            continue
        sweep = [c["vectorised_sweep"]["median_s"] * 1e3 for c in col]
        naive = [c["naive"]["median_s"] for c in col]
        ratio = [c["speedup_sweep"]["median"] for c in col]
        print(f"{t} thread(s), KEYS {k:2d}, {len(col)} runs, git {col[0]['info']['git'][:7]}: "
              f"sweep ms {', '.join(f'{x:.1f}' for x in sweep)}; naive s "
              f"{', '.join(f'{x:.3f}' for x in naive)}; naive/sweep "
              f"{', '.join(f'{x:.2f}' for x in ratio)} (median {st.median(ratio):.2f}); flips "
              f"{sorted({c['flips_total']['vectorised'] for c in col})}")
        for i, cell in enumerate(dec[0]["results"] if dec else []):
            rs = [d["results"][i] for d in dec]
            name = f"{cell['placement']} {cell['cell']}"
            cached = [1e3 * r["cached"]["median_s"] for r in rs]
            uncached = [1e3 * r["uncached"]["median_s"] for r in rs]
            sp = [r["speedup"]["median"] for r in rs]
            print(f"    decode {name}: cached ms {', '.join(f'{x:.1f}' for x in cached)}; "
                  f"uncached ms {', '.join(f'{x:.1f}' for x in uncached)}; speed-up "
                  f"{', '.join(f'{x:.2f}' for x in sp)}; same tokens "
                  f"{all(r['identical_outputs'] for r in rs)}")
