"""Time and peak memory of a training step and of the collapse sweep as T, d and B double.

Configurations: a base (seq len 24, d_model 64, batch 128 for training / 64 examples for the
sweep; 4 layers, 4 heads, d_mlp = 4 d) and each of seq len, width and batch doubled (x2, and
x4 unless --quick), the others at base, on random tokens of exactly that length. Then the
sequence length as the task makes it: real addition problems (decoder rows `B question E
answer E`) of n = 4 integers of d = 2 digits, and n or d doubled (x2, and x4 unless --quick),
at the base width and batch; their rows differ in length, so a training batch is padded to its
longest and the sweep runs length groups (`length_buckets`), as on real data. Training uses
`pre`, the sweep `qkv` (as analysed), random weights; the sweep is `measure_collapse` at one
sigma with `theory_draws=1`.

Time: every configuration is built in this process and timed side by side, alternating per
repeat (median), after WARMUP_ROUNDS untimed rounds of every row (one with --quick): with every
row's model and optimizer alive in one heap, the largest training steps fault in 10,000-40,000
fresh pages a step for their first rounds (`benchmarks/probes/scaling_faults.py`: on one thread
bursts up to the fifth call, hence five rounds; on two a few thousand a step can remain after
them), while a training run, thousands of steps long, sees the steady state. Growth is
compared with the analytic FLOP count of bench_mfu (training:
B T (6 N_mm + 12 L T d) over the padded batch; sweep: forward only, B T (2 N_mm + 4 L T d) a
forward, one unperturbed forward of the whole batch, then each length group at its padded width
once a draw).
The sweep's forwards stop early (`analysis.data.collect`; since the twenty-ninth session, with
normlab's attention kernel on, at the last layer's q and k), which the count does not. At the
twenty-third session's stopping point, after the last attention pattern, 81.2-81.6% of the
count ran at every shape up to 64 keys (`benchmarks/probes/sweep_flop_share.py`; its FLOP
counter sees torch's matmuls, not normlab's attention kernel, so it no longer measures the
share); the share is nearly constant across shapes, so the ratios are what the count predicts.

Peak memory: tracemalloc does not see torch's allocations and the profiler's memory events
are incomplete on CPU, so each configuration runs in a fresh subprocess (with --quick: one
subprocess for all configurations of a kind, one after another) with glibc's
`MALLOC_MMAP_THRESHOLD_=65536` (large blocks are mmapped and returned to the OS on free, so
RSS follows live memory). The child runs the step (or sweep) once at full size (AdamW state,
kernels), trims the heap, reads VmRSS, resets the peak (`echo 5 > /proc/self/clear_refs`),
runs it again and reads VmHWM: peak = VmHWM - VmRSS before, the extra resident memory one
steady-state step needs (activations, gradients, temporaries). Without clear_refs it falls back
to ru_maxrss after a tiny warm-up (then the AdamW state is included).

    python benchmarks/bench_scaling.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import random
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench_mfu import model_flops, n_matmul
from common import (
    bench_main,
    cpu_only,
    header,
    load_note,
    machine_info,
    md_table,
    paired_timing,
    repeats_for,
    rf,
    setup_threads,
    summary,
)
from normlab import ModelConfig, build_model
from normlab.train import loss_on, make_optimizer

BASE = {"train": {"seq_len": 24, "d_model": 64, "batch": 128},
        "collapse": {"seq_len": 24, "d_model": 64, "batch": 64}}
AXES = ("seq_len", "d_model", "batch")
#: the task's own sequence length: problems of n integers of d digits (base n4 d2), each of
#: n and d doubled; width and batch as BASE
PROBLEM_BASE = {"n": 4, "d": 2}
PROBLEM_AXES = ("n", "d")
PROBLEM_BASE_ROW = "problems n4 d2"
WARMUP_ROUNDS = 5  # untimed rounds before the timed ones: the heap's faults settle (docstring)
PLACEMENT = {"train": "pre", "collapse": "qkv"}
SIGMA = 0.3
LAYERS = 4


class _Train:
    lr, weight_decay, beta1, beta2, grad_clip = 1e-3, 0.02, 0.9, 0.98, 1.0


def configs(quick: bool) -> list[tuple[str, dict[str, int]]]:
    """(row name, multipliers): the random-token rows, then the problem rows (keys n, d)."""
    factors = (2,) if quick else (2, 4)
    out = [("base", {})]
    out += [(f"{axis} x{f}", {axis: f}) for axis in AXES for f in factors]
    out += [(PROBLEM_BASE_ROW, {"n": 1, "d": 1})]
    out += [(f"{axis} x{f}", {"n": 1, "d": 1, axis: f}) for axis in PROBLEM_AXES
            for f in factors]
    return out


def shape(kind: str, mult: dict[str, int]) -> dict[str, int]:
    """The row's sizes; a problem row has n and d, and its seq_len is its batch's width."""
    s = {k: v * mult.get(k, 1) for k, v in BASE[kind].items()}
    if "n" in mult:
        s |= {k: v * mult[k] for k, v in PROBLEM_BASE.items()}
        del s["seq_len"]
    return s


def base_row(mult: dict[str, int]) -> str:
    """The row a row's ratios are taken against: its own family's base."""
    return PROBLEM_BASE_ROW if "n" in mult else "base"


def problems(s: dict[str, int]) -> list[tuple[str, str]]:
    """The batch's problems of cell (n, d), the same for every run (seeded)."""
    from normlab.tasks.addition import sample_problem

    rng = random.Random(1)
    return [sample_problem(s["n"], s["d"], rng) for _ in range(s["batch"])]


