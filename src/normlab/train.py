"""Training: AdamW with warm-up and decay, periodic evaluation, safe checkpoints, exact resume.

A run folder holds `config.toml`, `metrics.jsonl`, `checkpoints/`, `tb/` (TensorBoard) and,
after `normlab eval`, `eval.json`. Nothing already written is overwritten unless asked.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from normlab.checkpoint import (
    CheckpointError,
    is_checkpoint_file,
    latest_checkpoint,
    list_checkpoints,
    model_state,
    optimizer_state,
    require,
    restore_rng,
    save_checkpoint,
)
from normlab.checks import first_line, format_bytes, is_int, is_seconds, memory_bytes
from normlab.config import RunConfig, load_config, read_toml
from normlab.evaluate import evaluate, forward_batch
from normlab.io import (
    ANALYSING,
    FolderLock,
    atomic_write_text,
    cannot_write,
    check_out_folder,
    clear_stages,
    provenance,
    read_json,
    read_metrics,
    recorded,
    write_json,
)
from normlab.model import Model, ModelConfig, build_model, native
from normlab.tasks.addition import IGNORE_INDEX, ResolvedTask, TrainStream, eval_sets

DONE = "train_done.json"  # written once training has finished (all steps or early stop)
#: what `DONE` holds, in words and as a test, for the sweep and the report (`io.read_json`)
DONE_RECORD = ('an object with an int "step", where training ended (and its "elapsed_s", '
               'seconds)',
               lambda d: isinstance(d, dict) and is_int(d.get("step"))
               and (d.get("elapsed_s") is None or is_seconds(d["elapsed_s"])))


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. a non-finite loss); the last good checkpoint remains."""


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train.device: 'cuda' requested but no CUDA device is available")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def check_device_flag(device: str) -> None:
    """`--device` (of train, sweep, reproduce) on this machine, refused in one line named by
    the flag the user typed, not the config field it sets."""
    try:
        pick_device(device)
    except ValueError as err:
        raise ValueError(f"--device {device}: "
                         f"{str(err).removeprefix(f'train.device: {device!r} ')}") from None


def lr_at(step: int, cfg: Any) -> float:
    """Linear warm-up, then linear/cosine decay to min_lr_ratio * lr (or constant).

    Step `s` (from 0) warms up at lr * (s + 1) / warmup_steps, so the last warm-up step and the
    first decay step both take lr. Decay reaches min_lr_ratio * lr at step `steps`, one past the
    last step run, as Hugging Face's decaying schedules do (the last step takes slightly more;
    their warm-up starts from 0, this one from lr / warmup_steps).
    """
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    frac = min(max(frac, 0.0), 1.0)
    shape = 1 - frac if cfg.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * frac))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape)


def is_weight_matrix(name: str, p: torch.Tensor) -> bool:
    """normlab's parameters to decay: the weight matrices `W_*` (embeddings, projections,
    unembedding), by name, not by shape: the attention's biases `b_Q`, `b_K`, `b_V` are
    [head, d_head], and were decayed by an `ndim >= 2` rule."""
    return name.rsplit(".", 1)[-1].startswith("W_")


def make_optimizer(model: torch.nn.Module, cfg: Any,
                   decayed: Callable[[str, torch.Tensor], bool] = is_weight_matrix,
                   ) -> torch.optim.AdamW:
    """Weight decay on the weight matrices only (`decayed`, for a model of other names: the
    benchmarks' references); norms, biases and logit scales are not decayed.

    The fused AdamW kernel (CPU and CUDA) updates every tensor in one call: a `qkv` model has
    ~70 parameter tensors, and the per-tensor loop cost ~5% of a small model's step.
    """
    decay: list[torch.Tensor] = []
    rest: list[torch.Tensor] = []
    for n, p in model.named_parameters():
        (decay if decayed(n, p) else rest).append(p)
    params = decay + rest
    fused = all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": rest, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        fused=fused,
        foreach=None if fused else False,
    )


def autocast(precision: str, device: torch.device) -> torch.autocast:
    """The training forward's `train.precision`: with "bfloat16", autocast runs
    its matmuls in bfloat16 (AMX or a GPU's tensor cores); weights, gradients, AdamW, the
    residual stream, the norms and the loss stay float32. Evaluation runs outside it."""
    return torch.autocast(device.type, dtype=torch.bfloat16,
                          enabled=precision == "bfloat16")


CHECK_LOSSES_EVERY = 256
"""The most steps whose losses wait unchecked, when the log and checkpoint steps are further
apart: one read back every 256 steps costs a GPU nothing, and the list stays short."""


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch tensor on `device`, without making the host wait for a GPU: from pinned
    memory the copy is queued behind the steps before it, where one from pageable memory may
    wait for them (CUDA's documented behaviour). Elsewhere a plain `.to`."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def loss_on(model: Model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy on answer tokens only; returns (loss, number of real tokens), both 0-d
    tensors on the batch's device: nothing is read back to the host (`forward_batch`)."""
    logits, targets, n_tok = forward_batch(model, batch)
    loss = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=IGNORE_INDEX
    )
    return loss, n_tok


