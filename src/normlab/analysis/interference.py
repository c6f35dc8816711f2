"""Subspace interference: content a head cannot read still moves its pattern under Pre-Norm.

PAPER.md section 3: with x = x_A + x_B and a head reading only A, Pre-Norm divides the head's
logits by ||x|| which depends on B; QKV-Norm normalises W_Q x, W_K x, which do not. Two tools:

`interference_probe` (any model, e.g. trained): for each self-attention site and head, take unit
directions u the head's q and k *cannot read* -- the left null space of the effective read map
-- add `alpha * ||x_token|| * u` to the residual that feeds the attention, and measure the mean
total-variation distance of that head's pattern. The read map accounts for where the norm is:

- `pre`, `pre_qk`: the attention reads N(x) with x = `blocks.{l}.hook_resid_pre`; the effective
  maps are diag(g) W_Q, diag(g) W_K (g the ln1 gain) and, for LayerNorm, u is also orthogonal
  to the all-ones vector, so centring cannot carry u into the read subspace. Only the norm of
  the token changes what the head sees.
- `post`: block l reads the output of block l-1's `ln2`, so u is added to *that norm's input*
  (a forward pre-hook) with the same effective map; block 0 reads the embedding directly.
- `none`, `qk`, `qkv`: the head reads x through W_Q, W_K directly (any q/k norm comes after
  the projection), so the pattern must be unchanged up to float rounding.

Cross-attention sites are skipped: their keys are the encoder output, not this block's
residual, so "a direction the head cannot read" is not defined on one stream.

`synthetic_interference` builds that x = x_A + x_B by hand in a one-layer normlab model and
shows the pattern's dependence on the spread of ||x_B|| under pre / qkv / none, and that
putting each subspace on a sphere restores independence under pre.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from normlab.analysis.data import (
    EvalData,
    Site,
    block_of,
    chunk_copies,
    evaluating,
    group_seed,
    resolve_sites,
    stack_of,
)
from normlab.analysis.norms import spread_stats
from normlab.checks import check_int, check_on_cpu, check_real, check_seed
from normlab.io import save_figure
from normlab.model import Model, ModelConfig, build_model
from normlab.model.block import PLACEMENTS
from normlab.model.norms import Norm

PROBE_TOKENS = ("all", "one")
SYNTHETIC_CONDITIONS = ("pre", "qkv", "none", "pre_spheres")


def _gain(norm: Norm) -> torch.Tensor:
    w = norm.w.detach()
    return 1.0 + w if norm.gain_offset else w


def read_norm(model: Model, site: Site) -> tuple[Norm | None, str]:
    """The norm whose output the site's q/k read, and where to inject: `resid` or `norm_input`.

    Returns (None, "resid") when the head reads the residual stream directly.
    """
    prefix, layer = block_of(model, site.name)
    stack = stack_of(model, prefix)
    placement = PLACEMENTS[model.cfg.norm_placement]
    if placement.attn == "pre":
        return stack.blocks[layer].ln1, "resid"
    if placement.attn == "post" and layer > 0:
        return stack.blocks[layer - 1].ln2, "norm_input"
    return None, "resid"


def null_directions(
    model: Model, site: Site, head: int, n: int, generator: torch.Generator
) -> tuple[torch.Tensor, int]:
    """`n` random unit directions u with u·(effective W_Q, W_K) = 0, and the null-space dim.

    Effective W = diag(g) W when a norm with gain g sits in front; with a LayerNorm, u is also
    orthogonal to the all-ones vector. Under a whole-projection q/k norm (`qkv_norm_scope =
    "all"`) every head's W_Q, W_K count, since the head's normalised q, k divide by all of
    them. Returns an empty [0, d] tensor when the null space is 0.
    """
    attn = site.module
    rep = attn.n_heads // attn.n_kv_heads
    if attn.q_norm is not None and attn.q_norm.scope == "all":
        # a whole-projection q/k norm divides by every head's projection: all of them read
        wq, wk = attn.W_Q.detach().double().unbind(0), attn.W_K.detach().double().unbind(0)
    else:
        wq, wk = [attn.W_Q[head].detach().double()], [attn.W_K[head // rep].detach().double()]
    norm, _ = read_norm(model, site)
    cols = [*wq, *wk]
    d = cols[0].shape[0]
    if norm is not None:
        g = _gain(norm).double()[:, None]
        cols = [g * w for w in cols]
        if norm.kind == "layer":
            cols.append(torch.full((d, 1), 1.0 / math.sqrt(d), dtype=torch.float64))
    m = torch.cat(cols, dim=1)
    if not bool(torch.isfinite(m).all()):  # torch's SVD error named no site, head or weight
        raise ValueError(f"{site.name} head {head}: W_Q, W_K or the gain of the norm before "
                         "them is not finite; expected a model with finite weights")
    u, s, _ = torch.linalg.svd(m, full_matrices=True)
    rank = int((s > s.max() * 1e-9).sum()) if s.numel() else 0
    basis = u[:, rank:]
    k = basis.shape[1]
    if k == 0:
        return torch.zeros(0, m.shape[0]), 0
    c = torch.randn(n, k, generator=generator, dtype=torch.float64)
    dirs = c @ basis.T
    return (dirs / dirs.norm(dim=-1, keepdim=True)).float(), k


#: The largest injected norm fraction: content 100x the token's own norm already swamps it,
#: and far past it float32 rounding of the direction moves even an immune head's pattern
#: (alpha 1e10 gave `qkv` a TV of 0.78; 1e30 overflowed to NaN). At 100 an immune head moves
#: by about 1e-5 (tested below 1e-4).
MAX_ALPHA = 100.0


def check_alpha(alpha: object) -> float:
    """The probe's injected norm fraction: a number in (0, `MAX_ALPHA`]."""
    return check_real(alpha, "alpha", what=f"a number in (0, {MAX_ALPHA:g}]",
                      ok=lambda v: 0 < v <= MAX_ALPHA)


