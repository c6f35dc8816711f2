"""One-off probe behind twenty-eighth- to thirty-first-session numbers in docs/performance.md; not
make bench.

How far past 64 keys `native.attention` stays faster than SDPA's CPU kernel, and so how far
`Attention` lets it run (`attention.KERNEL_BOUNDS_CPU`): T = S keys from 64 to 512, 4 heads,
about 2176 positions a call (the training batch's, 128 x 17), for twenty-three cases (the
twenty-eighth session ran the six with d_head 16 and 64, the twenty-ninth those and d_head 32's
two, the thirtieth the first fifteen):

- `train causal d16` / `d32` / `d64` / `d8` / `d4` / `d12`: forward and backward, a causal
  mask, d_head 16 (the configs'), 32, 64 (GPT-2's), or the narrow heads that the second bound
  (512 keys, 4096 key floats) lets past 256 keys: 8 and 4 to 512 keys, 12 to 341;
- `infer causal d16` / `d32` / `d64` / `d8` / `d4` / `d12`: the forward alone, no autograd
  (evaluation, a prompt's forward);
- `infer padded d16` / `d8`: the forward alone under a mask that differs by row (causal and a
  left padding of 0 to S/4 keys, as a batch of prompts has), which the kernel copies lane-major
  for each eight rows;
- `infer unmasked d16`: the forward alone with no mask (an encoder's);
- `train causal d13` / `d14` / `d15` / `d12 between` and their `infer` cases: the head widths
  the second bound admits past 256 keys without a measurement behind them (to 315, 292, 273
  and 341 keys), each at 256 keys and at all four widths' last admitted counts, so past its
  own bound too.

Each contender's median time over 9 rounds, alternating in one process; printed as the
kernel's time and SDPA's over it (above 1: the kernel is faster).

    .venv/bin/python benchmarks/probes/attention_range.py [THREADS]
"""
import statistics as st
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import probe_header, threads_from_argv

from normlab import allocator
from normlab.model import native

allocator.keep_freed_memory()
threads_from_argv("attention_range.py")
probe_header("attention_range.py")
H, POSITIONS = 4, 2176
KEYS = (64, 96, 128, 192, 256, 384, 512)
BETWEEN = (256, 273, 292, 315, 341)  # 256, then the second bound's last for d_head 15 to 12
CASES = dict.fromkeys(
    ("train causal d16", "infer causal d16", "infer padded d16", "infer unmasked d16",
     "train causal d64", "infer causal d64", "train causal d32", "infer causal d32",
     "train causal d8", "infer causal d8", "infer padded d8", "train causal d4",
     "infer causal d4", "train causal d12", "infer causal d12"), KEYS) | {
    f"{mode} causal d{d}": BETWEEN for d in (13, 14, 15) for mode in ("train", "infer")} | {
    f"{mode} causal d12 between": BETWEEN for mode in ("train", "infer")}


def mask_for(case: str, b: int, t: int) -> torch.Tensor | None:
    """The case's boolean mask, True where a query may attend: [1, 1, T, S] causal, [B, 1, T, S]
    causal and left-padded (each query still sees itself), or None."""
    if "unmasked" in case:
        return None
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
    if "padded" not in case:
        return causal
    pad = torch.arange(b) % (t // 4 + 1)  # row i's first pad[i] keys are padding
    real = torch.arange(t)[None, :] >= pad[:, None]
    return (causal & real[:, None, None, :]) | torch.eye(t, dtype=torch.bool)[None, None]


def contenders(case: str, t: int) -> tuple[int, dict[str, Callable[[], object]]]:
    """The batch for t keys, and the kernel's and SDPA's call for the case."""
    d = int(case.split(" d", 1)[1].split()[0])
    train = case.startswith("train")
    b = max(1, POSITIONS // t)
    g = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(b, H, t, d, generator=g).requires_grad_(train) for _ in range(3))
    scale = torch.full((H,), d ** -0.5)
    mask = mask_for(case, b, t)
    gz = torch.randn(b, H, t, d, generator=g)

    def kernel() -> object:
        z = native.attention(q, k, v, scale, mask)
        return torch.autograd.grad(z, (q, k, v), gz) if train else z

    def sdpa() -> object:
        z = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=d ** -0.5)
        return torch.autograd.grad(z, (q, k, v), gz) if train else z

    return b, {"kernel": kernel, "sdpa": sdpa}


print("case, keys, batch: kernel ms; SDPA / kernel (time, median of 9 rounds)")
for case, keys in CASES.items():
    for t in keys:
        b, fns = contenders(case, t)
        work = b * H * t * t * (3 if case.startswith("train") else 1)
        inner = max(1, int(4e6 // work))
        with torch.set_grad_enabled(case.startswith("train")):
            for f in fns.values():
                f()
            times: dict[str, list[float]] = {n: [] for n in fns}
            for r in range(9):
                for name in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
                    t0 = time.perf_counter()
                    for _ in range(inner):
                        fns[name]()
                    times[name].append((time.perf_counter() - t0) / inner)
        m = {n: st.median(v) for n, v in times.items()}
        print(f"  {case:26s} {t:3d} keys, batch {b:3d}: kernel {1e3 * m['kernel']:7.3f} ms; "
              f"SDPA {m['sdpa'] / m['kernel']:.2f}x", flush=True)
