"""`normlab analyze --hf`: tiny HF models saved locally, analysed through the CLI (no hub)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from normlab.cli import main  # noqa: E402
from normlab.interop.analyze import _rows  # noqa: E402

VOCAB = 50
WORDS = ["[UNK]", "the", "cat", "sat", "on", "mat", "a", "dog", "ran"]
NORMS_KEYS = {"classes", "percentiles", "n_examples", "entries", "summary", "note", "seed",
              "params", "config", "provenance", "hf", "hf_dir", "input"}
COLLAPSE_KEYS = {"threshold", "sigmas", "collapse_rate", "collapse_ci95", "predicted_rate",
                 "n_sparse_rows", "per_head", "per_site", "seed", "params", "config",
                 "provenance", "hf", "input", "accuracy", "accuracy_note"}


def _gpt2() -> Any:
    cfg = transformers.GPT2Config(n_embd=32, n_head=4, n_layer=2, vocab_size=VOCAB,
                                  n_positions=128, initializer_range=0.2, bos_token_id=0,
                                  eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _qwen3() -> Any:
    cfg = transformers.Qwen3Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   vocab_size=VOCAB, max_position_embeddings=128,
                                   initializer_range=0.2)
    return transformers.Qwen3ForCausalLM(cfg)


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    out = {k: root / k for k in ("gpt2", "qwen3", "gpt2_tok", "qwen2")}
    out["tokens"] = root / "tokens.txt"
    _gpt2().save_pretrained(out["gpt2"])
    _qwen3().save_pretrained(out["qwen3"])
    _gpt2().save_pretrained(out["gpt2_tok"])
    _tokenizer().save_pretrained(out["gpt2_tok"])
    cfg = transformers.Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=VOCAB, max_position_embeddings=128)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(out["qwen2"])
    ids = torch.randint(0, VOCAB, (300,), generator=torch.Generator().manual_seed(1))
    out["tokens"].write_text(" ".join(map(str, ids.tolist())) + "\n")
    return out


FAST = ["--sigmas", "0,0.2", "--draws", "4", "--examples", "3"]


@pytest.mark.parametrize("family", ["gpt2", "qwen3"])
def test_tokens_file(family: str, folders: dict[str, Path], tmp_path: Path,
                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    rc = main(["analyze", "--hf", str(folders[family]), "--tokens", str(folders["tokens"]),
               "--out", str(out), *FAST])
    assert rc == 0, capsys.readouterr().err
    assert {p.name for p in out.iterdir()} == {"norms.json", "norms.png", "collapse.json",
                                               "collapse.png", "collapse_rows.npz"}
    norms = json.loads((out / "norms.json").read_text())
    collapse = json.loads((out / "collapse.json").read_text())
    assert set(norms) >= NORMS_KEYS and set(collapse) >= COLLAPSE_KEYS
    cls = {"gpt2": "GPT2LMHeadModel", "qwen3": "Qwen3ForCausalLM"}[family]
    for doc in (norms, collapse):
        assert doc["hf"]["class"] == cls and doc["hf"]["config"]["vocab_size"] == VOCAB
        assert doc["hf"]["weights"][0]["sha256"] and doc["provenance"]["torch"]
        assert doc["seed"] == 0 and doc["config"]["vocab_size"] == VOCAB
    # 300 ids in rows of 128: 128 + 128 + 44 real tokens; the 84 pads are never counted
    assert norms["input"] | {"sha256": None} == {
        "kind": "tokens", "file": str(folders["tokens"]), "sha256": None, "tokenizer": None,
        "n_tokens": 300, "n_tokens_used": 300, "n_rows": 3, "row_length": 128}
    assert all(e["classes"]["all"]["n"] == 300 for e in norms["entries"] if e["head"] is None)
    hooks = {e["hook"] for e in norms["entries"]}
    assert ("blocks.1.attn.q_norm.hook_scale" in hooks) == (family == "qwen3")
    # sigma = 0 is the unperturbed model: nothing collapses; no task, so no accuracy
    assert collapse["sigmas"] == [0.0, 0.2] and collapse["collapse_rate"][0] == 0.0
    assert 0.0 <= collapse["collapse_rate"][1] <= 1.0 and collapse["n_sparse_rows"] > 0
    assert collapse["accuracy"] is None and "no task" in collapse["accuracy_note"]
    assert collapse["params"]["n_draws"] == 4 and collapse["draws_per_sigma"] == [1, 4]
    # the per-row columns name the model and the tokens they came from, as collapse.json does
    with np.load(out / "collapse_rows.npz", allow_pickle=False) as rows:
        meta = json.loads(str(rows["meta"]))
    assert meta["hf"] == collapse["hf"] and meta["input"] == collapse["input"]


def test_text_with_tokenizer(folders: dict[str, Path], tmp_path: Path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat\na dog ran on the mat zebra\n")
    out = tmp_path / "out"
    assert main(["analyze", "--hf", str(folders["gpt2_tok"]), "--text", str(text),
                 "--out", str(out), "--sigmas", "0", "--draws", "2"]) == 0
    collapse = json.loads((out / "collapse.json").read_text())
    assert collapse["input"]["kind"] == "text" and collapse["input"]["tokenizer"]
    assert collapse["input"]["n_tokens"] == 13 and collapse["input"]["row_length"] == 13
    assert collapse["collapse_rate"] == ([0.0] if collapse["n_sparse_rows"] else [None])


def test_rows_pad_and_mask() -> None:
    data, used = _rows(list(range(1, 11)), 4, 8)
    assert used == 10 and data.inputs["tokens"].tolist() == [[1, 2, 3, 4], [5, 6, 7, 8],
                                                              [9, 10, 0, 0]]
    assert data.valid["tokens"].sum() == 10 and not data.valid["tokens"][2, 2:].any()
    data, used = _rows(list(range(10)), 4, 2)  # n_examples caps the rows
    assert used == 8 and data.inputs["tokens"].shape == (2, 4)


def _error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("normlab: error: "), lines
    return lines[0]


def test_errors(folders: dict[str, Path], tmp_path: Path,
                capsys: pytest.CaptureFixture[str]) -> None:
    g, toks, out = str(folders["gpt2"]), str(folders["tokens"]), str(tmp_path / "out")
    text = tmp_path / "t.txt"
    text.write_text("the cat\n")
    oov = tmp_path / "oov.txt"
    oov.write_text("1 2 3\n4 77 5 -1\n")
    empty = tmp_path / "empty.txt"
    empty.write_text(" \n")
    bad = tmp_path / "bad.txt"
    bad.write_text("1 2 x3\n")
    base = ["analyze", "--hf"]
    msg = _error([*base, str(tmp_path / "nope"), "--tokens", toks, "--out", out], capsys)
    assert "does not exist" in msg and "nope" in msg
    assert "has no config.json" in _error([*base, str(tmp_path), "--tokens", toks, "--out",
                                           out], capsys)
    assert f"{str(text)!r} is a file, not a folder" in _error(  # it said "does not exist"
        [*base, str(text), "--tokens", toks, "--out", out], capsys)
    assert "exactly one of --tokens FILE or --text FILE" in _error(
        [*base, g, "--tokens", toks, "--text", str(text), "--out", out], capsys)
    assert "exactly one of" in _error([*base, g, "--out", out], capsys)
    assert "--out" in _error([*base, g, "--tokens", toks], capsys)
    assert "has no tokenizer" in _error([*base, g, "--text", str(text), "--out", out], capsys)
    msg = _error([*base, g, "--tokens", str(oov), "--out", out], capsys)
    assert "token id 77" in msg and "vocab_size 50" in msg and "2 out-of-range" in msg
    assert "holds no token ids" in _error([*base, g, "--tokens", str(empty), "--out", out],
                                          capsys)
    assert "('x3') is not an integer" in _error([*base, g, "--tokens", str(bad), "--out", out],
                                              capsys)
    assert "does not exist" in _error([*base, g, "--tokens", str(tmp_path / "no.txt"),
                                       "--out", out], capsys)
    # transformers' warnings on the config (an eos id outside the vocabulary) came before it
    assert "does not exist" in _error([*base, str(_weights_for(folders["gpt2"], eos_token_id=99)),
                                       "--tokens", str(tmp_path / "no.txt"), "--out", out], capsys)
    msg = _error([*base, str(folders["qwen2"]), "--tokens", toks, "--out", out], capsys)
    assert "'Qwen2ForCausalLM' is not supported" in msg and "GPT2LMHeadModel" in msg
    # the architecture first: a config with no vocab_size of its own (CLIP's) read as one
    # whose vocab_size is bad
    msg = _error([*base, str(_weights_for(folders["qwen2"], vocab_size=-5)), "--tokens", toks,
                  "--out", out], capsys)
    assert "'Qwen2ForCausalLM' is not supported" in msg
    assert "threshold" in _error([*base, g, "--tokens", toks, "--out", out, "--threshold",
                                  "1.5"], capsys)
    # one mode's options with the other were dropped without a word
    assert "give RUN_DIR or --hf DIR, not both" in _error(
        ["analyze", str(tmp_path), "--hf", g, "--tokens", toks, "--out", out], capsys)
    for opt in (["--out", out], ["--tokens", toks], ["--seq-len", "16"]):
        assert f"{opt[0]} is for --hf DIR only" in _error(["analyze", str(tmp_path), *opt],
                                                         capsys)
    assert main([*base, g, "--tokens", toks, "--out", out, "--seq-len", "4096"]) == 2
    # one line, refused before the weights load (transformers prints while it loads them)
    err = capsys.readouterr().err.strip()
    assert err.startswith("normlab: error: rows of ") and "\n" not in err
    assert err.endswith("lower seq_len (--seq-len)")
    assert not (tmp_path / "out").exists()
    # --out naming a file (or a folder under one) failed at the first write, after the whole
    # analysis, with "[Errno 17] File exists" naming no option
    for where, blocker in ((text, "it is a file"), (text / "sub", f"{str(text)!r} is a file")):
        msg = _error([*base, g, "--tokens", toks, "--out", str(where)], capsys)
        assert msg.endswith(f"--out {str(where)!r}: expected a folder for the results; {blocker}")


def test_without_transformers_hf_input_is_refused_in_one_line(
    folders: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """transformers is an optional dependency (`normlab[hf]`); without it `analyze --hf`
    ended in a ModuleNotFoundError traceback."""
    import sys

    from normlab.interop import from_hf_pretrained

    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers: ImportError
    out = tmp_path / "out"
    msg = _error(["analyze", "--hf", str(folders["gpt2"]), "--tokens", str(folders["tokens"]),
                  "--out", str(out)], capsys)
    assert msg == ("normlab: error: analyze --hf needs Hugging Face transformers: pip install "
                   "'normlab[hf]'")
    with pytest.raises(ValueError, match=r"^from_hf_pretrained needs Hugging Face transformers"):
        from_hf_pretrained(folders["gpt2"])
    assert not out.exists()


def _weights_for(folder: Path, **config: Any) -> Path:
    """`folder`'s weights beside a config.json changed by `config`: weights made for another
    model, as a hand-edited or mixed-up folder holds."""
    import shutil

    bad = folder.parent / f"{folder.name}-{'-'.join(f'{k}{v}' for k, v in config.items())}"
    if not bad.exists():
        shutil.copytree(folder, bad)
        cfg = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps(cfg | config))
    return bad


def test_weights_that_do_not_fill_the_model_are_refused(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """transformers fills what the file lacks with fresh random values and ignores what the
    model does not take, and only logs a report: a config of 3 layers over 2 layers' weights was
    analysed with a random third block (its numbers changed from run to run), one of 1 layer
    silently dropped the second."""
    from normlab.interop.hf import from_hf_pretrained

    g, toks = folders["gpt2"], str(folders["tokens"])
    cases = [({"n_layer": 3}, "tensors the config asks for are missing from the weights: "
              "transformer.h.2.", "(12 in all)"),
             # 11 of 12: transformers itself drops c_attn.bias, taken for GPT-2's old mask
             ({"n_layer": 1}, "the weights hold tensors the config's model does not take: "
              "transformer.h.1.", " in all)"),
             ({"vocab_size": 60}, "tensors do not fit the config's shapes: transformer.wte.weight"
              " is [50, 32] in the file, [60, 32] by the config", "(1 in all)")]
    for config, said, count in cases:
        bad = _weights_for(g, **config)
        with pytest.raises(ValueError) as err:
            from_hf_pretrained(bad)
        assert str(err.value) == (f"Hugging Face folder {str(bad)!r}: {said}"
                                  + str(err.value).split(said, 1)[1])
        assert count in str(err.value) and "\n" not in str(err.value)
        out = tmp_path / f"out-{bad.name}"
        msg = _error(["analyze", "--hf", str(bad), "--tokens", toks, "--out", str(out)], capsys)
        assert said in msg and not out.exists()
    from_hf_pretrained(g)  # the folder itself loads: nothing missing, nothing left over


def test_a_folder_that_does_not_load_is_one_line(folders: dict[str, Path], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A damaged safetensors file, a config value the model cannot be built with and a field of
    the wrong type each ended in a 26-42 line traceback."""
    import shutil

    g, toks = folders["gpt2"], str(folders["tokens"])
    cut = tmp_path / "cut"
    shutil.copytree(g, cut)
    blob = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    for folder, said in (
            (cut, f"Hugging Face folder {str(cut)!r}: cannot load the model: Error while "
                  "deserializing header"),
            (_weights_for(g, n_head=0), "cannot load the model: integer division or modulo"),
            (_weights_for(g, n_layer="two"), "cannot read config.json: Validation error for "
                                             "field 'n_layer': TypeError: Field 'n_layer' "
                                             "expected int, got str"),
            # it blamed the token ids ("token id 27 is outside the vocabulary ... ids 0..-6"),
            # after two lines of transformers' warnings on the bos and eos ids
            (_weights_for(g, vocab_size=-5), "config.json's vocab_size: expected a positive "
                                             "integer; got -5")):
        msg = _error(["analyze", "--hf", str(folder), "--tokens", toks, "--out",
                      str(tmp_path / "out")], capsys)
        assert said in msg, msg
    assert not (tmp_path / "out").exists()


