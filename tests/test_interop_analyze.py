"""`normlab analyze --hf`: tiny HF models saved locally, analysed through the CLI (no hub)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

from normlab.cli import main  # noqa: E402
from normlab.interop.analyze import _rows, loaded_weight_files  # noqa: E402

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
    (out["gpt2"] / "training_args.bin").write_bytes(b"a Trainer's, not weights")
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


def test_the_weight_files_recorded_are_those_transformers_reads(tmp_path: Path) -> None:
    """model.safetensors, else its index and shards, else the same for pytorch_model.bin (the
    order `from_pretrained` looks in); never a training_args.bin or a stale .bin beside them."""
    def names(*files: str, index: str | None = None) -> list[str]:
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        for f in files:
            (folder / f).write_bytes(b"")
        if index:
            (folder / index).write_text(json.dumps({"weight_map": {  # in no order: sorted
                "a": "m-00002.x", "b": "m-00005.x", "c": "m-00002.x", "d": "m-00001.x",
                "e": "m-00004.x", "f": "m-00003.x"}}))
        return [p.name for p in loaded_weight_files(folder)]

    assert names("model.safetensors", "pytorch_model.bin", "training_args.bin") == [
        "model.safetensors"]
    assert names("pytorch_model.bin", "training_args.bin") == ["pytorch_model.bin"]
    shards = [f"m-0000{i}.x" for i in range(1, 6)]
    assert names(*shards, "pytorch_model.bin", index="model.safetensors.index.json") == [
        "model.safetensors.index.json", *shards]
    assert names(*shards, index="pytorch_model.bin.index.json") == [
        "pytorch_model.bin.index.json", *shards]
    assert names("training_args.bin") == []


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
        # the file transformers read, not the training_args.bin beside it
        assert [w["file"] for w in doc["hf"]["weights"]] == ["model.safetensors"]
        assert doc["seed"] == 0 and doc["config"]["vocab_size"] == VOCAB
    # 300 ids in rows of 128: 128 + 128 + 44 real tokens; the 84 pads are never counted
    assert norms["input"] | {"sha256": None} == {
        "kind": "tokens", "file": str(folders["tokens"]), "sha256": None, "tokenizer": None,
        "whole_file": True, "n_tokens": 300, "n_tokens_used": 300, "n_rows": 3, "row_length": 128}
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
    assert collapse["input"]["whole_file"]
    assert collapse["collapse_rate"] == ([0.0] if collapse["n_sparse_rows"] else [None])


def test_a_tokenizer_without_its_vocabulary_is_refused(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """From tokenizer_config.json alone transformers 5 builds a tokenizer of its 5 special
    tokens (BertTokenizer), every word read as [UNK], and the analysis of those ids exited 0.
    A vocabulary file its class does not read gives the same empty tokenizer. Both are refused
    by the loaded tokenizer's size; a folder with no tokenizer file at all, before loading."""
    import shutil

    folder = tmp_path / "partial"
    shutil.copytree(folders["gpt2_tok"], folder)
    (folder / "tokenizer.json").unlink()  # copied without it
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {
        "tokenizer_class": "BertTokenizer"}))
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat\n")
    argv = ["analyze", "--hf", str(folder), "--text", str(text), "--out", str(tmp_path / "out"),
            "--sigmas", "0", "--draws", "1"]
    only_special = (
        f"normlab: error: --text: the tokenizer in {str(folder)!r} holds only its 5 special "
        "tokens (its vocabulary file is missing, or is not the one its class reads); save the "
        "whole tokenizer there with tokenizer.save_pretrained(DIR), or pass --tokens")
    assert _error(argv, capsys) == only_special
    (folder / "vocab.json").write_text("{}")  # GPT-2's file name, which BertTokenizer ignores
    assert _error(argv, capsys) == only_special
    assert not (tmp_path / "out").exists()
    for name in ("vocab.json", "tokenizer_config.json"):
        (folder / name).unlink()
    assert _error(argv, capsys).startswith(
        f"normlab: error: --text: folder {str(folder)!r} has no tokenizer (none of "
        "tokenizer.json, tokenizer_config.json, ")


