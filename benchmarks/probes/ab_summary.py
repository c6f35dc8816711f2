"""Summarise a folder of before/after runs in alternating processes (thirteenth session).

Files are `{train,collapse,decode}_{RULE}_{T}t_{round}.json`. Per thread count and rule, each
run's training-step medians (ms) and ratios to nanoGPT at d64, the collapse sweep and naive
loop and their ratio, and the decoding speed-ups; then the median over runs:

    .venv/bin/python benchmarks/probes/ab_summary.py DIR BEFORE AFTER
    e.g. DIR = benchmarks/results/session13_ab, BEFORE AFTER = textbook fast (RoPE), or
    DIR = benchmarks/results/session13_malloc, BEFORE AFTER = default tuned (the allocator)
"""
import json
import statistics as st
import sys
from pathlib import Path

if len(sys.argv) != 4:
    sys.exit("usage: ab_summary.py DIR BEFORE AFTER, e.g. benchmarks/results/session13_ab "
             "textbook fast")
root, rules = Path(sys.argv[1]), sys.argv[2:]
if not root.is_dir():
    sys.exit(f"{root}: expected the folder of the A/B runs")


def runs(kind: str, rule: str, t: int) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(root.glob(f"{kind}_{rule}_{t}t_*.json"))]


def fmt(xs: list[float], spec: str) -> str:
    return f"{', '.join(format(x, spec) for x in xs)} (median {format(st.median(xs), spec)})"


for t in (1, 2):
    for rule in rules:
        train, col, dec = runs("train", rule, t), runs("collapse", rule, t), runs("decode", rule, t)
        every = train or col or dec  # a folder may hold only some of the three
        if not every:
            continue
        commits = ", ".join(dict.fromkeys(r["info"]["git"][:7] for r in every))
        print(f"== {t} thread(s), {rule}, {len(every)} runs, git {commits}")
        for name in train[0]["widths"]["64"]["contenders"] if train else []:
            cs = [r["widths"]["64"]["contenders"][name] for r in train]
            ms = [1e3 * c["median_s"] for c in cs]
            line = f"  train d64 {name:15s} ms {fmt(ms, '.1f')}"
            if "vs_nanogpt" in cs[0] and name != "nanogpt":
                line += f"; /nanoGPT {fmt([c['vs_nanogpt']['median'] for c in cs], '.3f')}"
            print(line)
        if train:
            qkv_pre = [r["widths"]["64"]["qkv_over_pre"]["median"] for r in train]
            print(f"  train d64 qkv/pre {fmt(qkv_pre, '.3f')}")
        if col:
            sweep = [1e3 * c["vectorised_sweep"]["median_s"] for c in col]
            print(f"  collapse sweep ms {fmt(sweep, '.1f')}; "
                  f"naive s {fmt([c['naive']['median_s'] for c in col], '.3f')}; naive/sweep "
                  f"{fmt([c['speedup_sweep']['median'] for c in col], '.2f')}; flips "
                  f"{sorted({c['flips_total']['vectorised'] for c in col})}")
        for i, cell in enumerate(dec[0]["results"] if dec else []):
            rs = [d["results"][i] for d in dec]
            print(f"  decode {cell['placement']} {cell['cell']}: cached ms "
                  f"{fmt([1e3 * r['cached']['median_s'] for r in rs], '.1f')}; uncached ms "
                  f"{fmt([1e3 * r['uncached']['median_s'] for r in rs], '.1f')}; speed-up "
                  f"{fmt([r['speedup']['median'] for r in rs], '.2f')}; same tokens "
                  f"{all(r['identical_outputs'] for r in rs)}")
