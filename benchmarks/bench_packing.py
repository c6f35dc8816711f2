"""Sequence packing: one training step on the same problems, packed (`task.pack`) vs padded.

For the quick grid (`configs/addition/pre.toml`, d64) and the paper grid
(`configs/addition/paper/pre.toml`, d128), one batch of `train.batch_size` problems is drawn
from the training stream and built twice from the *same* problems: padded (one row each) and
packed (first-fit decreasing into rows as wide as the longest problem, attention and positions
kept inside each problem). The loss is checked to agree (same answer tokens, same model; a
RuntimeError past LOSS_TOLERANCE), then forward + backward + AdamW steps are timed side by side.
Density = real tokens / positions.

    python benchmarks/bench_packing.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from bench_train_step import build_contender
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
from normlab.config import load_config
from normlab.tasks.addition import PAD, TrainStream, make_batch
from normlab.train import loss_on

CONFIGS = {"quick": "configs/addition/pre.toml", "paper": "configs/addition/paper/pre.toml"}
# float32 sums in another order: every committed result's |packed - padded| is at most 2.4e-7
# (58 files); a packer that drops answer tokens moves it far more (tests/test_bench_packing.py)
LOSS_TOLERANCE = 1e-4


def run(args: argparse.Namespace) -> dict[str, Any]:
    device, info = start(args)
    repeats = repeats_for(args, quick=2, full=7)
    results = []
    for grid, path in CONFIGS.items():
        cfg = load_config(ROOT / path)
        task = cfg.validate()
        stream = TrainStream(task.train_cells, seed=0, batch_size=cfg.train.batch_size,
                             arch="decoder", answer_format=task.answer_format,
                             weights=task.train_weights)
        problems = stream.problems(cfg.train.batch_size)
        batches = {p: {k: v.to(device) for k, v in make_batch(
                       problems, "decoder", task.answer_format, task.digit_positions,
                       pack=p).items()} for p in (False, True)}
        models, steps = {}, {}
        for p, b in batches.items():  # the training-step benchmark's own step, same init
            models[p], steps[p] = build_contender("normlab", cfg.model, cfg, b, device=device)
        with torch.no_grad():
            losses = {p: float(loss_on(models[p], b)[0]) for p, b in batches.items()}
        if abs(losses[True] - losses[False]) > LOSS_TOLERANCE:  # else it times other work
            raise RuntimeError(f"{grid} grid: the packed batch's loss {losses[True]:.7g} is not "
                               f"the padded batch's {losses[False]:.7g} (tolerance "
                               f"{LOSS_TOLERANCE:g})")
        times = paired_timing({"padded": steps[False], "packed": steps[True]},
                              repeats=repeats, inner=1 if args.quick else 3, warmup=1,
                              device=device)
        real = int((batches[False]["tokens"] != PAD).sum())
        rows = {}
        for name, p in (("padded", False), ("packed", True)):
            shape = tuple(batches[p]["tokens"].shape)
            rows[name] = {"rows": shape[0], "width": shape[1], "density": real / (shape[0] *
                          shape[1]), "loss": losses[p], **summary(times[name]),
                          "real_tokens_per_s": real / summary(times[name])["median_s"]}
        results.append({"grid": grid, "config": path, "d_model": cfg.model.d_model,
                        "problems": len(problems), "real_tokens": real, **rows,
                        "speedup": ratio_stats(times["padded"], times["packed"]),
                        "loss_abs_diff": abs(losses[True] - losses[False])})
    return {"benchmark": "packing", "info": info, "repeats": repeats, "results": results,
            "load_note": load_note(info)}


def to_markdown(res: dict[str, Any]) -> str:
    rows = []
    for r in res["results"]:
        for name in ("padded", "packed"):
            x = r[name]
            rows.append([r["grid"], r["d_model"], name, f"{x['rows']} x {x['width']}",
                         f"{x['density']:.2f}", 1e3 * x["median_s"], x["real_tokens_per_s"],
                         rf(r["speedup"]["median"]) if name == "packed" else "1.00",
                         rci(r["speedup"]) if name == "packed" else "",
                         f"{r['loss_abs_diff']:.1e}" if name == "packed" else ""])
    return "\n\n".join([
        header("Sequence packing: training step, same problems", res["info"], res["load_note"]),
        f"One batch of the training stream (seed 0), built padded and packed; forward + backward "
        f"+ AdamW, median of {res['repeats']} repeats; speed-up = padded / packed time (median "
        "of per-repeat ratios); |Δ loss| = packed vs padded loss before training.",
        md_table(["grid", "d_model", "batch", "rows x width", "density", "ms/step",
                  "real tokens/s", "speed-up", "its median's CI", "|Δ loss|"], rows),
    ])


def main() -> None:
    bench_main(__doc__, run, to_markdown)


if __name__ == "__main__":
    main()
