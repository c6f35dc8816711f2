"""One-off probe behind the ninth session's notes in docs/performance.md; not part of make bench.

The collapse sweep on rows of 128 keys (the seq_len of `normlab analyze --hf`), where SDPA is
faster than the explicit path: a random qkv decoder (d128, 4 layers, RoPE, init_std 0.2), 16
rows of random tokens, 8 draws at sigma 0.3, 4 sweeps (the first is warm-up). Run it against
two versions of normlab by PYTHONPATH: the sweep reading the pattern (the eighth session's
`src`, git ab14541, or any checkout before `_RowWinners`) and reading q and k so the model
keeps SDPA (`benchmarks/probes/collapse_qk_reading.patch` applied to ab14541, or the current
`src`, which reads q and k for rows longer than EXPLICIT_MAX_KEYS_CPU):

    PYTHONPATH=OTHER/src .venv/bin/python benchmarks/probes/collapse_long_rows.py THREADS [T]
"""
import statistics as st
import sys

import torch

import normlab.analysis.collapse as collapse
from normlab import ModelConfig, build_model
from normlab.analysis.data import EvalData

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
T = int(sys.argv[2]) if len(sys.argv) > 2 else 128
torch.manual_seed(0)
model = build_model(ModelConfig(d_model=128, n_heads=4, n_layers=4, max_len=T, vocab_size=64,
                                norm_placement="qkv", init_std=0.2, pos_encoding="rope")).eval()
tokens = torch.randint(0, 64, (16, T), generator=torch.Generator().manual_seed(0))
data = EvalData.from_tokens(tokens, torch.ones_like(tokens, dtype=torch.bool))
ts = []
for _ in range(4):
    r = collapse.measure_collapse(model, data, sigmas=[0.3], n_draws=8, threshold=0.9,
                                  theory_draws=1)
    ts.append(r["sweep_seconds"])
short = getattr(collapse, "explicit_by_default", lambda device, n: False)(torch.device("cpu"), T)
kind = "q/k reading" if hasattr(collapse, "_RowWinners") and not short else "pattern reading"
print(f"{kind}, {torch.get_num_threads()} thread(s), T {T}: {r['n_sparse_rows']} rows, rate "
      f"{r['collapse_rate'][0]:.4f}, sweep median {st.median(ts[1:]):.3f} s "
      f"{[round(t, 3) for t in ts]}")
