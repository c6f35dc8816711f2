"""A checkpoint sidecar's contents are checked: its own hash (`sidecar_sha256`) catches a
flipped bit, and behind it the types of its fields catch a sidecar edited past the hash, or
one from before it (a null config, a step that is not its file's, an RNG state that does not
decode...): a one-line error naming the file and the field, and the newest good checkpoint is
used instead, as for bad tensors."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import TINY_RUN
from normlab.checkpoint import (
    SELF_HASH,
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    sidecar_hash,
)
from normlab.cli import main
from normlab.config import load_config
from normlab.train import load_run, train

TINY = [*TINY_RUN, "train.steps=20", "train.checkpoint_every=10", "train.eval_every=20"]

# (field as the error names it, how the newest sidecar is damaged)
DAMAGE = [
    ("config", lambda m: m.update(config=None)),  # `normlab eval`: 'NoneType' not iterable
    ("optimizer", lambda m: m.update(optimizer=None)),  # resume: TypeError
    ("stream", lambda m: m.update(stream={})),  # resume: KeyError 'cells'
    ("elapsed_s", lambda m: m.update(elapsed_s="x")),
    ("best", lambda m: m.update(best=None)),
    # values of the right type: NaN went on into metrics.jsonl and train_done.json (whose
    # reader then refused the run); a best of 5.0 stopped a resumed run at its first evaluation
    ("elapsed_s", lambda m: m.update(elapsed_s=float("nan"))),
    ("elapsed_s", lambda m: m.update(elapsed_s=-1e9)),
    ("best", lambda m: m.update(best=5.0)),
    ("best", lambda m: m.update(best=float("inf"))),
    ("best", lambda m: m.update(best=-0.5)),
    ("step", lambda m: m.update(step="abc")),
    ("torch_rng", lambda m: m.update(torch_rng="abc")),  # "Incorrect padding", naming nothing
    ("step", lambda m: m.update(step=1)),  # in step_0000020.json: resumed "from step 1"
    ("stale", lambda m: m.update(stale=True)),
    ("early_stopped", lambda m: m.update(early_stopped="no")),  # truthy: stopped the resume
    ("cuda_rng", lambda m: m.update(cuda_rng=5)),
    ("stream.cells", lambda m: m["stream"].update(cells=None)),
    ("stream.bit_generator", lambda m: m["stream"].update(bit_generator={"state": 1})),
    ("optimizer", lambda m: m["optimizer"].update(param_groups={})),
    ("optimizer.param_groups[0].params", lambda m: m["optimizer"]["param_groups"][0].update(
        params=None)),
    ("optimizer.param_groups[1].betas", lambda m: m["optimizer"]["param_groups"][1].update(
        betas=[0.9])),
    ("stale", lambda m: m.update(stale=-3)),
    # base64 of 10 bytes, not of torch's CPU state: the resume died in torch's own error
    ("torch_rng", lambda m: m.update(torch_rng=base64.b64encode(b"0123456789").decode())),
    ("optimizer.param_groups[0].weight_decay", lambda m: m["optimizer"]["param_groups"][0]
     .update(weight_decay="0.1")),
]
IDS = [f"{field}-{i}" for i, (field, _) in enumerate(DAMAGE)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny run with checkpoints at steps 10 and 20 (about a second), copied per test."""
    run = tmp_path_factory.mktemp("trained") / "run"
    train(load_config(None, TINY), run, progress=False)
    return run


@pytest.fixture
def run(trained: Path, tmp_path: Path) -> Path:
    shutil.copytree(trained, tmp_path / "run")
    return tmp_path / "run"


def _damage(run: Path, how: Any) -> Path:
    """Damage the newest sidecar (step 20's) and return it; its own hash is made again (an
    edit by hand, or by a tool, past the hash), so these reach the type checks behind it."""
    newest = list_checkpoints(run / "checkpoints")[-1]
    meta = json.loads(newest.read_text())
    how(meta)
    meta[SELF_HASH] = sidecar_hash(meta)
    newest.write_text(json.dumps(meta))
    return newest


def _only_newest(run: Path) -> None:
    older = list_checkpoints(run / "checkpoints")[0]
    older.with_suffix(".safetensors").unlink()
    older.unlink()


@pytest.mark.parametrize(("old", "new"), [
    ('"weight_decay": 0.02', '"weight_decay": 0.06'),  # one bit of "2" -> "6"
    ('"eps": 1e-08', '"eps": 1e-09'),
    ("stream", "state + 1"),  # the data stream's generator state (other batches)
])
def test_a_flipped_bit_in_a_sidecar_is_caught_by_its_own_hash(run: Path, old: str,
                                                               new: str) -> None:
    """The resume reads the optimiser's groups, the data stream and the RNG from the sidecar,
    outside the tensor file's SHA-256: a one-bit change trained on with no word, weights
    5e-3 off an uninterrupted run's (and the edited weight decay passed on to later
    checkpoints, the config still saying 0.02)."""
    newest = list_checkpoints(run / "checkpoints")[-1]
    text = newest.read_text()
    if old == "stream":
        meta = json.loads(text)
        meta["stream"]["bit_generator"]["state"]["state"] += 1
        newest.write_text(json.dumps(meta))
    else:
        assert text.index(old) < text.index('"config"')  # the optimizer's group, not the config
        newest.write_text(text.replace(old, new, 1))
    warnings: list[str] = []
    _, meta = latest_checkpoint(run / "checkpoints", warn=warnings.append)
    assert meta["step"] == 10
    assert len(warnings) == 1 and newest.name in warnings[0]
    assert "is corrupted or was edited (sidecar_sha256 does not match its fields)" in warnings[0]


