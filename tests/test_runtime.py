"""`normlab.runtime.tune_malloc`: freed memory is reused (the kernel's page-fault counter is
the independent truth), the opt-out works, and a bad setting is a one-line error."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from normlab import cli
from normlab.runtime import ENV, tune_malloc

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

FAULTS = """
import resource, torch
from normlab.runtime import tune_malloc
torch.set_num_threads(1)
print(tune_malloc())
def step():  # three 8 MiB activations, written, then freed, as in a sweep's forward
    xs = [torch.empty(2 << 20).fill_(1.0) for _ in range(3)]
    del xs
for _ in range(3):  # the heap grows to its working size
    step()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 10)
"""


def faults_per_step(setting: str) -> tuple[bool, float]:
    env = {**os.environ, ENV: setting}
    out = subprocess.run([sys.executable, "-c", FAULTS], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    return out[0] == "True", float(out[1])


@pytest.mark.skipif(not GLIBC, reason="tune_malloc tunes glibc's allocator only")
def test_tuned_process_reuses_freed_memory_instead_of_faulting_in_fresh_pages() -> None:
    applied, tuned = faults_per_step("1")
    left, default = faults_per_step("0")
    assert applied and not left
    # default glibc returns the 24 MiB to the kernel each step: ~6000 pages fault back in
    assert default > 1000
    assert tuned * 10 < default


def test_opt_out_leaves_the_allocator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "0")
    assert tune_malloc() is False


@pytest.mark.skipif(not GLIBC, reason="tune_malloc tunes glibc's allocator only")
def test_tuning_is_idempotent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert tune_malloc() is True
    assert tune_malloc() is True


def test_bad_setting_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match=f"{ENV}: expected 0 .* or 1 .*; got 'yes'"):
        tune_malloc()
    assert cli.main(["eval", "no-such-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"normlab: error: {ENV}: expected 0" in err
