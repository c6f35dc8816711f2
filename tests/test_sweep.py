"""Bad sweep input is refused in one line naming the sweep file (or the run's state file) and
the field: wrong-typed top-level keys, a file that is not UTF-8, run names that would lead out
of --out, and an empty or malformed train_done.json or timings.json found during a sweep."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from normlab import allocator, cli, sweep
from normlab.sweep import load_sweep

GRID = '[grid]\n"train.seed" = [0]\n'
NOT_ONE_FOLDER = "is not a single folder name (no path separators, not '.' or '..', not empty)"


@pytest.mark.parametrize(("top", "message"), [
    ("grid = 5", "sweep.grid: expected a table; got 5"),
    ('grid = ["train.seed"]', "sweep.grid: expected a table; got ['train.seed']"),
    ("set = 5", "sweep.set: expected a table; got 5"),
    ("run = 5", "sweep.run: expected a table; got 5"),
    ("base = 5", "sweep.base: expected a string, the run config's path; got 5"),
    ("name = 5", "sweep.name: expected a string, the run folder names' template; got 5"),
    ('name = "{}"', "sweep.name: invalid template '{}' (Replacement index 0 out of range for "
                    "positional args tuple); expected fields named by grid keys, as {seed}"),
    ('name = "{seed"', "sweep.name: invalid template '{seed' (expected '}' before end of "
                       "string); expected fields named by grid keys, as {seed}"),
    ('name = "{seed.x}"', "sweep.name: invalid template '{seed.x}' (the field {seed.x} reads "
                          "an attribute or item); expected fields named by grid keys, as {seed}"),
    # an attribute that exists named folders after a method's address, another every process
    ('name = "{seed.real}"', "sweep.name: invalid template '{seed.real}' (the field "
                             "{seed.real} reads an attribute or item); expected fields named by "
                             "grid keys, as {seed}"),
    ('name = "{seed[0]}"', "sweep.name: invalid template '{seed[0]}' (the field {seed[0]} "
                           "reads an attribute or item); expected fields named by grid keys, "
                           "as {seed}"),
])
def test_a_wrong_typed_top_level_key_is_named(tmp_path: Path, top: str, message: str) -> None:
    f, said = _refusal(tmp_path, top + "\n" + ("" if top.startswith("grid") else GRID))
    assert said == f"sweep file {str(f)!r}: {message}"


def test_a_bad_key_in_the_base_config_names_that_file(tmp_path: Path) -> None:
    """It named the sweep file alone, whose keys were all right; a grid value's error names no
    flag (the sweep sets it, not --set)."""
    (tmp_path / "base.toml").write_text("[train]\nlrr = 1\n")
    f, said = _refusal(tmp_path, 'base = "base.toml"\n' + GRID)
    assert said.startswith(f"sweep file {str(f)!r}: config file "
                           f"{str(tmp_path / 'base.toml')!r}: train.lrr: unknown key")
    (tmp_path / "base.toml").write_text("[train]\nlr = 1e-3\n")
    f, said = _refusal(tmp_path, 'base = "base.toml"\n[grid]\n"train.steps" = [1.5]\n')
    assert said == f"sweep file {str(f)!r}: train.steps: expected int; got float 1.5"


def _refusal(tmp_path: Path, content: str | bytes) -> tuple[Path, str]:
    """A sweep file of `content`, and what reading it is refused with."""
    f = tmp_path / "s.toml"
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError) as err:
        load_sweep(f, tmp_path / "out")
    return f, str(err.value)


@pytest.mark.parametrize(("data", "position"), [
    (b"\x85" + GRID.encode(), "byte 0x85 in position 0: invalid start byte"),
    (b"# caf\xe9\n" + GRID.encode(), "byte 0xe9 in position 5: invalid continuation byte"),
])
def test_a_sweep_file_that_is_not_utf8_is_named(tmp_path: Path, data: bytes,
                                                position: str) -> None:
    f, said = _refusal(tmp_path, data)
    assert said == (f"sweep file {str(f)!r}: not UTF-8 text, as TOML is ('utf-8' codec can't "
                    f"decode {position})")


@pytest.mark.parametrize(("name", "run_name"), [
    ("../escaped{seed}", "../escaped0"),
    ("{ABS}/abs{seed}", "{ABS}/abs0"),  # {ABS}: this test's own folder, as an absolute path
    ("nested/{seed}", "nested/0"),
    ("..", ".."),
    (".", "."),
    ("{seed!s:.0}", ""),
])
def test_a_run_name_must_be_one_folder_inside_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 name: str, run_name: str) -> None:
    """Nothing is made outside --out: the runs a sweep would execute make their folders."""
    name, run_name = (s.replace("{ABS}", str(tmp_path)) for s in (name, run_name))
    f = tmp_path / "s.toml"
    f.write_text(f"name = {name!r}\n{GRID}")
    here = tmp_path / "cwd"
    here.mkdir()
    monkeypatch.chdir(here)

    def execute(specs: list[sweep.RunSpec], **_: object) -> list[dict[str, object]]:
        for spec in specs:  # what each run would do first
            Path(spec.out).mkdir(parents=True, exist_ok=True)
        return []

    monkeypatch.setattr(sweep, "execute", execute)
    with pytest.raises(ValueError) as err:
        sweep.run_sweep(f, Path("out"))
    assert str(err.value) == f"sweep file {str(f)!r}: sweep.name: run name {run_name!r} " + (
        NOT_ONE_FOLDER)
    assert sorted(os.listdir(tmp_path)) == ["cwd", "s.toml"] and not os.listdir(here)


DONE_EXPECTED = ('expected an object with an int "step", where training ended (and its '
                 '"elapsed_s", seconds)')
TIMINGS_EXPECTED = "expected an object of step name -> seconds"
NOT_JSON = "not valid JSON (Expecting value: line 1 column 1 (char 0))"


NO_CHECKPOINT = "no checkpoint to make it again from: restore it from a copy"


@pytest.mark.parametrize(("file", "text", "message"), [
    ("train_done.json", "", f"{DONE_EXPECTED}; {NOT_JSON}; {NO_CHECKPOINT}"),
    ("train_done.json", "{}", f"{DONE_EXPECTED}; got {{}}; {NO_CHECKPOINT}"),
    ("train_done.json", '{"step": "7"}', f"{DONE_EXPECTED}; got {{'step': '7'}}; {NO_CHECKPOINT}"),
])
def test_a_runs_bad_state_file_fails_that_run_naming_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, file: str, text: str,
        message: str) -> None:
    """Reported as any failed run is (the sweep goes on), with the file and what it should
    hold, where no checkpoint can make it again (a copied result folder: a resume would train
    the run anew)."""
    f = tmp_path / "s.toml"
    f.write_text(GRID)
    (spec,) = load_sweep(f, tmp_path / "out")
    Path(spec.out).mkdir(parents=True)
    (Path(spec.out) / file).write_text(text)
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: True)
    res = sweep._safe_run(spec, "cpu")
    assert {k: res[k] for k in ("ok", "name", "error")} == {
        "ok": False, "name": "0",
        "error": f"ValueError: {str(Path(spec.out) / file)!r}: {message}"}


def test_the_command_refuses_a_wrong_typed_key_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "s.toml"
    f.write_text("grid = 5\n")
    assert cli.main(["sweep", "--config", str(f), "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"normlab: error: sweep file {str(f)!r}: sweep.grid: expected a table; got 5"]
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
@pytest.mark.parametrize(("device", "in_config"), [("cuda", "auto"), (None, "cuda")])
def test_a_gpu_this_machine_lacks_is_one_line_before_any_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: str | None,
        in_config: str) -> None:
    """Asked of the local backend, it started a worker per run and each failed with the same
    error, exit 1; `normlab train` refuses it in one line before any work."""
    def never(*a: object, **k: object) -> None:
        raise AssertionError("a worker was started")

    monkeypatch.setattr(sweep, "_local_backend", never)
    specs = [sweep.RunSpec(f"r{i}", str(tmp_path / f"r{i}"), {"train": {"device": in_config}})
             for i in range(2)]
    # named as the user gave it: the --device flag, or the runs' train.device
    said = "--device cuda: " if device else "train\\.device: 'cuda' "
    with pytest.raises(ValueError, match=rf"^{said}requested but no CUDA device is available$"):
        sweep.execute(specs, device=device, progress=False)
    assert not any(tmp_path.iterdir())
    # a finished run's eval and analysis run on the CPU: a rerun there is not refused
    for s in specs:
        Path(s.out).mkdir()
        (Path(s.out) / "train_done.json").write_text("{}")
    monkeypatch.setattr(sweep, "_local_backend", lambda jobs, device: (None, None, None))
    with pytest.raises(TypeError):  # past the check, into the stubbed backend
        sweep.execute(specs, device=device, progress=False)


# --------------------------------------------------------------------------- stopping a sweep


def _long_sweep(tmp_path: Path) -> Path:
    """Three tiny runs long enough to be stopped in their first (20,000 steps each)."""
    f = tmp_path / "long.toml"
    f.write_text('name = "r{seed}"\n[grid]\n"train.seed" = [0, 1, 2]\n[set]\n'
                 '"task.grid" = "smoke"\n"task.eval_size" = 8\n"model.d_model" = 16\n'
                 '"model.n_layers" = 1\n"model.d_mlp" = 32\n"train.steps" = 20000\n'
                 '"train.eval_every" = 10000\n"train.log_every" = 10\n'
                 '"train.checkpoint_every" = 10000\n[run]\nanalyze = false\n')
    return f


@pytest.fixture
def long_sweep(tmp_path: Path) -> Iterator[Callable[[], tuple[subprocess.Popen, list[int]]]]:
    """Starts `normlab sweep --jobs 1` of the long sweep (its own process group) and returns it
    once its first run logs, with its children's pids; whatever the test's outcome, none of
    them is left running."""
    started: list[tuple[subprocess.Popen, list[int]]] = []

    def start() -> tuple[subprocess.Popen, list[int]]:
        proc = subprocess.Popen([sys.executable, "-m", "normlab.cli", "sweep", "--config",
                                 str(_long_sweep(tmp_path)), "--out", str(tmp_path / "out"),
                                 "--jobs", "1"], stderr=subprocess.PIPE, text=True,
                                start_new_session=True,
                                # a background shell's children ignore SIGINT, and Python then
                                # never raises KeyboardInterrupt
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        started.append((proc, []))
        log = tmp_path / "out" / "r0" / "metrics.jsonl"
        for _ in range(600):
            if log.is_file() and log.stat().st_size:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the first run did not start within 60 s")
        children = [int(c) for c in Path(f"/proc/{proc.pid}/task/{proc.pid}/children")
                    .read_text().split()]
        started[-1] = (proc, children)
        return proc, children

    yield start
    for proc, children in started:
        for pid in [proc.pid, *children]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate()


def _gone(pid: int, within: float = 30.0) -> bool:
    for _ in range(int(within * 10)):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(
            f"/proc/{pid}/stat").exists() else "X"
        if state == "Z":  # ended, not yet reaped by a parent that is gone
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize(("sig", "group"), [(signal.SIGINT, False), (signal.SIGTERM, False),
                                            (signal.SIGINT, True)])
def test_a_stopped_sweep_ends_its_runs_and_starts_no_more(tmp_path: Path, long_sweep,
                                                          sig: int, group: bool) -> None:
    """Ctrl-C printed "interrupted", then every queued run was trained to the end before the
    process exited (26 s for four tiny runs; hours for the paper profile); SIGTERM killed the
    sweep and left its workers training; at a terminal (the whole group signalled) a worker
    could take the next run first. Signalled, the sweep ends its workers, starts no queued run
    and exits 130."""
    proc, workers = long_sweep()
    assert workers  # the pool's worker
    if group:  # Ctrl-C at a terminal
        os.killpg(proc.pid, sig)
    else:  # the sweep's process alone, as `kill` does
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "normlab: interrupted; finished runs and checkpoints are kept" in err
    assert all(_gone(w) for w in workers)
    assert not (tmp_path / "out" / "r1").exists() and not (tmp_path / "out" / "r2").exists()


def test_a_killed_sweeps_workers_end_with_it(long_sweep) -> None:
    """SIGKILL (or the out-of-memory killer) on the sweep left its workers training, and their
    run locks refused the rerun ("being trained by another process")."""
    proc, workers = long_sweep()
    proc.kill()
    proc.wait(timeout=30)
    assert workers and all(_gone(w) for w in workers)


@pytest.mark.parametrize(("text", "message"), [
    # the [set] value was dropped without a word
    ('[grid]\n"train.seed" = [0, 1]\n[set]\n"train.seed" = 7\n',
     "sweep.set.train.seed: also a grid key; give it in one table"),
    # "two runs get the same folder name; include every grid key", of the only grid key
    ('[grid]\n"train.seed" = [0, 0]\n', "sweep.grid.train.seed: value 0 is given twice"),
    ('[grid]\n"model.norm_placement" = ["pre", "qkv", "pre"]\n',
     'sweep.grid.model.norm_placement: value "pre" is given twice'),
    # names that cannot be folders: every run failed as its worker started it
    ('name = "r\\u0000{seed}"\n[grid]\n"train.seed" = [0]\n',
     "sweep.name: run name 'r\\x000' cannot name a folder and its log (a NUL, or more than 251 "
     "bytes)"),
    # 252 bytes: NAME.log beside the run's folder is 256, one past what Linux names
    ('name = "{seed:>252}"\n[grid]\n"train.seed" = [0]\n',
     f"sweep.name: run name {' ' * 251 + '0'!r} cannot name a folder and its log (a NUL, or "
     "more than 251 bytes)"),
    ('name = "r"\n[grid]\n"train.seed" = [0, 1]\n',
     "sweep.name: runs {'train.seed': 0} and {'train.seed': 1} both get the folder name 'r'; "
     "make the name tell them apart (every grid key, in a format that keeps their values "
     "apart)"),
    # every grid key is in it, and still one name ("include every grid key" could not help)
    ('name = "lr{lr:.0e}"\n[grid]\n"train.lr" = [0.001, 0.0011]\n',
     "sweep.name: runs {'train.lr': 0.001} and {'train.lr': 0.0011} both get the folder name "
     "'lr1e-03'; make the name tell them apart (every grid key, in a format that keeps their "
     "values apart)"),
    # one config twice, under two names, read later as two runs (two seeds, say): values
    # that differ as text but not as config
    ('[grid]\n"train.lr" = [1, 1.0]\n',
     "sweep.grid: runs {'train.lr': 1} and {'train.lr': 1.0} make the same config; give each "
     "value once"),
    # a table's keys in another order (the README's table-valued grid key)
    ('[grid]\n"task.splits" = [{a = [[3, 1]], b = [[5, 1]]}, {b = [[5, 1]], a = [[3, 1]]}]\n',
     "sweep.grid: runs {'task.splits': {'a': [[3, 1]], 'b': [[5, 1]]}} and {'task.splits': "
     "{'b': [[5, 1]], 'a': [[3, 1]]}} make the same config; give each value once"),
    ('[grid]\n"train.seed" = [0]\n[set]\n"train.lr.x" = 1\n',
     "sweep.set.train.lr.x: expected TABLE.KEY, e.g. train.lr"),
    ('name = "r{grid}"\n[grid]\n"task.grid" = ["smoke", "quick"]\n"train.seed" = [0]\n'
     '[set]\n"task.grid" = "paper"\n', "sweep.set.task.grid: also a grid key; give it in one "
     "table"),
    # spaced keys are the config's keys: compared raw, the [set] seed 7 was overwritten unseen
    ('[grid]\n"train.seed" = [0, 1]\n[set]\n"train.seed " = 7\n',
     "sweep.set.train.seed: also a grid key; give it in one table"),
    ('[grid]\n"train.seed" = [0, 1]\n" train.seed" = [5]\n',
     "sweep.grid: keys 'train.seed' and ' train.seed' are one key; give it once"),
])
def test_a_grid_that_cannot_make_its_runs_is_named(tmp_path: Path, text: str,
                                                   message: str) -> None:
    f, said = _refusal(tmp_path, text)
    assert said == f"sweep file {str(f)!r}: {message}"


def test_a_grid_past_max_runs_is_refused_before_it_is_expanded(tmp_path: Path,
                                                               monkeypatch) -> None:
    """A grid of 10**8 runs was expanded in silence (~1 ms and 10 KB a run) until memory ran
    out. Counted first: 3 x 2 = 6 runs against a bound of 5 here."""
    monkeypatch.setattr(sweep, "MAX_RUNS", 5)
    f = tmp_path / "s.toml"
    f.write_text('[grid]\n"train.seed" = [0, 1, 2]\n"model.d_model" = [16, 32]\n')
    with pytest.raises(ValueError) as err:
        load_sweep(f, tmp_path / "out")
    assert str(err.value) == (f"sweep file {str(f)!r}: sweep.grid: 6 runs (3 x 2); expected at "
                              "most 5")
    monkeypatch.setattr(sweep, "MAX_RUNS", 6)
    assert len(load_sweep(f, tmp_path / "out")) == 6
    # counted before anything else is read of the values: the check for a value given twice
    # took a minute on a grid of 100,000 seeds before the bound refused it
    f.write_text('[grid]\n"train.seed" = [0, 0, 0, 0, 0, 0, 0]\n')
    with pytest.raises(ValueError, match=r"sweep\.grid: 7 runs \(7\); expected at most 6$"):
        load_sweep(f, tmp_path / "out")


def test_a_run_name_of_251_bytes_is_taken() -> None:
    """The bound is the log's: NAME.log beside the folder must fit Linux's 255 bytes."""
    assert sweep._run_name("{seed:>251}", {"seed": 0}) == " " * 250 + "0"
    with pytest.raises(ValueError, match="more than 251 bytes"):
        sweep._run_name("{seed:>252}", {"seed": 0})


def test_a_second_sweep_of_one_out_is_refused(tmp_path: Path, capsys) -> None:
    """Two sweeps (or reproduces) of one --out made the same evaluations twice, each reported
    the other's runs as failed, and the report left was the last one written."""
    import fcntl

    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "s.toml").write_text('[grid]\n"train.seed" = [0]\n')
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)  # the first sweep's
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for argv in (["sweep", "--config", str(tmp_path / "s.toml")],
                     ["reproduce", "--profile", "smoke"]):
            assert cli.main([*argv, "--out", str(out)]) == 2
            assert capsys.readouterr().err.strip() == (
                f"normlab: error: --out {str(out)!r} is in use by another normlab sweep or "
                "reproduce (or a run trained there); wait for it to end, or give --out another "
                "folder")
        assert not any(out.iterdir())
    finally:
        os.close(fd)


