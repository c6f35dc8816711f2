"""Issue 6's targets, written once: the lines `plot.py` draws and the verdicts `run_all.py` prints.

A verdict reads a headline's median and its confidence interval (`common.ratio_stats`): "met"
or "missed" when the whole interval is on one side of the line, "(CI crosses)" when the median
is on one side and the interval reaches the other, so a reader sees at once which results the
run's noise could turn over. Hooks are held to "no cost measured": the interval reaches 1.0
(docs/performance.md's top table reads them so).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Target:
    bound: float
    sense: Literal["at most", "at least", "no cost"]

    def __str__(self) -> str:
        return {"at most": "≤ ", "at least": "≥ ", "no cost": "CI reaches "}[self.sense] + (
            f"{self.bound:g}")

    def verdict(self, median: float, stats: Mapping[str, Any] | None = None) -> str:
        """'met', 'met (CI crosses)', 'missed (CI crosses)' or 'missed' for this median and,
        where `stats` has one, its CI ('met' or 'missed (CI above ...)' for "no cost")."""
        lo, hi = stats["ci"] if stats and "ci" in stats else (median, median)
        if self.sense == "no cost":
            return "met" if lo <= self.bound else f"missed (CI above {self.bound:g})"
        good = (lambda x: x <= self.bound) if self.sense == "at most" else (
            lambda x: x >= self.bound)
        if good(lo) and good(hi):
            return "met"
        if not good(lo) and not good(hi):
            return "missed"
        return ("met" if good(median) else "missed") + " (CI crosses)"


DEFAULT_WIDTH = "64"  # configs/addition/pre.toml's d_model: the default training config's width
STEP_RATIO = Target(1.0, "at most")  # training-step time / the fastest reference's, every placement
QKV_OVER_PRE = Target(1.15, "at most")  # qkv's step time / pre's
MFU_PCT = Target(50.0, "at least")  # model FLOP utilisation, %, the default training config
DECODE = Target(3.0, "at least")  # uncached / cached decoding time, the longest cells
SWEEP = Target(20.0, "at least")  # naive loop / vectorised collapse sweep time
HOOKS = Target(1.0, "no cost")  # forward time with unused hook points / with them bypassed
