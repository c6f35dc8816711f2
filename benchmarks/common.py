"""Shared helpers for the benchmarks: CLI flags, paired timing, machine facts, Markdown.

Timing rule: contenders are timed side by side in one process, alternating per repeat (the
order is reversed every other repeat to cancel drift), and we report the median over repeats
plus the median of the per-repeat ratios. Nothing here asserts a time; benchmarks only report.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from normlab import allocator, io
from normlab.config import PRECISIONS
from normlab.io import atomic_write_text, git_commit
from normlab.model import native
from normlab.stats import median_ci

ROOT = Path(__file__).resolve().parent.parent


def positive_int(text: str) -> int:
    """argparse type: an int >= 1, else a one-line usage error naming the flag."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1; got {text!r}")
    return value


def positive_ints(text: str) -> list[int]:
    """argparse type: comma-separated ints >= 1 (e.g. `--widths 64,128`)."""
    try:
        return [positive_int(part) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated ints >= 1; got {text!r}") from None


def refuse_overwrite(parser: argparse.ArgumentParser, path: str | Path | None, force: bool,
                     flag: str = "--out") -> None:
    """Before any work: an existing result file is replaced only when asked (`--force`), and
    the file can be written (a folder, or a folder this process cannot write to, failed at the
    end, after every benchmark had run). Its name is a name, not a pattern: `r[1].json` was
    replaced unasked, since as a pattern it matches `r1.json` and not itself."""
    if path is None:
        return
    path = Path(path)
    try:
        if path.is_dir():
            raise ValueError(f"{str(path)!r} is a folder; expected a file to write the result to")
        try:
            io.check_out_folder(path.parent, name="its folder")
        except ValueError as err:
            raise ValueError(f"{str(path)!r} cannot be written: {err}") from None
        io.refuse_overwrite(path.parent, path.name, force)
    except ValueError as err:
        parser.error(f"{flag}: {err}")


def command(argv: Sequence[str] | None = None) -> list[str]:
    """The command line a result was made by: the script and `argv` as its `main` got them
    (called from Python, `sys.argv` is the caller's), else the process's own."""
    return list(sys.argv) if argv is None else [Path(sys.argv[0]).name, *argv]


def write_result(path: str | Path, obj: Any, argv: Sequence[str] | None = None) -> None:
    """A result JSON, written atomically (a crash leaves the old file or the new, never half),
    with the command that made it (`--quick`, `--repeats`, the benchmark's own flags: a single
    benchmark's file recorded none of them); `argv`: as its `main` got them."""
    doc = {"command": command(argv)} | obj if isinstance(obj, dict) else obj
    atomic_write_text(Path(path), json.dumps(doc, indent=1, default=str) + "\n")


def add_common_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--quick", action="store_true", help="a few seconds: checks it runs")
    parser.add_argument("--force", action="store_true",
                        help="overwrite an existing --out (--json) result file")
    parser.add_argument("--threads", type=positive_int, default=1,
                        help="torch.set_num_threads (default 1)")
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help="override the repeat count(s)")
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="where models run (default cpu); the collapse sweep and the "
                             "scaling runs are CPU-only and report themselves skipped on cuda")
    return parser


DEVICES = ("cpu", "cuda")


def add_precision_arg(parser: argparse.ArgumentParser) -> None:
    """`--precision`, as `train.precision`: bfloat16 runs the training steps' forward and loss
    under autocast (every contender alike) and measures the matmul peak in bfloat16."""
    parser.add_argument("--precision", choices=PRECISIONS, default="float32",
                        help="training steps in float32 (default) or bfloat16 autocast")


def setup_device(name: str) -> torch.device:
    """The device a benchmark's models run on; a one-line error for cuda without CUDA."""
    if name not in DEVICES:
        raise ValueError(f"--device: expected one of {', '.join(DEVICES)}; got {name!r}")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: this torch ({torch.__version__}) sees no CUDA device")
    return torch.device(name)


def start(args: argparse.Namespace) -> tuple[torch.device, dict[str, Any]]:
    """A benchmark's set-up: threads and malloc as the command has them (`setup_threads`),
    its device (`--device`; callers that build their own args may leave it out: cpu), and the
    machine facts taken at its start (`load_note` measures from them)."""
    threads = setup_threads(args.threads)
    device = setup_device(getattr(args, "device", "cpu"))
    return device, machine_info(threads, device)


def cpu_only(args: argparse.Namespace, benchmark: str, why: str) -> dict[str, Any] | None:
    """The result of a CPU-only benchmark asked to run on a GPU: skipped, saying why; None on
    CPU (run it)."""
    device = getattr(args, "device", "cpu")
    if device == "cpu":
        return None
    return {"benchmark": benchmark, "info": machine_info(setup_threads(args.threads)),
            "skipped": f"CPU only ({why}); asked for --device {device}"}


