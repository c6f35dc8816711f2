"""Greedy decoding with vs without the key/value cache, on the longest extrapolation cells.

A decoder of the quick-grid size (configs/addition/{pre,qkv}.toml; random weights, which cost
the same as trained ones) answers the fixed eval questions of the longest quick-grid
extrapolation cells (the one with the longest prompt and the one with the longest answer:
n=5 d=1 and n=2 d=3 on the current quick grid), in one batch each (as `normlab eval` batches
them), with the digit positions (`aux_fn`) when the config uses them. `--config` takes
another decoder recipe's size and grid instead (e.g. configs/addition/paper/pre.toml: n=6 d=4
and n=5 d=5), its placement replaced by `pre` and `qkv` as the default's is.
Generation length is forced to the cell's longest answer plus the closing E (`max_new`) with
an end token that never matches, so both paths generate exactly `max_new` tokens for every
question. The two paths are timed side by side, alternating per repeat, and their outputs are
checked to be identical.

    python benchmarks/bench_decode.py [--quick] [--threads N] [--config RECIPE.toml]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from bench_train_step import CONFIG, model_config
from common import (
    ROOT,
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
)
from normlab import build_model
from normlab.config import RunConfig, load_config
from normlab.model.generate import greedy_decode
from normlab.tasks.addition import (
    Cell,
    ResolvedTask,
    aux_positions,
    eval_sets,
    make_prompts,
    max_lengths,
    next_aux_position,
)

NEVER = -1  # an end-of-sequence id no token has: generation runs to max_new


def recipe(path: str | None) -> tuple[str, RunConfig, ResolvedTask]:
    """The recipe to decode (None: the quick one), as the JSON records it (relative to the
    repository where it lies inside), its config and its task; a recipe this benchmark cannot
    decode is a ValueError naming the file."""
    p = CONFIG if path is None else Path(path)
    full = p.resolve()
    name = full.relative_to(ROOT).as_posix() if full.is_relative_to(ROOT) else str(p)
    try:
        run_cfg = load_config(p)
        task = run_cfg.validate()
    except ValueError as err:  # load_config's name the file; the task's `validate` does not
        raise ValueError(err if str(p) in str(err) else f"--config {name}: {err}") from None
    if run_cfg.model.arch != "decoder":
        raise ValueError(f"--config {name}: model.arch must be 'decoder' (the benchmark "
                         f"decodes prompts alone); got {run_cfg.model.arch!r}")
    if not task.eval_splits.get("extrapolation"):
        raise ValueError(f"--config {name}: the task has no 'extrapolation' cells to decode")
    return name, run_cfg, task


def run(args: argparse.Namespace) -> dict[str, Any]:
    config, run_cfg, task = recipe(getattr(args, "config", None))  # run_all passes none
    device, info = start(args)
    sets = eval_sets(task)
    by_cell = {c: probs for split in sets.values() for c, probs in split.items()}
    extra = list(sets["extrapolation"])
    longest_prompt = max(extra, key=lambda c: (max_lengths([c])[0], max_lengths([c])[1]))
    longest_answer = max(extra, key=lambda c: (max_lengths([c])[1], max_lengths([c])[0]))
    cells: list[Cell] = list(dict.fromkeys([longest_prompt, longest_answer]))
    aux_fn = aux_positions if task.digit_positions else None
    aux_next = next_aux_position if task.digit_positions else None
    n_questions = 64 if args.quick else task.eval_size
    repeats = repeats_for(args, quick=3, full=7)
    placements = ("pre",) if args.quick else ("pre", "qkv")
    results = []
    for placement in placements:
        torch.manual_seed(0)
        model = build_model(model_config(run_cfg, run_cfg.model.d_model, placement))
        model = model.to(device).eval()
        for cell in cells:
            questions = [q for q, _ in by_cell[cell][:n_questions]]
            prompts = make_prompts(questions, "decoder")
            max_new = max_lengths([cell])[1] + 1
            outs: dict[str, list[list[int]]] = {}

            def decoder(cached: bool, key: str, prompts: list[list[int]] = prompts,
                        max_new: int = max_new, outs: dict = outs, model: Any = model) -> Any:
                def fn() -> None:
                    outs[key] = greedy_decode(model, prompts, max_new=max_new, eos=NEVER,
                                              aux_fn=aux_fn, use_cache=cached,
                                              aux_next=aux_next)
                return fn

            times = paired_timing({"cached": decoder(True, "cached"),
                                   "uncached": decoder(False, "uncached")},
                                  repeats=repeats, inner=1, warmup=1, device=device)
            n_tok = len(prompts) * max_new
            results.append({
                "placement": placement, "cell": cell.label, "batch": len(prompts),
                "prompt_len": max(len(p) for p in prompts), "max_new": max_new,
                "cached": summary(times["cached"]), "uncached": summary(times["uncached"]),
                "cached_tokens_per_s": n_tok / summary(times["cached"])["median_s"],
                "uncached_tokens_per_s": n_tok / summary(times["uncached"])["median_s"],
                "speedup": ratio_stats(times["uncached"], times["cached"]),
                "identical_outputs": outs["cached"] == outs["uncached"],
                "generated_all": all(len(r) == max_new for r in outs["cached"]),
            })
    return {"benchmark": "decode", "info": info, "repeats": repeats, "results": results,
            "config": config, "grid": "custom" if run_cfg.task.splits else run_cfg.task.grid,
            "d_model": run_cfg.model.d_model, "n_layers": run_cfg.model.n_layers,
            "load_note": load_note(info)}


def to_markdown(res: dict[str, Any]) -> str:
    rows = [[r["placement"], r["cell"], r["batch"], r["prompt_len"], r["max_new"],
             1e3 * r["cached"]["median_s"], 1e3 * r["uncached"]["median_s"],
             rf(r["speedup"]["median"]), rci(r["speedup"]),
             "yes" if r["identical_outputs"] else "NO"]
            for r in res["results"]]
    return "\n\n".join([
        header("Greedy decoding: KV cache vs none", res["info"], res["load_note"]),
        f"{res['config']} ({res['grid']} grid): d_model {res['d_model']}, {res['n_layers']} "
        "layers, random weights; one batch per cell, forced to max_new tokens; median of "
        f"{res['repeats']} repeats; speed-up = uncached / cached time (median of per-repeat "
        "ratios).",
        md_table(["placement", "cell", "batch", "prompt len", "max_new", "cached ms",
                  "uncached ms", "speed-up", "its median's CI", "same tokens"], rows),
    ])


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None,
                        help="a decoder recipe whose model size and grid's longest "
                             "extrapolation cells to decode (default: configs/addition/pre.toml, "
                             "the quick grid)")


def main() -> None:
    bench_main(__doc__, run, to_markdown, extra=add_args)


if __name__ == "__main__":
    main()
