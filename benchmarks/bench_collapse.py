"""Collapse-sweep throughput: `normlab.analysis.collapse` (vectorised) vs a naive Python loop.

Both contenders perturb q, k, v of every attention site with token-mode normal noise at one
sigma, on the same model, the same teacher-forced examples (`select_problems` on the train
cells, as `normlab analyze` does) and the same sparse rows (max weight >= 0.9), for the same
number of noise draws, and count rows whose argmax key changes.

- vectorised: `measure_collapse(model, data, sigmas=[sigma], n_draws, theory_draws=1)`: the
  batch is repeated across draws and run in a few large forwards, one per group of examples
  of similar length (`length_buckets`). We report its whole call and its own `sweep_seconds`
  (the perturbed forwards only, without finding rows and theory).
- vectorised, one width (`bucket=False`): the same, every example padded to the longest one,
  as before length bucketing (fifth session); its counts must equal the bucketed ones.
- naive (`naive_sweep`, below): one forward per example per draw, batch size 1, with hooks
  that scale q/k/v by the very same eps tables (drawn through `Perturbation.draw` in the same
  order), so the flip counts must agree row for row (up to float ties); we report agreement.
  Like `measure_collapse`'s hooks (twenty-fifth session), they write the noise into q, k and
  v in place. Like `measure_collapse`, each forward stops once the last pattern it reads is
  in hand (the last block's MLP and the unembedding cannot change it), so the speed-up is the
  vectorisation's alone. Until normlab's twenty-third session the loop ran every forward to
  the logits; that loop is still timed (`naive_full`, `speedup_sweep_full_forward`), for
  comparison with earlier results.

Throughput = sparse rows x draws / second. The naive loop gets its sparse rows for free. Each
contender runs once untimed first (until the forty-second session none did, and a result's first
repeat carried the first call's cost).

    python benchmarks/bench_collapse.py [--quick] [--threads N] [--run RUN_DIR]
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable
from typing import Any

import torch

from bench_train_step import base_config
from common import (
    bench_main,
    cpu_only,
    header,
    load_note,
    machine_info,
    md_table,
    paired_timing,
    ratio_stats,
    rci,
    repeats_for,
    rf,
    setup_threads,
    summary,
)
from normlab import build_model
from normlab.config import RunConfig
from normlab.model import Model
from normlab.tasks.addition import eval_sets

SIGMA = 0.3
SEED = 0
WARMUP = 1  # untimed calls of every contender first, as the Method says


class _Read(Exception):
    """Raised by the naive loop's last pattern hook: the rest of the forward is not needed."""


def naive_sweep(
    model: Model, data: Any, rows: Any, pert: Any, sigma: float, n_draws: int, chunk: int,
    seed: int = SEED, stop_early: bool = True, in_place: bool = True,
) -> torch.Tensor:
    """Flip count per sparse row: for each draw, for each example, one batch-1 forward,
    stopped after the last pattern it reads (`stop_early`) or run to the logits. The noise
    is written into q, k and v in place (`in_place`), as `measure_collapse`'s hooks do."""
    tokens = data.inputs["tokens"]
    aux = data.inputs.get("aux")  # digit positions, when the model uses them
    B, R = data.n_examples, len(rows)
    flips = torch.zeros(R, dtype=torch.float64)
    per_example = []
    for b in range(B):
        idx = (rows.example == b).nonzero().squeeze(1)
        per_example.append([(int(i), rows.sites[int(rows.site[i])], int(rows.head[i]),
                             int(rows.qpos[i]), int(rows.key[i])) for i in idx])
    site_names = [s.name for s in pert.sites]
    gen = torch.Generator().manual_seed(int(seed))
    done = 0
    model.eval()
    with torch.no_grad():
        while done < n_draws:
            c = min(chunk, n_draws - done)
            tables = pert.draw(sigma, c * B, data.lengths, gen)
            for j in range(c):
                for b in range(B):
                    r = j * B + b
                    argmax: dict[str, torch.Tensor] = {}

                    def scale(eps: torch.Tensor) -> Callable[..., torch.Tensor]:
                        def fn(x: torch.Tensor, hook: Any) -> torch.Tensor:
                            factor = 1 + eps[:, : x.shape[1], None, None]
                            return x.mul_(factor) if in_place else x * factor
                        return fn

                    def grab(x: torch.Tensor, hook: Any, store: dict = argmax) -> None:
                        store[hook.name.removesuffix(".hook_pattern")] = x[0].argmax(-1)
                        if stop_early and len(store) == len(rows.sites):
                            raise _Read

                    hooks = [(f"{s}.hook_{t}", scale(tables[(s, t)][r:r + 1]))
                             for s in site_names for t in pert.targets]
                    hooks += [(f"{s}.hook_pattern", grab) for s in rows.sites]
                    with model.hooks(hooks), contextlib.suppress(_Read):
                        model(tokens[b:b + 1], aux=None if aux is None else aux[b:b + 1])
                    for i, site, head, qpos, key in per_example[b]:
                        if int(argmax[site][head, qpos]) != key:
                            flips[i] += 1
            done += c
    return flips


