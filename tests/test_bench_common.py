"""benchmarks/common.py: the load warning counts only CPU time used by other processes."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import common


def _counters(wall: float, busy: float, own: float, steal: float = 0.0) -> dict[str, float]:
    return {"wall": wall, "busy": busy, "steal": steal, "own": own}


def _info(before: dict[str, float] | None, start_load: float = 0.1, threads: int = 1) -> dict:
    return {"loadavg_1m_at_start": start_load, "threads": threads, "cpu_count": 2,
            "cpu_counters_at_start": before}


@pytest.mark.parametrize(
    ("busy", "own", "others", "flagged"),
    [
        (30.0, 25.0, 0.0, False),  # all the busy time was this run's own (any thread count)
        (31.0, 25.0, 0.1, False),  # background noise
        (35.0, 25.0, 0.5, True),   # another process kept half a CPU busy
    ],
)
def test_load_note_counts_busy_time_beyond_the_runs_own(
    monkeypatch: pytest.MonkeyPatch, busy: float, own: float, others: float, flagged: bool
) -> None:
    monkeypatch.setattr(common, "cpu_counters", lambda: _counters(20.0, busy, own, steal=1.0))
    info = _info(_counters(10.0, 10.0, 5.0))
    note = common.load_note(info)
    assert info["load_during"] == {"seconds": 10.0, "others_busy_cpus": others,
                                   "stolen_cpus": 0.1}
    assert note.startswith("MEASURED UNDER LOAD") is flagged
    if flagged:
        assert f"kept {others:.2f} of 2 CPUs busy" in note


@pytest.mark.parametrize(
    ("start", "now", "threads", "flagged"),
    [
        (0.2, 1.9, 2, False),  # a 2-thread run loads the machine by itself
        (0.2, 1.7, 1, True),   # a 1-thread run and another busy process
        (1.1, 0.3, 1, True),   # load left by an earlier job at the start
    ],
)
def test_without_proc_stat_the_load_average_beyond_the_runs_threads_counts(
    monkeypatch: pytest.MonkeyPatch, start: float, now: float, threads: int, flagged: bool
) -> None:
    monkeypatch.setattr(common, "cpu_counters", lambda: None)
    monkeypatch.setattr(common.os, "getloadavg", lambda: (now, now, now))
    note = common.load_note(_info(None, start, threads))
    assert note.startswith("MEASURED UNDER LOAD") is flagged


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="needs Linux /proc/stat")
def test_cpu_counters_see_this_process_spin() -> None:
    # os.times() and /proc/stat count 10 ms ticks, each read truncated: allow a few ticks, and
    # compare in whole ticks so that float subtraction (4.05 - 3.86 < 0.19) cannot fail it.
    spin, tick = 0.3, 0.01
    before = common.cpu_counters()
    t0 = time.process_time()
    while time.process_time() - t0 < spin:
        pass
    after = common.cpu_counters()
    assert before is not None and after is not None
    own = round((after["own"] - before["own"]) / tick)
    assert own >= round(spin / tick) - 2
    assert round((after["busy"] - before["busy"]) / tick) >= round(spin / tick) - 5
    assert after["wall"] - before["wall"] >= own * tick - 0.02


def test_ratio_stats_reports_the_median_and_its_ci_of_paired_ratios() -> None:
    num, den = [2.0, 3.0, 8.0], [1.0, 1.0, 2.0]  # ratios 2, 3, 4
    st = common.ratio_stats(num, den)
    assert (st["median"], st["min"], st["max"], st["n"]) == (3.0, 2.0, 4.0, 3)
    assert st["ci"] == [2.0, 4.0] and st["ci_coverage"] == pytest.approx(0.75)
    assert common.rci(st) == "2.00–4.00 (75%)" and common.rci(None) == "—"
    # each repeat is kept, so a reader can recompute the interval from the file
    assert st["ratios"] == [2.0, 3.0, 4.0]
    t = common.summary([0.3, 0.1, 0.2])
    assert t["times_s"] == [0.3, 0.1, 0.2] and t["median_s"] == 0.2 and t["ci_s"] == [0.1, 0.3]


@pytest.mark.parametrize("argv", [["--threads", "0"], ["--repeats", "-2"], ["--threads", "two"]])
def test_bad_threads_or_repeats_is_a_one_line_usage_error(argv: list[str], capsys) -> None:
    import run_all

    parser = common.add_common_args(common.argparse.ArgumentParser(prog="bench"))
    for parse in (parser.parse_args, run_all.main):
        with pytest.raises(SystemExit) as exit_info:
            parse(argv)
        assert exit_info.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.endswith(f"error: argument {argv[0]}: expected an int >= 1; got {argv[1]!r}")
    assert parser.parse_args(["--threads", "2", "--repeats", "15"]).repeats == 15


def test_a_bad_malloc_setting_is_a_one_line_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Benchmarks run as the command does (normlab.allocator); a bad NORMLAB_MALLOC stops
    run_all in one line before any work."""
    import run_all

    monkeypatch.setenv("NORMLAB_MALLOC", "sometimes")
    with pytest.raises(SystemExit) as exit_info:
        run_all.main(["--quick", "--only", "hooks", "--out", str(tmp_path / "r.json")])
    assert exit_info.value.code == 2 and not (tmp_path / "r.json").exists()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith(
        ": error: NORMLAB_MALLOC: expected one of keep, default; got 'sometimes'")


