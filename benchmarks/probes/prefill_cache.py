"""One-off probe behind a twenty-second-session note in docs/performance.md; not part of make
bench.

Why does a cached decode's prompt forward cost more than the same forward without a cache?
bench_decode's n5d1 prompts (a `pre` decoder of the quick-grid size, random weights, 256
prompts of 16 tokens, glibc keeping freed memory as the benchmarks run), the prompt forward
five ways, in a shuffled order each round (median of 31 rounds, after two warm-ups):
without a cache (twice, as a control of the spread); with the cache as decoding fills it;
with the cache but attention reading the fresh keys/values rather than the buffers' views;
with a cache whose `append_kv` writes nothing (no buffers); and one that only keeps the
fresh keys/values alive (no buffers, no copy). Minor page faults per forward are printed.

    .venv/bin/python benchmarks/probes/prefill_cache.py [THREADS]
"""
import resource
import statistics as st
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import N5d1Decoder, probe_header, shuffled, threads_from_argv
from bench_train_step import base_config

from normlab import allocator
from normlab.model import attention
from normlab.model.generate import _pad
from normlab.tasks.addition import aux_positions

allocator.keep_freed_memory()
threads_from_argv("prefill_cache.py")
probe_header("prefill_cache.py")
cell = N5d1Decoder(base_config())
model = cell.model
seq, mask = _pad(cell.prompts, 0, left=True)
aux = _pad([aux_positions(p, "sequence") for p in cell.prompts], 0, left=True)[0]
append_kv = attention.append_kv


def reads_fresh(cache: dict, k: torch.Tensor, v: torch.Tensor) -> tuple:
    append_kv(cache, k, v)
    return k, v


def writes_nothing(cache: dict, k: torch.Tensor, v: torch.Tensor) -> tuple:
    return k, v


def keeps_alive(cache: dict, k: torch.Tensor, v: torch.Tensor) -> tuple:
    cache["kept"] = (k, v)
    return k, v


def prefill(cached: bool, variant: Callable | None = None) -> Callable[[], None]:
    def fn() -> None:
        attention.append_kv = variant or append_kv
        try:
            cache = model.new_cache(seq.shape[1] + cell.max_new - 1) if cached else None
            model(seq, attention_mask=mask, cache=cache, aux=aux)
        finally:
            attention.append_kv = append_kv
    return fn


ways = {
    "no cache": prefill(False),
    "no cache (again)": prefill(False),
    "cache, as decoding fills it": prefill(True),
    "cache, attention reads fresh k, v": prefill(True, reads_fresh),
    "cache, no buffers written": prefill(True, writes_nothing),
    "cache, fresh k, v kept alive only": prefill(True, keeps_alive),
}
with torch.no_grad():
    times = shuffled(ways, rounds=31)
    faults = {}
    for name, fn in ways.items():
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(10):
            fn()
        faults[name] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 10
base = st.median(times["no cache"])
print(f"n5d1 prompt forward, {seq.shape[0]} prompts of {seq.shape[1]} tokens; median ms of 31 "
      "shuffled rounds")
for name, t in times.items():
    ms = 1e3 * st.median(t)
    print(f"  {name:36s} {ms:6.2f} ms ({ms - 1e3 * base:+5.2f}), {faults[name]:.0f} minor "
          "faults a forward")
