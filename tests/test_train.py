"""Training learns, checkpoints are safe, resume is exact, bad input is one clear line."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import normlab.train as tr
from conftest import TINY_RUN as TINY
from normlab import allocator, build_model
from normlab.analysis.report import analyze_run
from normlab.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    sidecar_hash,
    sidecar_of,
)
from normlab.cli import eval_run, main
from normlab.config import dump_toml, load_config
from normlab.train import TrainingError, _written_here, loss_on, lr_at, train


def cfg(*extra: str):
    return load_config(None, [*TINY, *extra])


def test_learns_a_one_digit_cell(tmp_path: Path) -> None:
    c = cfg(
        "task.train=[[1, 1]]",
        "task.splits={held = [[2, 1]]}",
        "train.steps=150",
        "train.lr=3e-3",
        "train.eval_every=150",
        "train.checkpoint_every=150",
    )
    last = train(c, tmp_path / "run", progress=False)
    assert last["accuracy"]["train"] == 1.0


def _weights(run: Path) -> dict[str, torch.Tensor]:
    newest = list_checkpoints(run / "checkpoints")[-1]
    return load_file(newest.with_suffix(".safetensors"))


def _straight_and_resumed(
    c, tmp_path: Path, stop_after: int
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Newest weights of a straight run and of one killed after `stop_after` steps, resumed."""
    train(c, tmp_path / "straight", progress=False)
    train(c, tmp_path / "killed", progress=False, stop_after=stop_after)
    train(c, tmp_path / "killed", progress=False, resume=True)
    return _weights(tmp_path / "straight"), _weights(tmp_path / "killed")


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_resume_after_kill_is_bitwise_identical(tmp_path: Path, arch: str) -> None:
    c = cfg(
        f"model.arch='{arch}'",
        "train.steps=40",
        "train.checkpoint_every=10",
        "train.eval_every=20",
        "model.dropout=0.1",
    )
    # the kill after step 25 loses steps 21-25; resume restarts from the step-20 checkpoint
    a, b = _straight_and_resumed(c, tmp_path, stop_after=25)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert _logged(tmp_path / "killed") == _logged(tmp_path / "straight")
    # a kill at a checkpoint step that is no log step: `stop_after` logged a line there, which
    # the resume kept, where a killed run (and an uninterrupted one) has none
    c = cfg(f"model.arch='{arch}'", "train.steps=10", "train.checkpoint_every=4",
            "train.log_every=3", "train.eval_every=10")
    _straight_and_resumed(c, tmp_path / "at4", stop_after=4)
    assert [r["step"] for r in _logged(tmp_path / "at4/killed")] == [3, 6, 9, 10]
    assert _logged(tmp_path / "at4/killed") == _logged(tmp_path / "at4/straight")


def _logged(run: Path) -> list[dict]:
    """A run's metrics.jsonl, less what depends on the clock."""
    clock = ("elapsed_s", "tokens_per_s")
    return [{k: v for k, v in json.loads(x).items() if k not in clock}
            for x in (run / "metrics.jsonl").open()]


def test_resume_is_bitwise_identical_on_two_threads(tmp_path: Path) -> None:
    """`train.threads = 2` trains reproducibly too: with indexing for the embedding tables the
    token and digit-position gradients were summed in a varying order on two threads."""
    # batches large enough that the lookup's backward runs in parallel
    c = cfg("train.threads=2", "train.steps=30", "train.checkpoint_every=10",
            "train.eval_every=30", "train.batch_size=128", "model.d_model=64",
            "task.reverse_answer=true", "task.digit_positions=true", "model.n_aux_positions=8")
    try:
        a, b = _straight_and_resumed(c, tmp_path, stop_after=15)
    finally:
        torch.set_num_threads(1)  # train() sets the run's thread count
    assert "model/W_aux" in a and a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_a_finished_run_resumes_only_with_its_own_config(tmp_path: Path) -> None:
    """`--resume` on a finished run skips it only for the config it was made with: a sweep
    rerun after its `[set]` changed used to report the old run done, with the old results."""
    c = cfg("train.steps=10", "train.checkpoint_every=10", "train.eval_every=10")
    last = train(c, tmp_path / "run", progress=False)
    done = json.loads((tmp_path / "run" / "train_done.json").read_text())
    assert {"git_commit", "torch"} <= set(done["provenance"])  # who finished it, as results do
    assert done["config"] == json.loads(json.dumps(c.to_dict()))  # and what, seed included
    assert done.pop("config")["train"]["seed"] == c.train.seed and done.pop("provenance")
    assert train(c, tmp_path / "run", progress=False, resume=True) == done == last
    # which field, of some 60: it said only that the config differs
    with pytest.raises(ValueError, match=r"--resume: the config differs from the one saved in "
                                         r"'.*run' \(model\.d_mlp: saved \d+, given 32\); use"):
        train(cfg("train.steps=10", "train.checkpoint_every=10", "train.eval_every=10",
                  "model.d_mlp=32"), tmp_path / "run", progress=False, resume=True)
    with pytest.raises(ValueError, match=r"\(model\.d_mlp: saved \d+, given 32; 2 more: "
                                         r"train\.lr, train\.steps\)"):
        train(cfg("train.steps=11", "train.checkpoint_every=10", "train.eval_every=10",
                  "model.d_mlp=32", "train.lr=0.5"), tmp_path / "run", progress=False,
              resume=True)
    # the seed is what the run trained, not where it ran: another seed is another run
    with pytest.raises(ValueError, match=r"\(train\.seed: saved 0, given 1\); use"):
        train(cfg("train.steps=10", "train.checkpoint_every=10", "train.eval_every=10",
                  "train.seed=1"), tmp_path / "run", progress=False, resume=True)
    # a config built in Python with tuples is the same run as the lists read back from TOML
    c = cfg("train.steps=10", "train.checkpoint_every=10", "train.eval_every=10",
            "task.train=[[1, 1]]", "task.splits={held = [[2, 1]]}")
    train(c, tmp_path / "cells", progress=False)
    c.task.train = [(1, 1)]
    done = json.loads((tmp_path / "cells" / "train_done.json").read_text())
    assert train(c, tmp_path / "cells", progress=False, resume=True) == {
        k: v for k, v in done.items() if k not in ("config", "provenance")}


def test_resume_accepts_a_checkpoint_from_before_an_option_existed(tmp_path: Path) -> None:
    """A sidecar config without a newer key (here `task.complement_answer`) means its default."""
    c = cfg("train.steps=20", "train.checkpoint_every=10", "train.eval_every=20")
    train(c, tmp_path / "run", progress=False, stop_after=10)
    for side in (tmp_path / "run/checkpoints").glob("*.json"):
        meta = json.loads(side.read_text())
        del meta["config"]["task"]["complement_answer"]
        del meta["sidecar_sha256"]  # nor its own hash (newer still)
        side.write_text(json.dumps(meta))
    train(c, tmp_path / "run", progress=False, resume=True)
    train(c, tmp_path / "straight", progress=False)
    a, b = _weights(tmp_path / "run"), _weights(tmp_path / "straight")
    assert all(torch.equal(a[k], b[k]) for k in a)
    train(c, tmp_path / "other", progress=False, stop_after=10)
    changed = cfg("train.steps=20", "train.checkpoint_every=10", "train.eval_every=20",
                  "task.reverse_answer=true", "task.complement_answer=true")
    with pytest.raises(ValueError, match="--resume: the config differs"):  # still compared
        train(changed, tmp_path / "other", progress=False, resume=True)


def test_compiled_training_matches_eager_and_resumes_across_the_setting(tmp_path: Path) -> None:
    """`train.compile` changes how the step runs, not what it computes or what is saved."""
    c = cfg("train.steps=12", "train.checkpoint_every=6", "train.eval_every=12")
    train(c, tmp_path / "eager", progress=False)
    compiled = cfg("train.steps=12", "train.checkpoint_every=6", "train.eval_every=12",
                   "train.compile=true")
    from torch._dynamo.utils import counters

    counters.clear()
    train(compiled, tmp_path / "compiled", progress=False)
    assert counters["stats"]["unique_graphs"] >= 1  # the step really went through dynamo
    a, b = _weights(tmp_path / "eager"), _weights(tmp_path / "compiled")
    assert a.keys() == b.keys()  # no `_orig_mod.` prefix: load_run reads both alike
    for k in a:  # inductor reorders float sums: equal up to rounding, not bitwise
        torch.testing.assert_close(b[k], a[k], rtol=1e-4, atol=1e-5)
    train(c, tmp_path / "mixed", progress=False, stop_after=6)  # eager half, compiled half
    train(compiled, tmp_path / "mixed", progress=False, resume=True)
    for k, v in _weights(tmp_path / "mixed").items():
        torch.testing.assert_close(v, a[k], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match=r"train\.compile: expected"):
        cfg("train.compile=1")


def test_corrupted_checkpoint_is_one_line_and_previous_still_loads(tmp_path: Path) -> None:
    c = cfg("train.steps=20", "train.checkpoint_every=10", "train.eval_every=20")
    train(c, tmp_path / "run", progress=False)
    prev, newest = list_checkpoints(tmp_path / "run/checkpoints")
    blob = newest.with_suffix(".safetensors")
    blob.write_bytes(blob.read_bytes()[: blob.stat().st_size // 2])  # truncate
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(newest)
    assert "truncated or corrupted" in str(err.value) and "\n" not in str(err.value)
    _, meta = load_checkpoint(prev)
    assert meta["step"] == 10
    warnings: list[str] = []
    _, meta = latest_checkpoint(tmp_path / "run/checkpoints", warn=warnings.append)
    assert meta["step"] == 10 and warnings
    side = prev.with_suffix(".json")
    side.write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(prev)
    # both bad, each its own way: the one error names the newest one's fault, not the oldest's
    with pytest.raises(CheckpointError, match=r"^no readable checkpoint in .*: checkpoint "
                                              r"'.*step_0000020\.safetensors' is truncated"):
        latest_checkpoint(tmp_path / "run/checkpoints")


def test_checkpoint_sidecar_records_provenance(tmp_path: Path) -> None:
    train(
        cfg("train.steps=10", "train.checkpoint_every=10", "train.eval_every=10"),
        tmp_path / "run",
        progress=False,
    )
    _, meta = latest_checkpoint(tmp_path / "run/checkpoints")
    assert meta["config"]["train"]["seed"] == 0
    assert {"torch", "git_commit", "python"} <= set(meta["provenance"])
    # how malloc ran is on record too (it moves timings, not numbers): normlab.allocator
    assert meta["provenance"]["malloc"] == allocator.describe()
    assert meta["stream"] and meta["optimizer"]["param_groups"]
    assert "cuda_rng" not in meta  # a CPU run has no device generator to record
    assert (tmp_path / "run/config.toml").is_file()
    assert list((tmp_path / "run/tb").glob("events.out.tfevents.*"))
    rec = [json.loads(x) for x in (tmp_path / "run/metrics.jsonl").open()]
    assert {"step", "loss", "lr", "tokens_per_s"} <= set(rec[-1])


def test_the_gpu_random_state_is_checkpointed_and_restored(monkeypatch) -> None:
    """On a GPU, dropout masks come from the device's generator: its state is saved with the
    CPU's and set back on resume. Faked here (no GPU on the test machines): the fake device
    generator's state is what `torch.cuda` would return and take."""
    from normlab import checkpoint

    gpu = torch.device("cuda", 0)
    states = {gpu: torch.arange(16, dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: states[device].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state",
                        lambda state, device: states.__setitem__(device, state.clone()))
    saved = checkpoint.rng_state(gpu)
    assert set(saved) == {"torch_rng", "cuda_rng"}
    assert set(checkpoint.rng_state(torch.device("cpu"))) == {"torch_rng"}
    cpu_state = torch.get_rng_state()
    states[gpu] = torch.zeros(16, dtype=torch.uint8)  # both generators move on
    torch.rand(3)
    assert checkpoint.restore_rng(saved, gpu)
    assert torch.equal(states[gpu], torch.arange(16, dtype=torch.uint8))
    assert torch.equal(torch.get_rng_state(), cpu_state)
    del saved["cuda_rng"]  # a checkpoint written on the CPU, resumed on a GPU: said, not hidden
    assert not checkpoint.restore_rng(saved, gpu)
    assert checkpoint.restore_rng(saved, torch.device("cpu"))


def test_checkpoints_record_the_commit_the_run_started_from(tmp_path: Path, monkeypatch) -> None:
    """Editing or committing while a run trains must not relabel code already in memory."""
    import normlab.io

    labels = iter(["started", *["later"] * 100])
    monkeypatch.setattr(normlab.io, "git_commit", lambda: next(labels))
    train(cfg("train.steps=20", "train.checkpoint_every=10", "train.eval_every=20"),
          tmp_path / "run", progress=False)
    sides = list_checkpoints(tmp_path / "run/checkpoints")
    assert len(sides) == 2
    assert [json.loads(s.read_text())["provenance"]["git_commit"] for s in sides] == ["started"] * 2


def test_the_commit_is_marked_dirty_where_the_tree_has_local_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Results made from uncommitted code carry "-dirty" after the commit: the commit tests
    replace `git_commit`, so dropping the mark (a clean commit's name on them) passed."""
    import os
    import subprocess

    import normlab
    from normlab.io import git_commit

    if shutil.which("git") is None:
        pytest.skip("no git")
    pkg = tmp_path / "src" / "normlab"  # a checkout: git_commit asks the tree above src/
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")

    # the user's own git settings (a global commit.gpgsign) are not the test's
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", os.devnull)
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")

    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              cwd=tmp_path, check=True, capture_output=True,
                              text=True).stdout.strip()

    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "x")
    sha = git("rev-parse", "HEAD")
    monkeypatch.setattr(normlab, "__file__", str(pkg / "__init__.py"))
    assert git_commit() == sha
    (pkg / "__init__.py").write_text("x = 1\n")
    assert git_commit() == sha + "-dirty"


def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(tmp_path: Path, monkeypatch) -> None:
    real = tr.loss_on
    calls = {"n": 0}

    def poisoned(model, batch):
        calls["n"] += 1
        loss, n = real(model, batch)
        return (loss * float("nan"), n) if calls["n"] > 12 else (loss, n)

    monkeypatch.setattr(tr, "loss_on", poisoned)
    with pytest.raises(TrainingError, match="loss is nan at step 13; stopped, the last good"):
        train(
            cfg("train.steps=30", "train.checkpoint_every=10", "train.eval_every=30"),
            tmp_path / "run",
            progress=False,
        )
    _, meta = latest_checkpoint(tmp_path / "run/checkpoints")
    assert meta["step"] == 10
    calls["n"] = 10  # poisoned from the third step, before any checkpoint: none is claimed
    with pytest.raises(TrainingError, match="no checkpoint was written before"):
        train(cfg("train.steps=30", "train.checkpoint_every=10", "train.eval_every=30"),
              tmp_path / "early", progress=False)


def test_unchecked_losses_wait_at_most_check_losses_every_steps(tmp_path: Path,
                                                                monkeypatch) -> None:
    """With log and checkpoint steps far apart, losses are still checked every
    CHECK_LOSSES_EVERY steps: a bad one stops the run that soon, named by its step."""
    monkeypatch.setattr(tr, "CHECK_LOSSES_EVERY", 4)
    real, calls = tr.loss_on, {"n": 0}

    def poisoned(model, batch):
        calls["n"] += 1
        loss, n = real(model, batch)
        return (loss * float("nan"), n) if calls["n"] == 5 else (loss, n)

    monkeypatch.setattr(tr, "loss_on", poisoned)
    every = [f"train.{k}=40" for k in ("log_every", "eval_every", "checkpoint_every")]
    with pytest.raises(TrainingError, match="loss is nan at step 5; stopped, no checkpoint"):
        train(cfg("train.steps=40", *every), tmp_path / "run", progress=False)
    assert calls["n"] == 8  # checked after steps 4 and 8


def test_training_steps_read_nothing_back_to_the_host(tmp_path: Path, monkeypatch) -> None:
    """On a GPU every read of a tensor's value (`bool`, `int`, `.item()`) makes the host wait
    for all the work queued before it, so the loop reads only at its log, evaluation and
    checkpoint steps (it checked each step's loss, and counted its tokens, as it came).
    Counted on the CPU: 20 steps read as often as 10, when both log, evaluate and checkpoint
    only at their last step. Evaluation's own reads are left out: its decoding reads what
    the model writes, which differs after 10 and 20 steps."""
    reads, counting = {"n": 0}, {"on": True}

    def counted(real):
        def read(self, *args, **kwargs):
            reads["n"] += counting["on"]
            return real(self, *args, **kwargs)
        return read

    for name in ("__bool__", "__int__", "__float__", "__index__", "item", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch._C.TensorBase, name)))
    real_evaluate = tr.evaluate

    def evaluate(*args, **kwargs):
        counting["on"] = False
        try:
            return real_evaluate(*args, **kwargs)
        finally:
            counting["on"] = True

    monkeypatch.setattr(tr, "evaluate", evaluate)
    n = {}
    for steps in (10, 20):
        reads["n"] = 0
        every = [f"train.{k}={steps}" for k in ("log_every", "eval_every", "checkpoint_every")]
        train(cfg(f"train.steps={steps}", *every), tmp_path / str(steps), progress=False)
        n[steps] = reads["n"]
    assert n[10] == n[20] > 0


def test_never_overwrites_without_force(tmp_path: Path) -> None:
    c = cfg("train.steps=5", "train.checkpoint_every=5", "train.eval_every=5")
    train(c, tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match="already exists; pass --resume"):
        train(c, tmp_path / "run", progress=False)
    train(c, tmp_path / "run", progress=False, force=True)


def test_lr_schedule() -> None:
    c = cfg("train.steps=100", "train.warmup_steps=10", "train.lr=1.0", "train.min_lr_ratio=0.1")
    t = c.train
    assert lr_at(0, t) == pytest.approx(0.1)
    assert lr_at(9, t) == pytest.approx(1.0)
    assert lr_at(10, t) == pytest.approx(1.0)
    assert lr_at(100, t) == pytest.approx(0.1)
    assert lr_at(55, t) == pytest.approx(0.1 + 0.9 * 0.5)


