"""Checkpoints: tensors in safetensors (never pickle), everything else in a JSON sidecar.

`step_0001000.safetensors` holds model weights (`model/...`) and optimiser moments
(`optim/...`); `step_0001000.json` holds config, step, RNG and stream state, versions and
the SHA-256 of the tensor file. A checkpoint exists once its sidecar does (written last,
atomically), and is only trusted if the hash matches. The two newest are kept.
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from normlab.io import atomic_write_bytes, provenance, write_json

KEEP = 2
SIDECAR_KEYS = ("step", "sha256", "torch_rng")  # what every reader needs (load_checkpoint)


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated, corrupted or of the wrong model."""


def _stem(step: int) -> str:
    return f"step_{step:07d}"


def list_checkpoints(folder: Path) -> list[Path]:
    """Sidecars of complete checkpoints, oldest first: by step, which their names order only
    up to 7 digits (step 10,000,000 sorted before 9,999,999 and was pruned as it was written)."""
    def step(p: Path) -> tuple[int, str]:
        digits = p.stem.removeprefix("step_")
        return (int(digits) if digits.isdigit() else -1, p.name)
    return sorted(Path(folder).glob("step_*.json"), key=step)


def save_checkpoint(
    folder: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    meta: dict[str, Any],
) -> Path:
    """Write one checkpoint atomically and prune all but the newest `KEEP`."""
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
        "provenance": provenance(),
        **meta,
    }
    path = folder / f"{_stem(step)}.json"
    write_json(path, sidecar)
    for old in list_checkpoints(folder)[:-KEEP]:
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
    return tensors, meta


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
    """The newest checkpoint that verifies; a bad newer one is reported and skipped."""
    found = list_checkpoints(Path(folder))
    if not found:
        raise CheckpointError(f"no checkpoint in {str(folder)!r}")
    errors = []
    for side in reversed(found):
        try:
            return load_checkpoint(side)
        except CheckpointError as err:
            errors.append(str(err))
            if warn is not None:
                warn(f"skipping bad checkpoint: {err}")
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
