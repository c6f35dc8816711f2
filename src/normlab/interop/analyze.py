"""`analyze_hf`: norm spread and circuit collapse of a local Hugging Face causal LM.

The same measurements `analyze_run` makes on a normlab run, on a `save_pretrained` folder
converted with `from_hf_pretrained`. The input is either a file of whitespace-separated token
ids or a text file tokenised with the folder's own tokenizer; the ids are cut into rows of
`seq_len` (the last row right-padded and masked out, which a causal model never attends to).
There is no task, so there is no accuracy under noise: `collapse.json` says so.

Files in `out`: `norms.json` + `norms.png`, `collapse.json` + `collapse.png` and
`collapse_rows.npz`, with the schema of `analyze_run`, plus `hf` (class, config, weight
hashes) and `input` (file, hash, token counts). The unembedding is skipped while measuring:
no analysis reads the logits, and at a 50k-150k vocabulary they would dominate time and memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import re
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from normlab.analysis.collapse import (
    DEFAULT_MAX_TOKENS,
    DEFAULT_SIGMAS,
    MODES,
    NOISES,
    _check_choice,
    check_targets,
    check_threshold,
)
from normlab.analysis.data import EvalData
from normlab.analysis.report import measure_norms_and_collapse, write_analysis
from normlab.checks import check_int, check_seed, check_sigmas, first_line
from normlab.interop.hf import (
    context_length,
    from_hf_pretrained,
    read_hf_config,
    require_transformers,
)
from normlab.io import check_out_folder, provenance, refuse_overwrite, written_together
from normlab.model import DecoderLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt", "spiece.model")
"""Any of these in the folder means a tokenizer was saved there (transformers 5 otherwise
returns an empty tokenizer instead of failing). Not that it has a vocabulary: the tokenizer
loaded says that by its size (`_tokenize`), as a vocabulary file may have any name its class
reads (XLM-R's sentencepiece.bpe.model, DeBERTa's spm.model, ...), vouched for by
tokenizer_config.json alone."""

RESULTS = ("norms.json", "collapse.json")
"""The result files `analyze_hf` writes into `out`: they mark an earlier analysis, which --force
replaces (a figure or collapse_rows.npz without them is a killed command's, replaced: README)."""

ID = re.compile(r"-?[0-9]+")
"""A token id in a --tokens file (a negative one is then named as outside the vocabulary)."""

TEXT_CHUNK = 1 << 16
"""Characters of a --text file tokenised first (doubled until they give enough tokens)."""

CUT_MARGIN = 64
"""Tokens a prefix of a --text file must give past those used: the cut's own are dropped."""

SCORE_BUDGET = 1 << 27
"""Attention-score floats per layer in one perturbed forward (512 MiB); bounds the chunking."""

ACCURACY_NOTE = ("no task: a Hugging Face model analysed on free-form tokens has no exact-match "
                 "answer, so accuracy under noise is not measured (None)")


def analyze_hf(
    folder: Path,
    *,
    tokens: str | Path | None = None,
    text: str | Path | None = None,
    out: Path | None = None,
    sigmas: Sequence[float] = DEFAULT_SIGMAS,
    n_draws: int = 32,
    threshold: float = 0.9,
    mode: str = "token",
    targets: Sequence[str] | str = ("q", "k", "v"),
    noise: str = "normal",
    n_examples: int = 32,
    seed: int = 0,
    seq_len: int = 128,
    figures: bool = True,
    overwrite: bool = True,
) -> dict[str, Any]:
    """Norm spread and collapse of the HF model in `folder` on the `tokens` or `text` file.

    `n_examples` is the number of rows of `seq_len` tokens analysed (the first ones; fewer if
    the input is shorter). Every bad input is a one-line ValueError, raised before the model is
    loaded where possible. `overwrite=False` (the CLI without --force) refuses an `out` holding
    the JSON files the analysis writes, once the inputs have passed their checks (other files
    there are never touched). Returns both JSON documents plus `out`, `files` and `seconds`.
    """
    require_transformers("analyze --hf")
    sigmas = check_sigmas(sigmas)
    threshold = check_threshold(threshold)
    targets = check_targets(targets)
    seed = check_seed(seed)
    _check_choice(mode, MODES, "mode")
    _check_choice(noise, NOISES, "noise")
    n_draws = check_int(n_draws, "n_draws", low=1)
    n_examples = check_int(n_examples, "n_examples", low=1)
    seq_len = check_int(seq_len, "seq_len", low=2,
                        what="an int >= 2 (a query with a key before it)")
    if out is None:
        raise ValueError("analyze --hf: --out OUT (the output folder) is required")
    if (tokens is None) == (text is None):
        raise ValueError("analyze --hf: give exactly one of --tokens FILE or --text FILE")
    folder, out = Path(folder), check_out_folder(out)
    kind, path = ("tokens", Path(tokens)) if tokens is not None else ("text", Path(text))
    seconds: dict[str, float] = {}

    # --out locked first (a second analysis into it refused before it loads anything); the
    # files land together once all are made (collapse.json last): a failure or kill part way
    # leaves the folder as it was, not half new
    with written_together(out, "collapse.json") as stage:
        t0 = time.perf_counter()
        config, hf_class, _, held = read_hf_config(folder, "--hf folder")
        if not path.is_file():  # /dev/null or a pipe exists, and is not a file to read twice
            what = ("is a folder, not a file" if path.is_dir() else "does not exist"
                    if not path.exists() else "is not a regular file")
            raise ValueError(f"--{kind} file {str(path)!r} {what}")
        vocab = int(config.vocab_size)
        if kind == "tokens":
            ids, tok_name, whole = _read_token_ids(path), None, True
        else:
            ids, tok_name, whole = _tokenize(folder, path, n_examples * seq_len)
        _check_vocab(ids, vocab, path, folder)
        if len(ids) < 2:  # norms of one token read as no spread at all; nothing could collapse
            raise ValueError(f"--{kind} file {str(path)!r} gives 1 token; the analysis needs at "
                             "least 2 (a query with a key before it)")
        data, n_used = _rows(ids, seq_len, n_examples)
        context = context_length(config)  # before the weights load (transformers prints as it does)
        if data.lengths["tokens"] > context:
            raise ValueError(f"rows of {data.lengths['tokens']} tokens exceed the model's context "
                             f"of {context} positions; lower seq_len (--seq-len)")
        # after the input checks (checked first, earlier results hid a bad input until --force
        # was given), and the names written only (any *.json was refused, never overwritten)
        refuse_overwrite(out, RESULTS, overwrite)
        for message in held:  # transformers' warnings on the config, once nothing else is refused
            print(f"transformers: {message}", file=sys.stderr)
        model = from_hf_pretrained(folder)
        seconds["load"] = time.perf_counter() - t0

        max_tokens = max(1, min(DEFAULT_MAX_TOKENS,
                                SCORE_BUDGET // (model.cfg.n_heads * data.lengths["tokens"])))
        params = {"sigmas": sigmas, "n_draws": n_draws, "threshold": threshold, "mode": mode,
                  "targets": list(targets), "noise": noise, "n_examples": n_examples,
                  "n_examples_used": data.n_examples, "seq_len": seq_len,
                  "max_tokens": max_tokens, "unembedding": "skipped (logits are not used)"}
        common = {
            "hf_dir": str(folder),
            "hf": _hf_meta(folder, config, hf_class),
            "input": {"kind": kind, "file": str(path), "sha256": _sha256(path),
                      "tokenizer": tok_name, "whole_file": whole, "n_tokens": len(ids),
                      "n_tokens_used": n_used,
                      "n_rows": data.n_examples, "row_length": data.lengths["tokens"]},
            "seed": seed,
            "params": params,
            "config": model.cfg.to_dict(),
        }
        with _skip_unembed(model):
            norms, collapse, rows = measure_norms_and_collapse(
                model, data, common, seconds, "collapse", sigmas=sigmas, n_draws=n_draws,
                threshold=threshold, mode=mode, targets=targets, noise=noise, seed=seed,
                max_tokens=max_tokens)
        collapse |= {"accuracy": None, "accuracy_by_split": None, "accuracy_unperturbed": None,
                     "accuracy_unperturbed_by_split": None, "accuracy_examples": 0,
                     "accuracy_note": ACCURACY_NOTE, "seconds": seconds}
        collapse |= common | {"provenance": provenance()}
        names = write_analysis(stage, f"{folder.name} ({hf_class})", norms, collapse, rows,
                               figures=figures)
    files = [str(out / n) for n in names]
    return {"out": str(out), "files": files, "seconds": seconds, "norms": norms,
            "collapse": collapse}


# --------------------------------------------------------------------------- model


def loaded_weight_files(folder: Path) -> list[Path]:
    """The weight files `from_pretrained` reads from `folder`, in transformers' order: one
    safetensors file, else its index's shards, else the same for pytorch_model.bin. Listing
    every .bin and .safetensors named a Trainer's training_args.bin or a stale
    pytorch_model.bin as weights, and could not say which had loaded."""
    from transformers.utils import (
        SAFE_WEIGHTS_INDEX_NAME,
        SAFE_WEIGHTS_NAME,
        WEIGHTS_INDEX_NAME,
        WEIGHTS_NAME,
    )

    for single, index in ((SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME),
                          (WEIGHTS_NAME, WEIGHTS_INDEX_NAME)):
        if (folder / single).is_file():
            return [folder / single]
        if (folder / index).is_file():  # it loaded, so the index reads and its shards exist
            shards = json.loads((folder / index).read_text())["weight_map"].values()
            return [folder / index, *sorted(folder / f for f in set(shards))]
    return []


def _hf_meta(folder: Path, config: Any, hf_class: str) -> dict[str, Any]:
    import transformers

    weights = loaded_weight_files(folder)
    return {"class": hf_class, "model_type": config.model_type,
            "config": json.loads(config.to_json_string()),
            "weights": [{"file": p.name, "bytes": p.stat().st_size, "sha256": _sha256(p)}
                        for p in weights],
            "transformers": transformers.__version__}


@contextlib.contextmanager
def _skip_unembed(model: DecoderLM) -> Iterator[None]:
    """Forward passes return an empty tensor instead of logits (hooks still fire)."""
    model.unembed = lambda x: x[..., :0]  # type: ignore[method-assign]
    try:
        yield
    finally:
        del model.unembed


# --------------------------------------------------------------------------- input


def _read_token_ids(path: Path) -> list[int]:
    try:
        items = path.read_text(encoding="utf-8").split()
    except UnicodeDecodeError as err:
        raise ValueError(f"--tokens file {str(path)!r} is not UTF-8 text of token ids: "
                         f"{err}") from None
    ids = []
    for k, item in enumerate(items):
        # ASCII digits only: int() also took "1_0" as 10, "+5" and other scripts' digits
        if not ID.fullmatch(item):
            raise ValueError(f"--tokens file {str(path)!r}: item {k} ({item[:20]!r}) is not an "
                             "integer token id")
        ids.append(int(item))
    if not ids:
        raise ValueError(f"--tokens file {str(path)!r} holds no token ids")
    return ids


def _tokenize(folder: Path, path: Path, need: int) -> tuple[list[int], str, bool]:
    """Token ids of the text with the folder's tokenizer (its default special tokens), at least
    the first `need` of the whole file's, and whether the whole file was read.

    A long file is read only as far as needed: its first TEXT_CHUNK characters, doubled until
    they give `need + CUT_MARGIN` tokens. Where a tokenizer's merges stay within a word (a
    pre-tokenizer splits the text, as GPT-2's, Llama 3's and Qwen's do), only the tokens next
    to the cut differ from the whole file's, so the first `need` are the file's own (tested
    against whole-file tokenisation with a byte-level BPE); for one that merges across a whole
    text the margin is a safeguard, not a proof. Tokenised whole, a file took memory in proportion
    to its size, for the few thousand tokens used."""
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"--text: folder {str(folder)!r} has no tokenizer (none of "
                         f"{', '.join(TOKENIZER_FILES)}); save one there with "
                         "tokenizer.save_pretrained(DIR), or pass --tokens")
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as err:  # transformers raises many kinds; report one line
        raise ValueError(f"--text: cannot load the tokenizer in {str(folder)!r}: "
                         f"{first_line(err)}") from err
    if len(tok) <= len(set(tok.all_special_ids)):  # a vocabulary file missing: all [UNK]
        raise ValueError(f"--text: the tokenizer in {str(folder)!r} holds only its {len(tok)} "
                         "special tokens (its vocabulary file is missing, or is not the one its "
                         "class reads); save the whole tokenizer there with "
                         "tokenizer.save_pretrained(DIR), or pass --tokens")
    text, size, whole = "", TEXT_CHUNK, False
    try:
        with open(path, encoding="utf-8") as f:
            while True:
                more = f.read(size - len(text))  # returns less only at the file's end
                text += more
                whole = len(text) < size
                ids = list(tok(text, verbose=False)["input_ids"]) if text.strip() else []
                if whole or len(ids) >= need + CUT_MARGIN:
                    whole = whole or not f.read(1)  # a file of exactly `size` characters
                    break
                size *= 2
    except UnicodeDecodeError as err:
        raise ValueError(f"--text file {str(path)!r} is not UTF-8 text: {err}") from None
    if not ids:
        raise ValueError(f"--text file {str(path)!r} gives no tokens with "
                         f"{type(tok).__name__} from {str(folder)!r}")
    return (ids if whole else ids[:need]), type(tok).__name__, whole


def _check_vocab(ids: list[int], vocab: int, path: Path, folder: Path) -> None:
    # as Python ints: an id past int64 overflowed numpy, read as a size in the config
    bad = [k for k, i in enumerate(ids) if not 0 <= i < vocab]
    if bad:
        k = bad[0]
        raise ValueError(f"token id {ids[k]} (item {k} of {str(path)!r}) is outside the "
                         f"vocabulary of {str(folder)!r}: vocab_size {vocab}, ids 0..{vocab - 1}"
                         f" ({len(bad)} out-of-range ids in all)")


def _rows(ids: list[int], seq_len: int, n_examples: int) -> tuple[EvalData, int]:
    """The first `n_examples` rows of `seq_len` ids; the last row is right-padded and masked."""
    used = ids[:n_examples * seq_len]
    n_rows, width = math.ceil(len(used) / seq_len), min(seq_len, len(used))
    tokens = torch.zeros(n_rows * width, dtype=torch.long)
    valid = torch.zeros(n_rows * width, dtype=torch.bool)
    tokens[:len(used)] = torch.tensor(used, dtype=torch.long)
    valid[:len(used)] = True
    return EvalData.from_tokens(tokens.view(n_rows, width), valid.view(n_rows, width)), len(used)


# --------------------------------------------------------------------------- helpers


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


