"""Training-step throughput: normlab (every placement) vs nanoGPT-style and x-transformers.

The references: the nanoGPT-style model of `nanogpt_ref.py` with each of nanoGPT's attention
paths (`nanogpt`: SDPA, nanoGPT's default; `nanogpt-manual`: its explicit scores and softmax,
the path normlab itself takes on short CPU rows) and x-transformers' `Decoder` as it comes
(its default attention). normlab is held to the fastest of them.

One step = forward, cross-entropy on the answer tokens, backward, gradient clipping, AdamW
(`normlab.train.make_optimizer`, identical for every contender; the references, whose
parameters are not named `W_*`, decay theirs by nanoGPT's rule, `ndim >= 2`, which there picks
the weight matrices as normlab's names do here). All contenders see the same
real training batch of the quick grid (`TrainStream`, seed 0) and are timed side by side,
alternating per repeat. tokens/s counts every position of the padded batch (batch x seq len),
which is what the model computes on. The batch carries the digit positions (`aux`) when the
config uses them; the references are built with the config's sizes and, when it uses RoPE,
RoPE too (no absolute position table); they have no digit-position table.

With `--compile` every contender is also timed compiled (`torch.compile`, named
`...+compile`), and the fastest reference is the fastest of all references, eager or compiled.
Each row then also records its time over the fastest *eager* reference, which is what issue 6's
target compares (`eager_comparison`).

    python benchmarks/bench_train_step.py [--quick] [--threads N] [--widths 64,128] [--compile]
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from common import (
    ROOT,
    add_precision_arg,
    bench_main,
    header,
    load_note,
    md_table,
    paired_timing,
    positive_ints,
    ratio_stats,
    rci,
    repeats_for,
    rf,
    start,
    summary,
)
from nanogpt_ref import NanoGPT
from normlab import ModelConfig, build_model
from normlab.config import RunConfig, load_config
from normlab.tasks.addition import IGNORE_INDEX, TrainStream
from normlab.train import autocast, loss_on, make_optimizer

PLACEMENTS = ("none", "post", "pre", "qk", "qkv")
CONFIG = ROOT / "configs" / "addition" / "pre.toml"


def base_config() -> RunConfig:
    return load_config(CONFIG)


def model_config(run: RunConfig, d_model: int, placement: str) -> ModelConfig:
    """The recipe's model at width `d_model` (MLP scaled with it) and `placement`; a recipe's own
    `d_head` is kept at its width (re-derived from the heads only where the width changes)."""
    cfg = copy.deepcopy(run.model)
    scale = d_model / cfg.d_model
    if d_model != cfg.d_model:
        cfg.d_model, cfg.d_head = d_model, None
    cfg.d_mlp = int(run.model.d_mlp * scale)
    cfg.norm_placement = placement
    cfg.__post_init__()
    return cfg


def real_batch(
    run: RunConfig, batch_size: int | None = None, device: torch.device | None = None
) -> dict[str, torch.Tensor]:
    """The recipe's first training batch (seed 0), on `device` (default CPU)."""
    task = run.validate()
    stream = TrainStream(task.train_cells, seed=0, batch_size=batch_size or run.train.batch_size,
                         arch="decoder", answer_format=task.answer_format,
                         weights=task.train_weights, digit_positions=task.digit_positions)
    return {k: v.to(device or "cpu") for k, v in next(stream).items()}


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX)


def x_transformers_status() -> tuple[bool, str]:
    try:
        import x_transformers
    except ImportError as err:
        return False, f"not installed ({err})"
    from importlib.metadata import version

    return True, f"x-transformers {version('x-transformers')} ({x_transformers.__name__})"


def matrix_by_shape(name: str, p: torch.Tensor) -> bool:
    """nanoGPT's rule for what AdamW decays (`configure_optimizers`): every tensor of two or
    more dimensions, its weight matrices and embeddings; biases and norm gains are not."""
    return p.ndim >= 2


