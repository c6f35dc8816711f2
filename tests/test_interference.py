"""Subspace interference: the null-space probe and the synthetic demonstration."""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from normlab import ModelConfig, build_model
from normlab.analysis.data import EvalData, attention_sites, group_seed
from normlab.analysis.interference import (
    interference_probe,
    null_directions,
    plot_interference,
    synthetic_interference,
)
from normlab.tasks.addition import Cell


def data(arch: str = "decoder", n: int = 8) -> EvalData:
    rng = random.Random(2)
    return EvalData.from_problems([Cell(2, 2).sample(rng) for _ in range(n)], arch)


def model(placement: str, arch: str = "decoder", **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = dict(arch=arch, d_model=32, n_heads=4, n_layers=2, n_encoder_layers=1,
               n_decoder_layers=1, d_mlp=64, max_len=40, init_std=0.3, norm_placement=placement)
    return build_model(ModelConfig(**(cfg | kw))).eval()


def randomise_gains(m: torch.nn.Module) -> None:
    """Trained-looking LayerNorm gains, so the probe must account for diag(g)."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".w"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))


@pytest.mark.parametrize(("placement", "kw", "null_dim"), [
    ("qkv", {}, 32 - 2 * 8), ("none", {}, 32 - 2 * 8), ("qk", {}, 32 - 2 * 8),
    ("none", {"n_kv_heads": 2}, 32 - 2 * 8),  # a head reads W_Q[h] and its kv head's W_K
    ("qk", {"qkv_norm_scope": "all", "d_head": 2}, 32 - 2 * 4 * 2),  # every head's W_Q, W_K
], ids=["qkv", "none", "qk", "none-gqa", "qk-scope-all"])
def test_probe_is_zero_when_the_head_reads_x_directly(placement: str, kw: dict,
                                                      null_dim: int) -> None:
    """Content outside what the head's q and k read leaves its pattern still: null dims by
    hand (under grouped-query attention the head's own kv head; under a whole-projection q/k
    norm every head's projections, which its normalised q and k divide by)."""
    res = interference_probe(model(placement, **kw), data(), n_directions=2)
    assert len(res["per_head"]) == 8
    assert res["tv_max"] < 1e-5
    assert all(r["null_dim"] == null_dim for r in res["per_head"])


def test_probe_is_nonzero_under_pre_and_one_token_mode() -> None:
    m = model("pre")
    randomise_gains(m)
    res = interference_probe(m, data(), n_directions=2)
    assert all(r["tv_mean"] > 1e-3 for r in res["per_head"])
    assert all(r["null_dim"] == 32 - 2 * 8 - 1 for r in res["per_head"])  # centring
    one = interference_probe(m, data(), n_directions=2, tokens="one", heads=[1])
    assert len(one["per_head"]) == 2 and 0 < one["tv_mean"] < res["tv_mean"]


@pytest.mark.parametrize("tokens", ["all", "one"])
def test_the_probe_shifts_every_real_token_or_one_per_example(tokens: str) -> None:
    """`tokens="all"` adds the content to every real token and `"one"` to exactly one real
    token of each example: the tokens whose norm scale moved, against the unshifted forward."""
    m = model("pre", n_layers=1)
    d = data(n=6)  # padded rows of 10 to 14 real tokens
    scales: list[torch.Tensor] = []
    with m.hooks([("blocks.0.ln1.hook_scale", lambda x, hook: scales.append(x.detach()))]):
        interference_probe(m, d, n_directions=1, tokens=tokens, heads=[0])
    ref, shifted = (s[..., 0] for s in scales)  # the reference forward, then the probe's
    moved = (shifted / ref - 1).abs() > 1e-3
    valid = d.valid["tokens"]
    assert not (moved & ~valid).any()
    if tokens == "all":
        assert torch.equal(moved, valid)
    else:
        assert moved.sum(-1).tolist() == [1] * 6


def test_null_directions_respect_gain_and_centring() -> None:
    m = model("pre")
    randomise_gains(m)
    site = attention_sites(m)["blocks.1.attn"]
    u, _ = null_directions(m, site, 2, 3, torch.Generator().manual_seed(0))
    g = m.blocks[1].ln1.w.detach()
    for w in (m.blocks[1].attn.W_Q[2], m.blocks[1].attn.W_K[2]):
        assert (u @ (g[:, None] * w.detach())).abs().max() < 1e-5
        assert (u @ w.detach()).abs().max() > 1e-2  # the plain W would have been wrong
    torch.testing.assert_close(u.sum(-1), torch.zeros(3), atol=1e-5, rtol=0)
    torch.testing.assert_close(u.norm(dim=-1), torch.ones(3))
    # a gain stored as w and applied as 1 + w (Gemma style): the read map is diag(1 + w) W
    go = model("pre", norm_gain_offset=True)
    randomise_gains(go)
    u, k = null_directions(go, attention_sites(go)["blocks.1.attn"], 2, 3,
                           torch.Generator().manual_seed(0))
    g = go.blocks[1].ln1.w.detach()
    assert k == 32 - 2 * 8 - 1
    for w in (go.blocks[1].attn.W_Q[2], go.blocks[1].attn.W_K[2]):
        assert (u @ ((1 + g)[:, None] * w.detach())).abs().max() < 1e-5
    # pre_qk with zero LN bias: the head only sees the norm change, which its q/k norms
    # remove, so with the gain accounted for the pattern is unchanged
    pq = model("pre_qk")
    randomise_gains(pq)
    assert interference_probe(pq, data(), n_directions=2)["tv_max"] < 1e-4


def test_post_injects_before_the_previous_norm() -> None:
    res = interference_probe(model("post"), data(), n_directions=2)
    by_layer = {r["site"]: [] for r in res["per_head"]}
    for r in res["per_head"]:
        by_layer[r["site"]].append(r["tv_mean"])
    assert max(by_layer["blocks.0.attn"]) < 1e-5  # block 0 reads the embedding directly
    assert min(by_layer["blocks.1.attn"]) > 1e-3
    assert {r["inject"] for r in res["per_head"]} == {"resid", "norm_input"}


def test_encoder_decoder_skips_cross_attention() -> None:
    res = interference_probe(model("qkv", "encoder_decoder"), data("encoder_decoder"),
                             n_directions=1)
    assert res["skipped_sites"] == ["decoder.blocks.0.cross_attn"]
    assert {r["site"] for r in res["per_head"]} == {"encoder.blocks.0.attn",
                                                    "decoder.blocks.0.attn"}
    assert res["tv_max"] < 1e-5


@pytest.mark.parametrize("norm_type", ["rms", "layer"])
def test_synthetic_pre_depends_on_b_and_spheres_restore_independence(norm_type: str,
                                                                     tmp_path) -> None:
    res = synthetic_interference(spreads=[0.0, 0.2, 0.5], norm_type=norm_type, n_seqs=16)
    tv = res["tv"]
    for cond in ("qkv", "none", "pre_spheres"):
        assert max(tv[cond]) < 1e-5, cond
    assert tv["pre"][0] < 1e-5 < 1e-2 < tv["pre"][1] < tv["pre"][2]
    assert res["dim_a"] + res["dim_b"] == (16 if norm_type == "rms" else 15)
    plot_interference({"synthetic": res, "probe": None}, tmp_path / "i.png")
    assert (tmp_path / "i.png").is_file()


@pytest.mark.parametrize("kwargs", [dict(alpha=-1.0), dict(tokens="some"), dict(heads=[9]),
                                    dict(sites=["blocks.0.mlp"]), dict(n_directions=0),
                                    dict(seed=-1), dict(seed=2.5), dict(alpha=math.inf),
                                    dict(alpha=math.nan), dict(max_tokens=0),
                                    dict(max_tokens=1.5), dict(max_tokens="x"),
                                    dict(heads=[0, 0]), dict(alpha=1e30), dict(alpha=100.5)])
def test_bad_arguments(kwargs: dict) -> None:
    """alpha = inf gave NaN TVs, max_tokens = 0 or -5 was recorded as given (and "x" was a bare
    TypeError), and a head given twice was reported twice. A finite alpha of 1e30 overflowed to
    NaN too, and 1e10 gave an immune `qkv` head a TV of 0.78 from float32 rounding."""
    with pytest.raises(ValueError) as err:
        interference_probe(model("pre"), data(n=2), **kwargs)
    name = next(iter(kwargs)).rstrip("s")  # "unknown head 9", "heads: expected each head once"
    assert "\n" not in str(err.value) and name in str(err.value), err.value


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(d_model=1), "d_model: expected an int >= 2 (rms norm); got 1"),
        (dict(d_model=3, norm_type="layer"), "d_model: expected an int >= 4 (layer norm); got 3"),
        (dict(n_seqs=0), "n_seqs: expected an int >= 1; got 0"),
        (dict(n_tokens=1), "n_tokens: expected an int >= 2 (a row with two keys); got 1"),
        (dict(d_head=0), "d_head: expected an int >= 1; got 0"),
        (dict(logit_std=-1.0), "logit_std: expected a finite number > 0; got -1.0"),
        (dict(spreads=[]), "spreads: expected at least one spread"),
        (dict(spreads="0.1"), "spreads: expected a list of numbers in [0, 1); got '0.1'"),
        (dict(spreads=[0.1, 1.0]), "spread: expected a number in [0, 1); got 1.0"),
        (dict(norm_type="batch"), "norm_type: expected 'rms' or 'layer'; got 'batch'"),
        (dict(seed=-1), "seed: expected an int in [0, 2**63); got -1"),
    ],
)
def test_synthetic_study_refuses_bad_sizes_in_one_line(kwargs: dict, message: str) -> None:
    """Each was a ZeroDivisionError, an IndexError, a math domain error or silent NaN TVs."""
    with pytest.raises(ValueError) as err:
        synthetic_interference(**kwargs)
    assert str(err.value) == message