def test_rays_start_leaves_the_commands_sigterm_handler(monkeypatch) -> None:
    """`ray.init` installs its own SIGTERM handler: a Ray sweep sent SIGTERM dumped Ray's crash
    report and exited -6, its runs not stopped as Ctrl-C stops them. A stand-in for Ray's start
    takes SIGTERM as the real one does; the command's handler is back after it."""
    ray = pytest.importorskip("ray")

    def ours(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    def rays(signum: int, frame: object) -> None:
        raise AssertionError("Ray's handler")

    def init(**kwargs: object) -> None:
        signal.signal(signal.SIGTERM, rays)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {})
    monkeypatch.setattr(ray, "nodes", lambda: [])
    previous = signal.signal(signal.SIGTERM, ours)
    try:
        sweep._ray_backend(None, None, [])
        assert signal.getsignal(signal.SIGTERM) is ours
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_finished_runs_damaged_records_are_made_again_not_failed_each_rerun(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A damaged train_done.json or timings.json failed the run on every rerun of the sweep
    (and of `reproduce`, whose error said "rerun to retry"), and `train --resume` refused it.
    The record is made again from the last checkpoint (nothing retrained: the results made
    from that step are kept); the timings, bookkeeping, start again empty; each with a
    warning in the run's log."""
    import json

    import normlab.train
    from normlab.config import RunConfig
    from normlab.sweep import execute
    from normlab.train import train
    from test_report import TINY_SET

    f = tmp_path / "s.toml"
    f.write_text('name = "r{seed}"\n[grid]\n"train.seed" = [0]\n' + TINY_SET)
    specs = load_sweep(f, tmp_path / "out")
    out = Path(specs[0].out)
    assert [r["did"] for r in execute(specs, jobs=1, progress=False)] == [["train", "eval"]]
    record = json.loads((out / "train_done.json").read_text())
    results = (out / "eval.json").read_bytes()
    (out / "train_done.json").write_text('{"step": 6, "elapsed')
    (out / "timings.json").write_text('{"train": "1s"}')
    (res,) = execute(specs, jobs=1, progress=False)
    assert res["ok"] and res["did"] == ["train"], res
    again = json.loads((out / "train_done.json").read_text())
    assert {k: again[k] for k in ("step", "config")} == {k: record[k] for k in ("step", "config")}
    assert (out / "eval.json").read_bytes() == results  # made from the same step: kept
    assert set(json.loads((out / "timings.json").read_text())) == {"train"}  # this rerun's
    # damaged alone, with nothing to redo: replaced at once, so the report reads no seconds
    (out / "timings.json").write_text("[")
    assert [r["did"] for r in execute(specs, jobs=1, progress=False)] == [[]]
    assert json.loads((out / "timings.json").read_text()) == {}
    log = (tmp_path / "out" / "r0.log").read_text()
    assert f"warning: {str(out / 'train_done.json')!r}: expected" in log
    assert log.count("made again from the last checkpoint") == 1  # said once, by train
    assert f"warning: {str(out / 'timings.json')!r}: {TIMINGS_EXPECTED}" in log
    # train --resume, as the sweep: the record back, with the same warning; at a later
    # commit it trains no step, so the record keeps the commit the last step trained at
    (out / "train_done.json").write_text("")
    said: list[str] = []
    monkeypatch.setattr(normlab.train, "provenance", lambda: {"git_commit": "later"})
    done = train(RunConfig.from_dict(specs[0].config), out, resume=True, progress=False,
                 log=said.append)
    again = json.loads((out / "train_done.json").read_text())
    assert done["step"] == 6 and again["step"] == 6
    assert again["provenance"] == record["provenance"] != {"git_commit": "later"}
    assert any("made again from the last checkpoint" in s for s in said)


# --------------------------------------------------------------------------- pool, Ray, failures


def _specs(tmp_path: Path, threads: list[int]) -> list:
    f = tmp_path / "s.toml"
    f.write_text(f'name = "r{{seed}}"\n[grid]\n"train.seed" = {list(range(len(threads)))}\n')
    specs = load_sweep(f, tmp_path / "out")
    for spec, t in zip(specs, threads, strict=True):
        spec.config["train"]["threads"] = t
    return specs


@pytest.mark.parametrize(("cpus", "threads", "jobs"), [
    ({0, 1}, [1, 1, 1], 2), ({0, 1}, [1, 2, 2, 2], 1), ({0, 1}, [2, 2, 2, 2, 1], 1),
    ({0}, [1, 1, 1, 1], 1), (set(range(8)), [2, 1], 4), ({0, 1}, [4], 1),
])
def test_the_default_pool_holds_the_most_threads_on_the_usable_cpus(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpus: set, threads: list[int],
        jobs: int) -> None:
    """The pool was sized by the fewest threads a run takes and by os.cpu_count(): runs of 1
    and 2 threads on 2 CPUs ran 4 threads at once, and under taskset (or a Slurm cpuset) the
    machine's count was taken for the job's. Worked out by hand: usable CPUs // most threads,
    at least 1, at most the runs."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cpus)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    monkeypatch.setattr(sweep, "cgroup_cpu_quota", lambda *a: None)  # the host's may have one
    specs = _specs(tmp_path, threads)
    assert sweep.default_jobs(specs) == jobs
    seen: list[int] = []

    def backend(n: int, device: object, marks: str) -> tuple:
        seen.append(n)
        raise KeyboardInterrupt  # past the sizing: nothing is run

    monkeypatch.setattr(sweep, "_local_backend", backend)
    with pytest.raises(KeyboardInterrupt):
        sweep.execute(specs, progress=False)
    assert seen == [min(jobs, len(specs))]


@pytest.mark.parametrize(("error", "pointer"), [(KeyError("d_head"), True),
                                               (ValueError("train.lr: expected > 0"), False)])
def test_a_failed_runs_traceback_goes_to_its_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                error: Exception, pointer: bool) -> None:
    """The traceback was collected and dropped: a bug's `KeyError: 'd_head'` came with no file
    or line anywhere. It is in the run's log now, and the one line points there unless it is
    one of normlab's own one-line errors (a ValueError naming its field)."""
    (spec,) = _specs(tmp_path, [1])
    Path(spec.out).parent.mkdir(parents=True)

    def fails(*args: object) -> None:
        raise error

    monkeypatch.setattr(sweep, "run_one", fails)
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: True)
    res = sweep._safe_run(spec, None)
    log = Path(spec.out).parent / "r0.log"
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "in fails" in text
    assert text.rstrip().endswith(f"{type(error).__name__}: {error}")
    said = f"{type(error).__name__}: {error}"
    assert res["error"] == (said + f" (traceback in {str(log)!r})" if pointer else said)


