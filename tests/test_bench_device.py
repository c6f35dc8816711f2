"""The benchmarks' `--device`: GPU runs time their kernels (not their launches), CPU-only
benchmarks say they are skipped, and asking for a GPU that is not there is one line.

No GPU is needed: `torch.cuda.synchronize` is replaced by a recorder where a cuda device is
named, and the CPU-only benchmarks return before touching any device.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import common

CUDA = torch.device("cuda")  # a device object only: nothing below allocates on it

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")


def test_paired_timing_drains_the_gpu_queue_around_every_timed_repeat(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A CUDA call returns when its kernels are queued: each repeat's clock must start on an
    empty queue and stop once its own kernels ran, or it times launches and inherits the
    previous contender's work."""
    log: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append("sync"))
    stamps: list[int] = []
    monkeypatch.setattr(common.time, "perf_counter", lambda: stamps.append(len(log)) or 0.0)

    def contender(name: str):
        return lambda: log.append(name)

    common.paired_timing({"a": contender("a"), "b": contender("b")}, repeats=2, inner=2,
                         warmup=1, device=CUDA)
    assert log == ["a", "b", "sync",  # warm-ups, then their work drained
                   "sync", "a", "a", "sync", "sync", "b", "b", "sync",  # repeat 0: a, b
                   "sync", "b", "b", "sync", "sync", "a", "a", "sync"]  # repeat 1: b, a
    # each clock read sits on the sync before (start) or after (stop) a repeat's calls
    starts, stops = stamps[0::2], stamps[1::2]
    assert all(log[i - 1] == "sync" and log[i] in "ab" for i in starts)
    assert all(log[i - 1] == "sync" and log[i - 2] in "ab" for i in stops)


def test_on_the_cpu_nothing_waits_for_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(device=None) -> None:
        raise AssertionError("synchronize called on a CPU run")

    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    times = common.paired_timing({"a": lambda: None}, repeats=2, device=torch.device("cpu"))
    assert len(times["a"]) == 2
    common.paired_timing({"a": lambda: None}, repeats=1)  # no device: the CPU, as before
    common.sync(None)
    common.sync(torch.device("cpu"))


@needs_no_cuda
def test_cuda_without_a_gpu_is_one_line_from_run_all_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    import run_all

    with pytest.raises(ValueError, match=r"^--device cuda: this torch \(.*\) sees no CUDA"):
        common.setup_device("cuda")
    with pytest.raises(ValueError, match="--device: expected one of cpu, cuda; got 'tpu'"):
        common.setup_device("tpu")
    with pytest.raises(SystemExit) as exit_info:
        run_all.main(["--quick", "--device", "cuda", "--out", str(tmp_path / "r.json")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error: --device cuda: this torch" in err[0]
    assert not (tmp_path / "r.json").exists()


@needs_no_cuda
@pytest.mark.parametrize(
    "name", ["bench_train_step", "bench_mfu", "bench_packing", "bench_decode", "bench_hooks"])
def test_cuda_without_a_gpu_is_one_line_from_each_benchmark_that_uses_it(
    name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import importlib

    mod = importlib.import_module(name)
    out = tmp_path / "r.json"
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--quick", "--device", "cuda",
                                      "--out", str(out)])
    with pytest.raises(SystemExit) as exit_info:
        mod.main()
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not out.exists()  # stopped before any work
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].endswith("error: --device cuda: this torch "
                                             f"({torch.__version__}) sees no CUDA device")