class Progress:
    """A rich progress bar on a terminal; plain log lines otherwise (logs, CI, pipes)."""

    def __init__(self, total: int, start: int, enabled: bool, label: str) -> None:
        self.tty = enabled and sys.stderr.isatty()
        self.enabled, self.label, self.total = enabled, label, total
        self.bar = None
        if self.tty:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                TextColumn("{task.fields[info]}"),
                transient=False,
                console=Console(stderr=True),  # rich's default is stdout: `> last.json` held it
            )
            self.bar.start()
            self.task = self.bar.add_task(label, total=total, completed=start, info="")

    def update(self, step: int, info: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=step, info=info)
        elif self.enabled:
            print(f"[{self.label}] step {step}/{self.total} {info}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


# What normlab writes in a run folder, by name, folder by folder ("": the run folder itself):
# training (its config, checkpoints, log, record, TensorBoard events), `eval`, `analyze` and a
# sweep's timings. `--force` deletes these and no more, so a folder's other files, another
# tool's config.toml or checkpoints/ too, are kept.
ANALYSIS_FILES = ("norms.json", "norms.png", "collapse.json", "collapse.png",
                  "collapse_rows.npz", "interference.json", "interference.png")
RUN_FILES: dict[str, Callable[[str], bool]] = {
    "": lambda n: n in ("config.toml", "metrics.jsonl", DONE, "eval.json", "heatmap.png",
                        "timings.json"),
    "checkpoints": is_checkpoint_file,
    "tb": lambda n: n.startswith("events.out.tfevents."),
    "analysis": lambda n: n in ANALYSIS_FILES,
}


#: what training writes at the top of a run folder (eval and analyze write the rest)
TRAINING_FILES = ("config.toml", "metrics.jsonl", DONE)
#: the temp file `io.atomic_write_bytes` writes NAME through (tempfile.mkstemp's names)
MKSTEMP = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp")


def _target(name: str) -> str:
    """The file a name stands for: itself, or, for the temp file of an atomic write that a
    kill left (`.NAME.XXXXXXXX.tmp`, io.atomic_write_bytes), NAME."""
    if name.startswith(".") and name.endswith(".tmp"):
        return name[1:-4].rpartition(".")[0]
    return name


def _is_run_config(path: Path) -> bool:
    """A config.toml normlab wrote: its three tables, read as a run config. An empty file or
    another tool's would load as all defaults, or not at all."""
    try:
        if not {"model", "task", "train"} <= read_toml(path, "config file").keys():
            return False
        load_config(path, given=False)
    except (ValueError, OSError):
        return False
    return True


def _written_here(out: Path) -> tuple[list[Path], bool]:
    """The files in `out` that normlab writes, by name (with the temp files of writes a kill
    cut short), and whether they mark a run: its config.toml, a checkpoint, the log or the
    record. A subfolder that is a link is not looked into: its files are not this run's."""
    found: list[Path] = []
    for sub, ours in RUN_FILES.items():
        folder = out / sub
        if sub and (not folder.is_dir() or folder.is_symlink()):
            continue
        found += [p for p in folder.iterdir() if (p.is_file() or p.is_symlink())
                  and ours(_target(p.name)) and (p != out / "config.toml" or _is_run_config(p))]
    # by the file a temp file of normlab's own (mkstemp's 8 random characters) stands for too:
    # a kill while a new run wrote its first config.toml left a folder of that temp file alone,
    # refused by every rerun as no run folder (another tool's ".metrics.jsonl.swp.tmp" marks
    # nothing)
    names = {p: (_target(p.name) if MKSTEMP.fullmatch(p.name) else p.name) for p in found}
    marks = any((p.parent == out and names[p] in TRAINING_FILES)
                or (p.parent.name == "checkpoints" and names[p].endswith(".json"))
                for p in found)
    return sorted(found), marks


def prepare_run_dir(out: Path, *, resume: bool, force: bool,
                    log: Callable[[str], None] = lambda s: None) -> None:
    out = check_out_folder(out)
    has_content = out.exists() and any(out.iterdir())
    ours, marks = _written_here(out) if has_content else ([], False)
    if has_content and not marks:
        # --force deletes a run, --resume writes into it: neither in a folder that holds
        # something else (a mistyped --out, another tool's project); said first, as neither
        # flag is offered for it (both were, and both then refused)
        raise ValueError(
            f"{str(out)!r} holds files but is not a normlab run folder (no run config.toml, "
            f"{DONE}, checkpoint or metrics.jsonl); give --out a new or a run folder"
        )
    if has_content and not (resume or force):
        raise ValueError(
            f"run folder {str(out)!r} already exists; pass --resume to continue it "
            "or --force to start over"
        )
    if has_content:
        _check_run_entries(out)
    if has_content and force and not resume:
        if linked := [out / sub for sub in RUN_FILES if sub and (out / sub).is_symlink()]:
            # its files may be another run's, and the new run would write into them
            raise ValueError(f"--force: {str(linked[0])!r} is a link (to "
                             f"{str(linked[0].readlink())!r}); remove it, or give --out another "
                             "folder")
        if (out / "config.toml").is_file() and out / "config.toml" not in ours:
            raise ValueError(f"{str(out / 'config.toml')!r} is not a normlab run config, and the "
                             "new run's would replace it; move it, or give --out another folder")
        # what normlab wrote, and no more: any config.toml or checkpoints/ marked a folder as
        # a run's, and --force deleted all of it, a thesis beside them too
        # the record of a finished run first, what marks a run folder last: stopped part way,
        # a folder kept train_done.json and lost its checkpoints, and --resume called it done
        with FolderLock(ANALYSING) as analysing:
            if (out / "analysis").is_dir():  # an analysis in progress: refused, nothing deleted
                analysing.take(out / "analysis")
            for p in sorted(ours, key=lambda p: (p.name != DONE, p.name == "config.toml"
                                                 or p.parent.name == "checkpoints")):
                p.unlink()
            clear_stages(out / "analysis")  # a killed analysis's files
        for sub in filter(None, RUN_FILES):
            with contextlib.suppress(OSError):  # kept where it holds something else
                (out / sub).rmdir()
        if kept := sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()):
            shown = ", ".join(kept[:5]) + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")
            log(f"--force: kept what normlab did not write in {str(out)!r}: {shown}")
    out.mkdir(parents=True, exist_ok=True)


