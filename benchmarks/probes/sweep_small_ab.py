"""One-off probe behind a twenty-fourth-session note in docs/performance.md; not part of make
bench.

Three small changes to the collapse sweep's perturbed forwards, tried and not kept, each
switched off and on, alternating in one process (11 rounds), on bench_collapse's vectorised
sweep (its `sweep_seconds`; the flips it counts are checked equal both ways):

- flat: the noise hook's multiply over a flat last dimension ([n, p, H*e] x [n, p, 1])
  where ATen's broadcast inner loop ran over 16 floats ([n, p, H, e] x [n, p, 1, 1]); the
  same products, bit for bit.
- hm: the noise hook's product written head-major (the layout attention reads v in), to
  save attention's copy of v.
- gelu: the MLP's GELU in place (`aten::gelu_`) when nothing records a graph and no hook
  reads `hook_pre`, so the hidden activation is written once, not twice.

    .venv/bin/python benchmarks/probes/sweep_small_ab.py [THREADS]
"""
import statistics as st
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import Sweep, probe_header, threads_from_argv

import normlab.analysis.collapse as collapse
from normlab import allocator
from normlab.model import mlp

allocator.keep_freed_memory()
threads_from_argv("sweep_small_ab.py")
probe_header("collapse sweep: three small changes, A/B")
ORIGINAL_FORWARD, ORIGINAL_HOOK = mlp.MLP.forward, collapse._scale_hook


def gelu_in_place(self: mlp.MLP, x: torch.Tensor) -> torch.Tensor:
    """MLP.forward for the sweep's model (standard GELU MLP, no biases), GELU in place."""
    h = x @ self.W_in
    if torch.is_grad_enabled() or self.hook_pre.fns:
        return ORIGINAL_FORWARD(self, x)
    return self.hook_post(torch.ops.aten.gelu_(h)) @ self.W_out


def scale_hook(layout: str) -> Callable:
    """`_scale_hook` for token-mode noise on every head (the sweep's), by `layout`."""
    def make(table: torch.Tensor, head_mask: torch.Tensor) -> Callable:
        assert bool(head_mask.all()) and table.dim() == 2

        def fn(x: torch.Tensor, hook: object) -> torch.Tensor:
            n, p, h, e = x.shape
            f = 1 + table[:, :p]
            if layout == "flat":
                return (x.view(n, p, h * e) * f[:, :, None]).view(x.shape)
            out = torch.empty(n, h, p, e).transpose(1, 2)  # head-major memory
            return torch.mul(x, f[:, :, None, None], out=out)
        return fn
    return make


def switch_for(change: str) -> Callable[[bool], None]:
    def switch(on: bool) -> None:
        mlp.MLP.forward = gelu_in_place if on and change == "gelu" else ORIGINAL_FORWARD
        collapse._scale_hook = (scale_hook(change) if on and change in ("flat", "hm")
                                else ORIGINAL_HOOK)
    return switch


sweep = Sweep()
for change in ("flat", "hm", "gelu"):
    switch = switch_for(change)
    flips = []
    for on in (False, True):
        switch(on)
        flips.append(sweep.vectorised()["rows"]["rate"])
    assert torch.equal(*flips), f"{change}: other flips"
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(11):
        for on in (False, True) if r % 2 == 0 else (True, False):
            switch(on)
            times[on].append(sweep.vectorised()["sweep_seconds"])
    switch(False)
    ratios = [a / b for a, b in zip(times[False], times[True], strict=True)]
    print(f"  {change:5s} sweep off {1e3 * st.median(times[False]):7.2f} ms, on "
          f"{1e3 * st.median(times[True]):7.2f} ms, off / on {st.median(ratios):.3f} "
          f"[{min(ratios):.3f}, {max(ratios):.3f}], same flips")
