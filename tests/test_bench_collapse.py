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
