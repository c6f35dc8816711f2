"""`normlab.analysis.data`: `evaluating` (eval mode and no autograd inside, each mode restored)
and `select_problems`."""

from __future__ import annotations

import warnings

import pytest
import torch

from normlab import ModelConfig, build_model
from normlab.analysis.data import evaluating, select_problems
from normlab.tasks.addition import TaskConfig, eval_sets


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


def test_examples_past_the_eval_sets_are_all_of_them_said_and_recorded(
        capsys: pytest.CaptureFixture[str]) -> None:
    """5000 examples of 5 cells of 256 were cut to 256 a cell unsaid, and `per_cell` (recorded
    by analyze) read 1000. The smoke grid's train split has 2 cells; eval_size 8 holds 16. It
    is said in one `warning:` line to `warn` (stderr by default), naming the count: a Python
    UserWarning printed a source line too, and named `n_examples` to a user who typed
    `--examples`."""
    task = TaskConfig(grid="smoke", eval_size=8).resolve()
    sets = eval_sets(task)
    said: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said through `warn` only
        chosen, per_cell = select_problems(task, sets, 17, warn=said.append)
        assert per_cell == 8 and chosen == {"train": sets["train"]}
        assert said == ["warning: 17 examples asked for, but the eval sets of the selected "
                        "splits hold 16 problems (2 cells, up to 8 each); analysing those 16"]
        select_problems(task, sets, 17)
        assert capsys.readouterr() == ("", said[0] + "\n")  # the default: one stderr line
        said.clear()  # exactly what the sets hold, or less: nothing said
        assert select_problems(task, sets, 16, warn=said.append) == ({"train": sets["train"]}, 8)
        chosen, per_cell = select_problems(task, sets, 5, warn=said.append)  # ceil(5 / 2)
        assert per_cell == 3 and all(len(p) == 3 for p in chosen["train"].values())
        assert said == []
