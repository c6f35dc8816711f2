"""Teacher-forced answer-token accuracy against oracle models whose answers are known."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch import nn

from normlab import ModelConfig, build_model
from normlab.evaluate import answer_token_accuracy, forward_batch, predict
from normlab.tasks.addition import EOS, VOCAB, Cell, make_batch


class PeekingDecoder(nn.Module):
    """Predicts every next token by reading it; `miss_first` gets each first answer token wrong
    (with `negative_only`, only where it is the sign N: a negative answer's, written msd)."""

    def __init__(self, miss_first: bool = False, negative_only: bool = False) -> None:
        super().__init__()
        self.cfg = ModelConfig(arch="decoder")
        self.miss_first, self.negative_only = miss_first, negative_only

    def forward(self, tokens: torch.Tensor, aux: torch.Tensor | None = None) -> torch.Tensor:
        self.seen_training = self.training  # the mode a forward ran in
        nxt = tokens.roll(-1, dims=1)
        if self.miss_first:  # the token after the first E (the separator) is the first answer
            sep = (tokens == EOS).int().argmax(1)
            rows = torch.arange(len(tokens))
            if self.negative_only:
                rows = rows[nxt[rows, sep] == VOCAB.index("N")]
                sep = sep[rows]
            nxt[rows, sep] = (nxt[rows, sep] + 1) % len(VOCAB)
        return nn.functional.one_hot(nxt, len(VOCAB)).float()


def problems(n: int = 40, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    return [Cell(2, 2).sample(rng) for _ in range(n)] + [Cell(1, 1).sample(rng) for _ in range(n)]


@pytest.mark.parametrize("fmt", ["msd", "lsd", "lsd_complement"])
def test_a_model_that_reads_the_answer_is_right_everywhere(fmt: str) -> None:
    probs = problems()
    res = answer_token_accuracy(PeekingDecoder(), probs, answer_format=fmt, batch_size=16)
    assert res["count"] == len(probs) and res["exact"] == 1.0
    assert res["by_position"] == [1.0] * len(res["by_position"])
    longest = max(len(a) for _, a in probs) + 1  # answer tokens + the closing E
    assert len(res["by_position"]) == longest
    assert res["position_counts"][0] == len(probs)
    assert res["position_counts"][-1] == sum(len(a) + 1 == longest for _, a in probs)


def test_a_wrong_first_token_shows_at_position_zero_only() -> None:
    probs = problems()
    res = answer_token_accuracy(PeekingDecoder(miss_first=True), probs, answer_format="lsd")
    assert res["by_position"][0] == 0.0 and res["by_position"][1:] == [1.0] * (
        len(res["by_position"]) - 1)
    assert res["exact"] == 0.0
    assert res["first_token"] == {"negative": 0.0, "positive": 0.0}
    # wrong only on the sign: the split by the answer's sign must say which (a swapped split
    # passed, both halves being 0)
    res = answer_token_accuracy(PeekingDecoder(miss_first=True, negative_only=True), probs,
                                answer_format="msd")
    assert res["first_token"] == {"negative": 0.0, "positive": 1.0}
    negative = sum(a.startswith("N") for _, a in probs)
    assert 0 < negative < len(probs) and res["exact"] == 1 - negative / len(probs)
    # exact fractions, not float32's (43/80 was written 0.53750002384...)
    assert res["by_position"][0] == (len(probs) - negative) / len(probs)


@pytest.mark.parametrize("training", [False, True])
def test_the_model_comes_back_in_its_mode(training: bool) -> None:
    """Scored in eval mode (no dropout), then handed back in the mode it came in: a `finally`
    that set train(True) passed, and left an eval-mode model's next forward with dropout."""
    model = PeekingDecoder().train(training)
    answer_token_accuracy(model, problems(4), answer_format="msd")
    assert model.seen_training is False
    assert model.training is training


@pytest.mark.parametrize("batch_size", [0, -1, True, 1.5])
def test_a_batch_size_is_a_number_of_questions(batch_size: object) -> None:
    """-1 gave `predict` no answers and no error; 0 was range()'s error, naming no argument."""
    from normlab.evaluate import evaluate
    from normlab.tasks.addition import TaskConfig, eval_sets

    match = r"^batch_size: expected an int >= 1 questions a forward; got "
    with pytest.raises(ValueError, match=match):
        predict(PeekingDecoder(), ["1+2"], "decoder", "msd", 3, batch_size)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=match):
        answer_token_accuracy(PeekingDecoder(), problems(), answer_format="msd",
                              batch_size=batch_size)  # type: ignore[arg-type]
    task = TaskConfig(grid="smoke", eval_size=4).resolve()
    with pytest.raises(ValueError, match=match):
        evaluate(PeekingDecoder(), task, eval_sets(task),  # type: ignore[arg-type]
                 batch_size=batch_size)  # type: ignore[arg-type]


def test_no_splits_is_an_error() -> None:
    """`evaluate(model, task, {})` returned {'splits': {}}, an eval.json no reader takes."""
    from normlab.evaluate import evaluate
    from normlab.tasks.addition import TaskConfig

    with pytest.raises(ValueError, match=r"^sets: expected at least one split of problems"):
        evaluate(PeekingDecoder(), TaskConfig(grid="smoke").resolve(), {})  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_greedy_exact_match_never_beats_teacher_forced(arch: str, tmp_path) -> None:
    """A greedy answer that is right saw right prefixes, so teacher forcing gets it right too.
    On a model that gets some answers right (a random one got none: 0 <= 0 <= 0 held whatever
    was scored): 300 steps on the smoke grid learn its one-digit sums, not yet its 3-term ones."""
    from conftest import TINY_RUN
    from normlab.config import load_config
    from normlab.train import load_run, train

    extra = ["train.steps=300", "train.eval_every=300", "train.checkpoint_every=300",
             f"model.arch='{arch}'", "model.n_encoder_layers=1", "model.n_decoder_layers=1"]
    cfg = load_config(None, [*TINY_RUN, *extra])
    train(cfg, tmp_path / "run", progress=False)
    _, model, _ = load_run(tmp_path / "run")
    fmt = cfg.task.resolve().answer_format
    rng = random.Random(0)
    probs = [Cell(1, 1).sample(rng) for _ in range(30)] + [Cell(3, 1).sample(rng)
                                                          for _ in range(30)]
    tf = answer_token_accuracy(model, probs, answer_format=fmt)
    greedy = predict(model, [q for q, _ in probs], arch, fmt, max_new=6)
    greedy_exact = sum(g == a for g, (_, a) in zip(greedy, probs, strict=True)) / len(probs)
    pairs = zip(tf["by_position"], tf["position_counts"], strict=True)
    full = [a for a, c in pairs if c == len(probs)]
    assert 0 < greedy_exact <= tf["exact"] <= min(full) < 1


def test_wilson_interval_matches_its_closed_forms() -> None:
    """At 0 of n the Wilson interval is [0, z²/(n + z²)], at n of n its mirror, and at half
    it is centred on 1/2 with half-width z·sqrt(n/4 + z²/4)/(n + z²), z the normal's 97.5%
    quantile to double precision (1.96 was its rounding). The 5-of-10 bounds are the
    textbook's 0.2366 and 0.7634."""
    from normlab.evaluate import wilson_ci

    z2 = 1.959963984540054**2
    assert wilson_ci(0, 10) == (0.0, pytest.approx(z2 / (10 + z2), rel=1e-12))
    assert wilson_ci(10, 10) == (pytest.approx(10 / (10 + z2), rel=1e-12), 1.0)
    half = 1.959963984540054 * (10 / 4 + z2 / 4) ** 0.5 / (10 + z2)
    assert wilson_ci(5, 10) == pytest.approx((0.5 - half, 0.5 + half), rel=1e-12)
    assert wilson_ci(5, 10) == pytest.approx((0.2366, 0.7634), abs=5e-5)
    assert wilson_ci(0, 0) == (0.0, 1.0)  # nothing asked: every accuracy possible


@pytest.mark.parametrize("counts", [(3, -2), (5, 3), (-1, 10), (1, float("inf")), (2.5, 5),
                                    (1, float("nan"))])
def test_wilson_interval_refuses_impossible_counts(counts: tuple[int, int]) -> None:
    """(3, -2) read (5.77, -0.42), an interval outside [0, 1]; (5, 3) a bare math error; (1,
    inf) read (0, 0) and (2.5, 5) an interval of half an answer. Whole floats still count
    (the collapse sweep passes sums of flips)."""
    from normlab.evaluate import wilson_ci

    with pytest.raises(ValueError, match=r"^wilson_ci: expected whole counts 0 <= correct <= "
                                         r"count; got"):
        wilson_ci(*counts)
    assert wilson_ci(3.0, 10.0) == wilson_ci(3, 10)


def test_a_cell_longer_than_the_tasks_is_refused() -> None:
    """Decoding stops after the task's `max_new` tokens: a longer cell's right answers were cut
    to wrong ones (a perfect model read 42% on n2d7 of the quick grid). A shorter cell that the
    task does not list is evaluated."""
    from normlab.evaluate import evaluate
    from normlab.tasks.addition import TaskConfig

    task = TaskConfig(grid="smoke").resolve()
    model = build_model(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_mlp=32))
    rng = random.Random(0)
    long = Cell(2, 7)
    with pytest.raises(ValueError, match=r"^sets\['x'\]: cell n2d7 has questions up to 17 and "
                                         r"answers up to 9 characters, past the task's"):
        evaluate(model, task, {"x": {long: [long.sample(rng)]}})
    with pytest.raises(ValueError, match=r"^sets\['x'\]: expected Cell keys; got 'n1d1'"):
        evaluate(model, task, {"x": {"n1d1": [("1+1", "2")]}})  # type: ignore[dict-item]
    short = Cell(1, (1, 2))
    assert short not in task.all_cells
    res = evaluate(model, task, {"x": {short: [short.sample(rng) for _ in range(3)]}})
    assert res["splits"]["x"]["count"] == 3


