"""Options added beyond the paper each change behaviour (a test fails if one did nothing)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from normlab import ModelConfig, build_model
from normlab.config import load_config
from normlab.model.generate import greedy_decode
from normlab.model.norms import Norm
from normlab.tasks.addition import (
    BOS,
    EOS,
    aux_positions,
    encode,
    make_batch,
    next_aux_position,
    reverse_digits,
)
from normlab.train import lr_at, train

# ---- digit-significance positions ------------------------------------------------------------


def test_aux_positions_hand_computed() -> None:
    q = encode("N674-N71+5814")
    assert aux_positions(q, "question") == [0, 3, 2, 1, 0, 0, 2, 1, 0, 4, 3, 2, 1]
    a = encode(reverse_digits("N1043"))  # N3401: units first
    assert aux_positions([BOS, *a], "answer") == [0, 0, 1, 2, 3, 4]
    seq = [BOS, *q, EOS, *a, EOS]
    assert aux_positions(seq, "sequence") == [0, *aux_positions(q, "question"), 0,
                                              0, 1, 2, 3, 4, 0]
    with pytest.raises(ValueError, match="part must be question, answer or sequence"):
        aux_positions(q, "middle")


def test_make_batch_carries_aux_only_when_asked() -> None:
    probs = [("12+N3", "9"), ("N45-67", "N112")]
    assert "aux" not in make_batch(probs, "decoder", "lsd")
    dec = make_batch(probs, "decoder", "lsd", digit_positions=True)
    assert dec["aux"].shape == dec["tokens"].shape
    assert dec["aux"][1].tolist()[: len("BN45-67E") + 4] == [0, 0, 2, 1, 0, 2, 1, 0, 0, 1, 2, 3]
    ed = make_batch(probs, "encoder_decoder", "lsd", digit_positions=True)
    assert ed["src_aux"].shape == ed["src"].shape and ed["tgt_aux"].shape == ed["tgt_in"].shape


def _aux_model(arch: str = "decoder") -> torch.nn.Module:
    return build_model(ModelConfig(arch=arch, d_model=32, n_heads=4, n_layers=1,
                                   n_encoder_layers=1, n_decoder_layers=1, max_len=32,
                                   n_aux_positions=6, pos_encoding="rope", init_std=0.3))


def test_aux_positions_change_the_model_and_are_required() -> None:
    model = _aux_model()
    batch = make_batch([("N45-67", "N112")], "decoder", "lsd", digit_positions=True)
    a = model(batch["tokens"], aux=batch["aux"])
    b = model(batch["tokens"], aux=torch.zeros_like(batch["aux"]))
    assert (a - b).abs().max() > 1e-3
    with pytest.raises(ValueError, match="n_aux_positions > 0: pass `aux`"):
        model(batch["tokens"])


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_kv_cache_with_aux_equals_uncached(arch: str) -> None:
    model = _aux_model(arch)
    prompts = [[BOS, *encode(q), EOS] for q in ("12+N3", "N45-67", "5")]
    a = greedy_decode(model, prompts, max_new=6, eos=EOS, aux_fn=aux_positions)
    b = greedy_decode(model, prompts, max_new=6, eos=EOS, aux_fn=aux_positions,
                      use_cache=False)
    assert a == b


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (["task.digit_positions=true", "model.n_aux_positions=8"],
         "task.digit_positions: needs task.reverse_answer = true"),
        (["task.digit_positions=true", "task.reverse_answer=true", "model.n_aux_positions=2"],
         "model.n_aux_positions: expected >= "),
        (["model.n_aux_positions=8"], "model.n_aux_positions: set, but task.digit_positions"),
        (["task.complement_answer=true"], "task.complement_answer: needs task.reverse_answer"),
        (["task.complement_answer=1"], "task.complement_answer: expected bool"),
    ],
)
def test_digit_position_config_errors(sets: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        load_config(None, ["task.grid='smoke'", *sets])
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_the_fewest_digit_places_a_config_takes_decode_an_answer_that_never_stops(
    arch: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The table holds the places of the longest answer, but decoding feeds back one
    generated digit more: a model that wrote digits past the answer crashed the evaluation
    with an IndexError. Such a digit is fed at the last place; the answer is scored, wrong."""
    from normlab.evaluate import evaluate
    from normlab.tasks.addition import eval_sets

    base = ["task.grid='smoke'", "task.digit_positions=true", "task.reverse_answer=true",
            f"model.arch='{arch}'"]
    fewest = next(n for n in range(1, 64) if _accepted([*base, f"model.n_aux_positions={n}"]))
    run = load_config(None, [*base, f"model.n_aux_positions={fewest}"])
    task = run.validate()
    assert fewest == task.max_lengths()[1] + 1  # the longest answer's places, and place 0
    torch.manual_seed(0)
    model = build_model(run.model).eval()
    nine = encode("9")[0]
    step = "forward" if arch == "decoder" else "decode"  # what greedy decoding calls each step
    inner, calls = getattr(model, step), []

    def only_nines(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        logits = inner(*args, **kwargs)
        return torch.where(torch.arange(logits.shape[-1]) == nine, 1.0, 0.0).expand_as(logits)

    monkeypatch.setattr(model, step, only_nines)  # a model that writes 9s and never stops
    res = evaluate(model, task, eval_sets(task), limit=2)
    assert all(split["accuracy"] == 0.0 for split in res["splits"].values())
    # every decode ran its whole length: digits past the table were fed back
    n_batches = len(res["splits"])  # one batch a split at this size
    assert len(calls) >= n_batches * task.max_new() and fewest < task.max_new()


def _accepted(sets: list[str]) -> bool:
    try:
        load_config(None, sets).validate()
    except ValueError:
        return False
    return True


# ---- norm gain offset (Gemma-style 1 + w) ---------------------------------------------------


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_norm_gain_offset_applies_one_plus_w(kind: str) -> None:
    x = torch.randn(3, 8)
    plain, offset = Norm(8, kind), Norm(8, kind, gain_offset=True)
    torch.testing.assert_close(offset(x), plain(x))  # w = 0 acts as gain 1
    w = torch.randn(8)
    with torch.no_grad():
        offset.w.copy_(w)
        plain.w.copy_(1 + w)
    torch.testing.assert_close(offset(x), plain(x))
    assert (offset(x) - Norm(8, kind)(x)).abs().max() > 1e-3


# ---- training options -------------------------------------------------------------------------


def test_lr_schedules() -> None:
    c = load_config(None, ["train.steps=110", "train.warmup_steps=10", "train.lr=1.0",
                           "train.min_lr_ratio=0.0", "train.schedule='cosine'"]).train
    assert lr_at(60, c) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, c) == pytest.approx(0.0)
    # a quarter and three quarters of the decay, where cosine and linear part (0.854 vs 0.75):
    # the points above are both shapes', so a linear "cosine" passed
    assert lr_at(35, c) == pytest.approx((1 + math.cos(math.pi / 4)) / 2)
    assert lr_at(85, c) == pytest.approx((1 - math.cos(math.pi / 4)) / 2)
    c.schedule = "linear"
    assert (lr_at(35, c), lr_at(85, c)) == (pytest.approx(0.75), pytest.approx(0.25))
    c.schedule = "constant"
    assert lr_at(60, c) == lr_at(109, c) == 1.0


