"""normlab.allocator: glibc keeps freed memory in normlab's processes, and only there.

The setting is process-wide and permanent, so every check of what it does runs in a fresh
subprocess (tests elsewhere call the command in-process, which applies it to the test
process).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from normlab import allocator, cli

GLIBC = platform.libc_ver()[0] == "glibc"

# N 4 MiB blocks malloc'd, written and freed, six times over, counting the minor page faults
# of each round (PyTorch's CPU tensors come from the same malloc; raw blocks keep other
# allocations from landing between them; transparent huge pages off, so a fault is a 4 KiB
# page on every host). Under glibc's defaults the first round's blocks are mmapped; their
# frees raise the thresholds to 4 MiB (mmap) and 8 MiB (trim); from then on each round grows
# the heap by N * 4 MiB and its frees give it all back, so every round faults it in again.
CHURN = """
import ctypes, json, resource, sys
from normlab import allocator
libc = ctypes.CDLL("libc.so.6")
libc.prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
applied = allocator.keep_freed_memory()
again = allocator.keep_freed_memory()
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
counts = []
for _ in range(6):
    f0 = faults()
    blocks = [libc.malloc(4 << 20) for _ in range(int(sys.argv[1]))]
    for b in blocks:
        ctypes.memset(b, 1, 4 << 20)
    for b in blocks:
        libc.free(b)
    counts.append(faults() - f0)
print(json.dumps({"applied": applied, "again": again, "describe": allocator.describe(),
                  "faults": counts}))
"""
KEPT = "glibc, freed memory kept (mmap threshold 32 MiB, 64 MiB kept at the top)"
PAGES_PER_BLOCK = (4 << 20) // 4096


def clean_env() -> dict[str, str]:
    """This environment without any say over malloc (NORMLAB_MALLOC, glibc's own)."""
    return {k: v for k, v in os.environ.items()
            if k != allocator.ENV and not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}


def churn(setting: str | None, blocks: int = 6, **env_extra: str) -> dict:
    env = clean_env()
    if setting is not None:
        env[allocator.ENV] = setting
    out = subprocess.run([sys.executable, "-c", CHURN, str(blocks)], env=env | env_extra,
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_kept_memory_is_not_faulted_in_again() -> None:
    kept, default = churn(None), churn("default")
    # the control: with glibc's defaults this churn really does give its memory back and
    # fault it in again every round (else the first check below would prove nothing)
    assert default["applied"] is False and default["describe"] == "glibc defaults"
    assert min(default["faults"][2:]) > 5 * PAGES_PER_BLOCK, default
    # kept: once the first rounds have grown the heap, the same memory serves every round
    assert kept["applied"] is True and kept["again"] is True and kept["describe"] == KEPT
    assert max(kept["faults"][2:]) < 300, kept


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_at_most_64_mib_is_kept() -> None:
    """80 MiB freed a round: glibc trims down to the 64 MiB it keeps, so each round faults in
    the other 16 MiB (4 blocks) again, where the defaults fault in all 80."""
    kept, default = churn(None, blocks=20), churn("default", blocks=20)
    assert min(default["faults"][2:]) > 19 * PAGES_PER_BLOCK, default
    assert all(3 * PAGES_PER_BLOCK < f < 6 * PAGES_PER_BLOCK for f in kept["faults"][2:]), kept


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_keep_is_the_default_and_an_environment_setting_wins() -> None:
    assert churn("KEEP")["applied"] is True
    assert churn("")["applied"] is True
    # one of the same thresholds already set by the environment: left as it was, said so
    for env in ({"MALLOC_TRIM_THRESHOLD_": "65536"}, {"MALLOC_MMAP_MAX_": "0"},
                {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0:glibc.malloc.top_pad=0"}):
        got = churn(None, **env)
        assert got["applied"] is False and got["describe"] == "glibc, set by the environment"
        assert min(got["faults"][2:]) > 5 * PAGES_PER_BLOCK, (env, got)
    # other malloc settings in the environment do not stand in its way
    for env in ({"MALLOC_PERTURB_": "0"}, {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=0"}):
        assert churn(None, **env)["applied"] is True, env


PRELOADED_MALLOC = """
#include <stddef.h>
void *__libc_malloc(size_t n);
void *malloc(size_t n) { return __libc_malloc(n); }
"""


@pytest.mark.skipif(not GLIBC or not shutil.which("cc"), reason="glibc and a C compiler")
def test_an_allocator_in_ld_preload_is_left_alone(tmp_path: Path) -> None:
    """Where `malloc` is not glibc's (here a preloaded one that forwards to it), glibc's
    settings would tune an allocator nobody uses: nothing is set, and the record says so."""
    (tmp_path / "m.c").write_text(PRELOADED_MALLOC)
    lib = tmp_path / "libm_preload.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "m.c")],
                   check=True, capture_output=True)
    got = churn(None, LD_PRELOAD=str(lib))
    assert got["applied"] is False and got["describe"] == "not 64-bit glibc's malloc"


def test_a_bad_setting_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(allocator.ENV, "sometimes")
    for applied in (False, True):  # also once an earlier command has applied it
        monkeypatch.setattr(allocator, "_applied", applied)
        for call in (allocator.setting, allocator.keep_freed_memory):
            with pytest.raises(ValueError, match=r"^NORMLAB_MALLOC: expected one of keep, "
                                                 r"default; got 'sometimes'$"):
                call()
    # the command says so in one line before doing anything
    assert cli.main(["compare", "no-such-run-a", "no-such-run-b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["normlab: error: NORMLAB_MALLOC: expected one of keep, default; got "
                   "'sometimes'"]


def test_the_command_and_sweep_workers_apply_it_importing_does_not(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls = []
    monkeypatch.setattr(cli, "keep_freed_memory", lambda: calls.append("cli") or True)
    cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b")])  # fails: no runs
    assert calls == ["cli"]
    from normlab import sweep

    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: calls.append("sweep") or True)
    monkeypatch.setattr(sweep, "run_one", lambda spec, device: {"name": spec})
    assert sweep._safe_run("r0", "cpu") == {"ok": True, "name": "r0"}
    assert calls == ["cli", "sweep"]
    # a bad setting stops a sweep in one line before any worker starts
    monkeypatch.setenv(allocator.ENV, "sometimes")
    with pytest.raises(ValueError, match=r"^NORMLAB_MALLOC: expected"):
        sweep.execute([], progress=False)
    # importing normlab leaves glibc's defaults in place
    probe = ("import normlab, normlab.cli, normlab.sweep; from normlab import allocator; "
             "print(allocator.describe())")
    out = subprocess.run([sys.executable, "-c", probe], env=clean_env(), capture_output=True,
                         text=True, timeout=120, check=True).stdout.strip()
    assert out == ("glibc defaults" if GLIBC else "not 64-bit glibc's malloc")
