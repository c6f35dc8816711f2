"""Hook overhead: a forward with no hooks attached vs the same forward with HookPoints bypassed.

normlab's `HookPoint.__call__` returns its input at once when nothing is attached, and
`setup_hooks` binds each point as a plain attribute of its parent. The whole-forward baseline
replaces `HookPoint.__call__` by a bare `return x` (class-level monkeypatch, restored
afterwards), which isolates the check. Both contenders run the same model on the same tokens
(eval mode, no_grad, the same attention path), alternating per repeat. Batch 128 is a
training-size forward; batch 1 is decode-sized, where fixed per-call costs dominate.

A forward cannot run without its points, so what they cost against a model that has none
(reading the attribute, the call and the check) comes from a tight loop that reads
`self.hook_x(x)` as the model does, against the same method without the point; "predicted %"
scales it by the points one forward calls (`called_points`: fewer than the model has, since a
norm with nothing attached skips its own two, the fused attention paths pass no scores or
pattern through theirs, and the fused QK-Norm + RoPE no q or k).

    python benchmarks/bench_hooks.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from bench_train_step import base_config, model_config, real_batch
from common import (
    bench_main,
    header,
    load_note,
    md_table,
    paired_timing,
    ratio_stats,
    rci,
    repeats_for,
    rf,
    start,
    summary,
    sync,
)
from normlab import build_model
from normlab.model.hooks import HookedModule, HookPoint

ORIGINAL_CALL = HookPoint.__call__


def _bare(self: HookPoint, x: torch.Tensor) -> torch.Tensor:
    return x


def called_points(model: Any, tokens: torch.Tensor, aux: Any) -> list[str]:
    """The names of the points one unhooked forward calls, in order (HookPoint.__call__
    watched for one forward)."""
    names = {id(p): n for n, p in model.hook_points().items()}
    called: list[str] = []

    def watching(self: HookPoint, x: torch.Tensor) -> torch.Tensor:
        called.append(names[id(self)])
        return ORIGINAL_CALL(self, x)

    HookPoint.__call__ = watching
    try:
        with torch.no_grad():
            model(tokens, aux=aux)
    finally:
        HookPoint.__call__ = ORIGINAL_CALL
    return called


def _inner_for(fn: Callable[[], Any], target_s: float, device: torch.device | None = None) -> int:
    """Calls of `fn` per timed repeat, for about `target_s` seconds (one call timed, after
    one untimed; on a GPU until its kernels finished)."""
    fn()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return max(1, int(target_s / max(time.perf_counter() - t0, 1e-6)))


class PointHolder(HookedModule):
    """A module with one hook point, read the way every forward reads its points."""

    def __init__(self) -> None:
        super().__init__()
        self.hook_x = HookPoint()
        self.setup_hooks()

    def through_point(self, x: torch.Tensor) -> torch.Tensor:
        return self.hook_x(x)

    def without_point(self, x: torch.Tensor) -> torch.Tensor:
        return x


def call_cost(repeats: int, calls: int) -> dict[str, Any]:
    """Nanoseconds per unhooked hook point in a tight loop, read as forwards read them.

    `self.hook_x(x)` with the shipped HookPoint, with a bare `return x` as its `__call__`
    (what the whole-forward comparison bypasses), and a method without the point at all; the
    extra over the last is what a point costs a forward.
    """
    holder, x = PointHolder(), torch.zeros(1)

    def loop(call: Any, method: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[], None]:
        def fn() -> None:
            HookPoint.__call__ = call
            for _ in range(calls):
                method(x)
        return fn

    try:
        times = paired_timing({"hooks": loop(ORIGINAL_CALL, holder.through_point),
                               "bypassed": loop(_bare, holder.through_point),
                               "no point": loop(ORIGINAL_CALL, holder.without_point)},
                              repeats=repeats, inner=1, warmup=1)
    finally:
        HookPoint.__call__ = ORIGINAL_CALL
    ns = {k: 1e9 * summary(v)["median_s"] / calls for k, v in times.items()}
    return {"calls": calls, "ns_per_call": ns, "extra_ns_per_call": ns["hooks"] - ns["no point"],
            "check_ns_per_call": ns["hooks"] - ns["bypassed"],
            "times_s": times}  # each repeat's loop of `calls`, as every timing keeps them


def run(args: argparse.Namespace) -> dict[str, Any]:
    device, info = start(args)
    run_cfg = base_config()
    full = real_batch(run_cfg, device=device)
    batch, aux_all = full["tokens"], full.get("aux")  # aux: digit positions, if used
    repeats = repeats_for(args, quick=3, full=9)
    target = 0.05 if args.quick else 0.3
    results = []
    try:
        for placement in ("pre", "qkv"):
            torch.manual_seed(0)
            model = build_model(model_config(run_cfg, run_cfg.model.d_model, placement))
            model = model.to(device).eval()
            n_points = len(model.hook_points())
            for b in (128, 1):
                tokens = batch[:b]
                aux = None if aux_all is None else aux_all[:b]

                def forward(call: Any, tokens: torch.Tensor = tokens, aux: Any = aux,
                            model: Any = model) -> Any:
                    def fn() -> None:
                        HookPoint.__call__ = call
                        with torch.no_grad():
                            model(tokens, aux=aux)
                    return fn

                n_calls = len(called_points(model, tokens, aux))
                contenders = {"hooks": forward(ORIGINAL_CALL), "bypassed": forward(_bare)}
                inner = _inner_for(contenders["hooks"], target, device)
                times = paired_timing(contenders, repeats=repeats, inner=inner, warmup=1,
                                      device=device)
                th, tb = summary(times["hooks"]), summary(times["bypassed"])
                results.append({
                    "placement": placement, "batch": b, "seq_len": tokens.shape[1],
                    "hook_points": n_points, "hook_calls": n_calls, "inner": inner,
                    "hooks": th, "bypassed": tb,
                    "ratio": ratio_stats(times["hooks"], times["bypassed"]),
                    "us_per_hook_call": 1e6 * (th["median_s"] - tb["median_s"]) / n_calls,
                })
    finally:
        HookPoint.__call__ = ORIGINAL_CALL
    micro = call_cost(repeats, 20_000 if args.quick else 200_000)
    for r in results:  # the overhead the micro-benchmark predicts for one forward
        extra = r["hook_calls"] * micro["extra_ns_per_call"] * 1e-9
        r["predicted_overhead_pct"] = 100 * extra / r["bypassed"]["median_s"]
    return {"benchmark": "hooks", "info": info, "repeats": repeats, "results": results,
            "call_cost": micro,
            "load_note": load_note(info)}


def to_markdown(res: dict[str, Any]) -> str:
    rows = [[r["placement"], r["batch"], f"{r['hook_points']} ({r.get('hook_calls', '?')})",
             1e3 * r["hooks"]["median_s"],
             1e3 * r["bypassed"]["median_s"], rf(r["ratio"]["median"]), rci(r["ratio"]),
             f"{r['us_per_hook_call']:.2f}", f"{r['predicted_overhead_pct']:.2f}"]
            for r in res["results"]]
    c = res["call_cost"]
    return "\n\n".join([
        header("Hook overhead (forward, no hooks attached)", res["info"], res["load_note"]),
        f"d_model 64, 4 layers, seq len {res['results'][0]['seq_len']}; median of "
        f"{res['repeats']} repeats; ratio = with HookPoint calls / bypassed (median of "
        "per-repeat ratios); µs/call = time difference / the points a forward calls "
        "(noise-dominated, may be negative). Tight loop of "
        f"{c['calls']:,} reads `self.hook_x(x)` as a forward makes them: unhooked HookPoint "
        f"{c['ns_per_call']['hooks']:.0f} ns, with a bare `return x` as its call "
        f"{c['ns_per_call']['bypassed']:.0f} ns, a method without the point "
        f"{c['ns_per_call']['no point']:.0f} ns; predicted % = points called x (unhooked - "
        "without) / bypassed forward time: what the points cost against a model without them.",
        md_table(["placement", "batch", "hook points (called)", "ms (hooks)", "ms (bypassed)",
                  "ratio",
                  "its median's CI", "µs/call", "predicted %"], rows),
    ])


def main() -> None:
    bench_main(__doc__, run, to_markdown)


if __name__ == "__main__":
    main()