def interference_probe(
    model: Model,
    data: EvalData,
    *,
    alpha: float = 0.5,
    n_directions: int = 4,
    tokens: str = "all",
    sites: Sequence[str] | None = None,
    heads: Sequence[int] | None = None,
    seed: int = 0,
    max_tokens: int = 1 << 15,
) -> dict[str, Any]:
    """Mean TV distance of each head's pattern when unreadable content is added.

    `tokens="all"` adds to every real token, `"one"` to one random real token per example (the
    key-specific effect). TV = 0.5 * sum_k |a - a'| averaged over the real query rows with at
    least two keys to attend to (a row with one key has TV 0 whatever is added: counting it
    would only dilute the mean, as in `find_sparse_rows` and the synthetic study) and the
    `n_directions` directions; all heads and directions of a site run batched in one forward.
    Each head's directions, and each site's token pick, are drawn from a seed of their own
    (`seed`, the site's place among all sites, the head): a head reads the same whichever
    others are probed beside it.
    """
    check_on_cpu(model)
    check_alpha(alpha)
    n_directions = check_int(n_directions, "n_directions", low=1)
    seed = check_seed(seed)
    max_tokens = check_int(max_tokens, "max_tokens", low=1)
    if tokens not in PROBE_TOKENS:
        raise ValueError(f"unknown tokens {tokens!r}; expected one of {', '.join(PROBE_TOKENS)}")
    chosen, head_sel = resolve_sites(model, sites, heads)
    every = [s.name for s in resolve_sites(model)[0]]  # a site's seed: its place among all
    B = data.n_examples
    results, skipped = [], []
    with evaluating(model):
        ref: dict[str, torch.Tensor] = {}

        def save(x: torch.Tensor, hook: Any) -> None:
            ref[hook.name] = x

        def count_keys(x: torch.Tensor, hook: Any) -> None:  # the mask is every head's
            ref[hook.name] = torch.isfinite(x[:, 0]).sum(-1)  # [B, Q] keys a row may attend

        with model.hooks([(f"{s.name}.hook_{name}", fn) for s in chosen if not s.cross
                          for name, fn in (("pattern", save), ("attn_scores", count_keys))]):
            data.forward(model)
        for site in chosen:
            if site.cross:
                skipped.append(site.name)
                continue
            hs = list(range(site.n_heads)) if head_sel is None else head_sel
            # rows that can move: real queries with two or more keys they may attend to
            rows = data.valid[site.q_stream] & (ref[f"{site.name}.hook_attn_scores"] >= 2)
            results += _probe_site(model, data, site, hs, ref[f"{site.name}.hook_pattern"],
                                   rows, alpha, n_directions, tokens,
                                   (seed, every.index(site.name)), max_tokens, B)
    tv = [r["tv_mean"] for r in results if r["tv_mean"] is not None]
    return {
        "alpha": float(alpha),
        "n_directions": n_directions,
        "tokens": tokens,
        "placement": model.cfg.norm_placement,
        "norm_type": model.cfg.norm_type,
        "per_head": results,
        "tv_mean": float(np.mean(tv)) if tv else None,
        "tv_max": float(np.max(tv)) if tv else None,
        "skipped_sites": skipped,
        "note": "TV of a head's pattern when alpha*||x||*u is added to the residual feeding the "
                "attention, u in the null space of the head's effective q/k read map "
                "(LayerNorm gain and centring included under pre/pre_qk/post), averaged over the "
                "real query rows with at least two keys (n_rows; before normlab's twenty-second "
                "session, over every real row, one-key rows included); each head's directions "
                "drawn from a seed of its own (since the thirty-sixth session). Zero to float "
                "precision means the head is immune to content it cannot read.",
    }


