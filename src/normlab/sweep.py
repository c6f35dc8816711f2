"""Sweeps: expand a grid of config values into runs and execute them, locally or on Ray.

Each run is train (resuming whatever was left) -> eval -> analyse; a step whose output
exists is skipped (eval and analysis only if made from the checkpoint training finished with),
so rerunning a sweep only does what is missing. A failed run is reported with its error and
the others go on.

A sweep file (TOML):

    base = "../addition/pre.toml"        # run config, relative to this file
    name = "{norm_placement}-s{seed}"     # run folder names, from the grid keys' last part
    [grid]                                # every combination becomes one run
    "model.norm_placement" = ["pre", "qkv"]
    "train.seed" = [0, 1, 2]
    [set]                                 # fixed overrides for every run
    "train.steps" = 2000
    [run]
    analyze = true
"""

from __future__ import annotations

import datetime
import itertools
import json
import math
import os
import signal
import string
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from normlab import allocator
from normlab.checks import check_int, did_you_mean, first_line
from normlab.config import config_key, load_config, read_toml
from normlab.io import (
    FolderLock,
    check_out_folder,
    read_json,
    recorded,
    removed_if_left_empty,
    write_json,
)

SWEEP_KEYS = ("base", "name", "grid", "set", "run")
#: the most runs one sweep file may make: each is a folder, a config and a training
MAX_RUNS = 100_000
#: what a second sweep or reproduce of one --out is told while the first holds it
SWEEPING = ("--out {out} is in use by another normlab sweep or reproduce (or a run trained there); "
            "wait for it to end, or give --out another folder")
SWEEP_REMEDY = ("sweep", "the sweep file changed since that run was made: give the sweep "
                "another --out, or remove that run's folder")


@dataclass
class RunSpec:
    """One run of a sweep: its folder, its resolved config, what to do after training."""

    name: str
    out: str
    config: dict[str, Any]
    analyze: bool = True
    analysis: dict[str, Any] = field(default_factory=dict)
    #: who finds a run folder made with another config, and what to do (reproduce: its own)
    remedy: tuple[str, str] = SWEEP_REMEDY


def expand(
    base: str | Path | None,
    grid: dict[str, list[Any]],
    fixed: dict[str, Any],
    out: Path,
    name: str = "",
    analyze: bool = True,
    analysis: dict[str, Any] | None = None,
) -> list[RunSpec]:
    """Every combination of `grid` values on top of `base` + `fixed`; configs validated now."""
    if not grid:
        raise ValueError("sweep.grid: empty; expected at least one KEY = [values]")
    grid, fixed = _keyed(grid, "grid"), _keyed(fixed, "set")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise ValueError(f"sweep.grid.{key}: expected a non-empty list of values")
    if both := sorted(set(fixed) & set(grid)):  # the [set] value was dropped unseen
        raise ValueError(f"sweep.set.{both[0]}: also a grid key; give it in one table")
    n_runs = math.prod(len(v) for v in grid.values())
    if n_runs > MAX_RUNS:  # expanded in silence, ~10 KB and 1 ms a run, until memory ran out
        sizes = " x ".join(str(len(v)) for v in grid.values())
        raise ValueError(f"sweep.grid: {n_runs:,} runs ({sizes}); expected at most "
                         f"{MAX_RUNS:,}")
    for key, values in grid.items():  # named, where two runs "got the same folder name"
        seen: set[str] = set()
        for text in map(_toml, values):
            if text in seen:
                raise ValueError(f"sweep.grid.{key}: value {text} is given twice")
            seen.add(text)
    specs = []
    names: dict[str, dict[str, Any]] = {}
    configs: dict[str, dict[str, Any]] = {}  # a run's whole config -> its grid values
    fitted: set[str] = set()  # the model and task configs the analysis was checked against
    keys = list(grid)
    for combo in itertools.product(*(grid[k] for k in keys)):
        chosen = dict(zip(keys, combo, strict=True))
        sets = [f"{k}={_toml(v)}" for k, v in {**fixed, **chosen}.items()]
        cfg = load_config(base, sets, set_by=None)  # the sweep file leads its errors
        short = {k.split(".")[-1]: v for k, v in chosen.items()}
        run_name = _run_name(name or "-".join("{" + k + "}" for k in short), short)
        model_task = json.dumps([cfg.to_dict()[k] for k in ("model", "task")], sort_keys=True)
        if analyze and model_task not in fitted:  # now, not after every run has trained
            from normlab.analysis.report import check_analysis_fits

            try:
                check_analysis_fits(analysis or {}, cfg, "sweep.run.analysis")
            except ValueError as err:
                raise ValueError(f"{err} (run {run_name})") from None
            fitted.add(model_task)
        whole = json.dumps(cfg.to_dict(), sort_keys=True)
        if whole in configs:  # 1 and 1.0, or a table's keys in another order: one run twice
            raise ValueError(f"sweep.grid: runs {configs[whole]} and {chosen} make the same "
                             "config; give each value once")
        configs[whole] = chosen
        if run_name in names:
            raise ValueError(f"sweep.name: runs {names[run_name]} and {chosen} both get the "
                             f"folder name {run_name!r}; make the name tell them apart (every "
                             "grid key, in a format that keeps their values apart)")
        names[run_name] = chosen
        specs.append(
            RunSpec(run_name, str(out / run_name), cfg.to_dict(), analyze, analysis or {})
        )
    return specs


