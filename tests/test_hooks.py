"""Hook points, caches and the KV cache behave as documented."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from normlab import ModelConfig, build_model
from normlab.model import attention, native
from normlab.model.generate import _pad, greedy_decode

if TYPE_CHECKING:
    from conftest import SdpaPast


def cfg(**kw) -> ModelConfig:
    base = dict(d_model=32, n_heads=4, n_layers=2, d_mlp=64, max_len=32, init_std=0.3)
    base.update(kw)
    return ModelConfig(**base)


DOCUMENTED = [
    "hook_embed",
    "hook_pos_embed",
    "blocks.{l}.hook_resid_pre",
    "blocks.{l}.ln1.hook_scale",
    "blocks.{l}.ln1.hook_normalized",
    "blocks.{l}.attn.hook_q",
    "blocks.{l}.attn.hook_k",
    "blocks.{l}.attn.hook_v",
    "blocks.{l}.attn.hook_attn_scores",
    "blocks.{l}.attn.hook_pattern",
    "blocks.{l}.attn.hook_z",
    "blocks.{l}.hook_attn_out",
    "blocks.{l}.hook_resid_mid",
    "blocks.{l}.hook_mlp_out",
    "blocks.{l}.hook_resid_post",
    "ln_final.hook_scale",
    "blocks.{l}.mlp.hook_pre",
    "blocks.{l}.mlp.hook_post",
]


def test_documented_names_and_shapes_pre() -> None:
    model = build_model(cfg(norm_placement="pre"))
    names = set(model.hook_names())
    for layer in range(2):
        for n in DOCUMENTED:
            assert n.format(l=layer) in names, n
    tokens = torch.randint(0, 16, (3, 9))
    _, cache = model.run_with_cache(tokens)
    assert set(cache) == names
    assert cache["blocks.0.attn.hook_q"].shape == (3, 9, 4, 8)
    assert cache["blocks.0.attn.hook_attn_scores"].shape == (3, 4, 9, 9)
    assert cache["blocks.1.ln1.hook_scale"].shape == (3, 9, 1)
    assert cache["blocks.1.attn.hook_z"].shape == (3, 9, 4, 8)
    assert cache["blocks.0.hook_resid_post"].shape == (3, 9, 32)
    pattern = cache["blocks.1.attn.hook_pattern"]
    torch.testing.assert_close(pattern.sum(-1), torch.ones(3, 4, 9))
    assert (pattern.triu(1) == 0).all()  # causal
    # hook_scale is the divisor: resid / scale (centred) is what the gain multiplies
    x = cache["blocks.0.hook_resid_pre"]
    xc = x - x.mean(-1, keepdim=True)
    torch.testing.assert_close(
        cache["blocks.0.ln1.hook_scale"], (xc.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    )


def test_qkv_hooks_fire_after_the_norm() -> None:
    model = build_model(cfg(norm_placement="qkv", norm_type="rms"))
    _, cache = model.run_with_cache(torch.randint(0, 16, (2, 5)))
    pre = cache["blocks.0.attn.hook_k_pre_norm"]
    post = cache["blocks.0.attn.hook_k"]
    # gain is ones at init: the used key has RMS 1 per head, the projection does not
    torch.testing.assert_close(post.pow(2).mean(-1), torch.ones(2, 5, 4), atol=1e-4, rtol=0)
    torch.testing.assert_close(post, pre / cache["blocks.0.attn.k_norm.hook_scale"])
    assert "blocks.0.attn.hook_v_pre_norm" in cache and "blocks.0.ln1.hook_scale" not in cache


def test_a_named_point_is_cached_alone_and_detach_false_keeps_its_graph() -> None:
    """A string filter is one exact name: `hook_k` caches hook_k, not `hook_k_pre_norm` beside
    it. The cache holds detached tensors unless `detach=False`, whose entries stay in the
    graph: the loss's gradient reaches them."""
    model = build_model(cfg(norm_placement="qkv"))
    tokens = torch.randint(0, 16, (2, 5))
    name = "blocks.0.attn.hook_k"
    out, cache = model.run_with_cache(tokens, names_filter=name)
    assert list(cache) == [name] and not cache[name].requires_grad
    out, cache = model.run_with_cache(tokens, names_filter=[name], detach=False)
    assert list(cache) == [name] and cache[name].requires_grad
    (grad,) = torch.autograd.grad(out.logsumexp(-1).sum(), cache[name])
    assert grad.shape == (2, 5, 4, 8) and bool(grad.abs().sum() > 0)


@pytest.mark.parametrize(("scope", "normalized", "scale"), [
    ("head", (2, 5, 4, 8), (2, 5, 4, 1)), ("all", (2, 5, 32), (2, 5, 1))])
def test_qkv_norm_hook_shapes_follow_the_scope(scope: str, normalized: tuple[int, ...],
                                               scale: tuple[int, ...]) -> None:
    """As docs/architecture.md's table gives them: scope `all` normalises the whole
    projection, so its norm's own hooks see it flat, and hook_k is per head again."""
    model = build_model(cfg(norm_placement="qkv", qkv_norm_scope=scope))
    _, cache = model.run_with_cache(torch.randint(0, 16, (2, 5)))
    for v in ("q", "k", "v"):
        assert cache[f"blocks.0.attn.{v}_norm.hook_normalized"].shape == normalized
        assert cache[f"blocks.0.attn.{v}_norm.hook_scale"].shape == scale
        assert cache[f"blocks.0.attn.hook_{v}"].shape == (2, 5, 4, 8)


def test_encoder_decoder_names() -> None:
    model = build_model(cfg(arch="encoder_decoder", norm_placement="pre"))
    names = set(model.hook_names())
    for n in [
        "encoder.hook_embed",
        "encoder.blocks.0.attn.hook_pattern",
        "decoder.hook_embed",
        "decoder.blocks.1.cross_attn.hook_pattern",
        "decoder.blocks.0.ln_cross.hook_scale",
        "decoder.blocks.0.hook_cross_attn_out",
        "encoder.ln_final.hook_scale",
        "decoder.ln_final.hook_scale",
    ]:
        assert n in names, n
    src, tgt = torch.randint(0, 16, (2, 7)), torch.randint(0, 16, (2, 4))
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 5:] = False
    _, cache = model.run_with_cache(src, tgt, mask)
    cross = cache["decoder.blocks.0.cross_attn.hook_pattern"]
    assert cross.shape == (2, 4, 4, 7)
    assert (cross[1, :, :, 5:] == 0).all()  # padded source tokens get no attention
    torch.testing.assert_close(cross.sum(-1), torch.ones(2, 4, 4))


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
@pytest.mark.parametrize("placement", ["pre", "qkv"])
def test_every_listed_hook_point_fires_with_rope(arch: str, placement: str) -> None:
    """A listed name must fire: cross-attention had `hook_rot_q`/`hook_rot_k`, which RoPE never
    rotates, so caching them gave an empty cache without an error."""
    model = build_model(cfg(arch=arch, norm_placement=placement, pos_encoding="rope"))
    x = torch.randint(0, 16, (2, 7))
    args = (x, x[:, :4]) if arch == "encoder_decoder" else (x,)
    _, cache = model.run_with_cache(*args)
    assert set(model.hook_names()) == set(cache)
    rot = [n for n in cache if "hook_rot_" in n]
    assert rot and not any("cross_attn" in n for n in rot)


