"""Interop: Hugging Face models converted by `from_hf`, and a TransformerLens cross-check.

Every reference model is built locally from a tiny config (no hub access). Weights are
drawn with a large `initializer_range` so attention is far from uniform: a wrong RoPE base,
head layout or norm shows up as an O(1) logit error, not a 1e-6 one.

TransformerLens hooks whose meaning differs from ours (see docs/interop.md):
  - `ln*.hook_normalized`: TL fires before the gain and bias (x / scale); ours after.
  - `attn.hook_q` / `hook_k` with QK-Norm: TL fires before its q_norm/k_norm, ours after;
    TL's pre-norm value is our `attn.hook_q_pre_norm` / `hook_k_pre_norm`.
  - gated MLP `b_in`: TL adds it after the gate product, (act(x W_gate) * x W_in + b_in);
    ours (like HF's `up_proj` bias) inside, act(x W_gate) * (x W_in + b_in).
  - `attn.q_norm.hook_scale`: TL flattens to [batch * pos * head, 1]; ours is
    [batch, pos, head, 1].
  - TL's `from_pretrained` folds and centres LayerNorm weights by default (LayerNormPre),
    which changes `hook_scale` inputs and the residual stream; the reference models here are
    built from a `HookedTransformerConfig` directly, which does no such processing.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from normlab.model import DecoderLM, ModelConfig, build_model

if TYPE_CHECKING:
    from conftest import SdpaPast

transformers = pytest.importorskip("transformers")

from normlab.interop import from_hf, from_hf_pretrained  # noqa: E402

LOGIT_ATOL = 1e-4
SMALL = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=100, max_position_embeddings=64, initializer_range=0.2,
)


def _randomise_norms(hf: Any) -> Any:
    """HF initialises norm gains to 1 and biases to 0, which would hide a swapped mapping."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.startswith("transformer.ln") or ".ln_" in name:
                p.add_(0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(std=0.1)
    return hf.eval()


def _llama(**overrides: Any) -> Any:
    cfg = transformers.LlamaConfig(**{**SMALL, **overrides})
    return _randomise_norms(transformers.LlamaForCausalLM(cfg))


def _qwen3(**overrides: Any) -> Any:
    cfg = transformers.Qwen3Config(**{**SMALL, "head_dim": 24, **overrides})
    return _randomise_norms(transformers.Qwen3ForCausalLM(cfg))


def _gpt2(**overrides: Any) -> Any:
    cfg = transformers.GPT2Config(
        **{"n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 100, "n_positions": 32,
           "initializer_range": 0.2, "bos_token_id": 0, "eos_token_id": 0, **overrides}
    )
    return _randomise_norms(transformers.GPT2LMHeadModel(cfg))


def _check_parity(hf: Any, model: DecoderLM, sdpa_past: SdpaPast, n_layers: int = 2
                  ) -> dict[str, torch.Tensor]:
    """Logits to LOGIT_ATOL and each block's input residual equal to HF's hidden state, on the
    explicit path (hooked and not) and then, for the rest of the test, on SDPA's."""
    tokens = torch.randint(0, hf.config.vocab_size, (2, 24))
    with torch.no_grad():
        ref = hf(tokens, output_hidden_states=True)
        logits, cache = model.run_with_cache(tokens)  # explicit softmax path
        plain = model(tokens)  # no hook: explicit too at 24 keys on CPU (explicit_by_default)
        sdpa_past(0)
        fused = model(tokens)  # scaled_dot_product_attention path
    assert ref.logits.abs().max() > 1.0  # a non-trivial reference
    torch.testing.assert_close(logits, ref.logits, atol=LOGIT_ATOL, rtol=0)
    torch.testing.assert_close(plain, ref.logits, atol=LOGIT_ATOL, rtol=0)
    torch.testing.assert_close(fused, ref.logits, atol=LOGIT_ATOL, rtol=0)
    for layer in range(n_layers):
        torch.testing.assert_close(
            cache[f"blocks.{layer}.hook_resid_pre"], ref.hidden_states[layer], atol=1e-4, rtol=1e-5
        )
    pattern = cache["blocks.0.attn.hook_pattern"]
    torch.testing.assert_close(pattern.sum(-1), torch.ones(pattern.shape[:-1]))
    assert torch.all(pattern.triu(1) == 0)  # causal
    assert pattern[:, :, 4:].amax(-1).mean() > 0.2  # not uniform
    return cache


# ---- logits parity per family -------------------------------------------------------------


@pytest.mark.parametrize("tied", [True, False])
def test_gpt2_parity(tied: bool, sdpa_past: SdpaPast) -> None:
    """Untied too: its own lm_head, not wte (an untied GPT-2 converted with wte's logits)."""
    _check_parity(hf := _gpt2(tie_word_embeddings=tied), model := from_hf(hf), sdpa_past)
    assert model.cfg.tie_embeddings is tied


@pytest.mark.parametrize("act", ["gelu", "relu", "silu"])
def test_gpt2_parity_other_activations_eps_and_width(act: str, sdpa_past: SdpaPast) -> None:
    """`gelu` is erf's GELU, not gelu_new's tanh one (2e-3 apart in the logits, 20x the
    tolerance); a large eps and n_inner are read, not defaulted."""
    hf = _gpt2(activation_function=act, layer_norm_epsilon=0.05, n_inner=96)
    model = from_hf(hf)
    assert (model.cfg.norm_eps, model.cfg.d_mlp) == (0.05, 96)
    _check_parity(hf, model, sdpa_past)


@pytest.mark.parametrize(
    "overrides",
    [
        {"rope_theta": 500000.0},  # GQA, untied
        {"tie_word_embeddings": True, "attention_bias": True, "num_key_value_heads": 4,
         "head_dim": 24},
        # a large eps (logits ~10 off if the default were used) and erf's GELU in the gate
        {"rms_norm_eps": 0.05, "hidden_act": "gelu"},
    ],
    ids=["gqa-untied", "tied-bias-headdim", "eps-gelu"],
)
def test_llama_parity(overrides: dict[str, Any], sdpa_past: SdpaPast) -> None:
    hf = _llama(**overrides)
    model = from_hf(hf)
    c = model.cfg
    assert (c.norm_placement, c.norm_type, c.mlp_type, c.pos_encoding) == (
        "pre", "rms", "gated", "rope"
    )
    assert c.tie_embeddings == bool(overrides.get("tie_word_embeddings", False))
    assert c.n_kv_heads == overrides.get("num_key_value_heads", 2)
    assert c.rope_theta == overrides.get("rope_theta", 10000.0)
    _check_parity(hf, model, sdpa_past)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"head_dim": 16, "tie_word_embeddings": True, "attention_bias": True},
     {"rms_norm_eps": 0.05}],
    ids=["headdim24-untied", "tied-bias", "eps"],
)
def test_qwen3_parity(overrides: dict[str, Any], sdpa_past: SdpaPast) -> None:
    hf = _qwen3(**overrides)
    model = from_hf(hf)
    assert model.cfg.norm_placement == "pre_qk" and model.cfg.attn_scale == "fixed"
    assert model.cfg.d_head == overrides.get("head_dim", 24)  # not hidden_size / heads = 16
    cache = _check_parity(hf, model, sdpa_past)
    scale = cache["blocks.0.attn.q_norm.hook_scale"]  # RMS of each head's q, before RoPE
    assert scale.shape == (2, 24, 4, 1)
    pre = cache["blocks.0.attn.hook_q_pre_norm"]
    eps = overrides.get("rms_norm_eps", 1e-6)
    torch.testing.assert_close(scale, (pre.pow(2).mean(-1, keepdim=True) + eps).sqrt())
    assert "blocks.0.attn.k_norm.hook_scale" in cache and "blocks.0.attn.hook_rot_q" in cache


