"""One-off probe behind a twenty-third-session note in docs/performance.md; not part of make
bench.

The collapse sweep's forwards are large (up to ~1,000 sequences, ~15k positions), so a GELU
MLP's hidden activations, [positions, d_mlp] floats, are ~15 MB a layer: written by the first
matmul, read and written by the GELU, read by the second, out of this core's 2 MiB L2. Would
running the MLP a block of rows at a time (hidden in cache), or oneDNN's matmul with the GELU
fused in (`torch.ops.mkldnn._linear_pointwise`), be faster? Times one MLP of the benchmark's
size (d_model 64, d_mlp 256, exact GELU, no bias) on x [N, 64] every way, in a new random
order every round (median of 15 rounds after two warm-ups), and checks each result against
the plain one.

    .venv/bin/python benchmarks/probes/mlp_rows.py [THREADS]
"""
import statistics as st
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import probe_header, shuffled, threads_from_argv

from normlab import allocator

allocator.keep_freed_memory()
threads_from_argv("mlp_rows.py")
probe_header("MLP by row blocks")
torch.manual_seed(0)
W_in, W_out = torch.randn(64, 256) * 0.1, torch.randn(256, 64) * 0.1
W_in_t = W_in.t().contiguous()  # [out, in], as oneDNN's linear takes it


def plain(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x @ W_in) @ W_out


def blocks(rows: int):
    def fn(x: torch.Tensor) -> torch.Tensor:
        out = x.new_empty(x.shape[0], W_out.shape[1])
        for i in range(0, x.shape[0], rows):
            torch.mm(F.gelu(x[i:i + rows] @ W_in), W_out, out=out[i:i + rows])
        return out
    return fn


def onednn(x: torch.Tensor) -> torch.Tensor:
    h = torch.ops.mkldnn._linear_pointwise(x, W_in_t, None, "gelu", [], "none")
    return h @ W_out


with torch.inference_mode():
    for n in (2048, 14560):
        x = torch.randn(n, 64)
        ref = plain(x)
        ways = {"plain": lambda x=x: plain(x)}
        ways |= {f"blocks of {r}": (lambda x=x, f=blocks(r): f(x)) for r in (256, 512, 1024)}
        try:
            err = (onednn(x) - ref).abs().max().item()
            ways["oneDNN fused gelu"] = lambda x=x: onednn(x)
        except (RuntimeError, AttributeError) as e:
            err = None
            print(f"  oneDNN linear_pointwise unavailable: {str(e).splitlines()[0]}")
        for r in (256, 512, 1024):
            assert (blocks(r)(x) - ref).abs().max().item() < 1e-5
        times = shuffled(ways, rounds=15)
        base = st.median(times["plain"])
        print(f"N = {n} rows (hidden {n * 256 * 4 / 2**20:.1f} MiB); oneDNN max |diff| {err}")
        for name, ts in times.items():
            m = st.median(ts)
            print(f"  {name:20s} {1e3 * m:8.3f} ms  ({m / base:.3f} of plain)")
