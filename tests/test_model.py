"""The model computes what PAPER.md section 3 says, for every placement and norm type."""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from normlab import ModelConfig, build_model
from normlab.model import transformer
from normlab.model.attention import kernel_by_default, learned_scale_init
from normlab.model.transformer import footprint

PLACEMENTS = ["none", "post", "pre", "qk", "qkv", "pre_qk"]
NORMS = ["layer", "rms"]


def tiny(**kw) -> ModelConfig:
    # init_std 0.3: large enough that attention patterns are far from uniform
    base = dict(
        d_model=32, n_heads=4, n_layers=1, d_mlp=64, max_len=16, vocab_size=16, init_std=0.3
    )
    base.update(kw)
    return ModelConfig(**base)


def randomise(model: torch.nn.Module) -> None:
    """Non-trivial gains, biases and scales so a reference that forgets one of them fails."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".w", ".b")) or ".b_" in name or name.endswith("scale"):
                p.copy_(p + 0.3 * torch.randn_like(p))


# ---- an independent reference: per-head loops and torch's own functional norms ----------


def ref_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, kind: str) -> torch.Tensor:
    if kind == "layer":
        return F.layer_norm(x, x.shape[-1:], w, b, eps=1e-5)
    return F.rms_norm(x, x.shape[-1:], w, eps=1e-5)


def ref_rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of one head's x [batch, T, d] at positions [batch, T]: pair (i, i + d/2)
    turned by pos * 10000^(-2i/d), the angles from Python's float64 formula."""
    d = x.shape[-1]
    freq = torch.tensor([10000.0 ** (-2 * i / d) for i in range(d // 2)], dtype=torch.float64)
    angle = positions[..., None].double() * freq
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def ref_block(x: torch.Tensor, blk, placement: str, kind: str, keep: torch.Tensor,
              positions: torch.Tensor | None = None) -> torch.Tensor:
    """One block on x [batch, T, d_model]: `keep` [batch, T, T] is True where a query may
    attend; `positions` [batch, T], where given, rotate q and k (RoPE)."""
    a = blk.attn
    d_head = a.W_Q.shape[-1]
    per_kv = a.n_heads // a.n_kv_heads

    def norm_of(mod, v):
        return ref_norm(v, mod.w, getattr(mod, "b", None), kind)

    def attn(h):
        outs = []
        for i in range(a.n_heads):
            j = i // per_kv
            q, k, v = h @ a.W_Q[i], h @ a.W_K[j], h @ a.W_V[j]
            if placement in ("qk", "qkv", "pre_qk"):
                q, k = norm_of(a.q_norm, q), norm_of(a.k_norm, k)
            if placement == "qkv":
                v = norm_of(a.v_norm, v)
            if positions is not None:
                q, k = ref_rope(q, positions), ref_rope(k, positions)
            learned = isinstance(a.scale, torch.nn.Parameter)  # else the fixed 1/sqrt(d_head)
            s = (q @ k.transpose(-1, -2)) * (a.scale[i] if learned else 1 / math.sqrt(d_head))
            s = s.masked_fill(~keep, -math.inf)
            outs.append(s.softmax(-1) @ v @ a.W_O[i])
        return sum(outs)

    def mlp(h):
        return F.gelu(h @ blk.mlp.W_in) @ blk.mlp.W_out

    if placement == "none":
        x = x + attn(x)
        return x + mlp(x)
    if placement == "post":
        x = norm_of(blk.ln1, x + attn(x))
        return norm_of(blk.ln2, x + mlp(x))
    if placement in ("pre", "pre_qk"):  # pre_qk: q/k norms inside attention too
        x = x + attn(norm_of(blk.ln1, x))
        return x + mlp(norm_of(blk.ln2, x))
    x = x + attn(x)  # qk / qkv: norms inside attention, Pre-Norm MLP
    return x + mlp(norm_of(blk.ln2, x))


def ref_logits(model, tokens: torch.Tensor, mask: torch.Tensor, placement: str,
               kind: str) -> torch.Tensor:
    """A one-layer decoder's logits for tokens [batch, T] under a key mask [batch, T] (True on
    real tokens): positions count a row's real tokens, a query sees the real keys up to
    itself and always itself."""
    T = tokens.shape[1]
    positions = (mask.long().cumsum(-1) - 1).clamp(min=0)
    keep = torch.ones(T, T).tril().bool() & mask[:, None, :] | torch.eye(T).bool()
    x = model.embed.W_E[tokens]
    rope = model.cfg.pos_encoding == "rope"
    if not rope:
        x = x + model.pos_embed.W_pos[positions]
    x = ref_block(x, model.blocks[0], placement, kind, keep, positions if rope else None)
    if placement not in ("none", "post"):
        x = ref_norm(x, model.ln_final.w, getattr(model.ln_final, "b", None), kind)
    return x @ model.W_U


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("T", [7, 100])
@pytest.mark.parametrize("pos", ["learned", "rope"])
@pytest.mark.parametrize("kind", NORMS)
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_model_matches_reference(placement: str, kind: str, pos: str, T: int,
                                 dtype: torch.dtype, sdpa_past) -> None:
    """Every attention path (the default one: the kernel or SDPA; the explicit one a hook
    reads; SDPA) gives the float64 reference's logits on left-padded rows of 7 and 100 tokens.
    Before, one block on 7 unpadded tokens was compared, without pre_qk, RoPE or a mask; and a
    float64 model's logit scale and RoPE frequencies were float32's cast up, 1e-8 to 1e-6 off
    the reference (a hook reading the pattern changed its logits)."""
    model = build_model(tiny(norm_placement=placement, norm_type=kind, pos_encoding=pos,
                             max_len=128)).to(dtype)
    randomise(model)
    tokens = torch.randint(0, 16, (3, T))
    mask = torch.ones(3, T, dtype=torch.bool)
    mask[0, : T // 3] = False
    mask[1, :1] = False
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-12)
    with torch.no_grad():
        want = ref_logits(copy.deepcopy(model).double(), tokens, mask, placement, kind)
        ours = model(tokens, attention_mask=mask)
        hooked = model.run_with_hooks(tokens, attention_mask=mask, fwd_hooks=[
            ("blocks.0.attn.hook_pattern", lambda x, hook: None)])
        sdpa_past(0)
        fused = model(tokens, attention_mask=mask)
    for got in (ours, hooked, fused):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, **tol)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_norm_modules_present_exactly_where_placement_says(placement: str) -> None:
    model = build_model(tiny(norm_placement=placement))
    names = set(model.hook_names())
    assert ("blocks.0.ln1.hook_scale" in names) == (placement in ("pre", "post", "pre_qk"))
    assert ("blocks.0.ln2.hook_scale" in names) == (placement != "none")
    assert ("blocks.0.attn.k_norm.hook_scale" in names) == (placement in ("qk", "qkv", "pre_qk"))
    assert ("blocks.0.attn.v_norm.hook_scale" in names) == (placement == "qkv")
    assert ("ln_final.hook_scale" in names) == (placement in ("pre", "qk", "qkv", "pre_qk"))


# ---- the paper's mechanism as executable facts --------------------------------------------


def _blind_head_model(placement: str, kind: str = "rms"):
    """Head 0's W_Q and W_K cannot read direction u (a zero-mean unit vector)."""
    model = build_model(tiny(norm_placement=placement, norm_type=kind))
    u = torch.randn(32)
    u = u - u.mean()
    u = u / u.norm()
    proj = torch.eye(32) - torch.outer(u, u)
    with torch.no_grad():
        for W in (model.blocks[0].attn.W_Q, model.blocks[0].attn.W_K):
            W[0] = proj @ W[0]
    return model, u


@pytest.mark.parametrize("kind", NORMS)
@pytest.mark.parametrize("placement", ["none", "pre", "qkv"])
def test_content_in_an_unread_subspace_interferes_only_under_pre(placement: str, kind: str):
    model, u = _blind_head_model(placement, kind)
    tokens = torch.randint(0, 16, (1, 8))
    names = ["blocks.0.attn.hook_k", "blocks.0.attn.hook_pattern"]
    _, base = model.run_with_cache(tokens, names_filter=names)

    def add_u(x, hook):  # 3 * u on the residual input of token 2 only
        x = x.clone()
        x[:, 2] += 3.0 * u
        return x

    with model.hooks([("blocks.0.hook_resid_pre", add_u)]):
        _, moved = model.run_with_cache(tokens, names_filter=names)
    k0, k1 = base["blocks.0.attn.hook_k"][0, :, 0], moved["blocks.0.attn.hook_k"][0, :, 0]
    p0, p1 = base["blocks.0.attn.hook_pattern"][0, 0], moved["blocks.0.attn.hook_pattern"][0, 0]
    if placement == "pre":  # the shared normalisation factor rescales token 2's key
        assert (k0[2] - k1[2]).abs().max() > 1e-3
        assert (p0 - p1).abs().max() > 1e-4
    else:
        torch.testing.assert_close(k0, k1, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(p0, p1, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("placement", ["none", "pre", "qkv"])
def test_rescaling_a_tokens_residual(placement: str) -> None:
    """Pre and QKV-Norm patterns ignore a token's overall scale; no norm does not.

    (Exactly so only as norm_eps -> 0, hence the tiny eps here.)"""
    model = build_model(tiny(norm_placement=placement, norm_type="rms", norm_eps=1e-12))
    tokens = torch.randint(0, 16, (1, 8))
    name = "blocks.0.attn.hook_pattern"
    _, base = model.run_with_cache(tokens, names_filter=name)

    def scale3(x, hook):
        x = x.clone()
        x[:, 3] *= 5.0
        return x

    with model.hooks([("blocks.0.hook_resid_pre", scale3)]):
        _, moved = model.run_with_cache(tokens, names_filter=name)
    diff = (base[name] - moved[name]).abs().max()
    if placement == "none":
        assert diff > 1e-4
    else:
        assert diff < 1e-5


# ---- a second implementation written by others: HF GPT-2 -----------------------------------


def test_matches_hf_gpt2() -> None:
    transformers = pytest.importorskip("transformers")
    from normlab.interop import from_hf

    hf_cfg = transformers.GPT2Config(
        n_embd=64,
        n_head=4,
        n_layer=2,
        vocab_size=100,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    with torch.no_grad():  # non-trivial norm gains and biases
        for name, p in hf.named_parameters():
            if "ln" in name:
                p.add_(0.2 * torch.randn_like(p))
    model = from_hf(hf)
    assert model.cfg.norm_placement == "pre" and model.cfg.tie_embeddings
    tokens = torch.randint(0, 100, (3, 20))
    with torch.no_grad():
        ref = hf(tokens).logits
        ours = model(tokens)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


# ---- scales ---------------------------------------------------------------------------------


def test_attention_scale_options() -> None:
    fixed = build_model(tiny(norm_placement="qkv", attn_scale="fixed"))
    learned = build_model(tiny(norm_placement="qkv", attn_scale="learned"))
    pre = build_model(tiny(norm_placement="pre", attn_scale="learned"))
    assert not isinstance(fixed.blocks[0].attn.scale, torch.nn.Parameter)
    assert torch.allclose(fixed.blocks[0].attn.scale, torch.full((4,), 1 / math.sqrt(8)))
    assert isinstance(learned.blocks[0].attn.scale, torch.nn.Parameter)
    # log2(L^2 - L) / d_head with L = 16, d_head = 8
    assert learned_scale_init(learned.cfg) == pytest.approx(math.log2(240) / 8)
    # and the built model starts there, every head of every block (1 / sqrt(d_head) passed)
    for block in learned.blocks:
        torch.testing.assert_close(block.attn.scale.detach(), torch.full((4,), math.log2(240) / 8))
    assert not isinstance(pre.blocks[0].attn.scale, torch.nn.Parameter)  # q, k not normalised


def test_the_fixed_logit_scale_is_exact_in_the_models_dtype() -> None:
    """1/sqrt(d_head) was a float32 buffer that a cast rounded: a float64 model's was float32's
    (2e-8 off, on the explicit path only, so a hook reading the pattern changed its logits),
    and a round trip through bfloat16 kept bfloat16's. float32's is the one it always was."""
    model = build_model(tiny(norm_placement="pre"))  # d_head 8
    exact = 1 / math.sqrt(8)
    assert torch.equal(model.blocks[0].attn.scale, torch.tensor([exact] * 4, dtype=torch.float32))
    scale = model.double().blocks[0].attn.scale
    assert scale.dtype == torch.float64 and scale.tolist() == [exact] * 4
    scale = model.to(torch.bfloat16).float().blocks[0].attn.scale
    assert torch.equal(scale, torch.tensor([exact] * 4, dtype=torch.float32))
    assert "blocks.0.attn.scale" not in model.state_dict()  # still not saved


def test_qkv_norm_scope_all_normalises_whole_projection() -> None:
    model = build_model(tiny(norm_placement="qkv", norm_type="rms", qkv_norm_scope="all"))
    tokens = torch.randint(0, 16, (2, 6))
    _, cache = model.run_with_cache(tokens)
    assert cache["blocks.0.attn.q_norm.hook_scale"].shape == (2, 6, 1)
    q = cache["blocks.0.attn.hook_q"].flatten(-2)
    # gain is ones at init, so each whole q has RMS 1 while single heads need not
    torch.testing.assert_close(q.pow(2).mean(-1), torch.ones(2, 6), atol=1e-4, rtol=1e-4)
    head = build_model(tiny(norm_placement="qkv", norm_type="rms"))
    _, hc = head.run_with_cache(tokens)
    assert hc["blocks.0.attn.q_norm.hook_scale"].shape == (2, 6, 4, 1)


# ---- bad configs ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"norm_placement": "middle"}, "norm_placement"),
        ({"norm_type": "batch"}, "norm_type"),
        ({"arch": "encoder"}, "arch"),
        ({"pos_encoding": "alibi"}, "pos_encoding"),
        ({"qkv_norm_scope": "token"}, "qkv_norm_scope"),
        ({"attn_scale": "henry"}, "attn_scale"),
        ({"d_model": 30, "n_heads": 4}, "d_model"),
        ({"d_model": 0}, "d_model"),
        ({"n_layers": -1}, "n_layers"),
        ({"dropout": 1.0}, "dropout"),
        ({"dropout": -0.1}, "dropout"),
        ({"n_kv_heads": 3}, "n_kv_heads"),
        ({"pos_encoding": "rope", "d_model": 36, "n_heads": 4}, "d_head"),
        # not numbers where numbers go: a TypeError from the derived sizes used to come first
        ({"n_heads": "4"}, "n_heads"),
        ({"d_model": "128"}, "d_model"),
        # NaN or inf gave non-finite outputs, or (rope_theta inf) no rotation at all
        ({"norm_eps": float("nan")}, "norm_eps"),
        ({"rope_theta": float("inf")}, "rope_theta"),
        ({"init_std": float("nan")}, "init_std"),
        ({"norm_eps": True}, "norm_eps"),
        # finite in float64, not in the model's float32: inf weights, or an eps of 0 (0/0)
        ({"init_std": 1e39}, "init_std"),
        ({"norm_eps": 1e-60}, "norm_eps"),
        ({"norm_eps": -1e-5}, "norm_eps"),
        ({"norm_bias": "false"}, "norm_bias"),  # was taken as true
        ({"tie_embeddings": 1}, "tie_embeddings"),
        # past int64: torch's "Overflow when unpacking long" (a TypeError), naming nothing
        ({"vocab_size": 2**64}, "vocab_size"),
        ({"d_head": 2**63, "d_model": 2, "n_heads": 1}, "d_head"),
    ],
)
def test_bad_config_is_a_one_line_error(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError) as err:
        tiny(**kwargs)
    msg = str(err.value)
    assert f"ModelConfig.{field}" in msg and "\n" not in msg
    assert "expected" in msg


@pytest.mark.parametrize(
    ("kwargs", "named", "largest"),
    [
        # 256 PiB of positions: past any machine's address space, so refused everywhere
        ({"max_len": 10**15, "pos_encoding": "learned"}, "max_len = 1000000000000000",
         "pos_embed.W_pos, is [1000000000000000, 32]"),
        ({"vocab_size": 10**15}, "vocab_size = 1000000000000000", "W_U, is [32, "),
        # d_model**2 overflows torch's size arithmetic before any allocation
        ({"d_model": 2**40, "n_heads": 1}, "d_model = 1099511627776, ModelConfig.d_head = "
         "1099511627776", None),
        # and d_mlp, 4 d_model by default, is named with d_model
        ({"d_model": 2**27, "n_heads": 2, "d_mlp": None}, "d_mlp = 536870912, ModelConfig.d_model "
         "= 134217728", "blocks.0.mlp.W_in, is [134217728, 536870912]"),
    ],
)
def test_a_model_too_large_to_allocate_names_its_field(kwargs: dict, named: str,
                                                       largest: str | None) -> None:
    """torch's allocator said "DefaultCPUAllocator: can't allocate memory: you tried to
    allocate 512000000000000 bytes", and its size check "Storage size calculation overflowed":
    neither names the config field that asked for it."""
    with pytest.raises(ValueError) as err:
        build_model(tiny(**kwargs))
    msg = str(err.value)
    assert msg.startswith(f"ModelConfig.{named}: ") and "\n" not in msg
    assert msg.endswith("expected a smaller size")
    if largest:
        assert f"(the largest, {largest}" in msg and " GiB, more than could be allocated" in msg


def test_other_errors_building_a_model_are_not_taken_for_its_size(monkeypatch) -> None:
    from normlab.model.transformer import DecoderLM

    def broken(self, cfg):
        raise RuntimeError("a bug, not a size")

    monkeypatch.setattr(DecoderLM, "__init__", broken)
    with pytest.raises(RuntimeError, match="a bug, not a size"):
        build_model(tiny())


@pytest.mark.parametrize(
    "kwargs",
    [
        {"n_layers": 3},
        {"n_layers": 5, "pos_encoding": "rope", "tie_embeddings": True, "norm_placement": "qkv",
         "n_aux_positions": 4, "mlp_type": "gated", "attn_bias": True, "n_kv_heads": 2},
        {"arch": "encoder_decoder", "n_encoder_layers": 3, "n_decoder_layers": 4,
         "norm_placement": "post", "pos_encoding": "sinusoidal"},
    ],
)
def test_footprint_counts_the_bytes_the_built_model_holds(kwargs: dict) -> None:
    """Sized from one layer a stack on the meta device: the built model's own tensors are the
    truth."""
    cfg = tiny(**kwargs)
    model = build_model(cfg)
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    fp = footprint(type(model), cfg)
    assert fp.total == held
    # the modules of every layer, counted on the built model
    assert fp.modules == sum(".blocks." in f".{n}" for n, _ in model.named_modules())
    assert fp.shallow < fp.total and all(b > 0 for b in fp.per_layer.values())


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"n_layers": 4000}, "ModelConfig.n_layers = 4000: the model's weights and tables take "),
        # only the stack that holds the bytes
        ({"arch": "encoder_decoder", "n_encoder_layers": 4000, "n_decoder_layers": 2},
         "ModelConfig.n_encoder_layers = 4000: "),
        ({"arch": "encoder_decoder", "n_encoder_layers": 3000, "n_decoder_layers": 3000},
         "ModelConfig.n_encoder_layers = 3000, ModelConfig.n_decoder_layers = 3000: "),
    ],
)
def test_a_model_deeper_than_memory_is_refused_before_it_is_built(monkeypatch, kwargs: dict,
                                                                   named: str) -> None:
    """Each layer's tensors are small, so the allocator granted them all and the kernel killed
    the process once they were written (100,000 layers of d_model 64 on a 24 GiB machine,
    after minutes): no line named n_layers. Here memory is set at 64 MiB: 4000 layers of ~33
    KiB of weights and 64 KiB of modules each pass it, 300 fit."""
    monkeypatch.setattr(transformer, "memory_bytes", lambda: 64 * 2**20)
    monkeypatch.setattr(transformer.DecoderLM, "__init__", _refuses_to_build(
        transformer.DecoderLM.__init__, max_layers=1))
    monkeypatch.setattr(transformer.EncoderDecoderLM, "__init__", _refuses_to_build(
        transformer.EncoderDecoderLM.__init__, max_layers=1))
    with pytest.raises(ValueError) as err:
        build_model(tiny(**kwargs))
    msg = str(err.value)
    assert msg.startswith(named) and "\n" not in msg
    assert msg.endswith("beyond this machine's 64.0 MiB of memory and swap; expected a smaller "
                        "size")
    monkeypatch.undo()
    monkeypatch.setattr(transformer, "memory_bytes", lambda: 64 * 2**20)
    assert len(build_model(tiny(n_layers=300)).blocks) == 300  # within it: built


