"""benchmarks/bench_train_step.py's comparisons, from hand-set times: which reference each
ratio is over, with and without `--compile` (the contenders themselves are stubbed: their
steps are covered by test_bench_refs and the benchmark's own runs)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_train_step as bts
import run_all

#: seconds per step of every contender, the same each repeat: the compiled nanoGPT is the
#: fastest reference, the eager nanogpt-manual the fastest eager one
SECONDS = {"normlab-pre": 0.9, "normlab-qkv": 0.99, "nanogpt": 1.2, "nanogpt-manual": 1.0,
           "normlab-pre+compile": 0.6, "normlab-qkv+compile": 0.66, "nanogpt+compile": 0.5,
           "nanogpt-manual+compile": 0.55}


def _run(monkeypatch: pytest.MonkeyPatch, compile_too: bool) -> dict[str, Any]:
    names = [n for n in SECONDS if compile_too or not n.endswith(bts.COMPILED)]

    def contenders(*args: Any, **kw: Any) -> tuple[dict, dict]:
        assert kw["compile_too"] is compile_too
        return {n: (lambda: None) for n in names}, dict.fromkeys(names, 1000)

    def timing(steps: dict, repeats: int, **kw: Any) -> dict[str, list[float]]:
        return {n: [SECONDS[n]] * repeats for n in steps}

    monkeypatch.setattr(bts, "PLACEMENTS", ("pre", "qkv"))
    monkeypatch.setattr(bts, "contenders_for", contenders)
    monkeypatch.setattr(bts, "paired_timing", timing)
    monkeypatch.setattr(bts, "x_transformers_status", lambda: (False, "not installed"))
    return bts.run(argparse.Namespace(quick=True, threads=1, repeats=3, device="cpu",
                                      widths=[64], compile=compile_too))


@pytest.mark.parametrize("compile_too", [False, True])
def test_the_eager_comparison_is_over_the_fastest_eager_reference(
        monkeypatch: pytest.MonkeyPatch, compile_too: bool) -> None:
    res = _run(monkeypatch, compile_too)
    w = res["widths"]["64"]
    assert w["fastest_reference"] == ("nanogpt+compile" if compile_too else "nanogpt-manual")
    ref, st = bts.eager_comparison(w, "normlab-pre")
    assert ref == "nanogpt-manual" and st is not None
    assert st["median"] == pytest.approx(0.9) and st["ci"] == pytest.approx([0.9, 0.9])
    assert bts.eager_comparison(w, "normlab-qkv")[1]["median"] == pytest.approx(0.99)
    assert bts.eager_comparison(w, "normlab-none") == ("nanogpt-manual", None)  # not timed
    md = bts.to_markdown(res)
    assert ("fastest eager reference: nanogpt-manual" in md) is compile_too
    assert ("| normlab-pre | 1,000 | 900 | 2,418 | 0.75 | "
            + ("1.80 | 1.80–1.80 (75%) | 0.90 | 0.90–0.90 (75%) |" if compile_too else
               "0.90 | 0.90–0.90 (75%) |")) in md
    pre = w["contenders"]["normlab-pre"]
    assert pre["vs_fastest_ref"]["median"] == pytest.approx(0.9 / (0.5 if compile_too else 1.0))


def test_a_compiled_run_keeps_its_verdicts_in_the_headlines(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """run_all judges the eager steps against the eager reference and lists the compiled ones
    against the fastest of all, with no target (issue 6 sets none for them)."""
    rows = {r["quantity"]: (round(r["median"], 6), r["verdict"])
            for r in run_all.headline_rows({"train_step": _run(monkeypatch, True)})}
    assert rows == {
        "train step d64: normlab-pre / nanogpt-manual (time)": (0.9, "met"),
        "train step d64: normlab-qkv / nanogpt-manual (time)": (0.99, "met"),
        "train step d64: normlab-pre+compile / nanogpt+compile (time)": (1.2, None),
        "train step d64: normlab-qkv+compile / nanogpt+compile (time)": (1.32, None),
        "train step d64: qkv / pre (time)": (1.1, "met"),
    }


def test_model_config_keeps_a_recipes_own_head_width_at_its_width() -> None:
    """bench_decode and bench_hooks benchmark a recipe at its own width: its `d_head` stays
    (it was re-derived as d_model / n_heads, a smaller model than the recipe's); at another
    width the heads' width follows d_model, and the MLP scales with it."""
    run = bts.base_config()
    run.model.d_head = run.model.d_model // run.model.n_heads // 2  # not what d_model gives
    run.model.__post_init__()
    same = bts.model_config(run, run.model.d_model, "qkv")
    assert (same.d_head, same.d_mlp, same.norm_placement) == (
        run.model.d_head, run.model.d_mlp, "qkv")
    wide = bts.model_config(run, 2 * run.model.d_model, "pre")
    assert (wide.d_head, wide.d_mlp) == (2 * run.model.d_model // run.model.n_heads,
                                         2 * run.model.d_mlp)
