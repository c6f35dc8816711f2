"""benchmarks/plot.py: the figures show the results files' numbers; bad input is one line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import plot

ROOT = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"


def _stats(median: float, lo: float, hi: float) -> dict:
    return {"median": median, "ci": [lo, hi], "n": 7}


def _info(threads: int, git: str = "0123456789abcdef") -> dict:
    return {"cpu": "Intel(R) Xeon(R) Processor", "threads": threads, "git": git}


def _run_all(threads: int, scale: float = 1.0) -> dict:
    """A run_all.py JSON with made-up numbers (scaled per file, so two files differ)."""
    info = _info(threads)
    step = {p: _stats(scale * m, scale * m - 0.05, scale * m + 0.03)
            for p, m in zip(plot.PLACEMENTS, (0.9, 0.95, 0.97, 1.05, 1.1), strict=True)}
    kinds = {}
    for kind in ("train", "collapse"):
        rows = {"base": {"time_ratio": 1.0, "flop_ratio": 1.0, "memory_ratio": 1.0},
                "problems n4 d2": {"time_ratio": 1.0, "flop_ratio": 1.0, "memory_ratio": 1.0}}
        for dim, t in zip(plot.SCALED, (1.9, 2.3, 1.8, 1.6, 1.4), strict=True):
            rows[f"{dim} x2"] = {"time_ratio": scale * t, "flop_ratio": 2.1, "memory_ratio": 2.0}
            rows[f"{dim} x4"] = {"time_ratio": scale * 2 * t, "flop_ratio": 4.7,
                                 "memory_ratio": 3.9}
        kinds[kind] = rows
    return {"info": info, "results": {
        "train_step": {"benchmark": "train_step", "info": info, "widths": {"64": {
            "fastest_reference": "nanogpt-manual",
            "contenders": {f"normlab-{p}": {"vs_fastest_ref": s} for p, s in step.items()},
            "qkv_over_pre": _stats(scale * 1.13, scale * 1.1, scale * 1.16)}}},
        "mfu": {"benchmark": "mfu", "info": info, "widths": {"64": {"contenders": {
            "normlab-pre": {"mfu": scale * 0.3, "mfu_ci": [scale * 0.28, scale * 0.31]},
            "nanogpt": {"mfu": scale * 0.27}}}}},  # a result from before mfu_ci: no bar
        "decode": {"benchmark": "decode", "info": info, "results": [
            {"placement": "pre", "cell": "n5d1", "speedup": _stats(*(scale * v for v in (
                2.5, 2.4, 2.7)))},
            {"placement": "qkv", "cell": "n2d3", "speedup": _stats(*(scale * v for v in (
                3.1, 3.0, 3.2)))}]},
        "collapse": {"benchmark": "collapse", "info": info,
                     "speedup_sweep": _stats(*(scale * v for v in (18.0, 17.0, 18.5))),
                     "speedup_call": _stats(*(scale * v for v in (13.0, 12.0, 13.5)))},
        "scaling": {"benchmark": "scaling", "info": info, "kinds": kinds},
    }}


def _write(tmp_path: Path, name: str, obj: object) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(obj))
    return path


def _errorbars(ax) -> list[tuple[str, np.ndarray, np.ndarray, np.ndarray]]:
    """(label, x, median, [lo, hi] whisker ends) of every errorbar series on an axis."""
    out = []
    for c in ax.containers:
        data, _, (bars,) = c.lines[0], c.lines[1], c.lines[2]
        ends = np.array([seg[:, 1] for seg in bars.get_segments()])
        out.append((c.get_label(), np.asarray(data.get_xdata(), float),
                    np.asarray(data.get_ydata(), float), ends))
    return out


def test_targets_figure_shows_each_median_and_its_ci(tmp_path: Path) -> None:
    src = plot.load(_write(tmp_path, "r.json", _run_all(1)))
    fig = plot.targets_figure([src])
    step, mfu, decode, sweep = fig.axes[:4]
    raw = _run_all(1)["results"]
    w = raw["train_step"]["widths"]["64"]
    ((label, x, y, ends),) = _errorbars(step)
    want = [w["contenders"][f"normlab-{p}"]["vs_fastest_ref"] for p in plot.PLACEMENTS]
    want.append(w["qkv_over_pre"])
    assert label == "Intel Xeon, 1 thread, 0123456"
    np.testing.assert_allclose(x, np.arange(6))
    np.testing.assert_allclose(y, [s["median"] for s in want])
    np.testing.assert_allclose(ends, [s["ci"] for s in want])
    (_, _, mfu_y, mfu_ends), = _errorbars(mfu)
    np.testing.assert_allclose(mfu_y, [30.0, 27.0])
    np.testing.assert_allclose(mfu_ends, [[28.0, 31.0], [27.0, 27.0]])  # in %, as the medians
    np.testing.assert_allclose(_errorbars(decode)[0][2], [2.5, 3.1])
    np.testing.assert_allclose(_errorbars(sweep)[0][2], [18.0, 13.0])
    # every panel carries its target as a dashed line at the value
    for ax, y_target in ((step, 1.0), (step, 1.15), (mfu, 50.0), (decode, 3.0), (sweep, 20.0)):
        assert any(ln.get_linestyle() == "--" and set(ln.get_ydata()) == {y_target}
                   for ln in ax.get_lines()), (ax.get_title(), y_target)
    assert [t.get_text() for t in step.get_xticklabels()] == [*plot.PLACEMENTS, "qkv / pre"]


def test_a_compiled_run_draws_the_eager_comparison(tmp_path: Path) -> None:
    """Under --compile the panel shows each eager step over the fastest eager reference (the
    target's comparison), not over a compiled one; a --compile run from before that was
    recorded draws no step points (its ratios are all over the compiled reference)."""
    run = _run_all(1)
    w = run["results"]["train_step"]["widths"]["64"]
    for c in w["contenders"].values():
        c["vs_fastest_eager_ref"] = c["vs_fastest_ref"]
        c["vs_fastest_ref"] = _stats(9.0, 8.0, 10.0)  # over the compiled reference: not drawn
    w.update(fastest_reference="nanogpt+compile", fastest_eager_reference="nanogpt-manual")
    ((_, _, y, _),) = _errorbars(plot.targets_figure(
        [plot.load(_write(tmp_path, "c.json", run))]).axes[0])
    np.testing.assert_allclose(y[:-1], [0.9, 0.95, 0.97, 1.05, 1.1])
    del w["fastest_eager_reference"]
    ((_, x, _, _),) = _errorbars(plot.targets_figure(
        [plot.load(_write(tmp_path, "old.json", run))]).axes[0])
    np.testing.assert_allclose(x, [5.0])  # qkv / pre alone


def test_two_files_are_drawn_side_by_side_and_labelled_apart(tmp_path: Path) -> None:
    one = plot.load(_write(tmp_path, "1t.json", _run_all(1)))
    two = plot.load(_write(tmp_path, "2t.json", _run_all(2, scale=0.5)))
    series = _errorbars(plot.targets_figure([one, two]).axes[0])
    assert [s[0] for s in series] == ["Intel Xeon, 1 thread, 0123456",
                                      "Intel Xeon, 2 threads, 0123456"]
    assert np.all(series[0][1] < series[1][1])  # dodged: the first file left of the second
    np.testing.assert_allclose(series[1][2], 0.5 * series[0][2])


def test_files_with_the_same_machine_and_commit_are_told_apart_by_name(tmp_path: Path) -> None:
    paths = [_write(tmp_path, f"{name}.json", _run_all(1)) for name in ("first", "second")]
    sources = plot.load_all(paths)
    assert [s.label for s in sources] == ["Intel Xeon, 1 thread, 0123456 (first)",
                                          "Intel Xeon, 1 thread, 0123456 (second)"]
    legend = plot.targets_figure(sources).legends[0]
    assert [t.get_text() for t in legend.get_texts()] == [s.label for s in sources]


def test_the_legend_names_a_file_that_only_a_later_panel_draws(tmp_path: Path) -> None:
    full = _run_all(1)["results"]
    step = _write(tmp_path, "step.json", full["train_step"])
    sweep = _write(tmp_path, "sweep.json", {**full["collapse"], "info": _info(2)})
    legend = plot.targets_figure(plot.load_all([step, sweep])).legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["Intel Xeon, 1 thread, 0123456",
                                                          "Intel Xeon, 2 threads, 0123456"]


def test_scaling_figure_puts_time_against_the_flop_count(tmp_path: Path) -> None:
    src = plot.load(_write(tmp_path, "r.json", _run_all(1)))
    fig = plot.scaling_figure([src])
    time_ax, memory_ax = fig.axes[0], fig.axes[1]
    solid = [ln for ln in time_ax.get_lines() if ln.get_linestyle() == "-"]
    dashed = [ln for ln in time_ax.get_lines() if ln.get_linestyle() == "--"]
    train = _run_all(1)["results"]["scaling"]["kinds"]["train"]
    for dim, ln in zip(plot.SCALED, solid, strict=True):
        assert ln.get_color() == plot.COLOURS[dim]
        np.testing.assert_allclose(ln.get_xdata(), [1, 2, 4])
        np.testing.assert_allclose(ln.get_ydata(), [1.0, train[f"{dim} x2"]["time_ratio"],
                                                    train[f"{dim} x4"]["time_ratio"]])
    assert [list(ln.get_ydata()) for ln in dashed] == [[1.0, 2.1, 4.7]] * 5
    np.testing.assert_allclose(memory_ax.get_lines()[0].get_ydata(), [1.0, 2.0, 3.9])
    # a problem's n and d start from their own base row, not the random-token one; a file
    # without problem rows (before the twenty-third session) draws no line for them
    raw = _run_all(1)
    for kind in raw["results"]["scaling"]["kinds"].values():
        del kind["base"]
    lines = plot.scaling_figure([plot.load(_write(tmp_path, "p.json", raw))]).axes[0].get_lines()
    assert [ln.get_color() for ln in lines
            if len(ln.get_xdata()) == 3 and ln.get_linestyle() == "-"] == [
        plot.COLOURS["n"], plot.COLOURS["d"]]
    raw = _run_all(1)
    for kind in raw["results"]["scaling"]["kinds"].values():
        for row in [r for r in kind if r.startswith(("n ", "d ", "problems"))]:
            del kind[row]
    lines = plot.scaling_figure([plot.load(_write(tmp_path, "o.json", raw))]).axes[0].get_lines()
    assert len(lines) == 6  # three dims, each measured and counted


def test_the_flop_lines_reach_the_rows_a_later_file_measured(tmp_path: Path) -> None:
    """A --quick file (no x4 rows) before a full one: every dim's FLOP line is the full
    file's, to x4. The lines came from the first file alone, so they stopped at x2 while the
    full file's time lines went on to x4."""
    quick = _run_all(1)
    for kind in quick["results"]["scaling"]["kinds"].values():
        for name in [r for r in kind if r.endswith(" x4")]:
            del kind[name]
        for name in [r for r in kind if r.endswith(" x2")]:
            kind[name]["flop_ratio"] = 2.05  # the sweep's count differs a little by n_draws
    paths = [_write(tmp_path, "quick.json", quick), _write(tmp_path, "full.json", _run_all(1))]
    for order in (paths, paths[::-1]):
        for ax in plot.scaling_figure(plot.load_all(order)).axes[::2]:  # the time panels
            dashed = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
            assert [ln.get_color() for ln in dashed] == [plot.COLOURS[d] for d in plot.SCALED]
            assert [list(ln.get_xdata()) for ln in dashed] == [[1, 2, 4]] * 5
            assert [list(ln.get_ydata()) for ln in dashed] == [[1.0, 2.1, 4.7]] * 5


def test_a_benchmark_in_no_file_gets_a_panel_that_says_so(tmp_path: Path) -> None:
    hooks_only = {"benchmark": "hooks", "info": _info(1), "results": []}
    src = plot.load(_write(tmp_path, "hooks.json", hooks_only))
    fig = plot.targets_figure([src])
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    for name in ("train_step", "mfu", "decode", "collapse"):
        assert f"no {name} results in the inputs" in texts
    assert not any(ax.containers for ax in fig.axes)


def test_the_committed_full_run_draws_both_figures(tmp_path: Path) -> None:
    results = ROOT / "benchmarks" / "results" / "session14_after_1thread.json"
    written = plot.write_figures([results], tmp_path, formats=["png", "pdf"])
    assert sorted(p.name for p in written) == ["scaling.pdf", "scaling.png", "targets.pdf",
                                               "targets.png"]
    assert (tmp_path / "targets.png").read_bytes().startswith(PNG)
    assert (tmp_path / "scaling.pdf").read_bytes().startswith(b"%PDF")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such results file"),
        ("not json", "not JSON"),
        ('{"rows": []}', "expected the JSON of run_all.py --out or of one benchmark's --out"),
        ('{"results": {"mfu": {"error": "ValueError: x"}}}', "holds no benchmark results"),
        ('{"benchmark": "decode", "results": [{"cell": "n5d1"}]}',
         "not the layout this script reads (KeyError: 'placement')"),
        (json.dumps({"benchmark": "collapse", "speedup_call": {"median": 9, "ci": [10, 11]},
                     "speedup_sweep": {"median": 20, "ci": [19, 21]}}),
         "collapse whole call: median 9 lies outside its CI [10, 11]"),
    ],
)
def test_bad_results_file_is_a_one_line_error_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None, message: str
) -> None:
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exit_info:
        plot.main([str(path), "--out", str(tmp_path / "figs")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert str(path) in err and message in err
    assert not (tmp_path / "figs").exists()


def test_out_that_is_a_file_is_a_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, "r.json", _run_all(1))
    with pytest.raises(SystemExit):
        plot.main([str(path), "--out", str(path)])
    assert f"--out: {str(path)!r} is a file; expected a folder" in capsys.readouterr().err


def test_bad_format_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _write(tmp_path, "r.json", _run_all(1))
    with pytest.raises(SystemExit):
        plot.main([str(path), "--out", str(tmp_path), "--format", "png,gif"])
    assert "--format: expected a comma-separated subset of png, pdf, svg; got 'png,gif'" in (
        capsys.readouterr().err)


def test_existing_figures_are_replaced_only_with_force(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, "r.json", _run_all(1))
    out = tmp_path / "figs"
    out.mkdir()
    (out / "scaling.png").write_bytes(b"kept")
    with pytest.raises(SystemExit):
        plot.main([str(path), "--out", str(out)])
    assert "scaling.png' already exists; pass --force to overwrite it" in capsys.readouterr().err
    assert (out / "scaling.png").read_bytes() == b"kept" and not (out / "targets.png").exists()
    plot.main([str(path), "--out", str(out), "--force"])
    assert (out / "scaling.png").read_bytes().startswith(PNG)
    assert sorted(p.name for p in out.iterdir()) == ["scaling.png", "targets.png"]


def test_one_figure_alone_from_its_own_files(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--figures scaling` draws (and refuses to replace) only that figure, so it can come
    from other runs than the targets figure; an unknown name is a one-line usage error."""
    path = _write(tmp_path, "r.json", _run_all(1))
    out = tmp_path / "figs"
    out.mkdir()
    (out / "targets.png").write_bytes(b"kept")
    plot.main([str(path), "--out", str(out), "--figures", "scaling"])
    assert (out / "targets.png").read_bytes() == b"kept"
    assert (out / "scaling.png").read_bytes().startswith(PNG)
    with pytest.raises(SystemExit):
        plot.main([str(path), "--out", str(out), "--figures", "scaling,heat"])
    assert ("--figures: expected a comma-separated subset of targets, scaling; got "
            "'scaling,heat'") in capsys.readouterr().err


def test_run_all_keeps_its_json_when_a_figure_fails_and_no_plot_draws_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import types

    import run_all

    fake = types.SimpleNamespace(run=lambda args: {"benchmark": "mfu", "widths": {}},
                                 to_markdown=lambda res: "### fake")
    monkeypatch.setitem(run_all.MODULES, "mfu", fake)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no font")

    with monkeypatch.context() as m:
        m.setattr(run_all.plot, "write_figures", broken)
        assert run_all.main(["--only", "mfu", "--out", str(tmp_path / "a.json")]) == 0
    assert json.loads((tmp_path / "a.json").read_text())["results"]["mfu"]["benchmark"] == "mfu"
    assert "figures FAILED (RuntimeError: no font); the JSON above is complete" in (
        capsys.readouterr().err)
    assert run_all.main(["--only", "mfu", "--out", str(tmp_path / "b.json"), "--no-plot"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json"]


def test_a_figure_is_filled_by_a_benchmark_that_ran() -> None:
    assert set(plot.DRAWS) == set(plot.FIGURES)
    assert {b for bs in plot.DRAWS.values() for b in bs} <= set(plot.BENCHMARKS)
    ok, failed = {"benchmark": "x", "widths": {}}, {"benchmark": "x", "error": "boom"}
    skipped = {"benchmark": "x", "info": {}, "skipped": "CPU only"}  # common.cpu_only's shape
    scaled = {"benchmark": "scaling", "info": {}, "kinds": {}, "skipped": None}  # as it runs
    assert plot.filled({"train_step": ok}) == ["targets"]
    assert plot.filled({"scaling": scaled, "hooks": ok}) == ["scaling"]
    assert plot.filled({"scaling": {**scaled, "skipped": "collapse sweep skipped"}}) == [
        "scaling"]  # its training rows still ran
    assert plot.filled({"train_step": failed, "collapse": skipped, "scaling": scaled}) == [
        "scaling"]
    assert plot.filled({"hooks": ok, "packing": ok, "collapse": skipped}) == []


def test_run_all_draws_only_the_figures_its_benchmarks_fill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--only mfu` draws the targets figure alone (no empty scaling one); `--only hooks`,
    which neither figure shows, draws none, nor does a benchmark that failed. Every figure of
    the name is refused up front, drawn this time or not; with --force one not drawn is kept
    and named."""
    import types

    import run_all

    raw = _run_all(1)["results"]

    def broken(args: object) -> dict:
        raise RuntimeError("boom")

    for name in ("mfu", "hooks", "scaling"):
        fake = types.SimpleNamespace(run=lambda args, name=name: raw.get(name, {"results": []}),
                                     to_markdown=lambda res: "### fake")
        monkeypatch.setitem(run_all.MODULES, name, fake)
    assert run_all.main(["--only", "mfu", "--out", str(tmp_path / "a.json")]) == 0
    assert run_all.main(["--only", "hooks", "--out", str(tmp_path / "b.json")]) == 0
    monkeypatch.setattr(run_all.MODULES["scaling"], "run", broken)
    assert run_all.main(["--only", "hooks,scaling", "--out", str(tmp_path / "c.json")]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "a_targets.png", "b.json",
                                                          "c.json"]
    assert (tmp_path / "a_targets.png").read_bytes().startswith(PNG)
    (tmp_path / "d_scaling.png").write_bytes(b"an earlier run's")
    with pytest.raises(SystemExit):
        run_all.main(["--only", "mfu", "--out", str(tmp_path / "d.json")])
    assert not (tmp_path / "d.json").exists()
    capsys.readouterr()
    assert run_all.main(["--only", "mfu", "--out", str(tmp_path / "d.json"), "--force"]) == 0
    assert (tmp_path / "d_scaling.png").read_bytes() == b"an earlier run's"
    assert (tmp_path / "d_targets.png").read_bytes().startswith(PNG)
    assert (f"kept from an earlier run (this run draws no such figure): "
            f"{tmp_path / 'd_scaling.png'}") in capsys.readouterr().err


@pytest.mark.parametrize(
    ("info", "label"),
    [
        ({"cpu": "AMD EPYC 9B14", "threads": 2, "git": "0123456789ab-dirty"},
         "AMD EPYC 9B14, 2 threads, 0123456-dirty"),
        ({"cpu": "Intel(R) Xeon(R) CPU @ 2.20GHz", "threads": 1}, "Intel Xeon, 1 thread"),
        ({}, "unknown CPU"),
        ({"cpu": "AMD EPYC 9B14", "threads": 1, "git": "0123456789ab", "gpu": None},
         "AMD EPYC 9B14, 1 thread, 0123456"),  # a CPU run recorded with the device field
        ({"cpu": "AMD EPYC 9B14", "threads": 1, "git": "0123456789ab",
          "gpu": {"name": "NVIDIA H100 80GB HBM3"}}, "NVIDIA H100 80GB HBM3, 0123456"),
    ],
)
def test_labels_name_cpu_threads_and_commit(info: dict, label: str) -> None:
    assert plot.label_for(info) == label


def test_format_picks_the_files_written(tmp_path: Path) -> None:
    path = _write(tmp_path, "r.json", _run_all(1))
    plot.main([str(path), "--out", str(tmp_path / "figs"), "--format", "pdf,svg"])
    assert sorted(p.name for p in (tmp_path / "figs").iterdir()) == [
        "scaling.pdf", "scaling.svg", "targets.pdf", "targets.svg"]
    assert (tmp_path / "figs" / "targets.svg").read_text().lstrip().startswith("<?xml")
