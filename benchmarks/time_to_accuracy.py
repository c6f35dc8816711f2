"""Time to accuracy: the first logged step where a run's train accuracy reaches a threshold.

Reads `metrics.jsonl` of each run folder (records with `step`, `elapsed_s` and, at evaluation
steps, `accuracy.{split}`) and prints, per run, the first evaluation at which
`accuracy[split] >= threshold`, then the median over runs of each placement (read from the
run's `config.toml`, `model.norm_placement`). `elapsed_s` is the training loop's wall time: it
excludes the periodic evaluations, and the checkpoint writes in runs trained at the thirty-ninth
session's code or later (earlier runs include them, each with its two git calls). The resolution is
`train.eval_every` steps; each run's versions and git commit come from its newest checkpoint
sidecar. Runs that never reach the threshold are listed and left out of the
medians (the table says how many reached it).

    python benchmarks/time_to_accuracy.py RUN_DIR [RUN_DIR ...] [--threshold 0.99]
        [--split train] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tomllib
from pathlib import Path
from typing import Any

from common import refuse_overwrite, write_result
from normlab.io import read_metrics


def placement_of(run_dir: Path) -> str:
    cfg = run_dir / "config.toml"
    if cfg.is_file():
        try:
            return str(tomllib.loads(cfg.read_text())["model"]["norm_placement"])
        except (KeyError, tomllib.TOMLDecodeError):
            pass
    return "?"


def provenance_of(run_dir: Path) -> dict[str, Any] | None:
    """Versions, git commit and machine from the newest checkpoint's sidecar, if any."""
    sidecars = sorted((run_dir / "checkpoints").glob("step_*.json"))
    if not sidecars:
        return None
    try:
        return json.loads(sidecars[-1].read_text()).get("provenance")
    except (OSError, json.JSONDecodeError):
        return None


def first_reach(run_dir: Path, threshold: float, split: str) -> dict[str, Any]:
    out: dict[str, Any] = {"run": str(run_dir), "placement": placement_of(run_dir),
                           "reached": False, "step": None, "elapsed_s": None,
                           "provenance": provenance_of(run_dir)}
    try:
        records = read_metrics(run_dir)
    except (FileNotFoundError, ValueError) as err:
        return out | {"error": str(err)}
    out["splits"] = sorted({s for rec in records for s in rec.get("accuracy", {})})
    for rec in records:
        acc = rec.get("accuracy", {}).get(split)
        if acc is not None and acc >= threshold:
            return out | {"reached": True, "step": rec["step"], "elapsed_s": rec.get("elapsed_s"),
                          "accuracy": acc}
    last = records[-1] if records else {}
    return out | {"last_step": last.get("step"), "last_elapsed_s": last.get("elapsed_s")}


def summarise(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault(r["placement"], []).append(r)
    out = {}
    for name, rs in groups.items():
        hit = [r for r in rs if r["reached"]]
        secs = [r["elapsed_s"] for r in hit if r["elapsed_s"] is not None]
        out[name] = {
            "runs": len(rs), "reached": len(hit),
            "median_step": statistics.median([r["step"] for r in hit]) if hit else None,
            "median_elapsed_s": statistics.median(secs) if secs else None,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders")
    parser.add_argument("--threshold", type=float, default=0.99)
    parser.add_argument("--split", default="train")
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --json")
    args = parser.parse_args(argv)
    refuse_overwrite(parser, args.json, args.force, flag="--json")
    # each was read as a run that never reached it (exit 0): -1 as reached at once
    if not 0 < args.threshold <= 1:
        parser.error(f"--threshold: expected an accuracy in (0, 1]; got {args.threshold}")
    for run in args.runs:
        if not run.is_dir():
            what = "is a file" if run.exists() else "does not exist"
            parser.error(f"{str(run)!r}: expected a run folder; it {what}")
    rows = [first_reach(r, args.threshold, args.split) for r in args.runs]
    logged = {s for r in rows for s in r.get("splits", ())}
    if logged and args.split not in logged:
        parser.error(f"--split: no run logged {args.split!r} (logged: {', '.join(sorted(logged))})")
    groups = summarise(rows)
    print(f"first evaluation with accuracy.{args.split} >= {args.threshold}\n")
    print("| run | placement | step | elapsed s |\n|---|---|---|---|")
    for r in rows:
        if r["reached"]:
            secs = "—" if r["elapsed_s"] is None else f"{r['elapsed_s']:.1f}"  # an older log's
            print(f"| {r['run']} | {r['placement']} | {r['step']} | {secs} |")
        else:
            note = r.get("error") or f"not reached (last step {r.get('last_step')})"
            print(f"| {r['run']} | {r['placement']} | {note} | — |")
    print("\n| placement | reached / runs | median step | median elapsed s |\n|---|---|---|---|")
    for name, g in groups.items():
        sec = "—" if g["median_elapsed_s"] is None else f"{g['median_elapsed_s']:.1f}"
        step = "—" if g["median_step"] is None else f"{g['median_step']:g}"
        print(f"| {name} | {g['reached']} / {g['runs']} | {step} | {sec} |")
    if args.json:
        write_result(args.json, {"threshold": args.threshold, "split": args.split,
                                 "runs": rows, "by_placement": groups}, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
