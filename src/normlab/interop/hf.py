"""`from_hf`: a Hugging Face causal LM as a normlab `DecoderLM` with the same weights.

Each supported family is a config translation plus a weight mapping into the
TransformerLens layout; every architectural feature lives in the normlab model itself, so a
converted model has the same hooks as one normlab trained. Options a family supports but
normlab does not implement (RoPE scaling, sliding windows, ...) are refused, never ignored:
a silently wrong model is worse than none.
"""

from __future__ import annotations

import contextlib
import logging as std_logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from normlab.checks import first_line
from normlab.model import DecoderLM, ModelConfig, build_model

HF_ACT = {"gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu",
          "relu": "relu", "silu": "silu"}

StateDict = dict[str, torch.Tensor]


def context_length(c: Any) -> int:
    """Positions a Hugging Face config's model takes (`ModelConfig.max_len`): GPT-2 names
    them `n_positions`, the Llama family `max_position_embeddings`."""
    return int(c.n_positions if hasattr(c, "n_positions") else c.max_position_embeddings)


def _act(name: str, field: str) -> str:
    if name not in HF_ACT:
        raise ValueError(f"{field}: {name!r} is not supported; expected one of {sorted(HF_ACT)}")
    return HF_ACT[name]


def _check_tied(cfg: ModelConfig, sd: StateDict, embed: str) -> None:
    """A tied config whose lm_head is not the embedding is refused: a file holding its own
    lm_head is loaded untied by transformers with only a logged warning, and converted as tied
    it would unembed with the wrong matrix."""
    if (cfg.tie_embeddings and "lm_head.weight" in sd
            and not torch.equal(sd["lm_head.weight"], sd[embed])):
        raise ValueError(f"the config ties the embeddings (tie_word_embeddings), but the "
                         f"model's lm_head.weight is not its {embed}; expected a tied lm_head "
                         "or tie_word_embeddings = false")


def _heads_in(W: torch.Tensor, n: int, e: int) -> torch.Tensor:
    """nn.Linear weight [n * e, d] (y = x W^T) -> TransformerLens [n, d, e]."""
    return W.reshape(n, e, -1).transpose(1, 2)


# ---- GPT-2 ------------------------------------------------------------------------------------


def _gpt2_config(c: Any) -> ModelConfig:
    if getattr(c, "scale_attn_by_inverse_layer_idx", False) or not getattr(
        c, "scale_attn_weights", True
    ):
        raise ValueError(
            "scale_attn_by_inverse_layer_idx=True or scale_attn_weights=False is not supported; "
            "normlab scales attention by 1/sqrt(d_head)"
        )
    return ModelConfig(
        arch="decoder", vocab_size=c.vocab_size, d_model=c.n_embd, n_heads=c.n_head,
        n_layers=c.n_layer, d_mlp=c.n_inner or 4 * c.n_embd, max_len=context_length(c),
        pos_encoding="learned", norm_placement="pre", norm_type="layer",
        norm_eps=c.layer_norm_epsilon, attn_bias=True, mlp_bias=True,
        act=_act(c.activation_function, "activation_function"),
        # GPT-2 ties by default; an untied one has its own lm_head (reading wte was a wrong model)
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", True)),
    )


def _gpt2_weights(cfg: ModelConfig, sd: StateDict) -> StateDict:
    d, h, e = cfg.d_model, cfg.n_heads, cfg.d_head
    new: StateDict = {
        "embed.W_E": sd["transformer.wte.weight"],
        "pos_embed.W_pos": sd["transformer.wpe.weight"],
        "ln_final.w": sd["transformer.ln_f.weight"],
        "ln_final.b": sd["transformer.ln_f.bias"],
    }
    if not cfg.tie_embeddings:
        new["W_U"] = sd["lm_head.weight"].T
    for i in range(cfg.n_layers):
        src, dst = f"transformer.h.{i}.", f"blocks.{i}."
        W = sd[src + "attn.c_attn.weight"]  # Conv1D: [d, 3d]
        bias = sd[src + "attn.c_attn.bias"]
        for j, name in enumerate("QKV"):
            new[dst + f"attn.W_{name}"] = W[:, j * d:(j + 1) * d].reshape(d, h, e).permute(1, 0, 2)
            new[dst + f"attn.b_{name}"] = bias[j * d:(j + 1) * d].reshape(h, e)
        new[dst + "attn.W_O"] = sd[src + "attn.c_proj.weight"].reshape(h, e, d)
        new[dst + "attn.b_O"] = sd[src + "attn.c_proj.bias"]
        for k in ("1", "2"):
            new[dst + f"ln{k}.w"] = sd[src + f"ln_{k}.weight"]
            new[dst + f"ln{k}.b"] = sd[src + f"ln_{k}.bias"]
        new[dst + "mlp.W_in"] = sd[src + "mlp.c_fc.weight"]
        new[dst + "mlp.b_in"] = sd[src + "mlp.c_fc.bias"]
        new[dst + "mlp.W_out"] = sd[src + "mlp.c_proj.weight"]
        new[dst + "mlp.b_out"] = sd[src + "mlp.c_proj.bias"]
    return new