def build_contender(
    kind: str, cfg: ModelConfig, run: RunConfig, batch: dict[str, torch.Tensor],
    compiled: bool = False, device: torch.device | None = None, precision: str = "float32",
) -> tuple[torch.nn.Module, Callable[[], None]]:
    """kind: 'normlab' (cfg.norm_placement), 'nanogpt' (SDPA), 'nanogpt-manual' (nanoGPT's
    explicit attention) or 'x-transformers' (its default attention).

    `compiled` runs the model's forward (and so its backward) through `torch.compile`, as
    `train.compile` does for normlab and nanoGPT's `compile=True` for its model; the loss,
    clipping and AdamW stay eager for every contender alike. `device` (default CPU) holds the
    model; `batch` must already be there. `precision` "bfloat16" runs every contender's
    forward and loss under the autocast normlab's training loop uses (`train.precision`,
    `normlab.train.autocast`).
    """
    torch.manual_seed(0)
    tokens, targets = batch["tokens"], batch["targets"]
    if kind == "normlab":
        model: torch.nn.Module = build_model(cfg)

        def loss_fn() -> torch.Tensor:
            return loss_on(model, batch)[0]  # the training loop's own loss
    elif kind in ("nanogpt", "nanogpt-manual"):
        model = NanoGPT(cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.d_mlp,
                        cfg.max_len, rope=cfg.pos_encoding == "rope", flash=kind == "nanogpt")

        def loss_fn() -> torch.Tensor:
            return _ce(model(tokens), targets)
    elif kind == "x-transformers":
        from x_transformers import Decoder, TransformerWrapper

        model = TransformerWrapper(
            num_tokens=cfg.vocab_size,
            max_seq_len=cfg.max_len,
            attn_layers=Decoder(
                dim=cfg.d_model, depth=cfg.n_layers, heads=cfg.n_heads,
                attn_dim_head=cfg.d_head, ff_mult=cfg.d_mlp / cfg.d_model, ff_no_bias=True,
                # RoPE over the whole head (no absolute table) when normlab uses RoPE
                rotary_pos_emb=cfg.pos_encoding == "rope", rotary_emb_dim=cfg.d_head,
                verbose=False,
            ),
        )

        def loss_fn() -> torch.Tensor:
            return _ce(model(tokens), targets)
    else:
        raise ValueError(f"unknown contender {kind!r}")
    model.to(device or "cpu").train()
    if compiled:
        model.compile()  # in place: the loss closures above call the compiled module
    opt = make_optimizer(model, run.train) if kind == "normlab" else make_optimizer(
        model, run.train, decayed=matrix_by_shape)
    clip = run.train.grad_clip
    mixed = autocast(precision, torch.device(device or "cpu"))

    def step() -> None:
        with mixed:
            loss = loss_fn()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()

    return model, step


COMPILED = "+compile"  # suffix of a compiled contender's name
#: the references normlab is held to, the fastest of them: nanoGPT's two attention paths and
#: x-transformers as it comes (its own default attention, not SDPA)
REFERENCES = ("nanogpt", "nanogpt-manual", "x-transformers")


def contenders_for(
    run: RunConfig, d_model: int, batch: dict[str, torch.Tensor], placements: tuple[str, ...],
    refs: tuple[str, ...] = REFERENCES, compile_too: bool = False,
    device: torch.device | None = None, precision: str = "float32",
) -> tuple[dict[str, Callable[[], None]], dict[str, int]]:
    """Every contender's step, eager, and with `compile_too` also compiled (`name+compile`);
    on `device` (default CPU), where `batch` already is."""
    steps: dict[str, Callable[[], None]] = {}
    params: dict[str, int] = {}
    kinds = [(f"normlab-{p}", "normlab", p) for p in placements]
    kinds += [(r, r, "pre") for r in refs
              if r != "x-transformers" or x_transformers_status()[0]]
    if compile_too:
        from torch._dynamo import config as dynamo_config
        from torch._dynamo.utils import counters

        # Instances of one class share its forward's cache of compiled graphs; past the
        # default limit (8) dynamo would silently run later contenders eager.
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 64)
    for compiled in (False, True) if compile_too else (False,):
        for name, kind, placement in kinds:
            m, s = build_contender(kind, model_config(run, d_model, placement), run, batch,
                                   compiled, device, precision)
            if compiled:
                graphs = counters["stats"]["unique_graphs"]
                s()  # compile outside the timing (warm-up covers only recompiles)
                if counters["stats"]["unique_graphs"] == graphs:
                    raise RuntimeError(f"{name}: torch.compile compiled no graph (eager fallback)")
                name += COMPILED
            steps[name], params[name] = s, sum(x.numel() for x in m.parameters())
    return steps, params


