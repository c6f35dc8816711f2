"""normlab.stats: intervals checked against hand-computed values and by simulation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from normlab.stats import median_ci


@pytest.mark.parametrize(
    ("n", "k", "coverage"),
    [  # hand-computed: coverage = 1 - 2 * sum_{i<k} C(n, i) / 2^n
        (3, 1, 1 - 2 / 8),             # [min, max] only reaches 75%
        (7, 1, 1 - 2 / 128),           # 98.4%; k = 2 would be 87.5%
        (9, 2, 1 - 2 * 10 / 512),      # 96.1%; k = 3 would be 82.0%
        (11, 2, 1 - 2 * 12 / 2048),    # 98.8%; k = 3 would be 93.5% < 95%
    ],
)
def test_median_ci_takes_the_order_statistics_that_reach_the_level(
    n: int, k: int, coverage: float
) -> None:
    xs = [float(x) for x in reversed(range(10, 10 + n))]  # unsorted on purpose
    ci = median_ci(xs)
    assert (ci["lo"], ci["hi"]) == (10.0 + k - 1, 10.0 + n - k)
    assert ci["coverage"] == pytest.approx(coverage)


def test_median_ci_coverage_holds_in_simulation() -> None:
    """The interval holds the true median of a skewed distribution as often as it says."""
    rng = np.random.default_rng(0)
    true_median = np.log(2.0)  # exponential(1)
    hits = 0
    for _ in range(4000):
        ci = median_ci(rng.exponential(1.0, size=9).tolist())
        hits += ci["lo"] <= true_median <= ci["hi"]
    assert abs(hits / 4000 - (1 - 2 * 10 / 512)) < 0.015  # 96.1% ± ~4 standard errors


def test_median_ci_needs_a_value() -> None:
    with pytest.raises(ValueError, match="median_ci: expected at least one value"):
        median_ci([])



@pytest.mark.parametrize(("xs", "level", "match"), [
    ([1.0, math.nan, 2.0], 0.95, "got NaN"),  # sorted() puts NaN anywhere: [1, 2] came back
    ([1.0, 2.0, 3.0], 1.5, r"a level in \(0, 1\); got 1.5"),
    ([1.0, 2.0, 3.0], 0.0, r"a level in \(0, 1\); got 0.0"),
])
def test_median_ci_refuses_nan_and_a_level_outside_0_1(xs: list[float], level: float,
                                                      match: str) -> None:
    with pytest.raises(ValueError, match=match):
        median_ci(xs, level)
