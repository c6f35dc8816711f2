"""Model FLOPs utilisation of a training step, against this machine's measured matmul peak.

FLOPs per training step (forward + backward), counted analytically, PaLM-style:

    tokens = batch * seq_len                      (every position of the padded batch)
    flops  = tokens * (6 * N_mm + 12 * n_layers * seq_len * d_attn)

`N_mm` counts the parameters used in matrix multiplies: W_Q, W_K, W_V, W_O, W_in, W_out
(W_gate when gated) of every layer and the unembedding W_U; embeddings (gathers), norm gains,
biases and logit scales are left out. The attention term counts q.k and pattern.v over the full
seq_len x seq_len square (2 matmuls x 2 FLOPs per multiply-add x 3 for forward + backward),
i.e. it ignores the causal mask, as PaLM's formula does. d_attn = n_heads * d_head.
Norms, softmax, GELU and the optimiser are not counted: they are the overhead MFU exposes.

Peak: the best of several float32 `torch.mm` of two n x n matrices (2 n^3 FLOPs), measured in
the same process with the same thread count, before and after the training timings; on a GPU
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
            "median_flops_per_s": flops / summary(times)["median_s"]}


def flops_per_step(d_model: int, batch: int, seq_len: int) -> dict[str, float]:
    run = base_config()
    cfg = model_config(run, d_model, "pre")
    model = build_model(cfg)
    n_mm = sum(p.numel() for name, p in model.named_parameters()
               if name.rsplit(".", 1)[-1] in MATMUL_LEAVES)
    tokens = batch * seq_len
    d_attn = cfg.n_heads * cfg.d_head
    dense = 6 * n_mm * tokens
    attn = 12 * cfg.n_layers * seq_len * d_attn * tokens
    return {"n_mm": n_mm, "tokens": tokens, "dense_flops": dense, "attn_flops": attn,
            "flops": dense + attn}


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
        timed = {d: {k: c["median_s"] for k, c in w["contenders"].items()}
                 for d, w in train_step["widths"].items()}
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
            timed[d] = {k: summary(v)["median_s"] for k, v in times.items()}
        source = "timed here"
    peaks.append(matmul_peak(n, peak_reps, device, dtype))
    peak = max(p["best_flops_per_s"] for p in peaks)
    widths_out = {}
    for d, per in timed.items():
        f = flops_per_step(int(d), b, t)
        widths_out[d] = {
            **f,
            "contenders": {k: {"median_s": s, "flops_per_s": f["flops"] / s,
                               "mfu": f["flops"] / s / peak} for k, s in per.items()},
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
        rows = [[k, 1e3 * c["median_s"], c["flops_per_s"] / 1e9, 100 * c["mfu"]]
                for k, c in w["contenders"].items()]
        parts.append(f"**d_model {d}**: N_mm = {w['n_mm']:,}, {w['flops'] / 1e9:.2f} GFLOP/step "
                     f"(attention {100 * w['attn_flops'] / w['flops']:.1f}%)\n\n"
                     + md_table(["contender", "ms/step", "GFLOP/s", "MFU %"], rows))
    return "\n\n".join(parts)


def main() -> None:
    bench_main(__doc__, run, to_markdown, extra=add_precision_arg)


if __name__ == "__main__":
    main()