def random_model() -> tuple[RunConfig, Model]:
    """The benchmark's default model: configs/addition sizes as `qkv`, random weights, seed 0.

    init_std 0.2 makes random attention peakier: more, non-trivial sparse rows.
    """
    run_cfg = base_config()
    run_cfg.model.norm_placement = "qkv"
    run_cfg.model.init_std = 0.2
    torch.manual_seed(0)
    return run_cfg, build_model(run_cfg.model)


def eval_data(run_cfg: RunConfig, n_examples: int) -> Any:
    """Teacher-forced problems of the eval cells, chosen as `normlab analyze` chooses them."""
    from normlab.analysis.data import data_from_sets, select_problems

    task = run_cfg.task.resolve()
    sets, _ = select_problems(task, eval_sets(task), n_examples)
    return data_from_sets(sets, "decoder", task.answer_format, task.digit_positions)


def run(args: argparse.Namespace) -> dict[str, Any]:
    skip = cpu_only(args, "collapse", "normlab's analyses run on the CPU, `check_on_cpu`")
    if skip is not None:
        return skip
    threads = setup_threads(args.threads)
    info = machine_info(threads)
    try:
        from normlab.analysis.collapse import (
            DEFAULT_MAX_TOKENS,
            Perturbation,
            find_sparse_rows,
            measure_collapse,
        )
        from normlab.analysis.data import chunk_copies, sweep_groups
    except ImportError as err:
        return {"benchmark": "collapse", "info": info, "skipped": f"collapse API missing: {err}"}
    if args.run:
        from normlab.train import load_run

        run_cfg, model, _ = load_run(args.run)
        source = f"trained run {args.run}"
    else:
        run_cfg, model = random_model()
        source = "random weights (init_std 0.2), configs/addition/qkv.toml sizes"
    if run_cfg.model.arch != "decoder":
        return {"benchmark": "collapse", "info": info,
                "skipped": "the naive baseline handles decoder-only models"}
    n_examples = 24 if args.quick else 64
    n_draws = 4 if args.quick else 16
    repeats = repeats_for(args, quick=2, full=3)
    data = eval_data(run_cfg, n_examples)
    model.eval()
    rows = find_sparse_rows(model, data, threshold=0.9)
    pert = Perturbation(model)
    chunk = chunk_copies(data, DEFAULT_MAX_TOKENS, n_draws)
    results: dict[str, Any] = {}

    def vectorised(bucket: bool = True) -> None:
        res = measure_collapse(model, data, sigmas=[SIGMA], n_draws=n_draws, threshold=0.9,
                               theory_draws=1, seed=SEED, bucket=bucket)
        key = "" if bucket else "_one_width"
        results.setdefault(f"sweep_s{key}", []).append(res["sweep_seconds"])
        results[f"flips{key}"] = res["rows"]["rate"][:, 0] * n_draws
        results["n_rows"] = res["n_sparse_rows"]

    def naive(stop_early: bool = True) -> None:
        key = "naive_flips" if stop_early else "naive_full_flips"
        results[key] = naive_sweep(model, data, rows, pert, SIGMA, n_draws, chunk,
                                   stop_early=stop_early)

    times = paired_timing({"vectorised": vectorised, "one_width": lambda: vectorised(False),
                           "naive": naive, "naive_full": lambda: naive(False)},
                          repeats=repeats, inner=1, warmup=WARMUP)
    R = len(rows)
    work = R * n_draws
    # each call records its own sweep time, the warm-up calls' first: left out, as their calls'
    sweep_s, sweep_one = (results[k][WARMUP:] for k in ("sweep_s", "sweep_s_one_width"))
    agree = float((results["flips"].round() == results["naive_flips"]).double().mean()) if R else 1
    same = bool(torch.equal(results["flips"], results["flips_one_width"]))
    if not torch.equal(results["naive_flips"], results["naive_full_flips"]):
        raise RuntimeError("the naive loop counted other flips when stopped early")
    groups = sweep_groups(data, DEFAULT_MAX_TOKENS, n_draws)
    return {
        "benchmark": "collapse", "info": info, "model": source, "sigma": SIGMA,
        "n_examples": data.n_examples, "seq_len": data.lengths["tokens"], "n_draws": n_draws,
        "sparse_rows": R, "chunk_copies": chunk, "repeats": repeats, "warmup": WARMUP,
        "naive": summary(times["naive"]), "naive_full": summary(times["naive_full"]),
        "vectorised_call": summary(times["vectorised"]),
        "vectorised_sweep": summary(sweep_s),
        "one_width_sweep": summary(sweep_one),
        "length_groups": [[len(g), data.subset(g).lengths["tokens"]] for g in groups],
        "real_position_fraction": float(data.valid["tokens"].double().mean()),
        "naive_row_draws_per_s": work / summary(times["naive"])["median_s"],
        "vectorised_call_row_draws_per_s": work / summary(times["vectorised"])["median_s"],
        "vectorised_sweep_row_draws_per_s": work / summary(sweep_s)["median_s"],
        "speedup_sweep": ratio_stats(times["naive"], sweep_s),
        "speedup_sweep_full_forward": ratio_stats(times["naive_full"], sweep_s),
        "early_stop_gain_naive": ratio_stats(times["naive_full"], times["naive"]),
        "speedup_one_width_sweep": ratio_stats(times["naive"], sweep_one),
        "bucketing_gain": ratio_stats(sweep_one, sweep_s),
        "bucketed_equals_one_width": same,
        "speedup_call": ratio_stats(times["naive"], times["vectorised"]),
        "flip_agreement": agree,
        "flips_total": {"vectorised": float(results["flips"].sum()),
                        "naive": float(results["naive_flips"].sum())},
        "load_note": load_note(info),
    }


