"""Verdict rules, CI over seeds, sweep configs: synthetic inputs with known answers."""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import re
import shutil
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from normlab.config import load_config
from normlab.report import claims_table
from normlab.stats import mean_ci, verdict_band, verdict_sign, wilson_ci
from normlab.sweep import load_sweep


def test_mean_ci_hand_computed() -> None:
    m, (lo, hi) = mean_ci([1.0, 3.0])  # sd = sqrt(2), t(1) = 12.706
    assert m == 2.0
    assert hi - m == pytest.approx(12.706 * math.sqrt(2) / math.sqrt(2))
    m, (lo, hi) = mean_ci([0.5])
    assert m == 0.5 and math.isinf(lo) and math.isinf(hi)
    with pytest.raises(ValueError):
        mean_ci([])


def test_an_interval_is_clipped_to_what_the_values_can_take() -> None:
    """A collapse rate's t-interval read [-0.42%, 0.59%]: no rate is below 0. Clipped to the
    values' support, a mean's interval keeps its coverage (the mean lies there too)."""
    m, (lo, hi) = mean_ci([0.0, 0.002])  # sd = 0.002 / sqrt(2), half = 12.706 * 0.001
    assert m == pytest.approx(0.001) and lo == pytest.approx(0.001 - 0.012706)
    m, (lo, hi) = mean_ci([0.0, 0.002], support=(0, 1))
    assert lo == 0 and hi == pytest.approx(0.001 + 0.012706)
    _, (lo, hi) = mean_ci([0.999, 1.0], support=(0, 1))
    assert lo == pytest.approx(0.9995 - 12.706 * 0.0005) and hi == 1
    _, (lo, hi) = mean_ci([0.3, 0.31], support=(0, 1))  # inside the support: unchanged
    assert (lo, hi) == mean_ci([0.3, 0.31])[1] and lo > 0
    _, (lo, hi) = mean_ci([0.5], support=(0, 1))  # one value: still no interval
    assert math.isinf(lo) and math.isinf(hi)
    with pytest.raises(ValueError, match=r"expected values in \[0, 1\]; got \[0.5, 1.5\]"):
        mean_ci([0.5, 1.5], support=(0, 1))
    # the claims: rates of 0.0% and 0.2% give an interval from 0, with the same verdict
    runs = {"pre": {s: _run("pre", s, 0.99, 0.5, 0.2, rate) for s, rate in ((0, 0.0),
                                                                            (1, 0.002))}}
    h2 = {r["id"]: r for r in claims_table(runs)}["H2"]
    assert h2["ci95"][0] == 0 and h2["ci95"][1] == pytest.approx(0.013706)
    assert h2["verdict"] == "inconclusive"


def test_t_quantiles_past_the_table_match_published_values() -> None:
    """Beyond 30 degrees of freedom the interval used the normal's 1.96 (about 4% narrow at
    31). Published two-sided 95% t quantiles: df 31 2.0395, 40 2.0211, 60 2.0003, 120 1.9799."""
    from normlab.stats import t975

    assert t975(1) == 12.706 and t975(30) == 2.042
    for df, published in ((31, 2.0395), (40, 2.0211), (60, 2.0003), (120, 1.9799)):
        assert abs(t975(df) - published) < 2e-4
    m, (lo, hi) = mean_ci([float(v % 2) for v in range(41)])  # 41 seeds, 40 degrees of freedom
    sd = math.sqrt(sum((v % 2 - m) ** 2 for v in range(41)) / 40)
    assert abs((hi - lo) / 2 - 2.0211 * sd / math.sqrt(41)) < 1e-4


def test_verdict_rules() -> None:
    assert verdict_band((0.15, 0.25), 0.1, 0.4) == "agrees"
    assert verdict_band((0.5, 0.7), 0.1, 0.4) == "disagrees"
    assert verdict_band((0.01, 0.05), 0.1, 0.4) == "disagrees"
    assert verdict_band((0.05, 0.2), 0.1, 0.4) == "inconclusive"
    assert verdict_band((-math.inf, math.inf), 0.1, 0.4) == "inconclusive"
    assert verdict_sign((-0.3, -0.1)) == "agrees"
    assert verdict_sign((0.1, 0.3)) == "disagrees"
    assert verdict_sign((-0.1, 0.1)) == "inconclusive"
    # the band's edges count as inside it, and an interval touching 0 decides no sign
    assert verdict_band((0.1, 0.4), 0.1, 0.4) == "agrees"
    assert verdict_band((0.0, 0.1), 0.1, 0.4) == "inconclusive"
    assert verdict_band((0.4, 0.5), 0.1, 0.4) == "inconclusive"
    assert verdict_sign((-0.2, 0.0)) == verdict_sign((0.0, 0.2)) == "inconclusive"
    assert verdict_sign((0.1, 0.3), expect_negative=False) == "agrees"


def _run(placement: str, seed: int, train: float, held: float, h90: float, rate: float):
    ev = {"config": {"model": {"norm_placement": placement}, "train": {"seed": seed}},
          "checkpoint": {"step": 100},
          # the interval of the nearest count (read from a file, where it must be its own)
          "splits": {split: {"accuracy": acc, "count": n,
                             "ci95": list(wilson_ci(round(acc * n), n))}
                     for split, acc, n in (("train", train, 1280), ("interpolation", held, 256),
                                           ("extrapolation", held, 768))}}
    norms = {"summary": {"all": {"h90": h90}}}
    col = {"sigmas": [0.0, 0.1], "collapse_rate": [0.0, rate], "n_sparse_rows": 4000,
           "draws_per_sigma": [1, 32]}
    return {"eval": ev, "norms": norms, "collapse": col, "dir": Path(f"{placement}-s{seed}")}


def test_claims_table_on_synthetic_runs() -> None:
    runs = {
        "pre": {0: _run("pre", 0, 0.99, 0.50, 0.20, 0.010),
                1: _run("pre", 1, 0.99, 0.52, 0.21, 0.011),
                2: _run("pre", 2, 0.99, 0.51, 0.19, 0.009)},
        "qkv": {0: _run("qkv", 0, 0.99, 0.20, 0.05, 0.001),
                1: _run("qkv", 1, 0.985, 0.22, 0.05, 0.001),
                2: _run("qkv", 2, 0.995, 0.21, 0.05, 0.001)},
    }
    rows = {r["id"]: r for r in claims_table(runs)}
    assert rows["H1"]["verdict"] == "agrees" and rows["H1"]["ours"] == pytest.approx(0.2)
    assert rows["H2"]["verdict"] == "agrees" and rows["H2"]["ours"] == pytest.approx(0.01)
    assert rows["H3"]["verdict"] == "agrees"
    assert rows["H4"]["verdict"] == "agrees" and rows["H4"]["ours"] == pytest.approx(-0.3)
    # every seed's difference is -0.30, so H4's interval is the floor alone, by hand: a
    # held-out accuracy is the mean of two splits (256 and 768 questions), each of variance
    # Agresti-Coull's p~ (1 - p~) / (n + 4), p~ = (p n + 2) / (n + 4); three seeds, t(2)
    def ac(p: float, n: int) -> float:
        pt = (p * n + 2) / (n + 4)
        return pt * (1 - pt) / (n + 4)

    v4 = [sum(ac(p, 256) + ac(p, 768) for p in pair) / 4
          for pair in ((0.50, 0.20), (0.52, 0.22), (0.51, 0.21))]
    half = 4.303 * math.sqrt(sum(v4) / 3) / math.sqrt(3)
    assert rows["H4"]["ci95"] == pytest.approx([-0.3 - half, -0.3 + half])
    assert half == pytest.approx(0.0576, abs=1e-4)
    # flip H4: QKV-Norm better out of distribution
    for s in runs["qkv"]:
        runs["qkv"][s]["eval"]["splits"]["extrapolation"]["accuracy"] = 0.9
        runs["qkv"][s]["eval"]["splits"]["interpolation"]["accuracy"] = 0.9
    assert {r["id"]: r for r in claims_table(runs)}["H4"]["verdict"] == "disagrees"
    # seeds just above H1's and H2's bands (h90 0.45 ± 0.01 against [0.10, 0.40], a collapse
    # rate of 2.5% ± 0.1% against [0.5%, 2%]): their intervals miss them, whose upper edges no
    # test pinned (widened, each verdict read "agrees")
    runs["pre"] = {s: _run("pre", s, 0.99, 0.5, h90, rate) for s, (h90, rate) in
                   enumerate([(0.44, 0.024), (0.45, 0.025), (0.46, 0.026)])}
    rows = {r["id"]: r for r in claims_table(runs)}
    assert rows["H1"]["ci95"][0] > 0.40 and rows["H1"]["verdict"] == "disagrees"
    assert rows["H2"]["ci95"][0] > 0.02 and rows["H2"]["verdict"] == "disagrees"
    # H3's band, ±2 points, whose edges no test pinned either (widened to +20 points, QKV-Norm
    # 5 points better read "agrees"): three seeds' differences d - 0.1, d and d + 0.1 points,
    # of a million questions each (the binomial floor negligible beside their spread), so by
    # hand the interval is d ± 4.303 * 0.001 / sqrt(3), d ± 0.25 points
    def h3(d: float) -> dict[str, Any]:
        runs = {p: {s: _run(p, s, 0.93 + (p == "qkv") * (d + (s - 1) * 0.001), 0.5, 0.2, 0.01)
                    for s in range(3)} for p in ("pre", "qkv")}
        for r in (*runs["pre"].values(), *runs["qkv"].values()):
            r["eval"]["splits"]["train"]["count"] = 10**6
        return {r["id"]: r for r in claims_table(runs)}["H3"]

    half = 4.303 * 0.001 / math.sqrt(3)
    assert h3(0.05)["ci95"] == pytest.approx([0.05 - half, 0.05 + half])
    for d, verdict in ((0.05, "disagrees"), (0.017, "agrees"), (0.018, "inconclusive"),
                       (0.022, "inconclusive"), (0.023, "disagrees")):
        assert (h3(d)["verdict"], h3(-d)["verdict"]) == (verdict, verdict), d
    # no runs at all: every claim inconclusive, nothing invented
    assert all(r["verdict"] == "inconclusive" and r["ours"] is None for r in claims_table({}))