def test_left_padding_matches_on_real_tokens() -> None:
    """RoPE is relative, so our cumsum positions and HF's arange agree wherever it counts."""
    hf = _qwen3()
    model = from_hf(hf)
    tokens = torch.randint(0, 100, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, :3] = 0
    with torch.no_grad():
        ours = model(tokens, attention_mask=mask)
        ref = hf(tokens, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(ours[real], ref[real], atol=LOGIT_ATOL, rtol=0)


def test_from_hf_leaves_the_hf_model_alone() -> None:
    hf = _llama().to(torch.bfloat16)
    model = from_hf(hf)
    assert next(hf.parameters()).dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32 and not model.training


def test_from_hf_pretrained_roundtrip(tmp_path: Path, sdpa_past: SdpaPast) -> None:
    hf = _qwen3()
    hf.save_pretrained(tmp_path / "qwen3")
    model = from_hf_pretrained(tmp_path / "qwen3")
    _check_parity(hf, model, sdpa_past)


# ---- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(("make", "embed"), [(_gpt2, "transformer.wte.weight"),
                                             (_llama, "model.embed_tokens.weight")])
def test_a_tied_config_over_its_own_lm_head_is_refused(make: Callable[..., Any],
                                                       embed: str) -> None:
    """A config saying tie_word_embeddings over a file with an lm_head of its own: transformers
    loads it untied and only warns, and converted as tied it unembedded with the embedding."""
    hf = make(tie_word_embeddings=True)
    with torch.no_grad():
        hf.lm_head.weight = torch.nn.Parameter(hf.lm_head.weight + 0.1)  # no longer the same
    with pytest.raises(ValueError, match=rf"ties the embeddings \(tie_word_embeddings\), but "
                                         rf"the model's lm_head\.weight is not its {embed}"):
        from_hf(hf)
    hf.lm_head.weight = hf.get_input_embeddings().weight  # tied again
    assert from_hf(hf).cfg.tie_embeddings


