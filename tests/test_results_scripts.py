"""The scripts under docs/results/ that docs/results.md quotes, run on a tiny study."""

from __future__ import annotations

import json
import runpy
import shutil
from pathlib import Path

import pytest

from normlab.analysis.report import analyze_run
from normlab.config import load_config
from normlab.train import train

SCRIPTS = Path(__file__).resolve().parents[1] / "docs" / "results"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny trained and analysed run, in a folder of runs as `reproduce` writes them."""
    root = tmp_path_factory.mktemp("study") / "runs"
    cfg = load_config(None, ["task.grid='smoke'", "train.steps=30", "model.d_model=32",
                             "model.n_layers=1", "model.n_heads=4", "train.batch_size=16",
                             "train.eval_examples=4", "train.log_every=10"])
    train(cfg, root / "pre-s0", progress=False, log=lambda s: None)
    analyze_run(root / "pre-s0", n_examples=16, n_draws=4, sigmas=[0.0, 0.1, 0.2], seed=5,
                splits="train", threshold=0.3, figures=False)  # 0.3: sparse rows both ways
    return root


def _main(name: str):
    return runpy.run_path(str(SCRIPTS / f"{name}.py"))["main"]


def test_rows_loss_analyses_again_with_the_recorded_settings_and_prints_both(
        runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _main("rows_loss")(runs, tmp_path / "again", 0.1)
    before = json.loads((runs / "pre-s0/analysis/collapse.json").read_text())
    after = json.loads((tmp_path / "again/pre-s0/collapse.json").read_text())
    assert after["params"]["rows"] == "loss" and before["params"]["rows"] == "all"
    for same in ("sigmas", "n_draws", "threshold", "noise", "mode"):  # the recorded settings
        assert after[same] == before[same], same
    assert after["seed"] == before["seed"] == 5
    assert after["params"]["splits"] == before["params"]["splits"] == ["train"]
    assert after["n_rows"] < before["n_rows"]  # a decoder's final E and last question left out
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2
    for line, c in zip(lines, (before, after), strict=True):
        lo, hi = c["collapse_ci95"][1]
        assert f"{c['n_sparse_rows']:,} sparse of {c['n_rows']:,} rows" in line
        assert f"{100 * c['collapse_rate'][1]:.3f}% [{100 * lo:.3f}, {100 * hi:.3f}]" in line


def test_rows_loss_says_when_a_run_has_no_sparse_rows(
        runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """At theta 0.5 the tiny model's loss rows hold no sparse row: its rate is None (the script
    multiplied it by 100)."""
    shutil.copytree(runs / "pre-s0", tmp_path / "runs/pre-s0")
    analyze_run(tmp_path / "runs/pre-s0", n_examples=16, n_draws=4, sigmas=[0.0, 0.1], seed=5,
                splits="train", threshold=0.5, figures=False)
    _main("rows_loss")(tmp_path / "runs", tmp_path / "again", 0.1)
    after = json.loads((tmp_path / "again/pre-s0/collapse.json").read_text())
    assert after["n_sparse_rows"] == 0 and after["collapse_rate"] == [None, None]
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == f"pre-s0 rows=loss: 0 sparse of {after['n_rows']:,} rows; no collapse rate"


def test_rows_loss_refuses_bad_input_before_any_analysis(runs: Path, tmp_path: Path) -> None:
    main = _main("rows_loss")
    with pytest.raises(SystemExit, match=r"^--sigma: expected one of pre-s0's sigmas "
                                         r"\[0\.0, 0\.1, 0\.2\]; got 0\.3$"):
        main(runs, tmp_path / "again", 0.3)
    assert not (tmp_path / "again").exists()
    with pytest.raises(SystemExit, match="expected a folder of run folders"):
        main(tmp_path / "nowhere", tmp_path / "again", 0.1)
    with pytest.raises(SystemExit, match="no run folder with checkpoints/ and an analysis"):
        main(tmp_path, tmp_path / "again", 0.1)


def test_h2_theory_prints_each_runs_measured_over_predicted(
        runs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    c = json.loads((runs / "pre-s0/analysis/collapse.json").read_text())
    _main("h2_theory")(runs)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("pre-s0")
    assert c["predicted_rate"][0] == 0 and "σ=0.0" not in out[0]  # no ratio to 0
    for s, m, p in zip(c["sigmas"][1:], c["collapse_rate"][1:], c["predicted_rate"][1:],
                       strict=True):
        assert f"σ={s}: {m / p:.2f}" in out[0], s
    assert out[1] == (f"  σ=0.2: {100 * c['predicted_rate'][2]:.3f}% predicted, "
                      f"{100 * c['collapse_rate'][2]:.3f}% measured")
    # per layer: its heads' sparse rows, and their rates weighted by them, worked out here
    heads = [h for h in c["per_head"] if h["n_sparse"]]
    n = sum(h["n_sparse"] for h in heads)
    measured = sum(h["n_sparse"] * h["collapse_rate"][2] for h in heads) / n
    assert f"{n} sparse rows, {100 * measured:.2f}% measured" in out[2]


def test_rows_loss_checks_every_runs_sigmas_before_any_analysis(runs: Path,
                                                                 tmp_path: Path) -> None:
    """The second run lacking --sigma was found after the first run's analysis."""
    for name in ("pre-s0", "pre-s1"):
        shutil.copytree(runs / "pre-s0", tmp_path / "runs" / name)
    analyze_run(tmp_path / "runs/pre-s1", n_examples=16, n_draws=2, sigmas=[0.0, 0.2], seed=5,
                splits="train", figures=False)
    with pytest.raises(SystemExit, match=r"^--sigma: expected one of pre-s1's sigmas "
                                         r"\[0\.0, 0\.2\]; got 0\.1$"):
        _main("rows_loss")(tmp_path / "runs", tmp_path / "again", 0.1)
    assert not (tmp_path / "again").exists()
