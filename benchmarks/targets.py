"""Issue 6's targets, written once: the lines `plot.py` draws and the verdicts `run_all.py` prints.

A verdict reads a headline's median and its confidence interval (`common.ratio_stats`): "met"
or "missed" when the whole interval is on one side of the line, "(CI crosses)" when the median
is on one side and the interval reaches the other, so a reader sees at once which results the
run's noise could turn over. Hooks are held to the same rule at 1.0 (a forward with its unused
points no slower than with them bypassed): "met" only when the whole interval is at or below it
(the rule "the low end is at most 1.0", kept until the thirty-seventh session, said "met" for
a median of 1.3 whose interval reached 0.99). The coverage of the interval is the table's to
show (`common.rci`): few repeats give a wide interval at a lower coverage.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from bench_train_step import base_config


@dataclass(frozen=True)
class Target:
    bound: float
    sense: Literal["at most", "at least"]

    def __str__(self) -> str:
        return f"{'≤' if self.sense == 'at most' else '≥'} {self.bound:g}"

    def verdict(self, median: float, stats: Mapping[str, Any] | None = None) -> str:
        """'met', 'met (CI crosses)', 'missed (CI crosses)' or 'missed' for this median and,
        where `stats` has one, its CI. Without a CI (a single reading, or a CI of 0% coverage:
        one repeat) the median decides, and the verdict says so; a value that is not finite is
        'no reading'."""
        ci = stats.get("ci") if stats else None
        if stats and ci is not None and stats.get("ci_coverage", 1.0) > 0:
            lo, hi = min(ci), max(ci)
            alone = ""
        else:
            lo = hi = median
            alone = " (no CI)" if stats is not None else ""
        if not all(math.isfinite(x) for x in (median, lo, hi)):
            return "no reading"
        good = (lambda x: x <= self.bound) if self.sense == "at most" else (
            lambda x: x >= self.bound)
        if good(lo) and good(hi):
            return "met" + alone
        if not good(lo) and not good(hi):
            return "missed" + alone
        return ("met" if good(median) else "missed") + " (CI crosses)"


_RECIPE = base_config()  # configs/addition/pre.toml: the default training config, which MFU's
DEFAULT_WIDTH = str(_RECIPE.model.d_model)  # target is about: its width and how it trains
STEP_RATIO = Target(1.0, "at most")  # training-step time / the fastest reference's, every placement
QKV_OVER_PRE = Target(1.15, "at most")  # qkv's step time / pre's
MFU_PCT = Target(50.0, "at least")  # model FLOP utilisation, %: the default training config's
DEFAULT_CONFIG = {"threads": _RECIPE.train.threads, "device": "cpu",
                  "precision": _RECIPE.train.precision}
DECODE = Target(3.0, "at least")  # uncached / cached decoding time, the longest cells
SWEEP = Target(20.0, "at least")  # naive loop / vectorised collapse sweep time
HOOKS = Target(1.0, "at most")  # forward time with unused hook points / with them bypassed
