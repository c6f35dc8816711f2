"""Checkpoints: tensors in safetensors (never pickle), everything else in a JSON sidecar.

`step_0001000.safetensors` holds model weights (`model/...`) and optimiser moments
(`optim/...`); `step_0001000.json` holds config, step, RNG and stream state, versions, the
SHA-256 of the tensor file and one of its own fields (`sidecar_sha256`: a resume reads the data
stream, the RNG and the optimiser's groups from it, and one flipped bit there trained on
silently). A checkpoint exists once its sidecar does (written last, atomically), and is only
trusted if both hashes match and the sidecar's fields are of the types their readers take
(`check_sidecar`; a sidecar from before its hash is checked by type alone). The two newest are
kept.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from normlab.checks import is_fraction, is_int, is_real, is_seconds
from normlab.config import RunConfig
from normlab.io import atomic_write_bytes, jsonable, provenance, write_json

KEEP = 2
SELF_HASH = "sidecar_sha256"
SIDECAR_KEYS = ("step", "sha256", "torch_rng")  # what every reader needs (load_checkpoint)
CPU_RNG_BYTES = torch.get_rng_state().numel()  # what `torch.set_rng_state` takes back
STREAM_KEYS = ("cells", "weights", "bit_generator")  # what `TrainStream.load_state_dict` reads


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, corrupted or of the wrong model."""


def _stem(step: int) -> str:
    return f"step_{step:07d}"


def sidecar_of(folder: Path, step: int) -> Path:
    """The sidecar a checkpoint of `step` in `folder` has (whether or not it exists)."""
    return Path(folder) / f"{_stem(step)}.json"


def is_checkpoint_file(name: str) -> bool:
    """A name `save_checkpoint` writes: `step_<digits>.json` or `.safetensors`."""
    stem, _, ext = name.rpartition(".")
    return ext in ("json", "safetensors") and stem.startswith("step_") and stem[5:].isdigit()


def list_checkpoints(folder: Path) -> list[Path]:
    """Sidecars of complete checkpoints, oldest first: by step, which their names order only
    up to 7 digits (step 10,000,000 sorted before 9,999,999 and was pruned as it was written)."""
    def step(p: Path) -> int:
        return int(p.stem.removeprefix("step_"))
    # only save_checkpoint's names: a user's "step_notes.json" was taken for the oldest
    # checkpoint and pruned, with its .safetensors namesake
    found = (p for p in Path(folder).glob("step_*.json") if is_checkpoint_file(p.name))
    return sorted(found, key=step)


