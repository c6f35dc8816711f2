"""Slow suite (`make test-slow`, not in CI): the shipped quick recipe really learns its task."""

from __future__ import annotations

from pathlib import Path

import pytest

from normlab.cli import eval_run
from normlab.config import load_config
from normlab.train import train

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize("placement", ["pre", "qkv"])
def test_quick_recipe_reaches_99_percent_on_train_cells(tmp_path: Path, placement: str) -> None:
    """About 13 minutes each on one CPU thread (docs/results.md, section 2)."""
    cfg = load_config(ROOT / "configs" / "addition" / f"{placement}.toml")
    train(cfg, tmp_path / "run", progress=False)
    result = eval_run(tmp_path / "run")
    assert result["splits"]["train"]["accuracy"] >= 0.99
