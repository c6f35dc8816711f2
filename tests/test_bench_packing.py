"""benchmarks/bench_packing.py: the packed and padded steps are timed only once their losses on
the same problems agree, so a speed-up is never reported over steps doing other work."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_packing as P
from normlab.tasks.addition import IGNORE_INDEX

ARGS = argparse.Namespace(quick=True, threads=1, repeats=1, device="cpu")


def _untimed(contenders, *, repeats, **kw) -> dict[str, list[float]]:
    """paired_timing's shape, without running the steps: the loss check is under test."""
    return {name: [1.0] * repeats for name in contenders}


def test_a_packed_batch_with_another_loss_is_refused_before_timing(monkeypatch) -> None:
    """A packer that drops all but each row's first answer token from the loss: the run timed
    both steps and reported the speed-up, the two losses only recorded, though the docstring
    said they were checked. It now stops before timing, naming both losses."""
    real_batch, losses = P.make_batch, []

    def broken(problems, *args, pack=False, **kw):
        b = real_batch(problems, *args, pack=pack, **kw)
        if pack:
            t = b["targets"]
            first = (t != IGNORE_INDEX).int().argmax(1)
            keep = torch.zeros_like(t, dtype=torch.bool)
            keep[torch.arange(t.shape[0]), first] = True
            b["targets"] = torch.where(keep, t, torch.full_like(t, IGNORE_INDEX))
        return b

    def recorded(*args, **kw):
        out = real_loss(*args, **kw)
        losses.append(float(out[0]))
        return out

    def timed(*args, **kw):
        raise AssertionError("timed steps whose losses differ")

    real_loss = P.loss_on
    monkeypatch.setattr(P, "make_batch", broken)
    monkeypatch.setattr(P, "loss_on", recorded)
    monkeypatch.setattr(P, "paired_timing", timed)
    with pytest.raises(RuntimeError) as err:
        P.run(ARGS)
    padded, packed = losses  # the quick grid's, the first checked
    assert abs(packed - padded) > P.LOSS_TOLERANCE
    assert str(err.value) == (f"quick grid: the packed batch's loss {packed:.7g} is not the "
                              f"padded batch's {padded:.7g} (tolerance 0.0001)")


def test_the_real_packer_passes_the_check_on_both_grids(monkeypatch) -> None:
    """The tolerance leaves room for float32 sums in another order: the packer as it is gets
    through the check on both grids (a gap-closing test: the old code had no check)."""
    monkeypatch.setattr(P, "paired_timing", _untimed)
    res = P.run(ARGS)
    assert [r["grid"] for r in res["results"]] == ["quick", "paper"]
    for r in res["results"]:
        assert r["loss_abs_diff"] <= P.LOSS_TOLERANCE
        assert r["loss_abs_diff"] == abs(r["packed"]["loss"] - r["padded"]["loss"])


@pytest.mark.parametrize("shift", [1.0, -1.0])
def test_a_packed_loss_off_either_way_is_refused(monkeypatch, shift: float) -> None:
    """The check takes the difference's size: a packed loss below the padded one was timed."""
    real_loss = P.loss_on

    def off(model, batch, *args, **kw):
        out = real_loss(model, batch, *args, **kw)
        return (out[0] + shift, *out[1:]) if "segments" in batch else out

    monkeypatch.setattr(P, "loss_on", off)
    monkeypatch.setattr(P, "paired_timing", _untimed)
    with pytest.raises(RuntimeError, match=r"^quick grid: the packed batch's loss .* is not the "
                                           r"padded batch's"):
        P.run(ARGS)
