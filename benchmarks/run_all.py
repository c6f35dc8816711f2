"""Run every benchmark (what `make bench` runs), write one JSON and print Markdown tables.

    python benchmarks/run_all.py [--quick] [--threads N] [--out FILE.json [--force]]
        [--only train_step,mfu,packing,decode,collapse,scaling,hooks] [--no-plot]

Its last table, Headlines, gives each of issue 6's targets (`targets.py`) beside the run's
median, its CI and the run's verdict; the JSON holds the same rows under `headlines`. Beside
the JSON it draws `<stem>_targets.png` and `<stem>_scaling.png` (`plot.py`), each only if a
benchmark it shows ran.

A benchmark that fails or cannot run (e.g. the collapse API is missing) is reported as such
and the others still run. Timings are side-by-side ratios within one process; nothing here is
a pass/fail test. See docs/performance.md for how to read the output.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_collapse
import bench_decode
import bench_hooks
import bench_mfu
import bench_packing
import bench_scaling
import bench_train_step
import plot
import targets
from common import (
    ROOT,
    add_common_args,
    add_precision_arg,
    load_note,
    md_table,
    rci,
    refuse_overwrite,
    rf,
    start,
    write_result,
)

ORDER = ("train_step", "mfu", "packing", "decode", "collapse", "scaling", "hooks")
MODULES: dict[str, Any] = {
    "train_step": bench_train_step, "mfu": bench_mfu, "packing": bench_packing,
    "decode": bench_decode,
    "collapse": bench_collapse, "scaling": bench_scaling, "hooks": bench_hooks,
}


def headline_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The few numbers worth quoting, from the individual results: each with its median, its
    CI's stats (MFU's from its step time's; an older result without one gives "(no CI)") and,
    where issue 6 sets one, its target and this run's verdict (`targets.py`)."""
    rows: list[tuple[str, float, dict[str, Any] | None, targets.Target | None]] = []
    for d, w in results.get("train_step", {}).get("widths", {}).items():
        # issue 6 compares eager steps; a --compile run's compiled ones are listed, not judged
        judged = [(f"normlab-{p}", *bench_train_step.eager_comparison(w, f"normlab-{p}"),
                   targets.STEP_RATIO) for p in bench_train_step.PLACEMENTS]
        listed = [(name, w["fastest_reference"], w["contenders"][name]["vs_fastest_ref"], None)
                  for p in bench_train_step.PLACEMENTS
                  if (name := f"normlab-{p}{bench_train_step.COMPILED}") in w["contenders"]]
        for name, ref, st, target in judged + listed:
            if st is not None:
                rows.append((f"train step d{d}: {name} / {ref} (time)", st["median"], st, target))
        rows.append((f"train step d{d}: qkv / pre (time)", w["qkv_over_pre"]["median"],
                     w["qkv_over_pre"], targets.QKV_OVER_PRE))
    mfu = results.get("mfu", {})
    setup = {"threads": mfu.get("info", {}).get("threads"),
             "device": mfu.get("info", {}).get("device"), "precision": mfu.get("precision")}
    for d, w in mfu.get("widths", {}).items():
        for name in ("normlab-pre", "normlab-qkv"):
            if name in w["contenders"]:  # the target is the default config's: pre, its width,
                default = (name, d, setup) == (  # one thread, CPU, float32
                    "normlab-pre", targets.DEFAULT_WIDTH, targets.DEFAULT_CONFIG)
                c = w["contenders"][name]  # its CI from the step time's ({}: none recorded)
                ci = ({"ci": [100 * x for x in c["mfu_ci"]], "ci_coverage": c["ci_coverage"]}
                      if "mfu_ci" in c else {})
                rows.append((f"MFU d{d} {name} (%)", 100 * c["mfu"], ci,
                             targets.MFU_PCT if default else None))
    for r in results.get("packing", {}).get("results", []):
        rows.append((f"packing {r['grid']} grid: padded / packed step (time)",
                     r["speedup"]["median"], r["speedup"], None))
    for r in results.get("decode", {}).get("results", []):
        rows.append((f"decode {r['placement']} {r['cell']}: uncached / cached (time)",
                     r["speedup"]["median"], r["speedup"], targets.DECODE))
    col = results.get("collapse", {})
    if "speedup_sweep" in col:
        rows.append(("collapse sweep: naive / vectorised sweep (time)",
                     col["speedup_sweep"]["median"], col["speedup_sweep"], targets.SWEEP))
        rows.append(("collapse sweep: naive / whole measure_collapse (time)",
                     col["speedup_call"]["median"], col["speedup_call"], None))
    for r in results.get("hooks", {}).get("results", []):
        rows.append((f"hooks {r['placement']} batch {r['batch']}: with / bypassed (time)",
                     r["ratio"]["median"], r["ratio"], targets.HOOKS))
        if "hook_calls" in r:  # the points' whole cost, which the ratio cannot see (older
            # results scaled it by every registered point, 1.5-1.9x too many: not shown)
            rows.append((f"hooks {r['placement']} batch {r['batch']}: unused points' cost, "
                         "predicted (% of a forward)", r["predicted_overhead_pct"], None, None))
    return [{"quantity": q, "median": v,
             **({k: st[k] for k in ("ci", "ci_coverage")} if st and "ci" in st else {}),
             "target": None if t is None else str(t),
             **({} if t is None else {"bound": t.bound, "sense": t.sense}),
             "verdict": None if t is None else t.verdict(v, st)} for q, v, st, t in rows]


def _percent(v: float) -> str:
    """A percentage to one decimal, or to two significant digits below 1 (the unused hook
    points' predicted cost, 0.02%, read "0.0"); 0.999 rounds to "1.0", where two digits gave
    "1"."""
    short = f"{v:.2g}"
    return short if math.isfinite(v) and abs(float(short)) < 1 else f"{v:.1f}"