def sync(device: torch.device | None) -> None:
    """Wait for the device's queued work: a GPU returns from a launch before the kernel ran,
    so a timer read without this would time the launches, not the work."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def setup_threads(n: int) -> int:
    """The process as the `normlab` command runs it: n torch threads, and glibc's malloc
    keeping freed memory (`normlab.allocator`; `NORMLAB_MALLOC=default` to measure without)."""
    allocator.keep_freed_memory()
    torch.set_num_threads(n)
    return torch.get_num_threads()


def repeats_for(args: argparse.Namespace, quick: int, full: int) -> int:
    if args.repeats is not None:
        return args.repeats
    return quick if args.quick else full


def paired_timing(
    contenders: Mapping[str, Callable[[], Any]],
    *,
    repeats: int,
    inner: int = 1,
    warmup: int = 1,
    device: torch.device | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each contender, one entry per repeat, contenders interleaved,
    after `warmup` untimed rounds (each contender once a round, in the given order): the heap
    as rounds of all of them leave it, not as one contender's calls back to back do
    (bench_scaling's largest steps fault in fresh pages for their first rounds among the
    others).

    On a GPU (`device`), the queue is drained (`sync`) before each timed repeat starts and
    before it stops, so a repeat holds its kernels' run time and no earlier contender's.

    As `timeit` does, Python's garbage collector is off while they run (one collection
    first), so that no collection lands inside a timed call. Until the twentieth session a
    collection ran before every call instead: walking the process's objects (~170,000 in
    bench_decode's) left each call to start with cold caches, 3-5 ms more per decode, a fixed
    cost that lowered the cached decode's speed-up (`benchmarks/probes/decode_gc.py`,
    docs/performance.md). No contender of `make bench` leaves cyclic garbage to pile up
    meanwhile, so none is spared a cost it would pay (`benchmarks/probes/gc_cycles.py`).
    """
    for _ in range(warmup):
        for fn in contenders.values():
            fn()
    sync(device)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        for r in range(repeats):
            for name in names if r % 2 == 0 else names[::-1]:
                fn = contenders[name]
                sync(device)
                t0 = time.perf_counter()
                for _ in range(inner):
                    fn()
                sync(device)
                times[name].append((time.perf_counter() - t0) / inner)
    finally:
        if was_enabled:
            gc.enable()
    return times


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


