"""One-off probe behind a number in docs/performance.md (second session); not part of make bench.

    .venv/bin/python benchmarks/probes/comp.py pre,qkv e|c
"""
import sys, time, torch
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
from bench_train_step import base_config, real_batch, model_config
from normlab import build_model
from normlab.train import loss_on, make_optimizer
torch.set_num_threads(1)
run = base_config(); batch = real_batch(run)
for pl in sys.argv[1].split(","):
    torch.manual_seed(0)
    model = build_model(model_config(run, 64, pl)); model.train()
    opt = make_optimizer(model, run.train)
    cm = torch.compile(model, dynamic=True) if "c" in sys.argv[2] else model
    def step():
        logits = cm(batch["tokens"], aux=batch["aux"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0,1), batch["targets"].flatten(), ignore_index=-100)
        opt.zero_grad(); loss.backward(); opt.step()
    t0 = time.time(); step(); print(pl, "first step", time.time()-t0, flush=True)
    for _ in range(3): step()
    ts = []
    for _ in range(10):
        t0 = time.perf_counter(); step(); ts.append(time.perf_counter()-t0)
    ts.sort(); print(pl, sys.argv[2], "median ms", 1e3*ts[5])