def model_cfg(kind: str, s: dict[str, int], max_len: int) -> ModelConfig:
    return ModelConfig(d_model=s["d_model"], n_heads=4, n_layers=LAYERS, max_len=max_len,
                       norm_placement=PLACEMENT[kind], vocab_size=16)


def flops(kind: str, widths: list[tuple[int, int]], d: int, n_mm: int, n_draws: int,
          causal: bool = False) -> float:
    """bench_mfu's count over forwards of (rows, padded width) `widths`: the training batch
    (forward + backward); or the sweep's unperturbed forward over the whole batch (finding the
    sparse rows), then its groups, each run once a draw. `causal`: attention over the keys
    each query may see, what normlab's CPU attention kernel runs."""
    if kind == "train":
        return sum(model_flops(b, t, n_mm, LAYERS, d, causal=causal) for b, t in widths)
    per = [model_flops(b, t, n_mm, LAYERS, d, passes=1, causal=causal) for b, t in widths]
    return per[0] + n_draws * sum(per[1:])


def sweep_widths(data: Any, n_draws: int) -> list[tuple[int, int]]:
    """(examples, padded width) of the forwards `measure_collapse` runs on `data`: the whole
    batch once (`find_sparse_rows`), then each of its groups once a draw."""
    from normlab.analysis.collapse import DEFAULT_MAX_TOKENS
    from normlab.analysis.data import sweep_groups

    groups = sweep_groups(data, DEFAULT_MAX_TOKENS, n_draws)
    return [(data.n_examples, data.lengths["tokens"]),
            *((len(g), data.subset(g).lengths["tokens"]) for g in groups)]


