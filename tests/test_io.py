"""Result files: what they record of the code that made them, and how a damaged one reads."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

import normlab
from normlab.io import git_commit, read_json, recorded, refuse_overwrite


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=cwd,
                          capture_output=True, text=True, check=True).stdout.strip()


def _checkout(root: Path) -> Path:
    """A repository holding src/normlab/__init__.py, committed; returns that file."""
    pkg = root / "src" / "normlab"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (root / "README.md").write_text("hi\n")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "first")
    return pkg / "__init__.py"


def test_git_commit_is_the_checkouts_own_and_dirty_for_new_code_in_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new untracked module in src/ (code that ran, in no commit) left the commit clean."""
    init = _checkout(tmp_path / "repo")
    monkeypatch.setattr(normlab, "__file__", str(init))
    sha = _git(tmp_path / "repo", "rev-parse", "HEAD")
    assert git_commit() == sha
    (tmp_path / "repo" / "notes.txt").write_text("untracked, outside src/ and configs/")
    assert git_commit() == sha
    (init.parent / "my_task.py").write_text("")
    assert git_commit() == sha + "-dirty"
    (init.parent / "my_task.py").unlink()
    (tmp_path / "repo" / "README.md").write_text("edited\n")  # any tracked change
    assert git_commit() == sha + "-dirty"


def test_git_commit_is_none_for_a_copy_inside_another_repository(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """normlab installed (not editable) into a virtualenv inside the user's own project
    recorded that project's commit; GIT_DIR (a git hook's) another repository's."""
    project = tmp_path / "project"
    _checkout(project)
    site = project / ".venv" / "lib" / "python3.11" / "site-packages" / "normlab"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    monkeypatch.setattr(normlab, "__file__", str(site / "__init__.py"))
    assert git_commit() is None
    own = _checkout(tmp_path / "own")
    monkeypatch.setattr(normlab, "__file__", str(own))
    monkeypatch.setenv("GIT_DIR", str(project / ".git"))
    assert git_commit() == _git(tmp_path / "own", "rev-parse", "HEAD")


def test_a_file_that_fails_its_check_by_raising_is_named(tmp_path: Path) -> None:
    """A count too large for a float raised inside the check (the command then said "is a size
    in the config too large?"); a file nested past json's depth, a bare RecursionError, and
    `recorded` let it escape though it promises None."""
    f = tmp_path / "eval.json"
    f.write_text(json.dumps({"count": 10**400}))
    with pytest.raises(ValueError, match=r"^'.*eval\.json': expected a count; got "):
        read_json(f, "a count", lambda d: float(d["count"]) >= 0)
    f.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"^'.*eval\.json': expected a count; not valid JSON "
                                         r"\(nested too deeply to read\)$"):
        read_json(f, "a count")
    assert recorded(f, "step") is None


@pytest.mark.parametrize("step", ["true", "-1", "2.0"])
def test_a_metrics_line_needs_a_whole_step_of_at_least_zero(tmp_path: Path, step: str) -> None:
    """`"step": true` read as step 1, and a negative step was taken."""
    from normlab.io import read_metrics

    (tmp_path / "metrics.jsonl").write_text(f'{{"step": {step}}}\n{{"step": 5}}\n')
    with pytest.raises(ValueError, match=r"line 1: expected an object with an int 'step' >= 0$"):
        read_metrics(tmp_path)


def test_a_figure_that_cannot_be_saved_is_closed(tmp_path: Path) -> None:
    """An unknown format raised before the figure was closed: pyplot kept it for good."""
    import matplotlib.pyplot as plt

    from normlab.io import save_figure

    fig = plt.figure()
    with pytest.raises(ValueError, match="Format 'nope' is not supported"):
        save_figure(fig, tmp_path / "f.nope")
    assert not plt.fignum_exists(fig.number)


def test_an_out_folder_with_a_part_too_long_to_name_is_one_line(tmp_path: Path) -> None:
    from normlab.io import check_out_folder

    with pytest.raises(ValueError, match=r"^--out '.*': not a path this system can make "
                                         r"\(File name too long\)$"):
        check_out_folder(tmp_path / ("x" * 300) / "run")


def test_a_log_that_is_a_folder_is_named_as_one(tmp_path: Path) -> None:
    """A metrics.jsonl that is a folder was reported as "not found: is it a run folder?"."""
    from normlab.io import read_metrics

    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(ValueError, match=rf"^{re.escape(repr(str(tmp_path / 'metrics.jsonl')))} "
                                         r"is not a file; expected the run's log there$"):
        read_metrics(tmp_path)


def test_refuse_overwrite_takes_a_folder_of_a_results_name_as_there(tmp_path: Path) -> None:
    """A folder named eval.json where the result goes is refused as a file of that name is (the
    glob that came before matched it; taken as absent, the command failed later, while
    writing); --force passes it on, and a name not there is no refusal. Untested before."""
    (tmp_path / "eval.json").mkdir()
    with pytest.raises(ValueError, match=rf"^{re.escape(repr(str(tmp_path / 'eval.json')))} "
                                         r"already exists; pass --force to overwrite it$"):
        refuse_overwrite(tmp_path, ["notes.json", "eval.json"], False)
    refuse_overwrite(tmp_path, "eval.json", True)
    refuse_overwrite(tmp_path, "notes.json", False)