def test_a_layer_too_wide_for_memory_names_the_width(monkeypatch) -> None:
    """Two layers of d_model 1024 (4 * 1024**2 + 2 * 1024 * 4096 weights, 48.0 MiB each, and
    0.2 MiB of embeddings) past 64 MiB: the depth was named, as if fewer layers were the fix;
    a layer that is itself a large share of memory names the width."""
    monkeypatch.setattr(transformer, "memory_bytes", lambda: 64 * 2**20)
    with pytest.raises(ValueError) as err:
        build_model(tiny(d_model=1024, n_heads=4, d_mlp=4096, n_layers=2))
    assert str(err.value).startswith("ModelConfig.d_mlp = 4096, ModelConfig.d_model = 1024: the "
                                     "model's weights and tables take 96.2 MiB, more than could "
                                     "be allocated (the largest, blocks.0.mlp.W_in")


def _refuses_to_build(init, max_layers: int):
    """`init` that fails a test which builds a model deeper than `max_layers` off the meta
    device (the check must size it first)."""
    def guarded(self, cfg):
        deep = max(cfg.n_layers if cfg.arch == "decoder" else
                   max(cfg.n_encoder_layers, cfg.n_decoder_layers), 0)
        assert deep <= max_layers or torch.empty(0).is_meta, "built before it was sized"
        init(self, cfg)
    return guarded