def _keyed(table: dict[str, Any], name: str) -> dict[str, Any]:
    """A sweep table with its keys as the config reads them (`"train.seed "` is `train.seed`):
    compared raw, a spaced [set] key that was also a grid key was overwritten unseen."""
    out: dict[str, Any] = {}
    raw: dict[str, str] = {}
    for key, value in table.items():
        norm = ".".join(config_key(key, f"sweep.{name}.{key}"))  # named here, not as a --set
        if norm in out:
            raise ValueError(f"sweep.{name}: keys {raw[norm]!r} and {key!r} are one key; give "
                             "it once")
        out[norm], raw[norm] = value, key
    return out


def _run_name(template: str, fields: dict[str, Any]) -> str:
    """A run's folder name, `template` filled in from its grid values: one folder right inside
    the sweep's --out, never a path that leads out of it."""
    try:
        # a field reads a grid value, not its attributes or items: "{norm_placement.upper}"
        # named folders after a method's address, another in every process
        for _, field_name, _, _ in string.Formatter().parse(template):
            if field_name and any(c in field_name for c in ".["):
                raise ValueError(f"the field {{{field_name}}} reads an attribute or item")
        run_name = template.format(**fields)
    except KeyError as err:
        raise ValueError(f"sweep.name: {err} is not a grid key") from None
    except (IndexError, ValueError, AttributeError, TypeError) as err:  # "{}", "{seed", ...
        raise ValueError(f"sweep.name: invalid template {template!r} ({err}); expected "
                         "fields named by grid keys, as {seed}") from None
    if run_name in ("", ".", "..") or Path(run_name).name != run_name:
        raise ValueError(f"sweep.name: run name {run_name!r} is not a single folder name (no "
                         "path separators, not '.' or '..', not empty)")
    # every run failed as it started; 251: its log beside it, NAME.log, takes 255
    if "\0" in run_name or len(run_name.encode()) > 251:
        raise ValueError(f"sweep.name: run name {run_name!r} cannot name a folder and its log "
                         "(a NUL, or more than 251 bytes)")
    return run_name