def _check_run_entries(out: Path) -> None:
    """The folders training writes into are folders, its log a file: a file named checkpoints
    was found at the first checkpoint step, after training to it, and one named tb as a bare
    "[Errno 17] File exists" (under --force, after the old run was deleted); said first."""
    for name, kind, what in (("checkpoints", "folder", "checkpoints"),
                             ("tb", "folder", "TensorBoard events"),
                             ("metrics.jsonl", "file", "log")):
        p = out / name
        if (p.exists() or p.is_symlink()) and not (p.is_dir() if kind == "folder"
                                                    else p.is_file()):
            raise ValueError(f"{str(p)!r} is not a {kind}; training writes its {what} there: "
                             "move it, or give --out another folder")


def _truncate_metrics(path: Path, step: int) -> dict[str, Any] | None:
    """On resume, drop log lines written after the checkpoint (they will be redone); return
    the record of the checkpoint's step, if one was logged. Read as `read_metrics` reads: a
    last line cut short by the kill is dropped too (it blocked every resume), a damaged
    earlier line is an error naming it."""
    if not path.exists():
        return None
    keep = [rec for rec in read_metrics(path.parent) if rec["step"] <= step]
    atomic_write_text(path, "".join(json.dumps(rec) + "\n" for rec in keep))
    return next((rec for rec in keep if rec["step"] == step), None)


def _warn_schedule(tc: Any, log: Callable[[str], None]) -> None:
    """A schedule that never gets where its settings say: legal (a short smoke run of a long
    recipe), but said once. At warmup_steps = steps - 1 the last step is the first past warm-up,
    at train.lr, so none decays either."""
    head = f"warning: train.warmup_steps = {tc.warmup_steps} of train.steps = {tc.steps}: "
    decays = tc.schedule != "constant"
    if tc.warmup_steps >= tc.steps and tc.warmup_steps > 1:
        log(head + f"the learning rate warms up all run, to {lr_at(tc.steps - 1, tc) / tc.lr:.3g}"
            " x train.lr at the last step" + (", and never decays" if decays else ""))
    elif decays and tc.steps > 1 and tc.warmup_steps >= tc.steps - 1:
        log(head + f"no step decays (train.schedule = {tc.schedule!r}): the last is the first "
            "past warm-up, at train.lr")


_COMPARED = {"device": "device", "torch": "torch", "native": "set of native kernels"}
"""What a resume compares besides the config (`_resumed_under`), as its warning names each."""


def _resumed_under(started: dict[str, Any], meta: dict[str, Any], device: torch.device,
                   log: Callable[[str], None]) -> dict[str, Any]:
    """This segment's provenance, `started`, for a run resumed from the checkpoint `meta`:
    with `segments`, the device, torch and native kernels each part of the run trained under,
    by the step it began from (0, then a checkpoint's), where they changed, and one warning
    where they change now. Outside the config, they decide the numbers too: a resume under
    torch's kernels (no compiler, NORMLAB_NATIVE_*=0) or another torch went on silently to
    other weights, and the record named the last part's alone."""
    was = meta["provenance"] if isinstance(meta.get("provenance"), dict) else {}
    now = {"device": device.type, "torch": torch.__version__, "native": native.describe()}
    segments = was.get("segments")
    if not (isinstance(segments, list) and segments
            and all(isinstance(seg, dict) for seg in segments)):
        # a checkpoint made on a GPU holds its CUDA random state (`checkpoint.rng_state`)
        segments = [{"from_step": 0, "device": "cuda" if "cuda_rng" in meta else "cpu",
                     "torch": was.get("torch"), "native": was.get("native")}]
    last = segments[-1]
    if changed := [k for k in now if last.get(k) is not None and _differs(k, last, now)]:
        k = changed[0]
        log(f"warning: resumed from step {meta['step']} with another {_COMPARED[k]} than its "
            f"checkpoint's ({k}: checkpoint {last[k]!r}, now {now[k]!r}); the weights need not "
            "be bitwise an uninterrupted run's")
        segments = [*segments, {"from_step": meta["step"]} | now]
    return started | {"segments": segments} if len(segments) > 1 else started


