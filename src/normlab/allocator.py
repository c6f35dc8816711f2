"""glibc's malloc told to keep freed memory, in normlab's own processes.

Why. PyTorch on CPU takes every tensor from `malloc`. glibc gives freed memory at the top of
its heap back to the kernel once more than its trim threshold is free there, and serves
blocks above its mmap threshold from fresh mappings. It adapts both thresholds to the block
sizes it sees, but a decode's or an analysis's activations (megabytes each, alive for one
forward) keep landing beyond them, so each call faults its memory in again page by page.
On the Intel VM of docs/performance.md (twentieth session), a cached greedy decode of
bench_decode's n5d1 cell took ~7,700 minor page faults a call, repeated one after another as
`normlab eval` runs them, and 57 ms where it takes 40 ms with the memory kept.

What. `keep_freed_memory()` pins the two thresholds at the ceilings glibc's own adaptation
can reach on 64-bit systems (mmap 32 MiB, trim twice that), so blocks below 32 MiB come from
the heap and up to 64 MiB of free heap is kept for the next forward.

Where. The setting is process-wide and cannot be undone (glibc stops adapting once one is
set), so importing normlab never calls it. The `normlab` command does, once at start, as do
sweep workers and the benchmarks, which measure normlab as the command runs it.
`NORMLAB_MALLOC=default` leaves glibc's defaults alone. Without glibc (macOS, musl, Windows)
there is nothing to set.
"""

from __future__ import annotations

import ctypes
import os
import platform

MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit systems
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # where glibc's adaptation sets it for that threshold
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)
ENV = "NORMLAB_MALLOC"
CHOICES = ("keep", "default")

_applied = False


def setting() -> str:
    """`$NORMLAB_MALLOC`: 'keep' (the default when unset or empty) or 'default'."""
    value = os.environ.get(ENV, "").strip().lower() or "keep"
    if value not in CHOICES:
        raise ValueError(f"{ENV}: expected one of {', '.join(CHOICES)}; got "
                         f"{os.environ[ENV]!r}")
    return value


def keep_freed_memory() -> bool:
    """Keep freed memory in glibc's heap for the rest of this process (see the module's
    docstring); True if the setting is in force, False where glibc is absent or
    `NORMLAB_MALLOC=default`. Calling it again does nothing more."""
    global _applied
    if _applied:
        return True
    if setting() == "default" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    # mallopt returns 1 on success; both settings or neither is the state to report
    _applied = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                    and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied


def describe() -> str:
    """What this process runs with, for result files: 'keep freed memory (mmap 32 MiB, trim
    64 MiB)', 'glibc defaults' or 'not glibc'."""
    if _applied:
        return (f"keep freed memory (mmap {MMAP_THRESHOLD >> 20} MiB, "
                f"trim {TRIM_THRESHOLD >> 20} MiB)")
    return "glibc defaults" if platform.libc_ver()[0] == "glibc" else "not glibc"