def test_eval_json_schema(tmp_path: Path) -> None:
    train(
        cfg("train.steps=5", "train.checkpoint_every=5", "train.eval_every=5"),
        tmp_path / "run",
        progress=False,
    )
    result = eval_run(tmp_path / "run", limit=8)
    saved = json.loads((tmp_path / "run/eval.json").read_text())
    assert saved["splits"].keys() == {"train", "interpolation", "extrapolation"}
    for r in saved["splits"].values():
        assert 0 <= r["ci95"][0] <= r["accuracy"] <= r["ci95"][1] <= 1 and r["count"] > 0
    cell = saved["cells"][0]
    assert {"n", "d", "split", "accuracy", "count"} <= set(cell)
    assert saved["config"]["model"]["norm_placement"] == "pre"
    assert saved["checkpoint"]["step"] == 5 and result["splits"] == saved["splits"]
    assert saved["limit"] == 8  # a report pools only runs evaluated alike (report.collect)
    assert (tmp_path / "run/heatmap.png").stat().st_size > 1000
    tokens = {(t["cell"], t["split"]): t for t in saved["answer_tokens"]}
    assert tokens.keys() == {(c["cell"], c["split"]) for c in saved["cells"]}
    for t in tokens.values():  # teacher forcing: exact match needs every position right
        pairs = zip(t["by_position"], t["position_counts"], strict=True)
        full = [a for a, c in pairs if c == t["count"]]
        assert t["count"] == 8 and full and t["exact"] <= min(full)


def test_a_limit_that_asks_every_question_is_recorded_as_none(tmp_path: Path) -> None:
    """`--limit` at or past every cell's questions evaluates them all: recorded as a limit,
    `compare` starred the run and the report read it as not comparable with a full one."""
    run = tmp_path / "run"
    train(cfg("task.eval_size=6", "train.steps=2", "train.checkpoint_every=2",
              "train.eval_every=2"), run, progress=False)
    full = eval_run(run)
    assert eval_run(run, limit=6, force=True)["limit"] is None
    saved = json.loads((run / "eval.json").read_text())
    assert saved["limit"] is None and saved["splits"] == full["splits"]
    assert eval_run(run, limit=5, force=True)["limit"] == 5
    assert {c["count"] for c in json.loads((run / "eval.json").read_text())["cells"]} <= {5}


# ---- the command line ----------------------------------------------------------------------


