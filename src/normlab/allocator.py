"""glibc's malloc told to keep freed memory, in normlab's own processes.

Why. PyTorch on CPU takes every tensor from `malloc`. glibc gives the free memory at the top
of its heap back to the kernel once more than its trim threshold is free there, and serves
blocks above its mmap threshold from fresh mappings. It adapts both thresholds to the block
sizes it sees, yet a greedy decode's activations (megabytes each, alive for one forward)
keep landing beyond them, so call after call faults its memory in again page by page. On
the Intel VM of docs/performance.md (twentieth session,
`benchmarks/results/session20/malloc_decode_{1,2}t.txt` and `first/` there), cached decodes
of bench_decode's n5d1 cell one after another, as `evaluate` (what `normlab eval` decodes
with) runs them, took 7,000-11,000 minor page faults a call and 22-46% more time than with
the memory kept, which took at most one.

What. `keep_freed_memory()` pins the mmap threshold at the ceiling of glibc's own adaptation
on 64-bit systems (32 MiB), so blocks below it come from the heap, and keeps 64 MiB of free
memory at a heap's top when glibc trims it (`M_TOP_PAD`; it trims only past 64 MiB,
`M_TRIM_THRESHOLD`). A process so holds up to 64 MiB more per malloc arena, plus the freed
blocks under 32 MiB that glibc would have unmapped.

Where. The setting is process-wide and lasts (glibc stops adapting once a threshold is set),
so importing normlab never applies it: the `normlab` command does, once at start, as do sweep
workers and the benchmarks, which measure normlab as the command runs it. It is left alone
where glibc's malloc is not the one in use (macOS, musl, an allocator in `LD_PRELOAD`) or not
64-bit, where the environment already sets one of these thresholds (`MALLOC_MMAP_THRESHOLD_`,
`MALLOC_TRIM_THRESHOLD_`, `MALLOC_TOP_PAD_`, `MALLOC_MMAP_MAX_`, or their `glibc.malloc`
tunables), and with `NORMLAB_MALLOC=default`, each process reading its own environment.
"""

from __future__ import annotations

import ctypes
import os
import platform

MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems
TOP_PAD = 64 << 20  # free memory kept at the heap's top when glibc trims it
TRIM_THRESHOLD = TOP_PAD  # glibc trims only once more than this is free at the top
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # mallopt's numbers (malloc.h)
ENV = "NORMLAB_MALLOC"
CHOICES = ("keep", "default")
# the environment's own say over the same settings: glibc's variables and tunables
_GLIBC_SETTINGS = ("mmap_threshold", "trim_threshold", "top_pad", "mmap_max")

_applied = False


def setting() -> str:
    """`$NORMLAB_MALLOC`: 'keep' (the default when unset or empty) or 'default'."""
    value = os.environ.get(ENV, "").strip().lower() or "keep"
    if value not in CHOICES:
        raise ValueError(f"{ENV}: expected one of {', '.join(CHOICES)}; got "
                         f"{os.environ[ENV]!r}")
    return value


def _glibc_malloc() -> bool:
    """Whether this process's `malloc` is 64-bit glibc's (not musl's, nor one from
    LD_PRELOAD): the thresholds above are glibc's 64-bit ones."""
    if platform.libc_ver()[0] != "glibc" or ctypes.sizeof(ctypes.c_void_p) != 8:
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        used = ctypes.CDLL(None).malloc  # the symbol the process resolves
    except (OSError, AttributeError):
        return False
    addr = ctypes.cast  # function pointers compare by address
    return addr(used, ctypes.c_void_p).value == addr(libc.malloc, ctypes.c_void_p).value


def _set_by_environment() -> bool:
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    return any(os.environ.get(f"MALLOC_{name.upper()}_") or f"glibc.malloc.{name}=" in tunables
               for name in _GLIBC_SETTINGS)


def keep_freed_memory() -> bool:
    """Keep freed memory in glibc's heap for the rest of this process (see the module's
    docstring); True if the setting is in force, False where it is left alone. A bad
    `NORMLAB_MALLOC` raises a one-line ValueError, on every call."""
    global _applied
    choice = setting()
    if _applied:
        return True
    if choice == "default" or _set_by_environment() or not _glibc_malloc():
        return False
    mallopt = ctypes.CDLL("libc.so.6").mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # each returns 1 on success (64-bit glibc accepts all three values); the mmap threshold,
    # which changes which blocks the heap serves, goes last, once the heap will keep them
    _applied = bool(mallopt(_M_TOP_PAD, TOP_PAD) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
                    and mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    return _applied


def describe() -> str:
    """How this process's malloc runs, for result files."""
    if _applied:
        return (f"glibc, freed memory kept (mmap threshold {MMAP_THRESHOLD >> 20} MiB, "
                f"{TOP_PAD >> 20} MiB kept at the top)")
    if not _glibc_malloc():
        return "not 64-bit glibc's malloc"
    return "glibc, set by the environment" if _set_by_environment() else "glibc defaults"