def test_synthetic_norm_h90_is_the_runs_h90() -> None:
    """The synthetic study's realised spread is `spread_stats`' h90 of ||x|| / median, the
    number `norm_spread` reports for trained models, not a second definition beside it."""
    res = synthetic_interference(spreads=[0.0, 0.5], n_seqs=4, n_tokens=5, seed=3)
    gen = torch.Generator().manual_seed(3)  # the same draws, in the same order, by hand
    d, dim_a = 16, 8
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen).double())
    pa, pb = q.float()[:, :dim_a], q.float()[:, dim_a:]
    torch.randn(dim_a, 8, generator=gen), torch.randn(dim_a, 8, generator=gen)
    x_a = torch.randn(4, 5, dim_a, generator=gen) @ pa.T
    torch.randn(4, 5, 8, generator=gen)  # the baseline's B directions
    u = torch.rand(4, 5, generator=gen) * 2 - 1
    dirs = torch.randn(4, 5, 8, generator=gen)
    dirs = dirs / dirs.norm(dim=-1, keepdim=True)
    for s, h90 in zip([0.0, 0.5], res["norm_h90"], strict=True):
        norms = (x_a + (dirs * (math.sqrt(8) * (1 + s * u))[..., None]) @ pb.T).norm(dim=-1)
        dev = sorted(abs(float(v) / float(np.median(norms.numpy())) - 1) for v in norms.flatten())
        assert h90 == pytest.approx(dev[math.ceil(0.9 * len(dev)) - 1], rel=1e-6)