def test_collect_refuses_two_runs_of_one_placement_and_seed(tmp_path: Path) -> None:
    """Runs are keyed by placement and seed: a second run of the same pair used to replace
    the first without a word, and a claim's mean over seeds silently lost it."""
    import json

    from normlab.report import collect, split_table

    for name, d_model in (("pre-d32-s0", 32), ("pre-d64-s0", 64)):
        (tmp_path / name).mkdir()
        ev = _run("pre", 0, 1.0, 0.5, 0.2, 0.01)["eval"]  # accuracies its counts can give
        ev["config"]["model"]["d_model"] = d_model
        (tmp_path / name / "eval.json").write_text(json.dumps(ev))
    assert list(collect([tmp_path / "pre-d32-s0"])["pre"]) == [0]
    with pytest.raises(ValueError, match=r"pre-d64-s0.*a second pre run with seed 0"):
        collect([tmp_path / "pre-d32-s0", tmp_path / "pre-d64-s0"])
    # a split only some placements have: a dash for the others, not an error
    runs = {"pre": {0: _run("pre", 0, 0.99, 0.5, 0.2, 0.01)},
            "qkv": {0: _run("qkv", 0, 0.99, 0.5, 0.2, 0.01)}}
    runs["qkv"][0]["eval"]["splits"]["long"] = {"accuracy": 0.25, "count": 256}
    table = split_table(runs)
    assert table[0] == ["placement", "seeds", "train", "interpolation", "extrapolation", "long"]
    assert table[1][-1] == "—" and table[2][-1] == "25.0"


def test_cli_zero_draws_or_examples_or_limit_is_refused(tmp_path: Path, capsys) -> None:
    """`--draws 0` and `--examples 0` used to mean "the default" (a truthiness test), and
    `--limit 0` evaluated nothing; each is now a one-line error naming its flag."""
    from normlab import cli

    for argv, field in ((["analyze", str(tmp_path), "--draws", "0"], "--draws"),
                        (["analyze", str(tmp_path), "--examples", "0"], "--examples"),
                        (["analyze", "--hf", str(tmp_path), "--seq-len", "0"], "--seq-len"),
                        (["analyze", str(tmp_path), "--seed", "-1"], "--seed"),
                        (["eval", str(tmp_path), "--limit", "0"], "--limit")):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        expected = {"--seed": "an int in [0, 2**63)", "--seq-len": "an int >= 2"}.get(
            field, "an int >= 1")
        assert err == f"normlab: error: {field}: expected {expected}; got {argv[-1]}"


def test_bad_sweep_configs(tmp_path: Path) -> None:
    f = tmp_path / "s.toml"
    f.write_text('[grid]\n"model.norm_placement" = ["pre"]\n[oops]\n')
    with pytest.raises(ValueError, match=r"sweep\.oops: unknown key"):
        load_sweep(f, tmp_path / "out")
    f.write_text("[grid]\n")
    with pytest.raises(ValueError, match=r"sweep\.grid: empty"):
        load_sweep(f, tmp_path / "out")
    f.write_text('[grid]\n"model.d_modle" = [1]\n')
    with pytest.raises(ValueError, match=r"model\.d_modle: unknown key"):
        load_sweep(f, tmp_path / "out")
    f.write_text('[grid]\n"train.seed" = []\n')
    with pytest.raises(ValueError, match="non-empty list"):
        load_sweep(f, tmp_path / "out")
    with pytest.raises(ValueError, match="not found"):
        load_sweep(tmp_path / "missing.toml", tmp_path / "out")
    # [run.analysis] is checked when the sweep is read, not after every run's training;
    # every error names the sweep file
    at = "^" + re.escape(f"sweep file {str(f)!r}: ")
    for run, match in (('analysis = {n_draw = 8}', r"sweep\.run\.analysis\.n_draw: unknown key "
                                                  r"\(did you mean 'n_draws'\?\)"),
                       ('analyse = true', r"sweep\.run\.analyse: unknown key \(did you mean "
                                          r"'analyze'\?\)"),
                       ('analysis = {sigmas = [-0.1]}', r"sweep\.run\.analysis: sigmas\[0\]: "),
                       ('analysis = {alpha = 0}', r"sweep\.run\.analysis: alpha: "),
                       ('analysis = {rows = "trained"}',
                        r"sweep\.run\.analysis: unknown rows 'trained'; expected one of all, "
                        r"loss"),
                       ('analysis = {alpha = inf}', r"sweep\.run\.analysis: alpha: "),
                       ('analysis = 3', r"sweep\.run\.analysis: expected a table"),
                       ('analysis = {figures = "no"}', r"sweep\.run\.analysis\.figures: "),
                       ('analysis = {heads = ["0"]}', r"sweep\.run\.analysis\.heads: "),
                       ('analysis = {splits = ["trian"]}',
                        r"sweep\.run\.analysis\.splits: unknown split 'trian'; .* \(run 0\)$"),
                       ('analyze = "yes"', r"sweep\.run\.analyze: expected true or false")):
        f.write_text(f'[grid]\n"train.seed" = [0]\n[run]\n{run}\n')
        with pytest.raises(ValueError, match=at + match):
            load_sweep(f, tmp_path / "out")
    f.write_text('[grid]\n"train.seed" = [0]\n[run]\nanalysis = {n_draws = 8, seed = 2}\n')
    assert load_sweep(f, tmp_path / "out")[0].analysis == {"n_draws": 8, "seed": 2}



def test_a_sweeps_analysis_is_checked_against_each_runs_model_when_read(tmp_path: Path) -> None:
    """Heads and sites were checked only once every run had trained (splits alone were checked
    when the sweep was read): now each run's model config is, by analyze_run's own checks."""
    f = tmp_path / "s.toml"
    at = "^" + re.escape(f"sweep file {str(f)!r}: sweep.run.analysis.")
    grid = '[grid]\n"model.n_heads" = [4, 2]\n"model.arch" = ["decoder"]\n"task.grid" = ["smoke"]\n'
    for analysis, match in (
            ("{heads = [99]}", r"heads: unknown head 99; expected an int in \[0, 4\) \(run 4-"),
            ("{heads = 3}", r"heads: unknown head 3; expected an int in \[0, 2\) \(run 2-"),
            ('{sites = ["blocks.9.attn"]}', r"sites: unknown attention site 'blocks\.9\.attn'"),
            ('{sites = ["blocks.0.attn", "blocks.0.attn"]}', r"sites: expected each attention "),
            ("{sites = []}", r"sites: expected at least one attention site"),
            ('{splits = ["train", "train"]}', r"splits: expected each split once")):
        f.write_text(grid + f"[run]\nanalysis = {analysis}\n")
        with pytest.raises(ValueError, match=at + match):
            load_sweep(f, tmp_path / "out")
    # an encoder-decoder's sites, as analyze_run names them; not checked where not analysed
    f.write_text(grid.replace('"decoder"', '"encoder_decoder"')
                 + '[run]\nanalysis = {sites = ["decoder.blocks.1.cross_attn"], heads = [1]}\n')
    assert len(load_sweep(f, tmp_path / "out")) == 2
    f.write_text(grid + "[run]\nanalyze = false\nanalysis = {heads = [99]}\n")
    assert len(load_sweep(f, tmp_path / "out")) == 2


def test_a_sweep_key_that_is_not_table_key_is_named_as_the_sweep_file_writes_it(
        tmp_path: Path) -> None:
    """`[grid] "d_model" = [32]` was refused as `--set 'd_model'`, a flag never typed."""
    f = tmp_path / "s.toml"
    at = "^" + re.escape(f"sweep file {str(f)!r}: ")
    for text, key in (('[grid]\n"d_model" = [32]\n', "grid.d_model"),
                      ('[grid]\n"train.seed" = [0]\n[set]\n"model.x.y" = 1\n', "set.model.x.y")):
        f.write_text(text)
        with pytest.raises(ValueError, match=at + re.escape(f"sweep.{key}: expected TABLE.KEY")):
            load_sweep(f, tmp_path / "out")