def test_training_uses_its_packing_eval_examples_and_clipping(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each could be dropped with every other test passing: `task.pack` (packed and padded
    batches give the same loss: only the rows a batch takes tell), the periodic evaluation's
    first `train.eval_examples` questions a cell, and `grad_clip = 0` as no clipping (clipping
    to norm 0 would freeze every weight)."""
    import normlab.train as tr

    base = ["task.grid='smoke'", "model.d_model=16", "model.n_layers=1", "train.steps=4",
            "train.eval_every=4", "train.checkpoint_every=4", "train.batch_size=32",
            "train.eval_examples=3", "train.warmup_steps=0"]
    rows: list[int] = []
    limits: list[object] = []
    clipped: list[float] = []
    real_loss, real_eval = tr.loss_on, tr.evaluate
    real_clip = torch.nn.utils.clip_grad_norm_

    def loss_on(model, batch):
        rows.append(int(batch["tokens"].shape[0]))
        return real_loss(model, batch)

    def evaluate(*args, **kw):
        limits.append(kw.get("limit"))
        return real_eval(*args, **kw)

    def clip(params, max_norm, *a, **kw):
        clipped.append(max_norm)
        return real_clip(params, max_norm, *a, **kw)

    monkeypatch.setattr(tr, "loss_on", loss_on)
    monkeypatch.setattr(tr, "evaluate", evaluate)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", clip)
    for pack, grad_clip in ((False, 0.5), (True, 0.0)):
        rows.clear(), limits.clear(), clipped.clear()
        c = load_config(None, [*base, f"task.pack={str(pack).lower()}",
                               f"train.grad_clip={grad_clip}"])
        train(c, tmp_path / f"{pack}", progress=False)
        assert rows and (all(r < 32 for r in rows) if pack else set(rows) == {32})
        assert limits == [3]
        assert clipped == ([] if grad_clip == 0 else [0.5] * 4)


def test_early_stopping(tmp_path: Path) -> None:
    base = ["task.grid='smoke'", "model.d_model=16", "model.n_layers=1", "train.steps=40",
            "train.eval_every=10", "train.checkpoint_every=10", "train.eval_examples=4",
            "task.eval_size=4", "train.log_every=10"]
    last = train(load_config(None, [*base, "train.early_stop_accuracy=0.0"]), tmp_path / "a",
                 progress=False)
    assert last["early_stopped"] and last["step"] == 10
    done = json.loads((tmp_path / "a" / "train_done.json").read_text())
    assert done["step"] == 10
    last = train(load_config(None, [*base, "train.patience=1", "train.lr=1e-9"]),
                 tmp_path / "b", progress=False)
    assert last["early_stopped"] and last["step"] == 20  # no improvement at the second eval
    assert train(load_config(None, base), tmp_path / "c", progress=False)["step"] == 40
    # the evaluations without improvement are counted across a resume: a resume that reset
    # the count trained on past where the straight run stopped (step 40, not 30)
    slow = load_config(None, [*base, "train.patience=2", "train.lr=1e-9"])
    straight = train(slow, tmp_path / "d", progress=False)
    assert straight["early_stopped"] and straight["step"] == 30
    train(slow, tmp_path / "e", progress=False, stop_after=20)  # after one stale evaluation
    resumed = train(slow, tmp_path / "e", progress=False, resume=True)
    assert (resumed["step"], resumed.get("early_stopped")) == (30, True)


def test_next_aux_position_extends_rows_like_aux_positions() -> None:
    """The incremental rule gives what aux_positions gives on the grown row, token by token."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        q = [BOS, *encode("N45-67+8"), EOS]
        answer = torch.randint(0, 16, (8,), generator=gen).tolist()
        rows = [q + answer[:i] for i in range(len(answer) + 1)]
        prev = torch.tensor([aux_positions(r, "sequence")[-1] for r in rows[:-1]])
        tok = torch.tensor(answer)
        want = torch.tensor([aux_positions(r, "sequence")[-1] for r in rows[1:]])
        assert torch.equal(next_aux_position(prev, tok), want)
        tgt = [[BOS, *answer[:i]] for i in range(len(answer) + 1)]  # encoder-decoder target
        prev = torch.tensor([aux_positions(r, "answer")[-1] for r in tgt[:-1]])
        want = torch.tensor([aux_positions(r, "answer")[-1] for r in tgt[1:]])
        assert torch.equal(next_aux_position(prev, tok), want)


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_decoding_with_aux_next_equals_aux_fn(arch: str, use_cache: bool) -> None:
    model = _aux_model(arch)
    with torch.no_grad():  # favour digits, so generated answers exercise both branches
        gen = torch.Generator().manual_seed(1)
        model.W_U[:, 4:14] += 0.2 * torch.randn(model.W_U.shape[0], 10, generator=gen)
    prompts = [[BOS, *encode(q), EOS] for q in ("12+N3", "N45-67", "5", "9-9", "N1+2")]
    kw = {"max_new": 5, "eos": -1, "aux_fn": aux_positions, "use_cache": use_cache}
    a = greedy_decode(model, prompts, **kw)
    b = greedy_decode(model, prompts, aux_next=next_aux_position, **kw)
    assert a == b
    flat = [t for row in a for t in row]
    assert any(4 <= t <= 13 for t in flat) and any(not 4 <= t <= 13 for t in flat)


# ---- answer format ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("sets", "fmt"),
    [([], "msd"), (["task.reverse_answer=true"], "lsd"),
     (["task.reverse_answer=true", "task.complement_answer=true"], "lsd_complement")],
)
def test_answer_format_follows_the_config(sets: list[str], fmt: str) -> None:
    cfg = load_config(None, ["task.grid='smoke'", *sets])
    assert cfg.task.resolve().answer_format == fmt