def test_a_short_benchmark_is_not_judged_by_proc_stat_ticks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # over 0.05 s, four 10 ms ticks of other processes' time would read as 0.8 CPUs busy
    monkeypatch.setattr(common, "cpu_counters", lambda: _counters(10.05, 10.04, 5.0))
    monkeypatch.setattr(common.os, "getloadavg", lambda: (1.0, 1.0, 1.0))
    info = _info(_counters(10.0, 10.0, 5.0))
    assert common.load_note(info) == "" and "load_during" not in info


def test_widths_parse_as_positive_ints() -> None:
    assert common.positive_ints("64,128") == [64, 128]
    for bad in ("6x4", "64,", "0,64"):
        with pytest.raises(common.argparse.ArgumentTypeError,
                           match=f"expected comma-separated ints >= 1; got '{bad}'"):
            common.positive_ints(bad)


def test_bench_main_turns_bad_input_into_one_line(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    def run(args: object) -> dict:
        raise ValueError("'runs/nope' is not a normlab run folder (no checkpoints/)\ndetail")

    monkeypatch.setattr(sys, "argv", ["bench_x.py", "--quick"])
    with pytest.raises(SystemExit) as exit_info:
        common.bench_main("doc", run, lambda res: "")
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == "bench_x.py: error: 'runs/nope' is not a normlab run folder (no checkpoints/)\n"


def test_an_existing_result_file_is_replaced_only_with_force(tmp_path: Path, monkeypatch,
                                                             capsys) -> None:
    """bench_main and run_all refuse before any work; with --force the write is atomic."""
    import run_all

    out = tmp_path / "result.json"
    out.write_text('{"kept": true}')
    ran = []

    def run(args: object) -> dict:
        ran.append(1)
        return {"new": True}

    monkeypatch.setattr(sys, "argv", ["bench_x.py", "--out", str(out)])
    with pytest.raises(SystemExit) as exit_info:
        common.bench_main("doc", run, lambda res: "")
    assert exit_info.value.code == 2 and not ran
    assert capsys.readouterr().err.strip().endswith(
        f"error: --out: {str(out)!r} already exists; pass --force to overwrite it")
    with pytest.raises(SystemExit):
        run_all.main(["--out", str(out), "--only", "mfu", "--quick"])
    assert out.read_text() == '{"kept": true}'
    monkeypatch.setattr(sys, "argv", ["bench_x.py", "--out", str(out), "--force"])
    common.bench_main("doc", run, lambda res: "")
    assert ran == [1] and json.loads(out.read_text()) == {
        "command": ["bench_x.py", "--out", str(out), "--force"], "new": True}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # no temp file left


def test_time_to_accuracy_json_is_replaced_only_with_force(tmp_path: Path, capsys) -> None:
    import time_to_accuracy

    out = tmp_path / "tta.json"
    out.write_text("{}")
    run = tmp_path / "run"
    run.mkdir()  # a run folder with no log yet: a row saying so
    with pytest.raises(SystemExit) as exit_info:
        time_to_accuracy.main([str(run), "--json", str(out)])
    assert exit_info.value.code == 2 and out.read_text() == "{}"
    assert "--json: " in capsys.readouterr().err
    assert time_to_accuracy.main([str(run), "--json", str(out), "--force"]) == 0
    assert '"runs"' in out.read_text()


def test_time_to_accuracy_refuses_what_cannot_be_reached(tmp_path: Path, capsys) -> None:
    """A threshold of -1 counted a run as reached at its first evaluation, one of 2 or NaN and
    a misspelt split read "0 / 1 reached", a missing folder became a row: each exit 0."""
    import json as _json

    import time_to_accuracy

    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(_json.dumps({"step": 5, "accuracy": {"train": 0.5}})
                                       + "\n")
    for argv, said in (([str(run), "--threshold", "-1"], "--threshold: expected an accuracy in "
                                                         "(0, 1]; got -1.0"),
                       ([str(run), "--threshold", "nan"], "--threshold: expected"),
                       ([str(run), "--threshold", "2"], "--threshold: expected"),
                       ([str(run), "--split", "trian"], "--split: no run logged 'trian' "
                                                         "(logged: train)"),
                       ([str(tmp_path / "nope")], "expected a run folder; it does not exist"),
                       ([str(run / "metrics.jsonl")], "expected a run folder; it is a file")):
        with pytest.raises(SystemExit) as exit_info:
            time_to_accuracy.main(argv)
        assert exit_info.value.code == 2 and said in capsys.readouterr().err, argv
    out = tmp_path / "tta.json"
    assert time_to_accuracy.main([str(run), "--threshold", "0.5", "--json", str(out)]) == 0
    assert "| 1 / 1 |" in capsys.readouterr().out
    # the command as main got it, not the caller's (pytest's) own
    assert _json.loads(out.read_text())["command"] == [
        Path(sys.argv[0]).name, str(run), "--threshold", "0.5", "--json", str(out)]


def test_a_result_file_is_checked_as_a_name_and_as_writable_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """`--out r[1].json` matched r1.json as a pattern and replaced itself unasked; a folder, or
    a folder this process cannot write, failed after every benchmark had run; --only '' ran
    nothing and wrote an empty result."""
    import run_all

    ran = []

    def run(args: object) -> dict:
        ran.append(1)
        return {}

    (tmp_path / "r1.json").write_text("{}")
    (tmp_path / "r[1].json").write_text('{"kept": true}')
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out, said in ((tmp_path / "r[1].json", "already exists; pass --force"),
                      (tmp_path, "is a folder; expected a file to write the result to"),
                      (blocker / "r.json", f"cannot be written: its folder {str(blocker)!r}: "
                                           "expected a folder for the results; it is a file")):
        monkeypatch.setattr(sys, "argv", ["bench_x.py", "--out", str(out)])
        with pytest.raises(SystemExit) as exit_info:
            common.bench_main("doc", run, lambda res: "")
        assert exit_info.value.code == 2 and said in capsys.readouterr().err, out
    assert not ran and (tmp_path / "r[1].json").read_text() == '{"kept": true}'
    with pytest.raises(SystemExit):
        run_all.main(["--out", str(tmp_path / "new.json"), "--only", ",,"])
    assert "--only: expected a comma-separated subset" in capsys.readouterr().err
    assert not (tmp_path / "new.json").exists()


def test_run_all_writes_a_new_file_under_runs_bench_by_default(tmp_path: Path, monkeypatch,
                                                               capsys) -> None:
    """Without --out, `make bench` writes runs/bench/results-<UTC time>.json, not a tracked file."""
    import types

    import run_all

    fake = types.SimpleNamespace(run=lambda args: {"benchmark": "mfu", "widths": {}},
                                 to_markdown=lambda res: "### fake")
    monkeypatch.setattr(run_all, "ROOT", tmp_path)
    monkeypatch.setitem(run_all.MODULES, "mfu", fake)
    assert run_all.main(["--only", "mfu", "--quick"]) == 0
    written = sorted((tmp_path / "runs" / "bench").iterdir())
    assert len(written) == 2 and written[0].name.startswith("results-")
    result = written[0]
    assert '"mfu"' in result.read_text() and str(result) in capsys.readouterr().out
    # the figure of that result that MFU fills, beside it (plot.py; what the figures show and
    # which are drawn: tests/test_bench_plot.py)
    assert [p.name for p in written[1:]] == [f"{result.stem}_targets.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in written[1:])


def test_machine_info_names_the_cpu_kernels_and_the_header_shows_them() -> None:
    """Which vectorised ATen kernels ran (AVX512, AVX2, ...) is part of every result's record."""
    import torch

    info = common.machine_info(1)
    assert info["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert f"{info['cpu_capability']} kernels" in common.header("t", info)
    cap = info.pop("cpu_capability")  # results written before the field existed still render
    assert f"{cap} kernels" not in common.header("t", info)


def test_machine_info_records_the_native_kernels_and_the_header_shows_them() -> None:
    """Whether normlab's norms and RoPE ran its CPU kernels is part of every result's record."""
    from normlab.model import native

    info = common.machine_info(1)
    assert info["native"] == native.describe()
    assert f"normlab's CPU kernels: {info['native']}" in common.header("t", info)
    native.set_enabled(False)
    try:
        assert common.machine_info(1)["native"] == "off (torch's kernels)"
    finally:
        native.set_enabled(True)
    old = dict(info, native_norm=info.pop("native"))  # a sixteenth-session file
    assert f"normlab's CPU norm kernel: {old['native_norm']}" in common.header("t", old)
    assert "kernels:" not in common.header("t", info)  # and one from before the field
    assert "norm kernel" not in common.header("t", info)


def test_paired_timing_interleaves_and_times_with_the_collector_off() -> None:
    """Every call after the warm-ups runs with gc off (one collection before them, none
    between), in alternating order, and the collector's state is restored afterwards, also
    when a contender raises; several warm-ups run in rounds, each contender once a round."""
    import gc

    seen: list[tuple[str, bool]] = []
    counts: list[int] = []

    def contender(name: str):
        def fn() -> None:
            seen.append((name, gc.isenabled()))
            counts.append(gc.get_count()[0])
        return fn

    times = common.paired_timing({"a": contender("a"), "b": contender("b")}, repeats=4,
                                 inner=2, warmup=1)
    assert [n for n, _ in seen] == ["a", "b"] + ["a"] * 2 + ["b"] * 2 + ["b"] * 2 + ["a"] * 2 \
        + ["a"] * 2 + ["b"] * 2 + ["b"] * 2 + ["a"] * 2
    assert [on for _, on in seen] == [True, True] + [False] * 16
    assert gc.isenabled() and {len(t) for t in times.values()} == {4}
    # no collection between the timed calls: the young generation's count only grows
    timed_counts = counts[2:]
    assert timed_counts == sorted(timed_counts)

    def boom() -> None:
        if not gc.isenabled():
            raise RuntimeError("inside the timing")

    with pytest.raises(RuntimeError):
        common.paired_timing({"x": boom}, repeats=1)
    assert gc.isenabled()
    seen.clear()  # warm-up rounds: every contender once a round, before the timed repeats
    common.paired_timing({"a": contender("a"), "b": contender("b")}, repeats=1, warmup=3)
    assert seen == [("a", True), ("b", True)] * 3 + [("a", False), ("b", False)]


@pytest.mark.parametrize(("x", "text"), [(999.4, "999"), (999.7, "1,000"), (-999.7, "-1,000"),
                                         (1234.6, "1,235"), (0.12345, "0.123"), (7, "7")])
def test_fmt_chooses_its_format_after_rounding(x: float, text: str) -> None:
    """A table cell of 999.7 ms read "1e+03": the format was picked before rounding to 3
    digits."""
    assert common.fmt(x) == text
