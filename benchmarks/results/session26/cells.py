"""The top table's cells from one session's result files (docs/performance.md, twenty-sixth
section): training step (15 repeats), MFU (the full run's, and the 15-repeat run's pre step
over the full run's peak), decoding, collapse sweep (9 repeats and full), hooks.

    .venv/bin/python benchmarks/results/session26/cells.py benchmarks/results/session26[/before]
"""
import json
import sys
from pathlib import Path


def ci(s: dict, f: str = "{:.3f}") -> str:
    return f"{f.format(s['median'])} [{f.format(s['ci'][0])}, {f.format(s['ci'][1])}]"


def main(folder: Path) -> None:
    for t in (1, 2):
        full = json.loads((folder / f"full_{t}t.json").read_text())["results"]
        step = json.loads((folder / f"train_step_{t}t_r15.json").read_text())["widths"]["64"]
        sweep = json.loads((folder / f"collapse_{t}t_r9.json").read_text())
        print(f"== {t} thread(s)")
        c = step["contenders"]
        print("train step / fastest reference (" + step["fastest_reference"] + "), 15 repeats:",
              "; ".join(f"{p} {ci(c['normlab-' + p]['vs_fastest_ref'])}"
                        for p in ("none", "post", "pre", "qk", "qkv")))
        print("  nanogpt-manual / nanogpt:",
              f"{c['nanogpt-manual']['median_s'] / c['nanogpt']['median_s']:.3f}",
              " ms:", {k: round(v["median_s"] * 1e3, 1) for k, v in c.items()})
        print("qkv / pre:", ci(step["qkv_over_pre"]))
        mfu = full["mfu"]
        peak = mfu["peak"]["flops_per_s"]
        w = mfu["widths"]["64"]
        print(f"MFU d64 (full run): peak {peak / 1e9:.1f} GFLOP/s;",
              "; ".join(f"{k} {100 * w['contenders']['normlab-' + k]['mfu']:.1f}%"
                        for k in ("pre", "qkv")),
              "; from the 15-repeat step: " + ", ".join(
                  f"{k} {100 * w['flops'] / c['normlab-' + k]['median_s'] / peak:.1f}%"
                  for k in ("pre", "qkv")))
        for r in full["decode"]["results"]:
            print(f"decode {r['placement']} {r['cell']}: {ci(r['speedup'], '{:.2f}')}"
                  f" (cached {1e3 * r['cached']['median_s']:.1f} ms, uncached "
                  f"{1e3 * r['uncached']['median_s']:.1f} ms)")
        print("collapse 9 repeats:", ci(sweep["speedup_sweep"], "{:.2f}"), "; loop to the logits",
              ci(sweep["speedup_sweep_full_forward"], "{:.2f}"),
              f"; naive {sweep['naive']['median_s']:.3f} s, sweep "
              f"{sweep['vectorised_sweep']['median_s']:.4f} s")
        fc = full["collapse"]
        print("collapse full run:", ci(fc["speedup_sweep"], "{:.2f}"))
        h = full["hooks"]
        print("hooks:", "; ".join(f"{r['placement']} b{r['batch']} {ci(r['ratio'])}"
                                  for r in h["results"]),
              f"; {h['call_cost']['extra_ns_per_call']:.0f} ns a point")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