def test_a_machine_that_does_not_say_its_memory_builds_without_the_check(monkeypatch) -> None:
    monkeypatch.setattr(transformer, "memory_bytes", lambda: None)
    assert len(build_model(tiny(n_layers=3)).blocks) == 3


def test_numpy_floats_are_taken_as_python_floats() -> None:
    """np.float32(1e-5) was refused as "not a positive finite number"; a numpy float kept in
    the config would not serialise to JSON."""
    c = tiny(norm_eps=np.float32(1e-5), init_std=np.float64(0.02), dropout=np.float32(0.25))
    assert all(type(v) is float for v in (c.norm_eps, c.init_std, c.dropout))
    assert c.dropout == 0.25
    json.dumps(c.to_dict())


def test_unknown_field_from_dict() -> None:
    with pytest.raises(ValueError, match=r"^ModelConfig: unknown field 1; expected one of"):
        ModelConfig.from_dict({1: 2})  # type: ignore[dict-item]  # difflib's TypeError
    with pytest.raises(ValueError, match="unknown field 'd_modle' \\(did you mean 'd_model'"):
        ModelConfig.from_dict({"d_modle": 3})


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_init_shrinks_every_output_projection_by_the_total_depth(arch: str) -> None:
    """GPT-2 init: every `W_*` is N(0, init_std) except the residual writers `W_O` and `W_out`,
    N(0, init_std / sqrt(2 L)) with L every layer the residual stream passes (encoder's and
    decoder's together)."""
    torch.manual_seed(0)
    layers = {"n_layers": 3} if arch == "decoder" else {"n_encoder_layers": 5,
                                                        "n_decoder_layers": 2}
    model = build_model(tiny(arch=arch, d_model=64, d_mlp=256, init_std=0.02, **layers))
    depth = 3 if arch == "decoder" else 7
    seen = set()
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if not leaf.startswith("W_"):
            continue
        want = 0.02 / math.sqrt(2 * depth) if leaf in ("W_O", "W_out") else 0.02
        assert abs(p.std().item() / want - 1) < 0.1, (name, p.std().item(), want)
        seen.add(leaf)
    assert {"W_O", "W_out", "W_Q", "W_in", "W_E"} <= seen