def test_a_vocabulary_file_of_another_name_is_read(folders: dict[str, Path],
                                                   tmp_path: Path) -> None:
    """A tokenizer whose vocabulary file has a name off the file list (XLM-R's
    sentencepiece.bpe.model, vouched for by tokenizer_config.json) was refused as "no
    tokenizer", though transformers loads it: the file list only says a tokenizer was saved."""
    import io
    import shutil

    spm = pytest.importorskip("sentencepiece")
    folder = tmp_path / "xlmr"
    shutil.copytree(folders["gpt2"], folder)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter([" ".join(WORDS[1:])] * 20),
                                   model_writer=model, vocab_size=30, model_type="word",
                                   hard_vocab_limit=False, minloglevel=2)
    (folder / "sentencepiece.bpe.model").write_bytes(model.getvalue())
    (folder / "tokenizer_config.json").write_text('{"tokenizer_class": "XLMRobertaTokenizer"}')
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat\na dog ran\n")
    out = tmp_path / "out"
    assert main(["analyze", "--hf", str(folder), "--text", str(text), "--out", str(out),
                 "--sigmas", "0", "--draws", "1"]) == 0
    got = json.loads((out / "collapse.json").read_text())["input"]
    # <s> the cat sat on the mat a dog ran </s>: one id a word, none an [UNK]
    assert (got["tokenizer"], got["n_tokens"]) == ("XLMRobertaTokenizer", 11)
    tok = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert tok.unk_token_id not in tok(text.read_text())["input_ids"]


def test_out_refuses_only_the_files_it_writes_and_after_the_input_checks(
    folders: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Any *.json in --out was refused with "pass --force to overwrite it", which --force did
    not (a notes.json, or the model's own config.json with --out the model folder); and the
    refusal came before the input checks, so a missing folder or a negative sigma was named only
    once --force was given."""
    import shutil

    g, toks = str(folders["gpt2"]), str(folders["tokens"])
    quick = ["--tokens", toks, "--sigmas", "0", "--draws", "1", "--examples", "1"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.json").write_text('{"mine": 1}')
    assert main(["analyze", "--hf", g, *quick, "--out", str(out)]) == 0
    assert (out / "notes.json").read_text() == '{"mine": 1}'
    model = tmp_path / "model"
    shutil.copytree(folders["gpt2"], model)
    config = (model / "config.json").read_bytes()
    assert main(["analyze", "--hf", str(model), *quick, "--out", str(model)]) == 0
    assert (model / "config.json").read_bytes() == config and (model / "norms.json").is_file()
    # an earlier analysis there: the bad input is named first, then the earlier files
    before = (out / "collapse.json").read_bytes()
    msg = _error(["analyze", "--hf", str(tmp_path / "nope"), *quick, "--out", str(out)], capsys)
    assert "does not exist" in msg and "nope" in msg
    assert "--sigmas[1]" in _error(["analyze", "--hf", g, *quick, "--out", str(out),
                                    "--sigmas", "0,-1"], capsys)
    assert _error(["analyze", "--hf", g, *quick, "--out", str(out)], capsys) == (
        f"normlab: error: {str(out / 'collapse.json')!r} already exists; pass --force to "
        "overwrite it")
    assert (out / "collapse.json").read_bytes() == before
    (out / "collapse.json").unlink()  # either JSON marks an earlier analysis
    assert "norms.json' already exists" in _error(["analyze", "--hf", g, *quick, "--out",
                                                   str(out)], capsys)
    assert main(["analyze", "--hf", g, *quick, "--out", str(out), "--force"]) == 0
    for name in ("collapse.json", "norms.json"):
        (out / name).unlink()  # figures without them: a killed command's, replaced (README)
    assert main(["analyze", "--hf", g, *quick, "--out", str(out)]) == 0
    assert {p.name for p in out.iterdir()} == {"notes.json", "norms.json", "norms.png",
                                               "collapse.json", "collapse.png",
                                               "collapse_rows.npz"}


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
            # refused from the config, naming its field, before transformers' ZeroDivisionError
            (_weights_for(g, n_head=0), "config.json: GPT2LMHeadModel: n_head: expected a positive "
                                        "integer below 2**63; got 0"),
            (_weights_for(g, n_layer="two"), "cannot read config.json: Validation error for "
                                             "field 'n_layer': TypeError: Field 'n_layer' "
                                             "expected int, got str"),
            # it blamed the token ids ("token id 27 is outside the vocabulary ... ids 0..-6"),
            # after two lines of transformers' warnings on the bos and eos ids
            (_weights_for(g, vocab_size=-5), "config.json: GPT2LMHeadModel: vocab_size: "
                                             "expected a positive integer below 2**63; got -5")):
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


def _llama_with_bos(folder: Path) -> Path:
    """A Llama folder whose tokenizer adds one BOS, as Llama's do."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   vocab_size=VOCAB, max_position_embeddings=64,
                                   initializer_range=0.2, bos_token_id=len(WORDS))
    torch.manual_seed(2)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate([*WORDS, "<s>"])},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", len(WORDS))])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                                         bos_token="<s>").save_pretrained(folder)
    return folder


