"""Model FLOPs utilisation of a training step, against this machine's measured matmul peak.

FLOPs per training step (forward + backward), counted analytically, PaLM-style:

    tokens = batch * seq_len                      (every position of the padded batch)
    flops  = tokens * (6 * N_mm + 12 * n_layers * seq_len * d_attn)

`N_mm` counts the parameters used in matrix multiplies: W_Q, W_K, W_V, W_O, W_in, W_out
(W_gate when gated) of every layer and the unembedding W_U (W_E with tied embeddings: the same
d_model x vocab multiply); embeddings (gathers), norm gains, biases and logit scales are left
out. The attention term counts q.k and pattern.v over the full seq_len x seq_len square
(2 matmuls x 2 FLOPs per multiply-add x 3 for forward + backward), i.e. it ignores the causal
mask, as PaLM's formula (and nanoGPT's `estimate_mfu`) does, and the target is judged on it.
d_attn = n_heads * d_head. normlab's CPU attention kernel skips the masked keys, so it runs the
causal count, the attention term over seq_len (seq_len + 1) / 2 pairs: the table also gives
MFU over that count (`causal_flops`), a little lower.
Norms, softmax, GELU and the optimiser are not counted: they are the overhead MFU exposes.

Peak: the best of several float32 `torch.mm` of two n x n matrices (2 n^3 FLOPs), measured in
the same process with the same thread count, before and after the training timings (twice after
them where it reads `bench_train_step`'s timings of this run, as `run_all.py` has it); on a GPU
(`--device cuda`) there, n = 8192, at PyTorch's default float32 matmul precision ('highest':
no TF32), which the result records, so MFU stays float32 work over a float32 peak. With
`--precision bfloat16` the steps run under autocast (`train.precision`) and the peak is a
bfloat16 matmul's: bfloat16 work over a bfloat16 peak.

    python benchmarks/bench_mfu.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch

from bench_train_step import (
    base_config,
    contenders_for,
    model_config,
    real_batch,
)
from common import (
    add_precision_arg,
    bench_main,
    header,
    load_note,
    md_table,
    paired_timing,
    repeats_for,
    start,
    summary,
    sync,
)
from normlab import build_model

MATMUL_LEAVES = ("W_Q", "W_K", "W_V", "W_O", "W_in", "W_out", "W_gate", "W_U")


def matmul_peak(
    n: int, repeats: int, device: torch.device | None = None, dtype: torch.dtype = torch.float32
) -> dict[str, float]:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.mm(a, b)  # warm-up
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync(device)
        times.append(time.perf_counter() - t0)
    flops = 2 * n**3
    return {"n": n, "best_flops_per_s": flops / min(times),
            "median_flops_per_s": flops / summary(times)["median_s"], "times_s": times}


def n_matmul(model: torch.nn.Module) -> int:
    """N_mm: the parameters used in matrix multiplies (the module docstring's list). Tied
    embeddings have no W_U: the unembedding multiplies by the embedding's W_E, counted here."""
    n = sum(p.numel() for name, p in model.named_parameters()
            if name.rsplit(".", 1)[-1] in MATMUL_LEAVES)
    cfg = model.cfg
    return n + cfg.d_model * cfg.vocab_size if cfg.tie_embeddings else n


def model_flops(rows: int, seq_len: int, n_mm: int, n_layers: int, d_attn: int, *,
                passes: int = 3, causal: bool = False) -> float:
    """The count over `rows` sequences of `seq_len` positions, `passes` 3 for forward +
    backward (1: a forward): 2 N_mm a token a pass for the weights, 4 n_layers d_attn a query
    and key a pass for q.k and pattern.v, over every key (PaLM's count) or, `causal`, over the
    keys each query may see, (seq_len + 1) / 2 on average."""
    keys = (seq_len + 1) / 2 if causal else seq_len
    return passes * rows * seq_len * (2 * n_mm + 4 * n_layers * keys * d_attn)


def flops_per_step(d_model: int, batch: int, seq_len: int) -> dict[str, float]:
    run = base_config()
    cfg = model_config(run, d_model, "pre")
    n_mm = n_matmul(build_model(cfg))
    shape = (batch, seq_len, n_mm, cfg.n_layers, cfg.n_heads * cfg.d_head)
    dense = model_flops(batch, seq_len, n_mm, n_layers=0, d_attn=0)  # the weights' alone
    flops = model_flops(*shape)
    return {"n_mm": n_mm, "tokens": batch * seq_len, "dense_flops": dense,
            "attn_flops": flops - dense, "flops": flops,
            "causal_flops": model_flops(*shape, causal=True)}


def _utilisation(f: dict[str, float], step: dict[str, Any], peak: float) -> dict[str, Any]:
    """A contender's FLOP/s and MFU from its step's timing summary, and MFU's CI from the
    median time's (`mfu_ci`, absent for a summary without one, as older results are); the
    peak, the best of its measurements, is taken as it is."""
    s = step["median_s"]
    out: dict[str, Any] = {"median_s": s, "flops_per_s": f["flops"] / s,
                           "mfu": f["flops"] / s / peak,
                           "mfu_causal": f["causal_flops"] / s / peak}
    if "times_s" in step:  # each repeat's, as every timing keeps them
        out["times_s"] = step["times_s"]
    if "ci_s" in step:
        lo, hi = step["ci_s"]
        out["mfu_ci"] = [f["flops"] / hi / peak, f["flops"] / lo / peak]
        out["ci_coverage"] = step["ci_coverage"]
    return out


def run(args: argparse.Namespace, train_step: dict[str, Any] | None = None) -> dict[str, Any]:
    device, info = start(args)
    n = 8192 if device.type == "cuda" else 1024 if args.quick else 2048
    peak_reps = 3 if args.quick else 5
    precision = getattr(args, "precision", "float32")
    dtype = getattr(torch, precision)  # the peak in the precision the steps run their matmuls
    peaks = [matmul_peak(n, peak_reps, device, dtype)]
    if train_step is not None and (
        train_step["info"]["threads"], train_step["info"].get("device", "cpu"),
        train_step.get("precision", "float32"),
    ) == (info["threads"], info["device"], precision):  # the same steps, timed
        b, t = train_step["batch"], train_step["seq_len"]
        timed = {d: dict(w["contenders"]) for d, w in train_step["widths"].items()}
        source = "bench_train_step result of this run"
    else:
        run_cfg = base_config()
        batch = real_batch(run_cfg, device=device)
        b, t = batch["tokens"].shape
        widths = ["64"] if args.quick else ["64", "128"]
        repeats = repeats_for(args, quick=3, full=5)
        timed = {}
        for d in widths:
            steps, _ = contenders_for(run_cfg, int(d), batch, ("pre", "qkv"), ("nanogpt",),
                                      device=device, precision=precision)
            times = paired_timing(steps, repeats=repeats, inner=1, warmup=1, device=device)
            timed[d] = {k: summary(v) for k, v in times.items()}
        source = "timed here"
    peaks.append(matmul_peak(n, peak_reps, device, dtype))
    peak = max(p["best_flops_per_s"] for p in peaks)
    widths_out = {}
    for d, per in timed.items():
        f = flops_per_step(int(d), b, t)
        widths_out[d] = {
            **f,
            "contenders": {k: _utilisation(f, s, peak) for k, s in per.items()},
        }
    return {
        "benchmark": "mfu", "info": info, "batch": b, "seq_len": t, "timings": source,
        "precision": precision,
        "peak": {"matmul_n": n, "dtype": precision, "flops_per_s": peak, "measurements": peaks},
        "formula": "flops/step = B*T*(6*N_mm + 12*L*T*d_attn); N_mm = matmul weights incl. W_U",
        "widths": widths_out,
        "load_note": load_note(info),
    }


def to_markdown(res: dict[str, Any]) -> str:
    p = res["peak"]
    parts = [header("Model FLOPs utilisation (training step)", res["info"], res["load_note"]),
             f"peak = best {p.get('dtype', 'float32')} torch.mm {p['matmul_n']}x{p['matmul_n']}: "
             f"{p['flops_per_s'] / 1e9:.1f} GFLOP/s. {res['formula']} (causal mask ignored). "
             f"batch {res['batch']} x seq len {res['seq_len']}; step times: {res['timings']}."]
    for d, w in res["widths"].items():
        rows = [[k, 1e3 * c["median_s"], c["flops_per_s"] / 1e9, 100 * c["mfu"],
                 "" if "mfu_causal" not in c else f"{100 * c['mfu_causal']:.1f}"]
                for k, c in w["contenders"].items()]
        parts.append(f"**d_model {d}**: N_mm = {w['n_mm']:,}, {w['flops'] / 1e9:.2f} GFLOP/step "
                     f"(attention {100 * w['attn_flops'] / w['flops']:.1f}%)\n\n"
                     + md_table(["contender", "ms/step", "GFLOP/s", "MFU %",
                                 "MFU % (causal count)"], rows))
    return "\n\n".join(parts)


def main() -> None:
    bench_main(__doc__, run, to_markdown, extra=add_precision_arg)


if __name__ == "__main__":
    main()
