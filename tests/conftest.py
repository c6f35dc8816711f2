"""Shared test settings: deterministic, single-threaded torch (the CI machine has 2 cores)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


torch.set_num_threads(1)