def _differs(key: str, was: dict[str, Any], now: dict[str, Any]) -> bool:
    """Whether two parts of a run computed differently by `key`: the native kernels only where
    both ran on the CPU (a GPU's step never calls them), and "off" and "unavailable" alike
    (both are torch's kernels)."""
    if key != "native":
        return was[key] != now[key]
    if "cuda" in (was.get("device"), now["device"]):
        return False
    torchs = [str(d).endswith(native.TORCH_KERNELS) for d in (was[key], now[key])]
    return torchs != [True, True] and was[key] != now[key]


def _check_batch_fits(cfg: RunConfig, task: Any) -> None:
    """Under RoPE or no positions nothing bounded the sequence: a cell of 10**12 operands was
    accepted, then training spent hours writing its first question. One residual stream of a
    batch (float32) is the least a training step keeps; checked where a run trains, not where
    a finished run is read (a smaller machine evaluates it)."""
    need = task.max_seq_len(cfg.model.arch)
    stream = cfg.train.batch_size * need * cfg.model.d_model * 4
    if (limit := memory_bytes()) is not None and stream > limit:
        raise ValueError(
            f"task: its longest sequence, {need:,} tokens, makes one residual stream of a "
            f"batch of {cfg.train.batch_size} ({format_bytes(stream)}) larger than this "
            f"machine's memory ({format_bytes(limit)}) at model.d_model {cfg.model.d_model:,}; "
            "expected shorter problems (the task's cells), a smaller train.batch_size or a "
            "smaller model.d_model")


#: the least one drawn evaluation problem holds in CPython: its list slot and a tuple of two
#: strings (a one-character string is shared, so none of its own may be counted)
EVAL_PROBLEM_BYTES = 8 + 56


def _eval_sets(task: ResolvedTask) -> dict[str, Any]:
    """`eval_sets`, or one line naming task.eval_size where they cannot be held: a huge one
    drew for minutes, then failed as a MemoryError that named no field. Past this machine's
    memory they are refused before any is drawn."""
    cells = sum(len(c) for c in task.eval_splits.values())
    need = task.eval_size * cells * EVAL_PROBLEM_BYTES
    if (limit := memory_bytes()) is not None and need > limit:
        why = (f"they take at least {format_bytes(need)}, more than this machine's memory, "
               f"{format_bytes(limit)}")
    else:
        try:
            return eval_sets(task)
        except (MemoryError, OverflowError) as err:
            why = first_line(err)
    raise ValueError(f"task.eval_size: evaluation sets of {task.eval_size:,} problems a cell in "
                     f"{cells} cells could not be made ({why}); expected a smaller "
                     "task.eval_size")


#: what a second `train` of a run folder is told while the first holds it
TRAINING = ("run folder {out} is being trained by another process (or is a running sweep's or "
            "reproduce's --out); wait for it to end, or give --out another folder")