def make_work(
    kind: str, s: dict[str, int], n_draws: int
) -> tuple[Callable[[], Any], int, list[tuple[int, int]]]:
    """A callable running one training step / one sweep of shape s, N_mm, and the (rows,
    padded width) of its forwards."""
    from normlab.tasks.addition import make_batch

    gen = torch.Generator().manual_seed(1)
    probs = problems(s) if "n" in s else None
    if probs is not None:  # real problems, right-padded as training pads them
        batch = make_batch(probs, "decoder")
        tokens = batch["tokens"]
        targets = batch["targets"]
    else:
        tokens = torch.randint(4, 16, (s["batch"], s["seq_len"]), generator=gen)
        targets = torch.randint(4, 16, tokens.shape, generator=gen)
    torch.manual_seed(0)
    model = build_model(model_cfg(kind, s, tokens.shape[1]))
    if kind == "train":
        batch = {"tokens": tokens, "targets": targets}
        opt = make_optimizer(model, _Train)
        model.train()

        def step() -> None:
            loss = loss_on(model, batch)[0]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        return step, n_matmul(model), [tuple(tokens.shape)]
    from normlab.analysis.collapse import measure_collapse
    from normlab.analysis.data import EvalData

    data = (EvalData.from_problems(probs, "decoder") if probs is not None
            else EvalData.from_tokens(tokens))
    model.eval()

    def sweep() -> dict[str, Any]:
        return measure_collapse(model, data, sigmas=[SIGMA], n_draws=n_draws, theory_draws=1)

    return sweep, n_matmul(model), sweep_widths(data, n_draws)


# --------------------------------------------------------------------------- child (memory)


