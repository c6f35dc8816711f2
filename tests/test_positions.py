"""Positions and embedding tables (`normlab.model.positions`): the fast rotary rotation against
two independent truths, the textbook rotate-half formula and a complex-number rotation of
(i, i + d/2) pairs; `lookup` against indexing and a hand-written scatter-add, and its gradient's
reproducibility on two threads."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch

from normlab import ModelConfig, build_model
from normlab.model import native
from normlab.model.positions import Rotary, lookup, sinusoidal_table


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


@pytest.mark.parametrize("kernel", [True, False], ids=["native", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rotation_equals_the_textbook_formula_bit_for_bit(
    dtype: torch.dtype, kernel: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both paths: normlab's CPU kernel (float32, where built; here at any size) and torch's
    ops."""
    monkeypatch.setattr(native, "ROPE_MIN_ELEMENTS", 1)
    torch.manual_seed(0)
    rope_of = Rotary(16, 10000.0)
    positions = torch.randint(0, 40, (3, 7))
    rope = rope_of(positions)
    native.set_enabled(kernel, "rope")
    try:
        for heads in (4, 2, 4):  # q then GQA k then q again: each head count its own tables
            x = torch.randn(3, 7, heads, 16, dtype=dtype)
            assert torch.equal(rope(x), textbook(x, positions, 10000.0))
    finally:
        native.set_enabled(True, "rope")
    # the torch ops widen the tables once per head count; the kernel reads them as they are
    took_kernel = kernel and dtype is torch.float32 and native.load() is not None
    assert sorted(rope._wide) == ([] if took_kernel else [2, 4])


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


# --------------------------------------------------------------------------- embedding lookups


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_lookup_is_indexing_forward_and_its_gradient_sums_per_row() -> None:
    """`lookup(table, ids)` = `table[ids]`; its gradient is, per table row, the sum of the
    output gradients of the positions that read it (the hand-written scatter-add below)."""
    table = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    ids = torch.tensor([[0, 4, 4], [1, 4, 0]])
    out = lookup(table, ids)
    assert torch.equal(out, table[ids])
    g = torch.randn(2, 3, 3, dtype=torch.float64)
    out.backward(g)
    want = torch.zeros(5, 3, dtype=torch.float64)
    for b in range(2):
        for p in range(3):
            want[ids[b, p]] += g[b, p]
    assert torch.allclose(table.grad, want, rtol=0, atol=1e-12)
    assert not table.grad[2].any() and not table.grad[3].any()  # rows nobody read


def test_lookup_gradient_is_reproducible_with_two_threads() -> None:
    """Indexing's CPU backward adds a small vocabulary's many gradients in a varying order on
    two threads (it failed this 20 times in 20); the lookup must give the one-thread gradient,
    bit for bit, on every pass."""
    table = torch.randn(16, 64, requires_grad=True)
    ids = torch.randint(0, 16, (128, 17))
    g = torch.randn(128, 17, 64)

    def grad() -> torch.Tensor:
        table.grad = None
        lookup(table, ids).backward(g)
        return table.grad.clone()

    with threads(1):
        one = grad()
    with threads(2):
        for _ in range(10):
            assert torch.equal(grad(), one)