def test_sweep_values_reach_the_config_as_written(tmp_path: Path) -> None:
    """Grid and set values are written back as TOML for `load_config`: a string with an
    apostrophe or quotes, and lists, arrive as they were (an apostrophe used to leave
    quotes inside the value; a DEL, which TOML bars unescaped, arrived quotes and all)."""
    from normlab.sweep import _toml

    for v in ["it's", 'say "hi"', "back\\slash", "tab\tand\nline", "é", "", [1, "a'b"], 2.5,
              True, False, -0.0, 1e300, math.inf, -math.inf, 10**18, [], {},
              {"interpolation": [[3, 1]]}, {"a.b": {"it's": [{"x": 'q"'}]}, "": 1},
              [{"n": 1}, {"n": [2.5, True]}], datetime.datetime(1979, 5, 27, 7, 32),
              datetime.datetime(1979, 5, 27, 7, 32, 0, 999, tzinfo=datetime.UTC),
              datetime.date(1979, 5, 27), datetime.time(7, 32, 1), "del\x7fete"]:
        assert tomllib.loads(f"x = {_toml(v)}")["x"] == v, v
    assert math.isnan(tomllib.loads(f"x = {_toml(math.nan)}")["x"])
    # a table value (`task.splits`) was passed on as the text of a Python dict, and refused;
    # every run gets the values the sweep file holds, as `normlab train --set` gives them
    f = tmp_path / "s.toml"
    f.write_text('[grid]\n"train.seed" = [0, 1]\n"task.train" = [[[1, 1], [2, 1]], [[1, 2]]]\n'
                 '[set]\n"task.grid" = "smoke"\n"task.splits" = {interpolation = [[3, 1]], '
                 '"x-y" = [[3, [2, 3]]]}\n"train.lr" = 2e-3\n"train.compile" = false\n'
                 '"model.norm_placement" = "qkv"\n[run]\nanalyze = false\n')
    written = tomllib.loads(f.read_text())
    specs = load_sweep(f, tmp_path / "out")
    assert len(specs) == 4
    for spec in specs:
        for key, value in written["set"].items():
            table, name = key.split(".")
            assert spec.config[table][name] == value, key
    assert [s.config["task"]["train"] for s in specs] == written["grid"]["task.train"] * 2
    given = load_config(None, ["task.grid=smoke", "task.train=[[1, 2]]", "train.lr=2e-3",
                               "task.splits={interpolation=[[3,1]], x-y=[[3,[2,3]]]}",
                               "train.seed=1", "model.norm_placement=qkv"])
    assert specs[3].config == given.to_dict()


def test_sweep_expands_the_grid(tmp_path: Path) -> None:
    f = tmp_path / "s.toml"
    f.write_text('name = "{norm_placement}-s{seed}"\n[grid]\n'
                 '"model.norm_placement" = ["pre", "qkv"]\n"train.seed" = [0, 1, 2]\n'
                 '[set]\n"train.steps" = 7\n"task.grid" = "smoke"\n')
    specs = load_sweep(f, tmp_path / "out")
    assert [s.name for s in specs] == [f"{p}-s{i}" for p in ("pre", "qkv") for i in range(3)]
    assert all(s.config["train"]["steps"] == 7 for s in specs)
    assert specs[4].config["model"]["norm_placement"] == "qkv"
    assert specs[4].config["train"]["seed"] == 1


TINY_SET = ('[set]\n"task.grid" = "smoke"\n"task.eval_size" = 8\n"model.d_model" = 16\n'
            '"model.n_layers" = 1\n"model.d_mlp" = 32\n"train.steps" = 6\n'
            '"train.eval_every" = 6\n"train.checkpoint_every" = 3\n"train.eval_examples" = 4\n'
            '[run]\nanalyze = false\n')


# what analyze_run records of the checkpoint it analysed: the tiny runs' last is step 6
DONE_AT_6 = json.dumps({"checkpoint_step": 6})
# the least a norms.json and a collapse.json hold for the report (and so for the sweep) to read
NORMS = json.dumps({"summary": {"all": {"h90": 0.5}}})
COLLAPSE = json.dumps({"sigmas": [0.0], "collapse_rate": [0.0], "n_sparse_rows": 5,
                       "draws_per_sigma": [1]})


def _tiny_sweep(tmp_path: Path, seeds: str = "[0, 1]") -> Path:
    f = tmp_path / "s.toml"
    f.write_text(f'name = "{{norm_placement}}-s{{seed}}"\n[grid]\n"model.norm_placement" = '
                 f'["pre"]\n"train.seed" = {seeds}\n' + TINY_SET)
    return f


def test_local_sweep_runs_skips_and_resumes(tmp_path: Path) -> None:
    from normlab.config import RunConfig
    from normlab.sweep import execute
    from normlab.train import train

    specs = load_sweep(_tiny_sweep(tmp_path), tmp_path / "out")
    # a killed run: 4 of 6 steps done, checkpoint at 3, no eval yet
    train(RunConfig.from_dict(specs[1].config), Path(specs[1].out), progress=False, stop_after=4)
    # its first attempt's time, as the sweep records it: the rerun adds to it (it replaced it)
    (Path(specs[1].out) / "timings.json").write_text(json.dumps({"train": 100.0}))
    results = execute(specs, jobs=2, progress=False)
    assert all(r["ok"] for r in results), results
    took = json.loads((Path(specs[1].out) / "timings.json").read_text())
    assert 100.0 < took["train"] < 200.0 and set(took) == {"train", "eval"}
    by = {r["name"]: r for r in results}
    assert by["pre-s0"]["did"] == ["train", "eval"] and by["pre-s1"]["did"] == ["train", "eval"]
    assert "resuming" in (tmp_path / "out" / "pre-s1.log").read_text()
    again = execute(specs, jobs=1, progress=False)
    assert [r["did"] for r in again] == [[], []]  # nothing recomputed


def test_an_analysis_that_failed_part_way_is_run_again(tmp_path: Path, monkeypatch) -> None:
    """The sweep takes a run's analysis as done only once its last result file is written
    (it used to key on collapse.json, written before the interference probe)."""
    import dataclasses

    from normlab.analysis import report
    from normlab.sweep import run_one

    spec = dataclasses.replace(load_sweep(_tiny_sweep(tmp_path, "[0]"), tmp_path / "out")[0],
                               analyze=True)
    calls = []

    def analyze_run(out: Path, fail: bool = False, **kw) -> None:
        calls.append(kw)
        (out / "analysis").mkdir(exist_ok=True)
        (out / "analysis" / "collapse.json").write_text(COLLAPSE)
        if fail:
            raise ValueError("the interference probe failed")
        (out / "analysis" / "norms.json").write_text(NORMS)
        (out / "analysis" / "interference.json").write_text(DONE_AT_6)

    monkeypatch.setattr(report, "analyze_run", lambda out, **kw: analyze_run(out, True, **kw))
    with pytest.raises(ValueError, match="interference probe failed"):
        run_one(spec)
    monkeypatch.setattr(report, "analyze_run", analyze_run)
    assert run_one(spec)["did"] == ["analyze"]
    assert run_one(spec)["did"] == []
    assert len(calls) == 2


def test_a_finished_run_of_another_config_is_not_taken_as_done(tmp_path: Path) -> None:
    """A sweep (or `reproduce`) rerun after its config changed skipped the finished runs and
    kept their old results; the run's saved config must now be the spec's."""
    import dataclasses

    from normlab.sweep import run_one

    spec = load_sweep(_tiny_sweep(tmp_path, "[0]"), tmp_path / "out")[0]
    assert run_one(spec)["did"] == ["train", "eval"]
    assert run_one(spec)["did"] == []
    changed = dataclasses.replace(spec, config=spec.config | {
        "model": spec.config["model"] | {"d_mlp": 64}})
    # said in the sweep's words (it read "--resume: ... normlab train: --force", flags a
    # sweep user never gave), for a finished run and for one killed part way
    message = (r"^sweep: the config differs from the one saved in .*pre-s0' \(model\.d_mlp: "
               r"saved 32, given 64\); the sweep file changed since that run was made: give the "
               r"sweep another --out, or remove that run's folder$")
    with pytest.raises(ValueError, match=message):
        run_one(changed)
    (Path(spec.out) / "train_done.json").unlink()
    with pytest.raises(ValueError, match=message):
        run_one(changed)


def test_a_finished_analysis_with_other_settings_is_not_taken_as_done(
        tmp_path: Path, monkeypatch) -> None:
    """A sweep whose [run.analysis] changed kept each run's old analysis without a word; the
    settings collapse.json records must now be the ones asked for."""
    import dataclasses
    import json

    from normlab.analysis import report
    from normlab.sweep import run_one

    spec = dataclasses.replace(load_sweep(_tiny_sweep(tmp_path, "[0]"), tmp_path / "out")[0],
                               analyze=True, analysis={"n_draws": 8, "sigmas": [0, 0.1]})

    def analyze_run(out: Path, **kw) -> None:  # records params as the real one does
        folder = out / "analysis"
        folder.mkdir(exist_ok=True)
        params = report._recorded(**{k: v for k, v in ({
            "sigmas": [0.0, 0.1], "n_draws": 8, "threshold": 0.9, "mode": "token",
            "targets": ("q", "k", "v"), "noise": "normal", "n_examples": 256,
            "splits": ("train",), "sites": None, "heads": None, "alpha": 0.5}).items()})
        (folder / "collapse.json").write_text(json.dumps({"params": params, "seed": 0,
                                                          **json.loads(COLLAPSE)}))
        (folder / "norms.json").write_text(NORMS)
        (folder / "interference.json").write_text(DONE_AT_6)

    monkeypatch.setattr(report, "analyze_run", analyze_run)
    assert run_one(spec)["did"] == ["train", "eval", "analyze"]
    assert run_one(spec)["did"] == []  # the same settings: done
    # one split, site or head given alone is the list of one it is recorded as; and an
    # analysis recorded before this session, one split name as its letters, is the same
    same = {"n_draws": 8, "sigmas": [0, 0.1], "splits": "train"}
    assert run_one(dataclasses.replace(spec, analysis=same))["did"] == []
    doc = json.loads((Path(spec.out) / "analysis" / "collapse.json").read_text())
    doc["params"]["splits"] = list("train")
    (Path(spec.out) / "analysis" / "collapse.json").write_text(json.dumps(doc))
    assert run_one(spec)["did"] == []
    # a record from before `rows` was kept counted every row: the default, and only it
    del doc["params"]["rows"]
    (Path(spec.out) / "analysis" / "collapse.json").write_text(json.dumps(doc))
    assert run_one(dataclasses.replace(spec, analysis=same | {"rows": "all"}))["did"] == []
    for changed in ({"n_draws": 16, "sigmas": [0, 0.1]}, {"n_draws": 8, "sigmas": [0, 0.2]},
                    {"n_draws": 8, "sigmas": [0, 0.1], "seed": 1},
                    {"n_draws": 8, "sigmas": [0, 0.1], "rows": "loss"}):
        with pytest.raises(ValueError, match=r"holds an analysis with \w+ = .* is asked"):
            run_one(dataclasses.replace(spec, analysis=changed))


