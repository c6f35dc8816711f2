"""H1, norm spread: how far the scale each normalisation divides by strays from its typical value.

Subspace interference (PAPER.md section 3) needs the divisor of N(.) to vary across tokens;
if every token had the same norm, a Pre-Norm would be a constant factor and harmless. So at every
normalisation input (every `*.hook_scale`: ln1, ln2, ln_cross, ln_final and, under qk/qkv/pre_qk,
the per-head q/k/v norms, one entry per head) we take the scale over the real tokens of the eval
batch, divide by that layer's (and head's) median, and summarise the ratio per token class.
`h90` is the smallest symmetric half-width with at least 90% of ratios in [1 - h90, 1 + h90]:
the number to set beside the paper's "about ±20% for 90% of embeddings".

`hook_scale` is sqrt(mean(x_c^2) + eps) = ||x_c|| / sqrt(d) (x_c centred for LayerNorm, raw
for RMSNorm), so the ratio is that of L2 norms up to the tiny eps. For reference (e.g. under
`none`, which has no norms) the centred norm of every block's `hook_resid_pre` is summarised
too, as `kind: "resid"`: what a Pre-LayerNorm placed there would divide by.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from normlab.analysis.data import EvalData, evaluating, model_kwargs, stream_of
from normlab.checks import check_on_cpu
from normlab.io import save_figure
from normlab.model import Model

PERCENTILES = (5.0, 95.0)


def _norm_hooks(model: Model) -> list[str]:
    return [n for n in model.hook_names() if n.endswith(".hook_scale")]


def _resid_hooks(model: Model) -> list[str]:
    return [n for n in model.hook_names() if n.endswith(".hook_resid_pre")]


def norm_scales(
    model: Model, data: EvalData, names: Sequence[str] | None = None, *, resid: bool = True
) -> dict[str, dict[str, Any]]:
    """Per hook: `scale` [B, T] or [B, T, H] (head norms), its `stream` and `kind`.

    `names` restricts the `hook_scale` hooks (unknown names raise a one-line ValueError);
    `resid` adds the centred RMS of every `hook_resid_pre` (kind `resid`).
    """
    check_on_cpu(model)
    data.check_model(model)
    norm_names = _norm_hooks(model)
    if names is not None:
        names = [names] if isinstance(names, str) else list(names)
        for n in names:
            if n not in norm_names:
                raise ValueError(f"unknown norm hook {n!r}; expected one of "
                                 f"{', '.join(norm_names) or '(none: this model has no norms)'}")
        norm_names = names
    wanted = norm_names + (_resid_hooks(model) if resid else [])
    with evaluating(model):
        _, cache = model.run_with_cache(**_kwargs(data), names_filter=wanted)
    out: dict[str, dict[str, Any]] = {}
    for name in wanted:
        t = cache[name].float()
        if name.endswith(".hook_resid_pre"):
            xc = t - t.mean(-1, keepdim=True)
            scale, kind = xc.pow(2).mean(-1).sqrt(), "resid"
        else:
            scale, kind = t.squeeze(-1), "norm"
        real = data.valid[stream_of(name)]
        bad = ~torch.isfinite(scale) & (real if scale.dim() == 2 else real[..., None])
        if bad.any():  # else NaN statistics beside real-looking within_10/20, exit 0
            raise ValueError(f"{name}: {int(bad.sum())} scales of real tokens are not finite; "
                             "the model gives non-finite activations on this data")
        out[name] = {"scale": scale, "stream": stream_of(name), "kind": kind}
    return out


def _kwargs(data: EvalData) -> dict[str, Any]:
    """run_with_cache arguments for a teacher-forced batch (same call as `EvalData.forward`)."""
    return model_kwargs(data.arch, data.inputs)


def spread_stats(ratio: np.ndarray) -> dict[str, Any]:
    """Median, 5th/95th percentiles, fraction within ±10%/±20% and h90 of ratios to a median."""
    if ratio.size == 0:
        return {"n": 0, "median": None, "p5": None, "p95": None, "within_10": None,
                "within_20": None, "h90": None}
    dev = np.abs(ratio - 1.0)
    p5, p95 = np.percentile(ratio, PERCENTILES)
    return {
        "n": int(ratio.size),
        "median": float(np.median(ratio)),
        "p5": float(p5),
        "p95": float(p95),
        "within_10": float(np.mean(dev <= 0.1)),
        "within_20": float(np.mean(dev <= 0.2)),
        # the smallest h holding >= 90%: order statistic ceil(0.9 n), 1-based ("higher" took
        # ceil(0.9 (n - 1)) + 1, one too many where 0.9 n is whole or its fraction above 0.9)
        "h90": float(np.quantile(dev, 0.9, method="inverted_cdf")),
    }


def h90_var(ratio: np.ndarray, example: np.ndarray) -> float | None:
    """The sampling variance of `ratio`'s h90 over the examples it comes from (`example`: one
    id per ratio); None under two examples.

    A question's tokens move together, so thousands of ratios from a few hundred questions
    still leave h90 uncertain (tests/test_norms.py sets it beside a bootstrap over examples):
    Woodruff's interval for a quantile, the fraction within h90 with a variance robust to
    clusters (a ratio estimator's, over examples), carried through the empirical quantile
    function; the medians are taken as known, so this is a floor (H1's, in the report)."""
    dev = np.abs(np.asarray(ratio, dtype=np.float64) - 1.0)
    ids, inv = np.unique(example, return_inverse=True)
    if dev.size == 0 or len(ids) < 2:
        return None
    h = np.quantile(dev, 0.9, method="inverted_cdf")
    n_e, a_e = np.bincount(inv), np.bincount(inv, weights=dev <= h)
    frac = a_e.sum() / n_e.sum()
    var = len(ids) / (len(ids) - 1) * np.sum((a_e - frac * n_e) ** 2) / n_e.sum() ** 2
    z = 1.959963984540054
    lo, hi = (np.quantile(dev, min(max(0.9 + sign * z * np.sqrt(var), 0.0), 1.0),
                          method="inverted_cdf") for sign in (-1, 1))
    return float(((hi - lo) / (2 * z)) ** 2)


def norm_ratios(
    model: Model, data: EvalData, names: Sequence[str] | None = None, *, resid: bool = True
) -> list[dict[str, Any]]:
    """Ratios scale / median per hook (and head), over real tokens only.

    Each item: `hook`, `head` (None for a whole-vector norm), `kind`, `stream`, `median_scale`,
    `ratio` (float64 numpy, one per real token), `cls` (class index per ratio) and `example`
    (the example each ratio comes from).
    """
    items = []
    for name, info in norm_scales(model, data, names, resid=resid).items():
        stream = info["stream"]
        valid, classes = data.valid[stream], data.classes[stream]
        example = valid.nonzero()[:, 0].numpy()  # boolean indexing's row-major order
        scale = info["scale"]
        per_head = scale.dim() == 3
        heads = range(scale.shape[-1]) if per_head else [None]
        for h in heads:
            s = (scale[..., h] if per_head else scale)[valid].double().numpy()
            med = float(np.median(s)) if s.size else float("nan")
            items.append({"hook": name, "head": h, "kind": info["kind"], "stream": stream,
                          "median_scale": med, "ratio": s / med,
                          "cls": classes[valid].numpy(), "example": example})
    return items


def norm_spread(
    model: Model, data: EvalData, names: Sequence[str] | None = None, *, resid: bool = True
) -> dict[str, Any]:
    """JSON-ready summary: one entry per (hook, head) with `all` and per-class statistics.

    `summary` pools the ratios of every `kind: "norm"` entry (each already relative to its own
    median), so its `h90` is the model-wide figure to compare with the paper's ±20%.
    """
    entries, pooled, examples = [], {"all": []}, []
    for item in norm_ratios(model, data, names, resid=resid):
        by_class = {"all": spread_stats(item["ratio"])}
        for ci, cname in enumerate(data.class_names):
            sel = item["ratio"][item["cls"] == ci]
            if sel.size:
                by_class[cname] = spread_stats(sel)
                if item["kind"] == "norm":
                    pooled.setdefault(cname, []).append(sel)
        if item["kind"] == "norm":
            pooled["all"].append(item["ratio"])
            examples.append(item["example"])
        entries.append({k: item[k] for k in ("hook", "head", "kind", "stream", "median_scale")}
                       | {"classes": by_class})
    summary = {c: spread_stats(np.concatenate(v)) if v else spread_stats(np.zeros(0))
               for c, v in pooled.items()}
    summary["all"]["h90_var"] = (h90_var(np.concatenate(pooled["all"]), np.concatenate(examples))
                                 if examples else None)
    return {
        "classes": list(data.class_names),
        "percentiles": list(PERCENTILES),
        "n_examples": data.n_examples,
        "entries": entries,
        "summary": summary,
        "note": "ratio = hook_scale / median of that hook (and head) over real tokens of the "
                "teacher-forced eval batch; h90: the smallest h with at least 90% of ratios "
                "in [1-h, 1+h] (numpy quantile of |ratio - 1|, method inverted_cdf); "
                "summary.all.h90_var: its variance over examples (Woodruff, clusters). "
                "kind 'resid' = centred RMS of hook_resid_pre (reference, not a norm input).",
    }


def plot_norm_spread(result: dict[str, Any], path: Path, title: str = "") -> None:
    """Per-entry 5-95% ratio bars with the median, one panel per token class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    entries = [e for e in result["entries"] if e["kind"] == "norm"] or result["entries"]
    panels = ["all", *result["classes"]]
    fig, axes = plt.subplots(len(panels), 1, figsize=(max(6.0, 0.32 * len(entries) + 2), 2.4
                                                       * len(panels)), squeeze=False)
    labels = [_short(e) for e in entries]
    for ax, cname in zip(axes[:, 0], panels, strict=True):
        xs = np.arange(len(entries))
        for x, e in zip(xs, entries, strict=True):
            st = e["classes"].get(cname)
            if not st or st["n"] == 0:
                continue
            ax.plot([x, x], [st["p5"], st["p95"]], color="tab:blue", lw=4, alpha=0.6)
            ax.plot([x], [st["median"]], "o", color="black", ms=3)
        for y in (0.8, 1.0, 1.2):
            ax.axhline(y, color="grey", lw=0.8, ls="-" if y == 1.0 else "--")
        ax.set_ylabel(f"{cname}\nscale / median")
        ax.set_xticks(xs, labels, rotation=90, fontsize=6)
    axes[0, 0].set_title(title or "norm spread: 5-95% of scale / layer median (dashed: ±20%)",
                         fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)


def _short(entry: dict[str, Any]) -> str:
    name = entry["hook"].removesuffix(".hook_scale").removesuffix(".hook_resid_pre")
    name = name.replace("blocks.", "").replace("encoder.", "enc.").replace("decoder.", "dec.")
    return name + ("" if entry["head"] is None else f".h{entry['head']}")
