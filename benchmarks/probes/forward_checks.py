"""What the input checks the thirty-ninth and fortieth sessions added to `Stack.run` cost a
forward: the same expressions (a tensor's type and device, the cache's and the source's batch,
positions' dtype, `aux` unasked; since the fortieth, a step's mask and source against its
cache's, `transformer._check_cache`, and the cache's record of them) timed alone, beside one
cached decoding step of the quick grid's model (d 64, 4 layers, RoPE) at 256 prompts, the call
they sit on most often. The checks read attributes only: no tensor is made or read back.

Usage: `.venv/bin/python benchmarks/probes/forward_checks.py` (one torch thread).
"""

from __future__ import annotations

import statistics
import time
import timeit

import torch

from normlab import ModelConfig, build_model
from normlab.model.transformer import _check_cache


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_model(ModelConfig(d_model=64, n_heads=4, n_layers=4, pos_encoding="rope"))
    model.eval()
    stack, b = model, 256
    cache = model.new_cache(64)
    with torch.no_grad():
        model(torch.randint(0, 16, (b, 20)), cache=cache)
    step = torch.randint(0, 16, (b, 1))
    positions = aux = memory = key_mask = None

    def checks() -> None:  # as Stack.run writes them
        if not isinstance(step, torch.Tensor) or step.ndim != 2:
            raise AssertionError
        if step.device != stack.embed.W_E.device:
            raise AssertionError
        past = cache.length
        if past and (kept := cache.layers[0].get("self", {}).get("k")) is not None \
                and kept.shape[0] != b:
            raise AssertionError
        if memory is not None or (positions is not None and positions.is_floating_point()):
            raise AssertionError
        if aux is not None and stack.W_aux is None:
            raise AssertionError
        if past:
            _check_cache(cache, key_mask, memory, "attention_mask")
        cache.masked |= key_mask is not None  # the record a step leaves
        cache.memory = memory

    def steps() -> float:
        """Microseconds a cached step, over 40 steps after a fresh 20-token prefill."""
        fresh = model.new_cache(64)
        with torch.no_grad():
            model(torch.randint(0, 16, (b, 20)), cache=fresh)
            t0 = time.perf_counter()
            for _ in range(40):
                model(step, cache=fresh)
            return (time.perf_counter() - t0) / 40 * 1e6

    n = 100_000
    check_us = [timeit.timeit(checks, number=n) / n * 1e6 for _ in range(5)]
    step_us = [steps() for _ in range(5)]
    c, s = statistics.median(check_us), statistics.median(step_us)
    print(f"checks {c:.2f} us, cached step {s:.0f} us (medians of 5): {100 * c / s:.3f}%")


if __name__ == "__main__":
    main()