def _toml(v: Any) -> str:
    """A value read from the sweep file, written back as the TOML literal `--set` parses: every
    type TOML has (an inline table was passed on as the text of a Python dict)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):  # a TOML basic string: JSON's escapes, and DEL, which TOML bars
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, list):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, dict):  # keys quoted as strings are: any key, dotted or not
        return "{" + ", ".join(f"{_toml(k)} = {_toml(x)}" for k, x in v.items()) + "}"
    if isinstance(v, datetime.date | datetime.time):  # str() of a datetime has no "T"
        return v.isoformat()
    return str(v)  # int; float, inf and nan included (TOML spells them as Python does)


def load_sweep(path: Path, out: Path) -> list[RunSpec]:
    """The runs of a sweep file, every error one line naming the file (its key names, and the
    run configs it makes, are checked now, before any run trains)."""
    data = read_toml(Path(path), "sweep file")
    try:
        return _sweep_specs(data, Path(path), out)
    except ValueError as err:
        raise ValueError(f"sweep file {str(path)!r}: {err}") from None


def _sweep_specs(data: dict[str, Any], path: Path, out: Path) -> list[RunSpec]:
    for key in data:
        if key not in SWEEP_KEYS:
            raise ValueError(f"sweep.{key}: unknown key{did_you_mean(key, SWEEP_KEYS)}; "
                             f"expected one of {', '.join(SWEEP_KEYS)}")
    base = _sweep_value(data, "base", str, None, "a string, the run config's path")
    if base is not None:
        base = path.parent / base
    run = _sweep_value(data, "run", dict, {}, "a table")
    for key in run:
        if key not in ("analyze", "analysis"):
            raise ValueError(f"sweep.run.{key}: unknown key"
                             f"{did_you_mean(key, ('analyze', 'analysis'))}; expected analyze or "
                             "analysis")
    analyze, analysis = run.get("analyze", True), run.get("analysis", {})
    if not isinstance(analyze, bool):
        raise ValueError(f"sweep.run.analyze: expected true or false; got {analyze!r}")
    if not isinstance(analysis, dict):
        raise ValueError("sweep.run.analysis: expected a table of analyze_run's arguments")
    from normlab.analysis.report import check_analysis_args

    check_analysis_args(analysis, "sweep.run.analysis")  # now, not after every run's training
    return expand(base, _sweep_value(data, "grid", dict, {}, "a table"),
                  _sweep_value(data, "set", dict, {}, "a table"), out,
                  _sweep_value(data, "name", str, "", "a string, the run folder names' template"),
                  analyze, analysis)


def _sweep_value(data: dict[str, Any], key: str, kind: type, default: Any, what: str) -> Any:
    """The sweep file's top-level `key` (`default` when absent), refused in one line when it
    is not a `kind`."""
    if key not in data:
        return default
    if not isinstance(data[key], kind):
        raise ValueError(f"sweep.{key}: expected {what}; got {data[key]!r}")
    return data[key]


def run_one(spec: RunSpec, device: str | None = None) -> dict[str, Any]:
    """Train (or resume), evaluate and analyse one run; finished steps are skipped. `device`,
    where given (`--device`), overrides the run's `train.device`, as `normlab train`'s does."""
    import torch

    from normlab.cli import eval_run, retrained
    from normlab.config import RunConfig
    from normlab.report import RESULT_FILES, read_result
    from normlab.train import DONE, DONE_RECORD, check_saved_config, finished_record, train

    t0 = time.time()
    out = Path(spec.out)
    cfg = RunConfig.from_dict(spec.config)
    if device is not None:  # the config's own was replaced by "auto" unseen
        cfg.train.device = device
    torch.set_num_threads(cfg.train.threads)
    done = []
    log_path = run_log(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("a") as log:

        def say(s: str) -> None:
            log.write(s + "\n")
            log.flush()

        # a run folder of this name, made as another run (the sweep file changed since), is
        # neither resumed nor taken as done: said here in the sweep's words, not train's;
        # before anything in it is written
        check_saved_config(out, cfg, tuple(spec.remedy))
        timings_path = out / "timings.json"
        timings: dict[str, float] = {}
        if timings_path.is_file():
            try:  # bookkeeping (the report's seconds columns): a damaged one failed the run
                timings = read_json(timings_path, *RESULT_FILES["timings.json"])
            except ValueError as err:  # replaced now, so the report reads "no seconds"
                write_json(timings_path, timings)
                say(f"warning: {first_line(err)}; replaced by an empty record (the report "
                    "shows no seconds for the steps it timed)")

        def step(name: str, fn: Callable[[], Any]) -> None:
            t = time.time()
            fn()
            timings[name] = timings.get(name, 0.0) + time.time() - t
            write_json(timings_path, timings)
            done.append(name)

        # none, or a damaged one the resume makes again (and warns of: not said here too)
        if finished_record(out, lambda s: None) is None:
            step("train", lambda: train(cfg, out, resume=True, progress=False, log=say))
        # Results count as done only if made from the checkpoint training finished with: a
        # run stopped, evaluated or analysed by hand, then resumed by the sweep kept the
        # earlier checkpoint's results. The sweep owns the folder: they are made again (the
        # JSON files replaced atomically, as `normlab eval --force` replaces eval.json).
        final = read_json(out / DONE, *DONE_RECORD)["step"]
        # ... holding what the report reads, and made with the sweep's own settings: an
        # eval.json made by hand with --limit was taken as done, and the report then refused
        # to pool it, on every rerun
        ev = read_result(out, "eval.json")
        # (or of another run, trained again here with --force under another config)
        if (ev is None or ev["checkpoint"].get("step") != final or ev.get("limit") is not None
                or retrained(out, ev.get("config"))):
            step("eval", lambda: eval_run(out, force=True))
            _check_made_from(out / "eval.json", ("checkpoint", "step"), final)
        # interference.json is the last result analyze_run writes: an analysis that failed
        # part-way (its earlier files written) is run again, not taken as done
        if spec.analyze:
            from normlab.analysis.report import analyze_run, check_same_analysis

            done_at = recorded(out / "analysis" / "interference.json", "checkpoint_step")
            if done_at != final or any(read_result(out, f"analysis/{f}") is None  # or damaged
                                       for f in ("norms.json", "collapse.json")):
                step("analyze", lambda: analyze_run(out, **spec.analysis))
                _check_made_from(out / "analysis" / "interference.json", ("checkpoint_step",),
                                 final)
            else:  # done, but with these settings? (a changed sweep kept the old analysis)
                check_same_analysis(out / "analysis", spec.analysis)
    return {"name": spec.name, "did": done, "seconds": time.time() - t0}


def _check_made_from(path: Path, keys: tuple[str, ...], final: int) -> None:
    """A result just made is from the final checkpoint, or the run fails: the newest checkpoint
    that verifies is an earlier one when the final one is damaged."""
    made = recorded(path, *keys)
    if made != final:
        raise ValueError(f"{str(path)!r}: made from checkpoint step {made}, but training "
                         f"finished at step {final}, whose checkpoint does not verify")


def run_log(out: Path) -> Path:
    """A run's log, beside its folder (NAME.log): what it said while it ran, and its
    traceback where it failed."""
    return out.parent / f"{out.name}.log"


def _safe_run(spec: RunSpec, device: str | None, marks: str | None = None) -> dict[str, Any]:
    """A sweep worker's job (its own process, spawned or a Ray task): one run, its error
    reported instead of raised. A local worker first marks the run started in `marks`: when a
    worker dies, the sweep tells the runs it took down from those it never began."""
    if marks is not None:
        (Path(marks) / spec.name).touch()
    try:
        allocator.keep_freed_memory()  # a worker is normlab's own process, as the command is
        return {"ok": True, **run_one(spec, device)}
    except Exception as err:  # reported, and the sweep goes on
        tb = traceback.format_exc()
        error = f"{type(err).__name__}: {err}"
        log = run_log(Path(spec.out))
        try:  # where the one-line report cannot tell (a bug's KeyError), the log can
            with log.open("a") as f:
                f.write(tb)
            if not isinstance(err, ValueError):  # normlab's own errors say it in their line
                error += f" (traceback in {str(log)!r})"
        except OSError:
            pass
        return {"ok": False, "name": spec.name, "error": error, "traceback": tb}


def _current_step(spec: RunSpec) -> int:
    path = Path(spec.out) / "metrics.jsonl"
    try:
        last = path.read_text().rstrip().rsplit("\n", 1)[-1]
        return int(last.split('"step": ', 1)[1].split(",", 1)[0])
    except (OSError, IndexError, ValueError):
        return 0


def check_jobs(jobs: object) -> None:
    """Runs at once: None (`default_jobs`) or an int in [1, 65536) (2**31 failed in the process
    pool as "a size in the config too large")."""
    if jobs is not None:
        check_int(jobs, "--jobs", low=1, high=2**16, what="an int in [1, 65536) runs at once")


def check_execute(specs: list[RunSpec], *, backend: str = "local", jobs: int | None = None,
                  device: str | None = None, address: str | None = None) -> None:
    """What `execute` refuses before any run starts, in one line: `reproduce` asks first, so a
    refusal leaves its --out without a manifest (a device this machine lacks left one, which
    then refused every other profile there)."""
    allocator.setting()  # a bad NORMLAB_MALLOC: one line here, not an error from every worker
    check_jobs(jobs)
    if backend not in ("local", "ray"):
        raise ValueError(f"--backend: expected local or ray; got {backend!r}")
    if backend == "local" and address is not None:
        raise ValueError("--address: only with --backend ray; the local backend uses no cluster")
    if backend == "ray" and jobs is not None:
        raise ValueError("--jobs: only with --backend local; Ray runs as many runs at once as "
                         "its CPUs fit, each taking its train.threads")
    if backend == "local":
        from normlab.train import check_device_flag, pick_device

        # a GPU this machine lacks, for runs still to train: one line now, where every run
        # failed with it in turn (named by the flag the user typed, where it set the device)
        for name in sorted({d for s in specs if (d := _training_device(s, device))}):
            (pick_device if device is None else check_device_flag)(name)


def _training_device(spec: RunSpec, device: str | None) -> str | None:
    """The device a run still to train trains on (`--device`, else its train.device); None
    for a finished run, whose eval and analysis run on the CPU."""
    from normlab.train import DONE

    if (Path(spec.out) / DONE).is_file():
        return None
    return device or spec.config.get("train", {}).get("device", "auto")


def execute(
    specs: list[RunSpec],
    *,
    backend: str = "local",
    jobs: int | None = None,
    device: str | None = None,
    address: str | None = None,
    progress: bool = True,
    on_result: Callable[[dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every spec; returns one result dict per run (ok, did, seconds or error).

    `jobs` is the local pool's, `address` Ray's: given to the other backend, it is refused
    rather than dropped unseen."""
    check_execute(specs, backend=backend, jobs=jobs, device=device, address=address)
    if backend == "ray":
        # absolute: a Ray worker resolves a relative path in its own working folder (a
        # cluster head's), which left the sweep's --out empty and reported every run done
        specs = [replace(s, out=str(Path(s.out).resolve())) for s in specs]
        # Ray says nothing of which tasks run: bars from metrics lines
        return _execute(specs, _Backend(*_ray_backend(device, address, specs), workers=None),
                        progress, on_result)
    workers = max(1, min(jobs or default_jobs(specs), len(specs)))
    with tempfile.TemporaryDirectory(prefix="normlab-sweep-") as marks:
        return _execute(specs, _Pool(workers, device, marks), progress, on_result)