def save_checkpoint(
    folder: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    meta: dict[str, Any],
) -> Path:
    """Write one checkpoint atomically and prune all but the newest `KEEP`, this one always
    among them (an earlier step saved beside later ones was pruned as it was written)."""
    folder = Path(folder)
    tensors = {f"model/{k}": v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    opt_meta = None
    if optimizer is not None:
        sd = optimizer.state_dict()
        for pid, state in sd["state"].items():
            for k, v in state.items():
                tensors[f"optim/{pid}/{k}"] = torch.as_tensor(v).detach().cpu().contiguous()
        opt_meta = {"param_groups": sd["param_groups"]}
    blob = save(tensors)
    atomic_write_bytes(folder / f"{_stem(step)}.safetensors", blob)
    sidecar = {
        "step": step,
        "sha256": hashlib.sha256(blob).hexdigest(),
        "optimizer": opt_meta,
        **rng_state(next(model.parameters()).device),
        # the caller's, where it has one: train takes it once, not two git calls a save
        "provenance": meta["provenance"] if "provenance" in meta else provenance(),
        **meta,
    }
    # hashed as it will read back (tuples as lists, keys as strings)
    sidecar = json.loads(json.dumps(sidecar, default=jsonable))
    sidecar[SELF_HASH] = sidecar_hash(sidecar)
    path = sidecar_of(folder, step)
    write_json(path, sidecar)
    others = [c for c in list_checkpoints(folder) if c != path]
    for old in others[: max(len(others) - (KEEP - 1), 0)]:
        old.with_suffix(".safetensors").unlink(missing_ok=True)
        old.unlink(missing_ok=True)
    return path


def load_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read and verify one checkpoint (path to its .json or .safetensors)."""
    path = Path(path)
    side, tens = path.with_suffix(".json"), path.with_suffix(".safetensors")
    if not side.is_file() or not tens.is_file():
        raise CheckpointError(
            f"checkpoint {str(side.with_suffix(''))!r} is incomplete: "
            "expected both .json and .safetensors"
        )
    try:
        meta = json.loads(side.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(
            f"checkpoint sidecar {str(side)!r} is not valid JSON ({err})"
        ) from None
    missing = [k for k in SIDECAR_KEYS if k not in meta] if isinstance(meta, dict) else None
    if missing is None or missing:  # another program's JSON, or a sidecar cut short
        raise CheckpointError(
            f"checkpoint sidecar {str(side)!r} is not a normlab checkpoint's: expected an "
            f"object with {', '.join(SIDECAR_KEYS)}"
            + (f"; {', '.join(missing)} missing" if missing else "")
        )
    if SELF_HASH in meta and sidecar_hash(meta) != meta[SELF_HASH]:
        raise CheckpointError(
            f"checkpoint sidecar {str(side)!r} is corrupted or was edited "
            f"({SELF_HASH} does not match its fields)"
        )
    blob = tens.read_bytes()
    if hashlib.sha256(blob).hexdigest() != meta.get("sha256"):
        raise CheckpointError(
            f"checkpoint {str(tens)!r} is truncated or corrupted "
            "(SHA-256 does not match its sidecar)"
        )
    try:
        tensors = load(blob)
    except (SafetensorError, ValueError) as err:
        raise CheckpointError(f"checkpoint {str(tens)!r} cannot be read ({err})") from None
    check_sidecar(meta, side, tensors)
    return tensors, meta


def sidecar_hash(meta: dict[str, Any]) -> str:
    """SHA-256 of a sidecar's fields but its own hash, as canonical JSON (sorted keys)."""
    body = {k: v for k, v in meta.items() if k != SELF_HASH}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()


def check_sidecar(meta: dict[str, Any], side: Path, tensors: dict[str, torch.Tensor]) -> None:
    """The sidecar's fields are of the types their readers take (a resume, `load_run`,
    `normlab eval`): behind its own hash, for a sidecar edited past it or written before it, a
    damaged one is one line naming it and the field, and `latest_checkpoint` falls back to the
    previous checkpoint as for bad tensors. Fields absent here are `require`'s to report."""

    def expect(field: str, value: Any, ok: bool, what: str) -> None:
        if not ok:
            shown = json.dumps(value)
            shown = shown if len(shown) <= 40 else shown[:37] + "..."
            raise CheckpointError(f"checkpoint sidecar {str(side)!r}: {field}: expected {what}; "
                                  f"got {shown}")

    step, digits = meta["step"], side.stem.removeprefix("step_")
    expect("step", step, is_int(step) and step >= 0, "a whole number >= 0")
    if digits.isdigit():
        expect("step", step, step == int(digits), f"{int(digits)}, the step in its file name")
    expect("torch_rng", meta["torch_rng"], _decodes(meta["torch_rng"], CPU_RNG_BYTES),
           f"base64 of torch's {CPU_RNG_BYTES}-byte CPU random state")
    if "cuda_rng" in meta:
        expect("cuda_rng", meta["cuda_rng"], _decodes(meta["cuda_rng"]),
               "base64 of a CUDA random state")
    if "config" in meta:
        expect("config", meta["config"], isinstance(meta["config"], dict), "a table")
        try:  # as a resume and `load_run` read it: their error named no file
            RunConfig.from_dict(meta["config"])  # which validates it
        except ValueError as err:
            raise CheckpointError(f"checkpoint sidecar {str(side)!r}: config: {err}") from None
    # their values too: a NaN elapsed_s was written on into the run's own files (which then
    # refused to resume), a best of 5.0 stopped a resumed run early at its first evaluation
    if "elapsed_s" in meta:
        expect("elapsed_s", meta["elapsed_s"], is_seconds(meta["elapsed_s"]),
               "seconds (a finite number >= 0)")
    if "best" in meta:
        expect("best", meta["best"], meta["best"] == -1 or is_fraction(meta["best"]),
               "an accuracy in [0, 1], or -1 (none yet)")
    if "stale" in meta:
        expect("stale", meta["stale"], is_int(meta["stale"]) and meta["stale"] >= 0,
               "a whole number >= 0")
    if "early_stopped" in meta:
        expect("early_stopped", meta["early_stopped"], isinstance(meta["early_stopped"], bool),
               "true or false")
    if "stream" in meta:
        stream = meta["stream"]
        expect("stream", stream, isinstance(stream, dict) and all(k in stream for k in STREAM_KEYS),
               f"a table with {', '.join(STREAM_KEYS)}")
        cells = stream["cells"]
        expect("stream.cells", cells,
               isinstance(cells, list) and all(isinstance(c, str) for c in cells),
               "a list of cell labels")
        expect("stream.bit_generator", stream["bit_generator"],
               _is_generator_state(stream["bit_generator"]), "a numpy PCG64 generator's state")
    # moments in the tensor file need their param_groups here (`optimizer_state`); a
    # checkpoint saved without an optimizer has neither
    opt, moments = meta.get("optimizer"), any(k.startswith("optim/") for k in tensors)
    if opt is not None or moments:
        groups = opt.get("param_groups") if isinstance(opt, dict) else None
        expect("optimizer", opt, isinstance(groups, list) and bool(groups)
               and all(isinstance(g, dict) for g in groups),
               "a table with param_groups, a list of tables"
               + (" (the tensor file holds the optimizer's moments)" if moments else ""))
        for i, group in enumerate(groups):
            at = f"optimizer.param_groups[{i}]"
            params = group.get("params")
            expect(f"{at}.params", params,
                   isinstance(params, list) and all(is_int(p) for p in params),
                   "a list of parameter numbers")
            for key in ("lr", "eps", "weight_decay"):
                expect(f"{at}.{key}", group.get(key), is_real(group.get(key, 0.0)), "a number")
            betas = group.get("betas", [0.0, 0.0])
            expect(f"{at}.betas", betas, isinstance(betas, list) and len(betas) == 2
                   and all(is_real(b) for b in betas), "two numbers")


def _decodes(text: Any, size: int | None = None) -> bool:
    """`text` is a state `_decode` reads, of `size` bytes (of some bytes, without `size`)."""
    try:
        n = _decode(text).numel()
    except (TypeError, ValueError):  # not a string; not base64 (binascii.Error)
        return False
    return n == size if size is not None else n > 0


def _is_generator_state(state: Any) -> bool:
    """What `TrainStream.load_state_dict` sets on its (PCG64) generator: tried on one."""
    try:
        np.random.default_rng(0).bit_generator.state = state
    except (TypeError, ValueError, KeyError, OverflowError):
        return False
    return True


def require(meta: dict[str, Any], keys: tuple[str, ...], folder: Path) -> None:
    """A sidecar must hold what its reader takes from it (`load_run` the config, a resume the
    training state): one line naming the checkpoint, not a KeyError."""
    missing = [k for k in keys if k not in meta]
    if missing:
        raise CheckpointError(f"checkpoint step {meta['step']} in {str(folder)!r} lacks "
                              f"{', '.join(missing)}; expected a normlab training checkpoint")


def latest_checkpoint(
    folder: Path, warn: Any = None
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The newest checkpoint that verifies; a bad newer one is reported (`warn`) and skipped.
    With none left, one error naming the newest one's fault (no warnings before it: the
    command's error is then its one line)."""
    found = list_checkpoints(Path(folder))
    if not found:
        raise CheckpointError(f"no checkpoint in {str(folder)!r}")
    errors = []
    for side in reversed(found):
        try:
            loaded = load_checkpoint(side)
        except CheckpointError as err:
            errors.append(str(err))
            continue
        if warn is not None:
            for err in errors:
                warn(f"skipping bad checkpoint: {err}")
        return loaded
    raise CheckpointError(f"no readable checkpoint in {str(folder)!r}: {errors[0]}")


def model_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k[len("model/") :]: v for k, v in tensors.items() if k.startswith("model/")}


def optimizer_state(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        if k.startswith("optim/"):
            _, pid, name = k.split("/", 2)
            state.setdefault(int(pid), {})[name] = v
    return {"state": state, "param_groups": meta["optimizer"]["param_groups"]}


def _encode(state: torch.Tensor) -> str:
    return base64.b64encode(state.cpu().numpy().tobytes()).decode()


def _decode(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def rng_state(device: torch.device) -> dict[str, str]:
    """The random state a resume restores: torch's CPU generator (`torch_rng`) and, when
    training on a GPU, that device's (`cuda_rng`), which draws the dropout masks there."""
    state = {"torch_rng": _encode(torch.get_rng_state())}
    if device.type == "cuda":
        state["cuda_rng"] = _encode(torch.cuda.get_rng_state(device))
    return state


def restore_rng(meta: dict[str, Any], device: torch.device) -> bool:
    """Set the generators `rng_state` recorded; False when training on a GPU from a
    checkpoint without its state (written on another device, or by an older normlab), where
    dropout masks then differ from an uninterrupted run's."""
    torch.set_rng_state(_decode(meta["torch_rng"]))
    if device.type != "cuda":
        return True
    if "cuda_rng" not in meta:
        return False
    torch.cuda.set_rng_state(_decode(meta["cuda_rng"]), device)
    return True