def test_results_made_before_the_sweep_resumed_training_are_made_again(
        tmp_path: Path, monkeypatch) -> None:
    """A run stopped at step 3 of 6, then `normlab eval` (and `analyze`) by hand: a sweep rerun
    trained on to step 6 but kept the step-3 eval.json and analysis, which the report pooled.
    They count as done only if made from the checkpoint training finished with."""
    import dataclasses

    from normlab.analysis import report
    from normlab.cli import eval_run
    from normlab.config import RunConfig
    from normlab.sweep import run_one
    from normlab.train import train

    spec = dataclasses.replace(load_sweep(_tiny_sweep(tmp_path, "[0]"), tmp_path / "out")[0],
                               analyze=True)
    out = Path(spec.out)
    train(RunConfig.from_dict(spec.config), out, progress=False, stop_after=3)
    assert eval_run(out)["checkpoint"]["step"] == 3
    (out / "analysis").mkdir()
    (out / "analysis" / "interference.json").write_text(json.dumps({"checkpoint_step": 3}))
    analysed = []

    def analyze_run(run: Path, **kw) -> None:  # records its checkpoint as the real one does
        analysed.append(run)
        (run / "analysis" / "norms.json").write_text(NORMS)
        (run / "analysis" / "collapse.json").write_text(COLLAPSE)
        (run / "analysis" / "interference.json").write_text(DONE_AT_6)

    monkeypatch.setattr(report, "analyze_run", analyze_run)
    assert run_one(spec)["did"] == ["train", "eval", "analyze"]
    assert json.loads((out / "eval.json").read_text())["checkpoint"]["step"] == 6
    assert sorted(p.name for p in out.glob(".*tmp")) == []  # replaced by a rename
    assert run_one(spec)["did"] == [] and len(analysed) == 1  # now done
    # a result that cannot be read is not taken as done either
    (out / "eval.json").write_text("{")
    assert run_one(spec)["did"] == ["eval"]
    # the final checkpoint damaged: the newest that verifies is step 3's, and the run fails
    # (an eval.json from it is no result of the finished training)
    (out / "checkpoints" / "step_0000006.safetensors").write_bytes(b"damaged")
    (out / "eval.json").unlink()
    with pytest.raises(ValueError, match=r"made from checkpoint step 3, but training finished "
                                         r"at step 6, whose checkpoint does not verify"):
        run_one(spec)