def test_only_running_runs_get_a_progress_bar(tmp_path: Path) -> None:
    """Queued runs had bars beside the running ones (--jobs 1 and four runs: four bars)."""
    import concurrent.futures as cf

    (spec,) = _specs(tmp_path, [1])
    queued, running = cf.Future(), cf.Future()
    running.set_running_or_notify_cancel()
    assert not sweep._started(queued, spec) and sweep._started(running, spec)
    ref = object()  # a Ray reference says nothing: a run counts from its first metrics line
    assert not sweep._started(ref, spec)
    Path(spec.out).mkdir(parents=True)
    (Path(spec.out) / "metrics.jsonl").write_text('{"step": 1}\n')
    assert sweep._started(ref, spec)


class _FakeRay:
    """What `_ray_backend` and `execute` call of Ray: nodes with the given resources, tasks
    that record what they were asked for and finish at once; started by `init` unless
    `running`."""

    def __init__(self, nodes: list[dict], running: bool = False) -> None:
        self._nodes, self.asked, self.running = nodes, [], running

    def is_initialized(self) -> bool:
        return self.running

    def init(self, **kw: object) -> None:
        self.running = True

    def cluster_resources(self) -> dict:
        return {"CPU": sum(n.get("CPU", 0) for n in self._nodes),
                "GPU": sum(n.get("GPU", 0) for n in self._nodes)}

    def nodes(self) -> list[dict]:
        return [{"Alive": True, "Resources": r} for r in self._nodes]

    def remote(self, fn: object) -> object:
        ray = self

        class Task:
            def options(self, **kw: object) -> object:
                class Call:
                    def remote(self, spec: object, device: object) -> object:
                        ray.asked.append((spec, kw))
                        ref = type("Ref", (), {})()  # hashable, as Ray's references are
                        ref.payload = {"ok": True, "name": spec.name, "did": [],
                                       "seconds": 0.0}
                        return ref
                return Call()
        return Task()

    def wait(self, refs: list, num_returns: int, timeout: float) -> tuple[list, list]:
        return refs[:1], refs[1:]

    def get(self, ref: object) -> dict:
        return ref.payload

    def cancel(self, ref: object, force: bool) -> None:
        pass