def test_replacing_hook_changes_output_and_unknown_hook_errors() -> None:
    model = build_model(cfg())
    tokens = torch.randint(0, 16, (2, 6))
    base = model(tokens)
    out = model.run_with_hooks(
        tokens, fwd_hooks=[("blocks.0.hook_mlp_out", lambda x, h: torch.zeros_like(x))]
    )
    assert (out - base).abs().max() > 1e-3
    torch.testing.assert_close(model(tokens), base)  # hooks removed afterwards
    with pytest.raises(ValueError, match=r"unknown hook 'blocks\.9\.attn\.hook_q'"):
        model.run_with_hooks(tokens, fwd_hooks=[("blocks.9.attn.hook_q", lambda x, h: x)])
    # filter functions select several points
    seen = []
    model.run_with_hooks(
        tokens, fwd_hooks=[(lambda n: n.endswith("hook_pattern"), lambda x, h: seen.append(h.name))]
    )
    assert seen == ["blocks.0.attn.hook_pattern", "blocks.1.attn.hook_pattern"]


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_an_unhooked_forward_reads_no_hook_point_through_module_getattr(
    arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """setup_hooks binds every HookPoint as a plain attribute: nn.Module.__getattr__, ~0.6 µs
    a read, is not on the path of any hook point (it was, ~100 times per forward)."""
    model = build_model(cfg(norm_placement="qkv", arch=arch))
    tokens = torch.randint(0, 16, (2, 6))
    args = (tokens, tokens) if arch == "encoder_decoder" else (tokens,)
    slow_reads: list[str] = []
    module_getattr = torch.nn.Module.__getattr__

    def counting(self: torch.nn.Module, name: str) -> object:
        if name.startswith("hook_"):
            slow_reads.append(name)
        return module_getattr(self, name)

    monkeypatch.setattr(torch.nn.Module, "__getattr__", counting)
    with torch.no_grad():
        model(*args)
        model.run_with_cache(*args)
    assert slow_reads == []
    assert len(model.hook_points()) > 50


def test_bound_hook_points_stay_registered_and_follow_reassignment() -> None:
    import copy

    from normlab.model.hooks import HookPoint

    model = build_model(cfg())
    attn = model.blocks[0].attn
    assert vars(attn)["hook_q"] is attn._modules["hook_q"] is model.hook_points()[
        "blocks.0.attn.hook_q"]
    twin = copy.deepcopy(model)
    assert vars(twin.blocks[0].attn)["hook_q"] is twin.blocks[0].attn._modules["hook_q"]
    assert twin.blocks[0].attn.hook_q is not attn.hook_q
    new = HookPoint()
    attn.hook_q = new  # nn.Module.__setattr__: the registered module and the attribute agree
    assert attn.hook_q is new and attn._modules["hook_q"] is new
    tokens = torch.randint(0, 16, (2, 6))
    seen = []
    new.fns.append(lambda x, h: seen.append(x.shape))
    model(tokens)
    assert seen == [torch.Size([2, 6, 4, 8])]


def test_hooks_reach_points_swapped_in_after_construction() -> None:
    """A point or a block replaced after `setup_hooks` is the one hooks reach: attaching to
    the old one would run nothing, silently."""
    from normlab.model.hooks import HookPoint

    model = build_model(cfg())
    tokens = torch.randint(0, 16, (2, 6))
    model.blocks[0].attn.hook_q = HookPoint()
    seen: list[str] = []
    model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_q",
                                             lambda x, h: seen.append(h.name))])
    assert seen == ["blocks.0.attn.hook_q"]
    # a callable filter, after a whole block is swapped
    torch.manual_seed(1)  # a block of another model: a bare Block's weights are uninitialised
    model.blocks[1] = build_model(cfg()).blocks[1]
    seen.clear()
    model.run_with_hooks(tokens, fwd_hooks=[(lambda n: n == "blocks.1.hook_resid_pre",
                                             lambda x, h: seen.append(h.name))])
    assert seen == ["blocks.1.hook_resid_pre"]
    # run_with_cache names the new block's points and reads their tensors
    _, cache = model.run_with_cache(tokens)
    new_attn = model.blocks[1].attn
    _, direct = model.run_with_cache(tokens, names_filter="blocks.1.attn.hook_pattern")
    assert "" not in cache and "blocks.1.attn.hook_pattern" in cache
    torch.testing.assert_close(cache["blocks.1.attn.hook_pattern"],
                               direct["blocks.1.attn.hook_pattern"])
    assert model.hook_points()["blocks.1.attn.hook_pattern"] is new_attn.hook_pattern
    assert set(model.hook_names()) == set(cache)
    new_attn.hook_q.fns.append(lambda x, h: None)  # reset_hooks reaches the new points too
    model.reset_hooks()
    assert not new_attn.hook_q.fns


@pytest.mark.parametrize("placement", ["pre", "qkv"])
def test_rescaling_hook_k_acts_as_a_rescaled_key(placement: str) -> None:
    """Scaling key j by c multiplies column j of the raw scores by c, and nothing else."""
    model = build_model(cfg(norm_placement=placement, n_layers=1))
    tokens = torch.randint(0, 16, (1, 6))
    c = torch.tensor([1.0, 1.3, 0.7, 1.0, 1.1, 0.9])
    names = ["blocks.0.attn.hook_attn_scores", "blocks.0.attn.hook_pattern"]
    _, base = model.run_with_cache(tokens, names_filter=names)

    def scale_k(k, hook):
        return k * c[None, :, None, None]

    with model.hooks([("blocks.0.attn.hook_k", scale_k)]):
        _, moved = model.run_with_cache(tokens, names_filter=names)
    s0, s1 = base[names[0]], moved[names[0]]
    expect = s0 * c[None, None, None, :]
    torch.testing.assert_close(s1, expect)
    torch.testing.assert_close(moved[names[1]], expect.softmax(-1))
    # by a power of two, exactly (docs/architecture.md): a scaled key's products are exact
    pow2 = torch.tensor([1.0, 2.0, 0.5, 1.0, 4.0, 0.25])
    with model.hooks([("blocks.0.attn.hook_k", lambda k, hook: k * pow2[None, :, None, None])]):
        _, exact = model.run_with_cache(tokens, names_filter=names)
    finite = s0.isfinite()
    assert torch.equal(exact[names[0]][finite], (s0 * pow2[None, None, None, :])[finite])