@pytest.mark.parametrize("name", ["bench_collapse", "bench_scaling"])
def test_cpu_only_benchmarks_report_themselves_skipped_on_a_gpu(name: str) -> None:
    """The collapse sweep runs normlab's analyses, which refuse a model off the CPU; the
    scaling runs read host memory. Asked for cuda, each returns a skipped result at once (no
    CUDA needed), which its Markdown and run_all's headlines render."""
    import importlib

    import run_all

    mod = importlib.import_module(name)
    args = argparse.Namespace(quick=True, threads=1, repeats=1, run=None, device="cuda")
    res = mod.run(args)
    assert res["skipped"].startswith("CPU only (") and res["skipped"].endswith(
        "asked for --device cuda")
    assert "skipped: CPU only" in mod.to_markdown(res)
    assert run_all.headline_rows({res["benchmark"]: res}) == []  # a skipped result: no rows
    assert common.cpu_only(argparse.Namespace(threads=1, device="cpu"), name, "why") is None


def test_machine_info_records_the_device_and_the_header_names_the_gpu() -> None:
    info = common.machine_info(1, torch.device("cpu"))
    assert info["device"] == "cpu" and info["gpu"] is None
    assert common.machine_info(1)["device"] == "cpu"
    assert " on " not in common.header("t", info).splitlines()[2]
    info["gpu"] = {"name": "NVIDIA H100 80GB HBM3", "cuda": "13.0",
                   "float32_matmul_precision": "highest"}
    line = common.header("t", info).splitlines()[2]
    assert line.startswith("on NVIDIA H100 80GB HBM3 (CUDA 13.0, float32 matmul precision "
                           "highest); host: torch ")


def test_mfu_reuses_a_train_step_result_only_from_the_same_device() -> None:
    """MFU reads the train-step benchmark's step times when run_all ran it first; a result
    from another device, thread count or precision times other steps, so MFU times its own
    (and measures its peak in the steps' precision)."""
    import bench_mfu

    args = argparse.Namespace(quick=True, threads=1, repeats=1, device="cpu")
    timed = {"64": {"contenders": {"normlab-pre": {"median_s": 0.5}}}}
    fake = {"info": {"threads": 1, "device": "cpu"}, "batch": 128, "seq_len": 17,
            "widths": timed}
    assert bench_mfu.run(args, train_step=fake)["timings"] == "bench_train_step result of this run"
    fake["info"]["device"] = "cuda"
    res = bench_mfu.run(args, train_step=fake)
    assert res["timings"] == "timed here" and res["info"]["device"] == "cpu"
    assert set(res["widths"]["64"]["contenders"]) == {"normlab-pre", "normlab-qkv", "nanogpt"}
    old = {"info": {"threads": 1}, "batch": 128, "seq_len": 17, "widths": timed}  # pre-device
    assert bench_mfu.run(args, train_step=old)["timings"] == "bench_train_step result of this run"
    mixed = dict(old, precision="bfloat16")  # steps in another precision: timed here, in its own
    assert bench_mfu.run(args, train_step=mixed)["timings"] == "timed here"
    bf16 = bench_mfu.run(argparse.Namespace(quick=True, threads=1, repeats=1, device="cpu",
                                            precision="bfloat16"), train_step=mixed)
    assert bf16["timings"] == "bench_train_step result of this run"
    assert bf16["peak"]["dtype"] == "bfloat16" and "best bfloat16 torch.mm" in \
        bench_mfu.to_markdown(bf16)


ROOT = Path(__file__).resolve().parents[1]


def test_make_bench_passes_bench_args_to_run_all() -> None:
    """`make bench BENCH_ARGS="--device cuda"` reaches run_all.py (`make -n`: printed, not
    run)."""
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("no make")

    def bench_line(*extra: str) -> str:
        out = subprocess.run(["make", "-n", "-C", str(ROOT), "bench", *extra],
                             capture_output=True, text=True, check=True).stdout
        return next(line for line in out.splitlines() if "run_all.py" in line).strip()

    assert bench_line('BENCH_ARGS=--device cuda --threads 2').endswith(
        "run_all.py --device cuda --threads 2")
    assert bench_line().endswith("run_all.py")


