"""Process-wide CPU runtime setting: let glibc's allocator keep freed memory for reuse.

Why: a collapse sweep's forwards allocate and free activations of several MB per op (one
[8192, 256] float MLP activation is 8 MB). By default glibc's malloc hands such blocks back to
the kernel (`mmap` above its threshold, heap trimming above twice it), so the next op's tensor
lands on fresh pages that the kernel must fault in and zero: 15-20% of the sweep's time on the
development VM (`benchmarks/results_session13_malloc/`, docs/performance.md). PyTorch's CPU
tuning guide suggests jemalloc or TCMalloc for this; with glibc two `mallopt` calls do it. The
price: the process keeps its peak heap instead of shrinking after it (as PyTorch's CUDA
caching allocator does on a GPU).

The CLI and the benchmarks call `tune_malloc()` at start; Python users may call it
themselves. `NORMLAB_TUNE_MALLOC=0` leaves the allocator as it is.
"""

from __future__ import annotations

import ctypes
import os
import platform

ENV = "NORMLAB_TUNE_MALLOC"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 32 << 20
"""Blocks up to 32 MiB (glibc's maximum on 64-bit) come from the heap, not fresh `mmap`s."""
TRIM_THRESHOLD = 1 << 30
"""The heap is shrunk only when 1 GiB at its top is free."""


def tune_malloc() -> bool:
    """Keep freed memory in glibc's heap for reuse; True if applied (idempotent).

    A no-op (False) off Linux/glibc, or with `NORMLAB_TUNE_MALLOC=0`.
    """
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}: expected 0 (leave the allocator) or 1 (tune it); got {value!r}")
    if value == "0" or platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and bool(
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