def test_a_ray_run_no_node_can_hold_is_refused_not_left_waiting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """`train.threads` past every node's CPUs, or cuda where no node has a GPU, waited forever
    without a word (Ray's own warning is not shown): refused before any run starts on a Ray
    the sweep starts itself; a warning on a cluster's (--address, RAY_ADDRESS, or joined
    before), whose autoscaler may add the node. One node must hold both CPUs and GPU."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    fake = _FakeRay([{"CPU": 4, "GPU": 1}, {"CPU": 6}])
    monkeypatch.setitem(sys.modules, "ray", fake)
    # train.device "auto" asks for a GPU where the cluster has one
    with pytest.raises(ValueError, match=r"^run r1: asks for 8 CPUs \(train\.threads\) and a GPU "
                                         r"\(train\.device auto\), which no Ray node has; Ray "
                                         r"would wait forever$"):
        sweep.execute(_specs(tmp_path, [4, 8]), backend="ray", progress=False)
    fake.running = False
    with pytest.raises(ValueError, match=r"^run r0: asks for 6 CPUs \(train\.threads\) and a GPU "
                                         r"\(--device cuda\), which no Ray node has"):
        sweep.execute(_specs(tmp_path, [6]), backend="ray", device="cuda", progress=False)
    assert fake.asked == []  # nothing submitted
    # a finished run asks for no GPU: its eval and analysis run on the CPU
    (done,) = _specs(tmp_path, [6])
    Path(done.out).mkdir(parents=True)
    (Path(done.out) / "train_done.json").write_text('{"step": 1}')
    fake.running = False
    assert sweep.execute([done], backend="ray", device="cuda", progress=False)[0]["ok"]
    assert fake.asked[-1][1] == {"num_cpus": 6, "num_gpus": 0}
    for how in ({"address": "auto"}, {"env": "10.0.0.1:6379"}, {"joined": True}):
        fake.running = bool(how.get("joined"))
        if "env" in how:
            monkeypatch.setenv("RAY_ADDRESS", how["env"])
        res = sweep.execute(_specs(tmp_path, [8, 8]), backend="ray", device="cpu",
                            address=how.get("address"), progress=False)
        assert [r["ok"] for r in res] == [True, True], how  # said once, for the first
        assert capsys.readouterr().err.strip() == (
            "normlab: warning: run r0: asks for 8 CPUs (train.threads), which no Ray node has; "
            "Ray would wait forever unless the cluster adds such a node"), how
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
    fake.running = False  # 4 CPUs and a GPU: the first node holds them (r0 still to train)
    (tmp_path / "fresh").mkdir()
    assert sweep.execute(_specs(tmp_path / "fresh", [4]), backend="ray", device="cuda",
                         progress=False)[0]["ok"]
    assert fake.asked[-1][1] == {"num_cpus": 4, "num_gpus": 1}


def test_a_ray_sweep_gives_its_runs_absolute_folders(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A relative --out reached each Ray task as it was, resolved in the worker's own folder
    (a cluster head's): the runs went there, the sweep's --out stayed empty, and the command
    reported every run done."""
    fake = _FakeRay([{"CPU": 2}])
    monkeypatch.setitem(sys.modules, "ray", fake)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.toml").write_text('[grid]\n"train.seed" = [0]\n')
    assert sweep.run_sweep(Path("s.toml"), Path("rel"), backend="ray") == []
    ((spec, _),) = fake.asked
    assert spec.out == str(tmp_path / "rel" / "0")