def run(args: argparse.Namespace) -> dict[str, Any]:
    device, info = start(args)
    run_cfg = base_config()
    batch = real_batch(run_cfg, device=device)
    b, t = batch["tokens"].shape
    widths = args.widths or ([64] if args.quick else [64, 128])
    repeats = repeats_for(args, quick=3, full=7)
    inner = 1 if args.quick else 3
    xt_ok, xt_note = x_transformers_status()
    out: dict[str, Any] = {
        "benchmark": "train_step", "info": info, "batch": b, "seq_len": t,
        "repeats": repeats, "steps_per_repeat": inner, "x_transformers": xt_note,
        "config": str(CONFIG.relative_to(ROOT)), "widths": {},
    }
    compile_too = bool(getattr(args, "compile", False))
    precision = getattr(args, "precision", "float32")
    out["compiled"], out["precision"] = compile_too, precision
    for d in widths:
        steps, params = contenders_for(run_cfg, d, batch, PLACEMENTS, compile_too=compile_too,
                                       device=device, precision=precision)
        times = paired_timing(steps, repeats=repeats, inner=inner, warmup=1, device=device)
        sums = {name: summary(ts) for name, ts in times.items()}
        median = {name: s["median_s"] for name, s in sums.items()}
        fastest = min([r + c for c in ("", COMPILED) for r in REFERENCES if r + c in times],
                      key=median.__getitem__)
        eager = min([r for r in REFERENCES if r in times], key=median.__getitem__)
        rows = {}
        for name, ts in times.items():
            s = sums[name]
            rows[name] = {
                **s, "params": params[name], "tokens_per_s": b * t / s["median_s"],
                "vs_nanogpt": ratio_stats(ts, times["nanogpt"]),
                "vs_fastest_ref": ratio_stats(ts, times[fastest]),
            }
            if compile_too:  # without it the fastest reference is the eager one already
                rows[name]["vs_fastest_eager_ref"] = ratio_stats(ts, times[eager])
        w = out["widths"][str(d)] = {
            "contenders": rows, "fastest_reference": fastest,
            "qkv_over_pre": ratio_stats(times["normlab-qkv"], times["normlab-pre"]),
            "pre_over_fastest_ref": ratio_stats(times["normlab-pre"], times[fastest]),
        }
        if compile_too:
            w["fastest_eager_reference"] = eager
            w["compiled_qkv_over_pre"] = ratio_stats(
                times["normlab-qkv" + COMPILED], times["normlab-pre" + COMPILED])
    out["x_transformers_used"] = xt_ok
    out["load_note"] = load_note(info)
    return out


def eager_comparison(width: dict[str, Any], name: str) -> tuple[str, dict[str, Any] | None]:
    """The fastest eager reference of one width's results, and contender `name`'s time over
    it: issue 6's comparison, also for a `--compile` run, whose fastest reference may be a
    compiled one. The ratio is None where `name` was not timed, and for a `--compile` run
    written before the eager comparison was recorded (the seventh session's), whose ratios
    are all over a compiled reference and whose per-repeat times are not kept."""
    c = width["contenders"].get(name)
    if "fastest_eager_reference" in width:
        return width["fastest_eager_reference"], None if c is None else c["vs_fastest_eager_ref"]
    ref = width["fastest_reference"]
    if c is None or ref.endswith(COMPILED):
        return ref, None
    return ref, c["vs_fastest_ref"]  # no --compile: the fastest reference is an eager one


def to_markdown(res: dict[str, Any]) -> str:
    parts = [header("Training step (forward + backward + AdamW)", res["info"], res["load_note"]),
             f"batch {res['batch']} x seq len {res['seq_len']} (real quick-grid batch), "
             f"{res['config']} sizes, median of {res['repeats']} repeats x "
             f"{res['steps_per_repeat']} steps; ratio = time / reference time (median of "
             f"per-repeat ratios, > 1 means slower; CI: distribution-free interval for that "
             f"median, with its coverage). {res['x_transformers']}. Precision: "
             f"{res.get('precision', 'float32')} (every contender alike)."]
    for d, w in res["widths"].items():
        eager = "fastest_eager_reference" in w  # a --compile run: the targets' ratio apart
        rows = [[name, c["params"], 1e3 * c["median_s"], c["tokens_per_s"],
                 rf(c["vs_nanogpt"]["median"]), rf(c["vs_fastest_ref"]["median"]),
                 rci(c["vs_fastest_ref"]),
                 *([rf(c["vs_fastest_eager_ref"]["median"]), rci(c["vs_fastest_eager_ref"])]
                   if eager else [])]
                for name, c in w["contenders"].items()]
        parts.append(f"**d_model {d}** (fastest reference: {w['fastest_reference']}"
                     + (f"; fastest eager reference: {w['fastest_eager_reference']}, the one "
                        f"issue 6's target compares" if eager else "")
                     + f"; qkv/pre = {w['qkv_over_pre']['median']:.3f}, pre/fastest reference "
                     f"= {w['pre_over_fastest_ref']['median']:.3f})\n\n"
                     + md_table(["contender", "params", "ms/step", "tokens/s", "/nanogpt",
                                 "/fastest ref", "its median's CI",
                                 *(["/fastest eager ref", "its median's CI"] if eager else [])],
                                rows))
    return "\n\n".join(parts)


def main() -> None:
    def extra(p: argparse.ArgumentParser) -> None:
        p.add_argument("--widths", type=positive_ints, default=None,
                       help="comma-separated d_model values (default 64,128; 64 with --quick)")
        p.add_argument("--compile", action="store_true",
                       help="also time every contender under torch.compile (+~20 s each)")
        add_precision_arg(p)

    bench_main(__doc__, run, to_markdown, extra=extra)


if __name__ == "__main__":
    main()