def to_markdown(res: dict[str, Any]) -> str:
    if "skipped" in res:
        return f"### Collapse sweep\n\nskipped: {res['skipped']}"
    work = res["sparse_rows"] * res["n_draws"]
    rows = [
        ["naive loop (batch 1 per example per draw, stopped after the last pattern)",
         res["naive"]["median_s"], res["naive_row_draws_per_s"], rf(1.0), ""],
        ["naive loop run to the logits (the baseline until the twenty-third session)",
         res["naive_full"]["median_s"], work / res["naive_full"]["median_s"],
         rf(1 / res["early_stop_gain_naive"]["median"]), ""],
        ["measure_collapse, perturbed forwards (sweep_seconds)",
         res["vectorised_sweep"]["median_s"], res["vectorised_sweep_row_draws_per_s"],
         rf(res["speedup_sweep"]["median"]), rci(res["speedup_sweep"])],
        ["measure_collapse, whole call (rows + theory)", res["vectorised_call"]["median_s"],
         res["vectorised_call_row_draws_per_s"], rf(res["speedup_call"]["median"]),
         rci(res["speedup_call"])],
        ["measure_collapse(bucket=False), perturbed forwards (one width)",
         res["one_width_sweep"]["median_s"],
         res["sparse_rows"] * res["n_draws"] / res["one_width_sweep"]["median_s"],
         rf(res["speedup_one_width_sweep"]["median"]), rci(res["speedup_one_width_sweep"])],
    ]
    return "\n\n".join([
        header("Collapse sweep: vectorised vs naive loop", res["info"], res["load_note"]),
        f"{res['model']}; {res['n_examples']} examples x seq len {res['seq_len']}, "
        f"{res['sparse_rows']} sparse rows (theta 0.9), sigma {res['sigma']}, "
        f"{res['n_draws']} draws ({res['chunk_copies']} copies per forward); median of "
        f"{res['repeats']} repeats. Flip counts agree on {100 * res['flip_agreement']:.2f}% "
        f"of rows (totals {res['flips_total']['vectorised']:.0f} vs "
        f"{res['flips_total']['naive']:.0f}). Length groups (examples, width): "
        f"{', '.join(f'{n} x {w}' for n, w in res['length_groups'])} "
        f"({100 * res['real_position_fraction']:.0f}% of one-width positions are real); "
        f"bucketing gain {res['bucketing_gain']['median']:.2f}x, counts identical to one "
        f"width: {res['bucketed_equals_one_width']}.",
        md_table(["contender", "seconds", "row-draws/s", "speed-up vs naive",
                  "its median's CI"], rows),
        f"Against the loop run to the logits the perturbed forwards are "
        f"{rf(res['speedup_sweep_full_forward']['median'])}x faster "
        f"{rci(res['speedup_sweep_full_forward'])}.",
    ])


def main() -> None:
    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--run", default=None, help="a trained decoder run folder")

    bench_main(__doc__, run, to_markdown, extra=extra)


if __name__ == "__main__":
    main()