class _Backend:
    """Where runs go: `submit` a run, `wait` for some to finish, `stop` them all."""

    def __init__(self, submit: Callable, wait: Callable, stop: Callable,
                 workers: int | None) -> None:
        self._submit, self.wait, self.stop, self.workers = submit, wait, stop, workers

    def submit(self, spec: RunSpec) -> Any:
        return self._submit(spec)

    def resubmit(self, fut: Any, spec: RunSpec, pending: dict[Any, RunSpec]) -> bool:
        """Whether a finished future's run was queued again instead (see `_Pool`)."""
        return False

    def result(self, fut: Any, spec: RunSpec) -> dict[str, Any]:
        return _result(fut, spec)


class _Pool(_Backend):
    """The local backend, made anew when a worker dies (out of memory): the pool breaks then,
    failing every run in it, and the queued runs, which never began, went down with it; they
    go on in a new pool. The runs that had begun fail (one of them killed the worker), named,
    their checkpoints kept for a rerun."""

    def __init__(self, workers: int, device: str | None, marks: str) -> None:
        super().__init__(*_local_backend(workers, device, marks), workers=workers)
        self.device, self.marks = device, marks
        self.generation = 0
        self.of: dict[Any, tuple[int, RunSpec]] = {}  # future -> its pool's generation, run
        self.goes_on: dict[int, bool] = {}  # a broken generation -> its queued runs go on

    def submit(self, spec: RunSpec) -> Any:
        fut = self._submit(spec)
        self.of[fut] = (self.generation, spec)
        return fut

    def _broke(self, fut: Any) -> bool:
        return fut.done() and isinstance(fut.exception(), BrokenProcessPool)

    def resubmit(self, fut: Any, spec: RunSpec, pending: dict[Any, RunSpec]) -> bool:
        """Whether a broken pool's run was never begun, and so is queued again in the new pool
        made at the first news of the break. A break where no run had begun (a worker that
        dies as it starts) gives up: a new pool would break the same way, forever."""
        if not self._broke(fut) or _began(self.marks, spec):
            return False
        generation = self.of[fut][0]
        if generation not in self.goes_on:  # the first news of this break: decided once
            began = set(os.listdir(self.marks))
            took_down = [s.name for f, (g, s) in self.of.items()
                         if g == generation and s.name in began and self._broke(f)]
            self.goes_on[generation] = bool(took_down) and generation == self.generation
            if self.goes_on[generation]:
                self.generation += 1
                self._submit, self.wait, self.stop = _local_backend(self.workers, self.device,
                                                                    self.marks)
                print(f"normlab: a worker died, ending run(s) {', '.join(took_down)}; the "
                      "queued runs go on in a new pool", file=sys.stderr, flush=True)
        if not self.goes_on[generation]:
            return False
        pending[self.submit(spec)] = spec
        return True

    def result(self, fut: Any, spec: RunSpec) -> dict[str, Any]:
        if self._broke(fut) and not _began(self.marks, spec):  # never began: nothing to resume
            return {"ok": False, "name": spec.name, "error": "BrokenProcessPool: a worker "
                    "process died before this run began (as it started?); rerun to retry"}
        return _result(fut, spec)


