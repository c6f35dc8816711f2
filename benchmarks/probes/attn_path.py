"""One-off probe behind `EXPLICIT_MAX_KEYS_CPU` (ninth session); not part of make bench.

Causal attention forward+backward on CPU, ~3k query positions per call, 4 heads of 16, at
growing row lengths: SDPA (its CPU flash kernel, as the model ran with no hooks before), the
explicit path with masked_fill (the old hooked path) and the explicit path with the scale and
mask applied in one `addcmul` (the model's explicit path now; bitwise equal to masked_fill).

    .venv/bin/python benchmarks/probes/attn_path.py THREADS
"""
import statistics as st
import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
torch.manual_seed(0)
H, E = 4, 16
print(f"threads {torch.get_num_threads()}, torch {torch.__version__}; median ms of 15, fwd / fwd+bwd")
for T in [17, 24, 48, 96, 192, 384]:
    N = max(1, 3072 // T)
    q, k, v = (torch.randn(N, H, T, E, requires_grad=True) for _ in range(3))
    scale = torch.full((H, 1, 1), E ** -0.5)
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal, scale=E ** -0.5)

    def masked_fill() -> torch.Tensor:
        s = (q @ k.transpose(-1, -2)) * scale
        return s.masked_fill(~causal, float("-inf")).softmax(-1) @ v

    def addcmul() -> torch.Tensor:
        bias = torch.zeros(causal.shape).masked_fill_(~causal, float("-inf"))
        return torch.addcmul(bias, q @ k.transpose(-1, -2), scale).softmax(-1) @ v

    fs = {"sdpa": sdpa, "masked_fill": masked_fill, "addcmul": addcmul}
    assert torch.equal(addcmul(), masked_fill())
    go = torch.randn(N, H, T, E)
    fwd: dict[str, list[float]] = {n: [] for n in fs}
    both: dict[str, list[float]] = {n: [] for n in fs}
    for _ in range(15):  # alternating
        for n, f in fs.items():
            t0 = time.perf_counter()
            y = f()
            t1 = time.perf_counter()
            y.backward(go)
            both[n].append(time.perf_counter() - t0)
            fwd[n].append(t1 - t0)
    print(f"T={T:3d} x {N:3d}: " + "   ".join(
        f"{n} {1e3 * st.median(fwd[n]):.2f} / {1e3 * st.median(both[n]):.2f}" for n in fs)
        + f"   sdpa/addcmul f+b {st.median(both['sdpa']) / st.median(both['addcmul']):.2f}")