def test_tied_encoder_decoder_unembeds_with_the_decoders_table() -> None:
    """A tied encoder-decoder's logits are its decoder's final residual times the decoder's
    own embedding table (the table its targets are read with), not the encoder's."""
    torch.manual_seed(0)
    model = build_model(tiny(arch="encoder_decoder", tie_embeddings=True))
    assert model.encoder.embed.W_E is not model.decoder.embed.W_E
    src, tgt = torch.randint(0, 16, (2, 7)), torch.randint(0, 16, (2, 5))
    logits, cache = model.run_with_cache(src, tgt)
    table = cache["decoder.hook_embed"][0]  # row p: the embedding of tgt[0, p]
    assert torch.equal(table, model.decoder.embed.W_E[tgt[0]])
    want = cache["decoder.ln_final.hook_normalized"] @ model.decoder.embed.W_E.T
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=1e-5)


def test_evaluating_runs_without_autograd_in_eval_mode_and_restores_the_mode() -> None:
    """Inside `transformer.evaluating` a forward records no graph (greedy decoding and every
    analysis run there) and the model is in eval mode; afterwards its mode is back."""
    model = build_model(tiny(dropout=0.5)).train()
    tokens = torch.randint(0, 16, (2, 6))
    with transformer.evaluating(model):
        out = model(tokens)
        assert not model.training and not torch.is_grad_enabled()
    assert not out.requires_grad and out.grad_fn is None
    assert model.training and torch.is_grad_enabled() and model(tokens).requires_grad