def test_a_load_report_row_is_kept_for_the_error() -> None:
    """transformers' conversion errors say "look at the above report", which normlab holds
    back: its first flagged row goes into the one-line error instead."""
    import logging

    from normlab.interop.hf import _Kept

    kept = _Kept()
    assert kept.flagged() == ""
    table = ("GPT2LMHeadModel LOAD REPORT from: x\nKey | Status |\n----+----\n"
             "transformer.wte.weight | CONVERSION | dtype\nlm_head.weight | MISSING |")
    kept.emit(logging.LogRecord("transformers", logging.WARNING, "", 0, table, None, None))
    assert kept.flagged() == " (transformers' report: transformer.wte.weight CONVERSION dtype)"


def test_unsupported_architecture() -> None:
    cfg = transformers.Qwen2Config(**{**SMALL, "initializer_range": 0.02})
    with pytest.raises(ValueError, match=r"'Qwen2ForCausalLM' is not supported.*LlamaForCausal"):
        from_hf(transformers.Qwen2ForCausalLM(cfg))


@pytest.mark.parametrize("thing", [{"a": 1}, None, "gpt2"])
def test_something_not_a_model_is_refused_as_an_architecture(thing: Any) -> None:
    """`hf_model.config` was read before the class was checked: a dict raised
    "AttributeError: 'dict' object has no attribute 'config'"."""
    name = type(thing).__name__
    with pytest.raises(ValueError, match=rf"^architecture '{name}' is not supported; expected "
                                         r"one of GPT2LMHeadModel"):
        from_hf(thing)


