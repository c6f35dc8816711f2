"""One-off probe behind a number in docs/performance.md (second session); not part of make bench.

    .venv/bin/python benchmarks/probes/ln.py 
"""
import torch, time, torch.nn.functional as F
torch.set_num_threads(1)
N,h,e = 2176, 4, 16
x = torch.randn(N, h, e, requires_grad=True); g = torch.ones(e, requires_grad=True); b = torch.zeros(e, requires_grad=True)
go = torch.randn(N,h,e)
def ln(): return F.layer_norm(x, (e,), g, b, 1e-5)
def ln_noaff(): return F.layer_norm(x, (e,), None, None, 1e-5) * g + b
def rms(): return F.rms_norm(x, (e,), g, 1e-5)
def manual():
    xc = x - x.mean(-1, keepdim=True)
    return xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + 1e-5) * g + b
def manual_flat():  # reduce via matmul
    xf = x.reshape(N, h*e)
    M = torch.block_diag(*[torch.full((e,1), 1/e)]*h)  # [h*e, h]
    mu = xf @ M
    xc = (xf.view(N,h,e) - mu[..., None])
    var = xc.reshape(N,h*e).square() @ M
    return torch.addcmul(b, xc * torch.rsqrt(var + 1e-5)[..., None], g)
def gn():
    return F.group_norm(x.reshape(N, h*e), h, g.repeat(h), b.repeat(h), 1e-5).view(N,h,e)
for f in (ln, ln_noaff, rms, manual, manual_flat, gn):
    for mode in ("fwd", "fwd+bwd"):
        ts=[]
        for _ in range(50):
            t0=time.perf_counter(); y=f()
            if mode!="fwd": y.backward(go)
            ts.append(time.perf_counter()-t0)
        ts.sort(); print(f.__name__, mode, f"{1e6*ts[25]:.0f} us")