# ---- Llama / Qwen3 ----------------------------------------------------------------------------


def _rope_theta(c: Any) -> float:
    """Base of plain RoPE; any scaled variant is refused because normlab implements none.

    transformers 5 keeps everything in `rope_parameters`; 4.x used `rope_theta` plus an
    optional `rope_scaling` dict (`type` in old versions, `rope_type` in newer ones).
    """
    params = dict(getattr(c, "rope_scaling", None) or {})
    params.update(getattr(c, "rope_parameters", None) or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("per-layer-type rope_parameters are not supported")
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind != "default":
        raise ValueError(  # both names: transformers 5 saves rope_parameters, 4.x rope_scaling
            f"rope_parameters.rope_type (rope_scaling in transformers 4) {kind!r} is not "
            "supported; only plain RoPE (rope_type 'default') is implemented"
        )
    partial = params.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported; expected 1.0")
    return float(params.get("rope_theta", getattr(c, "rope_theta", 10000.0)))


def _llama_like_config(c: Any, *, qk_norm: bool) -> ModelConfig:
    """Pre-RMSNorm, RoPE, SwiGLU, GQA; Qwen3 adds per-head RMS QK-Norm before RoPE."""
    if getattr(c, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported (normlab has no gate bias)")
    windows = [t for t in (getattr(c, "layer_types", None) or []) if t != "full_attention"]
    if getattr(c, "use_sliding_window", False) or windows:
        raise ValueError("sliding-window attention is not supported")
    d, h = c.hidden_size, c.num_attention_heads
    return ModelConfig(
        arch="decoder", vocab_size=c.vocab_size, d_model=d, n_heads=h,
        n_kv_heads=getattr(c, "num_key_value_heads", None) or h,
        d_head=getattr(c, "head_dim", None) or (d // h if h else None),
        n_layers=c.num_hidden_layers, d_mlp=c.intermediate_size,
        max_len=context_length(c), pos_encoding="rope",
        rope_theta=_rope_theta(c), norm_placement="pre_qk" if qk_norm else "pre",
        norm_type="rms", norm_eps=c.rms_norm_eps, qkv_norm_scope="head", attn_scale="fixed",
        attn_bias=bool(getattr(c, "attention_bias", False)), mlp_bias=False,
        act=_act(c.hidden_act, "hidden_act"), mlp_type="gated",
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
    )


def _llama_like_weights(cfg: ModelConfig, sd: StateDict) -> StateDict:
    d, h, kvh, e = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_head
    new: StateDict = {"embed.W_E": sd["model.embed_tokens.weight"],
                      "ln_final.w": sd["model.norm.weight"]}
    if not cfg.tie_embeddings:
        new["W_U"] = sd["lm_head.weight"].T
    for i in range(cfg.n_layers):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        a = src + "self_attn."
        for name, n in (("q", h), ("k", kvh), ("v", kvh)):
            new[dst + f"attn.W_{name.upper()}"] = _heads_in(sd[a + f"{name}_proj.weight"], n, e)
            if cfg.attn_bias:
                new[dst + f"attn.b_{name.upper()}"] = sd[a + f"{name}_proj.bias"].reshape(n, e)
        new[dst + "attn.W_O"] = sd[a + "o_proj.weight"].T.reshape(h, e, d)
        if cfg.attn_bias:
            new[dst + "attn.b_O"] = sd[a + "o_proj.bias"]
        if cfg.norm_placement == "pre_qk":
            new[dst + "attn.q_norm.w"] = sd[a + "q_norm.weight"]
            new[dst + "attn.k_norm.w"] = sd[a + "k_norm.weight"]
        new[dst + "ln1.w"] = sd[src + "input_layernorm.weight"]
        new[dst + "ln2.w"] = sd[src + "post_attention_layernorm.weight"]
        new[dst + "mlp.W_gate"] = sd[src + "mlp.gate_proj.weight"].T
        new[dst + "mlp.W_in"] = sd[src + "mlp.up_proj.weight"].T
        new[dst + "mlp.W_out"] = sd[src + "mlp.down_proj.weight"].T
    return new


# ---- the families -----------------------------------------------------------------------------

_LLAMA_FIELDS = {"vocab_size": "vocab_size", "d_model": "hidden_size",
                 "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
                 "d_head": "head_dim", "n_layers": "num_hidden_layers",
                 "d_mlp": "intermediate_size", "max_len": "max_position_embeddings",
                 "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps"}


@dataclass(frozen=True)
class Converter:
    """One family: its config translation (which makes every refusal, so a folder is refused
    before its weights are read), its weight mapping into the TransformerLens layout, the name
    of its embedding (for the tie check), and its config's name for each ModelConfig field."""

    config: Callable[[Any], ModelConfig]
    weights: Callable[[ModelConfig, StateDict], StateDict]
    embed: str
    fields: dict[str, str]


CONVERTERS: dict[str, Converter] = {
    "GPT2LMHeadModel": Converter(
        _gpt2_config, _gpt2_weights, "transformer.wte.weight",
        {"vocab_size": "vocab_size", "d_model": "n_embd", "n_heads": "n_head",
         "n_layers": "n_layer", "d_mlp": "n_inner", "max_len": "n_positions",
         "norm_eps": "layer_norm_epsilon"}),
    "LlamaForCausalLM": Converter(partial(_llama_like_config, qk_norm=False),
                                  _llama_like_weights, "model.embed_tokens.weight", _LLAMA_FIELDS),
    "Qwen3ForCausalLM": Converter(partial(_llama_like_config, qk_norm=True),
                                  _llama_like_weights, "model.embed_tokens.weight", _LLAMA_FIELDS),
}


def _check_supported(name: str) -> Converter:
    if name not in CONVERTERS:
        raise ValueError(
            f"architecture {name!r} is not supported; expected one of {', '.join(CONVERTERS)}"
        )
    return CONVERTERS[name]


def hf_model_config(c: Any, name: str) -> ModelConfig:
    """The normlab config of a Hugging Face config `c` of causal-LM class `name`.

    Every refusal is made here, from the config alone, so that an unsupported model is refused
    before its weights are loaded; errors name the class and the Hugging Face field."""
    conv = _check_supported(name)
    try:
        return conv.config(c)
    except (ValueError, TypeError, AttributeError) as err:
        message = first_line(err)
        for ours, theirs in conv.fields.items():  # the field, and fields named in the text
            message = message.replace(f"ModelConfig.{ours}:", f"{theirs}:")
            message = re.sub(rf"\b{ours}=", f"{theirs}=", message)
        raise ValueError(f"{name}: {message}") from None


def from_hf(hf_model: Any) -> DecoderLM:
    """Convert a loaded Hugging Face causal LM into a float32, eval-mode model on the CPU.

    The weights are copied in float32 (so logits can be compared to 1e-4); `hf_model` itself
    is left untouched (dtype, device, mode).
    """
    name = type(hf_model).__name__
    _check_supported(name)  # a non-model (a dict) raised AttributeError on `.config`
    cfg = hf_model_config(hf_model.config, name)  # refused before any weight is copied
    state = hf_model.state_dict()
    # on the meta device (empty initialisation, offloading) there is nothing to copy: torch's
    # "Cannot copy out of meta tensor" traceback before
    if empty := [k for k, v in state.items() if v.is_meta]:
        raise ValueError(f"{name}: {empty[0]} ({len(empty)} tensors in all) is on the meta "
                         "device; expected a model with its weights loaded (not offloaded or "
                         "empty-initialised)")
    sd = {k: v.detach().to("cpu", torch.float32) for k, v in state.items()}
    conv = CONVERTERS[name]
    _check_tied(cfg, sd, conv.embed)
    model = build_model(cfg)
    assert isinstance(model, DecoderLM)
    with torch.no_grad():
        model.load_state_dict(conv.weights(cfg, sd), strict=True)
    return model.eval()


def require_transformers(what: str) -> None:
    """Hugging Face transformers is an optional dependency (`normlab[hf]`): without it, `what`
    is refused in one line, not with an import traceback."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ValueError(f"{what} needs Hugging Face transformers: pip install "
                         "'normlab[hf]'") from None


def check_hf_folder(folder: Path, name: str) -> None:
    """A local `save_pretrained` folder (one holding config.json), or one line saying what
    `folder` is instead, led by `name` (the option or function that was given it)."""
    if not (folder / "config.json").is_file():
        what = ("has no config.json" if folder.is_dir() else "is a file, not a folder"
                if folder.exists() else "does not exist")
        raise ValueError(f"{name} {str(folder)!r} {what}; expected a Hugging Face "
                         "save_pretrained folder")


#: Buffers older checkpoints saved beside the weights (a causal mask, RoPE's frequencies):
#: tensors the file holds and the model does not take that still leave nothing unloaded.
SAVED_BUFFERS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")  # not c_attn.bias


class _Kept(std_logging.Handler):
    """The messages transformers logs while it loads, held back instead of printed."""

    def __init__(self) -> None:
        super().__init__(std_logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: std_logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def flagged(self) -> str:
        """The load report's first row that flags a tensor, as " (row)"; "" if none."""
        flags = ("CONVERSION", "MISMATCH", "MISSING", "UNEXPECTED")
        rows = [" ".join(ln.replace("|", " ").split()) for m in self.messages
                for ln in m.splitlines() if any(f in ln for f in flags) and "|" in ln]
        return f" (transformers' report: {rows[0]})" if rows else ""


@contextlib.contextmanager
def held_logs() -> Iterator[_Kept]:
    """transformers' log lines held back, and its progress bar off, while it reads a folder:
    an error is then the only line on stderr, and it may quote what was held."""
    from transformers.utils import logging

    report = _Kept()
    bar = logging.is_progress_bar_enabled()
    # restored as found: a caller who had turned transformers' handler off got it back on
    root = logging.get_logger()
    handler = getattr(logging, "_default_handler", None)
    shown = handler is None or handler in root.handlers
    logging.disable_default_handler()
    logging.add_handler(report)
    logging.disable_progress_bar()
    try:
        yield report
    finally:
        logging.remove_handler(report)
        if shown:
            logging.enable_default_handler()
        if bar:
            logging.enable_progress_bar()


def read_hf_config(folder: Path, name: str) -> tuple[Any, str, ModelConfig, list[str]]:
    """A `save_pretrained` folder's config: as transformers reads it, the causal-LM class it
    loads as, and normlab's config of it, with every refusal made before a weight is read (a
    Llama 3.1 folder's RoPE scaling was refused only after all its weights had loaded); also
    the warnings transformers logged reading it, held for the caller to show. `name` (the
    option or function given `folder`) leads every error."""
    check_hf_folder(folder, name)
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig

    where = f"{name} {str(folder)!r}"
    try:
        # its warnings on a bad config (bos_token_id outside the vocabulary): shown only once
        # the analysis is about to run, else an error is the one line
        with held_logs() as report:
            config = AutoConfig.from_pretrained(folder, local_files_only=True)
    # transformers 5 checks a field's type with huggingface_hub's validation error, an
    # Exception (n_layer "two"), beside its own OSError, ValueError and KeyError
    except Exception as err:
        raise ValueError(f"{where}: cannot read config.json: {first_line(err)}") from err
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)].__name__
    except KeyError:  # a config with no causal LM (CLIP's): its own name
        cls = (config.architectures or [type(config).__name__])[0]
    try:
        cfg = hf_model_config(config, cls)
    except ValueError as err:
        raise ValueError(f"{where}: config.json: {err}") from None
    return config, cls, cfg, report.messages


def from_hf_pretrained(path: str | Path) -> DecoderLM:
    """Load a local `save_pretrained` folder (no hub access) and convert it with `from_hf`.

    Its config is read and translated first: a model normlab cannot convert is refused before
    its weights load. Every weight of the model must come from the folder: transformers fills
    a tensor the file lacks (a config of more layers than the file holds, a missing lm_head)
    with fresh random values and only logs a report, and ignores tensors the model does not
    take. Either is refused here, naming the first such tensor, as is a file that does not load
    at all."""
    require_transformers("from_hf_pretrained")
    folder = Path(path)
    read_hf_config(folder, "from_hf_pretrained: folder")
    from transformers import AutoModelForCausalLM

    where = f"Hugging Face folder {str(folder)!r}"
    with held_logs() as report:  # its load report, kept for the one-line error below
        try:
            # the saved dtype is kept here; from_hf upcasts to float32 (lossless from bf16/fp16)
            hf, info = AutoModelForCausalLM.from_pretrained(
                folder, local_files_only=True, output_loading_info=True,
                ignore_mismatched_sizes=True)
        # transformers' errors: a damaged safetensors header, a pickle it will not load, weights
        # it cannot convert ("look at the above report": its first flagged row is named)
        except Exception as err:
            raise ValueError(f"{where}: cannot load the model: {first_line(err)}"
                             + report.flagged()) from err
    unexpected = [k for k in info["unexpected_keys"] if not k.endswith(SAVED_BUFFERS)]
    for problem, keys in (("tensors the config asks for are missing from the weights",
                           [str(k) for k in info["missing_keys"]]),
                          ("tensors do not fit the config's shapes",
                           [f"{k} is {list(a)} in the file, {list(b)} by the config"
                            for k, a, b in info["mismatched_keys"]]),
                          ("the weights hold tensors the config's model does not take",
                           unexpected)):
        if keys:
            raise ValueError(f"{where}: {problem}: {sorted(keys)[0]} ({len(keys)} in all); "
                             "expected the weights its config.json was saved with")
    try:
        return from_hf(hf)
    except ValueError as err:  # the tie check, the one the weights make
        raise ValueError(f"{where}: {err}") from None