def test_dropout_only_where_it_drops(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropout modules run only in training with p > 0 (where they draw masks), or when a
    PyTorch hook is registered on them; in eval mode or with p = 0 they are skipped, which
    torch's dropout would return x for anyway: the same output, and no random numbers drawn.
    Training also drops attention weights: the first query, whose one weight is 1, mixes
    either nothing or 2 v (p = 0.5), and in eval mode exactly v."""
    calls: list[int] = []
    forward = torch.nn.Dropout.forward
    monkeypatch.setattr(torch.nn.Dropout, "forward",
                        lambda self, x: calls.append(1) or forward(self, x))
    tokens = torch.randint(0, 16, (4, 9))
    torch.manual_seed(0)
    model = build_model(tiny(n_layers=2, dropout=0.5)).train()
    a, b = model(tokens), model(tokens)
    assert len(calls) == 2 * (1 + 2 * 2) and not torch.equal(a, b)  # embed + 2 a block
    calls.clear()
    model.eval()
    assert torch.equal(model(tokens), model(tokens)) and not calls
    torch.manual_seed(0)
    plain = build_model(tiny(n_layers=2, dropout=0.0)).train()
    rng = torch.get_rng_state()
    y = plain(tokens)
    assert not calls and torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(plain.eval()(tokens), y)
    seen: list[int] = []  # a PyTorch hook on a dropout module still sees its call
    plain.blocks[0].drop.register_forward_hook(lambda m, a, out: seen.append(1))
    plain(tokens)
    assert len(seen) == 2  # attention's and the MLP's
    _, cache = model.train().run_with_cache(tokens)
    z, v = (cache[f"blocks.0.attn.hook_{n}"][:, 0] for n in ("z", "v"))  # [batch, head, d]
    kept = (z == 2 * v).all(-1)
    assert ((z == 0).all(-1) | kept).all() and 0 < int(kept.sum()) < kept.numel()
    _, cache = model.eval().run_with_cache(tokens)
    torch.testing.assert_close(cache["blocks.0.attn.hook_z"][:, 0],
                               cache["blocks.0.attn.hook_v"][:, 0], atol=1e-6, rtol=0)



# ---- q, k, v in one matmul under autocast ------------------------------------------------


class _MatmulWidths(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the output width of every matmul, as it reaches the kernels (after autocast)."""

    def __init__(self) -> None:
        super().__init__()
        self.widths: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default):
            self.widths.append(out.shape[-1])
        return out


