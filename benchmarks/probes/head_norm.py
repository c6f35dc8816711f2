"""One-off probe behind a fourteenth-session note in docs/performance.md; not part of make bench.

QKV-Norm's per-head LayerNorm runs ATen's kernel on rows of d_head = 16 floats, which costs
far more per element than the same kernel on 64-float rows. Can plain torch ops do the 16-float
rows faster? Times, on the training batch's q ([128, 17, 4, 16], float32, median µs), forward
(no autograd) and forward + backward of:

- `layer_norm`: `F.layer_norm(x, (16,), g, b)`, what `HeadNorm` runs;
- `layer_norm, 64-float rows`: the same number of elements as [2176, 64] (the reference);
- `layer_norm, no affine`: without gain and bias;
- `group_norm`: `F.group_norm` over [2176, 64] with 4 groups (gain and bias repeated);
- `rms_norm + bias`: `F.rms_norm`, exact for LayerNorm only on centred inputs;
- `moments by matmul`: means and variances by a block-indicator matmul, then elementwise;
- `batch_norm, transposed`: rows as batch-norm channels over a transposed copy.

    .venv/bin/python benchmarks/probes/head_norm.py [THREADS]
"""
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import median, paired_timing

if len(sys.argv) > 1 and not sys.argv[1].isdigit():
    sys.exit("usage: head_norm.py [THREADS]")
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
torch.manual_seed(0)
B, T, H, E = 128, 17, 4, 16
x = torch.randn(B, T, H, E, requires_grad=True)
g, b = torch.randn(E, requires_grad=True), torch.randn(E, requires_grad=True)
x64 = torch.randn(B * T, H * E, requires_grad=True)
g64, b64 = torch.randn(H * E, requires_grad=True), torch.randn(H * E, requires_grad=True)
dy = torch.randn(B, T, H, E)
block = torch.block_diag(*[torch.full((E, 1), 1.0 / E)] * H)  # [64, 4]: per-head means


def moments_by_matmul() -> torch.Tensor:
    xf = x.reshape(-1, H * E)
    mean, sq = xf @ block, (xf * xf) @ block
    rstd = torch.rsqrt(sq - mean * mean + 1e-5)
    expand = block.t() * E
    return ((xf - mean @ expand) * (rstd @ expand)).view_as(x) * g + b


def batch_norm_transposed() -> torch.Tensor:
    rows = x.reshape(-1, E).t().contiguous()  # [16, rows]: a row's 16 values per channel
    y = F.batch_norm(rows, None, None, training=True, eps=1e-5)
    return torch.addcmul(b[:, None], y, g[:, None]).t().reshape(x.shape)


CONTENDERS: dict[str, Callable[[], torch.Tensor]] = {
    "layer_norm": lambda: F.layer_norm(x, (E,), g, b),
    "layer_norm, 64-float rows": lambda: F.layer_norm(x64, (H * E,), g64, b64).view_as(x),
    "layer_norm, no affine": lambda: F.layer_norm(x, (E,)),
    "group_norm": lambda: F.group_norm(x.reshape(-1, H * E), H, g.repeat(H),
                                       b.repeat(H)).view_as(x),
    "rms_norm + bias": lambda: F.rms_norm(x, (E,), g, 1e-5) + b,
    "moments by matmul": moments_by_matmul,
    "batch_norm, transposed": batch_norm_transposed,
}


def timed(fn: Callable[[], object], n: int = 100) -> float:
    """Median µs per call over 9 rounds of n calls (`common.paired_timing`, 5 warm-up calls)."""
    return 1e6 * median(paired_timing({"fn": fn}, repeats=9, inner=n, warmup=5)["fn"])


ref = F.layer_norm(x, (E,), g, b)
print(f"{torch.get_num_threads()} thread(s), x {list(x.shape)}, median of 9 x 100 calls")
for name, fn in CONTENDERS.items():
    with torch.no_grad():
        fwd = timed(fn)
        err = "" if "64" in name or "rms" in name or "affine" in name else (
            f", max |diff| vs layer_norm {float((fn() - ref).abs().max()):.1e}")
    both = timed(lambda fn=fn: fn().backward(dy))
    per = 1e3 * fwd / x.numel()
    print(f"  {name:26s} forward {fwd:7.1f} us ({per:4.2f} ns/element), forward + backward "
          f"{both:7.1f} us{err}")
