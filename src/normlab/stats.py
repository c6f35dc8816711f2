"""Small statistics used across reports: means with t-intervals over seeds, medians with
distribution-free intervals (benchmark repeats), verdict rules."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from normlab.checks import is_int, is_real

#: the standard normal's 97.5% quantile, 1.959963984540054 (1.96 is its rounding)
Z975 = statistics.NormalDist().inv_cdf(0.975)

# two-sided 97.5% Student-t quantiles for 1..30 degrees of freedom (`t975` beyond)
_T975 = [12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042]


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom: the table up to 30, then
    the Cornish-Fisher expansion around the normal's `Z975` (within 1e-4 from 31 on; the
    normal's value alone made intervals over 32+ seeds ~4% too narrow)."""
    if not is_int(df) or df < 1:  # df 0 read the table's end; numpy's ints are ints
        raise ValueError(f"t975: expected whole degrees of freedom >= 1, got {df!r}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_ci(
    values: Sequence[float],
    within_var: Sequence[float] | None = None,
    support: tuple[float, float] | None = None,
) -> tuple[float, tuple[float, float]]:
    """Mean and 95% t-interval over seeds; one value gives an unbounded interval.

    `within_var`, each value's own sampling variance (an accuracy's binomial one), floors the
    seeds' variance at its mean: the spread between seeds cannot be smaller than each seed's
    measurement error, however alike two seeds happen to come out (two equal accuracies gave
    an interval of zero width, and a confident verdict from it).

    `support`, the [low, high] every value lies in (a rate's [0, 1]), clips a finite interval:
    the mean lies there too, so clipping keeps the coverage and drops bounds no value can take
    (a collapse rate's interval read [-0.42%, 0.59%]).
    """
    items = None if isinstance(values, str | bytes) else list(values)  # read once: an iterator
    if items is None or not all(map(is_real, items)):  # a string "12" read as 1 and 2
        raise ValueError(f"mean_ci: expected a sequence of numbers, got {values!r:.80}")
    vals = [float(v) for v in items]
    if not vals:
        raise ValueError("mean_ci: expected at least one value")
    if not all(map(math.isfinite, vals)):  # NaN gave a NaN interval, read as "inconclusive"
        raise ValueError(f"mean_ci: expected finite values, got {vals}")
    if support is not None and not all(support[0] <= v <= support[1] for v in vals):
        raise ValueError(f"mean_ci: expected values in [{support[0]}, {support[1]}]; got {vals}")
    n = len(vals)
    m = sum(vals) / n
    if within_var is not None:  # checked for one value too (it returned before, unread)
        if len(within_var) != n:
            raise ValueError(f"mean_ci: expected {n} within-seed variances, got {len(within_var)}")
        if not all(math.isfinite(v) and v >= 0 for v in within_var):  # max() dropped a NaN
            raise ValueError("mean_ci: expected within-seed variances >= 0, got "
                             f"{list(within_var)}")
    if n == 1:
        return m, (-math.inf, math.inf)
    var = sum((v - m) ** 2 for v in vals) / (n - 1)
    if within_var is not None:
        var = max(var, sum(within_var) / n)
    sd = math.sqrt(var)
    t = t975(n - 1)
    half = t * sd / math.sqrt(n)
    if support is None:
        return m, (m - half, m + half)
    return m, (max(m - half, support[0]), min(m + half, support[1]))


def percent(fraction: float, decimals: int) -> str:
    """`fraction` as a percentage to `decimals` places, an imperfect one never shown as 100:
    255 right of 256 read "100" on the heatmap (2559 of 2560 "100.0" in `compare`), in a study
    judged by reaching 100% (or 99%)."""
    text = f"{100 * fraction:.{decimals}f}"
    if fraction < 1 and float(text) >= 100:
        text = f"{100 - 10.0 ** -decimals:.{decimals}f}"
    return text


def wilson_ci(correct: int, count: int, z: float = Z975) -> tuple[float, float]:
    """95% Wilson score interval for a binomial proportion (sane at 0% and 100%):
    an accuracy over its questions, a collapse rate over its row-draws."""
    if (isinstance(correct, bool) or isinstance(count, bool)  # True read as 1
            or not (0 <= correct <= count and math.isfinite(count)  # (1, inf) read (0, 0)
                    and float(correct).is_integer() and float(count).is_integer())):
        # (3, -2) read (5.77, -0.42); (5, 3) a bare math error; (2.5, 5) an interval
        raise ValueError(f"wilson_ci: expected whole counts 0 <= correct <= count; got "
                         f"{correct} correct of {count}")
    if not (is_real(z) and 0 < z < math.inf):  # NaN read (0, 1); a negative z, lo > hi
        raise ValueError(f"wilson_ci: expected z > 0; got {z!r}")
    if count == 0:
        return (0.0, 1.0)
    p = correct / count
    denom = 1 + z * z / count
    centre = (p + z * z / (2 * count)) / denom
    half = z * math.sqrt(p * (1 - p) / count + z * z / (4 * count * count)) / denom
    # at 0 (or all) correct the bound is 0 (1) exactly; centre - half rounds to ~1e-17
    return (0.0 if correct == 0 else max(0.0, centre - half),
            1.0 if correct == count else min(1.0, centre + half))


def median_ci(xs: Sequence[float], level: float = 0.95) -> dict[str, float]:
    """Distribution-free confidence interval for the median: [x_(k), x_(n+1-k)] of the sorted xs.

    For i.i.d. draws the median lies between the k-th smallest and k-th largest with
    probability 1 - 2 P(Binomial(n, 1/2) <= k - 1), whatever the distribution; k is the
    largest that still reaches `level`. With five or fewer repeats even [min, max] falls short
    of 95%, so the coverage actually reached is returned beside the bounds.
    """
    xs = sorted(float(x) for x in xs)
    n = len(xs)
    if n == 0:
        raise ValueError("median_ci: expected at least one value")
    if any(math.isnan(x) for x in xs):  # NaN compares false both ways: `sorted` is no order
        raise ValueError(f"median_ci: expected numbers, got NaN among {xs}")
    if not 0 < level < 1:
        raise ValueError(f"median_ci: expected a level in (0, 1); got {level!r}")

    # in integers (2.0**n overflowed a float from 1024 repeats on), the binomial tail kept as
    # a running sum: summed afresh for each k, 4096 repeats took minutes
    total = 2**n
    k, tail, term = 1, 1, n  # tail = sum of C(n, i) for i < k; term = C(n, k)
    while k + 1 <= (n + 1) // 2 and 1.0 - 2 * (tail + term) / total >= level:
        tail += term
        term = term * (n - k) // (k + 1)
        k += 1
    return {"lo": xs[k - 1], "hi": xs[n - k], "coverage": 1.0 - 2 * tail / total}


def verdict_band(ci: tuple[float, float], lo: float, hi: float) -> str:
    """`agrees` if the CI lies inside [lo, hi], `disagrees` if it misses it, else inconclusive."""
    a, b = ci
    if lo <= a and b <= hi:
        return "agrees"
    if b < lo or a > hi:
        return "disagrees"
    return "inconclusive"


def verdict_sign(ci: tuple[float, float], expect_negative: bool = True) -> str:
    """For "A is worse than B": `agrees` if the CI of A - B is below 0, `disagrees` if above."""
    a, b = ci
    if expect_negative:
        return "agrees" if b < 0 else "disagrees" if a > 0 else "inconclusive"
    return "agrees" if a > 0 else "disagrees" if b < 0 else "inconclusive"
