"""`benchmarks/bench_decode.py --config`: another decoder recipe's size and grid, its longest
extrapolation cells decoded with and without the cache to the same tokens; bad recipes are one
line before any work."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_decode
from common import ROOT


def _main(monkeypatch: pytest.MonkeyPatch, *args: str) -> None:
    """The benchmark's command line, one repeat (the timings are not under test)."""
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--quick", "--repeats", "1", *args])
    bench_decode.main()


def test_paper_recipe_decodes_its_own_longest_cells(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The paper grid's extrapolation cells are n = 6 (d 1-4) and d = 5 (n 1, 2, 4, 5): the
    longest prompt is n6d4's, the longest answer n5d5's; the model is the recipe's (d_model
    128), and both paths give the same tokens, every question `max_new` of them."""
    out, recipe = tmp_path / "r.json", str(ROOT / "configs" / "addition" / "paper" / "pre.toml")
    _main(monkeypatch, "--config", recipe, "--out", str(out))
    res = json.loads(out.read_text())
    assert (res["config"], res["grid"], res["d_model"]) == (
        "configs/addition/paper/pre.toml", "paper", 128)  # recorded relative to the repository
    assert [r["cell"] for r in res["results"]] == ["n6d4", "n5d5"]
    for r in res["results"]:
        assert r["identical_outputs"] and r["generated_all"]
        assert r["speedup"]["median"] > 0


def test_default_recipe_is_the_quick_grid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    """Without --config (and from run_all, which passes none) the quick recipe's n5d1 and n2d3,
    as `make bench` has always timed them."""
    out = tmp_path / "r.json"
    _main(monkeypatch, "--out", str(out))
    res = json.loads(out.read_text())
    assert (res["config"], res["grid"], res["d_model"]) == (
        "configs/addition/pre.toml", "quick", 64)
    assert [r["cell"] for r in res["results"]] == ["n5d1", "n2d3"]


def test_custom_splits_are_recorded_as_custom(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A recipe's own extrapolation cells are decoded, and the JSON does not call them the
    grid's."""
    path, out = tmp_path / "recipe.toml", tmp_path / "r.json"
    path.write_text("[task]\nsplits = { extrapolation = [[3, 1]] }\n")
    _main(monkeypatch, "--config", str(path), "--out", str(out))
    res = json.loads(out.read_text())
    assert (res["config"], res["grid"]) == (str(path), "custom")
    assert [r["cell"] for r in res["results"]] == ["n3d1"]


@pytest.mark.parametrize(("text", "expected"), [
    (None, "config file '{path}' not found"),
    ('[model]\narch = "encoder_decoder"\n',
     "--config {path}: model.arch must be 'decoder' (the benchmark decodes prompts alone); "
     "got 'encoder_decoder'"),
    ("[model\n", "config file '{path}': invalid TOML"),
    ("[task]\nsplits = { interpolation = [[3, 1]] }\n",
     "--config {path}: the task has no 'extrapolation' cells to decode"),
    # a sweep file, not a recipe
    ("[base]\n", "config file '{path}': config.base: unknown table"),
    ("[model]\nd_model = -1\n", "config file '{path}': model.d_model: expected a positive"),
])
def test_bad_recipe_is_one_line_before_any_work(
    text: str | None, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Each names the file and what is wrong with it, before any timing or output file."""
    path, out = tmp_path / "recipe.toml", tmp_path / "r.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        _main(monkeypatch, "--config", str(path), "--out", str(out))
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not out.exists()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and expected.format(path=path) in err[0]
