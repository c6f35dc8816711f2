"""One-off probe behind a fourteenth-session note in docs/performance.md; not part of make bench.

Why is a cached decode's first forward (the prompt, which also fills the key/value cache)
slower than the same forward without a cache? Times both on bench_decode's n5d1 prompts (256
questions, random weights), alternating, with the minor page faults each forward takes
(`getrusage`): the cache keeps every layer's keys and values alive, so the forward's later
activations get fresh memory from the kernel instead of reusing freed blocks. Run it once as
is and once with glibc told to keep freed memory, e.g.

    .venv/bin/python benchmarks/probes/decode_faults.py [pre|qkv] [THREADS]
    MALLOC_MMAP_THRESHOLD_=1000000000 MALLOC_TRIM_THRESHOLD_=1000000000 \\
        .venv/bin/python benchmarks/probes/decode_faults.py
"""
import os
import resource
import statistics as st
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_train_step import base_config, model_config
from normlab import build_model
from normlab.model.generate import _pad
from normlab.tasks.addition import aux_positions, eval_sets, make_prompts

placement = sys.argv[1] if len(sys.argv) > 1 else "pre"
if placement not in ("pre", "qkv") or (len(sys.argv) > 2 and not sys.argv[2].isdigit()):
    sys.exit("usage: decode_faults.py [pre|qkv] [THREADS]")
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
run = base_config()
sets = eval_sets(run.validate())
cell = next(c for c in sets["extrapolation"] if c.label == "n5d1")
prompts = make_prompts([q for q, _ in sets["extrapolation"][cell][:256]], "decoder")
torch.manual_seed(0)
model = build_model(model_config(run, run.model.d_model, placement)).eval()
tokens, mask = _pad(prompts, 0, left=True)
aux = _pad([aux_positions(p, "sequence") for p in prompts], 0, left=True)[0]


def faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


res: dict[bool, list[tuple[float, int]]] = {True: [], False: []}
with torch.no_grad():
    for _ in range(15):
        for cached in (True, False):
            cache = model.new_cache() if cached else None
            f0, t0 = faults(), time.perf_counter()
            model(tokens, attention_mask=mask, cache=cache, aux=aux)
            res[cached].append((time.perf_counter() - t0, faults() - f0))
            del cache
env = {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}
print(f"{placement}, {torch.get_num_threads()} thread(s), prompt forward [256, "
      f"{tokens.shape[1]}], median of 15; malloc env: {env or 'default'}")
for cached, rows in res.items():
    ms = 1e3 * st.median(t for t, _ in rows)
    print(f"  {'with cache' if cached else 'no cache  '} {ms:6.2f} ms, "
          f"{st.median(f for _, f in rows):6.0f} minor page faults")
