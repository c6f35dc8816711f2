"""benchmarks/bench_hooks.py: which points an unhooked forward calls, by their names."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_hooks import called_points
from bench_train_step import base_config, model_config, real_batch
from normlab import build_model


@pytest.mark.parametrize("placement", ["pre", "qkv"])
def test_a_forward_calls_every_point_but_those_its_fused_paths_skip(placement: str) -> None:
    """The predicted cost scales by these. Skipped, by name: a norm's own two points (with
    nothing attached it returns at once), attention's scores and pattern (the fused attention
    paths form neither), and, with QKV-Norm and RoPE, q and k (the fused QK-Norm + RoPE
    writes the rotated vectors); every other point once."""
    run = base_config()
    batch = real_batch(run)
    model = build_model(model_config(run, run.model.d_model, placement)).eval()
    called = called_points(model, batch["tokens"][:4], batch["aux"][:4])
    skipped = ("hook_scale", "hook_normalized", "hook_attn_scores", "hook_pattern")
    if placement == "qkv":
        skipped += ("attn.hook_q", "attn.hook_k")
    want = [n for n in model.hook_names() if not n.endswith(skipped)]
    assert sorted(called) == sorted(want) and len(called) == len(set(called))
    assert len(called) == {"pre": 54, "qkv": 58}[placement] < len(model.hook_names())
    assert torch.is_grad_enabled()  # the forward's no_grad was its own
