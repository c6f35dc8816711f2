"""benchmarks/bench_mfu.py's FLOP count (MFU's numerator, the scaling rows' prediction) against
torch's own FLOP counter on the same step, and its causal count against one by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_mfu import flops_per_step, model_flops, n_matmul
from normlab import ModelConfig, build_model
from normlab.model import native
from normlab.train import loss_on


@pytest.fixture
def torch_ops_only():
    """The CPU kernels off: torch's counter sees only torch's ops (a ctypes call, none), and
    with them off the attention is torch's explicit matmuls over every key."""
    native.set_enabled(False)
    yield
    native.set_enabled(True)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("gated", [False, True])
def test_the_count_is_torchs_flop_counter_on_a_step(gated: bool, tied: bool,
                                                    torch_ops_only: None) -> None:
    """Tied embeddings: the count left the unembedding out (it looked for W_U, which a tied
    model has none of), d_model x vocab short."""
    cfg = ModelConfig(vocab_size=16, d_model=32, n_heads=4, n_layers=2, d_mlp=64, max_len=16,
                      norm_placement="pre", pos_encoding="rope",
                      mlp_type="gated" if gated else "standard", act="silu" if gated else "gelu",
                      tie_embeddings=tied)
    model = build_model(cfg)
    b, t = 3, 11
    tokens = torch.randint(0, 16, (b, t))
    batch = {"tokens": tokens, "targets": tokens}
    shape = (b, t, n_matmul(model), cfg.n_layers, cfg.n_heads * cfg.d_head)
    with FlopCounterMode(display=False) as counter:
        loss_on(model, batch)[0].backward()
    assert counter.get_total_flops() == model_flops(*shape)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(tokens)
    assert counter.get_total_flops() == model_flops(*shape, passes=1)


def test_the_causal_count_takes_the_keys_each_query_sees() -> None:
    """Three positions see 1 + 2 + 3 keys: half the square and the diagonal."""
    n_mm, layers, d_attn = 100, 2, 8
    by_hand = 2 * (2 * n_mm * 3 + 4 * layers * d_attn * (1 + 2 + 3))  # two rows, a forward
    assert model_flops(2, 3, n_mm, layers, d_attn, passes=1, causal=True) == by_hand
    assert model_flops(2, 1, n_mm, layers, d_attn, causal=True) == model_flops(
        2, 1, n_mm, layers, d_attn)
    f = flops_per_step(64, 128, 17)
    assert f["dense_flops"] < f["causal_flops"] < f["flops"] == f["dense_flops"] + f["attn_flops"]


def test_mfu_takes_its_interval_from_the_step_times() -> None:
    """MFU is the count over the time: the slow end of the time's CI is MFU's low end, the
    coverage is the time's, and a summary without a CI (an older result) gives none."""
    from bench_mfu import _utilisation
    from common import summary

    f = {"flops": 8.0, "causal_flops": 6.0}
    times = summary([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])  # 7 repeats: [min, max], 98.4%
    assert times["ci_s"] == [1.0, 7.0] and times["ci_coverage"] == pytest.approx(1 - 2 / 128)
    u = _utilisation(f, times, peak=2.0)
    assert (u["mfu"], u["mfu_causal"], u["mfu_ci"]) == (1.0, 0.75, [8 / 7 / 2, 4.0])
    assert u["ci_coverage"] == times["ci_coverage"]
    assert u["times_s"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]  # kept, to recompute the CI
    assert "mfu_ci" not in _utilisation(f, {"median_s": 4.0}, peak=2.0)