def test_model_backward_is_bitwise_reproducible_with_two_threads() -> None:
    """A training backward of a model with token, digit-position and learned position tables
    gives the same gradients, every parameter's, on every pass at two threads (with indexing,
    the three tables' did not), so two-thread training is reproducible."""
    cfg = ModelConfig(arch="decoder", norm_placement="qkv", d_model=32, n_heads=4, n_layers=2,
                      d_mlp=64, max_len=24, pos_encoding="learned", n_aux_positions=8)
    model = build_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (128, 17))
    aux = torch.randint(0, 8, (128, 17))

    def grads() -> dict[str, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        model(tokens, aux=aux).square().mean().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    with threads(2):
        first = grads()
        assert {"embed.W_E", "W_aux", "pos_embed.W_pos"} <= set(first)
        for _ in range(3):
            again = grads()
            for name in first:
                assert torch.equal(again[name], first[name]), name


@pytest.mark.parametrize(("field", "bad"), [("tokens", 16), ("tokens", -1), ("aux", 8)])
def test_an_id_outside_its_table_is_one_clear_error(field: str, bad: int) -> None:
    """Indexing wrapped a negative token round to the last row (silent garbage)."""
    cfg = ModelConfig(arch="decoder", d_model=16, n_heads=2, n_layers=1, d_mlp=32, max_len=8,
                      n_aux_positions=8)
    model = build_model(cfg)
    inputs = {"tokens": torch.zeros(2, 3, dtype=torch.long),
              "aux": torch.zeros(2, 3, dtype=torch.long)}
    inputs[field][1, 2] = bad
    n = cfg.vocab_size if field == "tokens" else 8
    with pytest.raises(IndexError, match=rf"^{field}: expected ids in \[0, {n}\), got values "
                                         rf"from {min(bad, 0)} to {max(bad, 0)}$"):
        model(inputs["tokens"], aux=inputs["aux"])


@pytest.mark.parametrize("pos", ["learned", "sinusoidal"])
def test_a_position_past_the_table_is_one_clear_error_whoever_counts_it(pos: str) -> None:
    """An additive table has `max_len` rows. Past them: a one-line error, for positions the
    model counts (along the row) and for positions passed in. Where the model counts them
    below a bound it knows, nothing is read back; where its bound reaches the end (left-padded
    rows count real tokens only), it reads their largest, and rows that fit still run."""
    model = build_model(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_mlp=32, max_len=8,
                                    vocab_size=16, pos_encoding=pos))
    model(torch.randint(0, 16, (2, 8)))  # positions 0-7: the whole table
    with pytest.raises(ValueError, match=r"position 8 is beyond ModelConfig\.max_len=8; raise"):
        model(torch.randint(0, 16, (2, 9)))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[:, :2] = False  # two pads on the left: 8 real tokens, positions 0-7
    logits = model(torch.randint(0, 16, (2, 10)), attention_mask=mask)
    assert bool(torch.isfinite(logits).all())
    mask[1, 1] = True  # row 1: 9 real tokens
    with pytest.raises(ValueError, match=r"position 8 is beyond ModelConfig\.max_len=8"):
        model(torch.randint(0, 16, (2, 10)), attention_mask=mask)
    model(torch.randint(0, 16, (1, 3)), positions=torch.tensor([[5, 6, 7]]))
    with pytest.raises(ValueError, match=r"position 9 is beyond ModelConfig\.max_len=8"):
        model(torch.randint(0, 16, (1, 3)), positions=torch.tensor([[0, 9, 1]]))


