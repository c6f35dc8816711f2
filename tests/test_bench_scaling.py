"""benchmarks/bench_scaling.py: the FLOP count is taken over the forwards that actually run,
and the task's sequence-length axes (a problem's n integers, d digits) are real problems."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_scaling as S
from normlab.analysis import collapse


def test_every_row_is_compared_with_its_own_familys_base() -> None:
    rows = dict(S.configs(quick=False))
    assert {S.base_row(m) for n, m in rows.items() if n.startswith(("seq_len", "d_model",
                                                                    "batch"))} == {"base"}
    assert S.base_row(rows["d x2"]) == S.base_row(rows["n x4"]) == S.PROBLEM_BASE_ROW
    assert S.shape("train", rows["n x2"]) == {"d_model": 64, "batch": 128, "n": 8, "d": 2}
    assert S.shape("train", rows["d x4"])["d"] == 8 and "seq_len" not in S.shape("train",
                                                                                  rows["d x4"])


def test_the_sweeps_count_covers_the_forwards_measure_collapse_runs(monkeypatch) -> None:
    """Real problems differ in length: the sweep runs the whole batch once (finding the sparse
    rows), then length groups at their own widths, once a draw. The count must be over those
    forwards, not over the batch padded to its longest row."""
    s = S.shape("collapse", dict(S.configs(quick=True))["n x2"])
    n_draws = 2
    work, n_mm, widths = S.make_work("collapse", s, n_draws)
    assert len(widths) > 2  # more than one length group on real problems
    seen: list[tuple[int, int]] = []
    inner = collapse.collect

    def spy(model, data, take, *, hooks=(), copies=1):
        seen.extend([(data.n_examples, data.lengths["tokens"])] * copies)
        return inner(model, data, take, hooks=hooks, copies=copies)

    monkeypatch.setattr(collapse, "collect", spy)
    work()
    assert sorted(seen) == sorted([widths[0], *widths[1:] * n_draws])
    d, L = s["d_model"], 4
    by_hand = sum(b * t * (2 * n_mm + 4 * L * t * d) for b, t in seen)
    assert S.flops("collapse", widths, d, n_mm, n_draws) == by_hand


def test_the_training_count_is_over_the_padded_problem_batch() -> None:
    s = S.shape("train", dict(S.configs(quick=True))["d x2"])
    _, n_mm, widths = S.make_work("train", s, 1)
    from normlab.tasks.addition import make_batch

    width = make_batch(S.problems(s), "decoder")["tokens"].shape[1]
    assert widths == [(128, width)]
    assert S.flops("train", widths, 64, n_mm, 1) == 128 * width * (6 * n_mm + 48 * width * 64)
    # over the keys each query sees, 1 + 2 + ... + width of them, what the kernel runs
    assert S.flops("train", widths, 64, n_mm, 1, causal=True) == 128 * (
        6 * n_mm * width + 48 * width * (width + 1) // 2 * 64)


def test_full_runs_time_each_row_after_the_warm_up_rounds(monkeypatch) -> None:
    """A full run times each row's step only after WARMUP_ROUNDS untimed calls (the largest
    steps fault in fresh pages up to their fifth call: the module's docstring), and says so in
    its JSON and Markdown; --quick keeps one. The steps and memory are stand-ins here; the
    untimed calls are the ones that run with the garbage collector on (`paired_timing`)."""
    import argparse
    import gc

    assert S.WARMUP_ROUNDS >= 5  # scaling_faults.py: one-thread bursts up to the fifth call
    calls: dict[str, list[bool]] = {}

    def work(kind: str, s: dict[str, int], n_draws: int):
        key = f"{kind} {sorted(s.items())}"

        def step() -> None:
            calls.setdefault(key, []).append(gc.isenabled())

        rows = (s["batch"], s.get("seq_len", 8))
        return step, 1000, [rows, rows] if kind == "collapse" else [rows]  # + a length group

    monkeypatch.setattr(S, "make_work", work)
    monkeypatch.setattr(S, "measure_memory",
                        lambda kind, shapes, n_draws, threads: [{} for _ in shapes])
    for quick, warmup, repeats in ((False, S.WARMUP_ROUNDS, 3), (True, 1, 2)):
        calls.clear()
        res = S.run(argparse.Namespace(quick=quick, threads=1, repeats=None, device="cpu"))
        assert res["warmup"] == warmup and res["repeats"] == repeats
        assert {tuple(c) for c in calls.values()} == {(True,) * warmup + (False,) * repeats}
        assert len(calls) == 2 * len(S.configs(quick))  # every row of both kinds
        assert {r["n"] for rows in res["kinds"].values() for r in rows.values()} == {repeats}
        assert f"after {warmup} untimed round(s) of every row" in S.to_markdown(res)