def _began(marks: str, spec: RunSpec) -> bool:
    return (Path(marks) / spec.name).exists()


def _execute(specs: list[RunSpec], backend: _Backend, progress: bool,
             on_result: Callable[[dict[str, Any]], None] | None) -> list[dict[str, Any]]:
    pending = {backend.submit(s): s for s in specs}  # in the sweep's order, as dicts keep it
    results: list[dict[str, Any]] = []
    try:
        with _Watch(specs, progress) as watch:
            while pending:
                done = set(backend.wait(list(pending)))
                # in the order submitted: runs queued again go to a new pool in the sweep's
                # order (a set's order started them at random)
                for fut in [f for f in pending if f in done]:
                    spec = pending.pop(fut)
                    if backend.resubmit(fut, spec, pending):
                        continue
                    results.append(res := backend.result(fut, spec))
                    watch.finished(spec, res)
                    if on_result:
                        on_result(res)
                # the pool hands a worker its next run early, so one more future reads as
                # running than runs: at most `workers` bars, the first submitted
                watch.tick([s for f, s in pending.items() if _started(f, s)]
                           [:backend.workers])
    except BaseException:  # Ctrl-C (or SIGTERM, which the command reads as one): the queued
        # runs were all trained to the end before the process exited
        backend.stop(list(pending))
        raise
    return results