def test_no_problems_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one problem"):
        answer_token_accuracy(PeekingDecoder(), [], answer_format="msd")


def test_a_limit_is_a_number_of_examples_or_none() -> None:
    """`limit` slices every cell: 0 or -1 would silently evaluate none, or all but the last."""
    from normlab.evaluate import evaluate
    from normlab.tasks.addition import TaskConfig, eval_sets

    task = TaskConfig(grid="smoke", eval_size=4).resolve()
    sets = eval_sets(task)
    model = build_model(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_mlp=32))

    def oracle(qs: list[str]) -> list[str]:
        return [answers[q] for q in qs]

    answers = {q: a for by in sets.values() for probs in by.values() for q, a in probs}
    res = evaluate(model, task, sets, limit=2, predictor=oracle)
    assert all(s["count"] == 2 * len(sets[n]) and s["accuracy"] == 1.0
               for n, s in res["splits"].items())
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match=r"^limit: expected an int >= 1"):
            evaluate(model, task, sets, limit=bad, predictor=oracle)
    # a split (or every cell of one) without problems: an accuracy of 0.0 from count 0 read as
    # measured
    empty = {"train": sets["train"], "extra": {cell: [] for cell in sets["train"]}}
    with pytest.raises(ValueError, match=r"^sets\['extra'\]: expected at least one problem"):
        evaluate(model, task, empty, predictor=oracle)