@pytest.mark.parametrize("placement", ["pre", "qkv"])
def test_autocast_projects_q_k_v_with_one_matmul(placement: str) -> None:
    """Under the training step's autocast, self-attention gets q, k and v from one matmul of
    the weights side by side (x cast once), cross-attention its k and v from one; without
    autocast each keeps its own. With grouped-query heads and biases, the one matmul's
    projections are the three matmuls' to bfloat16 rounding, in value and in gradient."""
    cfg = tiny(norm_placement=placement, n_kv_heads=2, attn_bias=True, pos_encoding="rope")
    attn = build_model(cfg).blocks[0].attn
    randomise(attn)
    x = torch.randn(3, 7, 32, requires_grad=True)
    e = cfg.d_head
    widths = _MatmulWidths()
    with torch.autocast("cpu", dtype=torch.bfloat16), widths:
        attn(x)
    assert widths.widths == [(4 + 2 + 2) * e, 7, e, 32]  # q, k, v at once; scores, z, W_O
    plain = _MatmulWidths()
    with plain:
        attn(x)
    assert plain.widths[:3] == [4 * e, 2 * e, 2 * e]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = attn._linear(x, "qkv")
        apart = [attn._linear(x, n)[0] for n in "qkv"]
    for f, a in zip(fused, apart, strict=True):
        assert f.dtype == a.dtype and f.shape == a.shape
        torch.testing.assert_close(f, a, rtol=1e-2, atol=1e-2)
    grads = []
    for ys in (fused, apart):
        loss = sum((y.float() * torch.linspace(-1, 1, y.shape[-1])).sum() for y in ys)
        grads.append(torch.autograd.grad(loss, [x, attn.W_Q, attn.W_K, attn.W_V, attn.b_V],
                                         retain_graph=True))
    for g1, g2 in zip(*grads, strict=True):
        torch.testing.assert_close(g1, g2, rtol=2e-2, atol=2e-2)


def test_autocast_cross_attention_projects_k_v_with_one_matmul() -> None:
    cfg = tiny(arch="encoder_decoder", norm_placement="qk", n_encoder_layers=1,
               n_decoder_layers=1)
    cross = build_model(cfg).decoder.blocks[0].cross_attn
    x, memory = torch.randn(2, 5, 32), torch.randn(2, 6, 32)
    widths = _MatmulWidths()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), widths:
        cross(x, memory=memory)
    assert widths.widths[:2] == [4 * cfg.d_head, 8 * cfg.d_head]  # q; then k and v at once


@pytest.mark.parametrize("shape", [(1, 1), (2, 6)])
@pytest.mark.parametrize("placement", ["pre", "qkv"])
def test_autocast_hooks_read_projections_from_their_own_matmuls(
    placement: str, shape: tuple[int, int]
) -> None:
    """Where a hook reads a projection as it leaves its matmul (before its norm, if any), the
    projections keep one matmul each under autocast: the hook gets a contiguous tensor of its
    own (`.view` works) that it may change in place under autograd, which a view of the one
    matmul's output is not (at batch 1 x 1 position it raised)."""
    model = build_model(tiny(norm_placement=placement, pos_encoding="rope"))
    seen = []

    def edit(t: torch.Tensor, hook) -> None:
        seen.append(t.view(t.shape[0], -1).shape)
        t.mul_(1.0)

    at = "_pre_norm" if placement == "qkv" else ""
    hooks = [(f"blocks.0.attn.hook_{n}{at}", edit) for n in "qkv"]
    widths = _MatmulWidths()
    with torch.autocast("cpu", dtype=torch.bfloat16), model.hooks(hooks), widths:
        model(torch.randint(0, 16, shape)).float().sum().backward()
    assert seen == [(shape[0], shape[1] * 32)] * 3
    assert widths.widths[:3] == [32, 32, 32]  # block 0: q, k, v apart


@pytest.mark.parametrize(("d_head", "n_keys", "kernel"), [
    (16, 256, True), (16, 257, False), (32, 256, True), (64, 128, True), (64, 129, False),
    (8, 384, True), (8, 512, True), (8, 513, False), (4, 512, True), (4, 513, False),
    (12, 341, True), (12, 342, False), (13, 315, True), (13, 316, False), (14, 292, True),
    (14, 293, False), (15, 273, True), (15, 274, False), (16, 384, False),
])
def test_shipped_kernel_bounds_by_head_width(d_head: int, n_keys: int, kernel: bool) -> None:
    """`attention.KERNEL_BOUNDS_CPU` as shipped: causal CPU rows past 64 keys take the attention
    kernel up to 256 keys and 8192 key floats, or up to 512 keys and 4096 key floats (heads of
    d_head 8 or less reach 512 keys, 12 to 15 reach 341 to 273). The rule alone: no kernel is
    called."""
    q, k = torch.empty(1, 1, 1, d_head), torch.empty(1, 1, n_keys, d_head)
    assert kernel_by_default(q, k, causal=True) is kernel