def test_no_more_bars_than_the_pool_has_workers(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool hands a worker its next run early, so one future more than it has workers
    reads as running: with one worker, two runs of four had bars. The first `jobs` that read
    as running get them."""
    import concurrent.futures as cf

    specs = _specs(tmp_path, [1, 1, 1, 1])
    futures = [cf.Future() for _ in specs]
    for f in futures[:2]:  # one runs, one handed over early
        f.set_running_or_notify_cancel()
    calls = iter([[], futures])
    ticked: list[list[str]] = []

    def backend(jobs: int, device: object, marks: str) -> tuple:
        it = iter(futures)
        return (lambda spec: next(it), lambda futs: next(calls), lambda futs: None)

    def result(fut: object, spec: object) -> dict:
        return {"ok": True, "name": spec.name, "did": [], "seconds": 0.0}

    monkeypatch.setattr(sweep, "_local_backend", backend)
    monkeypatch.setattr(sweep, "_result", result)
    monkeypatch.setattr(sweep._Watch, "tick",
                        lambda self, running: ticked.append([s.name for s in running]))
    sweep.execute(specs, jobs=1, progress=False)
    assert ticked[0] == ["r0"]


def test_a_sweep_that_cannot_start_leaves_no_out_behind(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ray cluster out of reach failed after the lock had made --out: an empty folder was
    left behind. One the sweep made is removed again while it is empty; one that was there
    stays."""
    fake = _FakeRay([{"CPU": 2}])

    def init(**kw: object) -> None:
        raise ConnectionError("ray client connection timeout")

    fake.init = init
    monkeypatch.setitem(sys.modules, "ray", fake)
    (tmp_path / "s.toml").write_text('[grid]\n"train.seed" = [0]\n')
    for there in (False, True):
        out = tmp_path / f"out{there}"
        if there:
            out.mkdir()
        with pytest.raises(ConnectionError):
            sweep.run_sweep(tmp_path / "s.toml", out, backend="ray",
                            address="ray://127.0.0.1:1")
        assert out.exists() is there


def _cgroup(tmp_path: Path, proc: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A fake cgroup mount (`files`: path under it -> text) and /proc/self/cgroup."""
    root = tmp_path / "cgroup"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (tmp_path / "proc").write_text(proc)
    return root, tmp_path / "proc"


@pytest.mark.parametrize(("proc", "files", "quota"), [
    # cgroup v2: the tightest of the process's cgroup and its parents
    ("0::/a/b\n", {"a/b/cpu.max": "max 100000\n", "a/cpu.max": "150000 100000\n"}, 1.5),
    ("0::/a/b\n", {"a/b/cpu.max": "50000 100000\n", "a/cpu.max": "300000 100000\n"}, 0.5),
    ("0::/a\n", {"a/cpu.max": "max 100000\n"}, None),
    # a container: its cgroup is the mount's root, /proc names the path outside it
    ("0::/docker/x\n", {"cpu.max": "200000 100000\n"}, 2.0),
    # cgroup v1, cpu mounted with cpuacct; -1 is no limit
    ("4:memory:/m\n2:cpu,cpuacct:/k\n", {"cpu,cpuacct/k/cpu.cfs_quota_us": "300000\n",
                                         "cpu,cpuacct/k/cpu.cfs_period_us": "100000\n"}, 3.0),
    ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    # /proc names the joined controllers, the mount only `cpu`
    ("2:cpu,cpuacct:/k\n", {"cpu/k/cpu.cfs_quota_us": "200000\n",
                             "cpu/k/cpu.cfs_period_us": "100000\n"}, 2.0),
    ("0::/\n", {}, None),  # no controller files at all
])
def test_a_cgroup_cpu_quota_is_read_from_v1_and_v2(tmp_path: Path, proc: str,
                                                   files: dict[str, str],
                                                   quota: float | None) -> None:
    """`docker --cpus` and Kubernetes limits set a CPU quota, not a cpuset: affinity showed the
    host's cores, and the default pool oversubscribed the quota. Quotas by hand: QUOTA/PERIOD."""
    assert sweep.cgroup_cpu_quota(*_cgroup(tmp_path, proc, files)) == quota


@pytest.mark.parametrize(("cpus", "cpu_max", "usable"), [
    (set(range(64)), "150000 100000", 2), (set(range(64)), "max 100000", 64),
    ({0, 1}, "800000 100000", 2), (set(range(8)), "10000 100000", 1),
])
def test_usable_cpus_is_the_affinity_capped_by_the_quota_rounded_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cpus: set, cpu_max: str,
        usable: int) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cpus)
    root, proc = _cgroup(tmp_path, "0::/\n", {"cpu.max": cpu_max})
    assert sweep.usable_cpus(root, proc) == usable