def test_a_splits_accuracy_is_over_its_questions_not_its_cells() -> None:
    """Sets passed to `evaluate` may give cells unequal numbers of questions: a split's
    accuracy is right answers over questions (3 of 4 here), not the mean of its cells' (1/2),
    which the command's equal-sized cells cannot tell apart."""
    from normlab.evaluate import evaluate
    from normlab.tasks.addition import TaskConfig, eval_sets

    task = TaskConfig(grid="smoke", eval_size=4).resolve()
    (a, pa), (b, pb) = list(eval_sets(task)["train"].items())[:2]
    sets = {"train": {a: pa[:3], b: pb[:1]}}
    model = build_model(ModelConfig(d_model=16, n_heads=2, n_layers=1, d_mlp=32))
    right = dict(pa[:3])  # right on a's three questions, wrong on b's one
    res = evaluate(model, task, sets, predictor=lambda qs: [right.get(q, "x") for q in qs])
    assert res["splits"]["train"]["count"] == 4
    assert res["splits"]["train"]["accuracy"] == 0.75


def test_a_heatmap_title_fits_its_figure(tmp_path, monkeypatch) -> None:
    """On a small grid the one-line title ran off both edges, cutting off the placement and
    seed heatmaps are told apart by; it is wrapped to the figure's width. A cell short of every
    answer never reads 100."""
    import normlab.evaluate as ev

    drawn = {}
    monkeypatch.setattr(ev, "save_figure", lambda fig, path: drawn.update(fig=fig))
    cells = [{"n": n, "d": d, "accuracy": a, "count": 256}
             for n, d, a in ((1, 1, 255 / 256), (3, 1, 1.0), (1, 2, 0.5))]
    title = ("qkv seed 3, step 9000: exact match %, the first 256 questions a cell (red: train "
             "cells)")
    ev.heatmap({"cells": cells}, [Cell(1, 1)], tmp_path / "h.png", title=title)
    fig = drawn["fig"]
    fig.canvas.draw()
    ax = fig.axes[0]
    box, edge = ax.title.get_window_extent(), fig.bbox
    assert ax.title.get_text().replace("\n", " ") == title and "\n" in ax.title.get_text()
    assert edge.x0 <= box.x0 and box.x1 <= edge.x1
    assert sorted(t.get_text() for t in ax.texts) == ["100", "50", "99"]