def train(
    cfg: RunConfig,
    out: Path,
    *,
    resume: bool = False,
    force: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> dict[str, Any]:
    """Train one run into `out`; returns the last metrics record.

    `stop_after` ends the process-equivalent early (after that many steps), used to test
    that a killed run resumes to the same weights. One process at a time trains in a folder.
    """
    with FolderLock(TRAINING) as lock:
        return _train(cfg, Path(out), lock, resume=resume, force=force, progress=progress,
                      stop_after=stop_after, log=log)


def _train(cfg: RunConfig, out: Path, lock: FolderLock, *, resume: bool, force: bool,
           progress: bool, stop_after: int | None, log: Callable[[str], None]) -> dict[str, Any]:
    if resume and force:  # --force was ignored, and a changed config's error then suggested it
        raise ValueError("--resume and --force: give one; --resume continues the run, --force "
                         "deletes it and starts over")
    task = cfg.validate()
    tc = cfg.train
    if resume and (out / DONE).is_file():  # finished before: nothing to redo, if the same run
        check_saved_config(out, cfg)
        done = finished_record(out, log)  # None: damaged, written again by the resume below
        if done is not None:
            if isinstance(done.get("config"), dict):  # checked against what trained, not a file
                _rewrite_edited_config(out, cfg, log, lock)
            return {k: v for k, v in done.items() if k not in ("config", "provenance")}
    # a checkpoint's sidecar, not any JSON file: a stray notes.json made a run killed before
    # its first checkpoint fail with "no checkpoint" rather than start again
    resuming = resume and (out / "checkpoints").is_dir() and bool(list_checkpoints(
        out / "checkpoints"))
    if not resuming:  # a new training; a resumed run keeps the rules it trained under
        cfg.task.check_given()
    resumed_from: dict[str, Any] = {}  # the checkpoint's sidecar, where one is resumed
    _warn_schedule(tc, log)
    _check_batch_fits(cfg, task)
    torch.set_num_threads(tc.threads)
    device = pick_device(tc.device)
    torch.manual_seed(tc.seed)
    model = build_model(cfg.model).to(device)
    opt = make_optimizer(model, tc)
    stream = TrainStream(
        task.train_cells,
        seed=tc.seed,
        batch_size=tc.batch_size,
        arch=cfg.model.arch,
        answer_format=task.answer_format,
        weights=task.train_weights,
        digit_positions=task.digit_positions,
        pack=task.pack,
    )
    start = stream.state_dict()  # one batch drawn and put back: a size too large fails here
    try:
        next(stream)
    except (ValueError, MemoryError, OverflowError) as err:  # numpy's "array is too big"
        raise ValueError(f"train.batch_size: a first batch of {tc.batch_size} problems could "
                         f"not be made ({first_line(err)}); expected a smaller batch, or "
                         "shorter problems (the task's cells)") from None
    stream.load_state_dict(start)
    sets = _eval_sets(task)
    # the folder is touched (with --force: emptied) only now, after everything that can refuse
    # the config (the device, the optimizer's settings, a batch or the evaluation sets too
    # large for memory): a refusal leaves the old run as it was
    config_text = cfg.to_toml()  # a value TOML cannot write: refused by now
    lock.take(out)
    prepare_run_dir(out, resume=resume, force=force, log=log)
    if resume and lock.fd is not None:
        # a kill while a checkpoint was written left its temp file, a whole checkpoint's size:
        # one more at each preemption, until --force; while train_done.json or config.toml was,
        # one left for good. Only under the lock, and only training's own: else they may be a
        # live writer's (an `eval` writes eval.json beside a resumed run)
        for p in _written_here(out)[0]:
            if MKSTEMP.fullmatch(p.name) and (p.parent.name == "checkpoints"
                                              or _target(p.name) in TRAINING_FILES):
                p.unlink()
    step, elapsed, best, stale = 0, 0.0, -1.0, 0
    ckpt_dir, metrics_path = out / "checkpoints", out / "metrics.jsonl"
    last: dict[str, Any] = {"step": step}
    if resuming:
        tensors, meta = latest_checkpoint(ckpt_dir, warn=log)
        require(meta, ("config", "stream", "elapsed_s", "best", "stale", "optimizer"), ckpt_dir)
        _check_same_config(meta["config"], cfg, out)
        load_weights(model, tensors, meta, ckpt_dir)
        settings = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        try:
            opt.load_state_dict(optimizer_state(tensors, meta))
        except ValueError:  # torch's "... doesn't match the size of optimizer's group"
            saved = [len(g["params"]) for g in meta["optimizer"]["param_groups"]]
            now = [len(g["params"]) for g in opt.param_groups]
            raise ValueError(
                f"{str(ckpt_dir)!r}: the optimizer state holds groups of {saved} tensors (decayed, "
                f"not), this model's are {now} (with attn_bias, checkpoints saved before the "
                "attention biases left weight decay); it cannot resume exactly: start again "
                "with --force") from None
        # the config decides weight decay, betas, eps and the flags, as checked above, not the
        # sidecar's copy (an edited one trained on with its own, and passed it on)
        for group, own in zip(opt.param_groups, settings, strict=True):
            group.update(own)
        try:  # a sidecar edited past its own hash: TrainStream's error named no file
            stream.load_state_dict(meta["stream"])
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{str(ckpt_dir)!r}: the newest checkpoint's data-stream state "
                             f"cannot be restored ({type(err).__name__}: {first_line(err)}); "
                             "it cannot resume exactly: start again with --force") from None
        if not restore_rng(meta, device) and cfg.model.dropout > 0:
            log("the checkpoint holds no CUDA random state: dropout masks will differ from an "
                "uninterrupted run's")
        step, elapsed = meta["step"], meta["elapsed_s"]
        best, stale = meta["best"], meta["stale"]
        resumed_from = meta
        # the last record is the checkpoint's own where one was logged: a run killed after
        # its last checkpoint finishes with its numbers, not with the step alone
        last = _truncate_metrics(metrics_path, step) or {"step": step}
        if meta.get("early_stopped"):  # killed after stopping early, before train_done.json
            last["early_stopped"] = True
        log(f"resuming {out} from step {step}")
        # every run folder holds the config it trains with: deleted since, or edited (then the
        # finished run was judged by the edit), it is written again
        _rewrite_edited_config(out, cfg, log, lock)
    else:
        if resume:  # killed before its first checkpoint: it starts again, as the same run
            check_saved_config(out, cfg)
            _truncate_metrics(metrics_path, 0)  # the killed attempt's lines are redone
        atomic_write_text(out / "config.toml", config_text)
    # Compiled for the training step only: evaluation runs other shapes in no-grad mode (each
    # would be one more compile), and checkpoints save `model` itself, so their keys and
    # `load_run` do not depend on this setting. Dynamo's caches are reset first: runs trained
    # one after another in a process (a sweep worker) share them, and past its recompile
    # limit dynamo would silently train the later runs eager.
    if tc.compile:
        torch._dynamo.reset()
    step_model = torch.compile(model) if tc.compile else model
    # resumed: events a killed attempt logged past the checkpoint are purged, as the metrics
    # lines are (TensorBoard would show their steps twice)
    # (killed before its first checkpoint: all of them, since the run starts again)
    writer = _tensorboard(out / "tb", purge_step=step + 1 if resuming else 1 if resume else None)
    # Taken once, now: the code in memory is the code at start, whatever the tree holds later.
    # A resume with no step left (a damaged train_done.json made again) trains nothing here:
    # its record keeps the checkpoint's, the commit the last step trained at
    started = provenance()
    if resuming and (step >= tc.steps or last.get("early_stopped")):
        started = resumed_from.get("provenance", started)
    elif resuming:
        started = _resumed_under(started, resumed_from, device, log)

    def checkpoint(early_stopped: bool = False) -> None:
        # a finite loss can come with a step that left weights non-finite: never save those as
        # "the last good checkpoint" (the next step's loss would only then be NaN)
        if not all(bool(torch.isfinite(p).all()) for p in model.parameters()):
            raise TrainingError(f"weights are not finite after step {step}; stopped, "
                                f"{_kept(ckpt_dir)}")
        meta = {
            "provenance": started,
            "config": cfg.to_dict(),
            "stream": stream.state_dict(),
            # to this step, not to the last log step: a resume adds its own time to it
            "elapsed_s": elapsed + (time.perf_counter() - t0),
            "best": best,
            "stale": stale,
            "early_stopped": early_stopped,  # a resume must not train on past the stop
        }
        # the log's lines to this step reach the disk before the checkpoint does: after a
        # power cut a checkpoint could outlive them, and a resume from it never writes them
        if metrics_path.is_file():
            with metrics_path.open("rb") as f:
                os.fsync(f.fileno())
        save_checkpoint(ckpt_dir, step, model, opt, meta)

    def record(rec: dict[str, Any]) -> None:
        try:
            with metrics_path.open("a") as f:
                f.write(json.dumps(rec) + "\n")
        except OSError as err:  # a full disk said "[Errno 28] No space left", naming no file
            raise cannot_write(metrics_path, err) from err
        if writer is not None:
            for k, v in rec.items():
                if isinstance(v, int | float) and k != "step":
                    writer.add_scalar(k, v, rec["step"])
            for split, acc in rec.get("accuracy", {}).items():
                writer.add_scalar(f"accuracy/{split}", acc, rec["step"])
            writer.flush()

    def check_losses() -> None:
        # The losses since the last check, read back at once: checking each step's loss as it
        # came made a GPU finish every step before the host could queue the next. A non-finite
        # one stops the run here, before anything is logged, evaluated or saved; the weights
        # it left are never saved (`checkpoint` checks them too).
        if not pending:
            return
        bad = (~torch.isfinite(torch.stack(pending))).nonzero()
        if len(bad):
            i = int(bad[0, 0])
            raise TrainingError(f"loss is {pending[i].item()} at step {step - len(pending) + i + 1}"
                                f"; stopped, {_kept(ckpt_dir)}")
        pending.clear()

    bar = Progress(tc.steps, step, progress, out.name)
    pending: list[torch.Tensor] = []  # this step's and earlier losses not checked yet
    tok_count: int | torch.Tensor = 0
    t0 = time.perf_counter()
    end = tc.steps if stop_after is None else min(tc.steps, stop_after)
    try:
        model.train()
        while step < end and not last.get("early_stopped"):
            lr = lr_at(step, tc)
            for group in opt.param_groups:
                group["lr"] = lr
            batch = {k: to_device(v, device) for k, v in next(stream).items()}
            with autocast(tc.precision, device):
                loss, n_tok = loss_on(step_model, batch)
            pending.append(loss.detach())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if tc.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
            opt.step()
            step += 1
            tok_count += n_tok
            # an evaluation step is logged too: nested in the log steps, evaluations at steps
            # that were not log steps were skipped
            evaluate_now = step % tc.eval_every == 0 or step == tc.steps
            # not at a `stop_after` step: a killed run logs nothing there either, and such a
            # record at a checkpoint step outlived the resume
            log_now = step % tc.log_every == 0 or step == tc.steps or evaluate_now
            checkpoint_now = step % tc.checkpoint_every == 0 or step == tc.steps
            if log_now or checkpoint_now or len(pending) >= CHECK_LOSSES_EVERY:
                check_losses()
            if log_now:
                # the clock read after the read-backs, which wait for every step a GPU still
                # has queued: read before them, that wait was never counted (elapsed_s short,
                # tokens_per_s high on CUDA)
                tokens, loss_now = int(tok_count), loss.item()
                now = time.perf_counter()
                elapsed_now = elapsed + (now - t0)
                tps = tokens / max(now - t0, 1e-9)
                last = {
                    "step": step,
                    "loss": loss_now,
                    "lr": lr,
                    "tokens_per_s": tps,
                    "elapsed_s": elapsed_now,
                }
                if evaluate_now:
                    model.eval()
                    res = evaluate(model, task, sets, limit=tc.eval_examples)
                    model.train()
                    last["accuracy"] = {s: r["accuracy"] for s, r in res["splits"].items()}
                    score = last["accuracy"].get(tc.early_stop_split, -1.0)
                    best, stale = (score, 0) if score > best else (best, stale + 1)
                record(last)
                acc = last.get("accuracy", {}).get(tc.early_stop_split)
                info = f"loss {last['loss']:.3f} | {tps:,.0f} tok/s" + (
                    f" | {tc.early_stop_split} acc {acc:.3f}" if acc is not None else ""
                )
                bar.update(step, info)
                elapsed, tok_count, t0 = elapsed_now, 0, time.perf_counter()
            stop = (  # not at the last step: the run trained its whole budget, no early stop
                step < tc.steps
                and "accuracy" in last
                and last["step"] == step
                and (best >= tc.early_stop_accuracy or (tc.patience and stale >= tc.patience))
            )
            # one checkpoint at a stop, whether or not the step had one, saying it stopped
            if checkpoint_now or stop:
                c0 = time.perf_counter()
                checkpoint(early_stopped=bool(stop))
                t0 += time.perf_counter() - c0  # writing is no training time (elapsed_s, tok/s)
            if stop:
                log(f"early stop at step {step}: {tc.early_stop_split} accuracy {best:.4f}")
                last["early_stopped"] = True
                break
    finally:
        bar.close()
        if writer is not None:
            writer.close()
    if step >= tc.steps or last.get("early_stopped"):
        # the record of the finish, its config (seed included), and the versions and commit
        # this segment started from (as its checkpoints record them: the code in memory,
        # whatever the tree holds now)
        write_json(out / DONE, last | {"config": cfg.to_dict(), "provenance": started})
    return last


