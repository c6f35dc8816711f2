"""Run configs: TOML files validated into typed dataclasses, with `--set key=value` overrides.

A run config has three tables, `[model]` (`ModelConfig`), `[task]` (`TaskConfig`) and
`[train]` (`TrainConfig`). Every error is one line naming the key.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from normlab.checks import (
    check_int,
    check_real,
    check_seed,
    check_threads,
    did_you_mean,
    is_real,
)
from normlab.model.config import ModelConfig
from normlab.tasks.addition import VOCAB_SIZE, ResolvedTask, TaskConfig

SCHEDULES = ("linear", "cosine", "constant")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("float32", "bfloat16")  # float16 would need loss scaling; not offered


@dataclass
class TrainConfig:
    """Optimisation and bookkeeping. AdamW; warm-up then decay to `min_lr_ratio * lr`."""

    seed: int = 0
    steps: int = 6000
    batch_size: int = 128
    lr: float = 1e-3
    min_lr_ratio: float = 0.0
    warmup_steps: int = 200
    schedule: str = "linear"
    weight_decay: float = 0.02
    beta1: float = 0.9
    beta2: float = 0.98
    grad_clip: float = 1.0  # the gradients' global norm at most this (0: no clipping)
    eval_every: int = 500
    eval_examples: int = 128  # per cell, for the periodic evaluation during training
    checkpoint_every: int = 500
    log_every: int = 50
    early_stop_split: str = "train"
    early_stop_accuracy: float = 1.01  # stop once this split reaches it (> 1: never)
    patience: int = 0  # stop after this many evaluations without improvement (0: never)
    threads: int = 1
    device: str = "auto"
    compile: bool = False  # torch.compile the training forward/backward (evaluation stays eager)
    # the training forward's matmuls in bfloat16 (autocast; weights, optimiser, norms float32)
    precision: str = "float32"

    def validate(self) -> None:
        """One-line errors naming the field, for configs made in Python as for files (a file's
        types are checked first, by `typed`): `steps = 2.5` trained 3 steps with no final
        evaluation, and a string `lr` failed inside a comparison naming nothing."""
        big = 2**63  # what config.toml can hold
        for name in ("steps", "batch_size", "eval_every", "eval_examples", "checkpoint_every",
                     "log_every"):
            setattr(self, name, check_int(getattr(self, name), f"train.{name}", low=1,
                                          high=big, what="a positive integer below 2**63"))
        for name in ("warmup_steps", "patience"):
            setattr(self, name, check_int(getattr(self, name), f"train.{name}", high=big,
                                          what="an int in [0, 2**63)"))
        self.seed = check_seed(self.seed, "train.seed")
        self.threads = check_threads(self.threads, "train.threads")
        # finite and in range here, where the field is named, not in torch's AdamW
        self.lr = check_real(self.lr, "train.lr", what="a positive finite number",
                             ok=lambda v: v > 0)
        for name in ("beta1", "beta2"):
            setattr(self, name, check_real(getattr(self, name), f"train.{name}",
                                           what="a number in [0, 1)", ok=lambda v: 0 <= v < 1))
        self.min_lr_ratio = check_real(self.min_lr_ratio, "train.min_lr_ratio",
                                       what="a number in [0, 1]", ok=lambda v: 0 <= v <= 1)
        for name in ("weight_decay", "grad_clip"):
            setattr(self, name, check_real(getattr(self, name), f"train.{name}",
                                           what="a finite number >= 0", ok=lambda v: v >= 0))
        for name, allowed in (("schedule", SCHEDULES), ("device", DEVICES),
                              ("precision", PRECISIONS)):
            value = getattr(self, name)
            if not isinstance(value, str) or value not in allowed:
                raise ValueError(f"train.{name}: expected one of {', '.join(allowed)}; got "
                                 f"{value!r}")
        if not isinstance(self.compile, bool):
            raise ValueError(f"train.compile: expected true or false; got {self.compile!r}")
        if not isinstance(self.early_stop_split, str):  # a split name, checked by RunConfig
            raise ValueError(f"train.early_stop_split: expected a split name; got "
                             f"{self.early_stop_split!r}")
        # NaN: early stopping never fired; inf is allowed (never stop)
        try:
            acc = float(self.early_stop_accuracy) if is_real(self.early_stop_accuracy) else -1.0
        except OverflowError:  # an int past float's range: above 1 all the same
            acc = math.inf
        if not 0 <= acc <= math.inf:
            raise ValueError(f"train.early_stop_accuracy: expected a number >= 0 (above 1: "
                             f"never stop); got {self.early_stop_accuracy!r}")
        self.early_stop_accuracy = acc


def _type_ok(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    if origin is list or hint is list:
        return isinstance(value, list)
    if origin is dict or hint is dict:
        return isinstance(value, dict)
    return True


def typed(cls: type, table: Any, where: str) -> Any:
    """Build dataclass `cls` from a TOML table: unknown keys and wrong types are errors."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a table; got {type(table).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in table.items():
        if key not in hints:
            raise ValueError(f"{where}.{key}: unknown key{did_you_mean(key, names)}; expected "
                             f"one of {', '.join(names)}")
        if not _type_ok(value, hints[key]):
            want = getattr(hints[key], "__name__", str(hints[key]))
            raise ValueError(
                f"{where}.{key}: expected {want}; got {type(value).__name__} {value!r}"
            )
    values = {k: (_as_float(v) if hints[k] is float else v) for k, v in table.items()}
    return cls(**values)