def test_llama_text_matches_the_hf_model(tmp_path: Path) -> None:
    """The Llama path end to end: one BOS for the stream (not one a row), and the norm scales
    and sparse-row count computed from transformers' own model and attentions."""
    from normlab.interop.analyze import analyze_hf

    folder = _llama_with_bos(tmp_path / "llama")
    words = ("the cat sat on a mat a dog ran on the mat " * 3).split()  # 36 words
    text = tmp_path / "t.txt"
    text.write_text(" ".join(words) + "\n")
    seq, theta = 16, 0.5
    res = analyze_hf(folder, text=text, out=tmp_path / "out", sigmas=[0.0], n_draws=1,
                     threshold=theta, seq_len=seq, figures=False)
    assert res["norms"]["input"]["n_tokens"] == len(words) + 1  # one BOS
    assert res["norms"]["input"]["n_rows"] == 3  # 37 tokens in rows of 16
    assert res["seconds"].keys() == {"load", "norms", "collapse"}  # each timed under its name

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager").eval()
    ids = transformers.AutoTokenizer.from_pretrained(folder)(text.read_text())["input_ids"]
    assert ids[0] == len(WORDS) and ids.count(len(WORDS)) == 1
    eps, seen = hf.config.rms_norm_eps, []
    hook = hf.model.layers[1].input_layernorm.register_forward_hook(
        lambda mod, args, out: seen.append(args[0][0]))
    n_sparse = 0
    with torch.no_grad():
        for k in range(0, len(ids), seq):  # each row alone: the pad is never attended to
            out = hf(torch.tensor([ids[k:k + seq]]), output_attentions=True)
            n_sparse += sum(int((a[0, :, 1:].amax(-1) >= theta).sum()) for a in out.attentions)
    hook.remove()
    scale = (torch.cat(seen).pow(2).mean(-1) + eps).sqrt()  # RMSNorm's divisor, real tokens
    entry = next(e for e in res["norms"]["entries"] if e["hook"] == "blocks.1.ln1.hook_scale")
    assert entry["classes"]["all"]["n"] == len(ids)
    assert entry["median_scale"] == pytest.approx(scale.median().item(), rel=1e-5)
    assert res["collapse"]["n_sparse_rows"] == n_sparse > 0


def test_a_model_it_cannot_convert_is_refused_before_its_weights_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """RoPE scaling was refused only once the text was tokenised and every weight loaded and
    copied to float32 (a Llama 3.1 8B: 48 GB before the one-line refusal)."""
    from normlab.interop.hf import from_hf, from_hf_pretrained

    folder = _llama_with_bos(tmp_path / "llama")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 32}
    (folder / "config.json").write_text(json.dumps(cfg))

    def never(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("loaded")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", never)
    said = ("LlamaForCausalLM: rope_parameters.rope_type (rope_scaling in transformers 4) "
            "'llama3' is not supported")
    with pytest.raises(ValueError, match=f"^from_hf_pretrained: folder .*: config.json: "
                                         f"{re.escape(said)}"):
        from_hf_pretrained(folder)
    text = tmp_path / "t.txt"
    text.write_text("the cat\n")
    msg = _error(["analyze", "--hf", str(folder), "--text", str(text), "--out",
                  str(tmp_path / "out")], capsys)
    assert msg == f"normlab: error: --hf folder {str(folder)!r}: config.json: {said}; only " \
                  "plain RoPE (rope_type 'default') is implemented"
    monkeypatch.undo()
    live = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(folder))
    monkeypatch.setattr(live, "state_dict", never)  # from_hf copied every weight first
    with pytest.raises(ValueError, match=f"^{re.escape(said)}"):
        from_hf(live)


