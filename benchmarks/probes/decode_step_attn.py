"""One-off probe behind a fifteenth-session note in docs/performance.md; not part of make bench.

Would SDPA serve cached decoding's one-query steps better than the explicit path that
`EXPLICIT_MAX_KEYS_CPU` picks for short rows? Times one cached step of bench_decode's model
(random weights, batch 256, digit positions) after a prompt of P - 1 tokens, so the step
attends to P keys, with the committed rule and with `EXPLICIT_MAX_KEYS_CPU = 0` (SDPA
whenever no hook reads the pattern), alternating, median of 15 rounds of 20 steps:

    .venv/bin/python benchmarks/probes/decode_step_attn.py pre|qkv [THREADS]
"""
import statistics as st
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import normlab.model.attention as attention
from bench_train_step import base_config, model_config
from normlab import build_model

if len(sys.argv) < 2 or sys.argv[1] not in ("pre", "qkv") or (
        len(sys.argv) > 2 and not sys.argv[2].isdigit()):
    sys.exit("usage: decode_step_attn.py pre|qkv [THREADS]")
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
run = base_config()
torch.manual_seed(0)
model = build_model(model_config(run, run.model.d_model, sys.argv[1])).eval()
b, vocab = 256, run.model.vocab_size
rule = attention.EXPLICIT_MAX_KEYS_CPU


def fresh(layers: list) -> list:
    """Each block's {"self": {"k", "v"}}, copied two deep: a step writes the inner dict."""
    return [{part: dict(kv) for part, kv in layer.items()} for layer in layers]


print(f"{sys.argv[1]}, {torch.get_num_threads()} thread(s), batch {b}; one cached step, "
      f"ms (median of 15 x 20 steps); explicit = rule {rule}, sdpa = rule 0")
with torch.no_grad():
    for keys in (12, 16, 17, 19, 24):
        g = torch.Generator().manual_seed(keys)
        tokens = torch.randint(2, vocab, (b, keys), generator=g)
        aux = torch.randint(0, run.model.n_aux_positions, (b, keys), generator=g)
        cache = model.new_cache()
        model(tokens[:, :-1], cache=cache, aux=aux[:, :-1])
        past = (cache.length, fresh(cache.layers))

        def step(max_keys: int, past=past, tokens=tokens, aux=aux, cache=cache) -> torch.Tensor:
            attention.EXPLICIT_MAX_KEYS_CPU = max_keys
            cache.length, cache.layers = past[0], fresh(past[1])
            return model(tokens[:, -1:], cache=cache, aux=aux[:, -1:])

        same = torch.allclose(step(rule), step(0), atol=1e-5)
        times: dict[int, list[float]] = {rule: [], 0: []}
        for r in range(15):
            for k in (rule, 0) if r % 2 == 0 else (0, rule):
                t0 = time.perf_counter()
                for _ in range(20):
                    step(k)
                times[k].append((time.perf_counter() - t0) / 20 * 1e3)
        ratios = [a / s for a, s in zip(times[rule], times[0], strict=True)]
        print(f"  {keys:2d} keys: explicit {st.median(times[rule]):.3f} ms, sdpa "
              f"{st.median(times[0]):.3f} ms, explicit / sdpa {st.median(ratios):.3f} "
              f"[{min(ratios):.3f}, {max(ratios):.3f}]; same logits: {same}")
attention.EXPLICIT_MAX_KEYS_CPU = rule