def _as_float(v: int | float) -> float:
    """A TOML number as a float; an integer past float's range as infinity of its sign, which
    each field's check then refuses by name, where float() raised an OverflowError naming no
    field."""
    try:
        return float(v)
    except OverflowError:
        return math.inf if v > 0 else -math.inf


def _fits_toml(value: Any) -> bool:
    """Every integer in `value` (lists and tables included) is a TOML (64-bit) integer."""
    if isinstance(value, int):
        return -(2**63) <= value < 2**63
    if isinstance(value, list | tuple):
        return all(_fits_toml(v) for v in value)
    if isinstance(value, dict):
        return all(_fits_toml(v) for v in value.values())
    return True


@dataclass
class RunConfig:
    """One training run: what model, which task, how to train."""

    model: ModelConfig = field(default_factory=ModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        for key in data:
            if key not in ("model", "task", "train"):
                raise ValueError(f"config.{key}: unknown table"
                                 f"{did_you_mean(key, ('model', 'task', 'train'))}; expected "
                                 "model, task or train")
        model = typed(ModelConfig, data.get("model", {}), "model")
        task = typed(TaskConfig, data.get("task", {}), "task")
        train = typed(TrainConfig, data.get("train", {}), "train")
        cfg = cls(model, task, train)
        cfg.validate()
        for name in ("model", "task", "train"):  # after the fields' own range checks
            for key, value in data.get(name, {}).items():
                if not _fits_toml(value):  # config.toml could not hold it; numpy overflowed
                    raise ValueError(f"{name}.{key}: expected integers in [-2**63, 2**63), "
                                     f"which TOML holds; got {value!r}")
        return cfg

    def validate(self) -> ResolvedTask:
        self.model.validate()
        self.train.validate()
        task = self.task.resolve()
        if self.model.vocab_size != VOCAB_SIZE:
            raise ValueError(
                f"model.vocab_size: expected {VOCAB_SIZE} for the addition task; "
                f"got {self.model.vocab_size}"
            )
        if task.digit_positions:
            # the places of the questions' digits and of the longest answer's; a generated
            # digit past them is fed back at the last place (`greedy_decode`)
            places = max(task.max_lengths()[1], max(max(c.digits) for c in task.all_cells)) + 1
            if self.model.n_aux_positions < places:
                raise ValueError(f"model.n_aux_positions: expected >= {places} for "
                                 f"task.digit_positions; got {self.model.n_aux_positions}")
        elif self.model.n_aux_positions:
            raise ValueError("model.n_aux_positions: set, but task.digit_positions is false; "
                             "the task would supply no aux positions")
        if task.pack and self.model.arch != "decoder":
            raise ValueError(f"task.pack: needs model.arch = 'decoder'; got {self.model.arch!r}")
        need = task.max_seq_len(self.model.arch)
        if self.model.position_table and self.model.max_len < need:
            raise ValueError(
                f"model.max_len: expected >= {need} for this task's longest "
                f"sequence; got {self.model.max_len}"
            )
        if self.train.early_stop_split not in task.eval_splits:  # a typo scored -1 at every eval
            raise ValueError(
                f"train.early_stop_split: expected one of {', '.join(task.eval_splits)}; "
                f"got {self.train.early_stop_split!r}"
            )
        return task

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": dataclasses.asdict(self.model),
            "task": dataclasses.asdict(self.task),
            "train": dataclasses.asdict(self.train),
        }

    def to_toml(self) -> str:
        """The config as a run folder's config.toml: a size `ModelConfig` derives (`DERIVED`)
        is left out where it equals what its sources derive. Pinned, `--set model.n_heads=4` on
        a run's file kept its d_head and n_kv_heads (grouped-query attention, where the same
        override on a recipe setting neither gave 4 heads of d_model / 4). A size that cannot
        be derived (d_model not a multiple of n_heads) is kept."""
        data = self.to_dict()
        for name in ModelConfig.DERIVED:
            try:
                derived = getattr(dataclasses.replace(self.model, **{name: None}), name)
            except ValueError:  # set where deriving it would fail: the config needs it
                continue
            if derived == data["model"][name]:
                del data["model"][name]
        return dump_toml(data)


