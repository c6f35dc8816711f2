"""Learning curves from metrics.jsonl: hand-written logs with known values, and the bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from normlab.cli import main
from normlab.curves import curve_table, learning_curve
from normlab.io import read_metrics


def _run(folder: Path, records: list[dict], tail: str = "") -> Path:
    folder.mkdir(parents=True)
    lines = [json.dumps(r) for r in records]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n" + tail)
    return folder


def _logs(tmp_path: Path) -> tuple[Path, Path]:
    a = _run(tmp_path / "a", [
        {"step": 50, "loss": 2.0, "elapsed_s": 5.0},
        {"step": 100, "loss": 1.0, "elapsed_s": 10.0,
         "accuracy": {"train": 0.25, "interpolation": 0.125}},
        {"step": 200, "loss": 0.5, "elapsed_s": 20.4, "accuracy": {"train": 0.5}},
    ], tail='{"step": 250, "lo')  # a job still writing its last line
    b = _run(tmp_path / "b", [{"step": 200, "elapsed_s": 30.0, "accuracy": {"train": 0.75}}])
    return a, b


def test_curve_reads_evaluations_only_and_skips_a_partial_last_line(tmp_path: Path) -> None:
    a, _ = _logs(tmp_path)
    assert [r["step"] for r in read_metrics(a)] == [50, 100, 200]
    c = learning_curve(a, "train")
    assert (c.steps, c.elapsed_s, c.accuracy) == ([100, 200], [10.0, 20.4], [0.25, 0.5])
    assert learning_curve(a, "interpolation").steps == [100]


def test_curve_table_is_the_union_of_steps(tmp_path: Path) -> None:
    a, b = _logs(tmp_path)
    header, rows = curve_table([learning_curve(a), learning_curve(b)])
    assert header == ["step", "a", "b"]
    assert rows == [["100", "25.0 (10 s)", "-"], ["200", "50.0 (20 s)", "75.0 (30 s)"]]
    # in step order whichever run comes first (the first run's steps led, the rest after)
    header, rows = curve_table([learning_curve(b), learning_curve(a)])
    assert header == ["step", "b", "a"] and [r[0] for r in rows] == ["100", "200"]


def test_bad_logs_give_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"metrics\.jsonl' not found"):
        read_metrics(tmp_path / "nothing")
    broken = _run(tmp_path / "broken", [{"step": 1}], tail='oops\n{"step": 2}\n')
    with pytest.raises(ValueError, match="line 2: not valid JSON"):
        read_metrics(broken)
    # a byte that is not UTF-8: the error named no file ("'utf-8' codec can't decode"), and
    # a last line cut short in a multi-byte character blocked every resume
    bad = tmp_path / "bad" / "metrics.jsonl"
    bad.parent.mkdir()
    good = json.dumps({"step": 1}).encode() + b"\n"
    bad.write_bytes(good + b'{"step": 2, "x": "\xff"}\n' + good)
    with pytest.raises(ValueError, match=r"metrics\.jsonl' line 2: not valid JSON"):
        read_metrics(bad.parent)
    bad.write_bytes(good + '{"step": 2, "x": "é'.encode()[:-1])
    assert read_metrics(bad.parent) == [{"step": 1}]
    nostep = _run(tmp_path / "nostep", [{"loss": 1.0}, {"step": 2}])
    with pytest.raises(ValueError, match="line 1: expected an object with an int 'step'"):
        read_metrics(nostep)
    a, _ = _logs(tmp_path)
    with pytest.raises(ValueError, match=r"no split 'extrapolation'.*logged: interpolation, train"):
        learning_curve(a, "extrapolation")
    # an accuracy in percent was printed as 5700.0, NaN as "nan"; seconds as text failed with
    # "Unknown format code 'f' for object of type 'str'", naming no file
    for i, rec in enumerate([{"accuracy": {"train": 57.0}}, {"accuracy": {"train": float("nan")}},
                             {"elapsed_s": "12"}, {"elapsed_s": -1.0},
                             {"elapsed_s": float("inf")}]):
        run = _run(tmp_path / f"odd{i}", [{"step": 100, "elapsed_s": 5.0,
                                           "accuracy": {"train": 0.5}} | rec, {"step": 200}])
        field = "accuracy" if "accuracy" in rec else "elapsed_s"
        with pytest.raises(ValueError, match=rf"odd{i}/metrics\.jsonl' line 1: expected "
                                             rf"'{field}'"):
            read_metrics(run)


def test_cli_curve_table_and_plot(tmp_path: Path, capsys) -> None:
    a, b = _logs(tmp_path)
    png = tmp_path / "fig" / "curves.png"
    assert main(["compare", "--curve", "train", "--markdown", "--plot", str(png), str(a),
                 str(b)]) == 0
    out = capsys.readouterr().out
    assert "| 200 | 50.0 (20 s) | 75.0 (30 s) |" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # never overwritten without --force; --plot alone is a usage error
    assert main(["compare", "--curve", "train", "--plot", str(png), str(a)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert main(["compare", "--curve", "train", "--plot", str(png), "--force", str(a)]) == 0
    assert main(["compare", "--plot", str(png), str(a)]) == 2
    assert "--plot: needs --curve SPLIT" in capsys.readouterr().err
    assert main(["compare", "--curve", "", str(a)]) == 2  # printed the accuracy table, exit 0
    assert "no split '' in metrics.jsonl" in capsys.readouterr().err
    # a folder: "already exists; pass --force", and with --force the OS's error on a temp file
    for force in ([], ["--force"]):
        assert main(["compare", "--curve", "train", "--plot", str(png.parent), *force,
                     str(a)]) == 2
        assert capsys.readouterr().err.strip() == (
            f"normlab: error: --plot {str(png.parent)!r}: expected a file to write the figure "
            "to; it is a folder")
    assert main(["compare", "--curve", "nope", str(a)]) == 2
    assert "no split 'nope'" in capsys.readouterr().err
    # a name matplotlib cannot write: its "Format 'txt' is not supported" named no flag
    txt = png.with_suffix(".txt")
    assert main(["compare", "--curve", "train", "--plot", str(txt), str(a)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"normlab: error: --plot {str(txt)!r}: expected a figure file ending "
                          "in one of ") and ".png" in err and ".pdf" in err
    assert not txt.exists()
    upper = png.with_name("curves.PNG")  # an ending in capitals is the same format
    assert main(["compare", "--curve", "train", "--plot", str(upper), str(a)]) == 0
    assert upper.read_bytes().startswith(b"\x89PNG")


def test_runs_of_the_same_name_from_two_folders_are_told_apart(tmp_path: Path,
                                                                capsys) -> None:
    """Two sweeps' `pre-s0` were two columns both called `pre-s0`: as many trailing path parts
    as tell them apart name them; distinct names stay as they were."""
    from normlab.curves import run_labels

    a = _run(tmp_path / "sweep1" / "pre-s0", [{"step": 10, "accuracy": {"train": 0.5}}])
    b = _run(tmp_path / "sweep2" / "pre-s0", [{"step": 10, "accuracy": {"train": 0.25}}])
    assert run_labels([a, b]) == ["sweep1/pre-s0", "sweep2/pre-s0"]
    assert run_labels([a, tmp_path / "sweep2" / "qkv-s0"]) == ["pre-s0", "qkv-s0"]
    assert main(["compare", "--curve", "train", "--markdown", str(a), str(b)]) == 0
    assert "| step | sweep1/pre-s0 | sweep2/pre-s0 |" in capsys.readouterr().out


def test_the_curve_title_says_how_many_questions_a_cell(tmp_path: Path, capsys) -> None:
    """A curve's point is the periodic evaluation of the first `train.eval_examples` questions
    a cell: without saying so it read 48.1% where `normlab eval` of the same checkpoint read
    50.4%. Where those are every question (`task.eval_size` or fewer) nothing is said, and the
    count is the one the run trained with (train_done.json's), not an edited config.toml's."""
    from normlab.config import dump_toml, load_config

    a, b = _logs(tmp_path)

    def configure(run: Path, key: str) -> None:
        (run / "config.toml").write_text(dump_toml(load_config(None, [key]).to_dict()))

    def title(*runs: Path) -> str:
        assert main(["compare", "--curve", "train", "--markdown", *map(str, runs)]) == 0
        return capsys.readouterr().out.splitlines()[0]

    configure(a, "train.eval_examples=64")
    configure(b, "task.eval_size=32")
    # which run asked fewer is named: "the first 64 questions a cell" read as both runs'
    assert title(a, b) == ("exact match % on train (training seconds); the first 64 questions "
                           "a cell in a (train.eval_examples; `normlab eval` asks every "
                           "question)")
    configure(b, "train.eval_examples=16")
    assert title(a, b) == (
        "exact match % on train (training seconds); the first 16 questions a cell in b; the "
        "first 64 in a (train.eval_examples; `normlab eval` asks every question)")
    configure(b, "train.eval_examples=64")
    assert title(a, b) == (
        "exact match % on train (training seconds); the first 64 questions a cell "
        "(train.eval_examples; `normlab eval` asks every question)")  # all runs alike
    configure(b, "task.eval_size=32")
    assert title(b) == "exact match % on train (training seconds)"  # all 32 asked
    trained = load_config(None, ["train.eval_examples=16"]).to_dict()
    (a / "train_done.json").write_text(json.dumps({"step": 200, "config": trained}))
    assert "; the first 16 questions a cell" in title(a)
    (b / "config.toml").write_text("[model\n")  # damaged: the table still prints, no count
    assert title(b) == "exact match % on train (training seconds)"
    fresh = _run(tmp_path / "fresh", [{"step": 5, "loss": 2.0}])  # not yet evaluated
    (fresh / "config.toml").write_text("[model\n")
    assert main(["compare", "--curve", "train", "--markdown", str(a), str(fresh)]) == 0
    assert "| 200 | 50.0 (20 s) | - |" in capsys.readouterr().out
    (b / "config.toml").unlink()  # a folder without its config: no count to give for it
    assert main(["compare", "--curve", "train", "--markdown", str(b)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "exact match % on train (training seconds)"


def test_runs_whose_split_holds_other_cells_are_refused_side_by_side(tmp_path: Path,
                                                                    capsys) -> None:
    """`compare` refused runs of two grids in one column; `compare --curve` drew them as one.
    A run with no config to read is left out of the check, as of the title's count."""
    from normlab.config import dump_toml, load_config

    a, b = _logs(tmp_path)
    for run, grid in ((a, "smoke"), (b, "quick")):
        (run / "config.toml").write_text(dump_toml(load_config(None, [f"task.grid='{grid}'"])
                                                   .to_dict()))
    assert main(["compare", "--curve", "train", str(a), str(b)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{str(b)!r}: split 'train' holds cells" in err
    assert "expected one split's runs to share its cells" in err
    (b / "config.toml").unlink()
    assert main(["compare", "--curve", "train", "--markdown", str(a), str(b)]) == 0
    capsys.readouterr()


def test_an_imperfect_accuracy_never_reads_100() -> None:
    """255 right of 256 read "100" on the heatmap and 2559 of 2560 "100.0" in compare."""
    from normlab.stats import percent

    assert (percent(255 / 256, 0), percent(2559 / 2560, 1)) == ("99", "99.9")
    # an interval's bounds too: "99.9 [100.0, 100.0]" held no value of its own
    from normlab.stats import wilson_ci

    assert [percent(b, 1) for b in wilson_ci(19999, 20000)] == ["99.9", "99.9"]
    assert (percent(1.0, 0), percent(1.0, 1), percent(0.5, 1), percent(0.996, 1)) == (
        "100", "100.0", "50.0", "99.6")


def test_a_curve_point_short_of_every_answer_is_not_shown_as_100(tmp_path: Path) -> None:
    run = _run(tmp_path / "r", [{"step": 10, "accuracy": {"train": 2559 / 2560}},
                                {"step": 20, "accuracy": {"train": 1.0}}])
    assert curve_table([learning_curve(run)])[1] == [["10", "99.9"], ["20", "100.0"]]


def test_the_curve_figure_is_in_minutes_and_whole_percent(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The wall-time panel, labelled in minutes, plots minutes, and the accuracy axis spans
    0-100%: no test read the figure, so seconds under "(min)", or an axis zoomed to the
    data, passed."""
    import matplotlib.pyplot as plt

    import normlab.curves as cu

    drawn: list = []
    monkeypatch.setattr(cu, "save_figure", lambda fig, path: drawn.append(fig))
    cu.plot_curves([cu.Curve("a", [100, 200], [600.0, 1200.0], [0.25, 0.5])], tmp_path / "c.png")
    ax1, ax2 = drawn[0].axes
    assert "(min)" in ax2.get_xlabel() and list(ax2.lines[0].get_xdata()) == [10.0, 20.0]
    assert list(ax1.lines[0].get_ydata()) == [25.0, 50.0] and ax1.get_ylim() == (0, 100)
    plt.close(drawn[0])


def test_a_run_that_has_not_logged_yet_is_a_curve_without_points(tmp_path: Path,
                                                                 capsys) -> None:
    """A run started (or killed) before its first log step has its config.toml but no
    metrics.jsonl: `compare --curve` refused it as "not found: is it a run folder?" (exit 2),
    and the other runs' curves with it. It has no points now, as with an empty log, and says
    why; a folder that holds no run is refused as before, and a misspelt split is named."""
    from normlab.config import dump_toml, load_config

    a, _ = _logs(tmp_path)
    started = tmp_path / "started"
    for sub in ("checkpoints", "tb"):
        (started / sub).mkdir(parents=True)
    (started / "config.toml").write_text(dump_toml(load_config(None, []).to_dict()))
    assert main(["compare", "--curve", "train", "--markdown", str(a), str(started)]) == 0
    out, err = capsys.readouterr()
    assert "| 100 | 25.0 (10 s) | - |" in out and "| 200 | 50.0 (20 s) | - |" in out
    assert err.strip() == f"{str(started)!r}: no metrics.jsonl yet (no step logged): no points"
    said: list[str] = []
    c = learning_curve(started, "train", log=said.append)
    assert (c.steps, c.accuracy, len(said)) == ([], [], 1)
    assert main(["compare", "--curve", "trian", str(started)]) == 2
    assert "no split 'trian' in the run's task" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    assert main(["compare", "--curve", "train", str(other)]) == 2
    assert capsys.readouterr().err.strip() == (f"normlab: error: {str(other / 'metrics.jsonl')!r}"
                                               f" not found: is {str(other)!r} a run folder?")