def test_odd_token_files_are_named(folders: dict[str, Path], tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    """An id past int64 read as "out of memory or range ... a size in the config"; a folder
    given as --tokens "does not exist"."""
    g, out = str(folders["gpt2"]), str(tmp_path / "out")
    big = tmp_path / "big.txt"
    big.write_text(f"1 2 {10**26} 4\n")
    msg = _error(["analyze", "--hf", g, "--tokens", str(big), "--out", out], capsys)
    assert msg == (f"normlab: error: token id {10**26} (item 2 of {str(big)!r}) is outside the "
                   f"vocabulary of {g!r}: vocab_size 50, ids 0..49 (1 out-of-range ids in all)")
    msg = _error(["analyze", "--hf", g, "--tokens", str(tmp_path), "--out", out], capsys)
    assert msg == f"normlab: error: --tokens file {str(tmp_path)!r} is a folder, not a file"
    # a device or a pipe exists: it said "does not exist"
    msg = _error(["analyze", "--hf", g, "--tokens", os.devnull, "--out", out], capsys)
    assert msg == f"normlab: error: --tokens file {os.devnull!r} is not a regular file"


def test_buffers_older_checkpoints_saved_still_load(folders: dict[str, Path],
                                                    tmp_path: Path) -> None:
    """GPT-2 checkpoints saved by older transformers hold each block's causal mask
    (`attn.bias`, `attn.masked_bias`): tensors the model does not take, that leave nothing
    unloaded. They are not taken for weights of another model."""
    import shutil

    from safetensors.torch import load_file, save_file

    from normlab.interop.hf import from_hf_pretrained

    old = tmp_path / "old"
    shutil.copytree(folders["gpt2"], old)
    sd = load_file(old / "model.safetensors")
    for i in range(2):
        sd[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 128, 128))
        sd[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    save_file(sd, old / "model.safetensors", metadata={"format": "pt"})
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    a, b = from_hf_pretrained(old), from_hf_pretrained(folders["gpt2"])
    assert torch.equal(a(tokens), b(tokens))
