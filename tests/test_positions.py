"""Rotary embeddings (`normlab.model.positions`): the fast rotation against two independent
truths, the textbook rotate-half formula and a complex-number rotation of (i, i + d/2) pairs."""

from __future__ import annotations

import pytest
import torch

from normlab.model.positions import Rotary


def textbook(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """`x * cos + cat(-x2, x1) * sin` with [batch, pos, 1, d_head] tables (GPT-NeoX form)."""
    e = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, e, 2, dtype=torch.float32) / e)
    angles = positions[..., None].float() * inv
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
    h = e // 2
    return x * angles.cos() + torch.cat([-x[..., h:], x[..., :h]], dim=-1) * angles.sin()


def complex_rotation(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Pair (i, i + d/2) as the complex number x_i + j x_{i+d/2}, times exp(j pos theta^(-2i/d))."""
    x = x.double()
    e = x.shape[-1]
    h = e // 2
    inv = 1.0 / theta ** (torch.arange(0, e, 2, dtype=torch.float64) / e)
    z = torch.complex(x[..., :h], x[..., h:]) * torch.polar(
        torch.ones((), dtype=torch.float64), positions[..., None, None].double() * inv)
    return torch.cat([z.real, z.imag], dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rotation_equals_the_textbook_formula_bit_for_bit(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    rope_of = Rotary(16, 10000.0)
    positions = torch.randint(0, 40, (3, 7))
    rope = rope_of(positions)
    for heads in (4, 2, 4):  # q then GQA k then q again: each head count its own tables
        x = torch.randn(3, 7, heads, 16, dtype=dtype)
        assert torch.equal(rope(x), textbook(x, positions, 10000.0))
    assert sorted(rope._wide) == [2, 4]


def test_rotation_is_the_complex_rotation_of_half_pairs() -> None:
    torch.manual_seed(1)
    positions = torch.randint(0, 300, (2, 5))
    x = torch.randn(2, 5, 3, 8)
    got = Rotary(8, 500.0)(positions)(x)
    torch.testing.assert_close(got.double(), complex_rotation(x, positions, 500.0),
                               rtol=1e-5, atol=1e-5)


def test_gradient_equals_the_textbook_gradient() -> None:
    torch.manual_seed(2)
    positions = torch.randint(0, 40, (4, 6))
    x = torch.randn(4, 6, 2, 16, dtype=torch.float64, requires_grad=True)
    g = torch.randn(4, 6, 2, 16, dtype=torch.float64)
    (fast,) = torch.autograd.grad(Rotary(16, 10000.0)(positions)(x), x, g)
    (slow,) = torch.autograd.grad(textbook(x, positions, 10000.0), x, g)
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-12)


def test_rotation_keeps_norms_and_scores_depend_on_offsets_only() -> None:
    torch.manual_seed(3)
    rotary = Rotary(16, 10000.0)
    q, k = torch.randn(1, 6, 2, 16), torch.randn(1, 6, 2, 16)
    pos = torch.arange(6)[None]
    rq, rk = rotary(pos)(q), rotary(pos)(k)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    shifted = rotary(pos + 17)
    scores = torch.einsum("bqhe,bkhe->bhqk", rq, rk)
    scores_shifted = torch.einsum("bqhe,bkhe->bhqk", shifted(q), shifted(k))
    torch.testing.assert_close(scores_shifted, scores, rtol=1e-4, atol=1e-4)