def test_positions_count_the_tokens_an_integer_mask_marks_real() -> None:
    """An integer attention mask counts as its truth values (as the attention mask reads
    it); a 2 counted two positions, then one real token without a word, and is now refused."""
    model = build_model(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_mlp=32, max_len=8,
                                    vocab_size=16, pos_encoding="learned"))
    tokens = torch.randint(0, 16, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.bool)
    mask[:, :2] = False
    as_bool = model(tokens, attention_mask=mask)
    assert torch.equal(model(tokens, attention_mask=mask.long()), as_bool)
    with pytest.raises(ValueError, match=r"^attention_mask: expected a bool mask or 0/1 values"):
        model(tokens, attention_mask=mask.long() * 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_a_half_precision_rope_model_rotates_in_its_own_dtype(dtype: torch.dtype,
                                                              arch: str) -> None:
    """`model.to(bfloat16)` rounded `inv_freq`, and its float32 tables promoted q and k but not
    v: every forward failed. The tables are now the model's dtype, from float32 angles."""
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, d_model=32, n_heads=2, n_layers=1, max_len=2048,
                      pos_encoding="rope")
    model = build_model(cfg)
    ref = torch.randint(3, cfg.vocab_size, (2, 9))
    args = (ref, ref) if arch == "encoder_decoder" else (ref,)
    want = model(*args)
    got = model.to(dtype)(*args)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.05)
    rotary = Rotary(16, 10000.0).to(dtype)
    positions = torch.tensor([[1000]])
    rope = rotary(positions)
    truth = Rotary(16, 10000.0)(positions)  # float32 throughout
    assert rope.cos.dtype == dtype
    torch.testing.assert_close(rope.cos.float(), truth.cos.to(dtype).float(), atol=0, rtol=0)
    back = rotary.float()(positions)  # the round trip kept the rounded frequencies
    assert torch.equal(back.cos, truth.cos) and torch.equal(back.sin, truth.sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_precision_tables_are_the_textbook_ones(dtype: torch.dtype) -> None:
    """float32 and float64 models take their angles from frequencies computed in their own
    dtype: float32's as before the half-precision fix; a float64 model's were float32's cast up
    (6e-8 off, 8e-6 rad at position 4000), now the float64 formula's to rounding."""
    positions = torch.tensor([[0, 1, 7, 1000, 4000]])
    inv = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=dtype) / 16)
    angles = positions[..., None].to(dtype) * inv
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
    rope = Rotary(16, 10000.0).to(dtype)(positions)
    assert rope.cos.dtype == dtype and torch.equal(rope.cos, angles.cos())
    if dtype == torch.float64:  # against Python's float64 formula
        exact = torch.tensor([[math.cos(p * 10000.0 ** (-i / 16)) for i in range(0, 16, 2)]
                              for p in positions[0].tolist()], dtype=torch.float64)
        torch.testing.assert_close(rope.cos[0, :, 0, :8], exact, atol=1e-11, rtol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast leaves the tables float32
        assert Rotary(16, 10000.0)(positions).cos.dtype == torch.float32


@pytest.mark.parametrize("d", [6, 7])
def test_sinusoidal_table_is_the_vaswani_formula(d: int) -> None:
    """The fixed table is Vaswani et al.'s: sin(pos / 10000^(2i/d)) at dim 2i, cos at 2i + 1
    (an odd width drops the last cos), and it is what a sinusoidal model adds to its tokens."""
    want = torch.zeros(9, d, dtype=torch.float64)
    for pos in range(9):
        for i in range(0, d, 2):
            angle = pos / 10000.0 ** (i / d)
            want[pos, i] = math.sin(angle)
            if i + 1 < d:
                want[pos, i + 1] = math.cos(angle)
    torch.testing.assert_close(sinusoidal_table(9, d).double(), want, atol=1e-6, rtol=0)
    # far out too: computed in float32 the angles drifted (1.5e-4 off at 4096 positions, width 64)
    pos = torch.arange(4096, dtype=torch.float64)[:, None]
    angle = pos / 10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    far = sinusoidal_table(4096, d).double()
    torch.testing.assert_close(far[:, 0::2], angle.sin(), atol=1e-7, rtol=0)
    torch.testing.assert_close(far[:, 1::2], angle.cos()[:, : d // 2], atol=1e-7, rtol=0)
    model = build_model(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_mlp=32, max_len=8,
                                    vocab_size=16, pos_encoding="sinusoidal"))
    assert torch.equal(model.pos_embed.W_pos, sinusoidal_table(8, 16).float())


def test_a_sinusoidal_table_follows_the_models_dtype_from_its_exact_values() -> None:
    """A cast rounded the buffer: a float64 model read float32's table (its rounding, up to
    3e-8 here), and a round trip through bfloat16 kept bfloat16's."""
    model = build_model(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_mlp=32, max_len=64,
                                    vocab_size=16, pos_encoding="sinusoidal"))
    exact = sinusoidal_table(64, 16)
    assert torch.equal(model.double().pos_embed.W_pos, exact)
    assert torch.equal(model.to(torch.bfloat16).float().pos_embed.W_pos, exact.float())
    assert model.pos_embed.W_pos.dtype == torch.float32
    assert "pos_embed.W_pos" not in model.state_dict()  # still not saved


def test_a_model_built_under_a_float64_default_reads_its_fixed_buffers_exact() -> None:
    """Under `torch.set_default_dtype(torch.float64)` the parameters were float64 but the fixed
    buffers float32 (logit scale 1/sqrt(8), RoPE's frequencies, the sinusoidal table): the
    model read float32's rounding of them, as a cast model did before they were kept exact."""
    truth = {"scale": torch.full((2,), 1 / math.sqrt(8), dtype=torch.float64),
             "inv_freq": torch.tensor([10000.0 ** (-i / 8) for i in range(0, 8, 2)],
                                      dtype=torch.float64),
             "W_pos": sinusoidal_table(8, 16)}
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        models = [build_model(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_mlp=32, max_len=8,
                                          vocab_size=16, pos_encoding=p))
                  for p in ("rope", "sinusoidal")]
    finally:
        torch.set_default_dtype(before)
    seen = set()
    for model in models:
        assert {p.dtype for p in model.parameters()} == {torch.float64}
        for name, buf in model.named_buffers():
            leaf = name.rsplit(".", 1)[-1]
            seen.add(leaf)
            assert buf.dtype == torch.float64, name
            torch.testing.assert_close(buf, truth[leaf], atol=0, rtol=1e-15)
    assert seen == set(truth)
    # under the usual float32 default they are float32's, as the parameters are
    model = build_model(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_mlp=32, max_len=8,
                                    vocab_size=16))
    assert {b.dtype for b in model.buffers()} == {torch.float32}