@pytest.mark.parametrize("placement", ["none", "post", "pre", "qk", "qkv"])
@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_fused_path_gives_the_same_numbers(placement: str, arch: str, sdpa_past: SdpaPast
                                           ) -> None:
    sdpa_past(0)  # SDPA even for short rows
    model = build_model(cfg(norm_placement=placement, arch=arch, pos_encoding="rope"))
    src = torch.randint(0, 16, (2, 8))
    args = (src,) if arch == "decoder" else (src, src[:, :5])
    fused = model(*args)
    for m in model.modules():
        if hasattr(m, "fused"):
            m.fused = False
    torch.testing.assert_close(model(*args), fused, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("pos", ["learned", "rope", "sinusoidal"])
@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_kv_cache_decoding_equals_uncached(pos: str, arch: str) -> None:
    model = build_model(cfg(arch=arch, pos_encoding=pos, norm_placement="qkv"))
    prompts = [[1, 5, 6, 2], [1, 7, 2], [1, 4, 4, 4, 9, 2]]
    a = greedy_decode(model, prompts, max_new=8, eos=2, use_cache=True)
    b = greedy_decode(model, prompts, max_new=8, eos=2, use_cache=False)
    assert a == b
    assert all(len(x) >= 1 for x in a)


@pytest.mark.parametrize("placement", ["pre", "qkv"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_kv_cache_steps_give_the_full_forward_logits(placement: str, kv_heads: int) -> None:
    """Prefill then one token at a time: every step's logits equal the uncached forward's."""
    model = build_model(cfg(norm_placement=placement, n_kv_heads=kv_heads, pos_encoding="rope"))
    model.eval()
    tokens = torch.randint(0, 16, (3, 9))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache()
        steps = [model(tokens[:, :4], cache=cache)]
        steps += [model(tokens[:, t : t + 1], cache=cache) for t in range(4, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    k = cache.layers[0]["self"]["k"]
    # head-major, each head's [kpos, d_head] rows in place: a view of a buffer with room to grow
    assert k.shape == (3, kv_heads, 9, 32 // 4) and k.stride()[2:] == (32 // 4, 1)


def test_kv_cache_buffers_grow_and_honour_a_reserve() -> None:
    """Keys/values are views of buffers: `capacity` reserves exactly that many positions, a
    cache without one doubles, and either grows past its size with the same logits."""
    model = build_model(cfg(pos_encoding="rope")).eval()
    tokens = torch.randint(0, 16, (2, 12))
    with torch.no_grad():
        full = model(tokens)
        # positions filled after each step: 6, 8, 10, 12; a full buffer doubles what it holds
        for capacity, sizes in ((6, [6, 16, 16, 16]), (0, [8, 8, 20, 20]), (12, [12] * 4)):
            cache = model.new_cache(capacity)
            out, seen = [model(tokens[:, :4], cache=cache)], []
            for t in range(4, 12, 2):
                out.append(model(tokens[:, t : t + 2], cache=cache))
                seen.append(cache.layers[0]["self"]["buf_k"].shape[2])
            torch.testing.assert_close(torch.cat(out, 1), full, atol=1e-5, rtol=1e-5)
            assert seen == sizes, (capacity, seen)
            assert cache.layers[1]["self"]["k"].shape[2] == 12
    for bad in (-1, "8", 2.5):
        with pytest.raises(ValueError, match="capacity: expected a number of positions >= 0"):
            model.new_cache(bad)


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_greedy_decode_reserves_exactly_the_positions_it_feeds(arch: str) -> None:
    """The cache holds what is fed to the model: the prompt (decoder-only; bos for an
    encoder-decoder) and every generated token but the last, which is never fed back. The
    reserve is exactly that long, so no buffer grows and none keeps a position unused."""
    model = build_model(cfg(arch=arch, pos_encoding="rope"))
    prompts = [[1, 5, 6, 2], [1, 7, 2]]
    caches, new_cache = [], model.new_cache

    def spy(capacity: int = 0):
        caches.append(new_cache(capacity))
        return caches[-1]

    model.new_cache = spy  # an instance attribute, shadowing the method for this model only
    out = greedy_decode(model, prompts, max_new=5, eos=-1)  # -1: no token ends a row early
    assert [len(r) for r in out] == [5, 5]
    fed = (4 if arch == "decoder" else 1) + 5 - 1
    (cache,) = caches
    assert cache.length == fed
    for layer in cache.layers:
        assert layer["self"]["buf_k"].shape[2] == layer["self"]["buf_v"].shape[2] == fed
    del model.new_cache
    assert greedy_decode(model, prompts, max_new=5, eos=-1, use_cache=False) == out
    assert greedy_decode(model, prompts, max_new=0, eos=-1) == [[], []]
    for bad in (-1, 2.0, True):
        with pytest.raises(ValueError, match=r"^max_new: expected a number of tokens >= 0"):
            greedy_decode(model, prompts, max_new=bad, eos=-1)
    assert greedy_decode(model, prompts, max_new=np.int64(5), eos=-1) == out  # numpy's ints
    # an empty prompt was decoded from the padding alone (an empty source: from no key at all)
    with pytest.raises(ValueError, match=r"^prompts\[1\]: expected at least one token"):
        greedy_decode(model, [[1, 5], []], max_new=2, eos=-1)


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_a_row_that_emits_eos_stops_alone(arch: str) -> None:
    """Whatever token is eos, each row is the free decode cut after its own first eos: a row
    that stops early does not stop the others (the loop ends only when every row is done)."""
    torch.manual_seed(1)
    model = build_model(cfg(arch=arch, pos_encoding="rope", init_std=1.0))
    prompts = [[1, 5, 6, 2], [1, 7, 2], [3, 9, 12, 4, 8]]
    free = greedy_decode(model, prompts, max_new=6, eos=-1)
    ragged = 0
    for eos in sorted({t for row in free for t in row}):
        cut = [row[: row.index(eos) + 1] if eos in row else row for row in free]
        assert greedy_decode(model, prompts, max_new=6, eos=eos) == cut, eos
        ragged += len({len(row) for row in cut}) > 1
    assert ragged  # some eos ends one row before another


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_per_token_inputs_of_the_wrong_width_are_refused(arch: str) -> None:
    """A mask, positions or aux of width 1 broadcast over every position (with a width-1
    attention_mask every token got position 0), other widths gave torch's broadcast errors;
    each is now one line naming the input. A 0/1 integer or float src_mask is a mask."""
    model = build_model(cfg(arch=arch, pos_encoding="rope")).eval()
    tokens, ones = torch.randint(3, 16, (2, 6)), torch.ones(2, 6, dtype=torch.bool)
    with torch.no_grad():
        if arch == "decoder":
            for kw, name in ((dict(attention_mask=ones[:, :1]), "attention_mask"),
                             (dict(positions=torch.zeros(2, 1, dtype=torch.long)), "positions"),
                             (dict(attention_mask=ones[:, :5]), "attention_mask")):
                with pytest.raises(ValueError, match=rf"^{name}: expected shape \(2 or 1, 6\)"):
                    model(tokens, **kw)
            with pytest.raises(ValueError, match=r"^tokens: expected \[batch, pos\]"):
                model(tokens[0])
            # one row for the whole batch (Hugging Face's position_ids) is still fine
            pos = torch.arange(6)[None]
            torch.testing.assert_close(model(tokens, positions=pos),
                                       model(tokens, positions=pos.expand(2, 6)))
            torch.testing.assert_close(model(tokens, attention_mask=ones[:1]),
                                       model(tokens, attention_mask=ones))
            return
        src_mask = torch.ones(2, 6, dtype=torch.bool)
        src_mask[1, 4:] = False
        want = model(tokens, tokens[:, :3], src_mask)
        for as_number in (src_mask.long(), src_mask.float()):
            torch.testing.assert_close(model(tokens, tokens[:, :3], as_number), want)
        with pytest.raises(ValueError, match=r"^src_mask: expected shape \(2 or 1, 6\)"):
            model(tokens, tokens[:, :3], src_mask[:, :1])


def test_hook_point_misuse_is_not_silent() -> None:
    """A typo in a list `names_filter` is refused as in a single name (it cached nothing); a
    PyTorch module hook on a hook point, which never fires, warns where to attach instead."""
    model = build_model(cfg())
    tokens = torch.randint(0, 16, (1, 4))
    with pytest.raises(ValueError, match=r"^unknown hook 'blocks\.0\.attn\.hook_patern'"):
        model.run_with_cache(tokens, names_filter=["blocks.0.attn.hook_z",
                                                   "blocks.0.attn.hook_patern"])
    point, other = model.blocks[0].attn.hook_pattern, model.blocks[0].attn.hook_z
    # (torch allows a module the old or the full backward hooks, not both: two points)
    for register in (point.register_forward_hook, point.register_forward_pre_hook,
                     point.register_full_backward_hook, point.register_full_backward_pre_hook,
                     other.register_backward_hook):
        with pytest.warns(UserWarning, match=r"module hooks never run on a normlab HookPoint"
                          r".*run_with_cache\(detach=False\)"):
            register(lambda *a: None).remove()


def test_a_hook_point_given_for_its_name_is_refused() -> None:
    """A HookPoint is a module, so callable: taken as a filter it matched every name, and its
    fn ran at all the model's points (a full cache for `names_filter`)."""
    model = build_model(cfg())
    tokens = torch.randint(0, 16, (1, 4))
    point = model.blocks[0].attn.hook_k
    ran: list[str] = []
    with pytest.raises(ValueError, match=r"^fwd_hooks\[0\]: expected a hook name or a function"
                       r" of a name; got the module HookPoint \(use its name, "
                       r"'blocks\.0\.attn\.hook_k'\)$"):
        model.run_with_hooks(tokens, fwd_hooks=[(point, lambda x, hook: ran.append(hook.name))])
    with pytest.raises(ValueError, match=r"^names_filter: .*got the module HookPoint"):
        model.run_with_cache(tokens, names_filter=point)
    # as a list pair too, and any module (an nn.Identity matched every point as well)
    with pytest.raises(ValueError, match=r"^fwd_hooks\[0\]: .*got the module HookPoint"):
        model.run_with_hooks(tokens, fwd_hooks=[[point, lambda x, hook: ran.append(hook.name)]])
    with pytest.raises(ValueError, match=r"^fwd_hooks\[0\]: .*got the module Identity$"):
        model.run_with_hooks(tokens, fwd_hooks=[(torch.nn.Identity(),
                                                 lambda x, hook: ran.append(hook.name))])
    assert ran == [] and not any(hp.fns for hp in model.hook_points().values())


def test_a_hook_returning_no_tensor_of_its_shape_is_named() -> None:
    """A hook's return replaces the tensor only as a tensor of its shape: a scalar or a slice
    broadcast into the residual silently, and a list failed deep in the forward."""
    model = build_model(cfg())
    tokens = torch.randint(0, 16, (2, 5))
    want = model(tokens)

    def halve(x: torch.Tensor, hook) -> torch.Tensor:
        return x / 2

    for name, ret, got in (
            ("blocks.0.hook_attn_out", lambda x: x.mean(), r"\(\) torch\.float32 on cpu"),
            ("ln_final.hook_scale", lambda x: x[:, :1], r"\(2, 1, 1\) torch\.float32 on cpu"),
            ("blocks.1.hook_resid_pre", lambda x: x.tolist(), "list"),
            ("blocks.1.hook_resid_pre", lambda x: x.double(), r"\(2, 5, 32\) torch\.float64"),
            ("blocks.1.hook_resid_pre", lambda x: x.to("meta"), r"\(2, 5, 32\) torch\.float32 "
                                                                r"on meta")):
        def bad(x: torch.Tensor, hook, ret=ret):
            return ret(x)

        with pytest.raises(ValueError, match=rf"^hook 'bad' at '{re.escape(name)}': expected "
                           rf"None or a tensor like its input, \(2, 5, .*\) torch\.float32 on "
                           rf"cpu; got {got}"):
            model.run_with_hooks(tokens, fwd_hooks=[(name, bad)])
    torch.testing.assert_close(model(tokens), want)  # nothing left attached
    out = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_attn_out", halve)])
    assert not torch.equal(out, want)  # a tensor of the shape still replaces


def test_leaving_a_nested_hooks_block_keeps_the_outer_order() -> None:
    """An inner block attaching a fn the outer one attached removes its own copy on exit (the
    last), not the outer's (the first): the hooks left run in the order attached."""
    model = build_model(cfg())
    tokens = torch.randint(0, 16, (2, 5))
    name = "blocks.0.hook_resid_mid"

    def add_one(x: torch.Tensor, hook) -> torch.Tensor:
        return x + 1

    def double(x: torch.Tensor, hook) -> torch.Tensor:
        return x * 2

    with model.hooks([(name, add_one)]), model.hooks([(name, double)]):
        want = model(tokens)
        with model.hooks([(name, add_one)]):
            assert model.hook_points()[name].fns == [add_one, double, add_one]
        assert model.hook_points()[name].fns == [add_one, double]
        torch.testing.assert_close(model(tokens), want, rtol=0, atol=0)
    assert model.hook_points()[name].fns == []


def test_a_copied_kv_cache_extended_twice_keeps_both_continuations() -> None:
    """Two continuations of one prompt from shallow copies of its cache: the second does not
    overwrite the first's keys in the shared buffer (it gets a buffer of its own)."""
    model = build_model(cfg(pos_encoding="rope")).eval()
    prompt = torch.randint(0, 16, (2, 5))
    a, b = torch.full((2, 1), 3), torch.full((2, 1), 7)
    with torch.no_grad():
        cache = model.new_cache(capacity=8)
        model(prompt, cache=cache)
        fork = attention_copy(cache)
        step_a = model(a, cache=cache)
        step_b = model(b, cache=fork)
        again_a = model(torch.full((2, 1), 4), cache=cache)  # a's cache still holds a
        full_a = model(torch.cat([prompt, a, torch.full((2, 1), 4)], 1))
        full_b = model(torch.cat([prompt, b], 1))
    torch.testing.assert_close(step_a[:, -1], full_a[:, 5], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(step_b[:, -1], full_b[:, -1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again_a[:, -1], full_a[:, -1], atol=1e-5, rtol=1e-5)


def attention_copy(cache):
    """A shallow copy of a KV cache: new dicts, the same tensors (as `copy.copy` per block)."""
    return type(cache)([{k: dict(d) for k, d in layer.items()} for layer in cache.layers],
                       cache.length)


def test_greedy_decode_leaves_the_training_mode_as_it_found_it() -> None:
    """Decoding runs every module in eval mode (no dropout) and leaves each module's mode as
    it found it: all training, all eval, or mixed; also when decoding fails."""
    model = build_model(cfg(pos_encoding="rope", dropout=0.5))
    prompts = [[1, 5, 6, 2], [1, 7, 2]]
    model.eval()
    want = greedy_decode(model, prompts, max_new=6, eos=2)
    assert not any(m.training for m in model.modules())
    for setup in (lambda: model.train(), lambda: model.blocks[0].train(),
                  lambda: model.blocks[1].eval()):
        setup()
        modes = [m.training for m in model.modules()]
        assert greedy_decode(model, prompts, max_new=6, eos=2) == want
        assert [m.training for m in model.modules()] == modes
    modes = [m.training for m in model.modules()]
    with pytest.raises(ValueError, match=r"prompts\[0\]: expected integer ids in \[0, 16\)"):
        greedy_decode(model, [[1, 99]], max_new=2, eos=2)  # refused before any forward
    assert [m.training for m in model.modules()] == modes

    def fail(x: torch.Tensor, hook: object) -> None:
        raise RuntimeError("a hook that fails inside a forward")

    with model.hooks([("blocks.0.hook_resid_pre", fail)]), pytest.raises(RuntimeError):
        greedy_decode(model, prompts, max_new=2, eos=2)  # fails inside a forward
    assert [m.training for m in model.modules()] == modes


def test_kv_cache_entries_a_caller_replaced_are_the_ones_extended() -> None:
    """Beam search reorders the cache's rows, activation patching swaps keys: the next step
    extends the tensors in the cache, not the buffers they replaced."""
    model = build_model(cfg(pos_encoding="rope")).eval()
    tokens = torch.randint(0, 16, (3, 6))
    perm = torch.tensor([2, 0, 1])
    with torch.no_grad():
        cache = model.new_cache(capacity=8)
        model(tokens[:, :5], cache=cache)
        for layer in cache.layers:
            d = layer["self"]
            d["k"], d["v"] = d["k"][perm], d["v"][perm]
        step = model(tokens[perm, 5:], cache=cache)
        full = model(tokens[perm])
    torch.testing.assert_close(step[:, -1], full[:, -1], atol=1e-5, rtol=1e-5)


def test_kv_cache_decoding_under_autograd_backpropagates() -> None:
    """Cached steps with gradients on (a differentiable decode) concatenate instead of writing
    into buffers autograd saved: backward works and gives the full forward's gradients."""
    model = build_model(cfg(pos_encoding="rope")).eval()
    tokens = torch.randint(0, 16, (2, 7))
    cache = model.new_cache(capacity=8)
    out = [model(tokens[:, :4], cache=cache)]
    out += [model(tokens[:, t : t + 1], cache=cache) for t in range(4, 7)]
    torch.cat(out, 1).square().mean().backward()
    cached = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(tokens).square().mean().backward()
    for a, b in zip(cached, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_kv_cache_filled_in_inference_mode_steps_on_outside_it() -> None:
    model = build_model(cfg(pos_encoding="rope")).eval()
    tokens = torch.randint(0, 16, (2, 6))
    cache = model.new_cache(capacity=8)
    with torch.inference_mode():
        model(tokens[:, :5], cache=cache)
    with torch.no_grad():
        step = model(tokens[:, 5:], cache=cache)
        full = model(tokens)
    torch.testing.assert_close(step[:, -1], full[:, -1], atol=1e-5, rtol=1e-5)


def test_left_padding_does_not_change_a_decoder_prompt() -> None:
    """A prompt decodes the same alone or in a batch with longer (left-padded) prompts."""
    model = build_model(cfg(pos_encoding="learned"))
    alone = greedy_decode(model, [[1, 7, 2]], max_new=6, eos=2)
    batched = greedy_decode(model, [[1, 7, 2], [1, 4, 4, 4, 9, 3, 2]], max_new=6, eos=2)
    assert batched[0] == alone[0]


def test_prompts_are_padded_left_or_right_with_their_mask() -> None:
    seqs = [[5, 6], [7], [8, 9, 4]]
    rows, real = _pad(seqs, 0, left=True)
    assert rows.tolist() == [[0, 5, 6], [0, 0, 7], [8, 9, 4]]
    assert real.tolist() == [[False, True, True], [False, False, True], [True, True, True]]
    rows, real = _pad(seqs, 3, left=False)
    assert rows.tolist() == [[5, 6, 3], [7, 3, 3], [8, 9, 4]]
    assert real.tolist() == [[True, True, False], [True, False, False], [True, True, True]]
    assert rows.dtype == torch.long and real.dtype == torch.bool
    rows, real = _pad([[], (4,)], 0, left=True)  # an empty prompt; a tuple
    assert rows.tolist() == [[0], [4]] and real.tolist() == [[False], [True]]


@pytest.mark.parametrize("placement", ["post", "pre", "qkv", "pre_qk"])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_fused_norms_give_the_same_numbers(placement: str, kind: str) -> None:
    """Unhooked norms use torch's fused kernels; a hook on hook_scale forces the explicit path."""
    model = build_model(cfg(norm_placement=placement, norm_type=kind, norm_gain_offset=True))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith((".w", ".b")):
                p.add_(0.3 * torch.randn_like(p))
    tokens = torch.randint(0, 16, (2, 9))
    fused = model(tokens)
    explicit = model.run_with_hooks(
        tokens, fwd_hooks=[(lambda n: n.endswith("hook_scale"), lambda x, h: None)]
    )
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("placement", ["pre", "qkv"])
def test_short_rows_on_cpu_skip_sdpa_and_equal_the_hooked_path(
    placement: str, attention_calls: tuple[list[int], list[int]], sdpa_past: SdpaPast
) -> None:
    """Rows of <= EXPLICIT_MAX_KEYS_CPU keys run the explicit path's arithmetic with no hook
    attached (faster than SDPA there): normlab's kernel (`native.attention`), whose output and
    gradients are a hooked forward's to float32 rounding, or with the kernel off the explicit
    path itself, bitwise a hooked forward's; its scores are the masked, scaled q.k written out
    by hand."""
    kernel, calls = attention_calls
    model = build_model(cfg(norm_placement=placement, pos_encoding="rope", n_layers=2))
    tokens = torch.randint(0, 16, (3, 9))

    def run(hooks: list) -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad()
        with model.hooks(hooks):
            out = model(tokens)
        out.square().sum().backward()
        return out.detach(), model.blocks[0].attn.W_Q.grad.clone()

    plain = run([])
    assert calls == [] and len(kernel) == 2
    hooked = run([("blocks.1.attn.hook_pattern", lambda x, hook: x)])
    assert len(kernel) == 3  # block 0's: block 1's hook sends it to the explicit path
    for ours, explicit in zip(plain, hooked, strict=True):
        torch.testing.assert_close(ours, explicit, atol=1e-6 * explicit.abs().max().item(),
                                   rtol=1e-5)
    native.set_enabled(False, "attention")
    try:
        plain = run([])
        hooked = run([("blocks.1.attn.hook_pattern", lambda x, hook: x)])
    finally:
        native.set_enabled(True)
    assert torch.equal(plain[0], hooked[0]) and torch.equal(plain[1], hooked[1])
    sdpa_past(8)  # 9 keys: SDPA again
    fused = run([])
    assert len(calls) == 2
    torch.testing.assert_close(fused[0], plain[0], atol=1e-5, rtol=1e-5)

    names = ["blocks.0.attn.hook_rot_q", "blocks.0.attn.hook_rot_k",
             "blocks.0.attn.hook_attn_scores"]
    _, c = model.run_with_cache(tokens, names_filter=names)
    q, k = c[names[0]].transpose(1, 2), c[names[1]].transpose(1, 2)
    scale = model.blocks[0].attn.scale.detach()[:, None, None]
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    want = ((q @ k.transpose(-1, -2)) * scale).masked_fill(~causal, float("-inf"))
    assert torch.equal(c[names[2]], want)


@pytest.mark.parametrize("n_keys", [1, 5, 9, 15, 16, 17, 24])
def test_softmax_rows_equals_a_float64_softmax_and_pads_only_short_cpu_rows(n_keys: int) -> None:
    """Short CPU rows are padded with -inf keys (a faster ATen kernel); the weights and their
    gradients are still the softmax's, and a fully masked row stays NaN, as softmax makes it."""
    causal = torch.ones(n_keys, n_keys, dtype=torch.bool).tril()
    s = torch.randn(3, 2, n_keys, n_keys).masked_fill(~causal, float("-inf"))
    s[0, 0, 0] = float("-inf")  # a row with no key to attend
    x = s.clone().requires_grad_()
    p = attention.softmax_rows(x)
    g = torch.randn_like(s)
    (grad,) = torch.autograd.grad(p, x, g)
    x64 = s.double().requires_grad_()
    p64 = x64.softmax(-1)
    (grad64,) = torch.autograd.grad(p64, x64, g.double())
    assert p.shape == s.shape
    ok = ~p64.isnan()
    assert torch.equal(p.isnan(), ~ok) and bool(ok.any())
    torch.testing.assert_close(p[ok].double(), p64[ok], atol=1e-6, rtol=1e-5)
    live = ok.all(-1, keepdim=True).expand_as(s)
    torch.testing.assert_close(grad[live].double(), grad64[live], atol=1e-6, rtol=1e-5)
    padded = n_keys < attention.SOFTMAX_MIN_KEYS_CPU
    assert p.stride(-2) == (attention.SOFTMAX_MIN_KEYS_CPU if padded else n_keys)


@pytest.mark.parametrize("placement", ["pre", "qkv"])
def test_padded_short_rows_give_the_model_s_numbers_and_pattern(placement: str,
                                                                monkeypatch) -> None:
    """A forward on 9-key rows, softmax padded, against the same model in float64 with the
    padding switched off: same logits and gradients, and hook_pattern sees
    [batch, head, qpos, kpos] rows that sum to 1."""
    model = build_model(cfg(norm_placement=placement, pos_encoding="rope"))
    tokens = torch.randint(0, 16, (3, 9))

    def run() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        model.zero_grad()
        out, c = model.run_with_cache(tokens, names_filter=["blocks.1.attn.hook_pattern"])
        model(tokens).square().sum().backward()
        return out, model.blocks[0].attn.W_Q.grad.clone(), c["blocks.1.attn.hook_pattern"]

    padded = run()
    monkeypatch.setattr(attention, "SOFTMAX_MIN_KEYS_CPU", 0)
    model.double()
    exact = run()
    assert padded[2].stride(-2) == 16 and exact[2].stride(-2) == 9  # the rule did apply
    for a, b in zip(padded, exact, strict=True):
        b = b.detach()
        torch.testing.assert_close(a.detach().double(), b, atol=1e-4 * float(b.abs().max()),
                                   rtol=1e-4)
    assert padded[2].shape == (3, 4, 9, 9)
    torch.testing.assert_close(padded[2].sum(-1), torch.ones(3, 4, 9))


def test_a_source_row_without_tokens_is_refused() -> None:
    """Cross-attention over a source with no real token attends to nothing: NaN where the
    pattern is computed (the kernel, the explicit path), 0 from SDPA, so the answer depended on
    the path and the batch; the encoder-decoder refuses such a row."""
    model = build_model(cfg(arch="encoder_decoder", pos_encoding="rope")).eval()
    src, mask = torch.randint(3, 16, (2, 5)), torch.ones(2, 5, dtype=torch.bool)
    mask[1] = False
    with pytest.raises(ValueError, match=r"^src_mask: row 1 has no real source token"):
        model(src, src[:, :2], mask)
    # `decode` called alone (a memory kept, another mask) checks it too: NaN logits up to 64
    # source positions, and past them SDPA's finite ones, meaning nothing
    memory = model.encode(src, torch.ones(2, 5, dtype=torch.bool))
    for cache in (None, model.new_cache(capacity=4)):
        with pytest.raises(ValueError, match=r"^src_mask: row 1 has no real source token"):
            model.decode(src[:, :2], memory, mask, cache=cache)


def test_the_source_row_check_keeps_one_graph_under_compile() -> None:
    """The check reads a tensor's value; under torch.compile it steps aside, so an
    encoder-decoder's forward stays one graph (it broke the graph twice, with a warning)."""
    model = build_model(cfg(arch="encoder_decoder", pos_encoding="rope")).eval()
    src, mask = torch.randint(3, 16, (2, 5)), torch.ones(2, 5, dtype=torch.bool)
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(src, src[:, :2], mask), model(src, src[:, :2], mask))


def test_reset_hooks_inside_a_hooks_block_leaves_it_cleanly() -> None:
    """`model.reset_hooks()` inside `with model.hooks(...)` (or from a hook during
    `run_with_hooks`) made the block's exit raise "list.remove(x): x not in list", hiding any
    error of the block and leaving the hooks after the failing one attached."""
    model = build_model(cfg())
    tokens = torch.randint(0, 16, (2, 5))
    want = model(tokens)
    seen: list[str] = []
    with model.hooks([("blocks.0.hook_resid_pre", lambda x, hook: seen.append(hook.name)),
                      ("blocks.1.hook_resid_pre", lambda x, hook: seen.append(hook.name))]):
        model.reset_hooks()
        with model.hooks([("blocks.1.hook_resid_pre", lambda x, hook: seen.append("late"))]):
            model(tokens)
    assert seen == ["late"]

    def reset(x: torch.Tensor, hook: object) -> None:
        model.reset_hooks()

    out = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_pre", reset),
                                                  ("blocks.1.hook_resid_pre", reset)])
    assert torch.equal(out, want) and not any(hp.fns for hp in model.hook_points().values())


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        # cut to [3, 4] by the tensor's dtype, unseen
        ({"prompts": [[3.9, 4.2]]}, r"prompts\[0\]: expected integer ids in \[0, 16\); got 3\.9"),
        ({"prompts": [[3, 4], [5, 99]]}, r"prompts\[1\]: expected integer ids in .*; got 99$"),
        ({"prompts": [[3, "4"]]}, r"prompts\[0\]: expected integer ids in .*; got '4'$"),
        # taken as id 1 by torch's tensor, unseen
        ({"prompts": [[3, 4], [5, True]]}, r"prompts\[1\]: expected integer ids in .*; got True$"),
        ({"prompts": [[3, 10**30]]}, r"prompts\[0\]: .*; got 1000000000000000000000000000000$"),
        # a pad or bos outside the vocabulary was reported as a bad id of `tokens`
        ({"prompts": [[3, 4], [5]], "pad": 16}, r"pad: expected a token id in \[0, 16\); got 16"),
        ({"prompts": [[3]], "pad": -1}, r"pad: expected a token id in \[0, 16\); got -1"),
        ({"prompts": [[3]], "eos": 2.0}, r"eos: expected an int in \[-2\*\*63, 2\*\*63\) "
                                         r"\(a token id; -1 never ends\); got 2\.0"),
        ({"prompts": [[3]], "eos": 2**63}, r"eos: expected an int in .*; got 9223372036854775808"),
        ({"prompts": [[3]], "bos": -1}, r"bos: expected a token id in \[0, 16\); got -1"),
        ({"prompts": torch.tensor([3, 4])}, r"prompts: expected a list of token lists or a "
                                            r"\[batch, pos\] tensor; got shape \(2,\)"),
        # past the position table: four forwards ran, then the tokens so far were lost
        ({"prompts": [[3, 4, 5, 6, 7, 8]], "max_new": 5},
         r"max_new: prompts\[0\]'s 6 tokens and 4 new ones need 10 positions, more than "
         r"ModelConfig\.max_len=8; expected max_new <= 3$"),
        ({"prompts": [[3], [3] * 9], "max_new": 1},
         r"prompts\[1\]: expected at most ModelConfig\.max_len=8 tokens; got 9"),
        # one prompt, not a list of them: "object of type 'int' has no len()"
        ({"prompts": [3, 4]}, r"prompts\[0\]: expected a list of token ids; got 3$"),
        ({"prompts": ["34"]}, r"prompts\[0\]: expected a list of token ids; got '34'$"),
        ({"prompts": list(torch.tensor([3, 4]))},
         r"prompts\[0\]: expected a list of token ids; got tensor\(3\)$"),
        ({"prompts": [np.array(3)]}, r"prompts\[0\]: expected a list of token ids; got "
                                     r"array\(3\)$"),
        # no order to read: {1: 2} decoded from [1]
        ({"prompts": [{1: 2}]}, r"prompts\[0\]: expected a list of token ids; got \{1: 2\}$"),
        ({"prompts": {(3, 4)}}, r"prompts: expected .*; got set$"),
        ({"prompts": 7}, r"prompts: expected a list of token lists or a \[batch, pos\] tensor; "
                         r"got int$"),
        ({"prompts": "34"}, r"prompts: expected .*; got str$"),
        # a level too deep: torch's "shape '[1, 1]' is invalid for input of size 2"
        ({"prompts": [[[3, 4]]]}, r"prompts\[0\]: expected integer ids in .*; got \[3, 4\]$"),
        # numpy's "truth value of an array ... is ambiguous"
        ({"prompts": np.array([3, 4])}, r"prompts: expected .*; got shape \(2,\)$"),
    ],
)
def test_greedy_decode_refuses_bad_input_before_it_starts(kwargs: dict, error: str) -> None:
    model = build_model(cfg(max_len=8, pos_encoding="learned", vocab_size=16))
    args = {"max_new": 2, "eos": 2} | kwargs
    with pytest.raises(ValueError, match=error):
        greedy_decode(model, **args)


def test_what_fits_the_position_table_still_decodes() -> None:
    """The check counts what the decode feeds: the prompt and every new token but the last
    (decoder-only), `bos` and the new tokens but the last (encoder-decoder)."""
    dec = build_model(cfg(max_len=8, pos_encoding="learned", vocab_size=16))
    assert len(greedy_decode(dec, [[3] * 6], max_new=3, eos=-1)[0]) == 3  # 8 positions fed
    assert len(greedy_decode(dec, [[3] * 8], max_new=1, eos=-1)[0]) == 1
    assert greedy_decode(dec, [[3] * 20], max_new=0, eos=2) == [[]]  # nothing fed
    rope = build_model(cfg(max_len=8, pos_encoding="rope", vocab_size=16))  # no table
    assert len(greedy_decode(rope, [[3] * 10], max_new=4, eos=-1)[0]) == 4
    encdec = build_model(cfg(arch="encoder_decoder", max_len=8, pos_encoding="learned",
                             vocab_size=16))
    assert len(greedy_decode(encdec, [[3] * 8], max_new=8, eos=-1)[0]) == 8
    with pytest.raises(ValueError, match=r"max_new: bos and 8 new tokens need 9 positions"):
        greedy_decode(encdec, [[3] * 8], max_new=9, eos=-1)
    with pytest.raises(ValueError, match=r"bos: expected a token id in \[0, 16\); got 16"):
        greedy_decode(encdec, [[3]], max_new=1, eos=2, bos=16)
    batch = torch.tensor([[3, 4, 5], [6, 7, 8]])  # a [batch, pos] tensor, as a list of rows
    want = greedy_decode(dec, batch.tolist(), max_new=2, eos=-1)
    assert greedy_decode(dec, batch, max_new=2, eos=-1) == want
    # numpy ids of any integer type, as token dumps hold them
    for dtype in (np.int32, np.uint16, np.int64):
        assert greedy_decode(dec, list(batch.numpy().astype(dtype)), max_new=2, eos=-1) == want
    # a [batch, pos] numpy array as the tensor, and prompts from a generator or a tuple
    assert greedy_decode(dec, batch.numpy(), max_new=2, eos=-1) == want
    assert greedy_decode(dec, (r for r in batch.tolist()), max_new=2, eos=-1) == want
    assert greedy_decode(dec, tuple(map(tuple, batch.tolist())), max_new=2, eos=-1) == want


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_a_generous_max_new_reserves_no_more_than_the_decode_uses(arch: str,
                                                                    monkeypatch) -> None:
    """With RoPE no table bounds max_new, and the cache reserved every position up front:
    10**12 asked the allocator for 64 TB though eos ended the decode at once. The reserve is
    capped at RESERVE_NEW new positions (here 2); past them the buffers double, and the tokens
    are those of a decode that reserved all it needed."""
    from normlab.model import generate

    model = build_model(cfg(arch=arch, pos_encoding="rope", vocab_size=16))
    prompts = [[3, 4, 5], [6, 7]]
    want = greedy_decode(model, prompts, max_new=9, eos=-1, use_cache=False)
    monkeypatch.setattr(generate, "RESERVE_NEW", 2)
    assert greedy_decode(model, prompts, max_new=9, eos=-1) == want
    first = want[0][0]  # as eos, it ends the decode of prompts[0] at its first token
    assert greedy_decode(model, prompts[:1], max_new=10**12, eos=first) == [[first]]


def test_task_positions_that_are_not_integers_are_named() -> None:
    model = build_model(cfg(n_aux_positions=4))
    with pytest.raises(ValueError, match=r"aux_fn's positions\[0\]: expected integers; got 0\.5"):
        greedy_decode(model, [[3, 4]], max_new=1, eos=2, aux_fn=lambda ids, part: [0.5] * len(ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bool, torch.uint8])
def test_tokens_that_are_not_integer_ids_are_named(dtype: torch.dtype) -> None:
    """Float tokens gave torch's "Expected tensor for argument #1 'indices' to have one of the
    following scalar types"."""
    model = build_model(cfg())
    with pytest.raises(ValueError, match=rf"tokens: expected integer ids \(int64 or int32\); "
                                         rf"got {dtype}"):
        model(torch.ones(2, 3, dtype=dtype))
    model(torch.ones(2, 3, dtype=torch.int32))  # int32 ids are ids


def test_greedy_decode_names_its_own_arguments() -> None:
    """An encoder-decoder with max_new = 0 ran its encoder and failed on a long source with
    "position 8 is beyond ModelConfig.max_len", naming no prompt (a decoder returned [[]]);
    aux mistakes were worded for the forward's `aux` (which greedy_decode does not take), and
    a shape at batch 1 read "(1 or 1, 2)"."""
    encdec = build_model(cfg(arch="encoder_decoder", max_len=8, pos_encoding="learned",
                             vocab_size=16))
    assert greedy_decode(encdec, [[3] * 9, [4]], max_new=0, eos=-1) == [[], []]
    for bad in ([[99, 3]], [[1.5, 2]], [[-3]]):  # ids still checked with nothing to generate
        with pytest.raises(ValueError, match=r"^prompts\[0\]: expected integer ids in \[0, 16\)"):
            greedy_decode(encdec, bad, max_new=0, eos=-1)
    digits = build_model(cfg(vocab_size=16, n_aux_positions=4))
    with pytest.raises(ValueError, match=r"^aux_fn: this model has ModelConfig.n_aux_positions "
                                         r"> 0; expected an aux_fn\(ids, part\)"):
        greedy_decode(digits, [[3, 4]], max_new=1, eos=-1)
    with pytest.raises(ValueError, match=r"^aux_fn: this model takes no aux positions"):
        greedy_decode(build_model(cfg(vocab_size=16)), [[3, 4]], max_new=1, eos=-1,
                      aux_fn=lambda ids, part: [0] * len(ids))
    with pytest.raises(ValueError, match=r"^aux_fn\(row 0, 'sequence'\): expected 2 positions, "
                                         r"one a token; got 1$"):
        greedy_decode(digits, [[3, 4]], max_new=1, eos=-1, aux_fn=lambda ids, part: [0])
    with pytest.raises(ValueError, match=r"^aux: expected shape \(1, 2\), one per position"):
        digits(torch.tensor([[3, 4]]), aux=torch.zeros(1, 3, dtype=torch.long))


def test_malformed_hook_arguments_are_named() -> None:
    """One (name, fn) pair not in a list, or a dict, was "too many values to unpack"; a fn that
    is none failed inside the forward; names_filter=123 was "'int' object is not iterable"."""
    model = build_model(cfg())
    tokens = torch.randint(0, model.cfg.vocab_size, (1, 4))
    name, fn = "blocks.0.hook_resid_pre", (lambda x, hook: x)
    cases = [((name, fn), r"^fwd_hooks\[0\]: expected a \(name or filter, fn\) pair \(one pair: "
                          r"put it in a list\); got 'blocks.0.hook_resid_pre'$"),
             ({name: fn}, r"^fwd_hooks: expected a list of \(name, fn\) pairs; got \{"),
             ([(name, None)], r"^fwd_hooks\[0\]: expected a \(name or filter, fn\) pair; got "),
             ([(name, fn, 1)], r"^fwd_hooks\[0\]: expected"), (5, r"^fwd_hooks: expected")]
    for hooks, said in cases:
        with pytest.raises(ValueError, match=said):
            model.run_with_hooks(tokens, fwd_hooks=hooks)
    assert not any(hp.fns for hp in model.hook_points().values())
    for bad in (123, {name: 1}, [name, 5]):
        with pytest.raises(ValueError, match=r"^names_filter: expected a hook name, a list of "
                                             r"names or a function of a name; got "):
            model.run_with_cache(tokens, names_filter=bad)
    _, cache = model.run_with_cache(tokens, names_filter=(n for n in [name]))
    assert list(cache) == [name]
    with pytest.raises(ValueError, match=r"^unknown hook 'blocks.0.hook_resid_per'"):
        model.run_with_cache(tokens, names_filter=(n for n in ["blocks.0.hook_resid_per"]))
    _, cache = model.run_with_cache(tokens, names_filter=(name,))
    assert list(cache) == [name]


def test_a_block_shared_by_two_models_is_cached_under_each_ones_names() -> None:
    """`a.blocks[1] = b.blocks[0]` renamed the shared points for both models; `b`'s cache then
    filed block 0's tensors under `blocks.1.*`, where its own block 1 overwrote them."""
    torch.manual_seed(0)
    a, b = build_model(cfg(n_layers=2)), build_model(cfg(n_layers=2))
    tokens = torch.randint(0, b.cfg.vocab_size, (1, 5))
    _, before = b.run_with_cache(tokens)
    a.blocks[1] = b.blocks[0]
    a.hook_names()  # a's set-up names the shared points blocks.1.*
    _, after = b.run_with_cache(tokens)
    assert after.keys() == before.keys()
    assert all(torch.equal(after[k], before[k]) for k in before)