def _status_kb(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _status_kb("VmHWM") is not None


def _trim() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Steady-state peak of one step/sweep: a full-size warm-up, then reset the peak and rerun.

    Without a resettable peak: a tiny warm-up only, and ru_maxrss (which then also holds the
    AdamW state created by this first full-size step).
    """
    torch.set_num_threads(spec["threads"])
    kind, s, n_draws = spec["kind"], spec["shape"], spec["n_draws"]
    resettable = _reset_peak()
    if resettable:
        work = make_work(kind, s, n_draws)[0]
        work()
    else:
        make_work(kind, {**s, "batch": 2}, 1)[0]()
        work = make_work(kind, s, n_draws)[0]
    _trim()
    rss0 = _status_kb("VmRSS")
    if resettable:
        _reset_peak()
    t0 = time.perf_counter()
    work()
    seconds = time.perf_counter() - t0
    if resettable:
        peak, method = _status_kb("VmHWM"), "VmHWM after clear_refs"
    else:
        peak, method = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "ru_maxrss"
    return {"rss_before_kb": rss0, "peak_kb": peak,
            "peak_delta_mb": (peak - rss0) / 1024 if peak and rss0 else None,
            "method": method, "seconds_single": seconds}


def measure_memory(
    kind: str, shapes: list[dict[str, int]], n_draws: int, threads: int
) -> list[dict[str, Any]]:
    """Peak memory of each shape, all in one fresh subprocess (in order, one after another)."""
    specs = [{"kind": kind, "shape": s, "n_draws": n_draws, "threads": threads} for s in shapes]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(specs)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    if proc.returncode:
        return [{"error": " ".join(proc.stderr.strip().splitlines()[-1:])}] * len(shapes)
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- parent


def run(args: argparse.Namespace) -> dict[str, Any]:
    skip = cpu_only(args, "scaling", "peak memory is read as the host processes' resident size, "
                                     "and the collapse sweep runs on the CPU")
    if skip is not None:
        return skip
    threads = setup_threads(args.threads)
    info = machine_info(threads)
    repeats = repeats_for(args, quick=2, full=3)
    warmup = 1 if args.quick else WARMUP_ROUNDS
    n_draws = 4 if args.quick else 8
    kinds = ["train"]
    skipped = None
    try:
        import normlab.analysis.collapse
        import normlab.analysis.data  # noqa: F401

        kinds.append("collapse")
    except ImportError as err:
        skipped = f"collapse sweep skipped: {err}"
    out: dict[str, Any] = {"benchmark": "scaling", "info": info, "repeats": repeats,
                           "warmup": warmup,
                           "n_draws": n_draws, "sigma": SIGMA, "kinds": {}, "skipped": skipped,
                           "memory_processes": ("one subprocess per kind" if args.quick
                                                else "one fresh subprocess per row")}
    for kind in kinds:
        cfgs = configs(args.quick)
        works, f = {}, {}
        for name, mult in cfgs:
            s = shape(kind, mult)
            works[name], n_mm, widths = make_work(kind, s, n_draws)
            f[name] = (flops(kind, widths, s["d_model"], n_mm, n_draws), widths,
                       flops(kind, widths, s["d_model"], n_mm, n_draws, causal=True))
        times = paired_timing(works, repeats=repeats, inner=1, warmup=warmup)
        rows = {}
        for name, mult in cfgs:
            base = base_row(mult)
            rows[name] = {"shape": shape(kind, mult), **summary(times[name]),
                          "flops": f[name][0], "forwards": f[name][1], "ratio_to": base,
                          "time_ratio": summary(times[name])["median_s"]
                          / summary(times[base])["median_s"],
                          "flop_ratio": f[name][0] / f[base][0],
                          "causal_flop_ratio": f[name][2] / f[base][2]}
        del works
        shapes = [shape(kind, mult) for _, mult in cfgs]
        if args.quick:  # one subprocess for all rows (saves interpreter start-ups)
            mems = measure_memory(kind, shapes, n_draws, threads)
        else:  # one fresh subprocess per row
            mems = [measure_memory(kind, [s], n_draws, threads)[0] for s in shapes]
        for (name, _), mem in zip(cfgs, mems, strict=True):
            rows[name]["memory"] = mem
        for r in rows.values():
            m, base_m = (x["memory"].get("peak_delta_mb") for x in (r, rows[r["ratio_to"]]))
            r["memory_ratio"] = m / base_m if m and base_m else None
        out["kinds"][kind] = rows
    out["load_note"] = load_note(info)
    return out


def to_markdown(res: dict[str, Any]) -> str:
    if "kinds" not in res:  # skipped as a whole (`cpu_only`)
        return f"### Scaling\n\nskipped: {res['skipped']}"
    parts = [header("Scaling: doubling seq len, width, batch", res["info"], res["load_note"]),
             f"time: median of {res['repeats']} alternating repeats in one process, after "
             f"{res.get('warmup', 1)} untimed round(s) of every row; peak memory: "
             f"{res['memory_processes']}, VmHWM - VmRSS around one step/sweep "
             "(MALLOC_MMAP_THRESHOLD_=65536); ratios are relative to the base row (random "
             f"tokens) or to the {PROBLEM_BASE_ROW!r} row (real problems, T their padded "
             f"width; the sweep's forwards their length groups, rows x width). Sweep: "
             f"measure_collapse, sigma {res['sigma']}, {res['n_draws']} draws."]
    titles = {"train": "training step (pre, forward + backward + AdamW)",
              "collapse": "collapse sweep (qkv, eval)"}
    for kind, rows in res["kinds"].items():
        table = []
        for name, r in rows.items():
            s, m = r["shape"], r["memory"]
            fw = r.get("forwards") or [[s["batch"], s.get("seq_len")]]
            groups = fw[1:] if kind == "collapse" else fw  # after the sweep's whole-batch one
            t = (", ".join(f"{b} x {w}" for b, w in groups) if len(groups) > 1
                 else groups[0][1])
            table.append([name, t, s["d_model"], s["batch"], 1e3 * r["median_s"],
                          rf(r["time_ratio"]), rf(r["flop_ratio"]),
                          rf(r["causal_flop_ratio"]) if "causal_flop_ratio" in r else "",
                          m.get("peak_delta_mb"), rf(r["memory_ratio"])])
        parts.append(f"**{titles[kind]}**\n\n" + md_table(
            ["config", "T (or groups, rows x T)", "d", "B", "ms", "time x", "FLOPs x",
             "causal FLOPs x", "peak MB", "memory x"], table))
    if res.get("skipped"):
        parts.append(res["skipped"])
    return "\n\n".join(parts)


def main() -> None:
    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--child", default=None, help=argparse.SUPPRESS)

    def early(args: argparse.Namespace) -> bool:
        if args.child:  # a measurement subprocess
            print(json.dumps([child(spec) for spec in json.loads(args.child)]))
        return bool(args.child)

    bench_main(__doc__, run, to_markdown, extra=extra, early=early)


if __name__ == "__main__":
    main()