def test_a_backend_refuses_the_options_it_would_not_use(tmp_path: Path, capsys) -> None:
    """`--address` with the local backend (and `--jobs` with Ray) were dropped unseen."""
    from normlab.cli import main

    f = _tiny_sweep(tmp_path, "[0]")
    for flags, msg in ((["--jobs", "1", "--address", "ray://nowhere:10001"],
                        "--address: only with --backend ray"),
                       (["--backend", "ray", "--jobs", "2"], "--jobs: only with --backend local")):
        assert main(["sweep", "--config", str(f), "--out", str(tmp_path / "out"), *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"normlab: error: {msg}; ") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()


def test_ray_gives_each_run_its_own_threads(tmp_path: Path, monkeypatch) -> None:
    """Every Ray task asked for the fewest `train.threads` of any run, not its own."""
    import sys
    import types
    from concurrent.futures import Future

    from normlab import sweep

    asked: list[dict] = []

    class Remote:
        def __init__(self, **kw) -> None:
            self.kw = kw

        def options(self, **kw) -> Remote:
            return Remote(**self.kw | kw)

        def remote(self, spec: sweep.RunSpec, device: str) -> Future:
            asked.append(self.kw)
            done: Future = Future()  # a result in hand, as a Ray object ref would give
            done.set_result({"ok": True, "name": spec.name, "did": [], "seconds": 0.0})
            return done

    gpus = {"GPU": 0}
    fake = types.SimpleNamespace(is_initialized=lambda: True,
                                 cluster_resources=lambda: dict(gpus),
                                 remote=lambda fn: Remote(),  # ray.remote(f), as Ray's
                                 wait=lambda refs, **kw: (refs[:1], refs[1:]),
                                 nodes=lambda: [{"Alive": True, "Resources": {"CPU": 4}}])
    monkeypatch.setitem(sys.modules, "ray", fake)
    specs = load_sweep(_tiny_sweep(tmp_path), tmp_path / "out")
    specs[1].config["train"]["threads"] = 3
    sweep.execute(specs, backend="ray", device="cuda", progress=False)
    assert asked == [{"num_gpus": 1, "num_cpus": 1}, {"num_gpus": 1, "num_cpus": 3}]
    # without --device, each run's own train.device: a GPU for the run that trains on CUDA
    asked.clear()
    specs[0].config["train"]["device"] = "cuda"
    sweep.execute(specs, backend="ray", progress=False)
    assert specs[1].config["train"].get("device", "auto") == "auto"
    assert asked == [{"num_gpus": 1, "num_cpus": 1}, {"num_gpus": 0, "num_cpus": 3}]
    # "auto" on a cluster with GPUs trains on one: it reserves it (Ray hides none from a task)
    asked.clear()
    gpus["GPU"] = 2
    sweep.execute(specs, backend="ray", progress=False)
    assert asked == [{"num_gpus": 1, "num_cpus": 1}, {"num_gpus": 1, "num_cpus": 3}]
    specs[1].config["train"]["device"] = "cpu"
    asked.clear()
    sweep.execute(specs, backend="ray", progress=False)
    assert asked[1] == {"num_gpus": 0, "num_cpus": 3}


def test_a_runs_device_is_its_configs_unless_device_is_given(tmp_path: Path) -> None:
    """`normlab sweep` set every run's train.device to its --device default, "auto": a config
    saying "cpu" trained on a GPU where one was found, and recorded "auto"."""
    import tomllib

    from normlab.sweep import run_one

    f = _tiny_sweep(tmp_path, "[0]")
    f.write_text(f.read_text().replace("[run]", '"train.device" = "cpu"\n[run]'))
    spec = load_sweep(f, tmp_path / "out")[0]
    run_one(spec)
    saved = tomllib.loads((Path(spec.out) / "config.toml").read_text())
    assert saved["train"]["device"] == "cpu"
    spec = load_sweep(f, tmp_path / "out2")[0]
    run_one(spec, device="auto")  # --device given: it overrides, as train's --device does
    saved = tomllib.loads((Path(spec.out) / "config.toml").read_text())
    assert saved["train"]["device"] == "auto"


def test_failed_run_is_reported_and_others_go_on(tmp_path: Path) -> None:
    from normlab.sweep import execute

    specs = load_sweep(_tiny_sweep(tmp_path), tmp_path / "out")
    Path(specs[0].out).mkdir(parents=True)
    (Path(specs[0].out) / "checkpoints").mkdir()
    (Path(specs[0].out) / "checkpoints" / "step_0000003.json").write_text("{broken")
    results = {r["name"]: r for r in execute(specs, jobs=1, progress=False)}
    assert not results["pre-s0"]["ok"] and "CheckpointError" in results["pre-s0"]["error"]
    assert results["pre-s1"]["ok"]


def test_ray_backend_on_a_local_instance(tmp_path: Path) -> None:
    ray = pytest.importorskip("ray")
    from normlab.sweep import execute

    specs = load_sweep(_tiny_sweep(tmp_path), tmp_path / "out")
    specs[1].config["train"]["threads"] = 2  # its task asks Ray for 2 CPUs, the other's for 1
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        results = execute(specs, backend="ray", progress=False)
    finally:
        ray.shutdown()
    assert all(r["ok"] for r in results), results
    # the same runs on the local backend: bitwise the same weights, the same evaluation (no
    # test compared them; a Ray task's environment is its own)
    local = [dataclasses.replace(s, out=str(tmp_path / "local" / s.name)) for s in specs]
    assert all(r["ok"] for r in execute(local, jobs=1, progress=False))
    for s, o in zip(specs, local, strict=True):
        ours, theirs = (sorted((Path(x.out) / "checkpoints").glob("*.safetensors"))
                        for x in (s, o))
        assert [p.name for p in ours] == [p.name for p in theirs]
        assert ours[-1].read_bytes() == theirs[-1].read_bytes(), s.name
        ray_eval, local_eval = (json.loads((Path(x.out) / "eval.json").read_text())["splits"]
                                for x in (s, o))
        assert ray_eval == local_eval, s.name


QUICK = Path(__file__).resolve().parents[1] / "docs/results/quick/runs"


def _edit_json(path: Path, edit: Callable[[dict], object]) -> None:
    """Read a result file, change it in place with `edit(doc)`, write it back."""
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def _quick_copy(out: Path) -> list[Path]:
    """The committed quick runs' result files (no checkpoints), to write reports from."""
    dirs = []
    for name in ("pre-s0", "pre-s1", "qkv-s0", "qkv-s1"):
        d = out / "runs" / name
        (d / "analysis").mkdir(parents=True)
        for f in ("eval.json", "train_done.json", "timings.json", "analysis/norms.json",
                  "analysis/collapse.json"):
            shutil.copy(QUICK / name / f, d / f)
        dirs.append(d)
    return dirs


def test_seed_means_pair_sigmas_by_value(tmp_path: Path) -> None:
    """Seeds analysed over other sigmas, or in another order: read at the same sigma (it was
    by position, an IndexError with fewer sigmas, a wrong figure in another order)."""
    from normlab.report import _seed_mean, write_report

    a = {"sigmas": [0.0, 0.1, 0.3], "collapse_rate": [0.0, 0.001, 0.02]}
    b = {"sigmas": [0.3, 0.1, 0.0], "collapse_rate": [0.04, 0.003, 0.0]}
    c = {"sigmas": [0.1], "collapse_rate": [0.005]}
    sig = [0.0, 0.1, 0.3]
    assert _seed_mean([a, b, c], "collapse_rate", sig) == pytest.approx([0.0, 0.003, 0.03])
    dirs = _quick_copy(tmp_path)
    path = tmp_path / "runs/pre-s1/analysis/collapse.json"
    col = json.loads(path.read_text())
    keep = [col["sigmas"].index(s) for s in (0.3, 0.1, 0.0)]  # fewer, and reversed
    for key in ("sigmas", "collapse_rate", "predicted_rate", "accuracy", "draws_per_sigma"):
        col[key] = [col[key][i] for i in keep]
    path.write_text(json.dumps(col))
    summary = write_report(tmp_path / "report", dirs, "quick")
    h2 = {r["id"]: r for r in summary["claims"]}["H2"]
    s0 = json.loads((QUICK / "pre-s0/analysis/collapse.json").read_text())
    s1 = json.loads((QUICK / "pre-s1/analysis/collapse.json").read_text())
    at = {run: r["collapse_rate"][r["sigmas"].index(0.1)] for run, r in (("s0", s0), ("s1", s1))}
    assert h2["per_seed"] == [at["s0"], at["s1"]]


def test_one_seed_gives_strict_json_and_no_infinite_interval(tmp_path: Path) -> None:
    from normlab.report import write_report

    dirs = _quick_copy(tmp_path)
    (tmp_path / "runs/qkv-s1/eval.json").unlink()  # qkv seed 1 never finished
    summary = write_report(tmp_path / "report", dirs, "quick")

    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    json.loads((tmp_path / "report/summary.json").read_text(), parse_constant=refuse)
    h3 = {r["id"]: r for r in summary["claims"]}["H3"]
    assert h3["n_seeds"] == 1 and h3["ci95"] == [None, None] and h3["verdict"] == "inconclusive"
    assert "inf" not in (tmp_path / "report/report.md").read_text()


def test_a_run_that_failed_is_left_out_of_the_claims_and_named(tmp_path: Path,
                                                                 monkeypatch) -> None:
    """A run that failed in this pass may hold an older attempt's results (a config that
    changed is refused before anything is written): they counted in the claims, unseen."""
    import normlab.reproduce as reproduce

    _quick_copy(tmp_path)

    def execute(specs: list, **kw: object) -> list[dict]:
        return [{"ok": s.name != "pre-s1", "name": s.name, "did": [], "seconds": 0.0,
                 "error": "ValueError: --resume: the config differs"} for s in specs]

    monkeypatch.setattr(reproduce, "execute", execute)
    with pytest.raises(RuntimeError, match="1 of 4 runs failed"):
        reproduce.reproduce("quick", tmp_path, progress=False)
    summary = json.loads((tmp_path / "summary.json").read_text())
    h1 = {r["id"]: r for r in summary["claims"]}["H1"]
    h90 = json.loads((QUICK / "pre-s0/analysis/norms.json").read_text())["summary"]["all"]["h90"]
    assert h1["n_seeds"] == 1 and h1["per_seed"] == [h90]  # pre-s0's alone
    assert summary["failed"] == {"pre-s1": "ValueError: --resume: the config differs"}
    head = (tmp_path / "report.md").read_text().split("## The paper")[0]
    assert "Left out: run pre-s1 failed" in head


def test_the_report_lists_failures_one_line_each_and_names_the_measured_splits(
        tmp_path: Path) -> None:
    """Errors span lines (torch's do): each failure is one list item. The accuracy panel's
    splits come from the records, also from an older record that kept "train" as letters."""
    from normlab.report import collect, figures, write_report

    dirs = _quick_copy(tmp_path)
    write_report(tmp_path / "report", dirs, "quick",
                 failed={"pre-s1": "RuntimeError: boom\n  at line 2", "qkv-s1": "ValueError: x"})
    md = (tmp_path / "report/report.md").read_text()
    assert "- **Left out: run pre-s1 failed** (RuntimeError: boom at line 2); rerun" in md
    # one seed per placement left: H3 a difference in signed points, with no interval
    assert "| +0.16 points [—, —] | 1 | **inconclusive** |" in md
    assert "- **Left out: run qkv-s1 failed** (ValueError: x); rerun" in md
    _edit_json(tmp_path / "runs/pre-s0/analysis/collapse.json",
               lambda col: col["params"].update(splits=list("train")))
    import matplotlib.pyplot as plt

    seen = []
    real = plt.Axes.set_ylabel
    try:
        plt.Axes.set_ylabel = lambda ax, text, *a, **k: seen.append(text)  # type: ignore[method-assign]
        figures(collect(dirs), tmp_path / "figs")
    finally:
        plt.Axes.set_ylabel = real  # type: ignore[method-assign]
    assert "exact-match accuracy (train)" in seen



def test_seeds_that_agree_exactly_keep_their_measurement_error() -> None:
    """Two seeds with the same train-accuracy difference gave H3 an interval of zero width
    (the committed quick report's +0.16% [0.16%, 0.16%] -> agrees). The seeds' variance is now
    floored at the differences' binomial variance, Agresti-Coull's. By hand: 0.99 and 0.98 of
    1280 questions are 1267.2 and 1254.4 right; over 1284 "questions" with two more right,
    p~ = 1269.2 / 1284 and 1256.4 / 1284, and the difference's variance is
    v = sum p~ (1 - p~) / 1284; two seeds, t(1) = 12.706: half-width 12.706 sqrt(v) / sqrt(2).
    A placement at 100% keeps a variance too: p (1 - p) / n gave it none."""
    runs = {"pre": {s: _run("pre", s, 0.98, 0.5, 0.2, 0.01) for s in (0, 1)},
            "qkv": {s: _run("qkv", s, 0.99, 0.5, 0.1, 0.01) for s in (0, 1)}}
    h3 = {r["id"]: r for r in claims_table(runs)}["H3"]
    pq, pp = 1269.2 / 1284, 1256.4 / 1284
    v = (pq * (1 - pq) + pp * (1 - pp)) / 1284
    half = 12.706 * math.sqrt(v) / math.sqrt(2)
    assert h3["ci95"] == pytest.approx([0.01 - half, 0.01 + half])
    assert h3["verdict"] == "inconclusive"  # [-0.0258, 0.0458] reaches past the ±0.02 band
    runs = {"pre": {s: _run("pre", s, 1.0, 0.5, 0.2, 0.01) for s in (0, 1)},
            "qkv": {s: _run("qkv", s, 1.0, 0.5, 0.1, 0.01) for s in (0, 1)}}
    lo, hi = {r["id"]: r for r in claims_table(runs)}["H3"]["ci95"]
    p1 = 1282 / 1284
    assert hi == pytest.approx(-lo) == pytest.approx(12.706 * math.sqrt(p1 * (1 - p1) / 1284))
    _, (lo, hi) = mean_ci([0.2, 0.4], within_var=[1e-6, 1e-6])  # the seeds' spread is larger
    assert (lo, hi) == mean_ci([0.2, 0.4])[1]
    with pytest.raises(ValueError, match="expected 2 within-seed variances"):
        mean_ci([0.2, 0.4], within_var=[1e-6])



def test_a_report_refuses_runs_made_with_other_settings(tmp_path: Path) -> None:
    """Claims pool runs over seeds: a run analysed at another threshold, evaluated on fewer
    examples or trained on another grid was averaged in without a word."""
    from normlab.report import collect

    dirs = _quick_copy(tmp_path)
    collect(dirs)  # the committed runs agree
    path = tmp_path / "runs/qkv-s1/analysis/collapse.json"
    _edit_json(path, lambda col: col["params"].update(threshold=0.8))
    with pytest.raises(ValueError, match=r"qkv-s1' was made with analysis threshold = 0\.8, "
                                         r".*pre-s0' with 0\.9; a report pools"):
        collect(dirs)
    # an older record's spelling of the same split
    _edit_json(path, lambda col: col["params"].update(threshold=0.9, splits=list("train")))
    collect(dirs)
    for run, limit in (("pre-s0", 8), ("qkv-s0", None)):  # recorded since the limit was
        _edit_json(tmp_path / f"runs/{run}/eval.json", lambda ev, n=limit: ev.update(limit=n))
    with pytest.raises(ValueError, match="eval limit = None"):
        collect(dirs)

    def other_grid(ev: dict) -> None:
        ev["limit"] = None
        ev["config"]["task"]["grid"] = "paper"

    _edit_json(tmp_path / "runs/pre-s0/eval.json", other_grid)
    with pytest.raises(ValueError, match="was made with task = "):
        collect(dirs)


def test_the_figure_shows_every_seeds_sigmas() -> None:
    """The collapse figure was drawn at the first seed's sigmas only: a sigma another seed
    measured was dropped from the curve. `collect` refuses such runs; hand-built ones reach
    `figures`. Sigmas merge only where they are one (a coarse tolerance dropped 0.005), and
    the band spans the seeds' range (its top at the lowest seed passed)."""
    from normlab.report import _seed_mean, _seed_range, _sigma_grid

    a = {"sigmas": [0.1, 0.0], "collapse_rate": [0.002, 0.0]}
    b = {"sigmas": [0.0, 0.3, 0.1 + 1e-12, 0.005], "collapse_rate": [0.0, 0.04, 0.004, 0.001]}
    sig = _sigma_grid([a, b])  # 0.1 and 0.1 + 1e-12 are one sigma; 0.005 is its own
    assert sig == pytest.approx([0.0, 0.005, 0.1, 0.3]) and len(sig) == 4
    assert _seed_mean([a, b], "collapse_rate", sig) == pytest.approx([0.0, 0.001, 0.003, 0.04])
    # the band drawn around the mean: the lowest and the highest seed at each sigma
    lo, hi = _seed_range([a, b], "collapse_rate", sig)
    assert (lo, hi) == (pytest.approx([0.0, 0.001, 0.002, 0.04]),
                        pytest.approx([0.0, 0.001, 0.004, 0.04]))


def test_the_norm_spread_whisker_spans_the_seeds_range(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The h90 bar's whisker runs from the lowest seed to the highest, as its title says:
    no test read the figure, so a whisker with its ends swapped (mirrored about the mean)
    passed."""
    import matplotlib.pyplot as plt

    import normlab.report as rep

    drawn: list = []
    monkeypatch.setattr(rep, "save_figure", lambda fig, path: drawn.append(fig))
    runs = {"pre": {s: _run("pre", s, 0.99, 0.5, h90, 0.01)
                    for s, h90 in enumerate([0.19, 0.20, 0.24])}}
    rep.figures(runs, tmp_path)
    from matplotlib.container import BarContainer

    (bars,) = [c for c in drawn[1].axes[0].containers if isinstance(c, BarContainer)]
    assert bars[0].get_height() == pytest.approx(0.21)
    (_, low), (_, high) = bars.errorbar.lines[2][0].get_segments()[0]
    assert sorted([low, high]) == pytest.approx([0.19, 0.24])
    for fig in drawn:
        plt.close(fig)


def test_a_task_without_held_out_splits_gives_no_number_for_h4(tmp_path: Path) -> None:
    """H4 compares held-out accuracy; runs evaluated on `train` alone gave NaN in
    summary.json (not JSON) and a NaN verdict input. Now no number, inconclusive."""
    runs = {p: {s: _run(p, s, 0.99, 0.5, 0.2, 0.01) for s in (0, 1)} for p in ("pre", "qkv")}
    for by in runs.values():
        for r in by.values():
            for split in ("interpolation", "extrapolation"):
                del r["eval"]["splits"][split]
    h4 = {r["id"]: r for r in claims_table(runs)}["H4"]
    assert h4["ours"] is None and h4["n_seeds"] == 0 and h4["verdict"] == "inconclusive"
    json.dumps(h4, allow_nan=False)


def test_settings_are_compared_across_every_run_not_only_the_first(tmp_path: Path) -> None:
    """Each run was compared with the first run's settings only: a first run without a
    collapse.json let every other run's analysis settings differ unseen."""
    from normlab.report import collect

    dirs = _quick_copy(tmp_path)
    (dirs[0] / "analysis" / "collapse.json").unlink()
    _edit_json(dirs[3] / "analysis" / "collapse.json",
               lambda col: col["params"].update(threshold=0.5))
    with pytest.raises(ValueError, match=r"qkv-s1' was made with analysis threshold = 0\.5, "
                                         r".*pre-s1' with 0\.9; a report pools"):
        collect(dirs)


@pytest.mark.parametrize(
    ("name", "text", "what"),
    [
        ("analysis/norms.json", '{"summary": ', "normlab norm spread"),
        ("analysis/norms.json", '{"runs": []}', "normlab norm spread"),
        ("analysis/collapse.json", '{"sigmas": [0.1, 0.2], "collapse_rate": [0.0]}',
         "normlab collapse results"),
        ("analysis/norms.json", '{"summary": {"all": {"h90": "0.5"}}}', "normlab norm spread"),
        ("analysis/collapse.json", '{"sigmas": [0.1], "collapse_rate": [0.0], "accuracy": []}',
         "normlab collapse results"),
        ("analysis/collapse.json", '{"sigmas": [0.1], "collapse_rate": [0.0], "params": 3}',
         "normlab collapse results"),
        ("eval.json", '{"splits": {}}', "normlab eval results"),
        ("eval.json", json.dumps({"splits": {}, "config": {"model": {"norm_placement": "pre"},
                                                           "train": {"seed": 0}}}),
         "normlab eval results"),  # no checkpoint
        ("timings.json", "[1]", "an object"),
        # numbers no rate, accuracy or spread can be
        ("analysis/collapse.json", '{"sigmas": [0.1], "collapse_rate": [1.5]}',
         "normlab collapse results"),
        ("analysis/collapse.json", '{"sigmas": [0.1], "collapse_rate": [0.1], '
         '"accuracy": [-0.1]}', "normlab collapse results"),
        ("analysis/norms.json", '{"summary": {"all": {"h90": -0.5}}}', "normlab norm spread"),
        ("analysis/norms.json", '{"summary": {"all": {"h90": NaN}}}', "normlab norm spread"),
        ("analysis/norms.json", '{"summary": {"all": {"h90": 0.5, "h90_var": -1}}}',
         "normlab norm spread"),
        ("eval.json", json.dumps({"splits": {"train": {"accuracy": 1.2, "count": 8,
                                                       "ci95": [0, 1]}},
                                  "config": {"model": {"norm_placement": "pre"},
                                             "train": {"seed": 0}}, "checkpoint": {}}),
         "normlab eval results"),
    ],
)
def test_a_damaged_result_file_is_named_in_one_line(tmp_path: Path, name: str, text: str,
                                                     what: str) -> None:
    """A cut-short norms.json was "Unterminated string ..." naming no file; a collapse rate
    short of its sigmas a zip() error; a norms.json without its summary a KeyError."""
    from normlab.report import collect

    dirs = _quick_copy(tmp_path)
    (dirs[1] / name).write_text(text)
    with pytest.raises(ValueError) as err:
        collect(dirs)
    msg = str(err.value)
    assert msg.startswith(f"{str(dirs[1] / name)!r}: expected {what}") and "\n" not in msg


def test_the_split_table_keeps_each_accuracys_measurement_error(tmp_path: Path) -> None:
    """Two seeds of 99.8% gave "99.8 [99.8, 99.8]", the zero-width interval the claims were
    fixed to avoid; the table now floors it at the accuracies' binomial variance, as they do."""
    from normlab.report import collect, split_table
    from normlab.stats import mean_ci

    runs = collect(_quick_copy(tmp_path))
    table = split_table(runs)
    row = next(r for r in table if r[0] == "pre")
    splits = [r["eval"]["splits"]["train"] for r in runs["pre"].values()]
    accs = [s["accuracy"] for s in splits]
    assert accs[0] == accs[1]  # the committed runs: the case that gave zero width
    n_t = [s["count"] + 4 for s in splits]  # Agresti-Coull's, as the claims use
    p_t = [(a * s["count"] + 2) / n for a, s, n in zip(accs, splits, n_t, strict=True)]
    m, (lo, hi) = mean_ci(accs, [p * (1 - p) / n for p, n in zip(p_t, n_t, strict=True)])
    assert lo < m < hi
    cell = row[table[0].index("train")]
    assert hi > 1  # clipped to 100%, as an accuracy's interval is
    assert cell == f"{100 * m:.1f} [{100 * lo:.1f}, {100 * 1:.1f}]"
    assert cell != f"{100 * m:.1f} [{100 * m:.1f}, {100 * m:.1f}]"


def test_a_worker_that_dies_fails_its_runs_not_the_sweep(tmp_path: Path, monkeypatch) -> None:
    """A worker killed (by the out-of-memory killer) broke the pool: `fut.result()` raised, no
    report was written and no run was named. Each run the pool held now fails, named."""
    import concurrent.futures as cf
    from concurrent.futures.process import BrokenProcessPool

    import normlab.sweep as sweep

    class WorkerCrashedError(Exception):  # Ray's, for a task whose worker died: it passed
        """straight through, a traceback that ended the sweep with runs in flight."""

    def backend(error: Exception):
        def make(jobs: int, device: str, marks: str):  # a pool's: none of its runs began
            def submit(spec):
                fut: cf.Future = cf.Future()
                fut.set_exception(error)
                return fut
            return submit, lambda futs: futs, lambda futs: None
        return make

    specs = load_sweep(_tiny_sweep(tmp_path), tmp_path / "out")
    monkeypatch.setattr(sweep, "_local_backend",
                        backend(BrokenProcessPool("a child process terminated abruptly")))
    results = sweep.execute(specs, jobs=1, progress=False)
    assert sorted(r["name"] for r in results) == sorted(s.name for s in specs)
    for r in results:
        assert not r["ok"] and r["error"].startswith("BrokenProcessPool: a worker process died")
    monkeypatch.setattr(sweep, "_local_backend",
                        backend(WorkerCrashedError("The worker died unexpectedly\nmore")))
    results = sweep.execute(specs, jobs=1, progress=False)
    assert sorted(r["name"] for r in results) == sorted(s.name for s in specs)
    for r in results:
        assert not r["ok"] and r["error"] == ("WorkerCrashedError: the run's worker died (The "
                                              "worker died unexpectedly); rerun to retry")


def test_a_report_refuses_runs_of_another_model_or_recipe(tmp_path: Path) -> None:
    """Runs picked by hand from two sweeps, another width or learning rate, were pooled: only
    the task, evaluation and analysis were compared. The placement and seed differ by design,
    and how a run ran (threads, device, logging) may."""
    from normlab.report import HOW_IT_RAN, collect

    dirs = _quick_copy(tmp_path)
    ev_path = dirs[2] / "eval.json"
    original = ev_path.read_text()
    for table, key, value in (("model", "d_model", 128), ("train", "lr", 1e-3),
                              ("train", "steps", 100)):
        ev = json.loads(original)
        ev["config"][table][key] = value
        ev_path.write_text(json.dumps(ev))
        with pytest.raises(ValueError, match=rf"{dirs[2].name}' was made with {table}\.{key} = "
                                             rf"{value!r}, .* with .*a report pools runs of "
                                             "one task, model, recipe"):
            collect(dirs)
    ev = json.loads(original)  # qkv-s0, run again as seed 9 on two threads, logging more
    ev["config"]["train"] |= {"seed": 9, "threads": 2, "device": "cuda", "compile": True,
                              "log_every": 7, "checkpoint_every": 9}
    assert set(HOW_IT_RAN) <= set(ev["config"]["train"])
    ev["config"]["model"]["norm_placement"] = "pre"
    ev_path.write_text(json.dumps(ev))
    runs = collect(dirs)
    assert sorted(runs["pre"]) == [0, 1, 9] and sorted(runs["qkv"]) == [1]


@pytest.mark.parametrize(("rows", "draws", "rate"), [(24, 2, 0.0), (50, 2, 0.01)])
def test_h2_seeds_that_measure_the_same_rate_keep_its_sampling_error(rows: int, draws: int,
                                                                     rate: float) -> None:
    """Two seeds that both saw 0 flips in 48 row-draws gave H2 the interval [0, 0] and
    "disagrees" (0 of 96 allows up to 3.8%); both at 1 of 100, [1%, 1%] and "agrees" (2 of 200
    allows 0.12% to 3.6%). By hand, Agresti-Coull over each seed's row-draws n: p~ = (k + 2) /
    (n + 4), variance p~ (1 - p~) / (n + 4); two seeds, t(1) = 12.706."""
    runs = {"pre": {s: _run("pre", s, 1.0, 0.5, 0.2, rate) for s in (0, 1)}}
    for r in runs["pre"].values():
        r["collapse"] |= {"n_sparse_rows": rows, "draws_per_sigma": [1, draws]}
    h2 = {r["id"]: r for r in claims_table(runs)}["H2"]
    n = rows * draws
    pt = (rate * n + 2) / (n + 4)
    half = 12.706 * math.sqrt(pt * (1 - pt) / (n + 4)) / math.sqrt(2)
    assert h2["ci95"] == pytest.approx([max(0.0, rate - half), rate + half])
    assert h2["verdict"] == "inconclusive"


def test_a_train_done_record_whose_seconds_are_not_a_number_is_named(tmp_path: Path) -> None:
    """train_done.json's "elapsed_s": "759 s" failed the report with "Unknown format code 'f'
    for object of type 'str'", naming no file."""
    from normlab.report import write_report

    dirs = _quick_copy(tmp_path)
    path = dirs[1] / "train_done.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | {"elapsed_s": "759 s"}))
    with pytest.raises(ValueError, match=r"pre-s1/train_done\.json': expected an object with an "
                                         r"int \"step\".*\"elapsed_s\", seconds\)"):
        write_report(tmp_path / "report", dirs, "quick")


def test_h1_seeds_of_equal_h90_keep_its_sampling_error() -> None:
    """Two seeds at h90 0.39 and 0.39 read [0.39, 0.39] and "agrees", though one seed's h90
    varies by about 0.03 over its questions: floored at the seeds' recorded h90_var (two
    seeds, t(1) = 12.706, by hand); norms.json files without one keep the old interval."""
    runs = {"pre": {s: _run("pre", s, 1.0, 0.5, 0.39, 0.01) for s in (0, 1)}}
    assert {r["id"]: r for r in claims_table(runs)}["H1"]["ci95"] == [0.39, 0.39]
    for r, var in zip(runs["pre"].values(), (0.03**2, 0.01**2), strict=True):
        r["norms"]["summary"]["all"]["h90_var"] = var
    h1 = {r["id"]: r for r in claims_table(runs)}["H1"]
    half = 12.706 * math.sqrt((0.03**2 + 0.01**2) / 2) / math.sqrt(2)
    assert h1["ci95"] == pytest.approx([0.39 - half, 0.39 + half])
    assert h1["verdict"] == "inconclusive"
    del runs["pre"][1]["norms"]["summary"]["all"]["h90_var"]  # one seed without: no floor
    assert {r["id"]: r for r in claims_table(runs)}["H1"]["ci95"] == [0.39, 0.39]


def test_the_report_states_the_analysis_settings_behind_its_numbers(tmp_path: Path) -> None:
    """H2's rate was set beside the paper's 1% with no threshold, draws or questions anywhere
    in report.md or summary.json (smoke measures at θ = 0.5, quick at 0.9); the norm-spread
    figure's y label ran past the figure's top."""
    import matplotlib.pyplot as plt

    from normlab.report import write_report

    dirs = _quick_copy(tmp_path)
    labels, bands = [], []
    real_save = plt.Figure.savefig

    def keep(fig, *args, **kwargs):  # type: ignore[no-untyped-def]
        done = real_save(fig, *args, **kwargs)
        fig.canvas.draw()  # at the figure's own dpi, as its bbox is (savefig drew at another)
        for ax in fig.axes:  # each y label drawn inside the figure, top to bottom
            box = ax.yaxis.label.get_window_extent()
            labels.append((ax.get_ylabel(), box.y0 >= 0 and box.y1 <= fig.bbox.height))
            bands.append(len(ax.collections))
        return done

    import unittest.mock

    with unittest.mock.patch.object(plt.Figure, "savefig", keep):
        summary = write_report(tmp_path / "report", dirs, "quick")
    params = json.loads((QUICK / "pre-s0/analysis/collapse.json").read_text())["params"]
    assert summary["analysis"]["threshold"] == params["threshold"] == 0.9
    assert summary["analysis"]["n_draws"] == params["n_draws"]
    md = (tmp_path / "report/report.md").read_text()
    line = next(ln for ln in md.splitlines() if ln.startswith("Analysis settings of every run"))
    assert "threshold 0.9" in line and f"n_draws {params['n_draws']}" in line
    assert json.loads((tmp_path / "report/summary.json").read_text())["analysis"] == \
        summary["analysis"]
    assert any(label.startswith("h90") for label, _ in labels)
    assert all(inside for _, inside in labels), labels
    # the collapse figure: θ on its axis, and the seeds' range as a band per placement
    at = [label for label, _ in labels].index("collapse rate of sparse rows (max weight ≥ 0.9)")
    assert bands[at] == bands[at + 1] == 2


def test_analyze_help_states_the_librarys_defaults(capsys, monkeypatch) -> None:
    """`analyze --help` hid the defaults of --sigmas, --draws and --examples (argparse's are
    None, so the library's own apply): now said, and checked against the library here; a bad
    --targets is named by its flag."""
    import inspect

    from normlab import cli
    from normlab.analysis import report
    from normlab.analysis.collapse import check_targets
    from normlab.analysis.report import analyze_run
    from normlab.interop.analyze import analyze_hf

    with pytest.raises(SystemExit):
        cli.main(["analyze", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    run, hf = inspect.signature(analyze_run).parameters, inspect.signature(analyze_hf).parameters
    sigmas = ",".join(f"{s:g}" for s in run["sigmas"].default)
    assert f"(default {sigmas})" in text and hf["sigmas"].default == run["sigmas"].default
    assert f"(default {run['n_draws'].default})" in text
    assert run["n_draws"].default == hf["n_draws"].default
    assert (f"(default {run['n_examples'].default}; with --hf, {hf['n_examples'].default} rows)"
            in text)
    # every option with a default says it (threshold, mode, noise, targets, seed did not)
    for flag in ("threshold", "mode", "noise", "seed"):
        assert f"(default {run[flag].default})" in text, flag
    assert "(default all)" in text and run["targets"].default == ("q", "k", "v")
    assert cli.main(["analyze", "some-run", "--targets", "q,x"]) == 2
    assert capsys.readouterr().err.strip() == ("normlab: error: --targets: unknown target 'x'; "
                                               "expected a subset of q, k, v")
    # spelled as the library reads them ("qk" and "q, k" were refused as unknown targets)
    seen: list[tuple] = []
    monkeypatch.setattr(report, "analyze_run", lambda run, out=None, **kw: seen.append(
        check_targets(kw["targets"])) or {"out": run, "files": []})
    for spelling in ("qk", "q, k", "k,q"):
        cli.main(["analyze", "some-run", "--targets", spelling])
    assert seen == [("q", "k")] * 3


def test_analyze_rows_reaches_the_run_analysis_and_is_refused_with_hf(
        tmp_path: Path, monkeypatch, capsys) -> None:
    """`--rows loss` is analyze_run's `rows`; left out, the library's default applies; with
    --hf (whose text has no unscored positions of its own) it is one line, not dropped."""
    from normlab import cli
    from normlab.analysis import report

    seen: list[dict] = []

    def fake(run_dir: Path, **kw):  # type: ignore[no-untyped-def]
        seen.append(kw)
        return {"out": str(run_dir / "analysis"), "files": []}

    monkeypatch.setattr(report, "analyze_run", fake)
    assert cli.main(["analyze", str(tmp_path), "--rows", "loss"]) == 0
    assert cli.main(["analyze", str(tmp_path)]) == 0
    assert seen[0]["rows"] == "loss" and "rows" not in seen[1]
    capsys.readouterr()
    assert cli.main(["analyze", "--hf", str(tmp_path), "--rows", "loss"]) == 2
    assert capsys.readouterr().err.strip() == (
        "normlab: error: analyze: --rows is for a run folder's analysis; with --hf every real "
        "row counts")
    with pytest.raises(SystemExit):
        cli.main(["analyze", str(tmp_path), "--rows", "trained"])
    assert "invalid choice: 'trained'" in capsys.readouterr().err


def test_a_report_pools_no_run_counted_over_other_rows(tmp_path: Path) -> None:
    """A record from before `rows` was kept counted every row: pooled with `rows = "all"`,
    refused beside `rows = "loss"` (its rates are over fewer rows)."""
    from normlab.report import _check_comparable

    def run(name: str, params: dict) -> dict:
        return {"dir": tmp_path / name, "collapse": {"params": params},
                "eval": {"config": {"task": {}, "model": {}, "train": {}}}}

    old = run("old", {"threshold": 0.9})
    assert _check_comparable([old, run("new", {"threshold": 0.9, "rows": "all"})])[
        "analysis rows"] == "all"
    with pytest.raises(ValueError, match=r"'.*loss' was made with analysis rows = 'loss', "
                                         r"'.*old' with 'all'"):
        _check_comparable([old, run("loss", {"threshold": 0.9, "rows": "loss"})])


def test_the_report_names_the_commit_each_run_trained_at(tmp_path: Path) -> None:
    """A run trained at one commit and evaluated again at another (reproduce does, where an
    eval.json is missing or stale) was reported under the evaluation's commit alone; the
    training's, in train_done.json, was read and dropped. Both are given now; the HTML's
    headings render their code spans (they kept the Markdown backticks)."""
    from normlab.report import write_report

    dirs = _quick_copy(tmp_path)
    done = json.loads((dirs[0] / "train_done.json").read_text())
    done["provenance"] = dict(done.get("provenance") or {}, git_commit="0" * 36 + "0a11",
                              torch="2.4.0+cpu")
    (dirs[0] / "train_done.json").write_text(json.dumps(done))
    summary = write_report(tmp_path / "report", dirs, "quick")
    run = next(r for r in summary["runs"] if r["run"] == dirs[0].name)
    assert run["trained_provenance"]["git_commit"] == "0" * 36 + "0a11"
    assert run["trained_provenance"]["torch"] == "2.4.0+cpu"
    evaluated = json.loads((dirs[0] / "eval.json").read_text())["provenance"]["git_commit"]
    assert run["provenance"]["git_commit"] == evaluated
    md = (tmp_path / "report" / "report.md").read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith(f"| {dirs[0].name} |"))
    # the whole row: its timings.json's eval (1.9 s) and analyze (30.7 s) columns could be
    # swapped unseen; train_done.json's 747.5 s of training
    assert row == f"| pre-s0 | pre | 0 | 9000 | 747 | 2 | 31 | {'0' * 36}0a11 | {evaluated} |"
    assert "| trained at | evaluated at |" in md
    page = (tmp_path / "report" / "report.html").read_text()
    assert "<h1>normlab reproduction — profile <code>quick</code></h1>" in page


def test_the_claim_rows_give_each_interval_in_order_and_in_its_unit(tmp_path: Path) -> None:
    """No test read a claim's interval or unit back from report.md: printed [upper, lower], or
    H2's rate without its x100, every test passed. The committed quick runs' rows, by hand
    from their files: two seeds, t(1) = 12.706, so a mean's half-width is
    12.706 |a - b| / 2 where the seeds' spread is above their floor (H1: no h90_var recorded,
    no floor), and H3's two equal differences take the binomial floor (as in
    `test_seeds_that_agree_exactly_keep_their_measurement_error`)."""
    from normlab.report import CLAIMS, write_report

    dirs = _quick_copy(tmp_path)
    write_report(tmp_path / "report", dirs, "quick")

    def read(run: str, name: str) -> dict[str, Any]:
        return json.loads((QUICK / run / name).read_text())

    def two_seeds(a: float, b: float, floor: float = 0.0) -> tuple[float, float, float]:
        half = 12.706 * math.sqrt(max((a - b) ** 2 / 2, floor) / 2)
        return (a + b) / 2, (a + b) / 2 - half, (a + b) / 2 + half

    norms = [read(f"pre-s{s}", "analysis/norms.json")["summary"]["all"] for s in (0, 1)]
    assert all("h90_var" not in n for n in norms)
    h1 = two_seeds(*(n["h90"] for n in norms))
    cols = [read(f"pre-s{s}", "analysis/collapse.json") for s in (0, 1)]
    h2 = two_seeds(*(c["collapse_rate"][c["sigmas"].index(0.1)] for c in cols))
    splits = {run: read(run, "eval.json")["splits"] for run in ("pre-s0", "pre-s1", "qkv-s0",
                                                                 "qkv-s1")}
    train = {run: sp["train"]["accuracy"] for run, sp in splits.items()}
    assert train == {"pre-s0": 0.9984375, "pre-s1": 0.9984375, "qkv-s0": 1.0, "qkv-s1": 1.0}
    pq, pp = 1282 / 1284, (0.9984375 * 1280 + 2) / 1284  # Agresti-Coull, 1280 questions
    h3 = two_seeds(*(train[f"qkv-s{s}"] - train[f"pre-s{s}"] for s in (0, 1)),
                   (pq * (1 - pq) + pp * (1 - pp)) / 1284)
    held = {run: (sp["interpolation"]["accuracy"] + sp["extrapolation"]["accuracy"]) / 2
            for run, sp in splits.items()}
    h4 = two_seeds(*(held[f"qkv-s{s}"] - held[f"pre-s{s}"] for s in (0, 1)))
    assert [round(x, 3) for x in h1] == [0.957, 0.215, 1.699]
    assert [round(100 * x, 2) for x in h2] == [0.08, -0.42, 0.59]  # a rate's low end: 0%
    assert [round(100 * x, 2) for x in h3] == [0.16, -1.56, 1.87]
    assert [round(100 * x, 2) for x in h4] == [4.98, -27.69, 37.66]
    md = (tmp_path / "report/report.md").read_text()
    rows = [("H1", "h90", "±0.20 (h90)", "0.957 [0.215, 1.699]", "inconclusive"),
            ("H2", "collapse rate at σ=0.1", "≈1% at σ ≤ 0.1", "0.08% [0.00%, 0.59%]",
             "inconclusive"),
            ("H3", "qkv − pre, train-cell accuracy", "comparable",
             "+0.16 points [-1.56 points, +1.87 points]", "agrees"),
            ("H4", "qkv − pre, held-out accuracy", "QKV-Norm worse",
             "+4.98 points [-27.69 points, +37.66 points]", "inconclusive")]
    for cid, unit, paper, ours, verdict in rows:
        assert (f"| **{cid}** {CLAIMS[cid]} ({unit}) | {paper} | {ours} | 2 | **{verdict}** |"
                in md.splitlines()), cid
    page = (tmp_path / "report/report.html").read_text()
    assert "<td>0.08% [0.00%, 0.59%]</td>" in page
    # every bullet (the verdict rules) in a list: they were <li> with no <ul>
    lists = re.findall(r"<ul>((?:<li>.*?</li>)*)</ul>", page)
    assert [item.count("<li>") for item in lists] == [4]
    assert page.count("<li>") == md.count("\n- ") == 4


def test_the_pages_bullets_are_lists_and_its_tables_tables() -> None:
    """Bullets were <li> elements with no <ul> around them, not valid HTML. Consecutive
    bullets make one list, closed at the first other line, as consecutive rows make a table."""
    from normlab.report import _html

    page = _html("- a\n- **b**\n\ntext\n- c\n| x | y |\n|---|---|\n| 1 | 2 |\n- d", Path("."))
    body = page.split("<body>")[1].removesuffix("</body></html>")
    assert body == ("<ul><li>a</li><li><b>b</b></li></ul><p>text</p><ul><li>c</li></ul>"
                    "<table><tr><td>x</td><td>y</td></tr><tr><td>1</td><td>2</td></tr></table>"
                    "<ul><li>d</li></ul>")


def test_a_report_of_failed_runs_draws_no_empty_legend(tmp_path: Path, recwarn) -> None:
    """With every run failed, matplotlib warned "No artists with labels found" twice, with
    its source lines, before `reproduce`'s one-line error."""
    from normlab.report import write_report

    write_report(tmp_path / "report", [], "quick", failed={"pre-s0": "ValueError: x"})
    assert (tmp_path / "report" / "report.md").is_file()
    assert not [w for w in recwarn if "No artists" in str(w.message)]


def test_a_timings_record_of_nan_inf_or_negative_seconds_is_damaged() -> None:
    """NaN, inf and -3.1 seconds passed the check: the Runs table read "-3" and "inf", and
    summary.json held bare NaN, which strict JSON readers refuse."""
    from normlab.report import RESULT_FILES

    ok = RESULT_FILES["timings.json"][1]
    assert ok({"train": 12.5, "eval": 0, "analyze": 3})
    for bad in (math.nan, math.inf, -3.1, True, "5"):
        assert not ok({"train": 1.0, "eval": bad}), bad
