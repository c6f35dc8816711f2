"""`normlab reproduce`: the whole study in one restartable command.

Profiles:
- `smoke`: tiny models on the smoke grid, 2 placements x 2 seeds, a minute or two (tests).
- `quick`: `pre` and `qkv` on the quick grid, 2 seeds each, about 30 minutes on 2 CPU cores
  (two runs at a time, one torch thread each).
- `paper`: every placement, 5 seeds, on the paper grid (`configs/addition/paper/`), for a
  GPU or a cluster (`--device cuda`, or `normlab sweep --backend ray` with the same configs).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import normlab
from normlab.io import FolderLock, check_out_folder, write_json
from normlab.report import check_poolable, write_report
from normlab.sweep import SWEEPING, RunSpec, check_execute, execute, expand

ALL_PLACEMENTS = ("none", "post", "pre", "qk", "qkv")


@dataclass(frozen=True)
class Profile:
    config_dir: str
    placements: tuple[str, ...]
    seeds: tuple[int, ...]
    overrides: dict[str, Any] = field(default_factory=dict)
    analysis: dict[str, Any] = field(default_factory=dict)


PROFILES = {
    "smoke": Profile(
        "configs/addition", ("pre", "qkv"), (0, 1),
        {"task.grid": "smoke", "task.eval_size": 32, "model.d_model": 32, "model.n_layers": 2,
         "model.d_mlp": 64, "train.steps": 60, "train.eval_every": 60,
         "train.checkpoint_every": 30, "train.eval_examples": 16, "train.warmup_steps": 10},
        # theta 0.5: 60-step models have almost no rows above 0.9, and H2 needs some rows
        {"n_examples": 32, "n_draws": 4, "sigmas": [0.0, 0.05, 0.1, 0.3], "threshold": 0.5},
    ),
    "quick": Profile("configs/addition", ("pre", "qkv"), (0, 1)),
    "paper": Profile("configs/addition/paper", ALL_PLACEMENTS, (0, 1, 2, 3, 4)),
}


#: What `reproduce` writes in its --out (`report.write_report`'s files, and the runs).
REPRODUCE_FILES = ("manifest.json", "runs", "report.md", "report.html", "summary.json", "figures")


class RunsFailed(RuntimeError):
    """Some of the profile's runs failed, each named, and the report leaves them out: the CLI
    exits 1 as `normlab sweep` does, not 2, the status of bad input."""


def config_root() -> Path:
    """The repository's configs/ (next to src/), else ./configs."""
    here = Path(normlab.__file__).resolve().parents[2]
    return here if (here / "configs").is_dir() else Path.cwd()


def profile_specs(name: str, out: Path) -> list[RunSpec]:
    if name not in PROFILES:
        raise ValueError(f"--profile: expected one of {', '.join(PROFILES)}; got {name!r}")
    prof = PROFILES[name]
    if not (config_root() / prof.config_dir).is_dir():  # an installed normlab ships none
        raise ValueError(f"--profile {name}: reads {prof.config_dir}/ of a normlab checkout, "
                         "found neither beside the package nor in the current folder; run it "
                         "in a clone of the repository")
    specs = []
    # a run made with another config is found in reproduce's words: the sweep's named a sweep
    # file reproduce has none of
    remedy = ("reproduce", f"the {name!r} profile's config changed since that run was made "
              "(another normlab version?): give --out a new folder, or remove that run's folder")
    for p in prof.placements:
        base = config_root() / prof.config_dir / f"{p}.toml"
        specs += [dataclasses.replace(s, remedy=remedy) for s in expand(
            base, {"train.seed": list(prof.seeds)}, prof.overrides, out / "runs",
            name=f"{p}-s{{seed}}", analysis=prof.analysis)]
    try:
        check_poolable({s.name: s.config for s in specs})
    except ValueError as err:
        raise ValueError(f"--profile {name}: run {err}") from None
    return specs


def reproduce(profile: str, out: Path, *, jobs: int | None = None, device: str | None = None,
              progress: bool = True) -> dict[str, Any]:
    """Train, evaluate and analyse every run of `profile` (skipping finished ones), then report."""
    out = check_out_folder(out)
    specs = profile_specs(profile, out)
    check_execute(specs, jobs=jobs, device=device)  # before manifest.json is written
    manifest = out / "manifest.json"
    if manifest.is_file():  # the run folders are {placement}-s{seed} in every profile
        try:
            before = json.loads(manifest.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            before = None
        if not isinstance(before, dict) or not isinstance(before.get("profile"), str):
            raise ValueError(f"{str(manifest)!r} is not a normlab reproduce manifest; give "
                             "--out a folder of its own")
        before = before["profile"]
        if before != profile:
            raise ValueError(f"--out {str(out)!r} holds the {before!r} profile's runs; give "
                             f"the {profile!r} profile a folder of its own")
    elif out.is_dir() and any(out.iterdir()):
        # made before manifests existed, or by hand: it may hold only what reproduce writes
        # (a report.md of the user's own was written over), and its runs must be this
        # profile's, checked now; each run found changed only failed
        foreign = sorted(p.name for p in out.iterdir() if p.name not in REPRODUCE_FILES)
        if foreign or not (out / "runs").is_dir():
            what = f"{foreign[0]!r}, which reproduce does not write" if foreign else "no runs/"
            raise ValueError(f"--out {str(out)!r} holds files but no manifest.json and "
                             f"{what}; give the {profile!r} profile a folder of its own")
    # every run made already must be this profile's as it stands (its definition may have
    # changed since the manifest was written): checked before the manifest and the report
    # are rewritten, where each run refused alone replaced a good report with "0/4 runs ok"
    from normlab.config import RunConfig
    from normlab.train import check_saved_config

    foreign_runs = ("reproduce", f"--out {str(out)!r} holds other runs: give the {profile!r} "
                    "profile a folder of its own")
    for s in specs:  # with a manifest they are this profile's runs, made at another version
        check_saved_config(Path(s.out), RunConfig.from_dict(s.config),
                           tuple(s.remedy) if manifest.is_file() else foreign_runs)
    with FolderLock(SWEEPING) as lock:
        lock.take(out)  # made now, and held while the runs and the report are written
        return _run_and_report(profile, out, specs, manifest, jobs, device, progress)


def _run_and_report(profile: str, out: Path, specs: list[RunSpec], manifest: Path,
                    jobs: int | None, device: str | None, progress: bool) -> dict[str, Any]:
    write_json(manifest, {"profile": profile, "runs": [s.__dict__ for s in specs]})
    results = execute(specs, jobs=jobs, device=device, progress=progress)
    failed = [r for r in results if not r["ok"]]
    for r in failed:  # first: a report that cannot be written must not hide them
        print(f"normlab: run {r['name']} failed: {r['error']}", file=sys.stderr)
    errors = {r["name"]: r["error"] for r in failed}  # results come in the order runs end
    summary = write_report(out, [Path(s.out) for s in specs], profile,
                           failed={Path(s.out).name: errors[s.name] for s in specs
                                   if s.name in errors})
    if progress:
        print(f"report: {out / 'report.md'} ({len(specs) - len(failed)}/{len(specs)} runs ok)",
              file=sys.stderr)
    if failed:
        raise RunsFailed(f"{len(failed)} of {len(specs)} runs failed; rerun to retry them")
    return summary
