"""Tests for normlab.analysis.theory, each against a truth computed independently of it."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch

from normlab.analysis.theory import (
    dense_head_output_shift,
    max_competitor_probability,
    monte_carlo_collapse,
    pair_flip_probability,
    predict_collapse,
    union_bound,
)

INF = math.inf


def phi(x: float) -> float:
    """Standard normal CDF from math.erf, independent of torch.special."""
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def mc_tol(p: float, n: int, k: float = 5.0) -> float:
    """k binomial standard errors, floored so a reference near 0 or 1 is not over-strict."""
    return k * math.sqrt(max(p * (1.0 - p), 1.0 / n) / n)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_rows(seed: int, rows: int = 40, keys: int = 6, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, keys, generator=gen(seed), dtype=torch.float64) * scale


def quadrature_collapse(row: list[float], sigma: float, nodes: int = 120) -> float:
    """Exact Gaussian collapse probability by conditioning on the winner's noise.

    Given z*, W = (1 + σz*)s*, and competitor j stays below W with probability
    Φ(±(W/s_j − 1)/σ) (sign of s_j); average the product over z* by Gauss-Hermite.
    """
    w_idx = int(np.argmax(row))
    s_star = row[w_idx]
    others = [s for i, s in enumerate(row) if i != w_idx]
    x, w = np.polynomial.hermite_e.hermegauss(nodes)
    w = w / math.sqrt(2 * math.pi)
    stay = 0.0
    for z, wt in zip(x, w, strict=True):
        big_w = (1 + sigma * z) * s_star
        prod = 1.0
        for s in others:
            t = (big_w / s - 1) / sigma
            prod *= phi(t) if s > 0 else phi(-t)
        stay += wt * prod
    return 1.0 - stay


def test_sigma_zero_gives_zero_everywhere() -> None:
    logits = random_rows(0)
    logits[0, 2] = -INF
    mask = torch.ones_like(logits, dtype=torch.bool)
    mask[1, :3] = False
    for fn in (union_bound, max_competitor_probability):
        assert torch.equal(fn(logits, 0.0, mask), torch.zeros(40, dtype=torch.float64))
    for noise in ("normal", "uniform"):
        p = monte_carlo_collapse(logits, 0.0, 100, noise, gen(1), mask)
        assert torch.equal(p, torch.zeros(40, dtype=torch.float64))
    assert (
        pair_flip_probability(torch.tensor([2.0, -1.0]), torch.tensor([1.0, -3.0]), 0.0).eq(0).all()
    )


@pytest.mark.parametrize(
    ("s_win", "s_other", "sigma"),
    [
        (2.0, 1.0, 0.5),
        (-1.0, -3.0, 0.3),
        (0.5, -0.5, 1.0),
        (3.0, 2.9, 0.1),
        (0.0, -2.0, 0.7),
        (-0.2, -0.25, 2.0),
    ],
)
def test_pair_closed_form_matches_brute_force(s_win: float, s_other: float, sigma: float) -> None:
    n = 200_000
    closed = float(pair_flip_probability(torch.tensor(s_win), torch.tensor(s_other), sigma))
    eps = np.random.default_rng(7).normal(0.0, sigma, size=(n, 2))
    brute = float(np.mean((1 + eps[:, 1]) * s_other > (1 + eps[:, 0]) * s_win))
    assert abs(closed - brute) < mc_tol(closed, n)
    # The library's own Monte Carlo agrees on the same 2-key row (key order swapped too).
    for row in ([s_win, s_other], [s_other, s_win]):
        mc = float(monte_carlo_collapse(torch.tensor([row]), sigma, n, generator=gen(3))[0])
        assert abs(closed - mc) < mc_tol(closed, n)


def test_hand_computed_two_key_value() -> None:
    expected = phi(-1.0 / (0.5 * math.sqrt(5.0)))  # s*=2, s'=1, σ=0.5 → Φ(−0.894) ≈ 0.1856
    assert expected == pytest.approx(0.18555, abs=1e-4)
    row = torch.tensor([[1.0, 2.0]], dtype=torch.float32)
    assert float(union_bound(row, 0.5)[0]) == pytest.approx(expected, rel=1e-12)
    assert float(max_competitor_probability(row, 0.5)[0]) == pytest.approx(expected, rel=1e-12)
    assert float(pair_flip_probability(2.0, 1.0, 0.5)) == pytest.approx(expected, rel=1e-12)


def test_union_bound_is_capped_at_one() -> None:
    """The union bound is min(1, sum of pair probabilities): nine competitors near-tied with
    the winner sum to about 4.4, a probability bound of 1, not 4.4."""
    row = [1.0] + [0.99] * 9
    pairs = sum(float(pair_flip_probability(1.0, s, 0.3)) for s in row[1:])
    assert pairs > 4
    assert float(union_bound(torch.tensor([row]), 0.3)[0]) == 1.0
    few = [1.0, 0.5, 0.4]  # a sum below 1 is the bound itself
    want = sum(float(pair_flip_probability(1.0, s, 0.3)) for s in few[1:])
    assert float(union_bound(torch.tensor([few]), 0.3)[0]) == pytest.approx(want, rel=1e-12)


def test_pair_probability_degenerate_and_dtype() -> None:
    # s* = s' = 0 never moves; a "winner" that is really behind always stays behind at σ=0.
    assert float(pair_flip_probability(0.0, 0.0, 1.0)) == 0.0
    assert float(pair_flip_probability(1.0, 2.0, 0.0)) == 1.0
    out = pair_flip_probability(torch.tensor([2.0], dtype=torch.float32), torch.tensor([1.0]), 0.5)
    assert out.dtype == torch.float64


def test_uniform_hand_computed_and_exact_zero() -> None:
    # s*=2, s'=1, u ~ U[-1/2, 1/2]: flip iff u' − 2u* > 1, a triangle of area 1/16.
    n = 200_000
    p = float(monte_carlo_collapse(torch.tensor([[2.0, 1.0]]), 0.5, n, "uniform", gen(5))[0])
    assert abs(p - 1 / 16) < mc_tol(1 / 16, n)
    # Below the worst row's threshold (s*−s')/(s*+s') no competitor can ever reach the winner.
    logits = torch.rand(30, 5, generator=gen(6), dtype=torch.float64) * 4 + 0.5
    top2 = logits.topk(2, dim=-1).values
    threshold = float(((top2[:, 0] - top2[:, 1]) / (top2[:, 0] + top2[:, 1])).min())
    p0 = monte_carlo_collapse(logits, 0.99 * threshold, 20_000, "uniform", gen(8))
    assert torch.equal(p0, torch.zeros(30, dtype=torch.float64))
    assert float(monte_carlo_collapse(logits, 3 * threshold, 20_000, "uniform", gen(8)).max()) > 0


def test_monte_carlo_between_bounds_on_random_rows() -> None:
    n = 20_000
    logits = random_rows(10)
    for sigma in (0.1, 0.3, 0.8):
        mc = monte_carlo_collapse(logits, sigma, n, generator=gen(11))
        low = max_competitor_probability(logits, sigma)
        high = union_bound(logits, sigma)
        assert bool((low <= high + 1e-12).all())
        for m, lo, hi in zip(mc.tolist(), low.tolist(), high.tolist(), strict=True):
            assert m >= lo - mc_tol(lo, n)
            assert m <= hi + mc_tol(min(hi, 1.0), n)


@pytest.mark.parametrize("sigma", [0.3, 0.8])
def test_monte_carlo_matches_quadrature_multi_key(sigma: float) -> None:
    rows = [[2.0, 1.5, -0.7, 1.2], [-0.5, -0.8, -2.5, -0.6], [1.0, -3.0, 0.9, -6.0]]
    n = 100_000
    logits = torch.tensor(rows)
    mc = monte_carlo_collapse(logits, sigma, n, generator=gen(12), chunk=7_000)
    low = max_competitor_probability(logits, sigma)
    high = union_bound(logits, sigma)
    for i, row in enumerate(rows):
        exact = quadrature_collapse(row, sigma)
        assert abs(float(mc[i]) - exact) < mc_tol(exact, n)
        assert float(low[i]) <= exact + 1e-9 <= float(high[i]) + 2e-9


def test_strongest_competitor_need_not_be_largest_logit() -> None:
    # s'=-0.1 needs ε' < −1 − 11ε*; s''=−100 needs roughly ε'' < −1.01 − 0.01ε*: s'' is likelier.
    row = torch.tensor([[1.0, -0.1, -100.0]])
    expected = float(pair_flip_probability(1.0, -100.0, 0.5))
    assert float(max_competitor_probability(row, 0.5)[0]) == pytest.approx(expected, rel=1e-12)
    assert expected > float(pair_flip_probability(1.0, -0.1, 0.5))


@pytest.mark.parametrize("noise", ["normal", "uniform"])
def test_monotone_in_sigma(noise: str) -> None:
    logits = random_rows(20, rows=30)
    sigmas = [0.0, 0.05, 0.1, 0.2, 0.4, 0.8]
    res = predict_collapse(logits, sigmas, 4_000, noise, seed=3)
    keys = ["monte_carlo", "pair_max", "union"] if noise == "normal" else ["monte_carlo"]
    for key in keys:
        vals = res[key]
        assert all(b >= a for a, b in itertools.pairwise(vals)), (key, vals)
        assert vals[0] == 0.0 and vals[-1] > vals[1]
    if noise == "uniform":
        assert res["pair_max"] is None and res["union"] is None


def test_adding_a_constant_changes_the_prediction() -> None:
    n = 200_000
    base = torch.tensor([[2.0, 1.0]])
    shifted = base + 10.0
    p_base = phi(-1.0 / (0.5 * math.sqrt(5.0)))  # ≈ 0.186
    p_shift = phi(-1.0 / (0.5 * math.sqrt(12.0**2 + 11.0**2)))  # ≈ 0.451
    assert float(union_bound(base, 0.5)[0]) == pytest.approx(p_base, rel=1e-12)
    assert float(union_bound(shifted, 0.5)[0]) == pytest.approx(p_shift, rel=1e-12)
    mc = float(monte_carlo_collapse(shifted, 0.5, n, generator=gen(4))[0])
    assert abs(mc - p_shift) < mc_tol(p_shift, n)
    assert p_shift - p_base > 0.25


def test_masked_keys_never_win() -> None:
    n, sigma = 100_000, 2.0
    two_key = float(pair_flip_probability(0.5, 0.4, sigma))
    # A huge masked logit (bool mask) and a -inf logit: with σ=2 many factors 1+ε are
    # negative, which would turn a careless -inf into +inf or let -50·(1+ε) overtake.
    logits = torch.tensor(
        [[0.5, 100.0, 0.4], [0.5, -INF, 0.4], [0.5, -50.0, 0.4]], dtype=torch.float64
    )
    mask = torch.tensor([[True, False, True], [True, True, True], [True, False, True]])
    for fn in (union_bound, max_competitor_probability):
        assert torch.allclose(
            fn(logits, sigma, mask), torch.full((3,), two_key, dtype=torch.float64), rtol=1e-12
        )
    mc = monte_carlo_collapse(logits, sigma, n, generator=gen(9), mask=mask)
    for m in mc.tolist():
        assert abs(m - two_key) < mc_tol(two_key, n)


def test_rows_with_fewer_than_two_keys_return_zero() -> None:
    logits = torch.tensor([[3.0, -INF, -INF], [-INF, -INF, -INF], [1.0, 5.0, 2.0], [1.0, 2.0, 0.5]])
    mask = torch.tensor([[True] * 3, [True] * 3, [True, False, False], [True] * 3])
    for fn in (union_bound, max_competitor_probability):
        out = fn(logits, 1.0, mask)
        assert out[:3].eq(0).all() and float(out[3]) > 0
    out = monte_carlo_collapse(logits, 1.0, 2_000, generator=gen(2), mask=mask)
    assert out[:3].eq(0).all() and float(out[3]) > 0
    res = predict_collapse(logits, [1.0], 2_000, seed=2, mask=mask)
    assert res["n_rows"] == 4 and res["n_rows_can_collapse"] == 1
    assert res["monte_carlo"][0] == pytest.approx(float(out[3]) / 4)


def test_predict_collapse_is_json_ready_and_consistent() -> None:
    logits = random_rows(30, rows=25).float()
    res = predict_collapse(logits, [0.2, 0.5], 5_000, "normal", seed=1)
    json.dumps(res)
    assert set(res) >= {"sigmas", "pair_max", "union", "monte_carlo", "monte_carlo_se"}
    assert res == predict_collapse(logits, [0.2, 0.5], 5_000, "normal", seed=1)
    for lo, mc, se, hi in zip(
        res["pair_max"], res["monte_carlo"], res["monte_carlo_se"], res["union"], strict=True
    ):
        assert 0 < se < 0.01 and lo - 5 * se <= mc <= hi + 5 * se
    # Float32 input gives the float64 result of the same numbers.
    assert torch.equal(union_bound(logits, 0.3), union_bound(logits.double(), 0.3))


def softmax_output(s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.softmax(s, dim=-1) @ v


def test_dense_shift_matches_finite_differences() -> None:
    g = gen(40)
    s = torch.randn(7, generator=g, dtype=torch.float64) * 2
    v = torch.randn(7, 5, generator=g, dtype=torch.float64)
    u = torch.randn(7, generator=g, dtype=torch.float64)
    a = torch.softmax(s, dim=-1)
    h = 1e-6
    fd = (softmax_output(s * (1 + h * u), v) - softmax_output(s * (1 - h * u), v)) / (2 * h)
    assert torch.allclose(dense_head_output_shift(a, s, v, u), fd, atol=1e-8)
    # Small finite ε: first order is accurate to O(ε²).
    eps = 1e-3 * u
    exact = softmax_output(s * (1 + eps), v) - softmax_output(s, v)
    assert torch.allclose(dense_head_output_shift(a.float(), s, v, eps), exact, atol=1e-5)
    # Batched leading dims agree with the unbatched call.
    batched = dense_head_output_shift(
        a.expand(3, 7), s.expand(3, 7), v.expand(3, 7, 5), u.expand(3, 7)
    )
    assert torch.allclose(batched, dense_head_output_shift(a, s, v, u).expand(3, 5))


def test_dense_shift_vanishing_cases() -> None:
    g = gen(41)
    v = torch.randn(6, 4, generator=g, dtype=torch.float64)
    eps = torch.randn(6, generator=g, dtype=torch.float64) * 0.1
    zero = torch.zeros(4, dtype=torch.float64)
    # q = 0: every logit is 0, so the pattern is uniform before and after.
    s0 = torch.zeros(6, dtype=torch.float64)
    assert torch.allclose(dense_head_output_shift(torch.softmax(s0, -1), s0, v, eps), zero)
    # All keys equal and scaled alike: the logits stay equal to each other.
    s1 = torch.full((6,), 1.7, dtype=torch.float64)
    same = torch.full((6,), 0.05, dtype=torch.float64)
    assert torch.allclose(dense_head_output_shift(torch.softmax(s1, -1), s1, v, same), zero)
    # Any ε with ε_j s_j constant is a uniform logit shift, which softmax ignores.
    s2 = torch.tensor([1.0, 2.0, -0.5, 4.0, 0.8, -2.0], dtype=torch.float64)
    assert torch.allclose(dense_head_output_shift(torch.softmax(s2, -1), s2, v, 0.01 / s2), zero)
    # Masked keys (weight 0, logit -inf) add nothing and produce no NaN.
    s3 = torch.cat([s2[:5], torch.tensor([-INF], dtype=torch.float64)])
    out = dense_head_output_shift(torch.softmax(s3, -1), s3, v, eps)
    assert torch.allclose(
        out, dense_head_output_shift(torch.softmax(s2[:5], -1), s2[:5], v[:5], eps[:5])
    )


def test_equal_eps_alone_is_a_temperature_change_not_zero() -> None:
    # PAPER.md says δo vanishes "when all keys are scaled alike"; with distinct logits that
    # is a temperature change, so δo = ε Σ_j a_j (s_j − s̄) v_j, matching the exact output.
    s = torch.tensor([1.0, 2.0, -0.5, 4.0], dtype=torch.float64)
    v = torch.eye(4, dtype=torch.float64)
    a = torch.softmax(s, -1)
    eps = torch.full((4,), 1e-4, dtype=torch.float64)
    shift = dense_head_output_shift(a, s, v, eps)
    exact = softmax_output(s * (1 + eps), v) - softmax_output(s, v)
    assert torch.allclose(shift, exact, atol=1e-8) and float(shift.abs().max()) > 1e-5
    # With identical values the head output cannot move at all.
    v_same = torch.ones(4, 3, dtype=torch.float64)
    assert torch.allclose(dense_head_output_shift(a, s, v_same, eps), torch.zeros(3).double())


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: union_bound(torch.ones(2, 3), -0.1), "sigma"),
        (lambda: pair_flip_probability(1.0, 0.0, math.nan), "sigma"),
        (lambda: monte_carlo_collapse(torch.ones(2, 3), 0.1, 0), "n_draws"),
        (lambda: monte_carlo_collapse(torch.ones(2, 3), 0.1, 1.5), "n_draws"),  # type: ignore[arg-type]
        (lambda: monte_carlo_collapse(torch.ones(2, 3), 0.1, 10, "cauchy"), "noise"),
        (lambda: monte_carlo_collapse(torch.ones(2, 3), 0.1, 10, chunk=0), "chunk"),
        (lambda: union_bound(torch.ones(3), 0.1), "logits"),
        (lambda: union_bound(torch.ones(2, 3, 4), 0.1), "logits"),
        (lambda: union_bound(torch.tensor([[1.0, math.nan]]), 0.1), "logits"),
        (lambda: union_bound(torch.tensor([[1.0, INF]]), 0.1), "logits"),
        (lambda: union_bound(torch.ones(2, 3), 0.1, torch.ones(2, 3)), "mask"),
        (lambda: union_bound(torch.ones(2, 3), 0.1, torch.ones(3, 2, dtype=torch.bool)), "mask"),
        (lambda: predict_collapse(torch.ones(2, 3), [0.1, -1.0], 10), "sigmas"),
        (lambda: predict_collapse(torch.ones(2, 3), "0.1", 10), "sigmas"),  # type: ignore[arg-type]
        (lambda: predict_collapse(torch.ones(2, 3), [True], 10), "sigmas[0]"),
        (lambda: predict_collapse(torch.ones(2, 3), ["0.1"], 10), "sigmas[0]"),
        (lambda: predict_collapse(torch.ones(2, 3), [None], 10), "sigmas[0]"),
        (lambda: predict_collapse(torch.ones(2, 3), [], 10), "sigmas"),
        (lambda: predict_collapse(torch.ones(2, 3), [0.1], 10, seed=1.7), "seed"),
        (lambda: predict_collapse(torch.ones(2, 3), [0.1], 10, seed=-1), "seed"),
        (lambda: predict_collapse(torch.ones(2, 3), [0.1], 10, seed="a"), "seed"),
        (lambda: pair_flip_probability(1.0, 0.0, None), "sigma"),  # type: ignore[arg-type]
        (lambda: predict_collapse(torch.ones(2, 3), [0.1], 0), "n_draws"),
        (lambda: predict_collapse(torch.ones(2, 3), [0.1], 10, "beta"), "noise"),
        (
            lambda: dense_head_output_shift(
                torch.ones(3), torch.ones(4), torch.ones(3, 2), torch.ones(3)
            ),
            "pattern",
        ),
        (
            lambda: dense_head_output_shift(
                torch.ones(3), torch.ones(3), torch.ones(2, 2), torch.ones(3)
            ),
            "values",
        ),
    ],
)
def test_bad_arguments_raise_one_line_value_error(call, name: str) -> None:
    with pytest.raises(ValueError) as info:
        call()
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(name)
