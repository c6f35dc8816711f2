"""One-off probe behind a ninth-session note in docs/performance.md; not part of make bench.

How close the vectorised collapse sweep is to this CPU's float32 matmul peak, on the
bench_collapse setup (qkv, random weights, init_std 0.2, 64 problems, 16 draws, sigma 0.3).
FLOPs are counted as bench_mfu does, forward only: 2 * matmul weights per position plus
4 * T * d_attn per position and layer (causal mask ignored), over the padded positions each
length group really runs, minus what the sweep skips (it stops at the last layer's pattern:
that layer's W_O and MLP, and the unembedding).

    .venv/bin/python benchmarks/probes/sweep_flops.py THREADS
"""
import statistics as st
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_collapse import eval_data, random_model  # noqa: E402
from bench_mfu import MATMUL_LEAVES, matmul_peak  # noqa: E402

from normlab.analysis.collapse import DEFAULT_MAX_TOKENS, measure_collapse  # noqa: E402
from normlab.analysis.data import FORWARD_COST_POSITIONS, chunk_copies, length_buckets  # noqa: E402

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
run, model = random_model()
model.eval()
cfg = model.cfg
data = eval_data(run, 64)
n_draws = 16

d, L, d_attn = cfg.d_model, cfg.n_layers, cfg.n_heads * cfg.d_head
per_layer = sum(p.numel() for n, p in model.blocks[0].named_parameters()
                if n.rsplit(".", 1)[-1] in MATMUL_LEAVES)
skipped = per_layer - 3 * d * d_attn  # the last layer runs only its q, k, v projections
chunk = chunk_copies(data, DEFAULT_MAX_TOKENS, n_draws)
groups = length_buckets(data, FORWARD_COST_POSITIONS / chunk)
flops = 0.0
for g in groups if len(groups) > 1 else [torch.arange(data.n_examples)]:
    T = data.subset(g).lengths["tokens"]
    positions = len(g) * T * n_draws
    flops += positions * (2 * (L * per_layer - skipped) + 4 * L * T * d_attn)
times = [measure_collapse(model, data, sigmas=[0.3], n_draws=n_draws, threshold=0.9,
                          theory_draws=1)["sweep_seconds"] for _ in range(6)][1:]
peak = matmul_peak(2048, 10)["best_flops_per_s"]
s = st.median(times)
print(f"{torch.get_num_threads()} thread(s): {flops / 1e9:.2f} GFLOP per sweep, median "
      f"{s:.3f} s of {len(times)} -> {flops / s / 1e9:.1f} GFLOP/s; matmul peak "
      f"{peak / 1e9:.1f} GFLOP/s -> {100 * flops / s / peak:.0f}% of peak")