def test_probe_averages_only_rows_that_can_move() -> None:
    """A causal row 0 has one key: its pattern cannot change, and counting it halved the TV of
    two-token sequences. The TV of row 1 is recomputed here from two forwards by hand."""
    m = model("pre", n_layers=1)
    randomise_gains(m)
    B, alpha = 6, 0.5
    tokens = torch.randint(1, 16, (B, 2), generator=torch.Generator().manual_seed(3))
    d = EvalData.from_tokens(tokens)
    res = interference_probe(m, d, alpha=alpha, n_directions=1, sites=["blocks.0.attn"],
                             heads=[0], seed=0)
    r = res["per_head"][0]
    assert r["n_rows"] == B  # not 2B
    site = attention_sites(m)["blocks.0.attn"]
    # the probe's own directions for this head: the first site's, head 0's seed (key 0 + 1)
    u, _ = null_directions(m, site, 0, 1, torch.Generator().manual_seed(group_seed(0, 0, 1)))

    def pattern(shift: bool) -> torch.Tensor:
        got = {}
        hooks = [("blocks.0.attn.hook_pattern", lambda p, hook: got.__setitem__("p", p))]
        if shift:
            hooks.append(("blocks.0.hook_resid_pre",
                          lambda x, hook: x + alpha * x.norm(dim=-1, keepdim=True) * u[0]))
        with torch.no_grad(), m.hooks(hooks):
            d.forward(m)
        return got["p"][:, 0].double()  # head 0: [B, 2, 2]

    row_tv = 0.5 * (pattern(True) - pattern(False)).abs().sum(-1)  # [B, 2]
    assert float(row_tv[:, 0].abs().max()) == 0.0 and float(row_tv[:, 1].min()) > 0
    assert abs(r["tv_mean"] - float(row_tv[:, 1].mean())) < 1e-6


@pytest.mark.parametrize("tokens", ["all", "one"])
def test_a_heads_result_does_not_depend_on_the_selection(tokens: str) -> None:
    """One generator drew every head's directions and every site's token picks in turn, so the
    same head with the same seed read 0.0621, 0.0589 or 0.0818 as other heads or sites were
    selected beside it (0.0226, 0.0071, 0.0045 with tokens="one")."""
    m = model("pre", n_layers=2)
    randomise_gains(m)
    d = data(n=6)

    def tv(**select: Any) -> float:
        res = interference_probe(m, d, n_directions=2, tokens=tokens, seed=3, **select)
        return next(r["tv_mean"] for r in res["per_head"]
                    if r["site"] == "blocks.1.attn" and r["head"] == 2)

    every = tv()
    assert every > 1e-3  # a pre head moves: the equalities below are not of zeros
    for select in ({"heads": [2]}, {"sites": ["blocks.1.attn"]}, {"heads": [1, 2]},
                   {"sites": ["blocks.1.attn"], "heads": [2]}):
        # the same directions; batched with other heads' copies, the sums round differently
        assert tv(**select) == pytest.approx(every, rel=1e-5), select
    res = interference_probe(m, d, n_directions=2, tokens=tokens, seed=4, heads=[2])
    assert res["per_head"][1]["tv_mean"] != every  # another seed, other directions
    # a site's token pick and its heads' directions: streams of their own (a key of (seed,
    # site) was (seed, site, 0), head 0's, after SeedSequence's zero padding)
    seeds = [group_seed(3, 1, k) for k in range(5)]
    assert len(set(seeds)) == 5 and group_seed(3, 1) == group_seed(3, 1, 0)


