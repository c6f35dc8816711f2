"""`normlab.analysis.data.evaluating`: eval mode and no autograd inside, each mode restored."""

from __future__ import annotations

import pytest
import torch

from normlab import ModelConfig, build_model
from normlab.analysis.data import evaluating


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(d_model=32, n_heads=4, n_layers=2, dropout=0.5))


def modes(m: torch.nn.Module) -> list[bool]:
    return [x.training for x in m.modules()]


def test_training_model_evaluates_inside_and_trains_after() -> None:
    m = model().train()
    tokens = torch.randint(0, 16, (2, 9))
    with evaluating(m):
        assert not any(modes(m)) and not torch.is_grad_enabled()
        a, b = m(tokens), m(tokens)
        torch.testing.assert_close(a, b)  # dropout off
        assert not a.requires_grad
    assert all(modes(m)) and torch.is_grad_enabled()


def test_mixed_modes_come_back_as_they_were() -> None:
    m = model().train()
    m.blocks[0].eval()
    before = modes(m)
    with evaluating(m):
        assert not any(modes(m))
    assert modes(m) == before


def test_model_already_in_eval_is_not_walked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """No eval()/train() walk over every submodule (the collapse sweep enters ~10 times)."""
    m = model().eval()

    def refuse(*_: object) -> None:
        raise AssertionError("eval()/train() called on a model already in eval mode")

    monkeypatch.setattr(m, "train", refuse)
    monkeypatch.setattr(m, "eval", refuse)
    with evaluating(m):
        m(torch.randint(0, 16, (1, 5)))
    assert not any(modes(m))


def test_modes_restored_when_the_block_raises() -> None:
    m = model().train()
    with pytest.raises(RuntimeError, match="inside"), evaluating(m):
        raise RuntimeError("inside")
    assert all(modes(m))


def test_a_mode_switched_inside_is_undone() -> None:
    m = model().eval()
    with evaluating(m):
        m.train()
    assert not any(modes(m))