def _probe_site(
    model: Model, data: EvalData, site: Site, hs: list[int], ref: torch.Tensor,
    rows: torch.Tensor, alpha: float, n_dir: int, tokens: str, group: tuple[int, int],
    max_tokens: int, B: int,
) -> list[dict[str, Any]]:
    """TV per head of `hs`, averaged over the query `rows` [B, Q] (see `interference_probe`).
    `group` (seed, the site's place among all sites) seeds the site's token pick (key 0) and
    each head h's directions (key h + 1) on their own, so a head's result does not depend on
    the selection. Keys of one length: `group_seed` pads a shorter key with zeros."""
    prefix, layer = block_of(model, site.name)
    norm, where = read_norm(model, site)
    valid = data.valid[site.q_stream]
    if tokens == "one":
        gen = torch.Generator().manual_seed(group_seed(*group, 0))
        empty = ~valid.any(-1)  # no real token to pick: multinomial refused the whole batch
        weights = valid.float().masked_fill(empty[:, None], 1.0)
        pick = torch.multinomial(weights, 1, generator=gen).squeeze(1)
        inject = torch.zeros_like(valid)
        inject[torch.arange(B), pick] = True
        inject &= valid
    else:
        inject = valid
    dirs, dims = [], []
    for h in hs:
        u, k = null_directions(model, site, h, n_dir,
                               torch.Generator().manual_seed(group_seed(*group, h + 1)))
        dims.append(k)
        dirs.append(u if k else torch.zeros(n_dir, site.module.W_Q.shape[1]))
    u_all = torch.cat(dirs)  # [n_heads_sel * n_dir, d], copy c = (head index, direction)
    n_copies = u_all.shape[0]
    tv = torch.zeros(n_copies, dtype=torch.float64)
    qmask = rows.float()
    n_rows = float(qmask.sum())
    chunk = chunk_copies(data, max_tokens, n_copies)
    start = 0
    while start < n_copies:
        c = min(chunk, n_copies - start)
        u = u_all[start:start + c]
        shift = u.repeat_interleave(B, 0)[:, None, :] * inject.repeat(c, 1)[..., None]

        def add(x: torch.Tensor, _shift: torch.Tensor = shift) -> torch.Tensor:
            return x + alpha * x.norm(dim=-1, keepdim=True) * _shift.to(x.dtype)

        got: dict[str, torch.Tensor] = {}

        def grab(x: torch.Tensor, hook: Any, _got: dict = got) -> None:
            _got["p"] = x

        hooks = [(f"{site.name}.hook_pattern", grab)]
        handle = None
        if where == "norm_input":
            handle = norm.register_forward_pre_hook(lambda _m, args, _a=add: (_a(args[0]),))
        else:
            hooks.append((f"{prefix}blocks.{layer}.hook_resid_pre", lambda x, hook, _a=add: _a(x)))
        try:
            with model.hooks(hooks):
                data.forward(model, copies=c)
        finally:
            if handle is not None:
                handle.remove()
        p = got["p"].view(c, B, site.n_heads, *ref.shape[2:])
        head_idx = torch.tensor([hs[(start + i) // n_dir] for i in range(c)])
        p_head = p[torch.arange(c), :, head_idx]  # [c, B, Q, K]
        r_head = ref[:, head_idx].permute(1, 0, 2, 3)  # [c, B, Q, K]
        row_tv = 0.5 * (p_head - r_head).abs().sum(-1).double()  # [c, B, Q]
        tv[start:start + c] = (row_tv * qmask.double()).sum((1, 2)) / max(n_rows, 1.0)
        start += c
    out = []
    for i, h in enumerate(hs):
        v = tv[i * n_dir:(i + 1) * n_dir]
        ok = dims[i] > 0 and n_rows > 0  # no direction to add, or no row that can move
        out.append({"site": site.name, "head": h, "null_dim": dims[i],
                    "tv_mean": float(v.mean()) if ok else None,
                    "tv_max": float(v.max()) if ok else None,
                    "tv_std": float(v.std()) if ok and n_dir > 1 else None,
                    "n_rows": int(n_rows), "inject": where})
    return out


# --------------------------------------------------------------------------- synthetic


def synthetic_interference(
    *,
    spreads: Sequence[float] = (0.0, 0.1, 0.2, 0.3, 0.5, 0.8),
    d_model: int = 16,
    d_head: int = 8,
    n_tokens: int = 16,
    n_seqs: int = 64,
    norm_type: str = "rms",
    logit_std: float = 3.0,
    seed: int = 0,
) -> dict[str, Any]:
    """TV of a head's pattern vs the spread of ||x_B||, with the head reading only A.

    x_A: Gaussian in A; x_B: random directions in B with norm m * (1 + s * U[-1, 1]), against a
    baseline with new B directions of constant norm m = sqrt(dim B). Conditions (real normlab
    one-layer, one-head models, weights set by hand): `pre`, `qkv`, `none`, and `pre_spheres`
    (pre with x_A and x_B each rescaled to a constant norm). A and B are orthogonal and, for
    LayerNorm, both orthogonal to the all-ones vector (so centring cannot mix them), which
    leaves dims d/2 and d/2 - 1; with RMSNorm (default) each has dim d/2. TV is the mean over
    query rows with at least two keys (causal model). Expected: `none`, `qkv`, `pre_spheres`
    ~ 0 (float precision); `pre` growing with the spread.
    """
    if isinstance(spreads, str | bytes) or not isinstance(spreads, Iterable):
        raise ValueError(f"spreads: expected a list of numbers in [0, 1); got {spreads!r}")
    spreads = [check_real(s, "spread", what="a number in [0, 1)", ok=lambda v: 0 <= v < 1)
               for s in spreads]
    if not spreads:
        raise ValueError("spreads: expected at least one spread")
    if norm_type not in ("rms", "layer"):
        raise ValueError(f"norm_type: expected 'rms' or 'layer'; got {norm_type!r}")
    low = 4 if norm_type == "layer" else 2  # subspaces A and B each at least one dim
    d_model = check_int(d_model, "d_model", low=low, what=f"an int >= {low} ({norm_type} norm)")
    d_head = check_int(d_head, "d_head", low=1)
    n_tokens = check_int(n_tokens, "n_tokens", low=2, what="an int >= 2 (a row with two keys)")
    n_seqs = check_int(n_seqs, "n_seqs", low=1)
    logit_std = check_real(logit_std, "logit_std", what="a finite number > 0", ok=lambda v: v > 0)
    seed = check_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    d = d_model
    if norm_type == "layer":
        m = torch.cat([torch.ones(d, 1), torch.randn(d, d - 1, generator=gen)], 1)
        q, _ = torch.linalg.qr(m.double())
        basis = q[:, 1:].float()
    else:
        q, _ = torch.linalg.qr(torch.randn(d, d, generator=gen).double())
        basis = q.float()
    dim_a = d // 2
    pa, pb = basis[:, :dim_a], basis[:, dim_a:]
    dim_b = pb.shape[1]
    c = math.sqrt(logit_std / dim_a)  # logits ~ dim_a * c^2 in std for unit-variance x_A
    wq = pa @ (torch.randn(dim_a, d_head, generator=gen) * c)
    wk = pa @ (torch.randn(dim_a, d_head, generator=gen) * c)
    coef_a = torch.randn(n_seqs, n_tokens, dim_a, generator=gen)
    x_a = coef_a @ pa.T
    radius = math.sqrt(dim_b)

    def b_part(scale: torch.Tensor) -> torch.Tensor:
        z = torch.randn(n_seqs, n_tokens, dim_b, generator=gen)
        return (z / z.norm(dim=-1, keepdim=True) * scale[..., None]) @ pb.T

    base_b = b_part(torch.full((n_seqs, n_tokens), radius))
    u = torch.rand(n_seqs, n_tokens, generator=gen) * 2 - 1
    new_dirs = torch.randn(n_seqs, n_tokens, dim_b, generator=gen)
    new_dirs = new_dirs / new_dirs.norm(dim=-1, keepdim=True)
    models = {p: _one_head_model(p, d, d_head, n_tokens, norm_type, wq, wk)
              for p in ("pre", "qkv", "none")}
    table: dict[str, list[float]] = {k: [] for k in SYNTHETIC_CONDITIONS}
    realised: list[float] = []
    for s in spreads:
        rb = radius * (1 + s * u)
        new_b = (new_dirs * rb[..., None]) @ pb.T
        norms = (x_a + new_b).norm(dim=-1)
        n = norms.numpy().ravel()
        realised.append(spread_stats(n / np.median(n))["h90"])  # the h90 the runs report
        for cond in SYNTHETIC_CONDITIONS:
            xa = x_a
            if cond == "pre_spheres":
                xa = x_a / x_a.norm(dim=-1, keepdim=True) * math.sqrt(dim_a)
                nb = new_b / new_b.norm(dim=-1, keepdim=True) * radius
            else:
                nb = new_b
            model = models["pre" if cond == "pre_spheres" else cond]
            table[cond].append(_mean_tv(model, xa + base_b, xa + nb))
    return {
        "spreads": spreads,
        "tv": table,
        "norm_h90": realised,
        "conditions": list(SYNTHETIC_CONDITIONS),
        "d_model": d, "dim_a": dim_a, "dim_b": dim_b, "d_head": d_head,
        "n_tokens": n_tokens, "n_seqs": n_seqs, "norm_type": norm_type, "seed": seed,
        "note": "TV of the pattern of a head reading only subspace A, between x_A + x_B (||x_B|| "
                "spread s) and x_A + x_B0 (constant ||x_B0||); norm_h90 = realised h90 of "
                "||x|| / median. pre_spheres: both subspaces projected on spheres.",
    }


def _one_head_model(
    placement: str, d: int, d_head: int, n_tokens: int, norm_type: str, wq: torch.Tensor,
    wk: torch.Tensor,
) -> Model:
    cfg = ModelConfig(d_model=d, n_heads=1, d_head=d_head, n_layers=1, d_mlp=4,
                      max_len=n_tokens, pos_encoding="none", norm_placement=placement,
                      norm_type=norm_type, attn_scale="fixed" if placement != "qkv" else "learned")
    model = build_model(cfg).eval()
    with torch.no_grad():
        model.blocks[0].attn.W_Q[0] = wq
        model.blocks[0].attn.W_K[0] = wk
    return model


def _mean_tv(model: Model, x0: torch.Tensor, x1: torch.Tensor) -> float:
    """Mean TV between the layer-0 patterns for residual inputs x0 and x1 (rows with >= 2 keys)."""
    pats = []
    for x in (x0, x1):
        got: dict[str, torch.Tensor] = {}
        hooks = [("blocks.0.hook_resid_pre", lambda _h, hook, _x=x: _x),
                 ("blocks.0.attn.hook_pattern",
                  lambda p, hook, _g=got: _g.__setitem__("p", p))]
        tokens = torch.zeros(x.shape[:2], dtype=torch.long)
        with evaluating(model), model.hooks(hooks):
            model(tokens)
        pats.append(got["p"][:, 0].double())
    row_tv = 0.5 * (pats[0] - pats[1]).abs().sum(-1)  # [N, T]
    return float(row_tv[:, 1:].mean())


# --------------------------------------------------------------------------- figure


def plot_interference(result: dict[str, Any], path: Path, title: str = "") -> None:
    """Left: synthetic TV vs ||x_B|| spread per condition. Right: per-head probe TV."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    syn, probe = result.get("synthetic"), result.get("probe")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    ax = axes[0]
    if syn:
        styles = ["o-", "s--", "^:", "x-."]
        for i, cond in enumerate(syn["conditions"]):
            ax.plot(syn["spreads"], syn["tv"][cond], styles[i % len(styles)], label=cond,
                    alpha=0.85)
        ax.set_xlabel("relative spread s of ||x_B|| (x_B norm = m(1 + s U[-1,1]))")
        ax.set_ylabel("mean TV of the A-reading head's pattern")
        ax.set_title("synthetic: head reads only A", fontsize=9)
        ax.legend(fontsize=8)
    ax = axes[1]
    if probe and probe["per_head"]:
        rows = probe["per_head"]
        labels = [f"{r['site'].replace('blocks.', '').replace('.attn', '')}.h{r['head']}"
                  for r in rows]
        # a head with no unreadable direction was not measured: no bar, not a TV of 0
        vals = [math.nan if r["tv_mean"] is None else r["tv_mean"] for r in rows]
        ax.bar(range(len(rows)), vals, color="tab:purple")
        unmeasured = [i for i, v in enumerate(vals) if math.isnan(v)]
        if unmeasured:
            ax.plot(unmeasured, [0.0] * len(unmeasured), "x", color="gray", clip_on=False,
                    label="no unreadable direction (not measured)")
            ax.legend(fontsize=7, loc="upper left")
        measured = [v for v in vals if not math.isnan(v)]
        ax.set_ylim(0, max(measured) * 1.25 if measured and max(measured) > 0 else 1)
        ax.set_xticks(range(len(rows)), labels, rotation=90, fontsize=6)
        ax.set_ylabel("mean TV")
        ax.set_title(f"probe ({probe['placement']}): unreadable content, "
                     f"alpha={probe['alpha']}, tokens={probe['tokens']}", fontsize=9)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
