"""`normlab reproduce --profile smoke`: the study's plumbing end to end, restartable."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from normlab.cli import main


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("repro") / "smoke"
    assert main(["reproduce", "--profile", "smoke", "--out", str(out), "--jobs", "2"]) == 0
    return out


def test_report_files_and_claims(smoke: Path) -> None:
    for name in ("report.md", "report.html", "summary.json", "manifest.json"):
        assert (smoke / name).is_file(), name
    summary = json.loads((smoke / "summary.json").read_text())
    claims = {c["id"]: c for c in summary["claims"]}
    assert set(claims) == {"H1", "H2", "H3", "H4"}
    for c in claims.values():
        assert c["verdict"] in ("agrees", "disagrees", "inconclusive")
        assert isinstance(c["ours"], float) and c["n_seeds"] == 2
    md = (smoke / "report.md").read_text()
    assert "| **H1**" in md and "Verdict rules" in md
    kernel = summary["provenance"]["native"]  # which native kernels ran is on record
    assert kernel and f"CPU kernels {kernel}" in md
    assert all(r["provenance"]["native"] == kernel for r in summary["runs"])
    html = (smoke / "report.html").read_text()
    assert "data:image/png;base64," in html and "<table>" in html  # self-contained
    # every figure of report.md embedded, one heatmap per run too: the two study figures alone
    # passed the line above
    assert html.count("<img ") == md.count("\n![") == 2 + 4
    runs = summary["runs"]
    assert {(r["placement"], r["seed"]) for r in runs} == {("pre", 0), ("pre", 1), ("qkv", 0),
                                                           ("qkv", 1)}
    assert all(r["provenance"]["torch"] and r["config"]["model"] for r in runs)
    for r in runs:
        d = smoke / "runs" / r["run"]
        for f in ("eval.json", "analysis/norms.json", "analysis/collapse.json"):
            assert (d / f).is_file()


def test_rerun_skips_finished_runs(smoke: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = {p: p.stat().st_mtime_ns for p in smoke.glob("runs/*/eval.json")}
    assert main(["reproduce", "--profile", "smoke", "--out", str(smoke), "--jobs", "1"]) == 0
    after = {p: p.stat().st_mtime_ns for p in smoke.glob("runs/*/eval.json")}
    assert before == after  # nothing recomputed
    assert "already done" in capsys.readouterr().err


def test_the_profiles_are_the_readmes_from_any_folder(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """quick is pre and qkv with 2 seeds each, paper every placement with 5 (the README): no
    test pinned them. The configs are the checkout's wherever the command runs: every test ran
    from the checkout, where ./configs hid a config_root that missed it."""
    from normlab.reproduce import profile_specs

    monkeypatch.chdir(tmp_path)
    for profile, placements, seeds in (("quick", ("pre", "qkv"), 2),
                                       ("paper", ("none", "post", "pre", "qk", "qkv"), 5)):
        specs = profile_specs(profile, tmp_path / profile)
        assert [s.name for s in specs] == [f"{p}-s{i}" for p in placements for i in range(seeds)]
        assert [(s.config["model"]["norm_placement"], s.config["train"]["seed"])
                for s in specs] == [(p, i) for p in placements for i in range(seeds)]


def test_failed_runs_are_still_a_runtime_error_to_python_callers() -> None:
    """`RunsFailed` lets the command exit 1; a caller catching RuntimeError still catches it."""
    from normlab.reproduce import RunsFailed

    assert issubclass(RunsFailed, RuntimeError)


def test_a_profile_without_the_checkouts_configs_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """An installed (not editable) normlab has no configs/ beside it: each profile's missing
    config file was named, not what to do."""
    from normlab import reproduce

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(reproduce, "config_root", lambda: tmp_path)
    assert main(["reproduce", "--profile", "quick", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--profile quick: reads configs/addition/ of a normlab checkout" in err
    assert "run it in a clone of the repository" in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_unknown_profile_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["reproduce", "--profile", "huge", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--profile: expected one of smoke, quick, paper" in err and "\n" not in err


def test_another_profile_into_the_same_folder_is_refused(
        smoke: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every profile names its runs {placement}-s{seed}: a second profile into one --out
    overwrote the report with the old runs' numbers under the new name; now it is one line,
    before anything is written."""
    before = {p: p.read_bytes() for p in (smoke / "manifest.json", smoke / "report.md")}
    assert main(["reproduce", "--profile", "quick", "--out", str(smoke)]) == 2
    err = capsys.readouterr().err.strip()
    assert "holds the 'smoke' profile's runs" in err and "\n" not in err
    assert {p: p.read_bytes() for p in before} == before