def _dies_or_finishes(spec, device: str | None, marks: str | None = None) -> dict:
    """A pool worker's job for the tests below (imported by name in the spawned workers):
    "die" begins, as `_safe_run` marks it, then its worker dies (the out-of-memory killer);
    "dead" kills its worker before it begins; the others finish at once."""
    if spec.name == "dead":
        os._exit(9)
    if marks is not None:
        (Path(marks) / spec.name).touch()
    with (Path(spec.out).parent / "began.txt").open("a") as f:  # the order runs began in
        f.write(spec.name + "\n")
    if spec.name.startswith("die"):
        time.sleep(3)  # the next run waits in the pool's call queue meanwhile, never begun
        os._exit(9)
    return {"ok": True, "name": spec.name, "did": ["train"], "seconds": 0.0}


def _named(tmp_path: Path, names: list[str]) -> list:
    return [dataclasses.replace(s, name=n, out=str(tmp_path / "out" / n))
            for s, n in zip(_specs(tmp_path, [1] * len(names)), names, strict=True)]


def test_a_dead_worker_fails_the_runs_that_began_and_the_queued_ones_go_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A worker killed (out of memory) broke the pool, and every run in it failed, the
    queued ones that never began too: the module says the others go on."""
    monkeypatch.setattr(sweep, "_safe_run", _dies_or_finishes)
    names = ["a", "die", "b", "c", "d", "e", "f"]
    (tmp_path / "out").mkdir()
    got = sweep.execute(_named(tmp_path, names), jobs=1, progress=False)
    assert {r["name"]: r["ok"] for r in got} == {n: n != "die" for n in names}
    # the queued runs began in the new pool in the sweep's order (a set's order was random)
    assert (tmp_path / "out/began.txt").read_text().split() == names
    (dead,) = [r for r in got if not r["ok"]]
    assert dead["error"].startswith("BrokenProcessPool: a worker process died (out of memory?), "
                                    "ending the runs that had begun")
    assert dead["error"].endswith("; rerun to resume it")
    err = capsys.readouterr().err  # one new pool for the break, not one a queued run
    assert err.count("normlab: a worker died") == 1
    assert "normlab: a worker died, ending run(s) die; the queued runs go on in a new pool" in err


def test_a_worker_dying_before_any_run_begins_fails_them_and_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No run had begun, so a new pool would break the same way: given up, not forever, and
    said as it is (not "ending the runs that had begun ...; rerun to resume it")."""
    monkeypatch.setattr(sweep, "_safe_run", _dies_or_finishes)
    got = sweep.execute(_named(tmp_path, ["dead", "x", "y"]), jobs=1, progress=False)
    assert [r["ok"] for r in got] == [False] * 3
    assert {r["error"] for r in got} == {"BrokenProcessPool: a worker process died before this "
                                         "run began (as it started?); rerun to retry"}