def test_a_heatmap_outlines_each_train_cell_in_red(tmp_path, monkeypatch) -> None:
    """The title says "red: train cells": no outline at all passed. One red square on each
    train cell of the grid, centred on it (row i = n, column j = d, as `imshow` draws)."""
    from matplotlib.colors import same_color
    from matplotlib.patches import Rectangle

    import normlab.evaluate as ev

    drawn = {}
    monkeypatch.setattr(ev, "save_figure", lambda fig, path: drawn.update(fig=fig))
    cells = [{"n": n, "d": d, "accuracy": 0.5, "count": 8} for n in (1, 3) for d in (1, 2)]
    ev.heatmap({"cells": cells}, [Cell(1, 1), Cell(3, 1)], tmp_path / "h.png")
    patches = drawn["fig"].axes[0].patches
    assert all(isinstance(p, Rectangle) and same_color(p.get_edgecolor(), "red")
               and not p.get_fill() and (p.get_width(), p.get_height()) == (1, 1)
               for p in patches)
    # n1d1 at row 0, column 0; n3d1 at row 1 (n = 3 is the second n), column 0
    assert sorted(p.get_xy() for p in patches) == [(-0.5, -0.5), (-0.5, 0.5)]


def test_a_heatmap_of_mixed_digit_cells_only_says_so(tmp_path) -> None:
    """With no cell of one digit count the grid was empty: a blank PNG and three matplotlib
    warnings. The figure now says where the cells are, and warns of nothing."""
    import warnings

    from normlab.evaluate import heatmap

    result = {"cells": [{"n": 2, "d": [1, 2], "accuracy": 0.5, "count": 4}]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        heatmap(result, [], tmp_path / "h.png")
    assert (tmp_path / "h.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_encoder_decoder_tokens_count_the_question_too() -> None:
    """`tokens_per_s` counts real input tokens, question included: a count of the answer
    targets alone (12 of these 32) passed. Either arch reads the same tokens of a problem:
    `B question E` and `answer E` (the decoder's `B question E answer E` in one row)."""
    probs = [("12+34", "46"), ("N5-7", "N12"), ("999+1", "1000")]
    question = (1 + 5 + 1) + (1 + 4 + 1) + (1 + 5 + 1)  # B question E, padding left out
    answer = (2 + 1) + (3 + 1) + (4 + 1)  # answer E
    for arch in ("encoder_decoder", "decoder"):
        model = build_model(ModelConfig(arch=arch, d_model=16, n_heads=2, n_layers=1,
                                        n_encoder_layers=1, n_decoder_layers=1, d_mlp=32))
        _, _, n_tok = forward_batch(model, make_batch(probs, arch, "msd"))
        assert n_tok.shape == () and int(n_tok) == question + answer == 32, arch


@pytest.mark.parametrize(("right", "count", "ci95"), [
    (4, 8, [0.49, 0.51]),  # compare printed "50.0 [49.0, 51.0]" for 4 of 8
    (100, 6000, None),  # an edited 100 of 6000 that kept 1 of 60's interval
], ids=["4_of_8", "100_of_6000"])
def test_an_eval_json_whose_interval_is_not_its_accuracys_is_refused(
        tmp_path, right: int, count: int, ci95: list[float] | None) -> None:
    """`compare` prints an eval.json's ci95 as it reads it, so one that is not the Wilson
    interval of its accuracy and count is refused in one line naming the file: no test held
    that check, and a reader taking every interval passed. The true interval (to 1e-5, as
    files written when z was 1.96 are up to 1.1e-6 off) is read: 4 of 8 is 50.0 [21.5, 78.5]."""
    import json

    from normlab.cli import compare_rows
    from normlab.evaluate import wilson_ci

    def write(run: str, split: dict) -> Path:
        (tmp_path / run).mkdir()
        doc = {"splits": {"train": split}, "cells": [],
               "config": {"model": {"norm_placement": "pre"}, "train": {"seed": 0}}}
        (tmp_path / run / "eval.json").write_text(json.dumps(doc))
        return tmp_path / run

    ci95 = ci95 if ci95 is not None else list(wilson_ci(1, 60))
    bad = write("bad", {"accuracy": right / count, "count": count, "ci95": ci95})
    with pytest.raises(ValueError) as err:
        compare_rows([bad])
    msg = str(err.value)
    assert msg.startswith(f"{str(bad / 'eval.json')!r}: expected normlab eval results")
    assert "\n" not in msg
    good = write("good", {"accuracy": 0.5, "count": 8,
                          "ci95": [x + 1e-6 for x in wilson_ci(4, 8)]})
    _, rows = compare_rows([good])
    assert rows[0][-1] == "50.0 [21.5, 78.5]"
