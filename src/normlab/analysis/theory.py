"""Analytic prediction of circuit collapse from recorded, unperturbed attention logits.

PAPER.md section 3: perturbing key norms multiplies each raw logit ``s_j = q·k_j·τ`` by
``(1 + ε_j)``. A query-side factor ``(1 + ε_q) > 0`` rescales the whole row and cannot move
the argmax, so only per-key factors matter. A row *collapses* when
``argmax_j (1 + ε_j) s_j`` differs from the unperturbed argmax ``j*``. (Gaussian noise makes
``1 + ε_q`` negative with probability ``Φ(−1/σ)``, 4e-4 at σ = 0.3 and 8e-24 at σ = 0.1;
the measurement then reverses the whole row, which this prediction leaves out.)

Conventions, shared by every function here:

- Logits are the raw ``q·k·τ`` values, never shifted: multiplicative noise is not
  invariant to adding a constant to a row, so shifted logits give a wrong prediction.
- A key takes part when its logit is finite and (if ``mask`` is given) ``mask`` is True,
  as for the boolean ``attn_mask`` of ``F.scaled_dot_product_attention``. ``-inf`` logits
  are masked keys; ``+inf`` or NaN logits are rejected.
- The winner is ``torch.argmax`` of the unperturbed row (first index on exact ties).
- A row with fewer than two keys taking part cannot collapse: every function returns 0
  for it instead of raising, because such rows (e.g. the first token under a causal mask)
  are ordinary sparse rows that an experiment will record.
- Work is done in float64 whatever the input dtype, and results are float64.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from normlab.checks import check_int, check_seed, check_sigma, check_sigmas

NOISES = ("normal", "uniform")
# Elements (R * K * draws) held at once by monte_carlo_collapse when chunk is None.
_DEFAULT_CHUNK_ELEMENTS = 1 << 22


def _check_noise(noise: str) -> str:
    if noise not in NOISES:
        raise ValueError(f"noise must be one of {NOISES}, got {noise!r}")
    return noise


def _prepare(logits: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """Validate a [R, K] logit matrix; return (float64 logits, valid keys, winner index).

    Invalid keys are set to ``-inf`` in the returned logits so argmax never picks them.
    """
    if not isinstance(logits, Tensor) or logits.dim() != 2:
        shape = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(f"logits must be a 2-D tensor [rows, keys], got {shape}")
    if not logits.is_floating_point():
        raise ValueError(f"logits must be a floating-point tensor, got dtype {logits.dtype}")
    s = logits.to(torch.float64)
    if bool(torch.isnan(s).any()) or bool(torch.isposinf(s).any()):
        raise ValueError("logits must be finite or -inf (masked keys), got NaN or +inf")
    valid = torch.isfinite(s)
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.shape != s.shape:
            got = (mask.dtype, tuple(mask.shape)) if isinstance(mask, Tensor) else type(mask)
            raise ValueError(f"mask must be a bool tensor of shape {tuple(s.shape)}, got {got}")
        valid = valid & mask.to(s.device)
    s = s.masked_fill(~valid, -math.inf)
    winner = s.argmax(dim=-1)
    return s, valid, winner


def pair_flip_probability(s_win: Tensor, s_other: Tensor, sigma: float) -> Tensor:
    """P((1+ε')s' > (1+ε*)s*) for i.i.d. ε ~ N(0, σ²): ``Φ(−(s*−s') / (σ√(s*²+s'²)))``.

    Exact for Gaussian noise because ``ε's' − ε*s* ~ N(0, σ²(s*²+s'²))``. Where that
    variance is zero (σ = 0, or s* = s' = 0) nothing moves, so the result is
    ``1[s' > s*]``: exactly 0 for a true winner. Inputs broadcast; the result is float64.
    """
    sigma = check_sigma(sigma)
    s_w = torch.as_tensor(s_win).to(torch.float64)
    s_o = torch.as_tensor(s_other).to(torch.float64)
    s_w, s_o = torch.broadcast_tensors(s_w, s_o)
    scale = sigma * torch.sqrt(s_w * s_w + s_o * s_o)
    degenerate = scale == 0
    z = -(s_w - s_o) / torch.where(degenerate, torch.ones_like(scale), scale)
    prob = torch.special.ndtr(z)
    return torch.where(degenerate, (s_o > s_w).to(torch.float64), prob)


def _competitor_probabilities(logits: Tensor, sigma: float, mask: Tensor | None) -> Tensor:
    """[R, K] pair flip probability of every competitor against its row's winner (0 elsewhere)."""
    sigma = check_sigma(sigma)
    s, valid, winner = _prepare(logits, mask)
    s_win = s.gather(-1, winner[:, None])
    competitor = valid.clone()
    competitor.scatter_(-1, winner[:, None], False)
    # Zero out non-competitors before the closed form so -inf never enters the arithmetic.
    s_safe = torch.where(competitor, s, torch.zeros_like(s))
    s_win_safe = torch.where(torch.isfinite(s_win), s_win, torch.zeros_like(s_win))
    prob = pair_flip_probability(s_win_safe, s_safe, sigma)
    return torch.where(competitor, prob, torch.zeros_like(prob))


def union_bound(logits: Tensor, sigma: float, mask: Tensor | None = None) -> Tensor:
    """Upper bound ``min(1, Σ_j pair_flip_probability(s*, s_j))`` on P(collapse), per row [R].

    Gaussian noise only. Tight when one competitor dominates; loose when many competitors
    sit close to the winner, which is when Monte Carlo is needed.
    """
    return _competitor_probabilities(logits, sigma, mask).sum(dim=-1).clamp(max=1.0)


def max_competitor_probability(logits: Tensor, sigma: float, mask: Tensor | None = None) -> Tensor:
    """Lower bound on P(collapse): the largest single-competitor pair probability, per row [R].

    The strongest competitor is the one with the largest pair probability, not necessarily
    the largest logit: a large negative logit can overtake under sign-flipping noise.
    Gaussian noise only.
    """
    probs = _competitor_probabilities(logits, sigma, mask)
    return probs.max(dim=-1).values if probs.shape[-1] else probs.sum(dim=-1)


def _standard_noise(
    shape: tuple[int, ...], noise: str, generator: torch.Generator | None, device: torch.device
) -> Tensor:
    """Unit-scale noise (N(0, 1) or U[-1, 1]) drawn on the generator's device."""
    gen_device = generator.device if generator is not None else device
    if noise == "normal":
        z = torch.randn(shape, generator=generator, dtype=torch.float64, device=gen_device)
    else:
        z = torch.rand(shape, generator=generator, dtype=torch.float64, device=gen_device)
        z = z.mul_(2.0).sub_(1.0)
    return z.to(device)


def monte_carlo_collapse(
    logits: Tensor,
    sigma: float,
    n_draws: int,
    noise: str = "normal",
    generator: torch.Generator | None = None,
    mask: Tensor | None = None,
    chunk: int | None = None,
) -> Tensor:
    """Monte Carlo estimate of P(argmax of ``(1+ε_j)s_j`` ≠ ``j*``) per row [R], all keys at once.

    Unbiased for any number of competitors and for either noise. The noise is drawn as
    ``σ·z`` with unit-scale ``z``, so runs that reuse a seeded generator across σ share
    random numbers and give estimates that are exactly non-decreasing in σ. Draws are
    processed ``chunk`` at a time (default: about 4M elements of R*K*chunk) to bound memory.
    The binomial standard error of row r is ``sqrt(p_r (1 − p_r) / n_draws)``.
    """
    sigma = check_sigma(sigma)
    _check_noise(noise)
    n_draws = check_int(n_draws, "n_draws", low=1)
    if chunk is not None:
        chunk = check_int(chunk, "chunk", low=1, what="None or an int >= 1")
    s, valid, winner = _prepare(logits, mask)
    n_rows, n_keys = s.shape
    if n_rows == 0 or sigma == 0.0:
        return torch.zeros(n_rows, dtype=torch.float64, device=s.device)
    can_collapse = valid.sum(dim=-1) >= 2
    if chunk is None:
        chunk = max(1, _DEFAULT_CHUNK_ELEMENTS // max(1, n_rows * n_keys))
    chunk = min(chunk, n_draws)
    s_finite = torch.where(valid, s, torch.zeros_like(s))
    flips = torch.zeros(n_rows, dtype=torch.int64, device=s.device)
    done = 0
    while done < n_draws:
        c = min(chunk, n_draws - done)
        z = _standard_noise((c, n_rows, n_keys), noise, generator, s.device)
        # (1 + σz)·s in place; masked keys forced to -inf after the multiply so a negative
        # factor can never turn them into +inf.
        perturbed = z.mul_(sigma).add_(1.0).mul_(s_finite).masked_fill_(~valid, -math.inf)
        flips += (perturbed.argmax(dim=-1) != winner).sum(dim=0)
        done += c
    rate = flips.to(torch.float64) / n_draws
    return torch.where(can_collapse, rate, torch.zeros_like(rate))


def predict_collapse(
    logits: Tensor,
    sigmas: Sequence[float],
    n_draws: int,
    noise: str = "normal",
    seed: int = 0,
    mask: Tensor | None = None,
) -> dict[str, Any]:
    """Mean predicted collapse rate over rows for each σ, as JSON-ready plain Python values.

    Keys: ``sigmas``, ``noise``, ``n_draws``, ``seed``, ``n_rows``, ``n_rows_can_collapse``,
    and per-σ lists ``pair_max`` (strongest-competitor lower bound), ``union`` (union
    upper bound), both None for uniform noise where the closed form does not apply,
    ``monte_carlo`` and ``monte_carlo_se`` (standard error of the mean from the draws only,
    rows held fixed). Means are over all rows, rows that cannot collapse counting as 0, so
    they compare directly with an experiment's collapse rate over the same rows. Every σ
    reuses the same seed (common random numbers), which makes ``monte_carlo`` monotone in σ.
    """
    _check_noise(noise)
    n_draws = check_int(n_draws, "n_draws", low=1)
    sigma_list = check_sigmas(sigmas)
    seed = check_seed(seed)
    s, valid, _ = _prepare(logits, mask)
    n_rows = s.shape[0]
    if n_rows == 0:
        raise ValueError("logits must have at least one row, got 0")
    closed = noise == "normal"
    out: dict[str, Any] = {
        "sigmas": sigma_list,
        "noise": noise,
        "n_draws": n_draws,
        "seed": seed,
        "n_rows": int(n_rows),
        "n_rows_can_collapse": int((valid.sum(dim=-1) >= 2).sum()),
        "pair_max": [] if closed else None,
        "union": [] if closed else None,
        "monte_carlo": [],
        "monte_carlo_se": [],
    }
    for sigma in sigma_list:
        if closed:
            out["pair_max"].append(float(max_competitor_probability(s, sigma).mean()))
            out["union"].append(float(union_bound(s, sigma).mean()))
        gen = torch.Generator(device=s.device).manual_seed(seed)
        p = monte_carlo_collapse(s, sigma, n_draws, noise, gen)
        out["monte_carlo"].append(float(p.mean()))
        out["monte_carlo_se"].append(float((p * (1 - p) / n_draws).sum().sqrt() / n_rows))
    return out


def dense_head_output_shift(pattern: Tensor, logits: Tensor, values: Tensor, eps: Tensor) -> Tensor:
    """First-order output change of a head when logit j becomes ``(1+ε_j)s_j``.

    ``δo ≈ Σ_j a_j (ε_j s_j − Σ_l a_l ε_l s_l) v_j`` (PAPER.md section 3): softmax only sees
    the logit changes ``ε_j s_j`` relative to their pattern-weighted mean, so δo vanishes
    when every ``ε_j s_j`` is equal (q = 0, all keys equal). Equal ε alone is *not* enough:
    it is a temperature change and moves the output by ``ε Σ_j a_j (s_j − s̄) v_j``.
    Shapes: pattern, logits, eps [..., K]; values [..., K, d]; result [..., d], float64.
    Keys with zero weight or ``-inf`` logits contribute nothing.
    """
    a = pattern.to(torch.float64)
    s = logits.to(torch.float64)
    e = eps.to(torch.float64)
    v = values.to(torch.float64)
    if a.dim() < 1 or a.shape != s.shape or a.shape != e.shape:
        raise ValueError(
            f"pattern, logits and eps must share shape [..., K], got "
            f"{tuple(a.shape)}, {tuple(s.shape)}, {tuple(e.shape)}"
        )
    if v.dim() != a.dim() + 1 or v.shape[:-1] != a.shape:
        raise ValueError(f"values must have shape {(*a.shape, 'd')}, got {tuple(v.shape)}")
    ds = torch.where(torch.isfinite(s) & (a > 0), e * s, torch.zeros_like(s))
    centred = ds - (a * ds).sum(dim=-1, keepdim=True)
    return torch.einsum("...k,...kd->...d", a * centred, v)