@pytest.mark.parametrize(("change", "said"), [
    ({"layer_norm_epsilon": -1.0}, "GPT2LMHeadModel: layer_norm_epsilon: expected a positive"),
    ({"activation_function": "gelu_fast"}, "GPT2LMHeadModel: activation_function: 'gelu_fast' "
                                           "is not supported"),
    ({"n_positions": 0}, "GPT2LMHeadModel: n_positions: expected"),
    # the fields named in the text too (it said "n_heads=5")
    ({"n_head": 5}, "GPT2LMHeadModel: n_embd: expected a multiple of n_head=5"),
])
def test_config_refusals_name_the_folder_and_its_field(
    change: dict[str, Any], said: str, folders: dict[str, Path], tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """They named normlab's field (ModelConfig.norm_eps) and no folder."""
    bad = _weights_for(folders["gpt2"], **change)
    msg = _error(["analyze", "--hf", str(bad), "--tokens", str(folders["tokens"]), "--out",
                  str(tmp_path / "out")], capsys)
    assert msg.startswith(f"normlab: error: --hf folder {str(bad)!r}: config.json: {said}"), msg


def test_inputs_too_short_or_odd_are_named(folders: dict[str, Path], tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """One token (or rows of one) ran to exit 0 with h90 = 0, "no spread"; a --tokens file
    not in UTF-8 was an error naming no file; int() took "1_0" as 10 and "+5" as 5."""
    g, out = str(folders["gpt2"]), str(tmp_path / "out")
    base = ["analyze", "--hf", g, "--out", out]
    one = tmp_path / "one.txt"
    one.write_text("7\n")
    assert _error([*base, "--tokens", str(one)], capsys) == (
        f"normlab: error: --tokens file {str(one)!r} gives 1 token; the analysis needs at least "
        "2 (a query with a key before it)")
    msg = _error([*base, "--tokens", str(folders["tokens"]), "--seq-len", "1"], capsys)
    assert msg == "normlab: error: --seq-len: expected an int >= 2; got 1"
    latin = tmp_path / "latin.txt"
    latin.write_bytes("1 2 é".encode("latin-1"))
    msg = _error([*base, "--tokens", str(latin)], capsys)
    assert msg.startswith(f"normlab: error: --tokens file {str(latin)!r} is not UTF-8 text")
    for item in ("1_0", "+5", "\u0663"):
        odd = tmp_path / "odd.txt"
        odd.write_text(f"1 2 {item} 4\n")
        assert f"item 2 ({item!r}) is not an integer token id" in _error(
            [*base, "--tokens", str(odd)], capsys)
    assert not (tmp_path / "out").exists()


def test_an_empty_path_is_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    """'' is the current folder as a Path (an unset shell variable): --hf '' was read as no
    --hf ("--out is for --hf DIR only"), --text '' as "'.' is a folder"."""
    for argv, flag in ((["analyze", "--hf", "", "--tokens", "t", "--out", "o"], "--hf"),
                       (["analyze", "--hf", "h", "--text", "", "--out", "o"], "--text"),
                       (["train", "--config", "c.toml", "--out", ""], "--out"),
                       (["eval", ""], "RUN_DIR"), (["compare", "a", ""], "RUN_DIR")):
        assert _error(argv, capsys) == f"normlab: error: {flag}: expected a path; got an " \
                                       "empty string"


def test_a_long_text_is_read_only_as_far_as_its_tokens_are_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole file was tokenised (a 37 MB file took 5.6 GB to use 4,096 tokens). A prefix
    gives the whole file's first tokens, with a byte-level BPE whose tokens cross spaces and
    runs of newlines, wherever the prefix is cut."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from normlab.interop import analyze

    lines = ["the cat sat  on the mat\n\n\n", "a dóg ran,   on the mat!!\n", " \t ü ü ü\n",
             "mat-mat mat123 the\r\n"]
    rng = np.random.default_rng(0)
    text = "".join(rng.choice(lines, size=200))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    folder = tmp_path / "tok"
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(folder)
    path = tmp_path / "t.txt"
    path.write_text(text, newline="")
    whole = transformers.AutoTokenizer.from_pretrained(folder)(
        path.read_text())["input_ids"]  # universal newlines, as the analysis reads
    monkeypatch.setattr(analyze, "TEXT_CHUNK", 7)
    for need in (1, 9, 100, 1000):
        ids, _, read_all = analyze._tokenize(folder, path, need)
        assert not read_all and ids == whole[:need]
    ids, _, read_all = analyze._tokenize(folder, path, len(whole))
    assert read_all and ids == whole