def _cli(capsys, *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err.strip()


def test_cli_bad_input(tmp_path: Path, capsys) -> None:
    out = str(tmp_path / "run")
    code, err = _cli(capsys, "train", "--config", str(tmp_path / "missing.toml"), "--out", out)
    assert code == 2 and err.count("\n") == 0 and "not found" in err
    code, err = _cli(capsys, "train", "--config", str(tmp_path), "--out", out)  # "not found"
    assert code == 2 and err == (f"normlab: error: config file {str(tmp_path)!r} is a folder; "
                                 "expected a TOML file")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nd_modle = 3\n")
    code, err = _cli(capsys, "train", "--config", str(bad), "--out", out)
    assert code == 2 and "model.d_modle: unknown key" in err and "\n" not in err
    bad.write_text("[train]\nlr = 'fast'\n")
    code, err = _cli(capsys, "train", "--config", str(bad), "--out", out)
    assert code == 2 and f"config file {str(bad)!r}: train.lr: expected float" in err
    bad.write_text("[model]\nnorm_placement = 'sandwich'\n")
    code, err = _cli(capsys, "train", "--config", str(bad), "--out", out)
    # the file leads its own fields' errors, named as its tables name them
    assert code == 2 and f"config file {str(bad)!r}: model.norm_placement: expected" in err
    code, err = _cli(capsys, "train", "--config", str(bad), "--out", out,
                     "--set", "model.norm_placement=sandwich")
    assert code == 2 and "error: --set model.norm_placement: expected one of" in err
    good = tmp_path / "good.toml"
    good.write_text(
        "[task]\ngrid = 'smoke'\n[train]\nsteps = 2\n[model]\nd_model = 16\nn_layers = 1\n"
    )
    Path(out).mkdir()
    (Path(out) / "keep.txt").write_text("results")
    code, err = _cli(capsys, "train", "--config", str(good), "--out", out, "--quiet")
    assert code == 2 and ("holds files but is not a normlab run folder (no run config.toml, "
                          "train_done.json, checkpoint or metrics.jsonl)") in err
    assert (Path(out) / "keep.txt").read_text() == "results"
    code, err = _cli(capsys, "eval", str(tmp_path / "nothing"))
    assert code == 2 and err == f"normlab: error: run folder {str(tmp_path / 'nothing')!r} does " \
                                "not exist"  # it said "not a normlab run folder (no checkpoints/)"
    code, err = _cli(capsys, "train", "--config", str(good), "--out", out, "--set",
                     "model.d_modle=32")
    assert code == 2 and "model.d_modle: unknown key (did you mean 'd_model'?); expected" in err
    code, err = _cli(capsys, "train", "--config", str(good), "--out", out, "--set", "oops")
    assert code == 2 and "KEY=VALUE" in err


def test_cli_compile_flag_sets_train_compile(tmp_path: Path, monkeypatch, capsys) -> None:
    """`normlab train --compile` reaches `train()` as `train.compile = true`; absent, false."""
    import normlab.train

    seen = []
    monkeypatch.setattr(normlab.train, "train", lambda cfg, out, **kw: seen.append(cfg) or {})
    good = tmp_path / "good.toml"
    good.write_text("[task]\ngrid = 'smoke'\n")
    for extra in (["--compile"], []):
        assert main(["train", "--config", str(good), "--out", str(tmp_path / "r"), *extra]) == 0
    assert [c.train.compile for c in seen] == [True, False]


def test_cli_train_eval_compare(tmp_path: Path, capsys) -> None:
    good = tmp_path / "good.toml"
    good.write_text(
        "[task]\ngrid = 'smoke'\neval_size = 8\n[train]\nsteps = 4\neval_every = 4\n"
        "checkpoint_every = 4\n[model]\nd_model = 16\nn_layers = 1\n"
    )
    for p in ("pre", "qkv"):
        code = main(
            [
                "train",
                "--config",
                str(good),
                "--out",
                str(tmp_path / p),
                "--quiet",
                "--set",
                f"model.norm_placement={p}",
                "--seed",
                "3",
            ]
        )
        assert code == 0
        assert main(["eval", str(tmp_path / p)]) == 0
    capsys.readouterr()
    assert main(["compare", "--markdown", str(tmp_path / "pre"), str(tmp_path / "qkv")]) == 0
    table = capsys.readouterr().out
    assert "| pre | pre | 3 |" in table and "| qkv | qkv | 3 |" in table


def test_eval_and_analyze_never_overwrite_without_force(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    train(cfg("train.steps=5", "train.checkpoint_every=5", "train.eval_every=5"), run,
          progress=False)
    assert main(["eval", str(run), "--limit", "4"]) == 0
    before = (run / "eval.json").read_text()
    capsys.readouterr()
    code, err = _cli(capsys, "eval", str(run), "--limit", "4")
    assert code == 2 and "eval.json' already exists; pass --force" in err and "\n" not in err
    assert (run / "eval.json").read_text() == before
    assert main(["eval", str(run), "--limit", "4", "--force"]) == 0
    (run / "analysis").mkdir()
    (run / "analysis" / "collapse.json").write_text("{}")
    code, err = _cli(capsys, "analyze", str(run))
    assert code == 2 and "already exists; pass --force" in err
    assert (run / "analysis" / "collapse.json").read_text() == "{}"


def test_analyze_lands_its_files_together_or_not_at_all(tmp_path: Path, monkeypatch,
                                                        capsys) -> None:
    """The files were written one by one, then ~2 s of figures: a full disk left one new
    norms.json (a rerun then refused to replace it), a failure or kill while drawing left new
    JSON beside the old figures, and the sweep took such a folder as done. Now a failure at
    any write, or while drawing, leaves the folder as it was; a killed writer's staging folder
    is cleared by the next; a second analysis of a folder being analysed is refused."""
    import errno
    import fcntl
    import os

    import normlab.analysis.report
    import normlab.io as nio
    from normlab.analysis.report import analyze_run

    run = tmp_path / "run"
    train(cfg("train.steps=5", "train.checkpoint_every=5", "train.eval_every=5"), run,
          progress=False)
    small = {"n_examples": 4, "n_draws": 2, "sigmas": [0.1]}
    seconds = analyze_run(run, **small)["seconds"]  # each measurement timed under its name
    assert seconds.keys() == {"norms", "collapse_sweep", "accuracy", "interference"}
    before = {f.name: f.read_bytes() for f in (run / "analysis").iterdir()}
    assert len(before) == 7
    real = nio.atomic_write_bytes
    for full_at in (1, 3, 5):  # a full disk at the first, a middle and a figure's write
        writes: list[Path] = []

        def write(path: Path, data: bytes, full_at: int = full_at,
                  writes: list = writes) -> None:
            writes.append(path)
            if len(writes) == full_at:
                raise nio.cannot_write(path, OSError(errno.ENOSPC, "No space left on device"))
            real(path, data)

        monkeypatch.setattr(nio, "atomic_write_bytes", write)
        monkeypatch.setattr(normlab.analysis.report, "atomic_write_bytes", write)
        with pytest.raises(OSError, match="No space left on device"):
            analyze_run(run, **small, seed=full_at)
        assert {f.name: f.read_bytes() for f in (run / "analysis").iterdir()} == before
    monkeypatch.undo()

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the figure failed")

    moved: list[str] = []

    def replace(src: object, dst: object) -> None:
        if Path(str(dst)).parent == run / "analysis":  # not a write into the staging folder
            moved.append(Path(str(dst)).name)
        real_replace(src, dst)

    real_replace = nio.os.replace
    monkeypatch.setattr(nio.os, "replace", replace)
    analyze_run(run, **small, seed=8)
    assert moved[-1] == "interference.json" and len(moved) == 7  # the sweep's mark last
    monkeypatch.undo()
    before = {f.name: f.read_bytes() for f in (run / "analysis").iterdir()}
    monkeypatch.setattr(normlab.analysis.report, "plot_interference", fail)
    with pytest.raises(RuntimeError, match="the figure failed"):
        analyze_run(run, **small, seed=9)
    assert {f.name: f.read_bytes() for f in (run / "analysis").iterdir()} == before
    monkeypatch.undo()
    (run / "analysis" / ".staging-killed").mkdir()  # as a kill while staging leaves it
    (run / "analysis" / ".staging-killed" / "norms.json").write_text("{}")
    analyze_run(run, **small, seed=3)
    after = {f.name: f.read_bytes() for f in (run / "analysis").iterdir()}
    assert after.keys() == before.keys() and after["norms.json"] != before["norms.json"]
    # a refusal leaves no analysis folder it made (the lock makes it, before any check)
    with pytest.raises(ValueError, match="unknown head 99"):
        analyze_run(run, out=tmp_path / "new" / "analysis", heads=[99], **small)
    assert not (tmp_path / "new" / "analysis").exists()
    (tmp_path / "file").write_text("x")  # a file where the folder goes: named as what it is
    with pytest.raises(ValueError, match=r"^analysis folder '.*file': expected a folder for "
                                         r"the results; it is a file$"):
        analyze_run(run, out=tmp_path / "file", **small)
    fd = os.open(run / "analysis", os.O_RDONLY | os.O_DIRECTORY)  # another process's lock
    loads: list[Path] = []
    monkeypatch.setattr(tr, "load_run", lambda d, *a: loads.append(d))
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError, match="is being analysed by another process"):
            analyze_run(run, **small)
        assert loads == []  # refused before it loaded the model (the lock came only after)
        monkeypatch.undo()
        capsys.readouterr()
        code, err = _cli(capsys, "analyze", str(run), "--examples", "4", "--draws", "2",
                         "--force")
        assert code == 2 and err == (f"normlab: error: {str(run / 'analysis')!r} is being "
                                     "analysed by another process (or its run trained); wait "
                                     "for it to end")
    finally:
        os.close(fd)


def test_analyze_writes_all_its_files_or_none(tmp_path: Path, monkeypatch, capsys) -> None:
    """`analyze --force` wrote norms.json first: a failure later (a seed past 2**64 - 1
    reached torch's generator only then) left a new norms.json beside the old collapse.json.
    Now a seed outside a run config's range is refused before any work, a failure part way
    leaves every file as it was, and the command lists the files it wrote (it printed the keys
    of its return value)."""
    import normlab.analysis.report

    run = tmp_path / "run"
    train(cfg("train.steps=5", "train.checkpoint_every=5", "train.eval_every=5"), run,
          progress=False)
    small = ["--examples", "4", "--draws", "2", "--sigmas", "0.1"]
    capsys.readouterr()
    assert main(["analyze", str(run), *small]) == 0
    out = capsys.readouterr().out.strip()
    assert out == (f"wrote {run / 'analysis'}: norms.json, collapse.json, collapse_rows.npz, "
                   "interference.json, norms.png, collapse.png, interference.png")
    before = {f.name: f.read_bytes() for f in (run / "analysis").iterdir()}
    code, err = _cli(capsys, "analyze", str(run), *small, "--force", "--seed", str(2**63))
    assert code == 2 and err == ("normlab: error: --seed: expected an int in [0, 2**63); got "
                                 f"{2**63}")

    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the probe failed")

    monkeypatch.setattr(normlab.analysis.report, "interference_probe", fail)
    code, err = _cli(capsys, "analyze", str(run), *small, "--force", "--seed", "7")
    assert code == 2 and err == "normlab: error: the probe failed"
    assert {f.name: f.read_bytes() for f in (run / "analysis").iterdir()} == before
    # more draws than memory holds grew the process for minutes until the allocator said
    # "can't allocate memory" (or the kernel killed it): sized first, refused by the flag
    import normlab.analysis.collapse

    monkeypatch.setattr(normlab.analysis.collapse, "memory_bytes", lambda: 2**30)
    code, err = _cli(capsys, "analyze", str(run), "--examples", "4", "--draws", str(10**9),
                     "--force")
    assert code == 2 and re.fullmatch(
        r"normlab: error: --draws: 1000000000 noise draws of \d+ examples need [\d,.]+ GiB of "
        r"noise tables, more than this machine's 1\.0 GiB of memory and swap; expected fewer "
        r"draws \(or examples\)", err), err
    assert {f.name: f.read_bytes() for f in (run / "analysis").iterdir()} == before


def test_cli_analyze_threads(tmp_path: Path, monkeypatch, capsys) -> None:
    """`normlab analyze --threads N` runs the analysis on N torch threads; 0 is a clear error."""
    import torch

    import normlab.analysis.report

    seen = []
    monkeypatch.setattr(normlab.analysis.report, "analyze_run",
                        lambda run_dir, **kw: seen.append(torch.get_num_threads())
                        or {"out": str(run_dir), "files": []})
    before = torch.get_num_threads()
    try:
        assert main(["analyze", str(tmp_path), "--threads", "2"]) == 0  # conftest sets 1
        assert seen == [2]
        code, err = _cli(capsys, "analyze", str(tmp_path), "--threads", "0")
        assert code == 2 and err == "normlab: error: --threads: expected an int >= 1; got 0"
        assert seen == [2]
    finally:
        torch.set_num_threads(before)


# ---- the twenty-first session's review: nothing lost, resume exact, bad input one line ----


def test_every_out_folder_is_checked_before_any_work(tmp_path: Path, capsys,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`reproduce` and `sweep` said "[Errno 17] File exists" for an --out that is a file, naming
    no option; a folder this process may not write to is named too (faked: tests may run as
    root, whom os.access lets write anywhere)."""
    (tmp_path / "file").write_text("x")
    for argv in (["reproduce"], ["sweep", "--config", str(tmp_path / "file")]):
        code, err = _cli(capsys, *argv, "--out", str(tmp_path / "file"))
        assert code == 2 and err.endswith("file': expected a folder for the results; it is a "
                                          "file"), err
    from normlab import io

    (tmp_path / "link").symlink_to(tmp_path / "nowhere")  # mkdir: "File exists"
    with pytest.raises(ValueError, match=r"/link/run': '.+/link' is a link to '.+/nowhere', "
                                         r"which does not exist$"):
        io.check_out_folder(tmp_path / "link" / "run")
    monkeypatch.setattr(io.os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match=rf"^--out '.+/new/run': {re.escape(repr(str(tmp_path)))}"
                                         r" is not writable here$"):
        io.check_out_folder(tmp_path / "new" / "run")


def test_force_and_resume_only_touch_a_run_folder(tmp_path: Path) -> None:
    """`--force` emptied any folder (a mistyped --out), and a refusal found after it (a device
    this machine lacks) left nothing of the old run; `--out` naming a file is one line."""
    c = cfg("train.steps=5", "train.checkpoint_every=5", "train.eval_every=5")
    other = tmp_path / "thesis"
    other.mkdir()
    (other / "thesis.tex").write_text("precious")
    for kw in (dict(force=True), dict(resume=True)):
        with pytest.raises(ValueError, match="is not a normlab run folder"):
            train(c, other, progress=False, **kw)
    assert (other / "thesis.tex").read_text() == "precious"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="expected a folder for the results; it is a file"):
        train(c, tmp_path / "file", progress=False)
    with pytest.raises(ValueError, match=r"/sub': expected a folder for the results; '.+/file' "
                                         r"is a file$"):  # "[Errno 20] Not a directory"
        train(c, tmp_path / "file" / "sub", progress=False)
    train(c, tmp_path / "run", progress=False)
    before = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="cuda"):
            train(cfg("train.steps=5", "train.device='cuda'"), tmp_path / "run", progress=False,
                  force=True)
        assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == before


def test_a_force_stopped_part_way_never_leaves_a_finished_record_alone(tmp_path: Path,
                                                                        monkeypatch) -> None:
    """`--force` deleted in path order, train_done.json last: stopped part way, a folder kept
    the record of a finished run without its checkpoints or config.toml, and `--resume` then
    returned it as done (under any config). Stopped at every deletion, the record is gone
    before what marks the run, and what marks the run goes last."""
    import shutil

    from normlab.train import DONE, prepare_run_dir

    c = cfg("train.steps=4", "train.checkpoint_every=2", "train.eval_every=4")
    train(c, tmp_path / "done", progress=False)
    n_files = len(tr._written_here(tmp_path / "done")[0])
    real = Path.unlink
    for stop in range(n_files):
        run = tmp_path / f"run{stop}"
        shutil.copytree(tmp_path / "done", run)
        calls = []

        def unlink(self: Path, *a: object, stop: int = stop, calls: list = calls) -> None:
            if len(calls) == stop:
                raise KeyboardInterrupt
            calls.append(self)
            real(self, *a)

        monkeypatch.setattr(Path, "unlink", unlink)
        with pytest.raises(KeyboardInterrupt):
            prepare_run_dir(run, resume=False, force=True)
        monkeypatch.setattr(Path, "unlink", real)
        assert stop == 0 or not (run / DONE).exists()
        marks = [p for p in calls if p.name == "config.toml" or p.parent.name == "checkpoints"]
        assert calls[len(calls) - len(marks):] == marks  # the marks after everything else
        if stop:  # resumed, it trains again: never the old record without its checkpoints
            assert train(c, run, progress=False, resume=True)["step"] == 4
            assert tr.list_checkpoints(run / "checkpoints")


def test_force_clears_a_killed_analysis_staging_folder(tmp_path: Path) -> None:
    """A kill while `analyze` moved its files left them in analysis/.staging-*, which `--force`
    kept as "not written by normlab": the new run carried the old run's results."""
    import fcntl
    import os

    c = cfg("train.steps=2", "train.checkpoint_every=2", "train.eval_every=2")
    run = tmp_path / "run"
    train(c, run, progress=False)
    stage = run / "analysis" / ".staging-x1y2"
    stage.mkdir(parents=True)
    (stage / "norms.json").write_text("{}")
    logs: list[str] = []
    # an analysis still running holds the folder: refused, before anything is deleted (its
    # staging folder cleared under it, it listed seven files and landed one)
    fd = os.open(run / "analysis", os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(ValueError, match=r"analysis' is being analysed by another process"):
            train(c, run, progress=False, force=True, log=logs.append)
    finally:
        os.close(fd)
    assert stage.exists() and (run / "train_done.json").exists()
    train(c, run, progress=False, force=True, log=logs.append)
    assert not stage.exists() and not any("kept what normlab did not write" in m for m in logs)


def test_a_finished_run_is_judged_by_the_config_it_trained_with(tmp_path: Path,
                                                                capsys) -> None:
    """An edited config.toml: a resume trained on with the checkpoint's config and kept the
    edit, and the finished run was judged by it (its true config refused, one that never
    trained taken as done). The resume now writes the file again, and says so; a finished
    run is judged by train_done.json's config. A changed d_model was named by d_head, the
    size derived from it."""
    c = cfg("train.steps=4", "train.checkpoint_every=2", "train.eval_every=4")
    run = tmp_path / "run"
    train(c, run, progress=False, stop_after=2)
    saved = (run / "config.toml").read_text()
    (run / "config.toml").write_text(saved.replace("lr = ", "lr = 5", 1))
    logs: list[str] = []
    assert train(c, run, progress=False, resume=True, log=logs.append)["step"] == 4
    assert any(m.startswith(f"warning: {str(run / 'config.toml')!r} is not the config this "
                            "run trained with (train.lr: saved ") and m.endswith("written again")
               for m in logs), logs
    assert (run / "config.toml").read_text() == saved
    (run / "config.toml").write_text(saved.replace("lr = ", "lr = 5", 1))
    edited = load_config(run / "config.toml")
    with pytest.raises(ValueError, match=r"\(train\.lr: saved "):  # never trained: refused
        train(edited, run, progress=False, resume=True)
    assert train(c, run, progress=False, resume=True)["step"] == 4  # judged by what trained
    assert (run / "config.toml").read_text() == saved  # and its file made right again
    with pytest.raises(ValueError, match=r"\(train\.lr: saved "):
        train(edited, run, progress=False, resume=True)
    # a rewrite that cannot be made (a read-only disk) is a warning: the run still reads as done
    logs.clear()
    (run / "config.toml").write_text(saved.replace("lr = ", "lr = 5", 1))
    with pytest.MonkeyPatch.context() as mp:
        def read_only(path: Path, text: str) -> None:
            raise OSError(30, "Read-only file system", str(path))

        mp.setattr(tr, "atomic_write_text", read_only)
        assert train(c, run, progress=False, resume=True, log=logs.append)["step"] == 4
    assert logs[-1].startswith(f"warning: {str(run / 'config.toml')!r} is not the config this "
                               "run trained with (train.lr: saved ")
    assert "; could not be written again: " in logs[-1] and "written again;" not in logs[-1]
    assert not any(m.endswith("; written again") for m in logs)  # said once, after trying
    # an older record with no config: nothing checked against what trained, so nothing written
    done = json.loads((run / "train_done.json").read_text())
    (run / "train_done.json").write_text(json.dumps({k: v for k, v in done.items()
                                                     if k != "config"}))
    (run / "config.toml").unlink()
    other = cfg("train.steps=4", "train.checkpoint_every=2", "train.eval_every=4",
                "train.lr=0.5")
    assert train(other, run, progress=False, resume=True)["step"] == 4
    assert not (run / "config.toml").exists()
    # a damaged record is left to the run's own path to name (reproduce refused every run):
    # the check falls back on config.toml
    (run / "config.toml").write_text(saved)
    (run / "train_done.json").write_text("{")
    tr.check_saved_config(run, c)
    with pytest.raises(ValueError, match=r"\(train\.lr: saved "):
        tr.check_saved_config(run, other)
    (run / "train_done.json").write_text(json.dumps(done))
    (run / "config.toml").unlink()
    (run / "config.toml").mkdir()  # a folder in its place: said as such, not "missing"
    logs.clear()
    assert train(c, run, progress=False, resume=True, log=logs.append)["step"] == 4
    assert logs[-1].startswith(f"warning: {str(run / 'config.toml')!r} is a folder; could "
                               "not be written again: ")
    (run / "config.toml").rmdir()
    wider = cfg("train.steps=4", "train.checkpoint_every=2", "train.eval_every=4",
                f"model.d_model={2 * c.model.d_model}")
    with pytest.raises(ValueError, match=r"\(model\.d_model: saved \d+, given \d+; 1 more: "
                                         r"model\.d_head\)"):
        train(wider, run, progress=False, resume=True)


def test_force_deletes_only_what_normlab_wrote(tmp_path: Path) -> None:
    """A folder holding any one marker (another tool's config.toml or checkpoints/) counted as
    a run folder, and --force deleted all of it: a thesis beside it too. It now deletes the
    files normlab writes in a run folder, by name, and says what it kept; the new run is
    whole, and a run, evaluated and analysed, leaves nothing behind."""
    c = cfg("train.steps=5", "train.checkpoint_every=5", "train.eval_every=5")
    out = tmp_path / "proj"
    train(c, out, progress=False)
    eval_run(out)
    analyze_run(out, n_examples=4, n_draws=1, sigmas=[0.1])
    (out / "timings.json").write_text("{}")  # as a sweep writes it
    (out / ".metrics.jsonl.x1y2.tmp").write_text("")  # a write a kill cut short
    (out / "checkpoints" / ".step_0000005.json.ab.tmp").write_text("")
    lines: list[str] = []
    train(c, out, progress=False, force=True, log=lines.append)
    assert not any("kept" in ln for ln in lines)  # all of it was normlab's
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoints", "config.toml", "metrics.jsonl", "tb", "train_done.json"]
    # beside a run: another tool's files, in folders normlab writes into too
    (out / "src").mkdir()
    (out / "src" / "thesis.tex").write_text("precious")
    (out / "checkpoints" / "epoch=3.ckpt").write_text("lightning")
    (out / "analysis").mkdir()
    (out / "analysis" / "mine.csv").write_text("mine")
    train(c, out, progress=False, force=True, log=lines.append)
    assert (out / "src" / "thesis.tex").read_text() == "precious"
    assert (out / "checkpoints" / "epoch=3.ckpt").read_text() == "lightning"
    assert (out / "analysis" / "mine.csv").read_text() == "mine"
    assert lines[-1] == (f"--force: kept what normlab did not write in {str(out)!r}: "
                         "analysis/mine.csv, checkpoints/epoch=3.ckpt, src/thesis.tex")


def test_force_and_resume_refuse_another_tools_project(tmp_path: Path) -> None:
    """Another tool's config.toml and checkpoints/ (Hugo's, Lightning's) marked a run folder;
    now only files normlab writes do, and a foreign config.toml beside a run is not replaced."""
    c = cfg("train.steps=5", "train.checkpoint_every=5", "train.eval_every=5")
    other = tmp_path / "site"
    (other / "checkpoints").mkdir(parents=True)
    (other / "config.toml").write_text('baseURL = "https://example.org"\n')
    (other / "checkpoints" / "epoch=3.ckpt").write_text("lightning")
    for kw in (dict(force=True), dict(resume=True)):
        with pytest.raises(ValueError, match="is not a normlab run folder"):
            train(c, other, progress=False, **kw)
    (other / "metrics.jsonl").write_text("")  # a run's log beside that config.toml
    with pytest.raises(ValueError, match=r"config\.toml' is not a normlab run config, and the "
                                         r"new run's would replace it"):
        train(c, other, progress=False, force=True)
    assert (other / "config.toml").read_text() == 'baseURL = "https://example.org"\n'
    assert (other / "metrics.jsonl").exists()
    # names that only look like normlab's mark nothing, and an empty config.toml (which loads
    # as all defaults) is not a run's
    odd = tmp_path / "odd"
    (odd / "checkpoints").mkdir(parents=True)
    for name in ("checkpoints/step_notes.json", "checkpoints/step_final.safetensors",
                 "config.toml", ".metrics.jsonl.swp.tmp"):
        (odd / name).write_text("")
    with pytest.raises(ValueError, match="is not a normlab run folder"):
        train(c, odd, progress=False, force=True)
    assert len(list(odd.rglob("*"))) == 5


def test_force_never_deletes_through_a_linked_folder(tmp_path: Path) -> None:
    """checkpoints/, tb/ or analysis/ as links to another run's folders: --force deleted that
    run's checkpoints, events and analysis through them, and the new run wrote into them. It
    is refused, naming the link."""
    c = cfg("train.steps=5", "train.checkpoint_every=5", "train.eval_every=5")
    first, second = tmp_path / "first", tmp_path / "second"
    train(c, first, progress=False)
    analyze_run(first, n_examples=4, n_draws=1, sigmas=[0.1])
    before = sorted(p.relative_to(first) for p in first.rglob("*"))
    train(c, second, progress=False)
    for sub in ("checkpoints", "tb", "analysis"):
        shutil.rmtree(second / sub, ignore_errors=True)
        (second / sub).symlink_to(first / sub, target_is_directory=True)
    with pytest.raises(ValueError, match=r"^--force: '.*second/checkpoints' is a link \(to "
                                         r"'.*first/checkpoints'\); remove it, or give --out"):
        train(c, second, progress=False, force=True)
    assert sorted(p.relative_to(first) for p in first.rglob("*")) == before
    assert _written_here(second)[0] == sorted(second / n for n in ("config.toml",
                                                                     "metrics.jsonl",
                                                                     "train_done.json"))


def test_resume_with_force_is_refused(tmp_path: Path, capsys) -> None:
    """`train --resume --force` ignored --force, and a changed config's error then told the
    user to pass --force: the two are refused together, before the folder is touched."""
    c = cfg("train.steps=2", "train.checkpoint_every=1", "train.eval_every=2",
            "train.warmup_steps=0")  # no warning on stderr
    train(c, tmp_path / "run", progress=False, stop_after=1)
    before = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    (tmp_path / "c.toml").write_text(dump_toml(cfg("train.steps=3").to_dict()))
    assert main(["train", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run"),
                 "--resume", "--force", "--quiet"]) == 2
    assert capsys.readouterr().err == ("normlab: error: --resume and --force: give one; --resume "
                                       "continues the run, --force deletes it and starts over\n")
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == before


def test_resume_past_a_torn_last_metrics_line(tmp_path: Path) -> None:
    """A last line cut short by the kill blocked every resume; it is dropped and redone, and
    the resumed run ends with the straight run's records. A damaged earlier line is named."""
    c = cfg("train.steps=20", "train.checkpoint_every=10", "train.eval_every=10")
    train(c, tmp_path / "straight", progress=False)
    train(c, tmp_path / "run", progress=False, stop_after=15)
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 16, "loss": 2.6')
    train(c, tmp_path / "run", progress=False, resume=True)
    steps = [json.loads(ln)["step"] for ln in metrics.read_text().splitlines()]
    want = [json.loads(ln)["step"] for ln in (tmp_path / "straight/metrics.jsonl").read_text()
            .splitlines()]
    assert steps == want
    train(c, tmp_path / "bad", progress=False, stop_after=15)
    lines = (tmp_path / "bad" / "metrics.jsonl").read_text().splitlines()
    lines[0] = lines[0][:10]
    (tmp_path / "bad" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl'? line 1: not valid JSON"):
        train(c, tmp_path / "bad", progress=False, resume=True)


def test_checkpoints_past_seven_digits_keep_the_newest(tmp_path: Path) -> None:
    """Names sort as steps only up to 7 digits: step 10,000,000 was pruned as it was written."""
    from normlab import ModelConfig, build_model
    from normlab.checkpoint import save_checkpoint

    model = build_model(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_mlp=32))
    for step in (9_999_000, 9_999_999, 10_000_000):
        save_checkpoint(tmp_path, step, model, None, {"config": {}})
    assert [json.loads(p.read_text())["step"] for p in list_checkpoints(tmp_path)] == [
        9_999_999, 10_000_000]


def test_an_earlier_step_saved_beside_later_ones_is_kept(tmp_path: Path) -> None:
    """Pruning kept the newest two by step, so step 5 saved beside 10 and 20 was deleted as it
    was written, and its returned path did not exist. It is now kept with the newest other."""
    from normlab import ModelConfig, build_model
    from normlab.checkpoint import save_checkpoint

    model = build_model(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_mlp=32))
    for step in (10, 20):
        save_checkpoint(tmp_path, step, model, None, {"config": {}})
    path = save_checkpoint(tmp_path, 5, model, None, {"config": {}})
    assert path.is_file() and path.with_suffix(".safetensors").is_file()
    assert [json.loads(p.read_text())["step"] for p in list_checkpoints(tmp_path)] == [5, 20]
    save_checkpoint(tmp_path, 30, model, None, {"config": {}})  # onwards, the newest two
    assert [json.loads(p.read_text())["step"] for p in list_checkpoints(tmp_path)] == [20, 30]


def test_a_run_killed_after_it_stopped_early_stays_stopped(tmp_path: Path) -> None:
    """Killed after the early-stop checkpoint, before train_done.json: resuming trained on to
    the next evaluation; it now ends where the straight run ended, with its record."""
    c = cfg("train.steps=30", "train.checkpoint_every=10", "train.eval_every=10",
            "train.early_stop_accuracy=0.0")
    done = train(c, tmp_path / "run", progress=False)
    assert done["early_stopped"] and done["step"] == 10
    (tmp_path / "run" / "train_done.json").unlink()
    again = train(c, tmp_path / "run", progress=False, resume=True)
    assert again == done
    assert [json.loads(p.read_text())["step"] for p in
            list_checkpoints(tmp_path / "run/checkpoints")] == [10]
    # killed after the last checkpoint of a full run: train_done.json keeps the numbers
    c = cfg("train.steps=10", "train.checkpoint_every=10", "train.eval_every=10")
    done = train(c, tmp_path / "full", progress=False)
    (tmp_path / "full" / "train_done.json").unlink()
    assert train(c, tmp_path / "full", progress=False, resume=True) == done


def test_resume_writes_a_config_toml_that_was_deleted(tmp_path: Path) -> None:
    """Resumed from a checkpoint, the folder stayed without the config.toml every run folder
    holds (the README's list; `compare` and the report read it)."""
    c = cfg("train.steps=10", "train.checkpoint_every=5", "train.eval_every=5")
    train(c, tmp_path / "run", progress=False, stop_after=5)
    written = (tmp_path / "run" / "config.toml").read_text()
    (tmp_path / "run" / "config.toml").unlink()
    train(c, tmp_path / "run", progress=False, resume=True)
    assert (tmp_path / "run" / "config.toml").read_text() == written


def test_resume_before_the_first_checkpoint_is_the_same_run_again(tmp_path: Path) -> None:
    """With no checkpoint yet, `--resume` restarted with any config, overwrote config.toml and
    appended to the killed attempt's metrics; now the config must match and the lines are
    redone once."""
    c = cfg("train.steps=20", "train.checkpoint_every=20", "train.eval_every=20")
    train(c, tmp_path / "straight", progress=False)
    train(c, tmp_path / "run", progress=False, stop_after=12)
    with pytest.raises(ValueError, match="--resume: the config differs"):
        train(cfg("train.steps=20", "train.checkpoint_every=20", "train.eval_every=20",
                  "train.lr=0.5"), tmp_path / "run", progress=False, resume=True)
    train(c, tmp_path / "run", progress=False, resume=True)
    read = lambda run: [json.loads(ln)["loss"] for ln in  # noqa: E731
                        (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
    assert read("run") == read("straight")


def test_evaluations_between_log_steps_are_run(tmp_path: Path) -> None:
    """Evaluations sat inside the log steps: eval_every 3 with log_every 5 evaluated at 15
    and the end only."""
    c = cfg("train.steps=12", "train.log_every=5", "train.eval_every=3",
            "train.checkpoint_every=12")
    train(c, tmp_path / "run", progress=False)
    recs = [json.loads(ln) for ln in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "accuracy" in r] == [3, 6, 9, 12]
    assert [r["step"] for r in recs] == [3, 5, 6, 9, 10, 12]
    # steps no multiple of eval_every: the last step is evaluated too (the run's record had
    # no accuracy)
    c = cfg("train.steps=7", "train.log_every=5", "train.eval_every=3",
            "train.checkpoint_every=7")
    assert "accuracy" in train(c, tmp_path / "odd", progress=False)
    recs = [json.loads(ln) for ln in (tmp_path / "odd/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "accuracy" in r] == [3, 6, 7]


@pytest.mark.parametrize(("sets", "field"), [
    (["train.early_stop_split='trian'"], "train.early_stop_split"),
    (["train.lr=nan"], "train.lr"), (["train.lr=inf"], "train.lr"),
    (["train.beta1=1.5"], "train.beta1"), (["train.beta2=-0.5"], "train.beta2"),
    (["train.weight_decay=inf"], "train.weight_decay"),
    (["train.grad_clip=nan"], "train.grad_clip"),
    (["train.seed=9223372036854775808"], "train.seed"),  # torch: "Overflow when unpacking"
    (["train.threads=100000"], "train.threads"),  # libgomp ended the process, exit 139
    (["train.precision='float16'"], "train.precision"),  # would need loss scaling
])
def test_training_settings_are_named_when_refused(sets: list[str], field: str) -> None:
    """A typo in early_stop_split scored -1 at every evaluation; NaN or out-of-range optimizer
    values were torch's errors, naming no field, or a NaN loss later."""
    with pytest.raises(ValueError, match=rf"^--set {field}: expected"):  # the flag's value
        cfg(*sets).validate()


@pytest.mark.parametrize(("field", "value", "want"), [
    ("steps", 2.5, "a positive integer"),  # trained 3 steps, no final evaluation
    ("batch_size", True, "a positive integer"),
    ("log_every", 2**63, "a positive integer below 2**63"),  # config.toml cannot hold it
    ("warmup_steps", 2.5, "an int in [0, 2**63)"),
    ("patience", -1, "an int in [0, 2**63)"),
    ("lr", "1e-3", "a positive finite number"),  # a TypeError inside a comparison
    ("beta1", None, "a number in [0, 1)"),
    ("weight_decay", None, "a finite number >= 0"),
    ("min_lr_ratio", True, "a number in [0, 1]"),
    ("early_stop_accuracy", "1", "a number >= 0"),
    ("eval_examples", 3.5, "a positive integer"),
    ("grad_clip", "1", "a finite number >= 0"),  # a TypeError inside a comparison
    ("early_stop_split", 3, "a split name"),
])
def test_a_train_config_made_in_python_is_checked_as_a_file_is(field: str, value: object,
                                                               want: str) -> None:
    """`typed` checks a file's types; a TrainConfig made in Python skipped them."""
    from normlab.config import TrainConfig

    with pytest.raises(ValueError, match=rf"^train\.{field}: expected {re.escape(want)}"):
        TrainConfig(**{field: value}).validate()


def test_a_train_config_takes_numpy_numbers_as_python_ones() -> None:
    """config.toml is written from the fields, and its writer takes Python numbers only."""
    import numpy as np

    from normlab.config import TrainConfig

    t = TrainConfig(steps=np.int64(7), lr=np.float32(0.5), early_stop_accuracy=10**400)
    t.validate()
    assert (type(t.steps), t.steps, type(t.lr), t.lr) == (int, 7, float, 0.5)
    assert t.early_stop_accuracy == float("inf")  # above 1: never stops, as the int meant
    assert "steps = 7" in dump_toml({"train": {"steps": t.steps}})


def test_only_weight_matrices_are_decayed() -> None:
    """One AdamW step with every parameter 1 and every gradient 0 moves only what is decayed,
    to 1 - lr * weight_decay exactly. The attention's biases are [head, d_head] and were
    decayed by a shape rule; norms, biases and logit scales must stay at 1."""
    from normlab import ModelConfig
    from normlab.config import TrainConfig

    model = build_model(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_mlp=32, attn_bias=True,
                                    mlp_bias=True, norm_placement="qkv", attn_scale="learned",
                                    n_aux_positions=3))
    opt = tr.make_optimizer(model, TrainConfig(lr=0.1, weight_decay=0.5))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0)
            p.grad = torch.zeros_like(p)
    opt.step()
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, torch.ones_like(p))}
    weights = {n for n, _ in model.named_parameters() if n.rsplit(".", 1)[-1].startswith("W_")}
    assert moved == weights and {"blocks.0.attn.W_Q", "embed.W_E", "W_U", "W_aux"} <= weights
    assert {"blocks.0.attn.b_Q", "blocks.0.attn.b_K", "blocks.0.attn.b_V"} <= (
        {n for n, _ in model.named_parameters()} - moved)
    for n in weights:
        p = model.get_parameter(n)
        assert torch.allclose(p, torch.full_like(p, 1 - 0.1 * 0.5), rtol=0, atol=1e-7), n


def test_a_checkpoint_of_the_old_decay_groups_is_refused_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An attn_bias run saved when b_Q/b_K/b_V were decayed (ndim >= 2) holds other optimizer
    groups: the resume failed with torch's "loaded state dict contains a parameter group that
    doesn't match the size of optimizer's group", naming no file."""
    c = cfg("model.attn_bias=true", "train.steps=4", "train.checkpoint_every=2",
            "train.eval_every=4")

    def by_shape(model: torch.nn.Module, tc: object) -> torch.optim.AdamW:
        ps = list(model.parameters())
        return torch.optim.AdamW([{"params": [p for p in ps if p.ndim >= 2]},
                                  {"params": [p for p in ps if p.ndim < 2]}])

    with monkeypatch.context() as m:
        m.setattr(tr, "make_optimizer", by_shape)
        train(c, tmp_path / "run", progress=False, stop_after=2)
    with pytest.raises(ValueError, match=r"checkpoints': the optimizer state holds groups of "
                                         r"\[\d+, \d+\] tensors .+ start again with --force$"):
        train(c, tmp_path / "run", progress=False, resume=True)


def test_a_batch_too_large_to_make_names_the_batch_size(tmp_path: Path) -> None:
    """numpy's "array is too big" named no field; nothing is written before the refusal.
    (Sized with the config now: the batch's residual stream alone exceeds memory. A batch that
    fails to be made is `test_force_keeps_the_old_run_when_a_size_does_not_fit_memory`'s.)"""
    with pytest.raises(ValueError, match=r"^task: its longest sequence, \d+ tokens, makes one "
                                         r"residual stream of a batch of 2305843009213693952 .+ "
                                         r"or a smaller model\.d_model$"):
        train(cfg("train.batch_size=2305843009213693952"), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_warmup_as_long_as_the_run_is_warned_about(tmp_path: Path) -> None:
    """The learning rate then never reaches train.lr nor decays: legal, for a short smoke run of
    a long recipe, but said once. 8 steps of a 10-step warm-up end at 8/10 of lr."""
    lines: list[str] = []
    train(cfg("train.steps=8", "train.warmup_steps=10", "train.eval_every=8",
              "train.checkpoint_every=8"), tmp_path / "run", progress=False, log=lines.append)
    warned = [ln for ln in lines if ln.startswith("warning: train.warmup_steps = 10 of "
                                                 "train.steps = 8")]
    assert len(warned) == 1 and "to 0.8 x train.lr at the last step" in warned[0]
    # 7 of 8 (or 1 of 2): the last step is the first past warm-up, at lr itself, so none
    # decays; said only where the schedule would decay, and not where 6 of 8 leave one step
    for warmup, steps, schedule, said in ((7, 8, "cosine", True), (1, 2, "linear", True),
                                          (7, 8, "constant", False), (6, 8, "cosine", False),
                                          (10, 8, "constant", True)):
        lines.clear()
        train(cfg(f"train.steps={steps}", f"train.warmup_steps={warmup}",
                  f"train.eval_every={steps}", f"train.checkpoint_every={steps}",
                  f"train.schedule='{schedule}'"),
              tmp_path / f"run-{warmup}-{steps}-{schedule}", progress=False, log=lines.append)
        warned = [ln for ln in lines if ln.startswith("warning:")]
        assert len(warned) == int(said), (warmup, steps, schedule, lines)
        if said and warmup < steps:
            assert warned[0] == (f"warning: train.warmup_steps = {warmup} of train.steps = "
                                 f"{steps}: no step decays (train.schedule = '{schedule}'): the "
                                 "last is the first past warm-up, at train.lr")
        elif said:  # a constant schedule does not decay anyway: not said
            assert warned[0].endswith("to 0.8 x train.lr at the last step")


def test_a_run_config_toml_derives_the_sizes_its_source_derived(tmp_path: Path) -> None:
    """A run folder's config.toml pinned d_head, d_mlp and n_kv_heads where they were derived:
    `--set model.n_heads=4` on it built grouped-query attention with d_head 16 (on the recipe,
    4 heads of 8). Sizes set to other values than derived stay."""
    c = cfg("train.steps=1", "train.eval_every=1", "train.checkpoint_every=1")
    assert (c.model.d_model, c.model.n_heads) == (32, 2)
    train(c, tmp_path / "run", progress=False)
    saved = tmp_path / "run/config.toml"
    written = load_toml_table(saved, "model")
    assert not {"d_head", "n_kv_heads"} & set(written) and written["d_mlp"] == 64  # (not 4 x 32)
    assert load_config(saved) == c  # the same run, so a resume takes it as its own
    again = load_config(saved, ["model.n_heads=4"]).model
    assert (again.d_head, again.n_kv_heads, again.d_mlp) == (8, 4, 64)
    assert "d_mlp" not in cfg("model.d_mlp=128").to_toml()
    own = cfg("model.d_head=8", "model.n_kv_heads=1", "model.d_mlp=40")
    kept = load_config_text(tmp_path / "own.toml", own.to_toml()).model
    assert (kept.d_head, kept.n_kv_heads, kept.d_mlp) == (8, 1, 40)
    # a d_head that could not be derived (d_model not a multiple of the heads; an odd one
    # under RoPE) is kept: deriving it raised, and such a run could not train
    for sets in (["model.d_model=100", "model.n_heads=3", "model.d_head=32"],
                 ["model.d_model=96", "model.n_heads=32", "model.d_head=4",
                  "model.pos_encoding='rope'"]):
        c = cfg(*sets)
        assert load_config_text(tmp_path / "odd.toml", c.to_toml()) == c


def load_toml_table(path: Path, table: str) -> dict:
    import tomllib

    return tomllib.loads(path.read_text())[table]


def load_config_text(path: Path, text: str):
    path.write_text(text)
    return load_config(path)


def test_a_config_error_names_where_its_field_came_from(tmp_path: Path) -> None:
    """The file, the flag that set the field (a part of it too: task.train[1]), or --seed; an
    error a file's field makes only with the overrides says both."""
    f = tmp_path / "c.toml"
    f.write_text("[train]\nsteps = 10\n[model]\nd_model = 48\n")
    for sets, seed, lead, field in (
            ([], -1, "--seed ", "train.seed"),
            (["task.train=[[1, 1], [0, 1]]"], None, "--set ", "task.train[1]"),
            (["train.steps=1.5"], None, "--set ", "train.steps"),
            (["model.n_heads=5"], None, f"config file {str(f)!r} with --set: ", "model.d_model"),
            # an unknown table, which only the flag named, was blamed on the file
            (["trian.steps=3"], None, "--set ", "config.trian: unknown table"),
    ):
        with pytest.raises(ValueError) as err:
            load_config(f, sets, seed=seed)
        assert str(err.value).startswith(f"{lead}{field}"), str(err.value)
    f.write_text("[model]\nd_model = 50\nn_heads = 4\n")
    with pytest.raises(ValueError, match=rf"^config file {re.escape(repr(str(f)))}: model\."):
        load_config(f)
    f.write_text("[trian]\nsteps = 3\n")  # the file's own unknown table stays the file's
    with pytest.raises(ValueError, match=rf"^config file {re.escape(repr(str(f)))} with --set: "
                                         r"config\.trian: unknown table"):
        load_config(f, ["train.steps=3"])


def test_a_bare_word_override_is_read_without_its_spaces() -> None:
    """`--set "model.norm_placement = qkv"` was refused, the value read as ' qkv'."""
    assert load_config(None, ["model.norm_placement = qkv "]).model.norm_placement == "qkv"


def test_config_files_and_checkpoints_that_cannot_be_read_are_named(tmp_path: Path) -> None:
    """A config that is not UTF-8, a table given a value, a sidecar of another program (or
    cut short), and weights of another model: one line naming the file or the field."""
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b"[train]\nsteps = 2 # \xff\n")
    with pytest.raises(ValueError, match=r"latin1\.toml.?: not UTF-8 text, as TOML is"):
        load_config(bad)
    bad.write_text("model = 5\ntrain = 3\n")
    with pytest.raises(ValueError, match=r"^config file '.*latin1\.toml': model: expected a table"):
        load_config(bad, ["model.d_model=32"])
    with pytest.raises(ValueError, match=r"^config file '.*latin1\.toml': train: expected a table"):
        load_config(bad, seed=1)
    c = cfg("train.steps=20", "train.checkpoint_every=10", "train.eval_every=20")
    train(c, tmp_path / "run", progress=False)
    prev, newest = list_checkpoints(tmp_path / "run/checkpoints")
    for text, match in (("[]", "not a normlab checkpoint's"), ('{"step": 20}', "missing")):
        newest.write_text(text)
        with pytest.raises(CheckpointError, match=match):
            load_checkpoint(newest)
    warnings: list[str] = []
    assert latest_checkpoint(tmp_path / "run/checkpoints", warn=warnings.append)[1]["step"] == 10
    assert warnings
    from normlab.train import load_run

    other = cfg("train.steps=20", "train.checkpoint_every=10", "train.eval_every=20",
                "model.d_mlp=32")
    side = json.loads(prev.read_text())
    side["config"] = other.to_dict()  # weights of d_mlp 64 under a d_mlp 32 config
    side["sidecar_sha256"] = sidecar_hash(side)  # edited past its own hash
    prev.write_text(json.dumps(side))
    newest.unlink()
    # the run's record names the config it trained: a sidecar saying another is refused so
    with pytest.raises(CheckpointError, match=r"step 10 in .* was made under another config "
                                              r"than the run folder records \(model\.d_mlp"):
        load_run(tmp_path / "run")
    (tmp_path / "run" / "train_done.json").unlink()  # no record: the weights do not fit it
    with pytest.raises(CheckpointError, match=r"step 10 in .* does not fit the model"):
        load_run(tmp_path / "run")


def test_cli_messages_name_what_is_wrong(tmp_path: Path, capsys) -> None:
    """`analyze --sigmas 0,x`, `reproduce --jobs -1` (it wrote manifest.json first), `compare`
    on a damaged or foreign eval.json: one line naming the option or file."""
    for sigmas in ("0,x", ""):  # "" was taken as the default sigmas
        code, err = _cli(capsys, "analyze", str(tmp_path), "--sigmas", sigmas)
        assert code == 2 and err.startswith("normlab: error: --sigmas: expected numbers")
    # named by the flag, where the library named its parameter ("sigmas[1]", "threshold")
    for flag, value, said in (("--sigmas", "0,-1", "--sigmas[1]: expected a finite number >= 0; "
                                                   "got -1.0"),
                              ("--threshold", "1.5", "--threshold: expected a number in (0, 1]; "
                                                     "got 1.5")):
        code, err = _cli(capsys, "analyze", str(tmp_path), flag, value)
        assert code == 2 and err == f"normlab: error: {said}"
    code, err = _cli(capsys, "reproduce", "--profile", "smoke", "--out", str(tmp_path / "r"),
                     "--jobs", "-1")
    assert code == 2 and "--jobs: expected an int in [1, 65536)" in err
    assert not (tmp_path / "r").exists()
    for text, match in (("{", "not valid JSON"), ('{"splits": {}}', "expected normlab eval")):
        (tmp_path / "a").mkdir(exist_ok=True)
        (tmp_path / "a" / "eval.json").write_text(text)
        code, err = _cli(capsys, "compare", str(tmp_path / "a"), str(tmp_path / "a"))
        assert code == 2 and match in err and "eval.json" in err and "\n" not in err


def test_resume_of_a_folder_that_does_not_exist_says_so(tmp_path: Path, capsys) -> None:
    """A mistyped --out with --resume started a fresh full-length run without a word. It is
    said, not refused: a job script may pass --resume on its first start too."""
    out, config = tmp_path / "typo", tmp_path / "tiny.toml"
    config.write_text(dump_toml(cfg("train.steps=2").to_dict()))
    code = main(["train", "--config", str(config), "--out", str(out), "--resume", "--quiet"])
    assert code == 0 and (out / "train_done.json").is_file()
    assert capsys.readouterr().err.splitlines()[0] == (
        f"normlab: --resume: {str(out)!r} does not exist; starting a new run there")


@pytest.mark.parametrize(("command", "said"), [
    ("train", "normlab: interrupted; finished checkpoints are kept (rerun with --resume)"),
    ("sweep", "normlab: interrupted; finished runs and checkpoints are kept (rerun it to "
              "continue)"),
    ("eval", "normlab: interrupted"),
])
def test_ctrl_c_says_what_to_do_for_its_command(command: str, said: str, tmp_path: Path,
                                                 monkeypatch, capsys) -> None:
    """Every command said "(use --resume)", a flag only `train` has."""
    import normlab.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    fn = {"train": "_cmd_train", "sweep": "_cmd_sweep", "eval": "_cmd_eval"}[command]
    monkeypatch.setattr(cli, fn, interrupted)
    argv = {"train": ["train", "--config", "x.toml", "--out", str(tmp_path)],
            "sweep": ["sweep", "--config", "x.toml", "--out", str(tmp_path)],
            "eval": ["eval", str(tmp_path)]}[command]
    assert cli.main(argv) == 130
    assert capsys.readouterr().err.strip() == said


def test_eval_writes_eval_json_last(tmp_path: Path, capsys) -> None:
    """A heatmap that could not be written (a folder in its place) left eval.json behind, and
    a rerun was then refused ("already exists; pass --force")."""
    run = tmp_path / "run"
    train(cfg("train.steps=2"), run, progress=False)
    (run / "heatmap.png").mkdir()
    code, err = _cli(capsys, "eval", str(run))
    assert code == 2 and err.endswith("heatmap.png': expected a file to write; it is a folder")
    assert not (run / "eval.json").exists()
    (run / "heatmap.png").rmdir()
    assert _cli(capsys, "eval", str(run))[0] == 0 and (run / "eval.json").is_file()


def test_a_folder_in_a_result_files_place_is_one_line(tmp_path: Path) -> None:
    """The OS's error named the temp file ("Is a directory: '.heatmap.png.b5wwdnlj.tmp' ->
    ...") or said only "File exists" for a file where a folder must be."""
    from normlab.io import atomic_write_text

    (tmp_path / "heatmap.png").mkdir()
    with pytest.raises(ValueError, match=r"^'.*heatmap\.png': expected a file to write; it is "
                                         r"a folder$"):
        atomic_write_text(tmp_path / "heatmap.png", "x")
    (tmp_path / "analysis").write_text("")
    with pytest.raises(ValueError, match=r"^'.*analysis/sub/norms\.json' cannot be written: "
                                         r"'.*analysis' is a file, not a folder$"):
        atomic_write_text(tmp_path / "analysis" / "sub" / "norms.json", "{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["analysis", "heatmap.png"]


def test_an_os_error_while_writing_names_the_file_not_its_temp_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk said "[Errno 28] No space left on device" or named '.x.png.vtzhkrsy.tmp',
    a file the user never chose; the old result and no temp file stay."""
    import errno
    import os

    from normlab.io import atomic_write_text

    target = tmp_path / "eval.json"
    target.write_text("old")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=r"^'.*/eval\.json' cannot be written: No space left on "
                                      r"device$"):
        atomic_write_text(target, "new")
    assert [p.name for p in tmp_path.iterdir()] == ["eval.json"]
    assert target.read_text() == "old"
    monkeypatch.undo()
    # the class kept (a caller may catch FileNotFoundError), and a folder that could not be
    # made named beside the file (as /proc refuses both, whoever runs this)
    import tempfile

    def no_temp(prefix: str, suffix: str, dir: Path) -> None:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory",
                                str(Path(dir) / f"{prefix}k3y.tmp"))

    def no_folder(self: Path, *args, **kwargs) -> None:
        raise PermissionError(errno.EACCES, "Permission denied", str(self))

    monkeypatch.setattr(tempfile, "mkstemp", no_temp)
    with pytest.raises(FileNotFoundError, match=r"^'.*/eval\.json' cannot be written: No such "
                                                r"file or directory$"):
        atomic_write_text(target, "new")
    monkeypatch.setattr(Path, "mkdir", no_folder)
    with pytest.raises(PermissionError, match=r"^'.*/sub/eval\.json' cannot be written: "
                                              r"Permission denied \('.*/sub'\)$"):
        atomic_write_text(tmp_path / "sub" / "eval.json", "new")


def test_result_files_are_written_whole_readable_and_figures_too(tmp_path: Path) -> None:
    """Atomic writes leave no temp file, give the mode the umask allows (read from the
    process, not by setting it), replace the file (a reader that opened the old one reads it
    whole, where a rewrite in place gives it a half file), and a figure that fails to render
    leaves the old file."""
    import os

    import matplotlib.pyplot as plt

    from normlab.io import atomic_write_text, process_umask, save_figure

    old = os.umask(0o027)
    try:
        assert process_umask() == 0o027
        atomic_write_text(tmp_path / "a.json", "{}")
        assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o640
    finally:
        os.umask(old)
    with (tmp_path / "a.json").open() as reader:
        atomic_write_text(tmp_path / "a.json", '{"new": 1}')
        assert reader.read() == "{}"
    assert (tmp_path / "a.json").read_text() == '{"new": 1}'
    fig, ax = plt.subplots(figsize=(2, 1))
    ax.plot([0, 1])
    save_figure(fig, tmp_path / "f.png")  # every figure at 200 dpi: 2 x 1 inches
    png = (tmp_path / "f.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    assert (int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")) == (400, 200)
    fig, ax = plt.subplots()

    def broken(*a, **k):
        raise RuntimeError("renderer failed")

    fig.savefig = broken
    with pytest.raises(RuntimeError, match="renderer failed"):
        save_figure(fig, tmp_path / "f.png", dpi=50)
    assert (tmp_path / "f.png").read_bytes() == png
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "f.png"]


def test_non_finite_weights_are_never_saved_as_a_good_checkpoint(tmp_path: Path,
                                                                   monkeypatch) -> None:
    """A step whose loss is finite but whose update leaves a weight non-finite stops the run
    before its checkpoint: the last good checkpoint is the one kept."""
    real = torch.nn.utils.clip_grad_norm_
    calls = {"n": 0}

    def poisoned(params, max_norm):
        calls["n"] += 1
        params = list(params)
        if calls["n"] == 20:  # step 20's loss was finite; its update writes NaN into weights
            params[0].grad.view(-1)[0] = float("inf")
            return torch.tensor(float("inf"))
        return real(params, max_norm)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", poisoned)
    c = cfg("train.steps=30", "train.checkpoint_every=10", "train.eval_every=30")
    with pytest.raises(TrainingError, match="weights are not finite after step 20"):
        train(c, tmp_path / "run", progress=False)
    _, meta = latest_checkpoint(tmp_path / "run/checkpoints")
    assert meta["step"] == 10


def test_resumed_tensorboard_events_show_each_step_once(tmp_path: Path) -> None:
    """A killed attempt's events past the checkpoint are purged on resume, as its metrics
    lines are (TensorBoard showed those steps twice)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    c = cfg("train.steps=20", "train.checkpoint_every=10", "train.eval_every=20")
    for stop in (15, 7):  # after a checkpoint, and before the first (the run starts again)
        train(c, tmp_path / f"run{stop}", progress=False, stop_after=stop)
        train(c, tmp_path / f"run{stop}", progress=False, resume=True)
        acc = EventAccumulator(str(tmp_path / f"run{stop}" / "tb"))
        acc.Reload()
        assert [e.step for e in acc.Scalars("loss")] == [5, 10, 15, 20], stop


def test_a_checkpoint_records_the_time_up_to_its_own_step(tmp_path: Path) -> None:
    """`elapsed_s` in a sidecar counted only to the last log step, so a checkpoint between
    log steps lost the time since (and a resume from it under-reported the run's time)."""
    c = cfg("train.steps=20", "train.checkpoint_every=10", "train.eval_every=20",
            "train.log_every=20")
    train(c, tmp_path / "run", progress=False, stop_after=15)
    _, meta = latest_checkpoint(tmp_path / "run/checkpoints")
    assert meta["step"] == 10 and meta["elapsed_s"] > 0


def test_bfloat16_precision_runs_the_matmuls_in_bfloat16_and_the_norms_in_float32() -> None:
    """`train.precision = "bfloat16"`: under the training step's autocast, projections and
    the MLP come out of their matmuls in bfloat16, while the residual stream, every norm's
    scale (QKV-Norm's too, whose input is a bfloat16 matmul output) and the loss stay float32,
    and the loss is the float32 one to bfloat16 rounding. With "float32" nothing changes."""
    from normlab.tasks.addition import make_batch

    c = cfg("model.norm_placement='qkv'", "train.precision='bfloat16'")
    c.validate()
    torch.manual_seed(0)
    model = build_model(c.model)
    batch = make_batch([("12+34", "46"), ("5+6", "11"), ("7+80", "87")], "decoder", "lsd")
    seen: dict[str, torch.dtype] = {}

    def record(x: torch.Tensor, hook) -> None:
        seen[hook.name.split(".", 2)[-1]] = x.dtype

    wanted = ["attn.hook_q_pre_norm", "attn.q_norm.hook_scale", "attn.v_norm.hook_scale",
              "mlp.hook_pre", "hook_resid_post", "ln2.hook_scale"]
    # hooks on the norms' scales change their kernels' rounding: float32's own loss, unhooked
    plain = loss_on(model, batch)[0]
    with model.hooks([(f"blocks.0.{n}", record) for n in wanted]):
        reference = loss_on(model, batch)[0]
        assert set(seen.values()) == {torch.float32}
        with tr.autocast(c.train.precision, torch.device("cpu")):
            loss = loss_on(model, batch)[0]
    assert seen == {"attn.hook_q_pre_norm": torch.bfloat16, "attn.q_norm.hook_scale":
                    torch.float32, "attn.v_norm.hook_scale": torch.float32,
                    "mlp.hook_pre": torch.bfloat16, "hook_resid_post": torch.float32,
                    "ln2.hook_scale": torch.float32}
    assert loss.dtype == torch.float32 and loss.item() != reference.item()
    torch.testing.assert_close(loss, reference, rtol=1e-2, atol=0)
    loss.backward()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    with tr.autocast(cfg().train.precision, torch.device("cpu")):  # float32: autocast off
        assert torch.equal(loss_on(model, batch)[0], plain)


def test_bfloat16_training_learns_resumes_exactly_and_is_its_own_config(tmp_path: Path) -> None:
    """Mixed precision trains (the loss falls as in float32), a killed run resumes to the same
    weights bit for bit, and a run made in one precision does not resume in the other."""
    c = cfg("train.precision='bfloat16'", "train.steps=30", "train.checkpoint_every=10",
            "train.eval_every=30", "train.lr=3e-3")
    a, b = _straight_and_resumed(c, tmp_path, stop_after=15)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    losses = [json.loads(x)["loss"] for x in (tmp_path / "straight/metrics.jsonl").open()]
    train(cfg("train.steps=30", "train.checkpoint_every=10", "train.eval_every=30",
              "train.lr=3e-3"), tmp_path / "f32", progress=False)
    f32 = [json.loads(x)["loss"] for x in (tmp_path / "f32/metrics.jsonl").open()]
    assert losses[-1] < 0.8 * losses[0] and abs(losses[-1] - f32[-1]) < 0.05 * f32[-1]
    assert a.keys() == _weights(tmp_path / "f32").keys()
    assert not torch.equal(a["model/blocks.0.mlp.W_in"], _weights(tmp_path / "f32")[
        "model/blocks.0.mlp.W_in"])  # the precision did change the arithmetic
    with pytest.raises(ValueError, match="the config differs from the one saved"):
        train(cfg("train.steps=30", "train.checkpoint_every=10", "train.eval_every=30",
                  "train.lr=3e-3"), tmp_path / "straight", progress=False, resume=True)


@pytest.mark.parametrize("placement", ["none", "post", "pre", "qk", "qkv", "pre_qk"])
def test_bfloat16_attention_scores_and_softmax_are_float32_in_every_placement(
    placement: str,
) -> None:
    """Under the step's autocast, QK-Norm's float32 output made its scores and softmax float32
    while `pre`'s (learned positions: no RoPE to promote q) were bfloat16, a precision that
    differed by placement in a study that compares placements."""
    from normlab.tasks.addition import make_batch

    c = cfg(f"model.norm_placement='{placement}'", "train.precision='bfloat16'")
    torch.manual_seed(0)
    model = build_model(c.model)
    batch = make_batch([("12+34", "46"), ("5+6", "11")], "decoder", "lsd")
    seen: dict[str, torch.dtype] = {}

    def record(x: torch.Tensor, hook) -> None:
        seen[hook.name] = x.dtype

    names = ["blocks.0.attn.hook_attn_scores", "blocks.0.attn.hook_pattern",
             "blocks.0.attn.hook_z"]
    mixed = tr.autocast(c.train.precision, torch.device("cpu"))
    with model.hooks([(n, record) for n in names]), mixed:
        loss_on(model, batch)
    assert seen == dict(zip(names, [torch.float32, torch.float32, torch.bfloat16], strict=True))


def test_a_model_with_bfloat16_weights_keeps_its_precision_under_autocast() -> None:
    """The norms' float32 statistics are for mixed precision (float32 weights); a model cast
    to bfloat16 as a whole runs in bfloat16 under autocast as before, not into a dtype error."""
    torch.manual_seed(0)
    for placement in ("pre", "qkv"):
        model = build_model(cfg(f"model.norm_placement='{placement}'").model).to(torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(torch.randint(0, 16, (2, 7)))
        assert out.dtype == torch.bfloat16 and bool(torch.isfinite(out).all())


def test_bfloat16_training_evaluates_in_float32(tmp_path: Path, monkeypatch) -> None:
    """Only the training forward runs under autocast: its periodic evaluations decode with
    float32 matmuls, as `normlab eval` and the analyses do."""
    states: list[bool] = []
    real = tr.evaluate

    def spy(*args, **kwargs):
        states.append(torch.is_autocast_enabled("cpu"))
        return real(*args, **kwargs)

    monkeypatch.setattr(tr, "evaluate", spy)
    c = cfg("train.precision='bfloat16'", "train.steps=10", "train.eval_every=5",
            "train.checkpoint_every=10")
    train(c, tmp_path / "run", progress=False)
    assert states == [False, False]


# ---- the thirty-fifth session's audit: nothing lost, every bad input one line --------------


def test_force_keeps_the_old_run_when_a_size_does_not_fit_memory(tmp_path: Path, capsys,
                                                                 monkeypatch) -> None:
    """`train --force` emptied a finished run, then failed drawing its first batch (7 TiB) with
    a traceback: the first batch and the evaluation sets are now made before the folder is
    touched, and running out of memory or range is one line. The failures are simulated (a real
    one depends on the host's overcommit policy), but for a size TOML cannot hold."""
    import normlab.tasks.addition as addition

    good = tmp_path / "good.toml"
    good.write_text("[task]\ngrid = 'smoke'\n[train]\nsteps = 2\nwarmup_steps = 0\n"
                    "[model]\nd_model = 16\nn_layers = 1\n")
    out = tmp_path / "run"
    assert main(["train", "--config", str(good), "--out", str(out), "--quiet"]) == 0

    def files() -> dict[str, bytes]:
        return {str(p): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}

    def no_memory(*args, **kwargs):
        raise MemoryError("Unable to allocate 7.28 TiB")

    before = files()
    argv = ["train", "--config", str(good), "--out", str(out), "--quiet", "--force"]
    for target in (addition.TrainStream, tr):
        with monkeypatch.context() as m:
            if target is tr:
                m.setattr(tr, "eval_sets", no_memory)
            else:
                m.setattr(addition.TrainStream, "__next__", no_memory)
            code, err = _cli(capsys, *argv)
        assert code == 2 and err == ("normlab: error: train.batch_size: a first batch of 128 "
                                     "problems could not be made (Unable to allocate 7.28 TiB); "
                                     "expected a smaller batch, or shorter problems (the task's "
                                     "cells)" if target is addition.TrainStream
                                     else "normlab: error: task.eval_size: evaluation sets of "
                                     "256 problems a cell in 5 cells could not be made (Unable "
                                     "to allocate 7.28 TiB); expected a smaller task.eval_size")
        assert files() == before
    code, err = _cli(capsys, *argv, "--set", f"train.batch_size={10**20}")
    assert code == 2 and "train.batch_size: expected a positive integer below 2**63" in err
    assert files() == before
    # a model too large for any address space: torch's allocator named no field
    code, err = _cli(capsys, *argv, "--set", f"model.max_len={10**15}", "--set",
                     "model.pos_encoding='learned'")
    assert code == 2 and err.startswith("normlab: error: ModelConfig.max_len = 10000000000000")
    assert "\n" not in err and files() == before
    # nor one of a billion small layers, which the allocator granted until the process was killed
    code, err = _cli(capsys, *argv, "--set", f"model.n_layers={10**9}")
    assert code == 2 and err.startswith("normlab: error: ModelConfig.n_layers = 1000000000: the "
                                        "model's weights and tables take ")
    assert "\n" not in err and files() == before


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("train.steps=3\nlr=5.0", "--set 'train.steps': expected one TOML value after '='"),
        ('task.grid="smoke"\n[train]\nsteps=2', "--set 'task.grid': expected one TOML value"),
        ("task.train=[[1, 5000]]", "task.train[0]: cell n1d5000 has sums of up to 5000 digits"),
        ("train.early_stop_accuracy=nan", "train.early_stop_accuracy: expected a number >= 0"),
        ("task.eval_seed=-1", "task.eval_seed: expected an int in [0, 2**63)"),
    ],
)
def test_odd_overrides_are_one_line_errors(override: str, match: str) -> None:
    """A newline in --set dropped what followed it unseen; a 5000-digit cell hit Python's
    4300-digit str limit (no field named); NaN early stopping never fired."""
    with pytest.raises(ValueError) as err:
        load_config(None, ["task.grid='smoke'", override])
    assert match in str(err.value) and "\n" not in str(err.value)


def test_a_damaged_run_folder_is_named_not_the_users_config(tmp_path: Path, capsys) -> None:
    """A bad key in the run's own config.toml read as if the user's --config held it, and an
    empty train_done.json was "Expecting value: line 1 column 1" with no file named."""
    c = cfg("train.steps=2", "train.checkpoint_every=2", "train.eval_every=2")
    train(c, tmp_path / "run", progress=False)
    (tmp_path / "c.toml").write_text(dump_toml(c.to_dict()))
    argv = ["train", "--config", str(tmp_path / "c.toml"), "--out", str(tmp_path / "run"),
            "--resume", "--quiet"]
    done = tmp_path / "run" / "train_done.json"
    saved = done.read_text()
    # damaged, it is named, and made again from the last checkpoint (it was refused on every
    # rerun); an object that is no record of where training ended is damaged too
    for text in ("", '{"loss": 0.1}'):
        done.write_text(text)
        code, err = _cli(capsys, *argv)
        (said,) = [ln for ln in err.splitlines() if str(done) in ln]
        assert code == 0 and said.startswith(f"warning: {str(done)!r}: expected an object with "
                                             "an int \"step\"")
        assert said.endswith("made again from the last checkpoint")
        assert json.loads(done.read_text())["step"] == json.loads(saved)["step"]
    done.write_text(saved)
    config = tmp_path / "run" / "config.toml"
    before = config.read_text()
    with config.open("a") as f:  # a finished run is judged by train_done.json's config
        f.write("\n[extra]\nfoo = 1\n")
    code, err = _cli(capsys, *argv)
    assert code == 0 and err.startswith(f"warning: {str(config)!r} is not the config this run "
                                        "trained with (")
    assert err.endswith("written again") and config.read_text() == before


def test_compare_names_a_damaged_eval_json_or_log(tmp_path: Path, capsys) -> None:
    """Each was a KeyError, TypeError or AttributeError traceback (or a float() error naming no
    file) from `compare` and `compare --curve`."""
    run = tmp_path / "a"
    run.mkdir()
    split = '{"accuracy": 0.5, "ci95": [0, 1]}'
    for text in ('{"splits": {"a": {}}, "config": {}, "seed": 0}',
                 f'{{"splits": {{"a": {split}}}, "config": {{}}, "seed": 0}}',
                 '{"splits": "abc", "config": {"model": {"norm_placement": "pre"}}, "seed": 0}',
                 f'{{"splits": {{"a": {split}}}, "config": {{"model": 3}}, "seed": 0}}'):
        (run / "eval.json").write_text(text)
        code, err = _cli(capsys, "compare", str(run))
        assert code == 2 and "eval.json" in err and "expected normlab eval results" in err, err
    for line in ('{"step": 1, "accuracy": 5}', '{"step": 1, "accuracy": {"train": "x"}}'):
        (run / "metrics.jsonl").write_text(line + "\n" + '{"step": 2}\n')
        code, err = _cli(capsys, "compare", "--curve", "train", str(run))
        assert code == 2 and "metrics.jsonl' line 1: expected 'accuracy'" in err, err


def test_compare_names_an_eval_json_that_is_a_folder(tmp_path: Path, capsys) -> None:
    """It said the file was "not found", and to run `normlab eval`, which would fail on it."""
    (tmp_path / "a" / "eval.json").mkdir(parents=True)
    code, err = _cli(capsys, "compare", str(tmp_path / "a"))
    assert code == 2 and "eval.json': expected the file `normlab eval` writes; got a folder" in err
    assert "not found" not in err


def test_compare_reads_the_seed_where_eval_json_records_it(tmp_path: Path, capsys) -> None:
    """`compare` printed the top-level `seed`, which its check no longer asked for: an
    eval.json without it gave a KeyError. The seed is the config's, as the report reads it."""
    quick = Path(__file__).resolve().parents[1] / "docs/results/quick/runs/pre-s1"
    run = tmp_path / "pre-s1"
    run.mkdir()
    ev = json.loads((quick / "eval.json").read_text())
    ev.pop("seed", None)
    (run / "eval.json").write_text(json.dumps(ev))
    assert main(["compare", "--markdown", str(run)]) == 0
    assert "| pre-s1 | pre | 1 |" in capsys.readouterr().out


def test_compare_plot_name_is_a_name_not_a_pattern(tmp_path: Path, capsys) -> None:
    """`--plot 'p[1].png'` matched `p1.png` (wrongly refused) and never itself (overwritten)."""
    c = cfg("train.steps=2", "train.checkpoint_every=2", "train.eval_every=2")
    train(c, tmp_path / "run", progress=False)
    plot = tmp_path / "p[1].png"
    argv = ["compare", "--curve", "train", str(tmp_path / "run"), "--plot"]
    (tmp_path / "p1.png").write_bytes(b"another figure")
    assert main([*argv, str(plot)]) == 0 and plot.is_file()
    code, err = _cli(capsys, *argv, str(plot))
    assert code == 2 and f"{str(plot)!r} already exists" in err
    assert (tmp_path / "p1.png").read_bytes() == b"another figure"


def test_analyze_threads_has_the_train_config_s_ceiling(tmp_path: Path, capsys) -> None:
    """--threads 100000 crashed libgomp (exit 139); train.threads was capped already."""
    code, err = _cli(capsys, "analyze", str(tmp_path), "--threads", "100000")
    assert code == 2 and err == "normlab: error: --threads: expected at most 1024; got 100000"


def test_compare_refuses_one_split_name_over_other_cells(tmp_path: Path, capsys) -> None:
    """Runs whose `extrapolation` held other cells (another grid) sat in one column, exit 0;
    runs that share the cells, evaluated on more or fewer examples, still compare."""
    from normlab.stats import wilson_ci

    def of(right: int, count: int) -> dict:
        return {"accuracy": right / count, "count": count, "ci95": list(wilson_ci(right, count))}

    good = of(4, 8)
    cfg = {"model": {"norm_placement": "pre"}, "train": {"seed": 0}}

    def run(name: str, cells: list[str], count: int = 8) -> Path:
        (tmp_path / name).mkdir()
        doc = {"splits": {"train": good, "extrapolation": of(count // 2, count)}, "config": cfg,
               "cells": [{"cell": c, "split": "extrapolation", "accuracy": 0.5} for c in cells]}
        (tmp_path / name / "eval.json").write_text(json.dumps(doc))
        return tmp_path / name

    a, b = run("a", ["n4d1", "n1d2"]), run("b", ["n1d2", "n4d1"], count=4)
    code, err = _cli(capsys, "compare", str(a), str(b))
    assert code == 0, err  # the same cells, in another order, on fewer examples
    c = run("c", ["n5d1"])
    code, err = _cli(capsys, "compare", str(a), str(b), str(c))
    assert code == 2 and err == (
        f"normlab: error: {str(c / 'eval.json')!r}: split 'extrapolation' holds cells n5d1, "
        f"{str(a / 'eval.json')!r}'s n1d2, n4d1; expected one split's runs to share its cells "
        "(compare puts them in one column)")
    # a damaged interval: printed as "50.0 [nan, inf]"; one that misses its own accuracy, as
    # "10.0 [98.3, 99.4]"; one around it but another count's (100 of 6000 printed with 1 of
    # 60's [0.3, 8.9]); an accuracy no count of questions gives, or no questions
    for bad in ({"ci95": "[NaN, Infinity]"}, {"ci95": "[0.8, 0.2]"}, {"ci95": "[-0.1, 0.5]"},
                {"ci95": "[0.6, 0.8]"}, {"ci95": "[0.2, 0.8]"}, {"count": 7}, {"count": 0},
                {"count": 7.0}, {"count": 16}):
        split = good | {k: v for k, v in bad.items() if k == "count"}
        text = json.dumps({"splits": {"train": split}, "config": cfg})
        (c / "eval.json").write_text(text.replace(json.dumps(good["ci95"]),
                                                  bad.get("ci95", json.dumps(good["ci95"]))))
        code, err = _cli(capsys, "compare", str(c))
        assert code == 2 and "expected normlab eval results" in err, (bad, err)
    (c / "eval.json").write_text(json.dumps({"splits": {"x": good}, "config": cfg}))
    code, err = _cli(capsys, "compare", str(c))  # no train split: the report read it unasked
    assert code == 2 and "train among them" in err, err
    (c / "eval.json").write_text(json.dumps({"splits": {"train": of(3, 6)}, "config": cfg}))
    assert _cli(capsys, "compare", str(c))[0] == 0  # 3 of 6 with its own interval
    # 19999 of 20000: neither the value nor its bounds read 100 ("99.9 [100.0, 100.0]")
    (c / "eval.json").write_text(json.dumps({"splits": {"train": of(19999, 20000)},
                                             "config": cfg}))
    assert main(["compare", "--markdown", str(c)]) == 0
    assert "| 99.9 [99.9, 99.9] |" in capsys.readouterr().out


def test_files_named_like_checkpoints_are_not_pruned_or_resumed_from(tmp_path: Path) -> None:
    """Pruning took a user's `step_notes.json` for the oldest checkpoint and deleted it with
    its `.safetensors` namesake; a stray `notes.json` made a run killed before its first
    checkpoint fail to resume ("no checkpoint") instead of starting again."""
    c = cfg("train.steps=30", "train.checkpoint_every=10", "train.eval_every=10")
    train(c, tmp_path / "straight", progress=False)
    ckpt = tmp_path / "run" / "checkpoints"
    ckpt.mkdir(parents=True)
    (tmp_path / "run" / "config.toml").write_text(dump_toml(c.to_dict()))
    for name in ("notes.json", "step_notes.json", "step_notes.safetensors", "step_.json"):
        (ckpt / name).write_text("mine")
    train(c, tmp_path / "run", progress=False, resume=True)  # started again, and finished
    assert {p.name for p in ckpt.iterdir()} == {
        "notes.json", "step_notes.json", "step_notes.safetensors", "step_.json",
        "step_0000020.json", "step_0000020.safetensors", "step_0000030.json",
        "step_0000030.safetensors"}
    assert [p.name for p in list_checkpoints(ckpt)] == ["step_0000020.json", "step_0000030.json"]
    name = "step_0000030.safetensors"  # the same run as the straight one: the same weights
    assert (ckpt / name).read_bytes() == (tmp_path / "straight/checkpoints" / name).read_bytes()


def test_a_folder_another_process_trains_in_is_refused_untouched(tmp_path: Path,
                                                                 capsys) -> None:
    """Two `train --resume` of one folder (a requeued job whose first start still ran) both
    trained: 40 log lines for 20, steps 10, 20, 30, 40, 10, 50, ... The folder is locked while
    a process trains in it; the lock goes with the process (here: released by train)."""
    import fcntl
    import os

    c = cfg("train.steps=20", "train.checkpoint_every=10", "train.eval_every=10")
    run = tmp_path / "run"
    train(c, run, progress=False, stop_after=10)
    before = {str(p): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    fd = os.open(run, os.O_RDONLY | os.O_DIRECTORY)  # "another process": another open lock
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        for flag in ("--resume", "--force"):
            code, err = _cli(capsys, "train", "--config", str(_toml(tmp_path, c)), "--out",
                             str(run), flag, "--quiet")
            assert code == 2 and err == (f"normlab: error: run folder {str(run)!r} is being "
                                         "trained by another process (or is a running sweep's "
                                         "or reproduce's --out); wait for it to end, or give "
                                         "--out another folder")
        assert {str(p): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before
    finally:
        os.close(fd)
    # the lock a first normlab holds, not only a raw exclusive one: a shared lock let two in
    from normlab.io import FolderLock

    with FolderLock(tr.TRAINING) as first:
        first.take(run)
        with pytest.raises(ValueError, match="is being trained by another process"):
            train(c, run, progress=False, resume=True)
    train(c, run, progress=False, resume=True)
    train(c, tmp_path / "run2", progress=False)  # released: the same process trains again
    train(c, tmp_path / "run2", progress=False, force=True)
    steps = [json.loads(ln)["step"] for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps))


def _toml(tmp_path: Path, c) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(dump_toml(c.to_dict()))
    return path


def test_a_resume_removes_checkpoint_temp_files_a_kill_left(tmp_path: Path) -> None:
    """A kill during a checkpoint's write left `.step_*.safetensors.XXXX.tmp`, a checkpoint's
    size, that no resume removed: one more per preemption. A resume removes those in
    checkpoints/ and nothing else."""
    c = cfg("train.steps=20", "train.checkpoint_every=10", "train.eval_every=10")
    run = tmp_path / "run"
    train(c, run, progress=False, stop_after=10)
    stale = run / "checkpoints" / ".step_00000020.safetensors.k1ll3d0n.tmp"
    stale.write_bytes(b"\0" * 1000)
    theirs = [run / "checkpoints" / ".notes.txt.abc.tmp", run / ".eval.json.x1y2z3.tmp"]
    for p in theirs:
        p.write_text("not a checkpoint's")
    train(c, run, progress=False, resume=True)
    assert not stale.exists() and all(p.exists() for p in theirs)


def test_a_checkpoint_takes_the_runs_provenance_and_no_training_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each checkpoint ran `provenance()` (two git calls, 0.6 s) and threw it away, and its
    write counted as training time in elapsed_s: 1.05 s against 0.15 s for the same 60 steps
    saved at each step or once. On a clock that only a checkpoint moves, elapsed_s is 0."""
    import normlab.checkpoint as ck

    monkeypatch.setattr(ck, "provenance", lambda: pytest.fail("provenance taken again"))
    clock = [0.0]
    real_save = tr.save_checkpoint

    def slow_save(*args, **kwargs):
        clock[0] += 1000.0  # a checkpoint that takes 1000 s
        return real_save(*args, **kwargs)

    monkeypatch.setattr(tr, "save_checkpoint", slow_save)
    monkeypatch.setattr(tr.time, "perf_counter", lambda: clock[0])
    c = cfg("train.steps=4", "train.checkpoint_every=1", "train.eval_every=2",
            "train.warmup_steps=0")
    last = train(c, tmp_path / "run", progress=False)
    assert clock[0] == 4000.0 and last["elapsed_s"] == 0.0
    sidecar = json.loads((tmp_path / "run/checkpoints/step_0000004.json").read_text())
    done = json.loads((tmp_path / "run/train_done.json").read_text())
    assert sidecar["provenance"] == done["provenance"] and sidecar["elapsed_s"] == 0.0


def test_resume_with_force_on_a_new_folder_prints_only_the_refusal(tmp_path: Path,
                                                                    capsys) -> None:
    """It said "does not exist; starting a new run there", then refused the flag pair."""
    c = cfg("train.steps=2")
    code, err = _cli(capsys, "train", "--config", str(_toml(tmp_path, c)), "--out",
                     str(tmp_path / "new"), "--resume", "--force", "--quiet")
    assert code == 2 and err == ("normlab: error: --resume and --force: give one; --resume "
                                 "continues the run, --force deletes it and starts over")
    assert not (tmp_path / "new").exists()


def test_a_log_line_that_cannot_be_written_names_the_log(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """On a full disk the appended log line failed with "[Errno 28] No space left on device",
    naming no file."""
    import errno

    real_open = Path.open

    def full(self: Path, mode: str = "r", *args, **kwargs):
        if self.name == "metrics.jsonl" and mode == "a":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", full)
    with pytest.raises(OSError, match=r"^'.*run/metrics\.jsonl' cannot be written: No space "
                                      r"left on device$"):
        train(cfg("train.steps=4", "train.eval_every=2"), tmp_path / "run", progress=False)


def test_the_log_reaches_the_disk_before_each_checkpoint(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Log lines were appended without fsync while the checkpoint after them was fsynced: after
    a power cut the checkpoint could survive its step's lines, which a resume never rewrites."""
    import os

    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    train(cfg("train.steps=4", "train.checkpoint_every=2", "train.eval_every=2"),
          tmp_path / "run", progress=False)
    names = [Path(p).name for p in synced]
    first_ckpt = next(i for i, n in enumerate(names) if ".step_" in n)
    assert "metrics.jsonl" in names[:first_ckpt]
    assert names.count("metrics.jsonl") == 2  # before each of the two checkpoints


def test_a_new_folder_is_locked_before_anything_is_prepared_in_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new folder was locked only after `prepare_run_dir`: a second start of it ran the
    preparation (a resume's tidying of temp files) unlocked. It is made and locked first."""
    import fcntl
    import os

    held: list[bool] = []
    real_prepare = tr.prepare_run_dir

    def prepare(out: Path, **kw) -> None:
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held.append(False)
        except BlockingIOError:
            held.append(True)
        finally:
            os.close(fd)
        real_prepare(out, **kw)

    monkeypatch.setattr(tr, "prepare_run_dir", prepare)
    train(cfg("train.steps=2", "train.warmup_steps=0"), tmp_path / "a" / "new", progress=False)
    assert held == [True]


def test_a_folder_taken_by_another_process_between_look_and_lock_is_left_to_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`removed_if_left_empty` decided "I made it" before the lock: refused by the process that
    made and locked the folder in between, it removed that folder, whose lock then sat on a
    deleted inode, and a third process took the new folder beside the first."""
    import fcntl
    import os

    from normlab import io

    out = tmp_path / "out"
    fds: list[int] = []
    real_take = io.FolderLock.take

    def others_first(self, folder: Path) -> None:  # another process makes and locks it now
        folder.mkdir(parents=True, exist_ok=True)
        fds.append(os.open(folder, os.O_RDONLY | os.O_DIRECTORY))
        fcntl.flock(fds[-1], fcntl.LOCK_EX | fcntl.LOCK_NB)
        real_take(self, folder)

    monkeypatch.setattr(io.FolderLock, "take", others_first)
    try:
        with pytest.raises(io.FolderBusy), io.removed_if_left_empty(out), \
                io.FolderLock(io.ANALYSING) as lock:
            lock.take(out)
        assert out.is_dir()  # still the holder's
    finally:
        for fd in fds:
            os.close(fd)
    with pytest.raises(RuntimeError), io.removed_if_left_empty(tmp_path / "mine"):
        (tmp_path / "mine").mkdir()
        raise RuntimeError("a failure of its own")
    assert not (tmp_path / "mine").exists()  # made and left empty by this block: removed


def test_a_kill_in_a_new_runs_first_write_leaves_a_folder_it_resumes(tmp_path: Path) -> None:
    """Killed while writing its first config.toml, a run folder held only that temp file, and
    every rerun (--resume and --force too) called it "not a normlab run folder". A resume also
    removes training's own temp files beside the checkpoints' (train_done.json's stayed)."""
    c = cfg("train.steps=4", "train.checkpoint_every=4", "train.eval_every=4")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".config.toml.k1ll3d00.tmp").write_text("[model]\nd_mo")
    with pytest.raises(ValueError, match=r"already exists; pass --resume"):
        train(c, run, progress=False)
    assert train(c, run, progress=False, resume=True)["step"] == 4
    assert not (run / ".config.toml.k1ll3d00.tmp").exists()
    (run / "train_done.json").unlink()  # killed while writing it
    (run / ".train_done.json.k1ll3d00.tmp").write_text("{")
    (run / ".eval.json.l1v3w000.tmp").write_text("{")  # an evaluation writing beside it
    (run / ".metrics.jsonl.swp.tmp").write_text("")  # another tool's (no mkstemp name)
    assert train(c, run, progress=False, resume=True)["step"] == 4
    assert not (run / ".train_done.json.k1ll3d00.tmp").exists()
    assert (run / ".eval.json.l1v3w000.tmp").exists()  # not training's: left to its writer
    assert (run / ".metrics.jsonl.swp.tmp").exists()


def test_eval_of_a_folder_it_cannot_write_is_refused_before_evaluating(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """It evaluated everything, then failed writing heatmap.png (analyze refused up front)."""
    import normlab.evaluate as ev
    from normlab import io

    run = tmp_path / "run"
    train(cfg("train.steps=2", "train.checkpoint_every=2", "train.eval_every=2"), run,
          progress=False)
    monkeypatch.setattr(io.os, "access", lambda path, mode: Path(path) != run)
    monkeypatch.setattr(ev, "evaluate", lambda *a, **k: pytest.fail("evaluated"))
    with pytest.raises(ValueError, match=rf"^eval: run folder '{re.escape(str(run))}': .* is "
                                         r"not writable here"):
        eval_run(run)


def test_without_locks_training_goes_on_and_leaves_temp_files_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the file system has no locks (flock: ENOLCK on some network ones) training runs
    unguarded, as before; a resume then removes no temp file, which may be a live writer's."""
    import errno

    def no_locks(fd: int, op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    c = cfg("train.steps=20", "train.checkpoint_every=10", "train.eval_every=10")
    run = tmp_path / "run"
    import normlab.io as normlab_io

    monkeypatch.setattr(normlab_io.fcntl, "flock", no_locks)
    train(c, run, progress=False, stop_after=10)
    tmp = run / "checkpoints" / ".step_0000020.safetensors.w1r1t3r.tmp"
    tmp.write_bytes(b"\0" * 10)
    assert train(c, run, progress=False, resume=True)["step"] == 20
    assert tmp.exists()


def test_a_run_trained_again_while_evaluated_gets_no_results_of_the_old_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """`eval` takes no lock (a run may be evaluated while it trains): a `train --force` under
    another seed while it evaluated left the deleted run's eval.json in the new run, unmarked
    in `compare`, refused by `eval` as current, taken as done by a sweep. It is looked at again
    before anything is written; an eval.json made before such a retraining is marked stale."""
    import normlab.evaluate as ev

    steps = ("train.steps=4", "train.checkpoint_every=4", "train.eval_every=4",
             "task.eval_size=8")
    run = tmp_path / "run"
    train(cfg(*steps), run, progress=False)
    real = ev.evaluate

    def evaluate_then_retrain(*args, **kw):
        out = real(*args, **kw)
        train(cfg(*steps, "train.seed=1"), run, progress=False, force=True)
        return out

    monkeypatch.setattr(ev, "evaluate", evaluate_then_retrain)
    with pytest.raises(ValueError, match=r"was trained again while it was evaluated \(train "
                                         r"--force\?\); nothing written"):
        eval_run(run)
    assert not (run / "eval.json").exists() and not (run / "heatmap.png").exists()
    monkeypatch.setattr(ev, "evaluate", real)
    eval_run(run)  # the seed-1 run's own; then the run is trained again under seed 2, and the
    old = (run / "eval.json").read_text()  # seed-1 eval.json written back (a race won late)
    train(cfg(*steps, "train.seed=2"), run, progress=False, force=True)
    (run / "eval.json").write_text(old)
    code, err = _cli(capsys, "compare", str(run))
    assert code == 0 and "trained again since, under another config" in err
    code, err = _cli(capsys, "eval", str(run))
    assert code == 2 and "trained again since, under another config" in err
    # what the run trained with is read from train_done.json or its newest checkpoint, never
    # config.toml: an unfinished run's edited config.toml refused every evaluation
    (run / "train_done.json").unlink()
    (run / "config.toml").write_text((run / "config.toml").read_text().replace(
        "seed = 2", "seed = 7"))
    eval_run(run, force=True)
    assert json.loads((run / "eval.json").read_text())["config"]["train"]["seed"] == 2


def test_an_evaluation_of_an_earlier_checkpoint_is_marked(tmp_path: Path, capsys) -> None:
    """A run evaluated at step 5, then resumed to the end: compare showed step 5's accuracy as
    the run's, unmarked, and `eval` refused to redo it without saying why. The folder's name
    has a space: the commands suggested are quoted, so they work when pasted."""
    import shlex

    run = tmp_path / "my run"
    config = tmp_path / "c.toml"
    train(cfg("train.steps=10", "train.checkpoint_every=5", "train.eval_every=5"), run,
          progress=False, stop_after=5)  # as a kill after step 5's checkpoint leaves it
    config.write_text((run / "config.toml").read_text())
    capsys.readouterr()
    assert main(["eval", str(run), "--limit", "2"]) == 0
    assert "checkpoint step 5 (before training finished (no train_done.json))" in \
        capsys.readouterr().out
    assert main(["compare", "--markdown", str(run)]) == 0
    out, err = capsys.readouterr()
    assert "| run | pre | 0 | 5 * |" in out.replace(f"| {run.name} ", "| run ")
    assert out.startswith("exact match % [95% CI]; step *: not the finished run's checkpoint")
    assert err.strip() == (
        f"normlab: {str(run / 'eval.json')!r}: made from step 5, before training finished (no "
        "train_done.json); on at most 2 questions a cell (--limit); `normlab eval "
        f"{shlex.quote(str(run))} --force` evaluates the newest checkpoint on every question")
    assert main(["train", "--config", str(config), "--out", str(run), "--resume",
                 "--quiet"]) == 0
    assert (f"normlab: {str(run / 'eval.json')!r} is from step 5, training now ended at step 10;"
            f" rerun `normlab eval {shlex.quote(str(run))} --force`") in capsys.readouterr().err
    code, err = _cli(capsys, "eval", str(run))
    assert code == 2 and err == (
        f"normlab: error: {str(run / 'eval.json')!r} already exists, made from step 5, but "
        "training finished at step 10; pass --force to overwrite it")
    assert main(["eval", str(run), "--force"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "checkpoint step 10"
    assert main(["compare", "--markdown", str(run)]) == 0
    out, err = capsys.readouterr()
    assert "| 10 |" in out and "*" not in out and err == ""
    # a damaged train_done.json is said, not raised (eval failed after writing eval.json)
    (run / "train_done.json").write_text('{"x": 1}')
    assert main(["eval", str(run), "--force"]) == 0
    assert "checkpoint step 10 (but train_done.json records no step to compare it with)" in \
        capsys.readouterr().out
    assert main(["compare", "--markdown", str(run)]) == 0
    assert "| 10 * |" in capsys.readouterr().out
    # a result folder copied without its checkpoints (docs/results/paper_*): "before training
    # finished", with a remedy that failed ("not a normlab run folder")
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("config.toml", "eval.json"):
        (copy / name).write_text((run / name).read_text())
    code, err = _cli(capsys, "eval", str(copy))  # said "pass --force", which failed too
    assert code == 2 and err == (f"normlab: error: {str(copy)!r} is not a normlab run folder "
                                 "(no checkpoints/)")
    assert main(["compare", "--markdown", str(copy)]) == 0
    assert capsys.readouterr().err.strip() == (
        f"normlab: {str(copy / 'eval.json')!r}: made from step 10, with no train_done.json or "
        "checkpoints/ to tell whether training finished; a copied result: nothing here to "
        "evaluate again")


def test_figures_and_messages_a_first_user_met(tmp_path: Path, capsys) -> None:
    """The heatmap's colour bar ran 0-1 under cells in percent, unlabelled, and its title gave
    no step; a run's checkpoints/ folder was "not a normlab run folder (no checkpoints/)"; a
    misspelt split before a run's first evaluation gave an empty curve table, exit 0."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    from normlab.evaluate import heatmap

    run = tmp_path / "run"
    train(cfg("train.steps=5", "train.checkpoint_every=5", "train.eval_every=5"), run,
          progress=False)
    capsys.readouterr()
    code, err = _cli(capsys, "eval", str(run / "checkpoints"))
    assert code == 2 and err == (f"normlab: error: {str(run / 'checkpoints')!r} is a run's "
                                 f"checkpoints/ folder; expected the run folder {str(run)!r}")
    assert main(["eval", str(run)]) == 0
    result = json.loads((run / "eval.json").read_text())
    seen: dict[str, object] = {}
    real_save = plt.Figure.savefig

    def keep(fig, *args, **kwargs):  # type: ignore[no-untyped-def]
        image = fig.axes[0].images[0]
        seen.update(clim=image.get_clim(), label=fig.axes[1].get_ylabel(),
                    title=fig.axes[0].get_title())
        return real_save(fig, *args, **kwargs)

    import unittest.mock

    with unittest.mock.patch.object(plt.Figure, "savefig", keep):
        heatmap(result, [], tmp_path / "h.png", title="t")
    assert seen["clim"] == (0, 100) and seen["label"] == "exact match (%)"
    # the title eval writes names the step and the questions a cell
    n = result["cells"][0]["count"]
    with unittest.mock.patch.object(plt.Figure, "savefig", keep):
        main(["eval", str(run), "--force"])
    # (wrapped to the figure's width)
    assert seen["title"].replace("\n", " ") == (f"pre seed 0, step 5: exact match %, {n} a cell "
                                                "(red: train cells)")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.toml").write_text((run / "config.toml").read_text())
    (fresh / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    code, err = _cli(capsys, "compare", "--curve", "trian", str(fresh))
    assert code == 2 and err.startswith(f"normlab: error: {str(fresh)!r}: no split 'trian' in "
                                        "the run's task (config.toml's splits: ")
    assert main(["compare", "--curve", "train", "--markdown", str(fresh)]) == 0


def test_a_log_step_counts_the_wait_for_queued_steps(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the log step's read-backs (the losses, the token count) wait for every step
    still queued; the clock was read before them, so that wait was never counted (elapsed_s
    short, tokens_per_s high). Simulated here: a token count whose read-back takes 0.3 s."""
    import time

    import normlab.train as tr

    class Queued:
        """A count on the device: reading it back waits for the queue."""

        def __init__(self, n: int) -> None:
            self.n = n

        def __radd__(self, other: int) -> Queued:  # the first step's: 0 + count
            return Queued(other + self.n)

        def __add__(self, other: Queued) -> Queued:
            return Queued(self.n + other.n)

        def __int__(self) -> int:
            time.sleep(0.3)
            return self.n

    real = tr.loss_on

    def queued(*args, **kwargs):  # type: ignore[no-untyped-def]
        loss, n = real(*args, **kwargs)
        return loss, Queued(int(n))

    monkeypatch.setattr(tr, "loss_on", queued)
    train(cfg("train.steps=4", "train.log_every=2", "train.eval_every=100",
              "train.checkpoint_every=100"), tmp_path / "run", progress=False)
    logs = [json.loads(ln) for ln in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logs] == [2, 4]
    assert logs[0]["elapsed_s"] >= 0.3 and logs[1]["elapsed_s"] >= 0.6


def test_training_steps_equal_a_hand_written_adamw_loop(tmp_path: Path) -> None:
    """Four steps of `train` against the same steps written out: the cross-entropy over the
    answer tokens, the gradient clipped to norm 1, AdamW by its formulas (weight decay on
    the `W_*` matrices only), at a warm-up then linear lr by hand. Dropping the line that sets
    each step's lr (every step at the peak) passed every test before this one. At a seed
    other than the default: a `train.seed` that never reached the initial weights or the
    training stream passed too."""
    import math

    import torch.nn.functional as F

    from normlab.tasks.addition import IGNORE_INDEX, TrainStream
    from normlab.train import load_run

    # a decay and an lr large enough that decaying every parameter, or none, is seen
    c = cfg("train.steps=4", "train.warmup_steps=2", "train.schedule='linear'",
            "train.min_lr_ratio=0.1", "train.checkpoint_every=4", "train.eval_every=4",
            "train.lr=1e-2", "train.weight_decay=0.5", "train.seed=3")
    t = c.train
    train(c, tmp_path / "run", progress=False)
    _, trained, _ = load_run(tmp_path / "run")

    torch.manual_seed(t.seed)  # as train builds its model
    model = build_model(c.model)
    task = c.task.resolve()
    stream = TrainStream(task.train_cells, seed=t.seed, batch_size=t.batch_size,
                         arch=c.model.arch, answer_format=task.answer_format,
                         weights=task.train_weights, digit_positions=task.digit_positions)
    params = dict(model.named_parameters())
    m = {n: torch.zeros_like(p) for n, p in params.items()}
    v = {n: torch.zeros_like(p) for n, p in params.items()}
    for s in range(t.steps):
        if s < t.warmup_steps:
            lr = t.lr * (s + 1) / t.warmup_steps
        else:
            f = (s - t.warmup_steps) / (t.steps - t.warmup_steps)
            lr = t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * (1 - f))
        b = next(stream)
        logits = model(b["tokens"], aux=b.get("aux"))
        loss = F.cross_entropy(logits.flatten(0, 1), b["targets"].flatten(),
                               ignore_index=IGNORE_INDEX)
        model.zero_grad(set_to_none=True)
        loss.backward()
        norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in params.values()))
        clip = min(1.0, t.grad_clip / (norm + 1e-6))
        with torch.no_grad():
            for n, p in params.items():
                g = p.grad * clip
                if n.rsplit(".", 1)[-1].startswith("W_"):
                    p.mul_(1 - lr * t.weight_decay)
                m[n].mul_(t.beta1).add_((1 - t.beta1) * g)
                v[n].mul_(t.beta2).add_((1 - t.beta2) * g * g)
                m_hat, v_hat = m[n] / (1 - t.beta1 ** (s + 1)), v[n] / (1 - t.beta2 ** (s + 1))
                p.sub_(lr * m_hat / (v_hat.sqrt() + 1e-8))
    got = dict(trained.named_parameters())
    for n, p in params.items():
        torch.testing.assert_close(got[n], p, atol=2e-6, rtol=1e-4, msg=n)


def test_a_stop_condition_first_met_at_the_last_step_is_no_early_stop(tmp_path: Path,
                                                                       capsys) -> None:
    """It printed "early stop at step 4" and recorded early_stopped, for a run that trained
    every step of its budget."""
    last = train(cfg("train.steps=4", "train.eval_every=4", "train.early_stop_accuracy=0"),
                 tmp_path / "run", progress=False)
    assert last["step"] == 4 and "early_stopped" not in last
    assert "early stop" not in capsys.readouterr().err
    done = json.loads((tmp_path / "run" / "train_done.json").read_text())
    assert done["step"] == 4 and "early_stopped" not in done
    # one step earlier it is one: stopped at step 2 of 4
    last = train(cfg("train.steps=4", "train.eval_every=2", "train.early_stop_accuracy=0"),
                 tmp_path / "run2", progress=False)
    assert last["step"] == 2 and last["early_stopped"]


def test_a_run_folder_holding_another_runs_checkpoints_is_refused_when_read(
        tmp_path: Path) -> None:
    """`eval` and `analyze` built the model from the newest checkpoint's own config and never
    compared it with the run's: a qkv run's checkpoints copied into a pre run were evaluated
    as that run, whose config.toml and train_done.json still said pre."""
    a, b = tmp_path / "a", tmp_path / "b"
    # a killed run's config.toml, edited or damaged, says nothing of what trained (a resume
    # writes it again from the checkpoint): read as before, from the checkpoint
    killed = tmp_path / "killed"
    train(cfg("train.steps=4", "train.checkpoint_every=2"), killed, progress=False,
          stop_after=2)
    for text in (dump_toml(cfg("train.steps=4", "train.log_every=7").to_dict()), "[[garbage"):
        (killed / "config.toml").write_text(text)
        assert tr.load_run(killed)[2]["step"] == 2
    train(cfg("train.steps=2", "model.norm_placement='pre'"), a, progress=False)
    train(cfg("train.steps=2", "model.norm_placement='qkv'"), b, progress=False)
    tr.load_run(a)  # its own checkpoints: read
    shutil.rmtree(a / "checkpoints")
    shutil.copytree(b / "checkpoints", a / "checkpoints")
    with pytest.raises(CheckpointError) as err:
        tr.load_run(a)
    assert str(err.value) == (
        f"checkpoint step 2 in {str(a / 'checkpoints')!r} was made under another config than the "
        "run folder records (model.norm_placement: the run's 'pre', its checkpoint's 'qkv'); "
        "expected the run's own checkpoints")
    # where and how it ran may differ (a resume may change them): read
    shutil.rmtree(a / "checkpoints")
    assert tr.load_run(b)[0].train.device != "cpu"
    train(cfg("train.steps=2", "model.norm_placement='pre'", "train.device='cpu'"), b,
          force=True, progress=False)
    shutil.copytree(b / "checkpoints", a / "checkpoints")
    assert tr.load_run(a)[0].train.device == "cpu"


def test_cli_advice_that_works_when_followed(tmp_path: Path, capsys) -> None:
    """Advice that failed when followed: `train --out` on a folder of the user's own files
    offered --resume and --force, both then refused; a d_model too large for memory was
    blamed on the task and batch size alone; `compare` on a folder named with a space said to
    run `normlab eval my run`; `eval` on a plain file said "no checkpoints/"."""
    mine = tmp_path / "thesis"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    config = tmp_path / "tiny.toml"
    config.write_text(dump_toml(cfg("train.steps=2").to_dict()))
    code, err = _cli(capsys, "train", "--config", str(config), "--out", str(mine))
    assert code == 2 and "holds files but is not a normlab run folder" in err
    assert "--resume" not in err.split(";")[0]
    check_fits = tr._check_batch_fits
    c = cfg("model.d_model=100000000")
    with pytest.raises(ValueError, match=r"at model\.d_model 100,000,000; expected shorter "
                                         r"problems \(the task's cells\), a smaller "
                                         r"train\.batch_size or a smaller model\.d_model$"):
        check_fits(c, c.validate())
    spaced = tmp_path / "my run"
    spaced.mkdir()
    code, err = _cli(capsys, "compare", str(spaced))
    assert err.endswith(f"run `normlab eval '{spaced}'` first")
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, err = _cli(capsys, "eval", str(afile))
    assert code == 2 and err == f"normlab: error: {str(afile)!r} is a file; expected a run folder"


def test_a_resume_that_trains_records_its_own_commit(tmp_path: Path, monkeypatch) -> None:
    """A record made again with no step left keeps the checkpoint's commit (the sweep's test);
    a resume that trains the rest records the commit it trained at, its own."""
    c = cfg("train.steps=4", "train.checkpoint_every=2", "train.eval_every=4")
    train(c, tmp_path / "run", progress=False, stop_after=2)
    monkeypatch.setattr(tr, "provenance", lambda: {"git_commit": "later"})
    train(c, tmp_path / "run", progress=False, resume=True)
    done = json.loads((tmp_path / "run" / "train_done.json").read_text())
    assert done["step"] == 4 and done["provenance"] == {"git_commit": "later"}


def test_a_damaged_record_with_no_checkpoint_is_refused_not_trained_again(
        tmp_path: Path) -> None:
    """A finished run's damaged train_done.json is made again from its last checkpoint; with
    none (a result folder copied without them) a resume would train the run anew over its
    results: refused in one line naming the file."""
    run = tmp_path / "run"
    c = cfg("train.steps=2")
    train(c, run, progress=False)
    (run / "train_done.json").write_text("{damaged")
    shutil.rmtree(run / "checkpoints")
    results = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    with pytest.raises(ValueError, match=r"^'.*train_done\.json': expected .*; no checkpoint "
                                         r"to make it again from: restore it from a copy$"):
        train(c, run, resume=True, progress=False, log=lambda s: None)
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == results


def test_train_names_its_device_flag(tmp_path: Path, capsys, monkeypatch) -> None:
    """`train --device cuda` without CUDA named `train.device`, which the user never wrote;
    sweep and reproduce name the flag. Nothing is made."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    config = tmp_path / "tiny.toml"
    config.write_text(dump_toml(cfg("train.steps=2").to_dict()))
    code, err = _cli(capsys, "train", "--config", str(config), "--out", str(tmp_path / "run"),
                     "--device", "cuda")
    assert code == 2 and err == ("normlab: error: --device cuda: requested but no CUDA device "
                                 "is available")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("edit", [  # (a state of the wrong type falls back to the older one)
    lambda s: s.update(cells=["n9d9"]),  # another grid's cells
    lambda s: s.update(weights="length" if s["weights"] == "uniform" else "uniform"),
])
def test_a_sidecars_bad_stream_state_names_the_checkpoints(tmp_path: Path, edit) -> None:
    """A sidecar edited past its own hash (rehashed) whose data-stream state is inconsistent:
    TrainStream's error named no file (or a KeyError, a bare name)."""
    c = cfg("train.steps=10", "train.checkpoint_every=5", "train.eval_every=10")
    run = tmp_path / "run"
    train(c, run, progress=False)
    (run / "train_done.json").unlink()
    side_path = sidecar_of(run / "checkpoints", 10)
    side = json.loads(side_path.read_text())
    edit(side["stream"])
    side["sidecar_sha256"] = sidecar_hash(side)
    side_path.write_text(json.dumps(side))
    with pytest.raises(ValueError, match=rf"^{re.escape(repr(str(run / 'checkpoints')))}: the "
                                         r"newest checkpoint's data-stream state cannot be "
                                         r"restored \(\w+: .+\); it cannot resume exactly"):
        train(c, run, progress=False, resume=True)


def _kernels_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every native kernel switched off for the rest of the test, as NORMLAB_NATIVE_*=0 does:
    describe() then says "off", where the run before said "on" (or "unavailable", unbuilt)."""
    from normlab.model import native

    for k in native.KERNELS:
        monkeypatch.setitem(native._enabled, k, False)


def test_a_resume_under_other_kernels_warns_and_records_each_part(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A resume under torch's kernels (no compiler, NORMLAB_NATIVE_*=0) went on silently to
    other weights, and train_done.json named the last part's kernels alone ("off"), though
    steps 1-4 trained with them on. Each part is recorded now, from the step it resumed at, and
    the change is one warning; a resume under the same ones says nothing and records none."""
    from normlab.model import native

    c = cfg("train.steps=12", "train.checkpoint_every=4", "train.eval_every=12")
    on, off = native.describe(), "off (torch's kernels)"
    run = tmp_path / "run"
    train(c, run, progress=False, stop_after=5)  # killed after step 5: resumes from step 4
    logs: list[str] = []
    with monkeypatch.context() as m:
        _kernels_off(m)
        train(c, run, progress=False, resume=True, stop_after=9, log=logs.append)
    warned = [s for s in logs if s.startswith("warning:")]
    assert warned == [f"warning: resumed from step 4 with another set of native kernels than "
                      f"its checkpoint's (native: checkpoint {on!r}, now {off!r}); the weights "
                      "need not be bitwise an uninterrupted run's"]
    logs.clear()
    train(c, run, progress=False, resume=True, log=logs.append)  # from step 8, kernels on
    assert sum(s.startswith("warning: resumed from step 8 with another set of native kernels")
               for s in logs) == 1
    done = json.loads((run / "train_done.json").read_text())
    torch_v = str(torch.__version__)
    assert done["provenance"]["native"] == on
    assert done["provenance"]["segments"] == [
        {"from_step": 0, "device": "cpu", "torch": torch_v, "native": on},
        {"from_step": 4, "device": "cpu", "torch": torch_v, "native": off},
        {"from_step": 8, "device": "cpu", "torch": torch_v, "native": on}]
    # the same kernels: no warning, and a record as an uninterrupted run's
    same = tmp_path / "same"
    train(c, same, progress=False, stop_after=5)
    logs.clear()
    train(c, same, progress=False, resume=True, log=logs.append)
    assert not [s for s in logs if s.startswith("warning:")]
    assert "segments" not in json.loads((same / "train_done.json").read_text())["provenance"]


def test_a_resume_under_another_torch_warns(tmp_path: Path) -> None:
    """The checkpoint's torch is compared too: another torch's ops need not round alike."""
    c = cfg("train.steps=8", "train.checkpoint_every=4", "train.eval_every=8")
    run = tmp_path / "run"
    train(c, run, progress=False, stop_after=5)
    side_path = sidecar_of(run / "checkpoints", 4)
    side = json.loads(side_path.read_text())
    side["provenance"]["torch"] = "1.13.1"  # as a checkpoint made under that torch holds it
    side["sidecar_sha256"] = sidecar_hash(side)
    side_path.write_text(json.dumps(side))
    logs: list[str] = []
    train(c, run, progress=False, resume=True, log=logs.append)
    assert [s for s in logs if s.startswith("warning:")] == [
        f"warning: resumed from step 4 with another torch than its checkpoint's (torch: "
        f"checkpoint '1.13.1', now {str(torch.__version__)!r}); the weights need not be bitwise "
        "an uninterrupted run's"]
    segments = json.loads((run / "train_done.json").read_text())["provenance"]["segments"]
    assert [(s["from_step"], s["torch"]) for s in segments] == [
        (0, "1.13.1"), (4, str(torch.__version__))]


@pytest.mark.parametrize(("name", "how", "flag"), [
    ("checkpoints", "file", "force"), ("tb", "file", "force"), ("tb", "file", "resume"),
    ("checkpoints", "file", "resume"), ("metrics.jsonl", "folder", "resume"),
    ("tb", "link", "resume"), ("checkpoints", "link", "resume"),
])
def test_a_file_where_the_run_writes_a_folder_is_refused_first(
        tmp_path: Path, name: str, how: str, flag: str) -> None:
    """A file named checkpoints was found at the first checkpoint step, after training to it;
    one named tb as a bare "[Errno 17] File exists" (under --force, after the old run was
    deleted); a metrics.jsonl folder as "not found: is it a run folder?". Each is refused in
    one line naming it, before anything is deleted or trained; a dangling link there too (it
    does not `exists()`, and no test had one)."""
    c = cfg("train.steps=4", "train.checkpoint_every=2", "train.eval_every=4",
            "train.log_every=1", "train.warmup_steps=1")
    run = tmp_path / "run"
    train(c, run, progress=False, stop_after=3)
    target = run / name
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    if how == "link":
        target.symlink_to(tmp_path / "gone")
    else:
        target.mkdir() if how == "folder" else target.write_text("notes")
    before = sorted((str(p), p.is_file() and p.read_bytes()) for p in run.rglob("*"))
    expected = "file" if how == "folder" else "folder"
    with pytest.raises(ValueError, match=rf"^{re.escape(repr(str(target)))} is not a "
                                         rf"{expected}; training writes its .+ there: move it, "
                                         r"or give --out another folder$"):
        train(c, run, progress=False, **{flag: True})
    assert sorted((str(p), p.is_file() and p.read_bytes()) for p in run.rglob("*")) == before


def test_eval_names_an_edited_config_toml_it_does_not_use(tmp_path: Path, capsys) -> None:
    """`normlab eval` evaluates with the checkpoint's config; a run folder's config.toml edited
    to ask for another task.eval_size was ignored unsaid. One warning names the field now."""
    c = cfg("train.steps=2", "train.checkpoint_every=2", "train.eval_every=2")
    run = tmp_path / "run"
    train(c, run, progress=False)
    capsys.readouterr()  # training's own warnings
    code, err = _cli(capsys, "eval", str(run))
    assert code == 0 and "warning" not in err  # as trained: nothing to say
    (run / "config.toml").write_text(dump_toml(cfg("train.steps=2", "train.checkpoint_every=2",
                                                    "train.eval_every=2",
                                                    "task.eval_size=8").to_dict()))
    code, err = _cli(capsys, "eval", str(run), "--force")
    assert code == 0
    assert [ln for ln in err.splitlines() if "warning" in ln] == [
        f"warning: {str(run / 'config.toml')!r} is not the config this run trained with "
        "(task.eval_size: config.toml 8, checkpoint 32); the checkpoint's is used"]
    assert json.loads((run / "eval.json").read_text())["config"]["task"]["eval_size"] == 32


def test_load_run_names_a_damaged_config_toml_not_a_missing_one(tmp_path: Path) -> None:
    """Only an edited, valid config.toml was tested: one that does not parse is named in the
    warning too, and a deleted one (a resume writes it again) is not warned about on every
    eval and analyze."""
    c = cfg("train.steps=2", "train.checkpoint_every=2", "train.eval_every=2")
    run = tmp_path / "run"
    train(c, run, progress=False)
    said: list[str] = []
    tr.load_run(run, warn=said.append)  # as trained
    (run / "config.toml").unlink()
    tr.load_run(run, warn=said.append)
    assert said == []
    (run / "config.toml").write_text("[task\n")
    got, _, _ = tr.load_run(run, warn=said.append)
    assert got.to_dict() == c.to_dict()
    assert len(said) == 1 and re.fullmatch(
        rf"warning: {re.escape(repr(str(run / 'config.toml')))} is not the config this run "
        r"trained with \(.*invalid TOML.*\); the checkpoint's is used", said[0])


def test_eval_sets_too_large_name_task_eval_size(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A task.eval_size of 1e8 drew for 72 s, then failed as "out of memory or range
    (MemoryError)", naming no field (a too large train.batch_size is named). Past this
    machine's memory it is refused before a problem is drawn; a MemoryError while drawing
    names it too. The folder is never made."""
    # 10**6 problems a cell, 5 cells (train 2, interpolation 1, extrapolation 2), 64 bytes at
    # least each: 320,000,000 bytes = 305.2 MiB, past a machine of 16 MiB
    monkeypatch.setattr(tr, "memory_bytes", lambda: 2**24)
    monkeypatch.setattr(tr, "eval_sets", lambda task: pytest.fail("drawn"))
    with pytest.raises(ValueError, match=r"^task\.eval_size: evaluation sets of 1,000,000 "
                                         r"problems a cell in 5 cells could not be made \(they "
                                         r"take at least 305\.2 MiB, more than this machine's "
                                         r"memory, 16\.0 MiB\); expected a smaller "
                                         r"task\.eval_size$"):
        train(cfg("task.eval_size=1000000"), tmp_path / "run", progress=False)

    def no_memory(task: object) -> None:
        raise MemoryError

    monkeypatch.setattr(tr, "memory_bytes", lambda: None)
    monkeypatch.setattr(tr, "eval_sets", no_memory)
    with pytest.raises(ValueError, match=r"^task\.eval_size: evaluation sets of 32 problems a "
                                         r"cell in 5 cells could not be made \(MemoryError\); "
                                         r"expected a smaller task\.eval_size$"):
        train(cfg(), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_an_overflow_while_the_eval_sets_are_drawn_names_task_eval_size(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """numpy's "cannot fit 'int' into an index-sized integer" (an OverflowError) while the
    sets are drawn is named as a MemoryError is; no test raised one."""
    def overflow(task: object) -> None:
        raise OverflowError("cannot fit 'int' into an index-sized integer")

    monkeypatch.setattr(tr, "memory_bytes", lambda: None)
    monkeypatch.setattr(tr, "eval_sets", overflow)
    with pytest.raises(ValueError, match=r"^task\.eval_size: evaluation sets of 32 problems a "
                                         r"cell in 5 cells could not be made \(cannot fit 'int' "
                                         r"into an index-sized integer\); expected a smaller "
                                         r"task\.eval_size$"):
        train(cfg(), tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


def test_a_run_trained_before_the_cell_rules_still_evaluates(
        tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """Held-out splits sharing problems (n2d1 in one, n2d1-2 in another) became a refusal in
    the forty-fifth session; applied to stored configs too, it made every run trained before
    unreadable ("no readable checkpoint ... shares problems"). The rule holds where a config is
    given (a file, --set, a new training); a stored one evaluates, resumes (from Python and
    from its config.toml) and is a run folder `--force` may start over, without a warning."""
    from normlab.config import RunConfig
    from normlab.tasks.addition import TaskConfig

    sets = ["task.splits={a=[[2,1]], b=[[2,[1,2]]]}", "task.train=[[1,1]]"]
    with pytest.raises(ValueError, match=r"^--set task\.splits\.b: cell n2d1-2 shares "
                                         r"problems with cell n2d1 of split 'a'$"):
        cfg(*sets)
    old = RunConfig.from_dict(cfg().to_dict() | {"task": cfg().to_dict()["task"] | {
        "train": [[1, 1]], "splits": {"a": [[2, 1]], "b": [[2, [1, 2]]]}}})  # read back: fine
    with pytest.raises(ValueError, match=r"^task\.splits\.b: cell n2d1-2 shares problems"):
        train(old, tmp_path / "new", progress=False)  # a new training is a config given now
    assert not (tmp_path / "new").exists()
    old.train.steps = old.train.checkpoint_every = old.train.eval_every = 2
    with monkeypatch.context() as m:  # trained as the normlab before the rule did
        m.setattr(TaskConfig, "check_given", TaskConfig.resolve)
        train(old, tmp_path / "run", progress=False)
    capsys.readouterr()
    run = tmp_path / "run"
    saved = (run / "config.toml").read_bytes()
    code, err = _cli(capsys, "eval", str(run))
    assert (code, [ln for ln in err.splitlines() if "warning" in ln]) == (0, [])
    assert set(json.loads((run / "eval.json").read_text())["splits"]) >= {"a", "b"}
    logs: list[str] = []
    done = train(old, run, resume=True, progress=False, log=logs.append)  # its own rules
    assert done["step"] == 2 and not [s for s in logs if "warning" in s]
    assert (run / "config.toml").read_bytes() == saved  # not taken as damaged and rewritten
    code, err = _cli(capsys, "train", "--config", str(run / "config.toml"), "--resume",
                     "--out", str(run))
    assert code == 0, err
    with pytest.raises(ValueError, match=r"^task\.splits\.b: cell n2d1-2 shares problems"):
        train(old, tmp_path / "empty", resume=True, progress=False)  # nothing to resume: new
    (tmp_path / "new.toml").write_text(dump_toml(cfg("train.steps=1").to_dict()))
    code, err = _cli(capsys, "train", "--config", str(tmp_path / "new.toml"), "--out", str(run),
                     "--force")  # its folder is a run's, which --force may start over
    assert code == 0, err


@pytest.mark.parametrize(("edit", "kernels_off", "warned"), [
    # made on a GPU (its CUDA random state in the checkpoint), resumed on the CPU
    ({"cuda_rng": "AAAAAAAAAAAAAAAAAAAAAA=="}, False,
     "device than its checkpoint's (device: checkpoint 'cuda', now 'cpu')"),
    # kernels not built where it was made, switched off now: torch's kernels both times
    ({"native": "unavailable: could not be built here (torch's kernels)"}, True, None),
])
def test_a_resume_compares_the_device_and_what_the_kernels_compute(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, edit: dict[str, str],
        kernels_off: bool, warned: str | None) -> None:
    """A GPU checkpoint resumed on the CPU said nothing (the device was not compared), and
    "unavailable" against "off" warned, though both mean torch's kernels."""
    c = cfg("train.steps=8", "train.checkpoint_every=4", "train.eval_every=8")
    run = tmp_path / "run"
    train(c, run, progress=False, stop_after=5)
    side_path = sidecar_of(run / "checkpoints", 4)
    side = json.loads(side_path.read_text())
    for key, value in edit.items():
        (side["provenance"] if key == "native" else side)[key] = value
    side["sidecar_sha256"] = sidecar_hash(side)
    side_path.write_text(json.dumps(side))
    logs: list[str] = []
    if kernels_off:
        _kernels_off(monkeypatch)
    train(c, run, progress=False, resume=True, log=logs.append)
    got = [s for s in logs if s.startswith("warning:")]
    assert got == ([] if warned is None else [
        f"warning: resumed from step 4 with another {warned}; the weights need not be bitwise "
        "an uninterrupted run's"])


def _resumed(meta: dict, device: str) -> tuple[dict, list[str]]:
    """`_resumed_under` on a checkpoint's `meta` resumed on `device` (its type is all it
    reads: no GPU needed): the provenance to record, and what it warned."""
    said: list[str] = []
    return tr._resumed_under({"commit": "c"}, meta, torch.device(device), said.append), said


def test_native_kernels_are_compared_only_between_two_cpu_parts() -> None:
    """The native kernels run on the CPU only: a part of a run on a GPU computed alike whatever
    they were, so a change of them beside a GPU part is no change. Every resume test trains on
    the CPU, and comparing them on a GPU too went unnoticed."""
    from normlab.model import native

    now, other = native.describe(), "on: a build of another machine"
    v = str(torch.__version__)
    for was, new in [("cuda", "cuda"), ("cuda", "cpu"), ("cpu", "cuda")]:
        assert not tr._differs("native", {"device": was, "native": other},
                               {"device": new, "native": now}), (was, new)
    assert tr._differs("native", {"device": "cpu", "native": other}, {"device": "cpu",
                                                                       "native": now})
    # made on a GPU (its CUDA random state kept) and resumed on one: nothing to say
    on_gpu = {"step": 4, "cuda_rng": "AA==", "provenance": {"torch": v, "native": other}}
    assert _resumed(on_gpu, "cuda") == ({"commit": "c"}, [])
    # made on the CPU, resumed on a GPU: the device is the change, and each part is recorded
    on_cpu = {"step": 4, "provenance": {"torch": v, "native": other}}
    got, said = _resumed(on_cpu, "cuda")
    assert said == ["warning: resumed from step 4 with another device than its checkpoint's "
                    "(device: checkpoint 'cpu', now 'cuda'); the weights need not be bitwise "
                    "an uninterrupted run's"]
    assert got == {"commit": "c", "segments": [
        {"from_step": 0, "device": "cpu", "torch": v, "native": other},
        {"from_step": 4, "device": "cuda", "torch": v, "native": now}]}
    got, said = _resumed(on_cpu, "cpu")  # both on the CPU: the kernels are compared
    assert len(said) == 1 and "another set of native kernels" in said[0]
    assert [s["native"] for s in got["segments"]] == [other, now]


@pytest.mark.parametrize("provenance", [{"torch": str(torch.__version__)}, None])
def test_a_checkpoint_that_recorded_no_kernels_resumes_without_a_warning(
        provenance: dict | None) -> None:
    """A checkpoint from before provenance held `native` (or before it had provenance) records
    nothing to compare: it resumes without a warning or a segment ("checkpoint None" was never
    ruled out by a test)."""
    meta = {"step": 4} | ({} if provenance is None else {"provenance": provenance})
    assert _resumed(meta, "cpu") == ({"commit": "c"}, [])


def test_damaged_segments_are_replaced_by_the_checkpoints_own() -> None:
    """A sidecar whose `segments` is not a list of tables (edited by hand: rehashed, or older
    than its hash) crashed a resume as "'int' object has no attribute 'get'"; the checkpoint's
    own torch and kernels stand for it, as where none is recorded."""
    from normlab.model import native

    now, v = native.describe(), str(torch.__version__)
    meta = {"step": 4, "provenance": {"torch": "1.13.1", "native": now, "segments": [1, 2]}}
    got, said = _resumed(meta, "cpu")
    assert len(said) == 1 and "(torch: checkpoint '1.13.1', now" in said[0]
    assert got["segments"] == [
        {"from_step": 0, "device": "cpu", "torch": "1.13.1", "native": now},
        {"from_step": 4, "device": "cpu", "torch": v, "native": now}]