def test_a_sidecar_from_before_its_hash_still_loads(run: Path) -> None:
    """Sidecars written before `sidecar_sha256` existed are checked by their fields' types."""
    newest = list_checkpoints(run / "checkpoints")[-1]
    meta = json.loads(newest.read_text())
    assert meta.pop(SELF_HASH) == sidecar_hash(meta)
    newest.write_text(json.dumps(meta))
    assert load_checkpoint(newest)[1]["step"] == 20


def test_the_config_decides_the_optimizer_settings_on_resume(tmp_path: Path) -> None:
    """An edited sidecar's optimiser settings (weight decay, betas, gradient ascent) are not
    taken over the config the resume checked: the run ends bitwise as an uninterrupted one."""
    whole, part = tmp_path / "whole", tmp_path / "part"
    cfg = load_config(None, TINY)
    train(cfg, whole, progress=False)
    train(cfg, part, progress=False, stop_after=12)
    newest = list_checkpoints(part / "checkpoints")[-1]

    def edit(m: dict[str, Any]) -> None:
        for group in m["optimizer"]["param_groups"]:  # both: the decayed and the rest
            group.update(weight_decay=0.5, betas=[0.5, 0.5], maximize=True)

    _damage(part, edit)
    train(cfg, part, progress=False, resume=True)
    saved = json.loads(list_checkpoints(part / "checkpoints")[-1].read_text())
    assert saved["optimizer"]["param_groups"][0]["weight_decay"] == cfg.train.weight_decay
    assert newest.name == "step_0000010.json"
    a, _ = latest_checkpoint(whole / "checkpoints")
    b, _ = latest_checkpoint(part / "checkpoints")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_undamaged_checkpoints_load(run: Path) -> None:
    _, meta = latest_checkpoint(run / "checkpoints")
    assert meta["step"] == 20
    _, meta = load_checkpoint(list_checkpoints(run / "checkpoints")[0])
    assert meta["step"] == 10


@pytest.mark.parametrize(("field", "how"), DAMAGE, ids=IDS)
def test_a_damaged_sidecar_falls_back_to_the_older_checkpoint(
    run: Path, field: str, how: Any
) -> None:
    newest = _damage(run, how)
    warnings: list[str] = []
    _, meta = latest_checkpoint(run / "checkpoints", warn=warnings.append)
    assert meta["step"] == 10
    assert len(warnings) == 1 and newest.name in warnings[0] and f": {field}: " in warnings[0]


@pytest.mark.parametrize(("field", "how"), DAMAGE, ids=IDS)
def test_a_damaged_sidecar_alone_is_one_line_naming_file_and_field(
    run: Path, field: str, how: Any
) -> None:
    newest = _damage(run, how)
    _only_newest(run)
    for load in (lambda: load_checkpoint(newest), lambda: latest_checkpoint(newest.parent)):
        with pytest.raises(CheckpointError) as err:
            load()
        msg = str(err.value)
        assert "\n" not in msg and newest.name in msg and f": {field}: expected" in msg, msg


def test_resume_from_a_damaged_newest_sidecar_uses_the_older_checkpoint(run: Path) -> None:
    """The resume read `optimizer` as a table: null was a TypeError."""
    newest = _damage(run, lambda m: m.update(optimizer=None))
    (run / "train_done.json").unlink()  # killed after its last checkpoint
    logs: list[str] = []
    last = train(load_config(None, TINY), run, progress=False, resume=True, log=logs.append)
    assert last["step"] == 20
    assert any("skipping bad checkpoint" in s and newest.name in s for s in logs)
    assert any(s.endswith("from step 10") for s in logs)


def test_load_run_falls_back_past_a_null_config(run: Path) -> None:
    _damage(run, lambda m: m.update(config=None))
    _, _, meta = load_run(run)
    assert meta["step"] == 10


def test_cli_eval_of_a_run_whose_only_sidecar_is_damaged_is_one_line_exit_2(
    run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    newest = _damage(run, lambda m: m.update(config=None))
    _only_newest(run)
    assert main(["eval", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("normlab: error: ")
    assert newest.name in err and ": config: expected a table" in err


@pytest.mark.parametrize(
    ("how", "said"),
    [
        (lambda m: m["config"].update(model="x"), "model: expected a table"),
        (lambda m: m["config"]["model"].update(d_modle=16), "model.d_modle: unknown key"),
        (lambda m: m["config"]["task"].update(grid="nosuch"), "task.grid: "),
    ],
)
def test_a_sidecar_config_that_is_no_run_config_is_a_damaged_sidecar(
    run: Path, capsys: pytest.CaptureFixture[str], how: Any, said: str
) -> None:
    """Only `config`'s type was checked: a sidecar whose config no longer parsed stopped
    `normlab eval` and `--resume` with the config's own error ("model: expected a table"),
    naming no file (`eval` takes no config from the user), and the older checkpoint was
    never tried."""
    newest = _damage(run, how)
    warnings: list[str] = []
    _, meta = latest_checkpoint(run / "checkpoints", warn=warnings.append)
    assert meta["step"] == 10
    assert len(warnings) == 1 and newest.name in warnings[0] and f": config: {said}" in warnings[0]
    _, _, meta = load_run(run)
    assert meta["step"] == 10 and "skipping bad checkpoint" in capsys.readouterr().err
    _only_newest(run)
    assert main(["eval", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and newest.name in err and f": config: {said}" in err
