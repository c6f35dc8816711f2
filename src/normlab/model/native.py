"""normlab's native CPU kernels, compiled on first use: LayerNorm / RMSNorm for `Norm`, RoPE's
rotation for `Rope`, the attention of a decoding step and of short rows for `Attention`, and
the GELU of a training step for `MLP`.

Norms. ATen's CPU `layer_norm` reduces one row at a time, so on QK/QKV-Norm's 16-float head
rows it is bound by each row's chain of adds (~22 ns a row, 2.6x its cost per float on
64-float rows), the main reason `qkv` trained ~15% slower than `pre` (docs/performance.md).
`native.c` reduces eight rows at once with AVX2 and splits rows over the OpenMP threads torch
uses. `Norm` takes it where it pays (`norm_applies`): inputs of MIN_ROWS rows or more, and under
autograd only rows of at most MAX_GRAD_WIDTH floats. It writes its output, and reads its
incoming gradient, through row strides, so per-head QK/QKV-Norm hands attention head-major
q, k and v (`head_major`) and takes their gradients back without a layout copy.

RoPE. torch computes `x * cos + roll(x * sin2, d/2)` in four passes over x (the roll is a
`cat` of two strided halves), plus as many again in the backward; the kernel does each in one
pass with the very same products and sums, so its results are bitwise torch's
(tests/test_native.py). It writes q and k head-major, so attention's matmuls read them without
a layout copy. `Rope` takes it whenever `rope_applies`; what it buys is measured in
docs/performance.md (seventeenth session).

QK-Norm then RoPE. With QK/QKV-Norm and RoPE, q and k are normalised and then rotated: two
kernel calls, each a pass over the tensor and, under autograd, a Python Function. `norm(...,
rope=(cos, sin2))` does both in one call each way: the norm's own block routine normalises a
block of positions into an L1-sized scratch, RoPE's rotates it into the head-major output, and
the backward undoes the rotation block by block before the norm's backward. The results are
bitwise those of the two calls (tests/test_native.py). `Attention` takes it for q and k when
no hook reads them between the norm and the rotation (`Norm.rotated`); it saves 1-3% of a
`qk`/`qkv` training step (docs/performance.md, nineteenth session).

Decoding attention. A cached decoding step attends with one query a row; ATen's explicit path
is five ops (two batched matmuls of one row each, a bias, a scale, a softmax), each paying
per-row overhead on rows of ~20 keys. The kernel makes one pass per row, reading the cache's
buffers in place, equal to torch's attention to float32 rounding (tests against float64).
`Attention` takes it whenever `attend_applies` and no hook reads the scores or the pattern
(docs/performance.md, eighteenth session).

Attention of short rows. On CPU, rows of at most 64 keys (a training step's 17, a prompt's,
a collapse sweep's) run the explicit path, faster there than SDPA's kernel
(`attention.EXPLICIT_MAX_KEYS_CPU`); that is eight ATen ops forward and as many back, each a
pass over [B, H, T, S] or [B, H, T, D] tensors paying per-op costs on 16-float heads: 2.0 ms
a layer, forward and backward, at a training step's shape on AMD EPYC (one thread), 8 ms of
a 50-61 ms step over four layers. `attention` runs it in one call each way, eight (b, h) rows
side by side in the lanes of an eight-float vector (no lane idle on a 17-key row, no sum
across lanes), skipping the keys a causal mask hides, and saves the weights for the
backward: 2.6-2.7x faster at that shape, a `pre` or `qkv` training step 7-8% faster on one
thread (docs/performance.md, twenty-seventh session). A mask that differs by row (a batch's
padding) is copied lane-major once for each eight rows, and keys none of them may see are
skipped too (twenty-eighth). Equal to torch's to float32 rounding (tests against float64).
`Attention` takes it whenever `attention_applies`, with no hook on the scores or the pattern
and no dropout, on the explicit path's rows and on longer causal ones
(`attention.kernel_by_default`); a hook on either sends that layer back to the explicit path,
whose numbers then differ from the kernel's by float32 rounding.

GELU in training. ATen's GELU backward recomputes erf and two exponentials from the saved
pre-activation: in a profiled `pre` step on AMD EPYC, one thread, 0.82 ms a call on [2176, 256]
(~1.5 ns a float), 1.45x its forward (benchmarks/results/session26/before/
train_prof_pre_1t.txt). `linear_gelu` runs the MLP's
first matmul and the GELU in one autograd Function whose forward also writes the GELU's
derivative (one pass, one exponential) and saves it in place of the pre-activation, so the
backward is one multiply: the same tensors saved, a training step 1-3% faster
(docs/performance.md, twenty-sixth session). Equal to ATen's to float32 rounding (tests against
float64). `MLP` takes it under autograd when no hook reads the pre-activation; without
autograd (evaluation, decoding, the collapse sweep) ATen's forward, which is faster alone,
runs.
The kernels are compiled with the system C compiler (`$CC`, else `cc`) the first time a
process needs them, and cached under `$NORMLAB_CACHE` (default `~/.cache/normlab`) in a file
keyed by the source, the flags, the compiler and the CPU (it is built for this CPU,
`-march=native`). Without a compiler, or with `NORMLAB_NATIVE_NORM=0` / `NORMLAB_NATIVE_ROPE=0`
/ `NORMLAB_NATIVE_ATTN=0` (decoding attention) / `NORMLAB_NATIVE_ATTENTION=0` (short rows) /
`NORMLAB_NATIVE_GELU=0`, torch's ops run instead: the same numbers to float32 rounding for the
norms, attention and GELU, bit for bit for RoPE.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("native.c")
# tried in order: OpenMP threads, then without (e.g. Apple clang), then without -march=native
FLAG_SETS = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-march=native"),
    ("-O3",),
)
ROWS_PER_THREAD = 512  # below this many rows a call runs on one thread
# fewest rows from which the kernel is at least as fast as torch's, without / with autograd
# (Intel Xeon, 1-2 threads, D = 16 and 64; at 1024 rows with autograd on two threads the two
# are even: benchmarks/probes/native_norm_rows.py)
MIN_ROWS = {False: 256, True: 1024}
# With autograd, only rows this narrow. Inside a training step the kernel roughly halves what
# QK/QKV-Norm's 16-float head rows cost, but on 64-float rows its backward, with the Python
# around it, is 0.1-0.3 ms a step slower than ATen's on one thread and 0.1-0.2 ms faster on
# two (under 1% of a step), so wide rows keep ATen's under autograd
# (benchmarks/probes/native_norm_in_step.py).
MAX_GRAD_WIDTH = 32
# Fewest elements of x from which RoPE's kernel is at least as fast as torch's ops. Below, the
# Python and ctypes around one call (~12 µs) cost more than torch's four small ops: the kernel
# runs at 0.65-0.69x torch's speed in eval and 0.83-0.85x with autograd at 64-1088 elements (a
# batch-1 forward is 1088), 0.78x and 0.90-0.92x at 4352; at 16384 ([256, 1, 4, 16], a decoding
# step of 256 prompts) 1.10-1.11x and 1.25-1.28x, and 1.1-4.9x beyond (Intel Xeon, 1-2
# threads: benchmarks/probes/native_rope_size.py,
# benchmarks/results/session17/native_rope_size_*.txt).
ROPE_MIN_ELEMENTS = 16384
# Widest position (H * D floats: heads x head width) the fused QK-Norm + RoPE call takes: its
# scratch block holds eight positions (native.c's FUSE_MAX_ROW).
FUSE_MAX_ROW = 1024


# Fewest elements of the MLP's pre-activation [rows, d_mlp] from which the linear + GELU
# Function is at least as fast as torch's matmul and GELU under autograd (see `linear_gelu`).
GELU_MIN_ELEMENTS = 16384

KERNELS = ("norm", "rope", "attn", "attention", "gelu")


OFF, ON = ("0", "false", "no", "off"), ("", "1", "true", "yes", "on")


def _enabled_by_env(kernel: str) -> bool:
    """`NORMLAB_NATIVE_NORM` / `_ROPE` / `_ATTN` / `_ATTENTION` / `_GELU`: 0, false, no or off
    switch that kernel off; a value of neither kind is warned of (`disable` left it on unsaid)."""
    name = f"NORMLAB_NATIVE_{kernel.upper()}"
    value = os.environ.get(name, "1").strip().lower()
    if value not in OFF + ON:
        warnings.warn(f"normlab: {name}={os.environ[name]!r} is neither on (1, true, yes, on) nor "
                      f"off (0, false, no, off); the {kernel} kernel stays on", RuntimeWarning,
                      stacklevel=2)
    return value not in OFF


_enabled = {k: _enabled_by_env(k) for k in KERNELS}
_lib: ctypes.CDLL | None = None
_tried = False
_loading = threading.Lock()  # one build per process, even when threads ask at once
built_with: tuple[str, ...] | None = None  # the flags of the loaded build, for reports


def set_enabled(on: bool, kernel: str | None = None) -> None:
    """Switch one kernel (`norm`, `rope`, `attn` (decoding attention), `attention` (short
    rows), `gelu`), or all, on or off for this process (benchmarks A/B them; tests compare)."""
    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {', '.join(KERNELS)} or None; got {kernel!r}")
    for k in KERNELS if kernel is None else (kernel,):
        _enabled[k] = on


def enabled(kernel: str) -> bool:
    """Whether `kernel` is switched on and built in this process (whether it runs is still each
    call's `*_applies`: dtype, device, autocast, tracing)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel: expected one of {', '.join(KERNELS)}; got {kernel!r}")
    return _enabled[kernel] and load() is not None


TORCH_KERNELS = "(torch's kernels)"
"""How `describe` ends where none of normlab's kernels runs (switched off, or not built)."""


def describe() -> str:
    """Which kernels run in this process, for result files: their build, or why not."""
    on = [k for k in KERNELS if _enabled[k]]
    if not on:
        return f"off {TORCH_KERNELS}"
    if load() is None:
        return f"unavailable: could not be built here {TORCH_KERNELS}"
    lib = _lib
    assert lib is not None and built_with is not None
    path = "AVX2 eight-row" if lib.nl_has_rows8() else "per-row"
    off = [k for k in KERNELS if k not in on]
    which = ", ".join(on) + (f"; {', '.join(off)} off" if off else "")
    return f"on: {which} ({' '.join(built_with)}, {path} norm path)"


def _cpu_id() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() + platform.machine()
    keep = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    return "\n".join(sorted(set(keep)))


def _cache_dir() -> Path:
    """`$NORMLAB_CACHE/kernels`, else `~/.cache/normlab/kernels` (RuntimeError: no home).
    A `~` is expanded (`NORMLAB_CACHE='~/x'`, quoted or set from Python, built into `./~/x`)."""
    root = os.environ.get("NORMLAB_CACHE") or Path.home() / ".cache" / "normlab"
    return Path(root).expanduser() / "kernels"


def compiler() -> list[str]:
    """The C compiler command: `$CC` (it may carry words, e.g. `ccache gcc`), else `cc`."""
    return shlex.split(os.environ.get("CC") or "cc")


def _library(cc: list[str], flags: tuple[str, ...], src: bytes) -> Path | None:
    """Where the build of `src` by this command with these flags is cached; None if the
    compiler does not run. Keyed by the whole command (`gcc -O0` builds another library than
    `gcc`: its words were not in the key, so a changed `$CC` reused the old build), the
    flags, the compiler's version and the CPU."""
    try:
        version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    key = hashlib.sha256(b"\0".join([src, "\x1f".join(cc).encode(), " ".join(flags).encode(),
                                     version.stdout.encode(), _cpu_id().encode()])
                         ).hexdigest()[:16]
    return _cache_dir() / f"native-{key}.so"


@dataclass
class _BuildLog:
    """What one `_load`'s builds met, for its warning if none loads."""

    built: set[Path] = field(default_factory=set)  # written by this load: not rebuilt
    compile_error: str = ""  # the compiler's last complaint
    load_error: str = ""  # the loader's last error for a file that built (a noexec cache)


def _complaint(stderr: bytes) -> str:
    """The compiler's first error line (else its last line), for the warning."""
    lines = [ln.strip() for ln in stderr.decode(errors="replace").splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    return (errors[0] if errors else lines[-1] if lines else "no message")[:300]


def _compile(cc: list[str], flags: tuple[str, ...], src: bytes, rebuild: bool = False,
             log: _BuildLog | None = None) -> Path | None:
    """Build (or find) the shared library for these flags; None if the compiler refuses (its
    complaint in `log`)."""
    log = log if log is not None else _BuildLog()
    # no home folder (a container's bare uid), an unwritable or shared cache: no kernel, as
    # without a compiler (each escaped from the first forward, then left the kernels off unsaid)
    try:
        out = _library(cc, flags, src)
        if out is None:
            log.compile_error = "it does not run"
            return None
        if out.exists() and not rebuild:
            return out
        # compile to a private name, then rename: another process never loads a half-written
        # file
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    except (OSError, RuntimeError) as err:
        log.compile_error = str(err)
        return None
    os.close(fd)
    cmd = [*cc, *flags, "-shared", "-fPIC", str(SOURCE), "-o", tmp]
    try:  # removed unless renamed, also on Ctrl-C during the build
        try:
            done = subprocess.run(cmd, capture_output=True, timeout=120)
        except (OSError, subprocess.SubprocessError) as err:
            log.compile_error = str(err)
            return None
        if done.returncode != 0:
            log.compile_error = _complaint(done.stderr)
            return None
        if os.path.getsize(tmp) == 0:  # a "compiler" that wrote nothing (CC=true)
            log.compile_error = "it wrote no library"
            return None
        # readable by the cache's other users, as a linker's own output is (mkstemp's is 0600)
        from normlab.io import process_umask  # here: io imports this module

        os.chmod(tmp, 0o755 & ~process_umask())
        log.built.add(out)
        try:
            os.replace(tmp, out)
        except OSError:  # another user's build holds the name (a sticky shared folder)
            return out if out.exists() else None
        return out
    finally:
        Path(tmp).unlink(missing_ok=True)


def load() -> ctypes.CDLL | None:
    """The compiled kernel, building it on first call; None if no build works (warned once).
    A thread that asks while another builds waits for that build (`_tried` is set when it
    ends: set at its start, such a thread was told there was no kernel)."""
    global _tried
    if _tried:
        return _lib
    with _loading:
        if not _tried:
            try:
                _load()
            except Exception as err:  # anything the build's own checks missed: said, once
                warnings.warn(f"normlab: the CPU kernels could not be loaded ({err}); norms, "
                              "RoPE, attention and GELU use torch's ops", RuntimeWarning,
                              stacklevel=2)
            # not after Ctrl-C during the build: the next call builds again
            _tried = True
        return _lib


def _open(cc: list[str], flags: tuple[str, ...], src: bytes, log: _BuildLog
          ) -> ctypes.CDLL | None:
    """Load this build, rebuilding it once if the cached file will not load (a damaged file).
    A file this load just built is not built again: it would not load either (a cache on a
    noexec mount, a missing libgomp: each flag set was built twice, and the loader's error,
    kept in `log` now, was dropped)."""
    for rebuild in (False, True):
        path = _compile(cc, flags, src, rebuild, log)
        if path is None:
            return None
        try:
            return ctypes.CDLL(str(path))
        except OSError as err:
            log.load_error = str(err)
            if path in log.built:
                return None
    return None


def _load() -> ctypes.CDLL | None:
    global _lib, built_with
    if platform.system() == "Windows":
        return None
    try:
        cc = compiler()
    except ValueError as err:  # shlex: an unclosed quote; every later call fell back unsaid
        warnings.warn(f"normlab: CC={os.environ['CC']!r} is not a command line ({err}); "
                      "norms, RoPE, attention and GELU use torch's ops", RuntimeWarning,
                      stacklevel=2)
        return None
    src = SOURCE.read_bytes()
    log = _BuildLog()
    for flags in FLAG_SETS:
        lib = _open(cc, flags, src, log)
        if lib is None:
            continue
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.nl_norm_fwd.argtypes = [p, p, p, p, p, p, i64, i64, i32, ctypes.c_float, i32,
                                    *[i64] * 5]
        lib.nl_norm_bwd.argtypes = [p, p, p, p, p, p, p, p, i64, i64, i32, i32, *[i64] * 5]
        lib.nl_rope.argtypes = [p, *[i64] * 4, p, p, p, *[i64] * 3, *[i64] * 4, i32, i32]
        lib.nl_attn1.argtypes = [p, i64, i64, p, *[i64] * 3, p, *[i64] * 3, p, p, i64, i64, p,
                                 *[i64] * 5, i32]
        lib.nl_norm_rope_fwd.argtypes = [p, p, p, p, p, p, *[i64] * 4, i32, ctypes.c_float,
                                         p, p, *[i64] * 3, i32]
        lib.nl_norm_rope_bwd.argtypes = [p, *[i64] * 4, p, p, p, p, p, p, p, *[i64] * 4, i32,
                                         p, p, i32]
        lib.nl_gelu_fwd.argtypes = [p, p, p, i64, i32]
        lib.nl_tattn_fwd.argtypes = [*[p] * 12, *[i64] * 5, i32]
        lib.nl_tattn_bwd.argtypes = [*[p] * 16, *[i64] * 5, i32]
        lib.nl_tattn_fwd.restype = lib.nl_tattn_bwd.restype = ctypes.c_int
        lib.nl_gelu_fwd.restype = None
        lib.nl_norm_fwd.restype = lib.nl_norm_bwd.restype = lib.nl_rope.restype = None
        lib.nl_attn1.restype = lib.nl_norm_rope_fwd.restype = lib.nl_norm_rope_bwd.restype = None
        lib.nl_has_rows8.restype = lib.nl_attn_max_keys.restype = ctypes.c_int
        lib.nl_fuse_max_row.restype = ctypes.c_int
        _lib, built_with = lib, flags
        return _lib
    try:
        where = str(_cache_dir())
    except RuntimeError:  # Path.home(): a uid with no home folder
        where = "a cache (no home folder)"
    if log.load_error:  # built, but the loader refused it: "could not compile" misled
        what = (f"built {SOURCE.name} with {' '.join(cc)!r} into {where} but could not load it "
                f"({log.load_error})")
        fix = "NORMLAB_CACHE to a folder on a mount that allows executables"
    else:
        why = f" ({log.compile_error})" if log.compile_error else ""
        what = f"could not compile {SOURCE.name} with {' '.join(cc)!r} into {where}{why}"
        fix = "CC to a C compiler and NORMLAB_CACHE to a writable folder"
    warnings.warn(
        f"normlab: {what}; norms, RoPE, attention and GELU use torch's ops (set {fix} for the "
        "faster CPU path, or NORMLAB_NATIVE_NORM=0, NORMLAB_NATIVE_ROPE=0, "
        "NORMLAB_NATIVE_ATTN=0, NORMLAB_NATIVE_ATTENTION=0 and NORMLAB_NATIVE_GELU=0 to "
        "silence this)",
        RuntimeWarning,
        stacklevel=2,
    )
    return None


def _needs_grad(*ts: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def norm_applies(x: torch.Tensor, gain: torch.Tensor) -> bool:
    """Whether `norm` should take these: float32 on CPU, eager, enough rows, the kernel built.

    Below MIN_ROWS rows torch's own call is faster (the ctypes call, and with autograd the
    Python Function, cost more than the kernel saves), so small inputs keep F.layer_norm; so
    do rows wider than MAX_GRAD_WIDTH when autograd records.
    Every norm of every forward asks, so the cheapest test (size) goes first, and the bias is
    not read (a module's parameter read costs ~0.4 µs): its autograd is `norm`'s business.
    """
    if not _enabled["norm"] or not isinstance(x, torch.Tensor) or x.ndim == 0:  # (fx Proxy: no)
        return False
    n, d = x.numel(), x.shape[-1]
    if d == 0 or n < MIN_ROWS[False] * d:
        return False
    if _tracing() or not (_plain(x) and _plain(gain) and gain.shape == (d,)):
        return False
    if _needs_grad(x, gain) and (n < MIN_ROWS[True] * d or d > MAX_GRAD_WIDTH):
        return False
    return load() is not None


_wrapped = torch._C._functorch.is_functorch_wrapped_tensor


_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def _plain(t: torch.Tensor) -> bool:
    """A float32 CPU tensor whose data C can read through its pointer: not a subclass (a
    FakeTensor's pointer points at nothing: C would crash), nor a vmap wrapper, nor the
    storage-less gradients a batched backward, `is_grads_batched`, hands a Function, nor a
    lazily negated view (`z.conj().imag`, or a gradient autograd hands back through one),
    whose memory holds the values before their sign is applied."""
    return (type(t) in _PLAIN_TYPES and t.dtype is torch.float32 and t.is_cpu
            and not _wrapped(t) and torch._C._has_storage(t) and not t.is_neg())


def _tracing() -> bool:
    """Under torch.compile or jit.trace a ctypes call would not be recorded (an fx trace hands
    `norm_applies` a Proxy, which it turns away first); under forward-mode AD (`dual_level`) it
    would drop the tangent, and the Functions have no `jvp`; under a `torch.func` transform
    (`grad`, `vmap`) a Function needs a `setup_context` these do not have."""
    return (torch.compiler.is_compiling() or torch.jit.is_tracing()
            or torch.autograd.forward_ad._current_level >= 0
            or torch._C._functorch.peek_interpreter_stack() is not None)


def _kernel() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError("normlab.model.native: the kernels are not built (see the warning)")
    return lib


def _threads(n_rows: int) -> int:
    return max(1, min(torch.get_num_threads(), n_rows // ROWS_PER_THREAD))


def _rows(t: torch.Tensor) -> tuple[int, int, int, int, int]:
    """Where C finds the rows of t (its `rowmap`): a contiguous [..., D] tensor, or a
    [B, T, H, D] view with D contiguous (rows in (b, t, h) order, any other strides)."""
    if t.is_contiguous():
        return 1, 1, t.shape[-1], 0, 0
    _, n_t, n_h, _ = t.shape
    return n_t, n_h, t.stride(0), t.stride(1), t.stride(2)


def _strided_rows(t: torch.Tensor) -> bool:
    """Whether C can read t's rows in place (`_rows`)."""
    return t.is_contiguous() or (t.ndim == 4 and t.stride(3) == 1)


def _forward(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float, center: bool,
    head_major: bool = False, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x: contiguous [..., D] -> (y, mean [N], rstd [N]); y is [..., D], or with `head_major`
    (x [B, T, H, D]) the contiguous [B, H, T, D] tensor whose `.transpose(1, 2)` is the norm;
    with `rope` tables (cos, sin2), head-major and rotated (`norm_rope_applies` holds)."""
    d = x.shape[-1]
    n = x.numel() // d
    y = x.new_empty(x.shape[0], x.shape[2], x.shape[1], d) if head_major else torch.empty_like(x)
    mean, rstd = x.new_empty(n), x.new_empty(n)
    bias = None if b is None else b.data_ptr()
    if rope is not None:
        bt, t, h, _ = x.shape
        yb, yt, yh, _ = y.transpose(1, 2).stride()
        _kernel().nl_norm_rope_fwd(
            x.data_ptr(), w.data_ptr(), bias, y.data_ptr(), mean.data_ptr(), rstd.data_ptr(),
            bt, t, h, d, int(center), eps, rope[0].data_ptr(), rope[1].data_ptr(), yb, yt, yh,
            min(_threads(n), bt * t),  # threads split the B * T positions
        )  # fmt: skip
        return y, mean, rstd
    _kernel().nl_norm_fwd(
        x.data_ptr(), w.data_ptr(), bias, y.data_ptr(), mean.data_ptr(), rstd.data_ptr(), n, d,
        int(center), eps, _threads(n), *_rows(y.transpose(1, 2) if head_major else y),
    )  # fmt: skip
    return y, mean, rstd


def torch_norm(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, eps: float, center: bool
) -> torch.Tensor:
    """The same norm by torch's fused ops (`Norm`'s path wherever the kernel is not taken),
    differentiable to any order."""
    if center:
        return torch.nn.functional.layer_norm(x, w.shape, w, b, eps)
    y = torch.nn.functional.rms_norm(x, w.shape, w, eps)
    return y if b is None else y + b  # the kernel's RMSNorm takes a bias too


class _NormFn(torch.autograd.Function):
    """With `head_major` it returns the contiguous [B, H, T, D] tensor, and `norm` transposes
    it outside (as `_RopeFn`: a view made inside a Function could not be changed in place by a
    hook). With RoPE tables (cos, sin2) it is QK-Norm then RoPE in one kernel call each way."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None,
        eps: float,
        center: bool,
        head_major: bool,
        cos: torch.Tensor | None,
        sin2: torch.Tensor | None,
    ) -> torch.Tensor:
        rope = None if cos is None or sin2 is None else (cos, sin2)
        y, mean, rstd = _forward(x, w, b, eps, center, head_major, rope)
        ctx.save_for_backward(x, w, b, mean, rstd, cos, sin2)
        ctx.eps, ctx.center, ctx.head_major = eps, center, head_major  # type: ignore[attr-defined]
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, w, b, mean, rstd, cos, sin2 = ctx.saved_tensors
        if ctx.head_major:
            gy = gy.transpose(1, 2)  # x's layout, [B, T, H, D], whatever its strides
        rest = (None, None, None, None, None)  # eps, center, head_major, cos, sin2
        if torch.is_grad_enabled() or not _plain(gy):
            # create_graph=True (double backward, e.g. a gradient penalty), or a batched
            # gradient C cannot read: take the gradient through torch's ops, which are
            # differentiable and batch
            def by_torch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None
                         ) -> torch.Tensor:
                y = torch_norm(x, w, b, ctx.eps, ctx.center)
                return y if cos is None else torch_rope(y, cos, sin2)

            return (*_grads_by_torch(by_torch, (x, w, b), ctx.needs_input_grad, gy), *rest)
        d = x.shape[-1]
        n = x.numel() // d
        if cos is not None:  # the rotation undone block by block, inside the kernel
            bt, tt, h, _ = x.shape
            t = min(_threads(n), bt * tt)
            gx, gw, gb = torch.empty_like(x), x.new_empty(t, d), x.new_empty(t, d)
            _kernel().nl_norm_rope_bwd(
                gy.data_ptr(), *gy.stride(), x.data_ptr(), w.data_ptr(), mean.data_ptr(),
                rstd.data_ptr(), gx.data_ptr(), gw.data_ptr(), gb.data_ptr(), bt, tt, h, d,
                int(ctx.center), cos.data_ptr(), sin2.data_ptr(), t,
            )  # fmt: skip
            return gx, gw[0], None if b is None else gb[0], *rest
        # QKV-Norm's v gradient comes back head-major from attention's matmul: read in place
        g = gy if _strided_rows(gy) else gy.contiguous()
        t = _threads(n)
        # a strided gy just copied into g is held by nobody else: gx overwrites it
        gx = g if g is not gy else torch.empty_like(x)
        gw, gb = x.new_empty(t, d), x.new_empty(t, d)
        _kernel().nl_norm_bwd(
            g.data_ptr(), x.data_ptr(), w.data_ptr(), mean.data_ptr(), rstd.data_ptr(),
            gx.data_ptr(), gw.data_ptr(), gb.data_ptr(), n, d, int(ctx.center), t, *_rows(g),
        )  # fmt: skip
        return gx, gw[0], None if b is None else gb[0], *rest


def _grads_by_torch(
    fn: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor | None, ...],
    needs: tuple[bool, ...], gy: torch.Tensor,
) -> list[torch.Tensor | None]:
    """A Function's backward taken again through torch's ops (`fn`, differentiable and
    batching) where C cannot serve it: create_graph=True, or a batched gradient. Only the inputs
    that want a gradient are asked for: a frozen gain or bias, or an input that is data, is no
    leaf of this graph, and asking for it would raise. Each input goes in through a view of its
    own, so that one tensor passed twice (attention's q, k and v) gets each slot's gradient,
    not the sum over its slots in every one."""
    want = [i for i, t in enumerate(inputs) if t is not None and needs[i]]
    with torch.enable_grad():
        slots = [t if t is None or i not in want else t.view_as(t) for i, t in enumerate(inputs)]
        y = fn(*slots)
        gs = torch.autograd.grad(y, [slots[i] for i in want], gy, create_graph=True,
                                 allow_unused=True)
    out: list[torch.Tensor | None] = [None] * len(inputs)
    for i, g in zip(want, gs, strict=True):
        out[i] = g
    return out


def norm(
    x: torch.Tensor, gain: torch.Tensor, bias: torch.Tensor | None, eps: float, center: bool,
    head_major: bool = False, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """LayerNorm (`center`) or RMSNorm over the last dim, as F.layer_norm / F.rms_norm.

    Takes float32 CPU tensors, gain and bias [D] (`norm_applies` says when it pays); anything else
    goes to torch's ops, which compute it or raise their usual error. With `head_major`, for x
    [B, T, H, D] (per-head QK/QKV-Norm), the result is a [B, T, H, D] view of a contiguous
    [B, H, T, D] tensor, the layout attention's matmuls read, so `.transpose(1, 2)` hands
    them q, k or v without a copy (and their gradient comes back without one).
    With `rope` tables (cos, sin2, as `rope` takes them) the result is also rotated, as
    `rope(norm(x), cos, sin2)`, head-major, in one kernel call each way (QK-Norm then RoPE);
    callers check `norm_rope_applies` (`Norm` does, and calls the two otherwise).
    """
    if head_major and x.ndim != 4:
        raise ValueError(f"native.norm: head_major expects x [B, T, H, D], got {tuple(x.shape)}")
    transformed = _tracing()  # e.g. under torch.func.vmap: torch's ops, whatever the inputs
    if rope is not None and not transformed:
        if not (norm_applies(x, gain) and norm_rope_applies(x, *rope)):
            raise ValueError(
                "native.norm: with rope, expected what norm_applies and rope_applies take and "
                f"H * D <= {FUSE_MAX_ROW}; got x {tuple(x.shape)}, gain {tuple(gain.shape)}, "
                f"cos {tuple(rope[0].shape)}, sin2 {tuple(rope[1].shape)}"
            )
        head_major = True  # as RoPE's kernel writes q and k
    d = x.shape[-1] if x.ndim else 0
    ok = [t is None or (_plain(t) and t.shape == (d,)) for t in (gain, bias)]
    if transformed or not (d and _plain(x) and all(ok)):  # e.g. a bias under vmap
        y = torch_norm(x, gain, bias, eps, center)  # torch's ops, rotated too
        return y if rope is None else torch_rope(y, *rope)
    x, gain = x.contiguous(), gain.contiguous()
    bias = None if bias is None else bias.contiguous()
    cos, sin2 = (None, None) if rope is None else rope
    if _needs_grad(x, gain, bias):
        y = _NormFn.apply(x, gain, bias, eps, center, head_major, cos, sin2)
    else:
        y = _forward(x, gain, bias, eps, center, head_major, rope)[0]
    return y.transpose(1, 2) if head_major else y


def norm_rope_applies(x: torch.Tensor, cos: torch.Tensor, sin2: torch.Tensor) -> bool:
    """Whether `norm(..., rope=(cos, sin2))` takes these, given that `norm_applies` does: RoPE's
    kernel takes them (`rope_applies`) and a position's H * D floats fit FUSE_MAX_ROW."""
    return rope_applies(x, cos, sin2) and x.shape[2] * x.shape[3] <= FUSE_MAX_ROW


# --------------------------------------------------------------------------- RoPE


def rope_applies(x: torch.Tensor, cos: torch.Tensor, sin2: torch.Tensor) -> bool:
    """Whether `rope` should take these: x [B, P, H, D] of at least ROPE_MIN_ELEMENTS elements
    and contiguous tables [B, P, 1, D], all float32 on CPU, tables without gradients, eager,
    the kernel built. Every rotation asks, so the cheap tests go first.
    """
    if not _enabled["rope"] or not isinstance(x, torch.Tensor) or x.ndim != 4:
        return False
    if x.numel() < ROPE_MIN_ELEMENTS:
        return False
    if _tracing() or not all(_plain(t) for t in (x, cos, sin2)):
        return False
    b, p, _, d = x.shape
    if d % 2 or cos.shape != (b, p, 1, d) or sin2.shape != cos.shape:
        return False
    if cos.requires_grad or sin2.requires_grad or not (cos.is_contiguous()
                                                        and sin2.is_contiguous()):
        return False
    return load() is not None


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin2: torch.Tensor, transposed: bool,
            head_major: bool) -> torch.Tensor:
    """The kernel on x [B, P, H, D] of any strides. Returns y [B, P, H, D] contiguous, or with
    `head_major` the contiguous [B, H, P, D] tensor whose `.transpose(1, 2)` is y."""
    b, p, h, d = x.shape
    out = x.new_empty(b, h, p, d) if head_major else x.new_empty(b, p, h, d)
    y = out.transpose(1, 2) if head_major else out
    xb, xt, xh, xd = x.stride()
    yb, yt, yh, _ = y.stride()
    _kernel().nl_rope(x.data_ptr(), xb, xt, xh, xd, cos.data_ptr(), sin2.data_ptr(),
                      y.data_ptr(), yb, yt, yh, b, p, h, d, int(transposed),
                      min(_threads(b * p * h), b * p))  # threads split the B * P rows
    return out


def torch_rope(x: torch.Tensor, cos: torch.Tensor, sin2: torch.Tensor, transposed: bool = False
               ) -> torch.Tensor:
    """The same rotation by torch's ops, the very products and sums (`Rope`'s path wherever
    the kernel is not taken, and the backward of gradients C cannot read), differentiable to
    any order; tables broadcast against x."""
    h = x.shape[-1] // 2
    if transposed:
        return x * cos + torch.roll(x, h, dims=-1) * sin2
    return x * cos + torch.roll(x * sin2, h, dims=-1)


class _RopeFn(torch.autograd.Function):
    """The rotation is linear and orthogonal, so its backward is the transposed rotation: this
    Function again, which is why gradients of any order come from the same kernel.

    With `head_major` it returns the contiguous [B, H, P, D] tensor, and `rope` transposes it
    outside: a view made inside a Function could not be changed in place by a hook."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin2: torch.Tensor,
        transposed: bool,
        head_major: bool,
    ) -> torch.Tensor:
        ctx.save_for_backward(cos, sin2)
        ctx.transposed, ctx.head_major = transposed, head_major  # type: ignore[attr-defined]
        return _rotate(x, cos, sin2, transposed, head_major)

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        cos, sin2 = ctx.saved_tensors
        g = gy.transpose(1, 2) if ctx.head_major else gy  # [B, P, H, D], any strides
        # gy arrives as attention hands it back (head-major, often transposed): read in place.
        # The forward's shape, dtype and device checks hold for it and are not redone, so
        # switching the kernel off between forward and backward cannot strand the backward.
        if not _plain(g):  # a batched gradient (vmap): no data pointer to hand C
            gx = torch_rope(g, cos, sin2, not ctx.transposed)
        elif torch.is_grad_enabled():  # create_graph: this backward must be differentiable too
            gx = _RopeFn.apply(g, cos, sin2, not ctx.transposed, False)
        else:
            gx = _rotate(g, cos, sin2, not ctx.transposed, False)
        return gx, None, None, None, None


def rope(x: torch.Tensor, cos: torch.Tensor, sin2: torch.Tensor, transposed: bool = False,
         head_major: bool = False) -> torch.Tensor:
    """`x * cos + roll(x * sin2, D // 2, dims=-1)`, `Rope`'s rotation, on x [B, P, H, D] with
    tables [B, P, 1, D] (`sin2 = cat(sin, -sin)`); `transposed` rotates back (the backward).

    Bitwise the result of those torch ops, forward and backward. x may have any strides. With
    `head_major` the result is a [B, P, H, D] view of a contiguous [B, H, P, D] tensor, the
    layout attention's matmuls read, so `.transpose(1, 2)` hands them q or k without a copy.
    Callers check `rope_applies` (`Rope` does, and runs the torch ops otherwise).
    """
    if not rope_applies(x, cos, sin2):
        raise ValueError(
            "native.rope: expected float32 CPU x [B, P, H, D] (D even, >= ROPE_MIN_ELEMENTS) "
            "and contiguous tables [B, P, 1, D] without gradients, and the kernel built; got x "
            f"{tuple(x.shape)}, cos {tuple(cos.shape)}, sin2 {tuple(sin2.shape)}"
        )
    if torch.is_grad_enabled() and x.requires_grad:
        out = _RopeFn.apply(x, cos, sin2, transposed, head_major)
    else:
        out = _rotate(x, cos, sin2, transposed, head_major)
    return out.transpose(1, 2) if head_major else out


# --------------------------------------------------------------------------- decoding attention

ATTN_MAX_KEYS = 4096  # the kernel keeps a row's scores on the stack (native.c's ATTN_MAX_KEYS)


def attend_applies(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: torch.Tensor,
    mask: torch.Tensor | None,
) -> bool:
    """Whether `attend` should take this attention: one query a row, q [B, H, 1, D], over
    k, v [B, KVH, T, D] (H a multiple of KVH; d contiguous, other strides free), 1 <= T <=
    ATTN_MAX_KEYS, scale [H], mask None or bool [B or 1, 1, 1, T]; float32 on CPU, eager, no
    autograd (the kernel has no backward: a decoding step needs none), no autocast (its
    float32 would differ from the prompt's bfloat16 attention), the kernel built.
    """
    if not _enabled["attn"] or not isinstance(q, torch.Tensor) or q.ndim != 4 or q.shape[2] != 1:
        return False
    if _tracing() or _needs_grad(q, k, v, scale):
        return False
    if not all(_plain(t) for t in (q, k, v, scale)):
        return False
    if torch.is_autocast_enabled("cpu"):  # as `attention_applies`: torch's matmuls in bfloat16
        return False
    b, h, _, d = q.shape
    if k.ndim != 4 or v.shape != k.shape or k.shape[0] != b or k.shape[3] != d:
        return False
    kvh, t = k.shape[1], k.shape[2]
    if not (0 < t <= ATTN_MAX_KEYS and kvh and h % kvh == 0 and scale.shape == (h,)):
        return False
    if q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1 or scale.stride(0) != 1:
        return False
    if mask is not None and not (
        mask.dtype is torch.bool and mask.is_cpu and mask.ndim == 4
        and mask.shape[0] in (1, b) and mask.shape[1:] == (1, 1, t)
    ):
        return False
    return load() is not None


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """`softmax(q @ k.T * scale[h] masked to -inf where not mask) @ v` for one query a row:
    q [B, H, 1, D], k, v [B, KVH, T, D] (head h reads k/v head h // (H // KVH)) -> z
    [B, H, 1, D]. The attention of a cached decoding step in one pass, where ATen's explicit
    path is five ops. Equal to it to float32 rounding (tests/test_native.py). Callers check
    `attend_applies` (`Attention` does, and runs torch's ops otherwise).
    """
    if not attend_applies(q, k, v, scale, mask):
        raise ValueError(
            "native.attend: expected float32 CPU q [B, H, 1, D], k and v [B, KVH, T, D] "
            f"(d contiguous, 1 <= T <= {ATTN_MAX_KEYS}), scale [H], mask None or bool "
            "[B or 1, 1, 1, T], no autograd, and the kernel built; got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, scale "
            f"{tuple(scale.shape)}, mask {None if mask is None else tuple(mask.shape)}"
        )
    b, h, _, d = q.shape
    kvh, t = k.shape[1], k.shape[2]
    z = q.new_empty(b, h, 1, d)
    mb = 0 if mask is None or mask.shape[0] == 1 else mask.stride(0)
    _kernel().nl_attn1(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), *k.stride()[:3], v.data_ptr(),
        *v.stride()[:3], scale.data_ptr(), None if mask is None else mask.data_ptr(), mb,
        0 if mask is None else mask.stride(3), z.data_ptr(), b, h, h // kvh, t, d,
        min(_threads(b * h * -(-t // 8)), b * h),  # a row of t keys is worth t / 8 norm rows
    )  # fmt: skip
    return z


# --------------------------------------------------------------------------- GELU in training


def linear_gelu_applies(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None
                        ) -> bool:
    """Whether `linear_gelu` should take `gelu(x @ w + b)`: w [d, m] wanting its gradient
    (autograd recording; without it ATen's GELU forward, faster alone, runs; and a frozen w's
    torch path keeps no x, which the Function would), x [..., d] and b None or [m], float32
    CPU tensors, at least GELU_MIN_ELEMENTS pre-activation elements, eager, no autocast, the
    kernel built."""
    if not _enabled["gelu"] or not isinstance(x, torch.Tensor) or x.ndim < 2 or w.ndim != 2:
        return False
    d, m = w.shape
    if x.shape[-1] != d or x.numel() // max(d, 1) * m < GELU_MIN_ELEMENTS:
        return False
    if not _needs_grad(w) or _tracing() or not (_plain(x) and _plain(w)):
        return False
    if b is not None and not (_plain(b) and b.shape == (m,)):
        return False
    if torch.is_autocast_enabled("cpu"):  # x @ w would be bfloat16 (mixed precision)
        return False
    return load() is not None


def torch_linear_gelu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The same function by torch's ops (differentiable to any order)."""
    h = x @ w
    return torch.nn.functional.gelu(h if b is None else h + b)


class _LinearGeluFn(torch.autograd.Function):
    """gelu(x @ w + b), saving x, w and the GELU's derivative (not the pre-activation): the
    backward's GELU is one multiply, and its matmuls are the ones autograd would run."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        w: torch.Tensor,
        b: torch.Tensor | None,
    ) -> torch.Tensor:
        h = x @ w
        if b is not None:
            h += b
        if h.dtype is not torch.float32 or not h.is_contiguous():  # what C reads, or nothing
            raise RuntimeError(f"native.linear_gelu: x @ w came out {h.dtype}, "
                               f"contiguous={h.is_contiguous()}; expected contiguous float32")
        y, dh = torch.empty_like(h), torch.empty_like(h)
        n_rows = h.numel() // h.shape[-1]
        _kernel().nl_gelu_fwd(h.data_ptr(), y.data_ptr(), dh.data_ptr(), h.numel(),
                              _threads(n_rows))
        ctx.save_for_backward(x, w, b, dh)
        return y

    @staticmethod
    def backward(ctx: Any, gy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        x, w, b, dh = ctx.saved_tensors
        want = ctx.needs_input_grad
        if torch.is_grad_enabled():
            # create_graph=True (a gradient penalty): the derivative saved is a constant to
            # autograd, so the gradient is taken again through torch's differentiable ops
            return tuple(_grads_by_torch(torch_linear_gelu, (x, w, b), want, gy))
        gh = gy * dh  # [..., m]
        gx = gh @ w.T if want[0] else None
        gh2, x2 = gh.reshape(-1, gh.shape[-1]), x.reshape(-1, x.shape[-1])
        gw = x2.T @ gh2 if want[1] else None
        gb = gh2.sum(0) if b is not None and want[2] else None
        return gx, gw, gb


def linear_gelu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`F.gelu(x @ w + b)` (exact GELU) for a training step: x [..., d], w [d, m], b [m] or None.

    Equal to torch's ops to float32 rounding, forward and backward, and differentiable to any
    order (a second-order gradient goes through torch's ops). Callers check
    `linear_gelu_applies` (`MLP` does, and runs torch's ops otherwise).
    """
    if not linear_gelu_applies(x, w, b):
        raise ValueError(
            "native.linear_gelu: expected float32 CPU x [..., d], w [d, m] wanting its "
            f"gradient, at least {GELU_MIN_ELEMENTS} elements of x @ w, b None or [m], no "
            f"autocast, and the kernel built; got x {tuple(x.shape)}, w {tuple(w.shape)}, "
            f"b {None if b is None else tuple(b.shape)}"
        )
    return _LinearGeluFn.apply(x, w, b)


# ------------------------------------------------------------------ attention of short rows

def attention_applies(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: torch.Tensor,
    mask: torch.Tensor | None,
) -> bool:
    """Whether `attention` can take `softmax(q k^T * scale, masked) v`: q [B, H, T, D], k, v
    [B, H, S, D] (as many heads: grouped ones are repeated first), d contiguous and the other
    strides free, scale [H], mask None or a 4-d bool tensor of sizes 1 or [B, H, T, S]'s;
    float32 CPU tensors, eager, no autocast, the kernel built. With or without autograd (q, k, v and
    scale may want gradients; the mask is data). Any number of keys: `Attention` asks only
    where the kernel is faster than SDPA's flash kernel (`attention.kernel_by_default`: at
    most 64 keys on CPU, or causal rows within `attention.KERNEL_BOUNDS_CPU`)."""
    if (not _enabled["attention"] or not isinstance(q, torch.Tensor) or q.ndim != 4
            or not isinstance(k, torch.Tensor) or k.ndim != 4):
        return False
    b, h, t, d = q.shape
    s = k.shape[2]
    if not (t and b and h and d and s):
        return False
    if k.shape != (b, h, s, d) or v.shape != k.shape or scale.shape != (h,):
        return False
    if _tracing() or not all(_plain(x) for x in (q, k, v, scale)):
        return False
    if q.stride(3) != 1 or k.stride(3) != 1 or v.stride(3) != 1 or scale.stride(0) != 1:
        return False
    if torch.is_autocast_enabled("cpu"):  # the explicit path's matmuls would be bfloat16
        return False
    if mask is not None and not (
        type(mask) is torch.Tensor and mask.dtype is torch.bool and mask.is_cpu and mask.ndim == 4
        and mask.layout is torch.strided and torch._C._has_storage(mask)
        and all(m in (1, n) for m, n in zip(mask.shape, (b, h, t, s), strict=True))
    ):
        return False
    return load() is not None


def _i64s(*xs: int) -> ctypes.Array:
    return (ctypes.c_int64 * len(xs))(*xs)


def _mask_strides(mask: torch.Tensor | None, shape: tuple[int, ...]) -> ctypes.Array:
    """The mask's strides over [B, H, T, S], 0 where it broadcasts or the size is 1 (so that a
    causal [1, 1, T, S] mask reads as the same for every (b, h) at batch 1 too)."""
    if mask is None:
        return _i64s(0, 0, 0, 0)
    return _i64s(*(0 if n == 1 else st for n, st in
                   zip(shape, mask.expand(*shape).stride(), strict=True)))


def _attention_threads(b: int, h: int, t: int, s: int) -> int:
    """Threads split the groups of eight (b, h) rows; a query of s keys counts as s / 8 norm
    rows toward ROWS_PER_THREAD."""
    return min(_threads(b * h * t * -(-s // 8)), -(-b * h // 8))


def _attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: torch.Tensor,
    mask: torch.Tensor | None, save_p: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """z as [B, T, H, D] (contiguous: `_out`'s flatten is then free) and, if `save_p`, the
    weights in the kernel's layout ([B*H/8 rounded up, T, S, 8]: eight rows side by side)."""
    b, h, t, d = q.shape
    s = k.shape[2]
    z = q.new_empty(b, t, h, d)
    p = q.new_empty(-(-b * h // 8), t, s, 8) if save_p else None
    failed = _kernel().nl_tattn_fwd(
        q.data_ptr(), _i64s(*q.stride()[:3]), k.data_ptr(), _i64s(*k.stride()[:3]),
        v.data_ptr(), _i64s(*v.stride()[:3]), scale.data_ptr(),
        None if mask is None else mask.data_ptr(), _mask_strides(mask, (b, h, t, s)),
        z.data_ptr(), _i64s(*z.transpose(1, 2).stride()[:3]),
        None if p is None else p.data_ptr(), b, h, t, s, d, _attention_threads(b, h, t, s),
    )  # fmt: skip
    if failed:
        raise MemoryError("native.attention: no memory for the kernel's scratch")
    return z, p


def torch_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: torch.Tensor,
    mask: torch.Tensor | None,
) -> torch.Tensor:
    """The same attention by torch's ops (differentiable to any order): z [B, T, H, D]."""
    scores = (q @ k.transpose(-1, -2)) * scale[:, None, None]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


class _AttentionFn(torch.autograd.Function):
    """Returns z [B, T, H, D] contiguous; `attention` makes the [B, H, T, D] view outside (a
    view made inside a Function could not be changed in place by a hook)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        z, p = _attention_forward(q, k, v, scale, mask, save_p=True)
        ctx.save_for_backward(q, k, v, scale, mask, p)
        return z

    @staticmethod
    def backward(ctx: Any, gz: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        q, k, v, scale, mask, p = ctx.saved_tensors
        need = ctx.needs_input_grad
        if torch.is_grad_enabled() or not _plain(gz):
            # create_graph=True, or a batched gradient C cannot read: torch's ops
            gs = _grads_by_torch(lambda q, k, v, scale: torch_attention(q, k, v, scale, mask),
                                 (q, k, v, scale), need[:4], gz)
            return (*gs, None)
        if gz.stride(3) != 1:  # C reads d contiguous (`.sum()`'s gradient is one expanded value)
            gz = gz.contiguous()
        b, h, t, d = q.shape
        s = k.shape[2]
        dq, dk, dv = q.new_empty(b, h, t, d), k.new_empty(b, h, s, d), v.new_empty(b, h, s, d)
        dscale = q.new_empty(b, h)
        g = gz.transpose(1, 2)  # [B, H, T, D] through its strides
        failed = _kernel().nl_tattn_bwd(
            q.data_ptr(), _i64s(*q.stride()[:3]), k.data_ptr(), _i64s(*k.stride()[:3]),
            v.data_ptr(), _i64s(*v.stride()[:3]), p.data_ptr(), g.data_ptr(),
            _i64s(*g.stride()[:3]), scale.data_ptr(), None if mask is None else mask.data_ptr(),
            _mask_strides(mask, (b, h, t, s)), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
            dscale.data_ptr(), b, h, t, s, d, _attention_threads(b, h, t, s),
        )  # fmt: skip
        if failed:
            raise MemoryError("native.attention: no memory for the kernel's scratch")
        return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None,
                dscale.sum(0) if need[3] else None, None)


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """`softmax(q @ k.T * scale[h], -inf where not mask) @ v`: q [B, H, T, D], k, v [B, H, S,
    D], scale [H] -> z [B, H, T, D] (a view of contiguous [B, T, H, D] memory, the layout the
    output projection reads).

    Explicit attention's eight ops in one kernel pass each way; differentiable in q, k, v and
    scale (to any order: a second-order gradient goes through torch's ops). Equal to torch's to
    float32 rounding for finite inputs: against float64, z and every gradient stay within
    float32's first-order rounding bound (the tests' `attention_rounding_bounds`: a sum of n
    terms adds n 2^-24 of its |terms|; a score's rounding, (d_head + 1) 2^-24 scale |q| . |k|,
    passes through the softmax; dscale's in the kernel's order of sums). In 432 cases (every
    mask, the tests' shapes up to 512 keys, seeds 0-2, q and k scaled 1, 4 and 8 times) each
    used at most 0.13 of its bound (torch's float32 ops 0.25), but where p is below e^-80
    (the bound's floor: the kernel's exponential is 0 there); dscale's bound is sound but
    loose, as its terms cancel (each query's ds sums to 0). The tighter precision once stated
    held at the tests' inputs, not at others: z, dq, dk, dv within twice torch's own error up
    to 64 keys (3.5 times with q and k scaled 4 times), dscale within 1e-5 of its largest
    value (3.5e-5 at another seed, 1e-3 scaled). A query whose keys are all masked is NaN, as
    torch's softmax makes it; it passes no gradient to q, k or the scale (as torch's
    `masked_fill` backward), and NaN to v's only where torch's is NaN too (under one mask for
    every row, none: its keys are never read). Where the mask is the same for every (b, h),
    keys past a query's last visible one (a causal mask's upper triangle) are never read, so an
    inf or NaN in their values, which torch's `0 * v` would spread, stays out; under a mask per
    row, so are keys that none of a group of eight (b, h) rows may see (padding they
    share). Made for short rows: each thread's scratch is about 8 (2 T S + 4 (T + S) D) floats,
    and 8 T S bytes under a mask per row. Callers check `attention_applies` (`Attention` does,
    and runs torch's ops otherwise).
    """
    if not attention_applies(q, k, v, scale, mask):
        raise ValueError(
            "native.attention: expected float32 CPU q [B, H, T, D], k and v [B, H, S, D] (d "
            "contiguous), scale [H], mask None or 4-d bool of sizes 1 or [B, H, T, S]'s, and "
            "the kernel built; got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, scale "
            f"{tuple(scale.shape)}, mask {None if mask is None else tuple(mask.shape)}"
        )
    if _needs_grad(q, k, v, scale):
        z = _AttentionFn.apply(q, k, v, scale, mask)
    else:
        z = _attention_forward(q, k, v, scale, mask, save_p=False)[0]
    return z.transpose(1, 2)