def test_the_gpu_script_runs_every_step_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks/gpu/run.sh as its header's CPU check runs it (DEVICE=cpu QUICK=1, PYTHON
    this interpreter): the benchmarks a GPU table holds, the two training runs and the
    summary, five files; run again into the same folder, it refuses in one line and keeps
    them; and a PYTHON without torch stops it in one line."""
    import json
    import os
    import subprocess

    script = ROOT / "benchmarks" / "gpu" / "run.sh"
    env = dict(os.environ, OUT=str(tmp_path / "out"), DEVICE="cpu", QUICK="1",
               PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:]
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_full.json", "gpu_full.md", "nvidia-smi.txt", "run.log", "tta.json"]
    full = json.loads((out / "gpu_full.json").read_text())
    assert sorted(full["results"]) == ["decode", "hooks", "mfu", "packing", "train_step"]
    assert not any("error" in r for r in full["results"].values())
    runs = json.loads((out / "tta.json").read_text())["runs"]
    assert sorted(r["placement"] for r in runs) == ["pre", "qkv"]
    # whole: its last line, the closing `date -u`, waited for (the script waits for its tee)
    log = (out / "run.log").read_text()
    assert log.rstrip().endswith("UTC " + full["info"]["date"][:4])
    assert "sync_check: skipped (CUDA's sync debug mode needs a GPU)" in log
    # before the training runs, which a lease may cut short; those finished within TTA_LIMIT
    assert log.index("sync_check:") < log.index("[pre-s0]") and "stopped at TTA_LIMIT" not in log

    before = {p.name: p.read_bytes() for p in out.iterdir()}  # run again: refused, kept
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout.strip().splitlines() == [
        f"run.sh: {out} already holds results; set OUT to another folder, or FORCE=1 to "
        "replace them"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    odd = dict(env, OUT=str(tmp_path / "odd"), TTA_LIMIT="2m")  # refused before any work
    proc = subprocess.run(["bash", str(script)], env=odd, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout.strip().splitlines() == [
        "run.sh: TTA_LIMIT=2m: expected whole seconds >= 1"]
    assert not (tmp_path / "odd").exists()

    bare = dict(env, OUT=str(tmp_path / "bare"), PYTHON=str(tmp_path / "no-torch"))
    (tmp_path / "no-torch").write_text("#!/bin/sh\nexit 1\n")
    (tmp_path / "no-torch").chmod(0o755)
    proc = subprocess.run(["bash", str(script)], env=bare, capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stdout.strip().splitlines() == [
        f"run.sh: {tmp_path / 'no-torch'} has no torch; set PYTHON to the interpreter that has it"]


def test_sync_check_counts_the_steps_synchronising_calls_and_skips_without_a_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """benchmarks/gpu/sync_check.py counts CUDA's synchronisation warnings in a run, outside
    evaluation. Without a GPU its counting is checked with a stand-in: every training loss
    warns as CUDA would, so a 10-step run counts 10; on the CPU, its command line says it is
    skipped."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))
    import warnings

    import sync_check

    import normlab.train as tr

    modes: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    loss_on, evaluate = tr.loss_on, tr.evaluate

    def warning_loss(*args, **kwargs):
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        return loss_on(*args, **kwargs)

    def warning_evaluate(*args, **kwargs):  # evaluation's warnings are not counted
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(tr, "loss_on", warning_loss)
    monkeypatch.setattr(tr, "evaluate", warning_evaluate)
    assert sync_check.synchronising_calls(10, "cpu", tmp_path, []) == 10
    learned = sync_check.VARIANTS["learned positions"]
    assert sync_check.synchronising_calls(3, "cpu", tmp_path, learned) == 3
    assert modes == ["warn", "default"] * 2 and tr.evaluate is warning_evaluate
    monkeypatch.setattr(sys, "argv", ["sync_check.py", "--device", "cpu"])
    assert sync_check.main() == 0
    assert capsys.readouterr().out == "sync_check: skipped (CUDA's sync debug mode needs a GPU)\n"