def test_alpha_up_to_its_bound_leaves_an_immune_head_still() -> None:
    """`alpha` is capped at MAX_ALPHA: past it float32 rounding moved immune heads (1e10 gave
    `qkv` 0.78). At the cap itself a `qkv` head still reads as immune."""
    from normlab.analysis.interference import MAX_ALPHA

    m = model("qkv", n_layers=2)
    randomise_gains(m)
    res = interference_probe(m, data(n=6), alpha=MAX_ALPHA, n_directions=2)
    assert MAX_ALPHA == 100 and res["tv_max"] < 1e-4


def test_the_figure_draws_no_bar_for_a_head_it_could_not_measure(tmp_path: Path,
                                                                  monkeypatch) -> None:
    """A head with no unreadable direction (tv_mean None) was drawn as a bar of 0, which reads as
    the immune QKV-Norm result."""
    import matplotlib.axes

    bars: list[list[float]] = []
    bar = matplotlib.axes.Axes.bar
    monkeypatch.setattr(matplotlib.axes.Axes, "bar",
                        lambda self, x, h, *a, **k: bars.append(list(h)) or bar(self, x, h, *a,
                                                                                  **k))
    probe = {"placement": "pre", "alpha": 0.5, "tokens": "all",
             "per_head": [{"site": "blocks.0.attn", "head": 0, "tv_mean": None},
                          {"site": "blocks.0.attn", "head": 1, "tv_mean": 0.0},
                          {"site": "blocks.0.attn", "head": 2, "tv_mean": 0.04}]}
    plot_interference({"synthetic": None, "probe": probe}, tmp_path / "i.png")
    (heights,) = bars
    assert math.isnan(heights[0]) and heights[1:] == [0.0, 0.04]


def test_non_finite_weights_are_named_before_the_svd() -> None:
    """torch's "linalg.svd: ... non-finite values" named no site, head or weight."""
    m = model("pre")
    with torch.no_grad():
        m.blocks[1].attn.W_Q[2, 0, 0] = math.nan
    with pytest.raises(ValueError, match=r"^blocks\.1\.attn head 2: W_Q, W_K or the gain of the "
                                         r"norm before them is not finite"):
        interference_probe(m, data(), n_directions=1)


def test_one_token_mode_skips_an_example_with_no_real_token() -> None:
    """An all-pad example (hand-built data) failed the whole probe in torch.multinomial. Put
    last, it leaves the others' picks (drawn row by row from one generator) as they were
    without it, so their result too; elsewhere it shifts the draws of the rows after it."""
    m = model("pre", n_layers=1)
    d = data(n=4)
    tokens, valid = d.inputs["tokens"], d.valid["tokens"]
    with_empty = EvalData.from_tokens(torch.cat([tokens, torch.zeros_like(tokens[:1])]),
                                      torch.cat([valid, torch.zeros_like(valid[:1])]))
    alone = interference_probe(m, EvalData.from_tokens(tokens, valid), n_directions=1,
                               tokens="one", heads=[0])
    got = interference_probe(m, with_empty, n_directions=1, tokens="one", heads=[0])
    assert got["per_head"][0]["tv_mean"] == pytest.approx(alone["per_head"][0]["tv_mean"])


def test_one_token_mode_shifts_one_real_token_of_each_example_and_none_of_an_empty_one() -> None:
    """The pick of an example with no real token must inject nothing (its stand-in pick lands
    on a pad); every other example gets exactly one real token."""
    m = model("pre", n_layers=1)
    d = data(n=4)
    tokens, valid = d.inputs["tokens"], d.valid["tokens"]
    empty_first = EvalData.from_tokens(torch.cat([torch.zeros_like(tokens[:1]), tokens]),
                                       torch.cat([torch.zeros_like(valid[:1]), valid]))
    scales: list[torch.Tensor] = []
    with m.hooks([("blocks.0.ln1.hook_scale", lambda x, hook: scales.append(x.detach()))]):
        interference_probe(m, empty_first, n_directions=1, tokens="one", heads=[0])
    ref, shifted = (s[..., 0] for s in scales)
    moved = (shifted / ref - 1).abs() > 1e-3
    assert moved.sum(-1).tolist() == [0, 1, 1, 1, 1]
    assert not (moved & ~empty_first.valid["tokens"]).any()