def test_kernel_bounds_only_for_causal_cpu_rows() -> None:
    """Past 64 keys, rows that are not causal (an encoder's, cross-attention's) and rows on
    another device stay with SDPA within the bounds; up to 64 keys every CPU row takes the
    kernel's path (the explicit one's)."""
    q, k = torch.empty(1, 1, 1, 8), torch.empty(1, 1, 384, 8)
    assert kernel_by_default(q, k, causal=True)
    assert not kernel_by_default(q, k, causal=False)
    assert not kernel_by_default(q.to("meta"), k.to("meta"), causal=True)
    assert kernel_by_default(q, k[:, :, :64], causal=False)
    assert not kernel_by_default(q.to("meta"), k[:, :, :64].to("meta"), causal=False)


def test_inputs_that_were_broadcast_ignored_or_left_to_torch_are_named() -> None:
    """A source of 2 rows with a target of 1 gave [2, 5, 16] logits, and an empty source
    cross-attention of exactly 0; meta ids gave NaN logits on a CPU model; numpy ids, and a
    cache stepped at another batch size, failed inside torch; RoPE turned float positions by
    fractions; `aux` to a model without digit positions was ignored."""
    import numpy as np

    ed = build_model(tiny(arch="encoder_decoder", n_encoder_layers=1, n_decoder_layers=1))
    src, tgt = torch.randint(0, 16, (2, 6)), torch.randint(0, 16, (1, 5))
    with pytest.raises(ValueError, match=r"^tgt: expected the source's batch of 2 rows; got 1$"):
        ed(src, tgt)
    with pytest.raises(ValueError, match=r"^src: expected at least one source position"):
        ed(src[:, :0], tgt.expand(2, 5))
    assert ed(src, tgt.expand(2, 5)).shape == (2, 5, 16)
    dec = build_model(tiny(pos_encoding="rope"))
    with pytest.raises(ValueError, match=r"^tokens: on meta, the model on cpu; expected them on "
                                         r"one device$"):
        dec(torch.zeros(1, 3, dtype=torch.long, device="meta"))
    with pytest.raises(ValueError, match=r"^tokens: expected a tensor of \[batch, pos\] ids; got "
                                         r"ndarray$"):
        dec(np.zeros((1, 3), dtype=np.int64))  # type: ignore[arg-type]
    cache = dec.new_cache()
    dec(torch.randint(0, 16, (2, 4)), cache=cache)
    with pytest.raises(ValueError, match=r"^tokens: expected the cache's batch of 2 rows; got 3$"):
        dec(torch.randint(0, 16, (3, 1)), cache=cache)
    with pytest.raises(ValueError, match=r"^positions: expected integer positions; got "
                                         r"torch\.float32$"):
        dec(torch.randint(0, 16, (1, 3)), positions=torch.tensor([[0.0, 0.5, 1.0]]))
    with pytest.raises(ValueError, match=r"^aux: this model takes no aux positions"):
        dec(torch.randint(0, 16, (1, 3)), aux=torch.zeros(1, 3, dtype=torch.long))


def test_a_mask_of_other_numbers_than_0_and_1_is_refused() -> None:
    """Masks are read as bool: an additive one (Hugging Face's 0 / -inf) attended to the
    padding and masked the real tokens, and -1, 0.5 or 2 counted as real, each without a word.
    0/1 numbers of any dtype still read as the bool mask."""
    dec = build_model(tiny())
    tokens = torch.randint(0, 16, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[0, :2] = False
    want = dec(tokens, attention_mask=mask)
    for numbers in (mask.long(), mask.float(), mask.to(torch.uint8)):
        assert torch.equal(dec(tokens, attention_mask=numbers), want)
    additive = torch.zeros(2, 6).masked_fill(~mask, -math.inf)
    bad = {"-inf": additive, "-1": torch.where(mask, 1, -1), "0.5": mask.float() / 2,
           "2": mask.long() * 2, "nan": mask.float().masked_fill(~mask, math.nan)}
    for shown, values in bad.items():
        with pytest.raises(ValueError, match=rf"^attention_mask: expected a bool mask or 0/1 "
                                             rf"values \(1 = a real token\); got {shown}$"):
            dec(tokens, attention_mask=values)
    ed = build_model(tiny(arch="encoder_decoder", n_encoder_layers=1, n_decoder_layers=1))
    src, tgt = torch.randint(0, 16, (2, 6)), torch.randint(0, 16, (2, 3))
    memory = ed.encode(src, mask)
    assert torch.equal(ed(src, tgt, mask.long()), ed(src, tgt, mask))
    for call in (lambda: ed(src, tgt, additive), lambda: ed.encode(src, additive),
                 lambda: ed.decode(tgt, memory, additive, cache=ed.new_cache())):
        with pytest.raises(ValueError, match=r"^src_mask: expected a bool mask or 0/1 values "
                                             r"\(1 = a real token\); got -inf$"):
            call()


def test_a_cached_step_checks_only_its_new_mask_columns() -> None:
    """A 0/1 mask of numbers was checked whole at every cached decoding step: O(batch x all
    keys) and, on a GPU, a device read each step. A step now compares only its new columns (the
    cached ones were checked at the prefill), and still refuses a bad value among them."""
    from torch.overrides import TorchFunctionMode

    class Compared(TorchFunctionMode):  # the shapes compared with a number (== 0, != 1, ...)
        def __init__(self) -> None:
            super().__init__()
            self.shapes: list[tuple[int, ...]] = []

        def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                               kwargs: dict[str, Any] | None = None) -> Any:
            if func in (torch.Tensor.__eq__, torch.Tensor.__ne__) and isinstance(
                    args[1], int | float):
                self.shapes.append(tuple(args[0].shape))
            return func(*args, **(kwargs or {}))

    dec = build_model(tiny())
    tokens = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0  # row 1 left-padded
    cache = dec.new_cache()
    with Compared() as seen:
        dec(tokens, attention_mask=mask[:, :5], cache=cache)
    assert seen.shapes and set(seen.shapes) == {(2, 5)}  # the prefill: all of its columns
    with Compared() as seen:
        got = dec(tokens[:, :1], attention_mask=mask[:, :6], cache=cache)[:, -1]
    assert seen.shapes and set(seen.shapes) == {(2, 1)}  # a step: its own column only
    want = dec(torch.cat([tokens, tokens[:, :1]], 1), attention_mask=mask[:, :6])[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    bad = mask.clone()
    bad[0, 6] = 2
    with pytest.raises(ValueError, match=r"^attention_mask: expected a bool mask or 0/1 values "
                                         r"\(1 = a real token\); got 2$"):
        dec(tokens[:, :1], attention_mask=bad, cache=cache)


def test_a_cached_steps_mask_of_another_shape_is_named_not_sliced() -> None:
    """A cached step checks only its mask's new columns, a 2-D mask's: one of another shape is
    named by the shape check, not sliced (`mask[:, past:]` of a 1-D mask is a bare IndexError,
    "too many indices"); no test gave a cached step such a mask."""
    dec = build_model(tiny())
    tokens = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(0))
    cache = dec.new_cache()
    dec(tokens, attention_mask=torch.ones(2, 5, dtype=torch.long), cache=cache)
    for shape, shown in [((6,), r"\(6,\)"), ((2, 1, 6), r"\(2, 1, 6\)")]:
        mask = torch.ones(shape, dtype=torch.long)
        with pytest.raises(ValueError, match=rf"^attention_mask: expected shape \(2 or 1, 6\), "
                                             rf"one per position of the cached positions and "
                                             rf"these; got {shown}$"):
            dec(tokens[:, :1], attention_mask=mask, cache=cache)


