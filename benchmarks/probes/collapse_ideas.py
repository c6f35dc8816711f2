"""One-off probe behind the eighth session's notes in docs/performance.md; not part of make bench.

Two ideas for a faster collapse sweep, measured on the bench_collapse setup (qkv, random
weights, init_std 0.2, 65 examples, one thread) before writing any code for them:

1. `sdpa`: the sweep reads `hook_pattern` at every site, which forces the explicit
   scores/softmax path in every layer. Upper bound of what the fused SDPA path could save:
   one perturbed forward (7 copies) reading every site's pattern, against the same forward
   that stops at the last layer's rotated keys, so every layer before it runs SDPA.
2. `truncate`: a causal row depends only on positions up to its query, so each example could
   be cut after its last sparse row. How many positions that would save, on random weights
   and on a trained run (RUN_DIR, optional).

    .venv/bin/python benchmarks/probes/collapse_ideas.py [RUN_DIR]
"""
import statistics as st
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_collapse import eval_data, random_model  # noqa: E402

from normlab.analysis.collapse import DEFAULT_MAX_TOKENS, Perturbation, find_sparse_rows  # noqa: E402
from normlab.analysis.data import chunk_copies, collect  # noqa: E402
from normlab.train import load_run  # noqa: E402

torch.set_num_threads(1)


def setup(src: str):
    if src == "random":
        run, model = random_model()
    else:
        run, model, _ = load_run(Path(src))
    return model.eval(), eval_data(run, 64)


model, data = setup("random")
c = chunk_copies(data, DEFAULT_MAX_TOKENS, 16)
pert = Perturbation(model)
hooks = pert.hooks(pert.draw(0.3, c * data.n_examples, data.lengths,
                             torch.Generator().manual_seed(0)))
L = len(model.blocks)
patterns = {f"blocks.{i}.attn.hook_pattern": (lambda p: p[..., 0].argmax(-1)) for i in range(L)}
last_k = {f"blocks.{L - 1}.attn.hook_rot_k": (lambda x: x.sum())}


def forward(take) -> float:
    t0 = time.perf_counter()
    collect(model, data, take, hooks=hooks, copies=c)
    return time.perf_counter() - t0


forward(patterns), forward(last_k)
a, b = [], []
for _ in range(15):  # alternating
    a.append(forward(patterns))
    b.append(forward(last_k))
print(f"sdpa: {c} copies per forward; patterns at every site {1e3 * st.median(a):.1f} ms, "
      f"SDPA up to the last layer's keys {1e3 * st.median(b):.1f} ms "
      f"(ratio {st.median(b) / st.median(a):.3f})")

for src in ["random", *sys.argv[1:]]:
    model, data = setup(src)
    rows = find_sparse_rows(model, data, threshold=0.9)
    last = torch.full((data.n_examples,), -1)
    last.scatter_reduce_(0, rows.example, rows.qpos, reduce="amax")
    width = int(data.widths()[:, 0].sum())
    needed = int((last + 1).clamp(min=0).sum())
    print(f"truncate ({src}): {len(rows)} sparse rows; positions {width}, up to the last "
          f"sparse row {needed} ({1 - needed / width:.1%} saved)")
