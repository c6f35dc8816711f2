"""Shared test settings: deterministic, single-threaded torch (the CI machine has 2 cores)."""

from typing import Protocol

import pytest
import torch
import torch.nn.functional as F

from normlab.model import attention, native

#: A run small enough to train in about a second: `load_config(None, [*TINY_RUN, ...])`.
TINY_RUN = [
    "task.grid='smoke'",
    "model.d_model=32",
    "model.n_layers=1",
    "model.n_heads=2",
    "model.d_mlp=64",
    "train.batch_size=32",
    "train.warmup_steps=5",
    "train.log_every=5",
    "train.eval_examples=16",
    "task.eval_size=32",
]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


torch.set_num_threads(1)


@pytest.fixture
def attention_calls(monkeypatch: pytest.MonkeyPatch) -> tuple[list[int], list[int]]:
    """Calls of normlab's attention kernel (`native.attention`) and of SDPA, one entry a call,
    in the two lists returned, counted for the test's length while both still compute: which
    path a model's attention took."""
    kernel: list[int] = []
    sdpa: list[int] = []
    ours, theirs = native.attention, F.scaled_dot_product_attention
    monkeypatch.setattr(native, "attention", lambda *a: kernel.append(1) or ours(*a))
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda *a, **k: sdpa.append(1) or theirs(*a, **k))
    return kernel, sdpa


class SdpaPast(Protocol):
    def __call__(self, n_keys: int | None = None) -> None: ...


@pytest.fixture
def sdpa_past(monkeypatch: pytest.MonkeyPatch) -> SdpaPast:
    """`sdpa_past(n)`: for the rest of the test, rows of more than n keys take SDPA where no
    hook reads them, causal ones too (no `KERNEL_BOUNDS_CPU`); n becomes
    `EXPLICIT_MAX_KEYS_CPU` (0: every row; None leaves it as it is). The one way tests force
    torch's fused path."""

    def force(n_keys: int | None = None) -> None:
        if n_keys is not None:
            monkeypatch.setattr(attention, "EXPLICIT_MAX_KEYS_CPU", n_keys)
        monkeypatch.setattr(attention, "KERNEL_BOUNDS_CPU", ())

    return force
