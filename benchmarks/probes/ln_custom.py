"""One-off probe behind a ninth-session note in docs/performance.md; not part of make bench.

QKV-Norm's per-head LayerNorm on the training step's shape [2176, 4, 16], forward + backward:
`F.layer_norm` against a hand-written autograd Function (`var_mean`, closed-form backward),
median ms of 60 alternating calls.

    .venv/bin/python benchmarks/probes/ln_custom.py THREADS
"""
import statistics as st
import sys
import time

import torch
import torch.nn.functional as F

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
torch.manual_seed(0)
N, H, E = 2176, 4, 16
x = torch.randn(N, H, E, requires_grad=True)
g, b = torch.randn(E, requires_grad=True), torch.randn(E, requires_grad=True)
go = torch.randn(N, H, E)


class LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, g, b):  # noqa: ANN001, ANN205
        var, mu = torch.var_mean(x, -1, keepdim=True, correction=0)
        rstd = (var + 1e-5).rsqrt_()
        xhat = (x - mu).mul_(rstd)
        ctx.save_for_backward(xhat, rstd, g)
        return torch.addcmul(b, xhat, g)

    @staticmethod
    def backward(ctx, dy):  # noqa: ANN001, ANN205
        xhat, rstd, g = ctx.saved_tensors
        gy = dy * g
        dx = (gy - gy.mean(-1, keepdim=True)).sub_(xhat * (gy * xhat).mean(-1, keepdim=True))
        dims = tuple(range(dy.dim() - 1))
        return dx.mul_(rstd), (dy * xhat).sum(dims), dy.sum(dims)


fs = {"F.layer_norm": lambda: F.layer_norm(x, (E,), g, b, 1e-5),
      "hand-written": lambda: LayerNorm.apply(x, g, b)}
outs = []
for f in fs.values():
    x.grad = g.grad = b.grad = None
    y = f()
    y.backward(go)
    outs.append((y.detach(), x.grad.clone()))
print("max |diff| output", float((outs[0][0] - outs[1][0]).abs().max()),
      "grad", float((outs[0][1] - outs[1][1]).abs().max()))
ts: dict[str, list[float]] = {n: [] for n in fs}
for _ in range(60):
    for n, f in fs.items():
        t0 = time.perf_counter()
        f().backward(go)
        ts[n].append(time.perf_counter() - t0)
print(f"{torch.get_num_threads()} thread(s): " + ", ".join(
    f"{n} {1e3 * st.median(v):.2f} ms" for n, v in ts.items()))