def config_key(key: str, where: str) -> list[str]:
    """`model.d_model` -> ['model', 'd_model']; anything else is one line naming `where` (the
    flag, or the sweep file's key: the same rule for both)."""
    path = key.strip().split(".")
    if len(path) != 2:
        raise ValueError(f"{where}: expected TABLE.KEY, e.g. train.lr")
    return path


def parse_override(item: str) -> tuple[list[str], Any]:
    """`model.d_model=128` -> (['model', 'd_model'], 128); values are TOML literals."""
    if "=" not in item:
        raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. model.d_model=128")
    key, raw = item.split("=", 1)
    path = config_key(key, f"--set {key!r}")
    try:
        doc = tomllib.loads(f"v = {raw}")
    except tomllib.TOMLDecodeError:
        # a bare word is a string: --set model.norm_placement=qkv (or "= qkv", spaced)
        return path, raw.strip()
    except RecursionError:  # tomllib's, past ~900 nested levels: "maximum recursion depth"
        raise ValueError(f"--set {key!r}: expected a TOML value; this one is nested too "
                         "deeply to read") from None
    if set(doc) != {"v"}:  # "3\nlr = 5.0": what followed the newline was dropped unseen
        raise ValueError(f"--set {key!r}: expected one TOML value after '='; got {raw!r}")
    return path, doc["v"]


def read_toml(path: Path, what: str) -> dict[str, Any]:
    """A TOML file's tables, or one line naming `what` and the file: missing, a folder, not
    UTF-8 (a ValueError naming no file), starting with a byte-order mark (tomllib's "Invalid
    statement (at line 1, column 1)" named nothing one could see), not TOML, or nested past
    what tomllib reads (its RecursionError said only "maximum recursion depth exceeded")."""
    where = f"{what} {str(path)!r}"
    if not path.is_file():
        raise ValueError(where + (" is a folder; expected a TOML file" if path.is_dir()
                                  else " not found"))
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{where}: not UTF-8 text, as TOML is ({err})") from None
    if text.startswith("\ufeff"):
        raise ValueError(f"{where}: starts with a byte-order mark (BOM); save it as UTF-8 "
                         "without one")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{where}: invalid TOML ({err})") from None
    except RecursionError:
        raise ValueError(f"{where}: invalid TOML (nested too deeply to read)") from None


def load_config(
    path: str | Path | None, overrides: list[str] = (), seed: int | None = None,
    set_by: str | None = "--set", given: bool = True,
) -> RunConfig:
    """Read a TOML run config (None: all defaults), apply overrides and an optional seed.

    An error is one line led by where the bad field came from: `set_by` (the flag; None where
    the caller names the source, as a sweep does) for a field an override set, `--seed` for the
    seed, else the file (`config file PATH:`, "with --set" where overrides were given, as an
    error naming two fields may be either's), so `train.steps: expected int` says whether the
    file or the flag is wrong. `given=False` reads a config a run folder stored, without the
    rules only a config given now keeps (`TaskConfig.check_given`).
    """
    data: dict[str, Any] = read_toml(Path(path), "config file") if path is not None else {}
    where = f"config file {str(path)!r}" if path is not None else ""

    def table(name: str) -> dict[str, Any]:
        if not isinstance(data.setdefault(name, {}), dict):  # `model = 5` in the file
            raise ValueError(f"{where}: {name}: expected a table; got {data[name]!r}")
        return data[name]

    given: dict[str, str] = {}  # field -> the source that set it last
    for item in overrides:
        (name, key), value = parse_override(item)
        table(name)[key] = value
        given[f"{name}.{key}"] = f"{set_by} " if set_by else ""
    if seed is not None:
        table("train")["seed"] = seed
        given["train.seed"] = "--seed "
    try:
        cfg = RunConfig.from_dict(data)
        if given:  # the rules a config given now keeps, past a stored one's
            cfg.task.check_given()
        return cfg
    except ValueError as err:
        # named as the file's tables name them (ModelConfig's own checks say "ModelConfig.")
        msg = "model." + str(err).removeprefix("ModelConfig.") if str(err).startswith(
            "ModelConfig.") else str(err)
        field = msg.split(":", 1)[0]
        # a part of a field set by an override is the override's too (task.train[1]); an
        # unknown table (`config.trian`) is the override's that named it, not the file's
        lead = next((src for g, src in given.items()
                     if field == g or field.startswith((g + ".", g + "["))
                     or field == "config." + g.split(".")[0]), None)
        if lead is None:
            with_set = " with --set" if set_by and overrides else ""
            lead = f"{where}{with_set}: " if where else ""
        raise ValueError(f"{lead}{msg}") from None


def dump_toml(data: dict[str, Any]) -> str:
    """Minimal TOML writer for our flat tables (None values are omitted)."""
    import tomli_w

    def clean(d: dict[str, Any]) -> dict[str, Any]:
        return {k: (clean(v) if isinstance(v, dict) else v) for k, v in d.items() if v is not None}

    return tomli_w.dumps(clean(data))