def test_a_task_too_long_for_memory_is_refused_under_any_positions(monkeypatch,
                                                                   tmp_path) -> None:
    """Only a position table bounded the sequence: under RoPE (every shipped config) a cell of
    10**12 operands was accepted and training spent hours writing its first question. By hand,
    the smoke grid's longest cell is n4d1: a question of 4 signed digits and 3 operators (11
    tokens), an answer of up to N36 (3), the decoder's row B q E a E 17 tokens; one float32
    residual stream of 4 rows at d 16 is 4 x 17 x 16 x 4 = 4,352 bytes. Checked by training,
    not by reading a config: a smaller machine may evaluate a finished run."""
    import normlab.train as tr
    from normlab.config import load_config

    cfg = load_config(None, ["task.grid='smoke'", "model.d_model=16", "model.n_heads=2",
                             "model.pos_encoding='rope'", "train.batch_size=4"])
    task = cfg.validate()
    assert task.max_seq_len("decoder") == 17
    monkeypatch.setattr(tr, "memory_bytes", lambda: 4352)
    tr._check_batch_fits(cfg, task)  # exactly fits
    monkeypatch.setattr(tr, "memory_bytes", lambda: None)  # a system that does not say
    tr._check_batch_fits(cfg, task)
    monkeypatch.setattr(tr, "memory_bytes", lambda: 4351)
    with pytest.raises(ValueError, match=r"^task: its longest sequence, 17 tokens, makes one "
                                         r"residual stream of a batch of 4 \(4\.2 KiB\) larger"):
        tr.train(cfg, tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()
    huge = load_config(None, ["task.train=[[1000000000000, 1]]", "model.pos_encoding='rope'"])
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"^task: its longest sequence, 3,000,000,000,0\d\d "
                                         r"tokens"):
        tr._check_batch_fits(huge, huge.validate())


# ---- config files ----------------------------------------------------------------------------


def test_a_config_saved_with_a_byte_order_mark_is_named_so(tmp_path: Path) -> None:
    """A UTF-8 file that starts with a BOM (as some Windows editors save it) was "invalid TOML
    (Invalid statement (at line 1, column 1))", which names nothing one can see."""
    f = tmp_path / "bom.toml"
    f.write_bytes(b"\xef\xbb\xbf[task]\ngrid = 'smoke'\n")
    with pytest.raises(ValueError, match=rf"^config file {re.escape(repr(str(f)))}: starts with "
                                         r"a byte-order mark \(BOM\); save it as UTF-8 without "
                                         r"one$"):
        load_config(f)
    f.write_bytes(f.read_bytes()[3:])  # the same text without it
    assert load_config(f).task.grid == "smoke"