def test_missing_or_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        from_hf_pretrained(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"has no config\.json"):
        from_hf_pretrained(tmp_path)
    (tmp_path / "model.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        from_hf_pretrained(tmp_path / "model.bin")


@pytest.mark.parametrize("kind", ["linear", "dynamic"])
def test_rope_scaling_refused(kind: str) -> None:
    hf = _llama(rope_scaling={"rope_type": kind, "factor": 2.0})
    with pytest.raises(ValueError, match=r"rope_parameters\.rope_type \(rope_scaling in "
                       rf"transformers 4\) '{kind}' is not supported"):
        from_hf(hf)


def _per_layer_rope() -> Any:
    c = transformers.LlamaConfig(**SMALL)
    c.rope_parameters = {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}
    return c


@pytest.mark.parametrize(("name", "config", "error"), [
    ("LlamaForCausalLM", lambda: transformers.LlamaConfig(**SMALL, mlp_bias=True),
     r"mlp_bias=True is not supported"),
    ("LlamaForCausalLM", lambda: transformers.LlamaConfig(**SMALL, rope_parameters={
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}),
     r"partial_rotary_factor=0\.5 is not supported"),
    ("LlamaForCausalLM", _per_layer_rope, r"per-layer-type rope_parameters are not supported"),
    ("Qwen3ForCausalLM", lambda: transformers.Qwen3Config(
        **SMALL, sliding_window=8, layer_types=["full_attention", "sliding_attention"]),
     r"sliding-window"),
    ("GPT2LMHeadModel", lambda: transformers.GPT2Config(scale_attn_by_inverse_layer_idx=True),
     r"scale_attn_by_inverse_layer_idx=True or scale_attn_weights=False is not supported"),
    ("GPT2LMHeadModel", lambda: transformers.GPT2Config(scale_attn_weights=False),
     r"scale_attn_by_inverse_layer_idx=True or scale_attn_weights=False is not supported"),
], ids=["mlp_bias", "partial_rotary", "per_layer_rope", "qwen3_layer_types",
        "gpt2_inverse_layer_idx", "gpt2_unscaled"])
def test_a_feature_normlab_lacks_is_refused_from_the_config(name: str, config: Callable[[], Any],
                                                            error: str) -> None:
    """Each of these changes the model's math; converted without it, the model would be
    silently wrong (a gate bias dropped, a window ignored). Qwen3's sliding layers named only
    in layer_types, with use_sliding_window off, are refused too."""
    from normlab.interop.hf import hf_model_config

    with pytest.raises(ValueError, match=rf"^{name}: .*{error}"):
        hf_model_config(config(), name)


def test_weights_on_the_meta_device_are_refused() -> None:
    """An empty-initialised or offloaded model has no data to copy: one line, not torch's
    "Cannot copy out of meta tensor" traceback."""
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    with pytest.raises(ValueError, match=r"^LlamaForCausalLM: model\.embed_tokens\.weight "
                       r"\(\d+ tensors in all\) is on the meta device; expected a model with "
                       r"its weights loaded"):
        from_hf(hf)


def test_loading_leaves_transformers_logging_as_it_was(tmp_path: Path) -> None:
    """Its log lines are held back while a folder loads, and its handler then restored as the
    caller had it: one turned off was turned back on."""
    from transformers.utils import logging as tlog

    from normlab.interop.hf import read_hf_config

    _gpt2().save_pretrained(tmp_path / "g")
    root = tlog.get_logger()
    try:
        for on in (False, True):
            # (from_hf_pretrained holds the logs twice: a restore inverted would cancel out)
            for load in (lambda: from_hf_pretrained(tmp_path / "g"),
                         lambda: read_hf_config(tmp_path / "g", "folder")):
                (tlog.enable_default_handler if on else tlog.disable_default_handler)()
                load()
                assert (tlog._default_handler in root.handlers) is on
    finally:
        tlog.enable_default_handler()


def test_sliding_window_refused() -> None:
    hf = _qwen3(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    with pytest.raises(ValueError, match="sliding-window"):
        from_hf(hf)


# ---- TransformerLens cross-check ------------------------------------------------------------


def _tl_pair(
    tl_cfg: dict[str, Any],
    ours: ModelConfig,
    rename: Callable[[str], str] = lambda k: k,
    zero: tuple[str, ...] = ("unembed.b_U",),
) -> tuple[Any, DecoderLM]:
    """A random HookedTransformer and a normlab model holding the same weights.

    The TL layout is ours, so the copy is a key rename (plus W_U, which TL keeps in
    `unembed`). Parameters ending in `zero` stay zero: TL's unembedding bias, which normlab
    does not have, and any bias whose meaning differs.
    """
    tl = pytest.importorskip("transformer_lens")
    torch.manual_seed(1)
    ref = tl.HookedTransformer(tl.HookedTransformerConfig(**tl_cfg)).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(zero):
                p.zero_()
            elif name.endswith(".w"):  # norm gains
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.split(".")[-1].startswith(("b_", "_b_")):
                p.normal_(std=0.1)
            else:
                p.normal_(std=0.3)
    model = build_model(ours)
    sd = {rename(k): v for k, v in ref.state_dict().items()
          if not k.endswith((".mask", ".IGNORE", ".rotary_sin", ".rotary_cos", "unembed.b_U"))}
    sd["W_U"] = sd.pop("unembed.W_U")
    model.load_state_dict(sd, strict=True)
    return ref, model.eval()


def _compare_hooks(
    ref: Any, model: DecoderLM, names: list[str], vocab: int
) -> tuple[dict[str, torch.Tensor], Any]:
    """Logits and the listed hooks (same meaning in both libraries) agree."""
    tokens = torch.randint(0, vocab, (2, 12))
    with torch.no_grad():
        ref_logits, ref_cache = ref.run_with_cache(tokens)
        logits, cache = model.run_with_cache(tokens)
    torch.testing.assert_close(logits, ref_logits, atol=LOGIT_ATOL, rtol=0)
    for name in names:
        torch.testing.assert_close(cache[name], ref_cache[name], atol=1e-5, rtol=1e-5, msg=name)
    assert cache["blocks.0.attn.hook_pattern"][:, :, 3:].amax(-1).mean() > 0.2
    return cache, ref_cache


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_transformer_lens_gpt2_style() -> None:
    d, h, layers, vocab, n_ctx = 32, 4, 2, 50, 16
    ref, model = _tl_pair(
        dict(n_layers=layers, d_model=d, n_ctx=n_ctx, d_head=d // h, n_heads=h, d_mlp=4 * d,
             d_vocab=vocab, act_fn="gelu_new", normalization_type="LN",
             positional_embedding_type="standard"),
        ModelConfig(vocab_size=vocab, d_model=d, n_heads=h, n_layers=layers, d_mlp=4 * d,
                    max_len=n_ctx, pos_encoding="learned", norm_placement="pre",
                    norm_type="layer", attn_bias=True, mlp_bias=True, act="gelu_tanh"),
    )
    names = ["hook_embed", "hook_pos_embed", "ln_final.hook_scale"]
    for i in range(layers):
        names += [f"blocks.{i}.{n}" for n in (
            "ln1.hook_scale", "ln2.hook_scale", "attn.hook_q", "attn.hook_k", "attn.hook_v",
            "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z", "hook_resid_mid",
            "mlp.hook_pre", "mlp.hook_post", "hook_resid_post")]
    cache, ref_cache = _compare_hooks(ref, model, names, vocab)
    # hook_normalized: TL's is before the gain and bias, ours after
    ln = model.blocks[0].ln1
    torch.testing.assert_close(
        cache["blocks.0.ln1.hook_normalized"],
        ref_cache["blocks.0.ln1.hook_normalized"] * ln.w + ln.b, atol=1e-5, rtol=1e-5,
    )


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_transformer_lens_qwen3_style() -> None:
    """RMSNorm, RoPE (rotate-half), SwiGLU, GQA and per-head QK-Norm: the Qwen3 recipe."""
    d, h, kvh, e, layers, vocab, n_ctx = 32, 4, 2, 16, 2, 50, 16
    ref, model = _tl_pair(
        dict(n_layers=layers, d_model=d, n_ctx=n_ctx, d_head=e, n_heads=h, n_key_value_heads=kvh,
             d_mlp=64, d_vocab=vocab, act_fn="silu", gated_mlp=True, normalization_type="RMS",
             final_rms=True, positional_embedding_type="rotary", rotary_dim=e,
             rotary_base=10000, use_qk_norm=True, eps=1e-6),
        ModelConfig(vocab_size=vocab, d_model=d, n_heads=h, n_kv_heads=kvh, d_head=e,
                    n_layers=layers, d_mlp=64, max_len=n_ctx, pos_encoding="rope",
                    norm_placement="pre_qk", norm_type="rms", norm_eps=1e-6, attn_scale="fixed",
                    act="silu", mlp_type="gated", attn_bias=True, mlp_bias=True),
        rename=lambda k: k.replace("attn._", "attn."),
        zero=("unembed.b_U", "mlp.b_in"),  # TL adds a gated b_in after the gate product
    )
    names = ["ln_final.hook_scale"]
    for i in range(layers):
        names += [f"blocks.{i}.{n}" for n in (
            "ln1.hook_scale", "ln2.hook_scale", "attn.hook_rot_q", "attn.hook_rot_k",
            "attn.hook_v", "attn.hook_pattern", "attn.hook_z", "mlp.hook_pre",
            "mlp.hook_pre_linear", "hook_resid_post")]
    cache, ref_cache = _compare_hooks(ref, model, names, vocab)
    # TL's hook_q is our hook_q_pre_norm; its q_norm.hook_scale is flattened over heads
    torch.testing.assert_close(cache["blocks.0.attn.hook_q_pre_norm"],
                               ref_cache["blocks.0.attn.hook_q"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache["blocks.0.attn.q_norm.hook_scale"].reshape(-1, 1),
                               ref_cache["blocks.0.attn.q_norm.hook_scale"], atol=1e-5, rtol=1e-5)

