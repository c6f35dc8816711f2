"""One-off probe behind a number in docs/performance.md (second session); not part of make bench.

    .venv/bin/python benchmarks/probes/parts.py .
"""
import sys, time, torch, statistics as st
src = sys.argv[1]
sys.path.insert(0, src + "/src"); sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from bench_train_step import base_config, real_batch, model_config
from normlab import build_model
from normlab.train import loss_on
torch.set_num_threads(1)
run = base_config(); batch = real_batch(run)
for pl in ("pre", "qkv"):
    torch.manual_seed(0)
    m = build_model(model_config(run, 64, pl)); m.train()
    params = list(m.parameters())
    opts = {f: torch.optim.AdamW(params, lr=1e-3, fused=f, foreach=False if not f else None) for f in (False, True)}
    def fb():
        loss = loss_on(m, batch)[0]; m.zero_grad(set_to_none=True); loss.backward()
    def f_only():
        with torch.no_grad(): loss_on(m, batch)
    fb()
    res = {"fwd": [], "fwdbwd": [], "opt_loop": [], "opt_fused": [], "clip": []}
    for r in range(15):
        t0 = time.perf_counter(); f_only(); res["fwd"].append(time.perf_counter()-t0)
        t0 = time.perf_counter(); fb(); res["fwdbwd"].append(time.perf_counter()-t0)
        t0 = time.perf_counter(); torch.nn.utils.clip_grad_norm_(params, 1.0); res["clip"].append(time.perf_counter()-t0)
        for f in (False, True):
            t0 = time.perf_counter(); opts[f].step(); res["opt_fused" if f else "opt_loop"].append(time.perf_counter()-t0)
    print(pl, len(params), {k: f"{1e3*st.median(v):.2f}" for k, v in res.items()})