def test_a_cached_step_must_read_what_its_cache_was_filled_from() -> None:
    """A step without the prefill's attention_mask attended to the cached padding (a padded
    row's logits 0.16 off), and an encoder-decoder step given another source read the first
    source's cached cross keys and values; each without a word."""
    dec = build_model(tiny(n_layers=2))
    tokens = torch.randint(1, 16, (2, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, :2] = False  # row 1 left-padded
    cache = dec.new_cache()
    dec(tokens, attention_mask=mask, cache=cache)
    step = torch.tensor([[3], [4]])
    with pytest.raises(ValueError, match=r"^attention_mask: the cache was filled under one; "
                                         r"expected one over the cached positions"):
        dec(step, cache=cache)
    grown = torch.cat([mask, torch.ones(2, 1, dtype=torch.bool)], 1)
    got = dec(step, attention_mask=grown, cache=cache)[:, -1]
    want = dec(torch.cat([tokens, step], 1), attention_mask=grown)[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    ed = build_model(tiny(arch="encoder_decoder", n_encoder_layers=1, n_decoder_layers=1))
    src = torch.randint(0, 16, (2, 6), generator=torch.Generator().manual_seed(1))
    memory = ed.encode(src)
    cache = ed.new_cache()
    ed.decode(torch.tensor([[1], [1]]), memory, cache=cache)
    ed.decode(step, ed.encode(src), cache=cache)  # the same source, encoded again: taken
    for other in (ed.encode(torch.randint(0, 16, (2, 3), generator=torch.Generator().manual_seed(
            2))), memory + 1):  # another length, and the same length of other values
        with pytest.raises(ValueError, match=r"^memory: expected the source the cache was "
                                             r"filled with"):
            ed.decode(step, other, cache=cache)
    # and its source mask: a step without it read the source's padding (a padded row's logits
    # 1.31 off the uncached forward's)
    smask = torch.ones(2, 6, dtype=torch.bool)
    smask[1, 4:] = False
    memory = ed.encode(src, smask)
    cache = ed.new_cache()
    ed.decode(torch.tensor([[1], [1]]), memory, smask, cache=cache)
    ed.decode(step, memory, smask.clone(), cache=cache)  # the same mask, another tensor: taken
    for other, said in ((None, r"\(one then, none now\)"), (torch.ones(2, 6, dtype=torch.bool),
                                                          r"\(one then, another now\)")):
        with pytest.raises(ValueError, match=r"^src_mask: expected the source mask the cache "
                                             rf"was filled under at every step {said}"):
            ed.decode(step, memory, other, cache=cache)


def test_an_encoder_decoders_errors_name_its_inputs_and_a_padded_source_reads_unpadded() -> None:
    """Both stacks said "tokens"/"aux", so a bad source and a bad target read alike; and a
    left-padded source's tokens took other positions than unpadded ones (learned and
    sinusoidal positions; logits 1.2 off), where a decoder's prompt counts its real tokens."""
    for pos in ("learned", "sinusoidal"):
        ed = build_model(tiny(arch="encoder_decoder", n_encoder_layers=1, n_decoder_layers=1,
                              pos_encoding=pos)).eval()
        src = torch.randint(0, 16, (1, 4), generator=torch.Generator().manual_seed(3))
        tgt = torch.tensor([[1, 5]])
        padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), src], 1)
        left = torch.tensor([[False, False, True, True, True, True]])
        with torch.no_grad():
            torch.testing.assert_close(ed(padded, tgt, left), ed(src, tgt), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"^src: expected \[batch, pos\] ids"):
        ed(src[0], tgt)
    with pytest.raises(ValueError, match=r"^tgt: expected \[batch, pos\] ids"):
        ed(src, tgt[0])
    with pytest.raises(IndexError, match=r"^tgt: expected ids in \[0, 16\)"):
        ed(src, tgt + 100)
    with pytest.raises(ValueError, match=r"^src_aux: this model takes no aux positions"):
        ed(src, tgt, src_aux=torch.zeros(1, 4, dtype=torch.long))