def test_a_foreign_manifest_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # a profile that is not a name said "holds the ['smoke'] profile's runs; give the 'smoke'
    # profile a folder of its own"
    for text in ("[1, 2]", "{not json", '{"runs": []}', '{"profile": ["smoke"]}'):
        (tmp_path / "manifest.json").write_text(text)
        assert main(["reproduce", "--profile", "smoke", "--out", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip()
        assert "is not a normlab reproduce manifest" in err and "\n" not in err


def test_a_folder_of_other_runs_without_a_manifest_is_refused_before_anything_is_written(
        smoke: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A study made before manifests existed (the committed `docs/results/quick`) has none:
    every run of another profile then failed its config check, and the empty report of that
    profile was written over the study's own."""
    import shutil

    old = tmp_path / "old"
    shutil.copytree(smoke, old)
    (old / "manifest.json").unlink()
    before = {p: p.read_bytes() for p in old.rglob("*") if p.is_file()}
    assert main(["reproduce", "--profile", "quick", "--out", str(old)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("normlab: error: reproduce: the config differs from the one saved in")
    assert f"--out {str(old)!r} holds other runs" in err and "\n" not in err
    assert {p: p.read_bytes() for p in old.rglob("*") if p.is_file()} == before


def test_a_folder_of_the_users_own_files_is_refused_untouched(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Without a manifest, a folder holding a report.md and a summary.json of the user's own
    was trained into and its files written over, with exit 0."""
    (tmp_path / "report.md").write_text("my notes")
    (tmp_path / "summary.json").write_text("keep")
    assert main(["reproduce", "--profile", "smoke", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"normlab: error: --out {str(tmp_path)!r} holds files but no manifest.json and no "
        "runs/; give the 'smoke' profile a folder of its own")
    (tmp_path / "runs").mkdir()
    (tmp_path / "thesis.tex").write_text("mine")
    assert main(["reproduce", "--profile", "smoke", "--out", str(tmp_path)]) == 2
    assert "and 'thesis.tex', which reproduce does not write;" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "report.md", "runs", "summary.json", "thesis.tex"]
    assert (tmp_path / "report.md").read_text() == "my notes"


def test_an_evaluation_made_by_hand_with_a_limit_is_made_again(
        smoke: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`normlab eval RUN --limit 4` left an eval.json the rerun took as done; the report then
    refused to pool it, on every rerun. A damaged analysis file is made again too."""
    import shutil

    out = tmp_path / "again"
    shutil.copytree(smoke, out)
    run = out / "runs" / "pre-s0"
    assert main(["eval", str(run), "--limit", "4", "--force"]) == 0
    (run / "analysis" / "norms.json").write_text('{"summary": {}}')  # JSON, not what it reads
    capsys.readouterr()
    assert main(["reproduce", "--profile", "smoke", "--out", str(out), "--jobs", "1"]) == 0
    assert json.loads((run / "eval.json").read_text())["limit"] is None
    assert json.loads((run / "analysis" / "norms.json").read_text())["summary"]
    err = capsys.readouterr().err
    assert "pre-s0: ok (eval, analyze" in err, err


@pytest.mark.parametrize(("flags", "message"), [
    (["--jobs", str(2**31)], r"^normlab: error: --jobs: expected an int in \[1, 65536\) runs at "
                             r"once; got 2147483648$"),
    # the flag, not the runs' train.device, which it overrides
    (["--device", "cuda"], r"^normlab: error: --device cuda: requested but no CUDA device is "
                           r"available$"),
])
def test_a_refused_reproduce_writes_no_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                flags: list[str], message: str) -> None:
    """The manifest was written before the sweep's own checks: a device this machine lacks, or
    --jobs past what the pool takes (blamed on "a size in the config"), left a folder whose
    manifest then refused every other profile there."""
    import torch

    if "cuda" in flags and torch.cuda.is_available():
        pytest.skip("this machine has the GPU the refusal is about")
    out = tmp_path / "out"
    assert main(["reproduce", "--profile", "smoke", "--out", str(out), *flags]) == 2
    assert re.match(message, capsys.readouterr().err.strip())
    assert not out.exists()


def test_a_run_made_with_another_config_is_named_in_reproduces_words(
        smoke: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """It said "the sweep file changed since that run was made: give the sweep another --out",
    naming a file reproduce has none of."""
    import shutil

    out = tmp_path / "smoke"
    shutil.copytree(smoke, out)
    done = out / "runs" / "pre-s0" / "train_done.json"  # a finished run: the config it records
    record = json.loads(done.read_text())
    record["config"]["train"]["steps"] += 1
    done.write_text(json.dumps(record))
    assert main(["reproduce", "--profile", "smoke", "--out", str(out), "--jobs", "1"]) == 2
    err = capsys.readouterr().err
    assert ("the 'smoke' profile's config changed since that run was made (another normlab "
            "version?): give --out a new folder, or remove that run's folder") in err
    assert "sweep file" not in err


def test_a_profile_changed_since_its_runs_is_refused_before_the_report(
        smoke: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A profile whose definition changed since its runs were made (a new normlab): each
    finished run was refused alone, after manifest.json was rewritten to the new configs and
    the good report replaced by "0/4 runs ok" with every claim inconclusive."""
    import dataclasses
    import shutil

    from normlab import reproduce

    out = tmp_path / "smoke"
    shutil.copytree(smoke, out)
    kept = {p: p.read_bytes() for p in (out / "manifest.json", out / "report.md",
                                        out / "summary.json")}
    changed = dataclasses.replace(reproduce.PROFILES["smoke"], overrides={
        **reproduce.PROFILES["smoke"].overrides, "train.lr": 0.5})
    monkeypatch.setitem(reproduce.PROFILES, "smoke", changed)
    assert main(["reproduce", "--profile", "smoke", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "train.lr" in err and "the 'smoke' profile's config changed since that run" in err
    assert {p: p.read_bytes() for p in kept} == kept


def test_a_reproduce_whose_runs_failed_exits_1_as_a_sweep_does(
        smoke: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A failed run exited 2, the status of bad input (nothing run), where `normlab sweep`
    exits 1 (cli's docstring): a script could not tell a study whose report left a run out
    from a refused command."""
    import shutil

    out = tmp_path / "smoke"
    shutil.copytree(smoke, out)
    result = out / "runs" / "pre-s1" / "eval.json"
    result.unlink()
    result.mkdir()  # the evaluation is made again, and cannot be written
    assert main(["reproduce", "--profile", "smoke", "--out", str(out), "--jobs", "1"]) == 1
    err = capsys.readouterr().err
    assert "normlab: run pre-s1 failed: " in err
    assert "1 of 4 runs failed; rerun to retry them" in err
    assert "- **Left out: run pre-s1 failed**" in (out / "report.md").read_text()


@pytest.mark.parametrize("folder", ["configs/addition", "configs/addition/paper"])
def test_the_shipped_placements_differ_only_in_where_the_norms_go(folder: str) -> None:
    """No test read none/post/qk.toml or a paper config but pre: a changed learning rate or
    thread count in one passed every test (and the report refused the study at its end)."""
    from normlab.config import load_config
    from normlab.reproduce import ALL_PLACEMENTS, config_root

    configs = {p: load_config(config_root() / folder / f"{p}.toml").to_dict()
               for p in ALL_PLACEMENTS}
    for p, cfg in configs.items():
        assert cfg["model"].pop("norm_placement") == p
    assert all(cfg == configs["pre"] for cfg in configs.values())


def test_a_profile_whose_configs_cannot_be_pooled_is_refused_before_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A placement's config with another learning rate: every run trained (the paper profile's
    25 of 40,000 steps), then the report refused them."""
    from normlab import reproduce

    shutil.copytree(reproduce.config_root() / "configs", tmp_path / "configs")
    qkv = tmp_path / "configs/addition/qkv.toml"
    assert "\nlr = 2e-3" in qkv.read_text()
    qkv.write_text(qkv.read_text().replace("\nlr = 2e-3", "\nlr = 3e-3", 1))
    monkeypatch.setattr(reproduce, "config_root", lambda: tmp_path)
    assert main(["reproduce", "--profile", "smoke", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("normlab: error: --profile smoke: run 'qkv-s0' would train with "
                          "train.lr = 0.003, 'pre-s0' with ")
    assert not (tmp_path / "out").exists()