#: The train settings that say where a run runs, not what it trains: a resume may change them.
RUNS_ON = ("device", "compile")

RESUME_REMEDY = ("--resume", "use the same config, or start over in another folder "
                 "(normlab train: --force)")
"""Who finds a changed config, and what to do about it, as `normlab train --resume` says it."""


def finished_record(out: Path, log: Callable[[str], None]) -> dict[str, Any] | None:
    """`out`'s train_done.json as the sweep reads it; None where it has none, or
    where it is damaged and a checkpoint can make it again (a resume from the last checkpoint
    writes it, training no step: said to `log` as a warning). A damaged record was refused on
    every rerun, whose error advised the rerun. With no checkpoint (a copied result folder) a
    resume would train the run anew: one line naming the file instead."""
    path = Path(out) / DONE
    if not path.is_file():
        return None
    try:
        return read_json(path, *DONE_RECORD)
    except ValueError as err:
        if not list_checkpoints(Path(out) / "checkpoints"):
            raise ValueError(f"{first_line(err)}; no checkpoint to make it again from: restore "
                             "it from a copy") from None
        log(f"warning: {first_line(err)}; made again from the last checkpoint")
        return None


def check_saved_config(out: Path, cfg: RunConfig,
                       remedy: tuple[str, str] = RESUME_REMEDY) -> None:
    """A run folder's config (`trained_config`), where it has one, must be `cfg`'s (up to where
    and how it runs): a finished run is taken as done, or a killed one restarted, only as
    itself. `remedy` (who, what to do) words the error for the command the user ran."""
    saved = trained_config(out)
    if saved is not None:
        _check_same_config(saved, cfg, Path(out), remedy)


