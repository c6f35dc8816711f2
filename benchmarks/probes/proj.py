"""One-off probe behind a number in docs/performance.md (second session); not part of make bench.

    .venv/bin/python benchmarks/probes/proj.py 
"""
import torch, time, statistics as st
torch.set_num_threads(1)
B,T,d,h,e = 128,17,64,4,16
x = torch.randn(B,T,d, requires_grad=True)
Ws = [torch.randn(h,d,e, requires_grad=True) for _ in range(3)]
def sep():
    return [(x @ W.transpose(0,1).reshape(d,h*e)).unflatten(-1,(h,e)) for W in Ws]
def fused():
    W = torch.cat([w.transpose(0,1) for w in Ws], dim=1)
    return list((x @ W.flatten(1)).unflatten(-1, W.shape[1:]).split(h, dim=-2))
def fused_contig():
    return [p.contiguous() for p in fused()]
cos = torch.randn(B,T,1,e); sin = torch.randn(B,T,1,e)
def rope(t):
    r = torch.cat([-t[..., e//2:], t[..., :e//2]], -1); return t*cos + r*sin
def full(proj):
    def f():
        q,k,v = proj()
        q, k = rope(q), rope(k)
        z = torch.nn.functional.scaled_dot_product_attention(q.transpose(1,2), k.transpose(1,2), v.transpose(1,2), is_causal=True)
        z.sum().backward()
    return f
fs = {"sep": full(sep), "fused": full(fused), "fused_contig": full(fused_contig)}
ts = {k: [] for k in fs}
for f in fs.values(): f()
for r in range(60):
    for k, f in fs.items():
        t0 = time.perf_counter(); f(); ts[k].append(time.perf_counter()-t0)
for k in fs: print(k, f"{1e3*st.median(ts[k]):.2f} ms, min {1e3*min(ts[k]):.2f}")