def ratio_stats(num: Sequence[float], den: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and a median CI of the per-repeat ratios num[i] / den[i] (paired)."""
    rs = [a / b for a, b in zip(num, den, strict=True) if b > 0]
    ci = median_ci(rs)
    return {"median": median(rs), "min": min(rs), "max": max(rs), "n": len(rs),
            "ci": [ci["lo"], ci["hi"]], "ci_coverage": ci["coverage"],
            "ratios": rs}  # each repeat's, so the CI can be recomputed from the file


def summary(times: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and count of a contender's times, and its median's CI (`ci_s`, with
    its coverage), from which a quantity over the time (MFU) takes its own."""
    ci = median_ci(times)
    return {"median_s": median(times), "min_s": min(times), "max_s": max(times), "n": len(times),
            "ci_s": [ci["lo"], ci["hi"]], "ci_coverage": ci["coverage"],
            "times_s": list(times)}  # each repeat's, so the CI can be recomputed from the file


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_counters() -> dict[str, float] | None:
    """CPU seconds so far: busy and stolen over all CPUs (/proc/stat), and this process's own.

    `own` includes waited-for children (bench_scaling measures memory in subprocesses).
    None where /proc/stat is missing (not Linux).
    """
    try:
        with open("/proc/stat") as f:
            fields = [float(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0.0] * 8)[:8]
    t = os.times()
    return {"wall": time.monotonic(), "busy": (user + nice + system + irq + softirq) / hz,
            "steal": steal / hz,
            "own": t.user + t.system + t.children_user + t.children_system}


def gpu_info(device: torch.device | None) -> dict[str, Any] | None:
    """The GPU a cuda run used, and the float32 matmul precision it ran at (PyTorch's default,
    'highest', keeps TF32 off, so float32 peaks and MFU are true float32); None on CPU."""
    if device is None or device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    return {"name": props.name, "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1),
            "multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda,
            "float32_matmul_precision": torch.get_float32_matmul_precision()}


def machine_info(threads: int, device: torch.device | None = None) -> dict[str, Any]:
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return {
        "device": "cpu" if device is None else device.type,
        "gpu": gpu_info(device),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        # ATen's vectorised kernel family on this CPU (AVX512 on both the Intel and the AMD
        # VMs this project has run on; AVX2 or DEFAULT elsewhere), so results say which ran
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": threads,
        "mkldnn": bool(torch.backends.mkldnn.is_available()),
        "native": native.describe(),  # normlab's CPU kernels (norms, RoPE), or why not
        "malloc": allocator.describe(),  # glibc keeping freed memory (setup_threads) or not
        "git": git_commit(),  # the same record as run folders: tracked changes make it -dirty
        "loadavg_1m_at_start": round(load[0], 2),
        "cpu_counters_at_start": cpu_counters(),
    }


OTHERS_BUSY_LIMIT = 0.25
"""CPUs' worth of time used by other processes, on average over a benchmark, that flags it."""
MIN_JUDGED_SECONDS = 1.0
"""Shorter benchmarks are not judged by /proc/stat: its 10 ms ticks would dominate."""


def load_note(info: dict[str, Any]) -> str:
    """A warning when other processes used the CPU while this benchmark ran; '' if none did.

    `info` is the benchmark's `machine_info`, taken at its start. Busy CPU time over all CPUs
    (/proc/stat) minus this process's own, over the wall time since then, is the load that
    competed with it; unlike the load average it neither lags nor counts the run's own
    threads. The measurement goes into `info['load_during']`. Without /proc/stat, or for a
    benchmark shorter than `MIN_JUDGED_SECONDS`, falls back to the 1-minute load average
    beyond the run's own threads.
    """
    before, now = info.get("cpu_counters_at_start"), cpu_counters()
    if before and now and now["wall"] - before["wall"] >= MIN_JUDGED_SECONDS:
        wall = now["wall"] - before["wall"]
        others = (now["busy"] - before["busy"] - (now["own"] - before["own"])) / wall
        steal = (now["steal"] - before["steal"]) / wall
        info["load_during"] = {"seconds": round(wall, 1), "others_busy_cpus": round(others, 3),
                               "stolen_cpus": round(steal, 3)}
        if others > OTHERS_BUSY_LIMIT:
            return (f"MEASURED UNDER LOAD (other processes kept {others:.2f} of "
                    f"{info['cpu_count']} CPUs busy on average): absolute timings are "
                    "disturbed; rerun on a quiet machine")
        return ""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    others = max(info["loadavg_1m_at_start"], load - info["threads"])
    if others > 0.5:
        return (f"MEASURED UNDER LOAD (1-min load average {max(load, others):.2f} on "
                f"{info['cpu_count']} CPUs, {info['threads']} thread(s) of them this run's): "
                "absolute timings are disturbed; rerun on a quiet machine")
    return ""


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "—"
    if isinstance(x, int):
        return f"{x:,}"
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
        return f"{x:.{digits}g}"
    # judged after rounding: 999.7 at 3 digits is 1,000, not "1e+03"
    return f"{x:,.{digits}g}" if abs(float(f"{x:.{digits}g}")) < 1000 else f"{x:,.0f}"


def rf(x: float | None) -> str:
    """A ratio for a table: two decimals."""
    return "—" if x is None else f"{x:.2f}"


def rci(stats: Mapping[str, Any] | None) -> str:
    """A ratio's median CI for a table: 'lo–hi (coverage %)'; '—' for results without one."""
    if not stats or "ci" not in stats:
        return "—"
    lo, hi = stats["ci"]
    return f"{lo:.2f}–{hi:.2f} ({100 * stats['ci_coverage']:.0f}%)"


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, bool) or not isinstance(v, int | float):
            return str(v)
        return f"{v:,}" if isinstance(v, int) else fmt(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def header(title: str, info: Mapping[str, Any], extra: str = "") -> str:
    kernels = f", {info['cpu_capability']} kernels" if info.get("cpu_capability") else ""
    line = (f"torch {info['torch']}, {info['threads']} thread(s), {info['cpu']} "
            f"({info['cpu_count']} CPUs{kernels}), {info['date']}")
    if info.get("gpu"):  # a cuda run: the models ran there
        gpu = info["gpu"]
        line = (f"on {gpu['name']} (CUDA {gpu['cuda']}, float32 matmul precision "
                f"{gpu['float32_matmul_precision']}); host: " + line)
    if info.get("native"):  # recorded from the seventeenth session on
        line += f"; normlab's CPU kernels: {info['native']}"
    elif info.get("native_norm"):  # the sixteenth session's files: the norm kernel only
        line += f"; normlab's CPU norm kernel: {info['native_norm']}"
    return f"### {title}\n\n{line}" + (f"\n\n{extra}" if extra else "")


def bench_main(
    doc: str,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    to_markdown: Callable[[dict[str, Any]], str],
    extra: Callable[[argparse.ArgumentParser], None] | None = None,
    early: Callable[[argparse.Namespace], bool] | None = None,
) -> None:
    """The command line every `bench_*.py` shares: common flags, run, print, optional JSON.

    `extra` adds a benchmark's own flags; `early(args)` may handle the call itself (and
    return True), e.g. a subprocess child mode.
    """
    parser = add_common_args(argparse.ArgumentParser(description=doc.splitlines()[0]))
    parser.add_argument("--out", default=None, help="write the JSON result here")
    if extra is not None:
        extra(parser)
    args = parser.parse_args()
    if early is not None and early(args):
        return
    refuse_overwrite(parser, args.out, args.force)
    try:
        res = run(args)
    except (ValueError, FileNotFoundError) as err:  # bad input (a flag, a run folder): one line
        parser.exit(2, f"{parser.prog}: error: {str(err).splitlines()[0]}\n")
    print(to_markdown(res))
    if args.out:
        write_result(args.out, res)