def _result(fut: Any, spec: RunSpec) -> dict[str, Any]:
    """A finished run's result; a run whose worker died, named as failed (the other runs go
    on)."""
    try:
        return fut.result() if hasattr(fut, "result") else _ray_get(fut)
    except BrokenProcessPool as err:  # a worker killed (out of memory): the runs in the pool
        # that had begun fail with it, each named in the report, not the study
        return {"ok": False, "name": spec.name, "error": f"BrokenProcessPool: a worker process "
                f"died (out of memory?), ending the runs that had begun ({err}); rerun to "
                "resume it"}
    except Exception as err:  # Ray's WorkerCrashedError, out of memory: a traceback ended the
        # sweep, runs in flight abandoned
        return {"ok": False, "name": spec.name, "error": f"{type(err).__name__}: the run's "
                f"worker died ({first_line(err)}); rerun to retry"}


def _threads(spec: RunSpec) -> int:
    return int(spec.config["train"].get("threads", 1))


def usable_cpus(cgroup_root: Path = Path("/sys/fs/cgroup"),
                proc_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """The CPUs this process may run on: its affinity (taskset, a Slurm or cgroup cpuset), not
    the machine's count, which gave a job of 4 cores out of 64 a pool of 64 workers, capped by
    a cgroup CPU quota (`docker --cpus`, a Kubernetes limit), rounded up, which affinity does
    not show."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform (macOS)
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    return max(1, min(cpus, math.ceil(quota))) if quota is not None else cpus


def cgroup_cpu_quota(root: Path, proc_cgroup: Path) -> float | None:
    """CPUs' worth of time this process's cgroup (or a parent of it) may use, or None if
    unlimited or unknown: cgroup v2's `cpu.max` ("QUOTA PERIOD" or "max PERIOD"), else v1's
    `cpu.cfs_quota_us` / `cpu.cfs_period_us` (quota -1 is unlimited). A container sees its own
    cgroup as the mount's root, so the mount's root is read too."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            mount, files = root, ("cpu.max",)
        elif "cpu" in controllers.split(","):
            mount, files = root / controllers, ("cpu.cfs_quota_us", "cpu.cfs_period_us")
            if not mount.is_dir():
                mount = root / "cpu"
        else:
            continue
        here = mount / path.lstrip("/")
        for d in {mount, here, *(p for p in here.parents if mount in p.parents)}:
            try:
                words = " ".join((d / f).read_text() for f in files).split()
                quota, period = float(words[0]), float(words[1])
            except (OSError, IndexError, ValueError):  # no file here, or "max": no limit
                continue
            if quota > 0 and period > 0:
                limits.append(quota / period)
    return min(limits, default=None)


def default_jobs(specs: list[RunSpec]) -> int:
    """Runs at once without --jobs: as many as the usable CPUs hold the most threads a run
    takes (the fewest was read: runs of 1 and 2 threads on 2 CPUs ran 4 threads at once)."""
    return max(1, usable_cpus() // max((_threads(s) for s in specs), default=1))


def _started(fut: Any, spec: RunSpec) -> bool:
    """Whether a run is under way, for its progress bar (queued runs had bars too): the pool's
    future says so; Ray's does not, so a run counts from its first metrics line."""
    if hasattr(fut, "running"):
        return bool(fut.running())
    return (Path(spec.out) / "metrics.jsonl").is_file()


def _local_backend(jobs: int, device: str | None, marks: str) -> tuple[Callable, Callable,
                                                                        Callable]:
    import concurrent.futures as cf
    import multiprocessing as mp

    pool = cf.ProcessPoolExecutor(max_workers=jobs, mp_context=mp.get_context("spawn"),
                                  initializer=_end_with, initargs=(os.getpid(),))

    def submit(spec: RunSpec) -> cf.Future:
        return pool.submit(_safe_run, spec, device, marks)

    def wait(futs: list[cf.Future]) -> list[cf.Future]:
        done, _ = cf.wait(futs, timeout=2.0, return_when=cf.FIRST_COMPLETED)
        if len(done) == len(futs):
            pool.shutdown(wait=False)
        return list(done)

    def stop(futs: list[cf.Future]) -> None:
        """Drop the queued runs and end the running ones (their checkpoints stay): the pool
        has no call that ends its workers, so they are terminated as processes."""
        workers = list((getattr(pool, "_processes", None) or {}).values())  # gone at shutdown
        pool.shutdown(wait=False, cancel_futures=True)
        for w in workers:
            w.terminate()
        for w in workers:
            w.join(10)

    return submit, wait, stop


def _end_with(parent: int) -> None:
    """A pool worker ends when the sweep's process does: killed (SIGKILL, out of memory), it
    left its workers training, and their run locks refused the rerun. Linux only
    (PR_SET_PDEATHSIG); elsewhere, as before."""
    import ctypes

    # Ctrl-C reaches the whole process group: an interrupted worker took the next queued run
    # before the sweep ended it. The sweep alone decides, and ends its workers itself
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the sweep died before the call took hold
        os._exit(1)


def _ray_backend(device: str | None, address: str | None,
                 specs: list[RunSpec]) -> tuple[Callable, Callable]:
    """One Ray task a run, asking for that run's own `train.threads` CPUs, and a GPU where it
    trains on CUDA (`--device`, else its `train.device`): "cuda", or "auto" on a cluster with
    GPUs (Ray does not hide GPUs from a task that asked for none: "auto" runs would all train
    on the first one, none reserving it). A run no node can hold waited forever without a
    word: refused first on the Ray the sweep starts, said on a cluster's (whose autoscaler
    may still add the node)."""
    try:
        import ray
    except ImportError:
        raise ValueError("--backend ray needs Ray: pip install 'normlab[ray]'") from None
    # a Ray this sweep starts is all there will be; a cluster's (given, in RAY_ADDRESS, or
    # joined by the caller) may grow
    own = address is None and not os.environ.get("RAY_ADDRESS") and not ray.is_initialized()
    if not ray.is_initialized():
        # ray.init takes SIGTERM for its own crash handler: the command's (stop as Ctrl-C
        # does, ending the runs in flight) is put back
        term = signal.getsignal(signal.SIGTERM)
        ray.init(address=address, include_dashboard=False, log_to_driver=False,
                 ignore_reinit_error=True)
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, term)
    remote = ray.remote(_safe_run)
    cuda = ("cuda", "auto") if ray.cluster_resources().get("GPU", 0) > 0 else ("cuda",)

    def gpus(spec: RunSpec) -> int:
        """A GPU for a run still to train on CUDA."""
        return int(_training_device(spec, device) in cuda)

    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive", True)]
    for spec in specs:  # some one node must hold a run's CPUs and GPU together
        need = {"CPU": _threads(spec), "GPU": gpus(spec)}
        if any(all(r.get(k, 0) >= v for k, v in need.items()) for r in nodes):
            continue
        what = f"{need['CPU']} CPUs (train.threads)" + (
            f" and a GPU ({'--device' if device else 'train.device'} "
            f"{_training_device(spec, device)})" if need["GPU"] else "")
        msg = f"run {spec.name}: asks for {what}, which no Ray node has; Ray would wait forever"
        if own:
            raise ValueError(msg)
        print(f"normlab: warning: {msg} unless the cluster adds such a node", file=sys.stderr)
        break

    def submit(spec: RunSpec) -> Any:
        return remote.options(num_cpus=_threads(spec), num_gpus=gpus(spec)).remote(spec, device)

    def wait(refs: list[Any]) -> list[Any]:
        done, _ = ray.wait(refs, num_returns=1, timeout=2.0)
        return done

    def stop(refs: list[Any]) -> None:
        for ref in refs:
            ray.cancel(ref, force=True)

    return submit, wait, stop


def _ray_get(ref: Any) -> dict[str, Any]:
    import ray

    return ray.get(ref)


class _Watch:
    """Runs done / total, plus a bar per running run (read from its metrics.jsonl)."""

    def __init__(self, specs: list[RunSpec], enabled: bool) -> None:
        self.total, self.done = len(specs), 0
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()
        self.bars: dict[str, Any] = {}
        self.progress = None

    def __enter__(self) -> _Watch:
        if self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                     MofNCompleteColumn(), console=Console(stderr=True))
            self.progress.start()
            self.overall = self.progress.add_task("runs", total=self.total)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.progress is not None:
            self.progress.stop()

    def tick(self, running: list[RunSpec]) -> None:
        if self.progress is None:
            return
        for spec in running:
            steps = spec.config["train"]["steps"]
            if spec.name not in self.bars:
                self.bars[spec.name] = self.progress.add_task(f"  {spec.name}", total=steps)
            self.progress.update(self.bars[spec.name], completed=_current_step(spec))

    def finished(self, spec: RunSpec, res: dict[str, Any]) -> None:
        self.done += 1
        msg = (f"run {self.done}/{self.total} {spec.name}: "
               + (f"ok ({', '.join(res['did']) or 'already done'}, {res['seconds']:.0f}s)"
                  if res["ok"] else f"FAILED: {res['error']}"))
        if self.progress is not None:
            self.progress.update(self.overall, completed=self.done)
            if spec.name in self.bars:
                self.progress.remove_task(self.bars.pop(spec.name))
            self.progress.console.print(msg)
        elif self.enabled:
            print(msg, file=sys.stderr, flush=True)


def run_sweep(config: Path, out: Path, *, backend: str = "local", address: str | None = None,
              jobs: int | None = None, device: str | None = None) -> list[dict[str, Any]]:
    """`normlab sweep`: returns the failed runs (empty when all succeeded)."""
    specs = load_sweep(config, check_out_folder(out))
    check_execute(specs, backend=backend, jobs=jobs, device=device, address=address)
    with removed_if_left_empty(Path(out)), FolderLock(SWEEPING) as lock:
        lock.take(Path(out))
        results = execute(specs, backend=backend, jobs=jobs, device=device, address=address)
    failed = [r for r in results if not r["ok"]]
    for r in failed:
        print(f"normlab: run {r['name']} failed: {r['error']}", file=sys.stderr)
    return failed
