"""The command line as a user meets it: help, streams, exit codes."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from normlab import cli

TINY = ("[task]\ngrid = 'smoke'\neval_size = 8\n[train]\nsteps = 4\nwarmup_steps = 0\n"
        "eval_every = 4\n"
        "checkpoint_every = 4\n[model]\nd_model = 16\nn_layers = 1\n")


def _trained(tmp_path: Path) -> Path:
    (tmp_path / "c.toml").write_text(TINY)
    run = tmp_path / "run"
    assert cli.main(["train", "--config", str(tmp_path / "c.toml"), "--out", str(run),
                     "--quiet"]) == 0
    assert cli.main(["eval", str(run)]) == 0
    return run


def test_every_option_and_argument_says_what_it_is() -> None:
    """Eight options and the run folders had no help: `normlab eval --help` showed a bare
    run_dir."""
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    bare = [f"{name} {a.dest}" for name, p in sub.choices.items() for a in p._actions
            if not a.help and not isinstance(a, argparse._HelpAction)]
    assert bare == []


def test_the_command_parses_its_arguments_before_importing_torch() -> None:
    """`normlab/__init__` imported the model, so torch, before `main` ran: `--help` took
    seconds, and a Ctrl-C in them printed a traceback. The model's names still import."""
    code = ("import sys, normlab.cli; assert 'torch' not in sys.modules, 'torch'; "
            "from normlab import KVCache, ModelConfig, build_model; print(ModelConfig.__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "ModelConfig"
    with pytest.raises(AttributeError, match="module 'normlab' has no attribute 'nothing'"):
        import normlab

        normlab.nothing  # noqa: B018


def test_progress_bars_go_to_stderr_on_a_terminal(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The bar was drawn when stderr was a terminal, but on rich's default console, stdout:
    `normlab train ... > last.json` began with the bar, and the terminal showed nothing."""
    (tmp_path / "c.toml").write_text(TINY)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert cli.main(["train", "--config", str(tmp_path / "c.toml"), "--out",
                     str(tmp_path / "run")]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["step"] == 4  # the final record, alone
    assert "4/4" in err and "run" in err  # the bar, with its label


def test_a_sweeps_bar_and_run_lines_go_to_stderr_on_a_terminal(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from normlab.sweep import _Watch

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    spec = argparse.Namespace(name="r0", config={"train": {"steps": 4}}, out="nowhere")
    with _Watch([spec], True) as watch:
        watch.finished(spec, {"ok": True, "did": ["train"], "seconds": 1.0})
    out, err = capsys.readouterr()
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", err)  # rich's colours
    assert out == "" and "run 1/1 r0: ok (train, 1s)" in plain and "runs" in plain


def test_a_reader_that_stops_early_gets_the_shells_code_and_no_message(tmp_path: Path) -> None:
    """`normlab eval RUN | head -c1` exited 120 with "Exception ignored ... BrokenPipeError"
    (or 2, "error: Broken pipe", unbuffered), the work done: at random under pipefail."""
    run = _trained(tmp_path)
    code = ("import sys; from normlab.cli import main; "
            f"sys.exit(main(['compare', '--markdown', {str(run)!r}]))")
    for env in ({}, {"PYTHONUNBUFFERED": "1"}):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, env={**os.environ, **env})
        proc.stdout.close()  # the reader is gone before the table is written
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 141 and err == "", (env, err)


def test_compare_names_a_file_given_as_a_run_and_refuses_force_without_plot(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A file was answered "run `normlab eval FILE` first", which then refused the file;
    --force without --plot was accepted and did nothing."""
    (tmp_path / "c.toml").write_text(TINY)
    assert cli.main(["compare", str(tmp_path / "c.toml")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"normlab: error: RUN_DIR {str(tmp_path / 'c.toml')!r} is a file; expected a run folder")
    assert cli.main(["compare", "--force", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        "normlab: error: --force: only with --plot (it overwrites the figure)")


def test_analyze_refuses_only_its_own_files_and_after_the_flag_checks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Any *.json in RUN_DIR/analysis was refused with "pass --force to overwrite it", which
    --force did not; and the refusal came before the flags were checked, so a negative sigma
    was named only once --force was given."""
    run = _trained(tmp_path)
    quick = ["--sigmas", "0", "--draws", "1", "--examples", "2"]
    (run / "analysis").mkdir()
    (run / "analysis" / "notes.json").write_text('{"mine": 1}')
    assert cli.main(["analyze", str(run), *quick]) == 0
    assert (run / "analysis" / "notes.json").read_text() == '{"mine": 1}'
    before = (run / "analysis" / "collapse.json").read_bytes()
    capsys.readouterr()
    assert cli.main(["analyze", str(run), *quick, "--sigmas", "0,-1"]) == 2
    assert capsys.readouterr().err.startswith("normlab: error: --sigmas[1]")
    assert cli.main(["analyze", str(run), *quick]) == 2
    assert capsys.readouterr().err.strip() == (
        f"normlab: error: {str(run / 'analysis' / 'collapse.json')!r} already exists; pass "
        "--force to overwrite it")
    assert (run / "analysis" / "collapse.json").read_bytes() == before


def test_analyze_refuses_each_of_its_json_files_and_no_figure(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Only collapse.json was tested: norms.json or interference.json alone marks an earlier
    analysis as well, and a figure without them (a killed analysis's) is replaced, as the
    README says; neither was tested for `analyze RUN` (for `--hf` only)."""
    run = _trained(tmp_path)
    quick = ["--sigmas", "0", "--draws", "1", "--examples", "2"]
    assert cli.main(["analyze", str(run), *quick]) == 0
    folder = run / "analysis"
    results = {p.name: p.read_bytes() for p in folder.glob("*.json")}
    assert set(results) == {"norms.json", "collapse.json", "interference.json"}
    for name in results:
        for p in folder.glob("*.json"):
            p.unlink()
        (folder / name).write_bytes(results[name])
        capsys.readouterr()
        assert cli.main(["analyze", str(run), *quick]) == 2
        assert capsys.readouterr().err.strip() == (
            f"normlab: error: {str(folder / name)!r} already exists; pass --force to "
            "overwrite it")
    for p in folder.glob("*.json"):
        p.unlink()
    assert len(list(folder.glob("*.png"))) == 3
    assert cli.main(["analyze", str(run), *quick]) == 0  # the figures alone: replaced
    assert {p.name for p in folder.glob("*.json")} == set(results)


def test_analyze_of_a_folder_that_is_no_run_says_so_before_earlier_results(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The refusal of earlier results comes after the run-folder check: a folder holding
    analysis/collapse.json but no run is named as no run folder, not told to pass --force
    (only the argument checks' order was tested)."""
    folder = tmp_path / "notes"
    (folder / "analysis").mkdir(parents=True)
    (folder / "analysis" / "collapse.json").write_text("{}")
    capsys.readouterr()
    assert cli.main(["analyze", str(folder), "--sigmas", "0", "--draws", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"normlab: error: {str(folder)!r} is not a normlab run folder (no checkpoints/)")


def test_the_lazy_names_are_listed_for_tab_completion() -> None:
    import normlab

    assert {"KVCache", "ModelConfig", "build_model", "__version__"} <= set(dir(normlab))
