"""benchmarks/bench_collapse.py: the naive baseline counts what `measure_collapse` counts, and
stopping its forwards after the last pattern changes no count and skips the rest."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_collapse as B
from normlab.analysis.collapse import (
    DEFAULT_MAX_TOKENS,
    Perturbation,
    find_sparse_rows,
    measure_collapse,
)
from normlab.analysis.data import chunk_copies


def test_naive_loop_stops_after_the_last_pattern_and_counts_the_same_flips() -> None:
    run_cfg, model = B.random_model()
    data = B.eval_data(run_cfg, 6)
    model.eval()
    rows = find_sparse_rows(model, data, threshold=0.9)
    assert len(rows) > 0
    pert = Perturbation(model)
    last_mlp_calls = []
    model.blocks[-1].mlp.register_forward_hook(lambda *a: last_mlp_calls.append(1))
    n_draws = 3
    chunk = chunk_copies(data, DEFAULT_MAX_TOKENS, n_draws)  # the draws' order, as the sweep's
    early = B.naive_sweep(model, data, rows, pert, B.SIGMA, n_draws, chunk)
    assert last_mlp_calls == []  # no forward reached the last MLP
    full = B.naive_sweep(model, data, rows, pert, B.SIGMA, n_draws, chunk, stop_early=False)
    assert len(last_mlp_calls) == n_draws * data.n_examples
    assert torch.equal(early, full) and early.sum() > 0
    res = measure_collapse(model, data, sigmas=[B.SIGMA], n_draws=n_draws, threshold=0.9,
                           theory_draws=1, seed=B.SEED)
    assert torch.equal((res["rows"]["rate"][:, 0] * n_draws).round(), early)


def test_the_sweep_times_leave_out_the_warm_up_call(monkeypatch) -> None:
    """Every contender runs once untimed first, as the Method says (none did, and the first
    repeat carried the first call's cost); the sweep's own times, recorded by each call, are
    then the timed calls' alone, so they pair with the naive loop's repeats."""
    import argparse

    import normlab.analysis.collapse as C

    real, calls = C.measure_collapse, []

    def numbered(*args, **kw):  # the real sweep, its time replaced by the call's number
        res = real(*args, **kw)
        calls.append(kw.get("bucket", True))
        return {**res, "sweep_seconds": float(len(calls))}

    monkeypatch.setattr(C, "measure_collapse", numbered)
    res = B.run(argparse.Namespace(quick=True, threads=1, repeats=2, run=None, device="cpu"))
    # warm-up (bucketed, one width), then the repeats, the order reversed every other one
    assert calls == [True, False, True, False, False, True]
    assert res["warmup"] == 1 and res["vectorised_sweep"]["times_s"] == [3.0, 6.0]
    assert res["one_width_sweep"]["times_s"] == [4.0, 5.0]
    assert res["speedup_sweep"]["n"] == 2
