"""H2, circuit collapse: do sparse attention rows keep their winner when q/k/v norms are noisy?

PAPER.md section 3 models subspace interference as multiplicative noise on the L2 norms of
q, k, v: `q -> (1 + eps) q` etc. Here that noise is applied to the real model with forward hooks
on `hook_q`, `hook_k`, `hook_v` of the chosen attention sites, and we count the sparse rows
(max weight >= theta) whose argmax key changes. Beside it we put the analytic prediction of
`normlab.analysis.theory` computed from the recorded, unperturbed raw logits of those rows.

Noise (`Perturbation`):
- `token` mode (default): one eps per token per attention module, shared by that token's q, k
  and v in every selected head (a token's norm is one number in a Pre-Norm model). For
  cross-attention the queries (decoder tokens) and the memory (encoder tokens) have separate
  tables.
- `vector` mode: independent eps for each of q, k, v, per head and token.
- eps ~ N(0, sigma^2) (`normal`) or U[-sigma, sigma] (`uniform`), drawn as sigma * z with z
  drawn once per sigma from `torch.Generator().manual_seed(seed)`: every sigma sees the same z
  (common random numbers), so the measured rate is close to monotone in sigma.
- Tables are pre-drawn for the whole padded width, so hooks only index them; this is what makes
  uncached greedy decoding consistent across steps (position p has the same eps at every step).

Measurement vs theory (why they differ, on purpose):
- The measurement perturbs every selected site at once, so a row's logits also move because
  earlier layers' noise changed this layer's input, and value noise changes the inputs of later
  layers. The theory sees only key-norm noise at the row's own layer, applied to the recorded
  logits. Measured > predicted therefore signals propagation, not an error.
- In `token` mode a query's own eps is a row-wide factor, which cannot move the argmax while
  1 + eps > 0 (in self-attention the query token's own key carries the same eps, which after
  that factor is divided out is one more independent key factor, as the theory has it). A
  negative 1 + eps (normal noise: probability Phi(-1/sigma); uniform: none for sigma <= 1)
  reverses the row; the theory leaves it out.
- Targets without `k` (e.g. only `v`) have no direct effect on the row in the theory, which
  still reports the key-noise prediction for reference.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from normlab.analysis.data import (
    EvalData,
    Site,
    chunk_copies,
    collect,
    evaluating,
    group_seed,
    last_block_sites,
    resolve_sites,
    sweep_groups,
)
from normlab.analysis.theory import predict_collapse
from normlab.checks import (
    check_int,
    check_on_cpu,
    check_real,
    check_seed,
    check_sigma,
    check_sigmas,
    format_bytes,
    memory_bytes,
)
from normlab.io import save_figure
from normlab.model import EncoderDecoderLM, Model
from normlab.model.attention import pattern_formed_anyway
from normlab.model.generate import greedy_decode
from normlab.model.hooks import torch_hooked
from normlab.model.norms import Norm
from normlab.stats import wilson_ci
from normlab.tasks.addition import (
    EOS,
    Cell,
    ResolvedTask,
    aux_positions,
    make_prompts,
    next_aux_position,
    parse_answer,
)

MODES = ("token", "vector")
TARGETS = ("q", "k", "v")
NOISES = ("normal", "uniform")
THRESHOLDS = (0.5, 0.8, 0.9, 0.99)
ROWS = ("all", "loss")
"""Which query rows may count as sparse rows: every real one, or only those whose output reaches
a position the training loss scores (`EvalData.loss_rows`)."""
DEFAULT_SIGMAS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.15, 0.2, 0.3)
DEFAULT_MAX_TOKENS = 1 << 13
"""Positions per forward in the batched sweep; bounds memory (MLP activations dominate). On
CPU, chunks of ~8k positions ran the sweep ~15% faster than 32k ones (activations closer to
cache size; `benchmarks/probes/collapse_prof.py`)."""

CI_METHOD = ("cluster bootstrap over examples (1000 resamples, percentile 95%): draws and rows "
             "of one example are correlated, so examples, not row-draws, are resampled; every "
             "sigma uses the same resamples; at sigma > 0 widened to at least the Wilson interval "
             "over row-draws, which a bootstrap of 0 flips or of one example's rows lacks")


# --------------------------------------------------------------------------- validation


def check_threshold(theta: float) -> float:
    return check_real(theta, "threshold", what="a number in (0, 1]", ok=lambda v: 0 < v <= 1)


def check_targets(targets: Sequence[str] | str) -> tuple[str, ...]:
    """`("q","k")`, `"qk"`, `"q,k"` or `"q, k"`; order normalised to q, k, v."""
    items = (list(targets.replace(",", "").replace(" ", "")) if isinstance(targets, str)
             else list(targets))
    for t in items:
        if t not in TARGETS:
            raise ValueError(f"targets: unknown target {t!r}; expected a subset of q, k, v")
    if not items:
        raise ValueError("targets: expected at least one of q, k, v")
    return tuple(t for t in TARGETS if t in items)


def _check_choice(value: str, allowed: Sequence[str], name: str) -> str:
    if value not in allowed:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(allowed)}")
    return value


# --------------------------------------------------------------------------- perturbation


Tables = dict[tuple[str, str], torch.Tensor]


class Perturbation:
    """Multiplicative q/k/v noise on chosen sites and heads, applied from pre-drawn tables.

    `draw(sigma, n_rows, lengths, generator)` makes the eps tables for a batch of `n_rows`
    sequences; `hooks(tables)` gives `(hook_name, fn)` pairs for `model.hooks(...)`. Tables are
    drawn for *all* sites and targets in a fixed order, whatever is selected, so a selection
    never changes the noise another site receives. With grouped-query attention a selected query
    head selects the key/value head it reads.
    """

    def __init__(
        self,
        model: Model,
        *,
        mode: str = "token",
        targets: Sequence[str] | str = TARGETS,
        noise: str = "normal",
        sites: Sequence[str] | None = None,
        heads: Sequence[int] | None = None,
    ) -> None:
        self.mode = _check_choice(mode, MODES, "mode")
        self.noise = _check_choice(noise, NOISES, "noise")
        self.targets = check_targets(targets)
        self.all_sites, _ = resolve_sites(model)
        self.sites, self.heads = resolve_sites(model, sites, heads)

    def _head_mask(self, site: Site, target: str) -> torch.Tensor:
        n = site.n_heads if target == "q" else site.n_kv_heads
        if self.heads is None:
            return torch.ones(n)
        rep = site.n_heads // site.n_kv_heads
        keep = set(self.heads) if target == "q" else {h // rep for h in self.heads}
        return torch.tensor([float(i in keep) for i in range(n)])

    def draw(
        self, sigma: float, n_rows: int, lengths: Mapping[str, int], generator: torch.Generator
    ) -> Tables:
        """eps tables keyed by (site, target): [n_rows, L] (token) or [n_rows, L, heads]."""
        sigma = check_sigma(sigma)

        def z(*shape: int) -> torch.Tensor:
            if self.noise == "normal":
                return torch.randn(shape, generator=generator) * sigma
            return (torch.rand(shape, generator=generator) * 2 - 1) * sigma

        tables: Tables = {}
        for site in self.all_sites:
            lq, lkv = lengths[site.q_stream], lengths[site.kv_stream]
            if self.mode == "token":
                tq = z(n_rows, lq)
                tkv = z(n_rows, lkv) if site.cross else tq
                tables[(site.name, "q")] = tq
                tables[(site.name, "k")] = tables[(site.name, "v")] = tkv
            else:
                tables[(site.name, "q")] = z(n_rows, lq, site.n_heads)
                tables[(site.name, "k")] = z(n_rows, lkv, site.n_kv_heads)
                tables[(site.name, "v")] = z(n_rows, lkv, site.n_kv_heads)
        return tables

    def hooks(self, tables: Tables) -> list[tuple[str, Callable[..., torch.Tensor]]]:
        out = []
        for site in self.sites:
            for t in self.targets:
                fn = _scale_hook(tables[(site.name, t)], self._head_mask(site, t),
                                 getattr(site.module, f"{t}_norm"))
                out.append((f"{site.name}.hook_{t}", fn))
        return out


def _scale_hook(
    table: torch.Tensor, head_mask: torch.Tensor, norm: Norm | None = None
) -> Callable[..., torch.Tensor]:
    """x [batch, pos, head, d_head] -> x * (1 + eps[batch, pos(, head)]) on selected heads.

    The product is written into x itself where nothing else can hold x (`_may_overwrite`):
    the same products, without a fresh tensor per call: the sweep's forwards about 2%
    faster, within the noise (`benchmarks/probes/sweep_noise_in_place.py`). `norm` is the
    norm that made x, if any (QK/QKV-Norm): a hook on its output has seen x.
    """

    def fn(x: torch.Tensor, hook: Any) -> torch.Tensor:
        n, p = x.shape[:2]
        if table.shape[0] != n or table.shape[1] < p:
            raise ValueError(f"{hook.name}: eps table {tuple(table.shape)} does not cover a "
                             f"batch of {n} x {p} positions")
        eps = table[:, :p]
        eps = eps[:, :, None, None] if eps.dim() == 2 else eps[..., None]
        mask = head_mask.to(x.dtype)[None, None, :, None]
        factor = 1 + eps.to(x.dtype) * mask
        return x.mul_(factor) if _may_overwrite(x, fn, hook, norm) else x * factor

    return fn


def _may_overwrite(x: torch.Tensor, fn: Callable[..., Any], hook: Any, norm: Norm | None) -> bool:
    """Whether a hook `fn` may change the vector x in place: autograd does not need it, `fn`
    is the first function on its point (no other has seen x), and no hook reads the norm that
    made x (normlab's `hook_normalized`, or a PyTorch hook on the norm module), which would
    have seen the same tensor. x is otherwise fresh: a projection's or a norm's output."""
    if x.requires_grad or not hook.fns or hook.fns[0] is not fn:
        return False
    return norm is None or not (norm.hook_normalized.fns or torch_hooked(norm))


# --------------------------------------------------------------------------- sparse rows


@dataclass
class SparseRows:
    """Sparse rows of the unperturbed model, grouped by site (then example, head, query).

    Columns are [R] tensors; `logits[site]` holds the raw scores [R_site, K_site] of that
    site's rows in the same order (``-inf`` on masked keys). `valid_rows[(site, head)]` is
    the number of real query rows of that head and `counts[(site, head)][theta]` how many are
    sparse at each reporting threshold.
    """

    threshold: float
    sites: list[str]
    site: torch.Tensor
    head: torch.Tensor
    example: torch.Tensor
    qpos: torch.Tensor
    key: torch.Tensor
    weight: torch.Tensor
    logits: dict[str, torch.Tensor]
    valid_rows: dict[tuple[str, int], int]
    counts: dict[tuple[str, int], dict[float, int]]

    def __len__(self) -> int:
        return int(self.site.numel())


def find_sparse_rows(
    model: Model,
    data: EvalData,
    *,
    threshold: float = 0.9,
    sites: Sequence[str] | None = None,
    heads: Sequence[int] | None = None,
    rows: str = "all",
) -> SparseRows:
    """Rows with max weight >= threshold at real query positions of the chosen sites/heads.

    Rows with fewer than two attendable keys (the first token under a causal mask) are left
    out everywhere: they are trivially "sparse" and can never collapse, so counting them
    would only dilute the collapse rate. `rows="loss"` also leaves out rows whose output no
    scored position reads (`EvalData.loss_rows`): a decoder's final E, and its question in
    the last block, whose attention training never shaped.
    """
    check_on_cpu(model)
    threshold = check_threshold(threshold)
    _check_choice(rows, ROWS, "rows")
    if rows == "loss" and not data.scored:  # hand-built data: every row would count
        raise ValueError("rows: 'loss' needs data that records which outputs the loss scores "
                         "(EvalData.from_problems); this data records none")
    chosen, head_sel = resolve_sites(model, sites, heads)
    last = last_block_sites(model) if rows == "loss" else set()
    names = [f"{s.name}.hook_{k}" for s in chosen for k in ("attn_scores", "pattern")]
    cache = collect(model, data, {n: torch.Tensor.detach for n in names})
    thetas = sorted(set(THRESHOLDS) | {threshold})
    cols: dict[str, list[torch.Tensor]] = {k: [] for k in
                                           ("site", "head", "example", "qpos", "key", "weight")}
    logits, valid_rows, counts = {}, {}, {}
    for si, site in enumerate(chosen):
        pattern = cache[f"{site.name}.hook_pattern"]  # [B, H, Q, K]
        scores = cache[f"{site.name}.hook_attn_scores"]
        hs = list(range(site.n_heads)) if head_sel is None else head_sel
        real = (data.valid[site.q_stream] if rows == "all"
                else data.loss_rows(site.q_stream, site.name in last))
        qvalid = real[:, None, :].expand(-1, site.n_heads, -1).clone()
        keep = torch.zeros(site.n_heads, dtype=torch.bool)
        keep[hs] = True
        qvalid &= keep[None, :, None]
        nan = torch.isnan(scores).any(-1) & data.valid[site.q_stream][:, None, :]
        if nan.any():  # they looked like one-key rows: left out, and the analysis read as sound
            heads = nan.any(-1).any(0).nonzero().flatten().tolist()
            raise ValueError(f"{site.name}: {int(nan.sum())} attention rows of real queries have "
                             f"NaN scores (heads {heads}); the model gives non-finite "
                             "activations on this data")
        qvalid &= torch.isfinite(scores).sum(-1) >= 2
        weight, key = pattern.max(-1)
        for h in hs:
            w = weight[:, h][qvalid[:, h]]
            valid_rows[(site.name, h)] = int(w.numel())
            counts[(site.name, h)] = {t: int((w >= t).sum()) for t in thetas}
        b, h, q = torch.nonzero(qvalid & (weight >= threshold), as_tuple=True)
        cols["site"].append(torch.full_like(b, si))
        for name, val in (("head", h), ("example", b), ("qpos", q), ("key", key[b, h, q]),
                          ("weight", weight[b, h, q])):
            cols[name].append(val)
        logits[site.name] = scores[b, h, q]
    return SparseRows(threshold, [s.name for s in chosen],
                      *(torch.cat(cols[k]) for k in cols), logits, valid_rows, counts)


# --------------------------------------------------------------------------- sweep


class _PatternWinners:
    """The argmax key of a site's chosen rows under noise, read off `hook_pattern`.

    Gathering the few sparse rows before the argmax skips the rest of the pattern: a
    full-pattern argmax over <= 16 keys cost ~7% of a sweep. Used where the model runs the
    explicit attention path anyway (`attention.pattern_formed_anyway`: short rows on CPU with
    `native.attention` off, not built or not applying), so reading the pattern is free.
    """

    def __init__(self, site: Site, example: torch.Tensor, head: torch.Tensor,
                 qpos: torch.Tensor) -> None:
        self.name = f"{site.name}.hook_pattern"
        self.example, self.head, self.qpos = example, head, qpos

    def take(self, copies: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        def rows(pattern: torch.Tensor) -> torch.Tensor:  # [c * B, H, Tq, Tk] -> [c, R]
            p = pattern.view(copies, -1, *pattern.shape[1:])
            return p[:, self.example, self.head, self.qpos].argmax(-1)

        return {self.name: rows}

    def winners(self, got: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return got[self.name]


class _RowWinners:
    """The argmax key of a site's chosen rows under noise, from its q and k, not its pattern.

    Where the model would run SDPA (long rows, GPUs; `explicit_by_default`) or normlab's
    attention kernel (short rows on CPU; `native.attention`), reading `hook_pattern` would
    force every site's layer onto the explicit scores/softmax path, which materialises
    [batch, head, T, T]. Instead the rows' queries and keys are gathered at
    `hook_q`/`hook_k` (`hook_rot_*` with RoPE; after the perturbation hooks, so the noisy
    vectors), and the rows' scores are recomputed outside the model, `scale * q.k`, masked with
    the attendable keys of the recorded unperturbed scores (noise never changes which keys a
    row may read). The argmax of the scores is the argmax of the softmax. On 128-key rows this
    ran the sweep 14-34% faster (`benchmarks/probes/collapse_long_rows.py`); on short rows with
    the kernel the perturbed forwards took 0.93-1.00 of their time reading the pattern, with the
    kernel off 1.02-1.14 of it, hence `_PatternWinners` there (`benchmarks/probes/
    collapse_row_winners.py`; docs/performance.md, twenty-ninth section).
    """

    def __init__(
        self, site: Site, example: torch.Tensor, head: torch.Tensor, qpos: torch.Tensor,
        attendable: torch.Tensor,
    ) -> None:
        # only a site RoPE rotates has these points (cross-attention's keys are the source's)
        rot = "rot_" if hasattr(site.module, "hook_rot_q") else ""
        self.q_name, self.k_name = f"{site.name}.hook_{rot}q", f"{site.name}.hook_{rot}k"
        self.example, self.head, self.qpos = example, head, qpos
        self.kv_head = head // (site.n_heads // site.n_kv_heads)
        self.scale = site.module.scale.detach()[head]  # [R]
        self.attendable = attendable  # [R, K] bool

    def take(self, copies: int) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
        """`collect` readers: the rows' queries [c, R, e] and their keys [c, R, Tk, e]."""
        def q_rows(q: torch.Tensor) -> torch.Tensor:  # [c * B, Tq, H, e]
            return q.unflatten(0, (copies, -1))[:, self.example, self.qpos, self.head]

        def k_rows(k: torch.Tensor) -> torch.Tensor:  # [c * B, Tk, KVH, e]
            k = k.unflatten(0, (copies, -1)).transpose(2, 3)  # [c, B, KVH, Tk, e]
            return k[:, self.example, self.kv_head]

        return {self.q_name: q_rows, self.k_name: k_rows}

    def winners(self, got: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """[c, R] argmax key of every row in every copy."""
        q, k = got[self.q_name], got[self.k_name]
        scores = (k @ q[..., None]).squeeze(-1) * self.scale[:, None]  # [c, R, Tk]
        mask = self.attendable[:, : scores.shape[-1]]
        return scores.masked_fill(~mask, float("-inf")).argmax(-1)


def _winners(
    site: Site, part: EvalData, example: torch.Tensor, head: torch.Tensor, qpos: torch.Tensor,
    attendable: torch.Tensor,
) -> _PatternWinners | _RowWinners:
    """The cheaper reader for this site at this group's width: the pattern where the model
    computes it anyway (`attention.pattern_formed_anyway`), else the rows' q and k (so the
    model keeps SDPA or the kernel: `attention.kernel_by_default`)."""
    if pattern_formed_anyway(site.module.W_Q, part.lengths[site.kv_stream]):
        return _PatternWinners(site, example, head, qpos)
    return _RowWinners(site, example, head, qpos, attendable)


def _resamples(n: int, seed: int, n_boot: int = 1000) -> np.ndarray:
    """[n_boot, n] how often each of n examples (clusters) is drawn in each bootstrap resample.
    One set serves every sigma, so a sigma's CI does not depend on which sigmas came before it
    (it did while they drew from one stream in turn), and CIs across sigma are paired."""
    if n == 0:  # no examples: every CI is None (`_cluster_ci`)
        return np.zeros((n_boot, 0))
    rng = np.random.default_rng(seed)
    return rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot).astype(np.float64)


def _cluster_ci(flips: np.ndarray, counts: np.ndarray, w: np.ndarray,
                noisy: bool = True) -> list[float | None]:
    """95% percentile CI of sum(flips)/sum(counts) over the resamples `w` [n_boot, examples],
    widened to at least the Wilson interval over the row-draws where there is noise: a
    bootstrap of 0 flips, or of rows all in one example, has zero width ([0, 0] at sigma 0.01
    in every committed quick run), as if the rate were known exactly."""
    if counts.sum() == 0:
        return [None, None]
    num, den = w @ flips, w @ counts
    rates = num[den > 0] / den[den > 0]
    lo, hi = np.percentile(rates, [2.5, 97.5])
    if noisy:
        w_lo, w_hi = wilson_ci(float(flips.sum()), float(counts.sum()))
        lo, hi = min(lo, w_lo), max(hi, w_hi)
    return [float(lo), float(hi)]


def _check_noise_fits(pert: Perturbation, data: EvalData, n_draws: int) -> None:
    """A sigma's noise tables, every draw's, are drawn before its forwards (so an example's
    noise does not depend on its group): sized from one row's tables, n_draws too many for
    memory is refused by name, where 10**12 grew the process until the allocator or the
    kernel stopped it."""
    limit = memory_bytes()
    one = {id(t): t for t in pert.draw(0.0, 1, data.lengths, torch.Generator()).values()}
    need = 2 * n_draws * data.n_examples * sum(t.numel() * t.element_size() for t in one.values())
    if limit is not None and need > limit:  # 2: the draws, and their tables concatenated
        raise ValueError(f"n_draws: {n_draws} noise draws of {data.n_examples} examples need "
                         f"{format_bytes(need)} of noise tables, more than this machine's "
                         f"{format_bytes(limit)} of memory and swap; expected fewer draws "
                         "(or examples)")


def measure_collapse(
    model: Model,
    data: EvalData,
    *,
    sigmas: Sequence[float] = DEFAULT_SIGMAS,
    n_draws: int = 32,
    threshold: float = 0.9,
    mode: str = "token",
    targets: Sequence[str] | str = TARGETS,
    noise: str = "normal",
    sites: Sequence[str] | None = None,
    heads: Sequence[int] | None = None,
    seed: int = 0,
    theory_draws: int = 256,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    bucket: bool = True,
    rows: str = "all",
) -> dict[str, Any]:
    """Measured collapse rate per sigma with a 95% CI, per head, and the theory beside it.

    The batch is repeated along the batch dimension, one copy per noise draw, as many copies
    per forward as fit in `max_tokens` positions, each copy getting its own eps; the argmax
    key of every row is read off `hook_pattern` where the model computes the pattern anyway
    (`attention.pattern_formed_anyway`: short rows on CPU that `native.attention` does not
    take), else recomputed from its noisy q and k, so the layers keep SDPA or the kernel.
    With `bucket`, the examples are split into groups of similar length (`length_buckets`)
    and each group runs at its own width (and so with more copies per forward), so short
    problems do not pay for the longest one's padding; the eps of every (draw, example,
    position) and hence the counts are the same either way. sigma = 0 is run once (every
    draw would be identical). The noise is drawn `chunk` copies at a time (the copies that
    fit in `max_tokens`), so a seed gives the same eps, and the same counts, for the same
    `max_tokens` and data, not across them (the rates agree statistically; `analyze_run`
    keeps the default, and the result records it). Returns a JSON-ready dict; `rows` holds
    the per-row columns as tensors (pop it before writing JSON), with `rate` [R, n_sigmas]
    the per-row measured collapse frequency. `rows` picks the query rows that may be sparse
    (`find_sparse_rows`).
    """
    check_on_cpu(model)
    sigmas = check_sigmas(sigmas)
    n_draws = check_int(n_draws, "n_draws", low=1)
    theory_draws = check_int(theory_draws, "theory_draws", low=1)
    seed = check_seed(seed)
    max_tokens = check_int(max_tokens, "max_tokens", low=1)
    pert = Perturbation(model, mode=mode, targets=targets, noise=noise, sites=sites, heads=heads)
    if any(sigmas):
        _check_noise_fits(pert, data, n_draws)
    sparse = find_sparse_rows(model, data, threshold=threshold, sites=sites, heads=heads,
                              rows=rows)
    B, R = data.n_examples, len(sparse)
    by_site = {name: (sparse.site == i).nonzero().squeeze(1) for i, name in enumerate(sparse.sites)}
    flips = torch.zeros(R, len(sigmas), dtype=torch.float64)
    draws_used = []
    sweep_s, row_draws = 0.0, 0
    chunk = chunk_copies(data, max_tokens, n_draws)
    # one group: the batch as it is, no copy
    groups = sweep_groups(data, max_tokens, n_draws) if bucket else [torch.arange(B)]
    sites = {s.name: s for s in pert.all_sites}
    attendable = {name: torch.isfinite(t) for name, t in sparse.logits.items()}  # [R_site, K]
    parts = []  # (examples, their batch, {site: (row indices, their readers)}, copies)
    for g in groups:
        local = torch.full((B,), -1, dtype=torch.long)
        local[g] = torch.arange(len(g))
        sel = {name: idx[local[sparse.example[idx]] >= 0] for name, idx in by_site.items()}
        part = data if len(groups) == 1 else data.subset(g)
        # a site's rows are contiguous, so idx - its first row indexes its logits' rows
        sel = {name: (idx, _winners(sites[name], part, local[sparse.example[idx]],
                                    sparse.head[idx], sparse.qpos[idx],
                                    attendable[name][idx - by_site[name][0]]))
               for name, idx in sel.items() if idx.numel()}
        if sel:  # a short group fits more copies in one forward: fewer, fuller forwards
            parts.append((g, part, sel, chunk_copies(part, max_tokens, n_draws)))
    for si, sigma in enumerate(sigmas):
        gen = torch.Generator().manual_seed(seed)
        total = 1 if sigma == 0 else n_draws
        draws_used.append(total)
        t0 = time.perf_counter()
        # Every draw's eps, drawn `chunk` copies at a time over the whole batch (so the noise
        # an example gets does not depend on its group), then cut per group.
        drawn = [pert.draw(sigma, min(chunk, total - d) * B, data.lengths, gen)
                 for d in range(0, total, chunk)]
        merged: dict[int, torch.Tensor] = {}  # tables shared by several targets stay shared
        tables = {key: merged.setdefault(id(t), torch.cat([d[key] for d in drawn]))
                  for key, t in drawn[0].items()}
        for g, part, sel, group_chunk in parts:
            for done in range(0, total, group_chunk):
                c = min(group_chunk, total - done)
                pick = ((done + torch.arange(c))[:, None] * B + g[None, :]).flatten()  # copy-major
                picked: dict[int, torch.Tensor] = {}  # token mode shares k and v tables
                sub = {key: picked.setdefault(id(t), t[pick]) for key, t in tables.items()}
                take = {k: fn for _, w in sel.values() for k, fn in w.take(c).items()}
                grabbed = collect(model, part, take, hooks=pert.hooks(sub), copies=c)
                for idx, w in sel.values():
                    flips[idx, si] += (w.winners(grabbed) != sparse.key[idx]).sum(0).double()
        if sigma > 0:
            sweep_s += time.perf_counter() - t0
            row_draws += R * total
    draws = torch.tensor(draws_used, dtype=torch.float64)
    rate_rows = flips / draws
    resamples = _resamples(B, seed)
    ex = sparse.example.numpy()
    rows_per_example = np.bincount(ex, minlength=B).astype(np.float64)
    collapse_rate, ci = [], []
    for si in range(len(sigmas)):
        f_ex = np.bincount(ex, weights=flips[:, si].numpy(), minlength=B)
        c_ex = rows_per_example * draws_used[si]
        collapse_rate.append(float(f_ex.sum() / c_ex.sum()) if R else None)
        ci.append(_cluster_ci(f_ex, c_ex, resamples, noisy=sigmas[si] > 0))
    theory = _theory(sparse, [s.name for s in pert.all_sites], sigmas, noise, theory_draws, seed)
    per_head = []
    for (site_name, h), n_valid in sparse.valid_rows.items():
        sel = (sparse.site == sparse.sites.index(site_name)) & (sparse.head == h)
        n_sparse = int(sel.sum())
        entry = {
            "site": site_name, "head": h, "n_rows": n_valid, "n_sparse": n_sparse,
            "sparse_fraction": n_sparse / n_valid if n_valid else None,
            "mostly_sparse": bool(n_valid and n_sparse / n_valid >= 0.5),
            "sparse_counts_by_threshold": {str(t): v for t, v in
                                           sparse.counts[(site_name, h)].items()},
            "collapse_rate": ([float(v) for v in rate_rows[sel].mean(0)] if n_sparse
                              else [None] * len(sigmas)),
        }
        entry |= theory["per_head"].get((site_name, h), {
            "predicted_rate": [None] * len(sigmas), "predicted_union": [None] * len(sigmas),
            "predicted_pair_max": [None] * len(sigmas)})
        per_head.append(entry)
    per_site = []
    for si, name in enumerate(sparse.sites):
        sel = sparse.site == si
        n_valid = sum(v for (s, _), v in sparse.valid_rows.items() if s == name)
        per_site.append({"site": name, "n_rows": n_valid, "n_sparse": int(sel.sum()),
                         "collapse_rate": ([float(v) for v in rate_rows[sel].mean(0)]
                                           if bool(sel.any()) else [None] * len(sigmas))})
    thetas = sorted({t for c in sparse.counts.values() for t in c})
    n_valid_total = sum(sparse.valid_rows.values())
    return {
        "threshold": sparse.threshold,
        "noise": pert.noise,
        "mode": pert.mode,
        "targets": list(pert.targets),
        "sites": sparse.sites,
        "heads": pert.heads,
        "sigmas": sigmas,
        "collapse_rate": collapse_rate,
        "collapse_ci95": ci,
        "ci_method": CI_METHOD,
        "predicted_rate": theory["monte_carlo"],
        "predicted_rate_se": theory["monte_carlo_se"],
        "predicted_union": theory["union"],
        "predicted_pair_max": theory["pair_max"],
        "theory_draws": theory_draws,
        "n_sparse_rows": R,
        "n_rows": n_valid_total,
        "sparse_fraction": R / n_valid_total if n_valid_total else None,
        "n_draws": n_draws,
        "draws_per_sigma": draws_used,
        "max_tokens": max_tokens,  # with the seed, it fixes the noise (see the docstring)
        "n_examples": B,
        "sparse_counts_by_threshold": {
            str(t): sum(c[t] for c in sparse.counts.values()) for t in thetas},
        "mostly_sparse_heads": sum(e["mostly_sparse"] for e in per_head),
        "per_head": per_head,
        "per_site": per_site,
        "rows_per_s": row_draws / sweep_s if sweep_s > 0 else None,
        "sweep_seconds": sweep_s,
        "seed": seed,
        "theory_note": THEORY_NOTE,
        "rows": {"site": sparse.site, "head": sparse.head, "example": sparse.example,
                 "qpos": sparse.qpos, "key": sparse.key, "weight": sparse.weight,
                 "rate": rate_rows},
    }


THEORY_NOTE = (
    "predicted_*: theory.predict_collapse on the recorded unperturbed raw scores (scaled q.k, "
    "-inf masked) of the sparse rows, key-norm noise at the row's own layer only (monte_carlo = "
    "predicted_rate, union upper bound, pair_max lower bound; the bounds are None for uniform "
    "noise). Each (site, head) draws its own noise (group_seed), so predicted_rate_se, which "
    "adds the heads' variances, holds. The measurement perturbs all selected sites at once: "
    "noise from earlier layers propagates into this layer's logits and value noise changes "
    "later inputs, so measured rates may exceed the prediction; a query's factor 1 + eps < 0 "
    "(normal noise: probability Phi(-1/sigma); uniform: none for sigma <= 1) reverses its row, "
    "which the theory leaves out; targets without k have no direct effect in the theory."
)


def _theory(
    rows: SparseRows, all_sites: list[str], sigmas: list[float], noise: str, n_draws: int,
    seed: int,
) -> dict[str, Any]:
    """`predict_collapse` per (site, head) group, combined into row-weighted means.

    Each group draws its own noise (a seed of its own, from `seed`, the site's place among
    all of the model's sites, `all_sites`, and the head, so a head's prediction does not
    depend on which other sites were chosen, as its measured noise does not):
    with one seed for all, every group reused the others' draws, and the combined standard
    error, which adds the groups' variances as independent, came out too small by up to the
    square root of the number of groups. Within a group every σ reuses its seed, so
    `monte_carlo` stays monotone in σ.
    """
    S = len(sigmas)
    closed = noise == "normal"
    tot = {k: np.zeros(S) for k in ("monte_carlo", "union", "pair_max")}
    var = np.zeros(S)
    per_head = {}
    for si, name in enumerate(rows.sites):
        site_sel = rows.site == si
        for h in rows.head[site_sel].unique().tolist():
            sel = (rows.site == si) & (rows.head == h)
            logits = rows.logits[name][sel[site_sel]]
            p = predict_collapse(logits, sigmas, n_draws, noise=noise,
                                 seed=group_seed(seed, all_sites.index(name), h))
            n = p["n_rows"]
            per_head[(name, h)] = {
                "predicted_rate": p["monte_carlo"],
                "predicted_union": p["union"] if closed else [None] * S,
                "predicted_pair_max": p["pair_max"] if closed else [None] * S,
            }
            tot["monte_carlo"] += n * np.array(p["monte_carlo"])
            var += (n * np.array(p["monte_carlo_se"])) ** 2
            if closed:
                tot["union"] += n * np.array(p["union"])
                tot["pair_max"] += n * np.array(p["pair_max"])
    R = len(rows)
    out: dict[str, Any] = {"per_head": per_head}
    for k, v in tot.items():
        out[k] = [float(x) for x in v / R] if R and (closed or k == "monte_carlo") else (
            [None] * S)
    out["monte_carlo_se"] = [float(x) for x in np.sqrt(var) / R] if R else [None] * S
    return out


# --------------------------------------------------------------------------- accuracy


def perturbed_predictor(
    model: Model,
    task: ResolvedTask,
    perturbation: Perturbation,
    sigma: float,
    *,
    seed: int = 0,
    batch_size: int = 512,
) -> Callable[[list[str]], list[str]]:
    """A predictor for `normlab.evaluate.evaluate`: greedy answers under the perturbation.

    Decoding is uncached so every step recomputes all positions with the same pre-drawn eps
    (one draw per question); with sigma = 0 it returns the unperturbed greedy answers.
    """
    check_on_cpu(model)
    sigma = check_sigma(sigma)
    seed = check_seed(seed)
    arch = model.cfg.arch
    max_new = task.max_new()

    def predict(questions: list[str]) -> list[str]:
        gen = torch.Generator().manual_seed(seed)
        out: list[str] = []
        for i in range(0, len(questions), batch_size):
            prompts = make_prompts(questions[i:i + batch_size], arch)
            width = max(len(p) for p in prompts)
            if isinstance(model, EncoderDecoderLM):
                lengths = {"src": width, "tgt": max_new + 1}
            else:
                lengths = {"tokens": width + max_new}
            tables = perturbation.draw(sigma, len(prompts), lengths, gen)
            with model.hooks(perturbation.hooks(tables)):
                ids = greedy_decode(model, prompts, max_new=max_new, eos=EOS, use_cache=False,
                                    aux_fn=aux_positions if task.digit_positions else None,
                                    aux_next=next_aux_position if task.digit_positions else None)
            for row in ids:
                try:
                    out.append(parse_answer(row, task.answer_format))
                except ValueError:
                    out.append("?")
        return out

    return predict


def perturbed_accuracy(
    model: Model,
    task: ResolvedTask,
    sets: dict[str, dict[Cell, list[tuple[str, str]]]],
    *,
    sigmas: Sequence[float] = DEFAULT_SIGMAS,
    limit: int | None = None,
    mode: str = "token",
    targets: Sequence[str] | str = TARGETS,
    noise: str = "normal",
    sites: Sequence[str] | None = None,
    heads: Sequence[int] | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Exact-match accuracy (pooled over `sets`, and per split) at each sigma, plus unperturbed.

    `accuracy_unperturbed` comes from plain `evaluate` (cached decoding), an independent check
    that sigma = 0 reproduces it.
    """
    from normlab.evaluate import evaluate

    check_on_cpu(model)
    sigmas = check_sigmas(sigmas)
    seed = check_seed(seed)
    pert = Perturbation(model, mode=mode, targets=targets, noise=noise, sites=sites, heads=heads)

    def pooled(res: dict[str, Any]) -> float:
        n = sum(s["count"] for s in res["splits"].values())
        return sum(s["accuracy"] * s["count"] for s in res["splits"].values()) / max(n, 1)

    with evaluating(model):
        base = evaluate(model, task, sets, limit=limit)
        acc, per_split = [], []
        for sigma in sigmas:
            res = evaluate(model, task, sets, limit=limit,
                           predictor=perturbed_predictor(model, task, pert, sigma, seed=seed))
            acc.append(pooled(res))
            per_split.append({k: v["accuracy"] for k, v in res["splits"].items()})
    return {
        "accuracy": acc,
        "accuracy_by_split": per_split,
        "accuracy_unperturbed": pooled(base),
        "accuracy_unperturbed_by_split": {k: v["accuracy"] for k, v in base["splits"].items()},
        "accuracy_examples": sum(s["count"] for s in base["splits"].values()),
    }


# --------------------------------------------------------------------------- figure


def plot_collapse(result: dict[str, Any], path: Path, title: str = "") -> None:
    """Measured rate with its CI band and the predictions vs sigma; accuracy on a twin axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = np.array(result["sigmas"])

    def arr(key: str) -> np.ndarray:
        return np.array([np.nan if v is None else v for v in result.get(key) or []], dtype=float)

    fig, ax = plt.subplots(figsize=(6, 4))
    rate = arr("collapse_rate")
    if rate.size:
        lo = np.array([np.nan if c[0] is None else c[0] for c in result["collapse_ci95"]])
        hi = np.array([np.nan if c[1] is None else c[1] for c in result["collapse_ci95"]])
        ax.fill_between(s, lo, hi, color="tab:red", alpha=0.2, lw=0)
        ax.plot(s, rate, "o-", color="tab:red", label="measured collapse")
    for key, style, label in (("predicted_rate", "s--", "predicted (Monte Carlo)"),
                              ("predicted_union", ":", "union bound"),
                              ("predicted_pair_max", "-.", "pair max")):
        y = arr(key)
        if y.size and not np.all(np.isnan(y)):
            ax.plot(s, y, style, color="tab:blue", label=label, alpha=0.8)
    ax.set_xlabel("sigma (relative q/k/v norm noise)")
    ax.set_ylabel(f"collapse rate (sparse rows, theta={result['threshold']})")
    acc = arr("accuracy")
    if acc.size:
        ax2 = ax.twinx()
        ax2.plot(s, acc, "^-", color="tab:green", label="accuracy")
        ax2.set_ylabel("exact-match accuracy", color="tab:green")
        ax2.set_ylim(-0.02, 1.02)
        ax2.legend(loc="center right", fontsize=8)
    ax.legend(loc="upper left", fontsize=8)
    ax.set_title(title or f"circuit collapse ({result['mode']} mode, {result['noise']} noise, "
                          f"targets {''.join(result['targets'])})", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)