def trained_config(out: Path) -> dict[str, Any] | None:
    """The config of the run in `out`: the one its train_done.json records (what trained: an
    edited config.toml made the true config refused and one never trained accepted), else its
    config.toml's; None where it has neither. A damaged record is passed over (the run's own
    path names it, not every run of a reproduce); a damaged config.toml is one line naming it."""
    trained = recorded(Path(out) / DONE, "config")
    if isinstance(trained, dict):
        return trained
    path = Path(out) / "config.toml"
    if not path.is_file():
        return None
    try:
        return load_config(path, given=False).to_dict()
    except ValueError as err:  # a damaged run folder, not the user's --config: name it
        msg = str(err)
        raise ValueError(msg if str(path) in msg else f"{str(path)!r}: {msg}") from None


def _rewrite_edited_config(out: Path, cfg: RunConfig, log: Callable[[str], None],
                           lock: FolderLock) -> None:
    """A resumed or finished run's config.toml made `cfg` again (the checkpoint's or
    train_done.json's config, as checked) where it was deleted, damaged or edited: an edited one
    went on judging the finished run, its true config refused and one never trained taken."""
    path = out / "config.toml"
    try:
        diff = (_config_diff(load_config(path, given=False).to_dict(), cfg) if path.is_file()
                else None)
    except ValueError as err:  # damaged: written again, as a missing one is
        diff = first_line(err)
    if not diff and path.is_file():
        return
    try:  # only to write: a finished run on a read-only disk still reads as done
        lock.take(out)
        atomic_write_text(path, cfg.to_toml())
        failed = None
    except (ValueError, OSError) as err:
        failed = first_line(err)
    if diff or failed:
        what = (f"is not the config this run trained with ({diff})" if diff
                else "is a folder" if path.is_dir() else "is missing")
        done = "written again" if failed is None else f"could not be written again: {failed}"
        log(f"warning: {str(path)!r} {what}; {done}")


def load_weights(model: Model, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                 folder: Path) -> None:
    """A checkpoint's weights into the model its config builds; one line naming the
    checkpoint where they do not fit (tensors of another model)."""
    try:
        model.load_state_dict(model_state(tensors))
    except RuntimeError as err:
        first = str(err).splitlines()[1:2] or [str(err)]
        raise CheckpointError(
            f"checkpoint step {meta['step']} in {str(folder)!r} does not fit the model its "
            f"config builds ({first[0].strip()})"
        ) from None


def _check_same_config(saved: dict[str, Any], cfg: RunConfig, out: Path,
                       remedy: tuple[str, str] = RESUME_REMEDY) -> None:
    """Resuming (or finding finished) the run in `out` needs the config it was made with; the
    error names the fields that differ (of some 60, set by a file, `--set` or a sweep)."""
    if diff := _config_diff(saved, cfg):
        who, what = remedy
        raise ValueError(f"{who}: the config differs from the one saved in {str(out)!r} "
                         f"({diff}); {what}")


