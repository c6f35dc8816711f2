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

ROOT = Path(__file__).resolve().parents[1]


def _main(monkeypatch: pytest.MonkeyPatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", ["bench_decode.py", "--quick", *args])
    bench_decode.main()


def test_paper_recipe_decodes_its_own_longest_cells(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The paper grid's extrapolation cells are n = 6 (d 1-4) and d = 5 (n 1, 2, 4, 5): the
    longest prompt is n6d4's, the longest answer n5d5's; the model is the recipe's (d_model
    128), and both paths give the same tokens, every question `max_new` of them."""
    out, recipe = tmp_path / "r.json", str(ROOT / "configs" / "addition" / "paper" / "pre.toml")
    _main(monkeypatch, "--config", recipe, "--out", str(out))
    res = json.loads(out.read_text())
    assert (res["config"], res["grid"], res["d_model"]) == (recipe, "paper", 128)
    assert [r["cell"] for r in res["results"]] == ["n6d4", "n5d5"]
    for r in res["results"]:
        assert r["identical_outputs"] and r["generated_all"]
        assert r["speedup"]["median"] > 0


def test_default_recipe_is_the_quick_grid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    out = tmp_path / "r.json"
    _main(monkeypatch, "--out", str(out))
    res = json.loads(out.read_text())
    assert (res["config"], res["grid"], res["d_model"]) == (
        "configs/addition/pre.toml", "quick", 64)
    assert [r["cell"] for r in res["results"]] == ["n5d1", "n2d3"]


@pytest.mark.parametrize(("text", "expected"), [
    (None, "config file '{path}' not found"),
    ('[model]\narch = "encoder_decoder"\n',
     "--config {path}: model.arch must be 'decoder' (the benchmark decodes prompts alone); "
     "got 'encoder_decoder'"),
    ("[model\n", "config file '{path}': invalid TOML"),
])
def test_bad_recipe_is_one_line_before_any_work(
    text: str | None, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
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
