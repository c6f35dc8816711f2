"""Sequence packing (`task.pack`): a packed row computes exactly what its problems compute alone.

Independent truths: each problem run through the model by itself (logits per segment), the
unpacked batch's loss (the same answer tokens), and hand-computed packings and positions.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from normlab import ModelConfig, build_model
from normlab.checkpoint import list_checkpoints
from normlab.config import load_config
from normlab.model.config import POS_ENCODINGS
from normlab.model.transformer import _segment_positions
from normlab.tasks.addition import (
    IGNORE_INDEX,
    PAD,
    Cell,
    TrainStream,
    make_batch,
    pack_rows,
    sample_problem,
)
from normlab.train import loss_on, train

if TYPE_CHECKING:
    from conftest import SdpaPast

PROBLEMS = [("1+2", "3"), ("N45-67", "N112"), ("7", "7"), ("12+N3-N88", "97"), ("N5", "N5")]


def test_pack_rows_first_fit_decreasing_by_hand() -> None:
    # lengths 5, 9, 3, 12, 4 into width 12: 12 | 9+3 | 5+4
    assert pack_rows([5, 9, 3, 12, 4], 12) == [[3], [1, 2], [0, 4]]
    assert pack_rows([4, 4, 4], 12) == [[0, 1, 2]]
    with pytest.raises(ValueError, match="wider than 3"):
        pack_rows([4], 3)


def test_segment_positions_restart_per_segment() -> None:
    seg = torch.tensor([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    assert _segment_positions(seg).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], list(range(8))]


@pytest.mark.parametrize("digit_positions", [False, True])
def test_packed_batch_holds_the_same_tokens_and_targets(digit_positions: bool) -> None:
    plain = make_batch(PROBLEMS, "decoder", "lsd", digit_positions)
    packed = make_batch(PROBLEMS, "decoder", "lsd", digit_positions, pack=True)
    width = plain["tokens"].shape[1]
    assert packed["tokens"].shape[1] == width  # rows no wider than the longest problem
    assert packed["tokens"].shape[0] < len(PROBLEMS)
    assert packed["segments"].shape == packed["tokens"].shape
    real = plain["tokens"] != PAD
    assert int((packed["tokens"] != PAD).sum()) == int(real.sum())
    # the multiset of (token, target, aux) triples is unchanged
    keys = ["tokens", "targets"] + (["aux"] if digit_positions else [])

    def triples(b: dict[str, torch.Tensor]) -> list[tuple[int, ...]]:
        m = b["tokens"] != PAD
        return sorted(zip(*(b[k][m].tolist() for k in keys), strict=True))

    assert triples(packed) == triples(plain)
    assert int((packed["segments"] == 0).sum()) == int((packed["tokens"] == PAD).sum())


@pytest.mark.parametrize("placement", ["pre", "qkv"])
@pytest.mark.parametrize("pos", POS_ENCODINGS)
@pytest.mark.parametrize("path", ["default", "sdpa"])
def test_packed_logits_equal_each_problem_alone(placement: str, pos: str, path: str,
                                                sdpa_past: SdpaPast) -> None:
    """On CPU's own paths (the explicit one, normlab's kernel) and on SDPA's, which takes the
    block-diagonal mask on a GPU and on long CPU rows; under every positions option."""
    if path == "sdpa":
        sdpa_past(0)
    torch.manual_seed(0)
    model = build_model(ModelConfig(d_model=32, n_heads=2, n_layers=2, d_mlp=64, max_len=48,
                                    norm_placement=placement, pos_encoding=pos,
                                    n_aux_positions=8)).eval()
    packed = make_batch(PROBLEMS, "decoder", "lsd", True, pack=True)
    with torch.no_grad():
        logits = model(packed["tokens"], aux=packed["aux"], segments=packed["segments"])
        # no query attends across a problem's boundary (nor to the row's padding)
        _, cache = model.run_with_cache(packed["tokens"], aux=packed["aux"],
                                        segments=packed["segments"], names_filter=lambda n:
                                        n.endswith("hook_pattern"))
        seg = packed["segments"]
        other = (seg[:, :, None] != seg[:, None, :]) & (seg[:, :, None] != 0)
        for pattern in cache.values():
            assert pattern.shape[1:2] == (2,) and not pattern.masked_fill(
                ~other[:, None], 0).any()
        checked = 0
        for r in range(packed["tokens"].shape[0]):
            seg = packed["segments"][r]
            for s in seg.unique().tolist():
                if s == 0:
                    continue
                cols = (seg == s).nonzero().squeeze(1)
                alone = model(packed["tokens"][r, cols][None], aux=packed["aux"][r, cols][None])
                torch.testing.assert_close(logits[r, cols], alone[0], atol=1e-5, rtol=1e-5)
                checked += 1
    assert checked == len(PROBLEMS)


def test_packed_loss_equals_unpacked_loss() -> None:
    torch.manual_seed(1)
    model = build_model(ModelConfig(d_model=32, n_heads=2, n_layers=2, d_mlp=64,
                                    n_aux_positions=8)).eval()
    rng = random.Random(0)
    probs = [sample_problem(n, d, rng) for n, d in [(1, 1), (2, 3), (3, 2), (1, 2), (4, 1)] * 6]
    with torch.no_grad():
        a, n_a = loss_on(model, make_batch(probs, "decoder", "lsd", True))
        b, n_b = loss_on(model, make_batch(probs, "decoder", "lsd", True, pack=True))
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert n_a == n_b
    # and it is not trivially equal: without segments the packed rows leak across problems
    packed = make_batch(probs, "decoder", "lsd", True, pack=True)
    with torch.no_grad():
        leak = model(packed["tokens"], aux=packed["aux"])
        leaked = F.cross_entropy(leak.flatten(0, 1), packed["targets"].flatten(),
                                 ignore_index=IGNORE_INDEX)
    assert not torch.allclose(leaked, a, atol=1e-4)


def test_packed_stream_resumes_exactly() -> None:
    cells = [Cell(1, 1), Cell(2, 2), Cell(4, 1)]
    s1 = TrainStream(cells, seed=3, batch_size=16, arch="decoder", pack=True)
    next(s1)
    state = json.loads(json.dumps(s1.state_dict()))
    want = next(s1)
    s2 = TrainStream(cells, seed=99, batch_size=16, arch="decoder", pack=True)
    s2.load_state_dict(state)
    got = next(s2)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)


def test_bad_pack_config_is_one_line() -> None:
    with pytest.raises(ValueError, match=r"task\.pack: expected bool; got int 1"):
        load_config(None, ["task.pack=1"])
    with pytest.raises(ValueError, match=r"task\.pack: needs model\.arch = 'decoder'"):
        load_config(None, ["task.pack=true", "model.arch='encoder_decoder'"])
    with pytest.raises(ValueError, match="pack needs arch 'decoder'"):
        make_batch(PROBLEMS, "encoder_decoder", pack=True)
    # the stream took both (it failed at its first batch, and packed for "no"); a bare
    # question was "too many values to unpack"
    with pytest.raises(ValueError, match=r"^pack needs arch 'decoder'; got 'encoder_decoder'"):
        TrainStream([Cell(1, 1)], 0, 4, "encoder_decoder", pack=True)
    with pytest.raises(ValueError, match=r"^pack: expected true or false; got 'no'"):
        TrainStream([Cell(1, 1)], 0, 4, "decoder", pack="no")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^problems\[0\]: expected a \(question, answer\) "
                                         r"pair; got '1\+2'"):
        make_batch(["1+2"], "decoder")  # type: ignore[list-item]
    model = build_model(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_mlp=32))
    tokens = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"segments: expected shape \(2, 5\)"):
        model(tokens, segments=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="segments: only for a causal forward"):
        model(tokens, segments=torch.ones(2, 5, dtype=torch.long), cache=model.new_cache())


@pytest.mark.parametrize("pos", ["learned", "rope"])
def test_a_segment_id_used_again_later_is_another_problem(pos: str) -> None:
    """Positions restart at each run of an id, and so does attention: the third run of
    [1, 1, 1, 2, 2, 2, 1, 1, 1] saw the first run's tokens (same id), its logits 0.076 off its
    own; the packer numbers segments uniquely, a direct caller need not."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(d_model=16, n_heads=2, n_layers=2, d_mlp=32, max_len=16,
                                    pos_encoding=pos, init_std=0.3)).eval()
    tokens = torch.randint(0, 16, (1, 9))
    reused = torch.tensor([[1, 1, 1, 2, 2, 2, 1, 1, 1]])
    unique = torch.tensor([[1, 1, 1, 2, 2, 2, 3, 3, 3]])
    with torch.no_grad():
        got = model(tokens, segments=reused)
        torch.testing.assert_close(got, model(tokens, segments=unique), rtol=0, atol=0)
        torch.testing.assert_close(got[:, 6:], model(tokens[:, 6:]), atol=1e-5, rtol=1e-5)


def test_packed_training_learns_and_resumes_bitwise(tmp_path: Path) -> None:
    tiny = ["task.grid='smoke'", "task.pack=true", "model.d_model=32", "model.n_layers=1",
            "model.n_heads=2", "model.d_mlp=64", "train.batch_size=32", "train.warmup_steps=5",
            "train.log_every=5", "train.eval_examples=16", "task.eval_size=32",
            "train.steps=30", "train.checkpoint_every=10", "train.eval_every=30"]
    c = load_config(None, tiny)
    train(c, tmp_path / "straight", progress=False)
    train(c, tmp_path / "killed", progress=False, stop_after=15)
    train(c, tmp_path / "killed", progress=False, resume=True)

    def weights(run: Path) -> dict[str, torch.Tensor]:
        return load_file(list_checkpoints(run / "checkpoints")[-1].with_suffix(".safetensors"))

    a, b = weights(tmp_path / "straight"), weights(tmp_path / "killed")
    assert all(torch.equal(a[k], b[k]) for k in a)
    rec = [json.loads(x) for x in (tmp_path / "straight/metrics.jsonl").open()]
    assert rec[0]["loss"] > rec[-1]["loss"]  # it trains