def test_a_run_is_marked_begun_before_it_can_fail(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (spec,) = _named(tmp_path, ["r"])
    Path(spec.out).parent.mkdir(parents=True)
    Path(spec.out).write_text("a file where the run's folder goes")
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: True)
    marks = tmp_path / "marks"
    marks.mkdir()
    assert not sweep._safe_run(spec, "cpu", str(marks))["ok"]
    assert (marks / "r").is_file()


def test_the_readmes_sweep_file_is_read_as_its_comments_say(tmp_path: Path) -> None:
    """The README's sweep file, with its base at the checkout's: 2 placements x 3 seeds named
    by the template, [set] in every run, [run.analysis] passed on."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    text = readme.split("```toml\n", 1)[1].split("```", 1)[0]
    base = Path(__file__).resolve().parents[1] / "configs/addition/pre.toml"
    f = tmp_path / "s.toml"
    f.write_text(text.replace('"../addition/pre.toml"', repr(str(base))))
    specs = load_sweep(f, tmp_path / "out")
    assert [s.name for s in specs] == [f"{p}-s{i}" for p in ("pre", "qkv") for i in range(3)]
    assert {(s.config["train"]["steps"], s.analyze) for s in specs} == {(2000, True)}
    assert all(s.analysis == {"n_draws": 8} for s in specs)


def test_a_second_dead_worker_makes_a_third_pool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Each break is its own: the runs queued after a second one go on in a third pool (they
    were sent to the second, broken one)."""
    monkeypatch.setattr(sweep, "_safe_run", _dies_or_finishes)
    names = ["a", "die", "b", "die2", "c"]
    (tmp_path / "out").mkdir()
    got = sweep.execute(_named(tmp_path, names), jobs=1, progress=False)
    assert {r["name"]: r["ok"] for r in got} == {n: not n.startswith("die") for n in names}
    assert capsys.readouterr().err.count("normlab: a worker died") == 2


def test_a_sweeps_analysis_past_the_eval_sets_is_not_said_when_the_sweep_is_read(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """n_examples past the eval sets was warned of while the sweep was read, once for every
    model of the grid, before any run trained; each run's analysis says it in its turn. The
    splits are still checked then."""
    f = tmp_path / "s.toml"
    grid = ('[grid]\n"model.n_heads" = [4, 2]\n[set]\n"task.grid" = "smoke"\n'
            '"task.eval_size" = 8\n[run]\n')  # 2 train cells of 8 problems
    f.write_text(grid + "analysis = {n_examples = 1000}\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        specs = load_sweep(f, tmp_path / "out")
    assert capsys.readouterr() == ("", "")
    assert [s.analysis for s in specs] == [{"n_examples": 1000}] * 2
    f.write_text(grid + 'analysis = {n_examples = 1000, splits = ["trian"]}\n')
    with pytest.raises(ValueError, match=r"sweep\.run\.analysis\.splits: unknown split 'trian'"):
        load_sweep(f, tmp_path / "out")