def _config_diff(saved: dict[str, Any], cfg: RunConfig,
                 words: tuple[str, str] = ("saved", "given")) -> str | None:
    """The fields in which `cfg` differs from `saved`, the first with both values (named by
    `words`); None if none does (up to where and how it runs)."""
    was, now = _comparable(saved), _comparable(cfg.to_dict())
    if was == now:
        return None
    keys = [(t, k) for t in sorted(was.keys() | now.keys())
            for k in sorted(was.get(t, {}).keys() | now.get(t, {}).keys())
            if was.get(t, {}).get(k) != now.get(t, {}).get(k)]
    # a size that followed another (d_head a changed d_model) after the one a user set
    changed = {k for t, k in keys if t == "model"}
    keys.sort(key=lambda tk: tk[0] == "model" and bool(
        changed & set(ModelConfig.DERIVED.get(tk[1], ()))))
    (t, k), more = keys[0], [f"{t}.{k}" for t, k in keys[1:]]
    diff = (f"{t}.{k}: {words[0]} {was.get(t, {}).get(k)!r}, "
            f"{words[1]} {now.get(t, {}).get(k)!r}")
    if more:
        diff += f"; {len(more)} more: {', '.join(more[:3])}{', ...' if more[3:] else ''}"
    return diff


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    """A config minus settings that may change across a resume (where and how it runs).

    Round-tripped through `RunConfig`, so a checkpoint written before an option existed
    compares equal to the same config with that option at its default.
    """
    # JSON's view: a config built in Python with tuples equals the lists read back from TOML
    config = json.loads(json.dumps(RunConfig.from_dict(config).to_dict()))
    return {**config, "train": {k: v for k, v in config["train"].items() if k not in RUNS_ON}}


def _tensorboard(path: Path, purge_step: int | None = None) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is a dependency, but keep training without it
        return None
    return SummaryWriter(str(path), purge_step=purge_step)


def _kept(ckpt_dir: Path) -> str:
    """What a stopped run leaves to resume from, for its error message."""
    if list_checkpoints(ckpt_dir):
        return f"the last good checkpoint in {str(ckpt_dir)!r} is kept"
    return "no checkpoint was written before"


def load_run(run_dir: Path, device: str = "cpu",
             warn: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
             ) -> tuple[RunConfig, Model, dict[str, Any]]:
    """The config and newest good model of a run folder (weights only, never unpickled).

    The config is the checkpoint's, the one its weights trained with: a run folder's
    config.toml edited since (to evaluate another `task.eval_size`) was ignored unsaid, and
    is now named in a warning (`warn`)."""
    run_dir = check_run_folder(run_dir)
    tensors, meta = latest_checkpoint(run_dir / "checkpoints", warn=warn)
    require(meta, ("config",), run_dir / "checkpoints")
    cfg = RunConfig.from_dict(meta["config"])
    # another run's checkpoints (copied in by hand) were evaluated as this run's, which its
    # train_done.json still named. Only that record says what trained (a config.toml may be
    # edited, or damaged, and a resume writes it again from the checkpoint), and its config is
    # the one the final checkpoint was saved with
    saved = recorded(run_dir / DONE, "config")
    if isinstance(saved, dict) and (diff := _config_diff(saved, cfg,
                                                        ("the run's", "its checkpoint's"))):
        raise CheckpointError(f"checkpoint step {meta.get('step')} in "
                              f"{str(run_dir / 'checkpoints')!r} was made under another config "
                              f"than the run folder records ({diff}); expected the run's own "
                              "checkpoints")
    path = run_dir / "config.toml"
    try:
        edited = _config_diff(load_config(path, given=False).to_dict(), cfg,
                              ("config.toml", "checkpoint"))
    except (ValueError, OSError) as err:  # missing: a resume writes it again; else named
        edited = None if not path.exists() else first_line(err)
    if edited:
        warn(f"warning: {str(path)!r} is not the config this run trained with ({edited}); the "
             "checkpoint's is used")
    model = build_model(cfg.model)
    load_weights(model, tensors, meta, run_dir / "checkpoints")
    return cfg, model.to(device).eval(), meta


def check_run_folder(run_dir: Path) -> Path:
    """`run_dir` as a run folder to read (one holding checkpoints/), or one line saying what it
    is instead; before anything is loaded or written beside it."""
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ValueError(f"run folder {str(run_dir)!r} does not exist")
    if run_dir.name == "checkpoints" and (run_dir.parent / "config.toml").is_file():
        raise ValueError(f"{str(run_dir)!r} is a run's checkpoints/ folder; expected the run "
                         f"folder {str(run_dir.parent)!r}")
    if not run_dir.is_dir():
        raise ValueError(f"{str(run_dir)!r} is a file; expected a run folder")
    if not (run_dir / "checkpoints").is_dir():
        raise ValueError(f"{str(run_dir)!r} is not a normlab run folder (no checkpoints/)")
    return run_dir


__all__ = ["TrainingError", "load_run", "lr_at", "provenance", "train"]
