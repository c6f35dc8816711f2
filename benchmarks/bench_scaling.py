"""Time and peak memory of a training step and of the collapse sweep as T, d and B double.

Configurations: a base (seq len 24, d_model 64, batch 128 for training / 64 examples for the
sweep; 4 layers, 4 heads, d_mlp = 4 d) and each of seq len, width and batch doubled (x2, and
x4 unless --quick), the others at base. Training uses `pre`, the sweep `qkv` (as analysed),
random weights and random tokens; the sweep is `measure_collapse` at one sigma with
`theory_draws=1`.

Time: every configuration is built in this process and timed side by side, alternating per
repeat (median). Growth is compared with the analytic FLOP count of bench_mfu (training:
B T (6 N_mm + 12 L T d); sweep: forward only, B T (2 N_mm + 4 L T d) per forward, one
unperturbed forward plus one per draw).

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
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from common import (
    bench_main,
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
PLACEMENT = {"train": "pre", "collapse": "qkv"}
SIGMA = 0.3
MATMUL_LEAVES = ("W_Q", "W_K", "W_V", "W_O", "W_in", "W_out", "W_gate", "W_U")


class _Train:
    lr, weight_decay, beta1, beta2, grad_clip = 1e-3, 0.02, 0.9, 0.98, 1.0


def configs(quick: bool) -> list[tuple[str, dict[str, int]]]:
    factors = (2,) if quick else (2, 4)
    out = [("base", {})]
    out += [(f"{axis} x{f}", {axis: f}) for axis in AXES for f in factors]
    return out


def shape(kind: str, mult: dict[str, int]) -> dict[str, int]:
    return {k: v * mult.get(k, 1) for k, v in BASE[kind].items()}


def model_cfg(kind: str, s: dict[str, int]) -> ModelConfig:
    return ModelConfig(d_model=s["d_model"], n_heads=4, n_layers=4, max_len=s["seq_len"],
                       norm_placement=PLACEMENT[kind], vocab_size=16)


def n_matmul(model: torch.nn.Module) -> int:
    return sum(p.numel() for name, p in model.named_parameters()
               if name.rsplit(".", 1)[-1] in MATMUL_LEAVES)


def flops(kind: str, s: dict[str, int], n_mm: int, n_draws: int) -> float:
    b, t, d = s["batch"], s["seq_len"], s["d_model"]
    if kind == "train":
        return b * t * (6 * n_mm + 12 * 4 * t * d)
    return (1 + n_draws) * b * t * (2 * n_mm + 4 * 4 * t * d)


def make_work(kind: str, s: dict[str, int], n_draws: int) -> tuple[Callable[[], Any], int]:
    """A callable running one training step / one sweep of shape s, and N_mm."""
    torch.manual_seed(0)
    model = build_model(model_cfg(kind, s))
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, 16, (s["batch"], s["seq_len"]), generator=gen)
    if kind == "train":
        batch = {"tokens": tokens, "targets": torch.randint(4, 16, tokens.shape, generator=gen)}
        opt = make_optimizer(model, _Train)
        model.train()

        def step() -> None:
            loss = loss_on(model, batch)[0]
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()

        return step, n_matmul(model)
    from normlab.analysis.collapse import measure_collapse
    from normlab.analysis.data import EvalData

    data = EvalData.from_tokens(tokens)
    model.eval()

    def sweep() -> dict[str, Any]:
        return measure_collapse(model, data, sigmas=[SIGMA], n_draws=n_draws, theory_draws=1)

    return sweep, n_matmul(model)


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
        work, _ = make_work(kind, s, n_draws)
        work()
    else:
        make_work(kind, {**s, "batch": 2}, 1)[0]()
        work, _ = make_work(kind, s, n_draws)
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
    threads = setup_threads(args.threads)
    info = machine_info(threads)
    repeats = repeats_for(args, quick=2, full=3)
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
                           "n_draws": n_draws, "sigma": SIGMA, "kinds": {}, "skipped": skipped,
                           "memory_processes": ("one subprocess per kind" if args.quick
                                                else "one fresh subprocess per row")}
    for kind in kinds:
        cfgs = configs(args.quick)
        works, n_mm = {}, {}
        for name, mult in cfgs:
            works[name], n_mm[name] = make_work(kind, shape(kind, mult), n_draws)
        times = paired_timing(works, repeats=repeats, inner=1, warmup=1)
        base_t = summary(times["base"])["median_s"]
        base_f = flops(kind, shape(kind, {}), n_mm["base"], n_draws)
        rows = {}
        for name, mult in cfgs:
            s = shape(kind, mult)
            f = flops(kind, s, n_mm[name], n_draws)
            rows[name] = {"shape": s, **summary(times[name]), "flops": f,
                          "time_ratio": summary(times[name])["median_s"] / base_t,
                          "flop_ratio": f / base_f}
        del works
        shapes = [shape(kind, mult) for _, mult in cfgs]
        if args.quick:  # one subprocess for all rows (saves interpreter start-ups)
            mems = measure_memory(kind, shapes, n_draws, threads)
        else:  # one fresh subprocess per row
            mems = [measure_memory(kind, [s], n_draws, threads)[0] for s in shapes]
        for (name, _), mem in zip(cfgs, mems, strict=True):
            rows[name]["memory"] = mem
        base_m = rows["base"]["memory"].get("peak_delta_mb")
        for r in rows.values():
            m = r["memory"].get("peak_delta_mb")
            r["memory_ratio"] = m / base_m if m and base_m else None
        out["kinds"][kind] = rows
    out["load_note"] = load_note(info)
    return out


def to_markdown(res: dict[str, Any]) -> str:
    parts = [header("Scaling: doubling seq len, width, batch", res["info"], res["load_note"]),
             f"time: median of {res['repeats']} alternating repeats in one process; peak memory: "
             f"{res['memory_processes']}, VmHWM - VmRSS around one step/sweep "
             "(MALLOC_MMAP_THRESHOLD_=65536); ratios are relative to the base row. Sweep: "
             f"measure_collapse, sigma {res['sigma']}, {res['n_draws']} draws."]
    titles = {"train": "training step (pre, forward + backward + AdamW)",
              "collapse": "collapse sweep (qkv, eval)"}
    for kind, rows in res["kinds"].items():
        table = []
        for name, r in rows.items():
            s, m = r["shape"], r["memory"]
            table.append([name, s["seq_len"], s["d_model"], s["batch"], 1e3 * r["median_s"],
                          rf(r["time_ratio"]), rf(r["flop_ratio"]), m.get("peak_delta_mb"),
                          rf(r["memory_ratio"])])
        parts.append(f"**{titles[kind]}**\n\n" + md_table(
            ["config", "T", "d", "B", "ms", "time x", "FLOPs x", "peak MB", "memory x"], table))
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
