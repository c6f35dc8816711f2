"""normlab.allocator: glibc keeps freed memory in normlab's processes, and only there.

The setting is process-wide and permanent, so every check that applies it runs in a fresh
subprocess: the test process itself keeps glibc's defaults.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from normlab import allocator, cli

GLIBC = platform.libc_ver()[0] == "glibc"

# Six 4 MiB blocks malloc'd, written and freed, six times over, counting the minor page faults
# of each round (PyTorch's CPU tensors come from the same malloc; raw blocks keep other
# allocations from landing between them). Under glibc's defaults the first round's blocks are
# mmapped; their frees raise the thresholds to 4 MiB (mmap) and 8 MiB (trim); from then on
# each round grows the heap by 24 MiB and its frees give it back (24 > 8), so every round
# faults its memory in again.
CHURN = """
import ctypes, json, resource
from normlab import allocator
applied = allocator.keep_freed_memory()
again = allocator.keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for _ in range(6):
    f0 = faults()
    blocks = [libc.malloc(4 << 20) for _ in range(6)]
    for b in blocks:
        ctypes.memset(b, 1, 4 << 20)
    for b in blocks:
        libc.free(b)
    counts.append(faults() - f0)
print(json.dumps({"applied": applied, "again": again, "describe": allocator.describe(),
                  "faults": counts}))
"""


def churn(setting: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != allocator.ENV}
    if setting is not None:
        env[allocator.ENV] = setting
    out = subprocess.run([sys.executable, "-c", CHURN], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_kept_memory_is_not_faulted_in_again():
    kept, default = churn(None), churn("default")
    # the control: with glibc's defaults this churn really does give its memory back and
    # fault it in again every round (else the first check below would prove nothing)
    assert default["applied"] is False and default["describe"] == "glibc defaults"
    assert min(default["faults"][2:]) > 3000, default
    # kept: once the first rounds have grown the heap, the same memory serves every round
    assert kept["applied"] is True and kept["again"] is True
    assert kept["describe"] == "keep freed memory (mmap 32 MiB, trim 64 MiB)"
    assert max(kept["faults"][2:]) < 300, kept


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_keep_is_the_default_and_case_free():
    assert churn("KEEP")["applied"] is True
    assert churn("")["applied"] is True


def test_a_bad_setting_is_a_one_line_error(monkeypatch, capsys):
    monkeypatch.setenv(allocator.ENV, "sometimes")
    with pytest.raises(ValueError, match=r"^NORMLAB_MALLOC: expected one of keep, default; "
                                         r"got 'sometimes'$"):
        allocator.setting()
    # the command says so in one line before doing anything
    assert cli.main(["compare", "no-such-run-a", "no-such-run-b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["normlab: error: NORMLAB_MALLOC: expected one of keep, default; got "
                   "'sometimes'"]


def test_the_command_and_sweep_workers_apply_it_importing_does_not(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append("cli") or True)
    cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b")])  # fails: no runs
    assert calls == ["cli"]
    from normlab import sweep

    monkeypatch.setattr(sweep, "keep_freed_memory", lambda: calls.append("sweep") or True)
    monkeypatch.setattr(sweep, "run_one", lambda spec, device: {"name": spec})
    assert sweep._safe_run("r0", "cpu") == {"ok": True, "name": "r0"}
    assert calls == ["cli", "sweep"]
    # importing normlab (as this test process did) left glibc's defaults in place
    probe = ("import normlab, normlab.cli, normlab.sweep; from normlab import allocator; "
             "print(allocator.describe())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    assert out == ("glibc defaults" if GLIBC else "not glibc")