def headlines(rows: list[dict[str, Any]], quick: bool = False) -> str:
    """`headline_rows` as a Markdown table."""
    table = [[r["quantity"], _percent(r["median"]) if "%" in r["quantity"] else rf(r["median"]),
              rci(r), r["target"] or "", r["verdict"] or ""] for r in rows]
    note = ("`--quick`: smaller sizes and fewer repeats than the targets are measured at; "
            "its verdicts are not the targets'.\n\n" if quick else "")
    return ("### Headlines\n\n" + note + md_table(
        ["quantity", "value (median)", "CI of the median", "target (issue 6)", "this run"],
        table) if table else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(parser)  # --quick, --threads, --repeats: the same flags as each benchmark
    parser.add_argument("--out", type=Path, default=None,
                        help="result JSON (default: runs/bench/results-<UTC time>.json, a new "
                             "file each run; an existing file needs --force)")
    parser.add_argument("--only", default=",".join(ORDER), help="comma-separated subset")
    parser.add_argument("--run", default=None, help="trained decoder run for bench_collapse")
    parser.add_argument("--compile", action="store_true",
                        help="train_step also times every contender under torch.compile")
    add_precision_arg(parser)  # the train-step and MFU steps (packing's stay float32)
    parser.add_argument("--no-plot", action="store_true",
                        help="skip the figures (<out stem>_targets.png, _scaling.png; each "
                             "is drawn only if a benchmark it shows ran)")
    args = parser.parse_args(argv)
    if args.out is None:  # a new file per run: `make bench` never replaces a cited result
        stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")
        args.out = ROOT / "runs" / "bench" / f"results-{stamp}.json"
    refuse_overwrite(parser, args.out, args.force)
    chosen = [n.strip() for n in args.only.split(",") if n.strip()]
    if not chosen:  # ran nothing and wrote an empty result, exit 0
        parser.error(f"--only: expected a comma-separated subset of {', '.join(ORDER)}; got "
                     f"{args.only!r}")
    for name in chosen:
        if name not in MODULES:
            parser.error(f"--only: unknown benchmark {name!r}; expected {', '.join(ORDER)}")
    # every figure this name could have, drawn this time or not: no earlier run's figure is
    # left beside a new JSON unless --force
    figures = {} if args.no_plot else plot.outputs(args.out.parent, args.out.stem, ["png"])
    for fig_path in figures:
        refuse_overwrite(parser, fig_path, args.force)
    bench_args = argparse.Namespace(quick=args.quick, threads=args.threads, repeats=args.repeats,
                                    widths=None, run=args.run, out=None,
                                    compile=args.compile, device=args.device,
                                    precision=args.precision)
    try:  # NORMLAB_MALLOC or --device cuda without CUDA: one line, as each bench_*.py says it
        _, info = start(bench_args)
    except ValueError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    t_start = time.perf_counter()
    results: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    todo = [name for name in ORDER if name in chosen]
    for i, name in enumerate(todo, 1):
        mod = MODULES[name]
        t0 = time.perf_counter()
        # a line, not a live bar: a bar's refresh thread would take CPU from the timings
        print(f"[bench] {i}/{len(todo)} {name} ({t0 - t_start:.0f} s so far) ...",
              file=sys.stderr, flush=True)
        try:
            run: Callable[..., dict[str, Any]] = mod.run
            if name == "mfu" and "train_step" in results and "error" not in results["train_step"]:
                res = run(bench_args, train_step=results["train_step"])
            else:
                res = run(bench_args)
            text = mod.to_markdown(res)
        except Exception as err:  # report and go on with the other benchmarks
            res = {"benchmark": name, "error": f"{type(err).__name__}: {err}",
                   "traceback": traceback.format_exc()}
            text = f"### {name}\n\nFAILED: {res['error']}"
        seconds[name] = time.perf_counter() - t0
        results[name] = res
        print(text + "\n", flush=True)
    try:  # the results are in hand: a headline that cannot be read must not lose them
        heads = headline_rows(results)
    except (KeyError, TypeError, ValueError) as err:
        heads = []
        print(f"headlines FAILED ({type(err).__name__}: {err}); every result is in the JSON",
              file=sys.stderr)
    if heads:
        print(headlines(heads, args.quick) + "\n")
    note = load_note(info)
    doc = {
        "command": " ".join(["python", "benchmarks/run_all.py", *(argv or sys.argv[1:])]),
        "quick": args.quick, "info": info, "load_note": note, "seconds": seconds,
        "total_seconds": time.perf_counter() - t_start, "results": results,
        "headlines": heads,
    }
    write_result(args.out, doc, argv)
    print(f"total {doc['total_seconds']:.0f} s; wrote {args.out}" + (f"; {note}" if note else ""))
    drawn = plot.filled(results) if figures else []
    stale = [str(p) for p, name in figures.items() if name not in drawn and p.exists()]
    if stale:  # --force: kept, not deleted, and said
        print(f"kept from an earlier run (this run draws no such figure): {', '.join(stale)}",
              file=sys.stderr)
    if drawn:
        try:  # the JSON is written: a figure that fails must not lose it
            written = plot.write_figures([args.out], args.out.parent, args.out.stem,
                                         force=args.force, figures=drawn)
            print("figures: " + ", ".join(str(f) for f in written))
        except Exception as err:
            print(f"figures FAILED ({type(err).__name__}: {err}); the JSON above is complete; "
                  f"retry with: python benchmarks/plot.py {args.out} --out DIR", file=sys.stderr)
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
