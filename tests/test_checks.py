"""normlab.checks: one whole-number check for every layer's arguments."""

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from normlab import build_model, checks
from normlab.analysis.data import resolve_sites
from normlab.analysis.theory import monte_carlo_collapse, predict_collapse
from normlab.checks import check_int, check_real, check_seed, check_sigmas, is_int
from normlab.config import load_config
from normlab.model import ModelConfig
from normlab.model.generate import greedy_decode
from normlab.model.transformer import KVCache
from normlab.sweep import check_jobs


@pytest.mark.parametrize("value", [0, 3, 2**70, np.int64(5), np.uint8(7)])
def test_is_int_takes_python_and_numpy_integers(value: object) -> None:
    assert is_int(value)


@pytest.mark.parametrize("value", [True, False, 2.0, 1.7, "3", None, np.float32(2), [1]])
def test_is_int_refuses_bools_floats_and_the_rest(value: object) -> None:
    assert not is_int(value)


def test_check_int_returns_a_python_int() -> None:
    out = check_int(np.int64(12), "n", low=1)
    assert out == 12 and type(out) is int


@pytest.mark.parametrize(
    ("value", "low", "what", "message"),
    [
        (0, 1, None, "n: expected an int >= 1; got 0"),
        (-1, 0, None, "n: expected an int >= 0; got -1"),
        (True, 0, None, "n: expected an int >= 0; got True"),
        (2.0, 0, None, "n: expected an int >= 0; got 2.0"),
        ("2", 0, "a number of steps", "n: expected a number of steps; got '2'"),
    ],
)
def test_check_int_refuses_with_one_line(value: object, low: int, what: str | None,
                                         message: str) -> None:
    with pytest.raises(ValueError) as info:
        check_int(value, "n", low=low, what=what)
    assert str(info.value) == message


def test_every_layer_takes_a_numpy_integer_as_an_int() -> None:
    """The layers used to disagree: some took numpy integers, others refused them."""
    cfg = ModelConfig(vocab_size=np.int64(16), d_model=np.int64(32), n_heads=np.int32(2),
                      n_layers=np.int64(1), max_len=np.int64(16))
    assert type(cfg.d_model) is int and type(cfg.d_head) is int and type(cfg.d_mlp) is int
    json.dumps(cfg.to_dict())  # a config with numpy integers in it would not serialise
    assert (cfg.d_head, cfg.d_mlp) == (16, 128)
    assert KVCache.empty(1, np.int64(4)).layers[0]["self"]["reserve"].item() == 4
    assert check_seed(np.uint32(3)) == 3
    check_jobs(np.int64(2))
    p = monte_carlo_collapse(torch.tensor([[2.0, 1.0]]), 0.5, np.int64(8),
                             generator=torch.Generator().manual_seed(0))
    assert p.shape == (1,)
    pred = predict_collapse(torch.tensor([[2.0, 1.0]]), [0.5], np.int64(8))
    assert type(pred["n_draws"]) is int  # results hold Python ints: plain json.dumps takes them
    # sizes derived from numpy integers are worked out as Python ints: uint8 200 * 4 wrapped
    wide = ModelConfig(d_model=np.uint8(200), n_heads=np.uint8(4), n_layers=1)
    assert (wide.d_mlp, wide.d_head) == (800, 50)
    model = build_model(cfg)
    assert resolve_sites(model, None, np.int64(1))[1] == [1]
    assert resolve_sites(model, None, np.arange(2))[1] == [0, 1]
    with pytest.raises(ValueError, match=r"^unknown head 2\.0; expected an int in \[0, 2\)$"):
        resolve_sites(model, None, [2.0])


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: ModelConfig(d_model=True), "ModelConfig.d_model: expected a positive integer "
                                            "below 2**63; got True"),
        (lambda: ModelConfig(n_aux_positions=-1), "ModelConfig.n_aux_positions: expected an "
                                                  "integer >= 0; got -1"),
        (lambda: check_seed(1.0), "seed: expected an int in [0, 2**63); got 1.0"),
        (lambda: check_seed(2**63), f"seed: expected an int in [0, 2**63); got {2**63}"),
        (lambda: load_config(None, [f"train.seed={2**63}"]),
         f"--set train.seed: expected an int in [0, 2**63); got {2**63}"),
        (lambda: check_jobs(True), "--jobs: expected an int in [1, 65536) runs at once; got True"),
        (lambda: KVCache.empty(1, 2.0), "capacity: expected a number of positions >= 0; got 2.0"),
        (lambda: greedy_decode(None, [[1]], max_new=-1, eos=2),  # type: ignore[arg-type]
         "max_new: expected a number of tokens >= 0; got -1"),
    ],
)
def test_each_layer_names_its_argument(call: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        call()  # type: ignore[operator]
    assert str(info.value) == message


def test_the_analyses_refuse_a_model_off_the_cpu_in_one_line() -> None:
    """They build inputs, masks and noise on the CPU: a GPU model failed deep in a forward with
    a device mismatch. The `meta` device stands in for a GPU (no GPU on the test machines)."""
    import random

    from normlab.analysis.collapse import (
        Perturbation,
        find_sparse_rows,
        measure_collapse,
        perturbed_accuracy,
        perturbed_predictor,
    )
    from normlab.analysis.data import EvalData
    from normlab.analysis.interference import interference_probe
    from normlab.analysis.norms import norm_spread
    from normlab.config import load_config
    from normlab.evaluate import answer_token_accuracy
    from normlab.tasks.addition import Cell, eval_sets

    model = build_model(ModelConfig(d_model=32, n_heads=2, n_layers=1, max_len=32)).to("meta")
    rng = random.Random(0)
    problems = [Cell(2, 1).sample(rng) for _ in range(4)]
    data = EvalData.from_problems(problems, "decoder")
    task = load_config(Path(__file__).resolve().parents[1] / "configs/addition/pre.toml").validate()
    calls = [lambda: norm_spread(model, data), lambda: find_sparse_rows(model, data),
             lambda: measure_collapse(model, data), lambda: interference_probe(model, data),
             lambda: perturbed_accuracy(model, task, eval_sets(task), limit=1),
             lambda: perturbed_predictor(model, task, Perturbation(model), 0.1),
             lambda: answer_token_accuracy(model, problems, answer_format="msd")]
    for call in calls:
        with pytest.raises(ValueError) as info:
            call()
        assert str(info.value) == ("model: expected a model on the CPU, where the analyses run; "
                                   "got one on meta (call model.cpu() first)")


@pytest.mark.parametrize("value", [0.5, 2, np.float32(0.25), np.float64(1e-3), np.int64(3)])
def test_check_real_takes_python_and_numpy_numbers_as_floats(value: object) -> None:
    out = check_real(value, "x", what="a number > 0", ok=lambda v: v > 0)
    assert out == float(value) and type(out) is float


@pytest.mark.parametrize("value", [True, "1", None, math.nan, math.inf, -math.inf, [1.0], -1.0])
def test_check_real_refuses_non_numbers_non_finite_and_out_of_range(value: object) -> None:
    with pytest.raises(ValueError) as info:
        check_real(value, "x", what="a number > 0", ok=lambda v: v > 0)
    assert str(info.value) == f"x: expected a number > 0; got {value!r}"


def test_check_sigmas_takes_one_number_or_any_sequence_of_them() -> None:
    assert check_sigmas(0.1) == [0.1]
    assert check_sigmas((0, 0.2)) == [0.0, 0.2]
    assert check_sigmas(np.array([0.05, 0.1])) == [0.05, 0.1]  # numpy arrays are no Sequence


@pytest.mark.parametrize(
    ("sigmas", "message"),
    [
        ([0.1, -1.0], "sigmas[1]: expected a finite number >= 0; got -1.0"),
        # overflowed the perturbed float32 scores to inf and NaN, whose argmax was counted
        ([0.0, 1e308], "sigmas[1]: expected at most 1e+06 (noise past it overflows float32 "
                       "attention scores); got 1e+308"),
        ([True], "sigmas[0]: expected a finite number >= 0; got True"),
        (["0.1"], "sigmas[0]: expected a finite number >= 0; got '0.1'"),
        (math.nan, "sigma: expected a finite number >= 0; got nan"),
        ("0.1", "sigmas: expected a list of numbers >= 0; got '0.1'"),
        ({"a": 0.1}, "sigmas: expected a list of numbers >= 0; got {'a': 0.1}"),
        ({0.1, 0.2}, "sigmas: expected a list of numbers >= 0; got {0.1, 0.2}"),  # no order
        ([], "sigmas: expected at least one sigma"),
    ],
)
def test_check_sigmas_names_the_bad_one(sigmas: object, message: str) -> None:
    with pytest.raises(ValueError) as info:
        check_sigmas(sigmas)
    assert str(info.value) == message


def test_check_real_names_an_int_too_large_for_a_float() -> None:
    """float(10**400) raised OverflowError, past the field's name, out of a sweep file."""
    with pytest.raises(ValueError, match=r"^alpha: expected a number > 0; got 1000"):
        check_real(10**400, "alpha", what="a number > 0", ok=lambda v: v > 0)


def test_check_sigmas_reads_tensors_as_their_numbers() -> None:
    """A 1-D tensor's items were refused as "expected a finite number >= 0; got tensor(0.)",
    and a 0-d one as no list, while numpy's were taken."""
    assert check_sigmas(torch.tensor([0.0, 0.5])) == [0.0, 0.5]
    assert check_sigmas(torch.tensor(0.25)) == [0.25] == check_sigmas(np.float64(0.25))
    with pytest.raises(ValueError, match=r"^sigmas\[1\]: expected a finite number >= 0; got -1"):
        check_sigmas(torch.tensor([0.0, -1.0]))
    with pytest.raises(ValueError, match=r"^sigmas\[0\]: expected a finite number >= 0; got True"):
        check_sigmas(torch.tensor([True]))


def test_one_sigma_is_named_sigma_and_a_numpy_threshold_is_a_number() -> None:
    """A single `sigma` argument's error named it `sigmas[0]`; `threshold` alone refused numpy
    floats, which every other real-valued argument takes."""
    from normlab.analysis.collapse import Perturbation, check_threshold

    model = build_model(ModelConfig(d_model=32, n_heads=2, n_layers=1, max_len=16))
    with pytest.raises(ValueError, match=r"^sigma: expected a finite number >= 0; got -0\.1$"):
        Perturbation(model).draw(-0.1, 1, {"tgt": 4}, torch.Generator())
    assert check_threshold(np.float32(0.5)) == 0.5


def test_each_bound_is_where_its_docstring_puts_it() -> None:
    """The edges themselves: only values far past them were tested, so moving a bound by one
    (1024 threads refused, an elapsed time of 0 s refused as no duration, 1 GiB printed as
    1,024.0 MiB) or loosening the misspelling match (`stop` taken for `steps`) passed."""
    assert checks.check_threads(checks.MAX_THREADS, "t") == 1024
    with pytest.raises(ValueError, match=r"^t: expected at most 1024; got 1025$"):
        checks.check_threads(1025, "t")
    assert checks.is_seconds(0) and checks.is_seconds(0.0) and not checks.is_seconds(-1e-9)
    assert [checks.format_bytes(n) for n in (2**30, 2**20, 2**30 - 1, 1023)] == [
        "1.0 GiB", "1.0 MiB", "1,024.0 MiB", "1.0 KiB"]
    assert checks.did_you_mean("step", ["steps", "seed"]) == " (did you mean 'steps'?)"
    assert checks.did_you_mean("stop", ["steps", "seed"]) == ""
    assert checks.did_you_mean("decay", ["weight_decay"]) == ""


def test_memory_bytes_reads_the_system(monkeypatch) -> None:
    """Memory and swap from /proc/meminfo where Linux has it, else the physical pages."""
    total = checks.memory_bytes()
    if Path("/proc/meminfo").exists():
        info = Path("/proc/meminfo").read_text()
        kib = [int(ln.split()[1]) for ln in info.splitlines()
               if ln.startswith(("MemTotal:", "SwapTotal:"))]
        assert total == 1024 * sum(kib)
    # swap counts too (this machine may have none, where leaving it out passed)
    monkeypatch.setattr(checks.Path, "read_text",
                        lambda self: "MemTotal:  8388608 kB\nSwapTotal: 4194304 kB\n")
    assert checks.memory_bytes() == 12 * 2**30
    monkeypatch.setattr(checks.Path, "read_text", lambda self: "no such table")
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert checks.memory_bytes() == pages > 0


@pytest.mark.parametrize(("key", "sign", "message"), [
    ("train.lr", "", r"train\.lr: expected a positive finite number; got inf$"),
    ("train.weight_decay", "-", r"train\.weight_decay: expected a finite number >= 0; got -inf$"),
    ("model.dropout", "", r"model\.dropout: expected a number in \[0, 1\); got inf$"),
])
def test_a_float_field_given_an_int_past_floats_range_is_named(tmp_path, key: str, sign: str,
                                                               message: str) -> None:
    """A 400-digit integer in a float field, from a file or --set, failed in the config's
    reader with "int too large to convert to float" (the CLI: "out of memory or range ... is
    a size too large?"), naming no field, before the field's check could."""
    from normlab.config import load_config

    big = sign + "1" + "0" * 400
    with pytest.raises(ValueError, match="^--set " + message):
        load_config(None, [f"{key}={big}"])
    table, name = key.split(".")
    (tmp_path / "c.toml").write_text(f"[{table}]\n{name} = {big}\n")
    with pytest.raises(ValueError, match="^config file '.*c.toml': " + message):
        load_config(tmp_path / "c.toml")


def test_toml_nested_past_what_tomllib_reads_is_named(tmp_path) -> None:
    """tomllib raises RecursionError past ~900 levels: "maximum recursion depth exceeded"
    named neither the file nor the key."""
    from normlab.config import load_config

    deep = "[" * 5000 + "]" * 5000
    (tmp_path / "deep.toml").write_text(f"[task]\ntrain = {deep}\n")
    with pytest.raises(ValueError, match=r"^config file '.*deep\.toml': invalid TOML \(nested too "
                                         r"deeply to read\)$"):
        load_config(tmp_path / "deep.toml")
    with pytest.raises(ValueError, match=r"^--set 'task\.train': expected a TOML value; this one "
                                         r"is nested too deeply to read$"):
        load_config(None, [f"task.train={deep}"])
    from normlab.sweep import load_sweep

    (tmp_path / "sweep.toml").write_text(f"[grid]\n\"task.train\" = {deep}\n")
    with pytest.raises(ValueError, match=r"^sweep file '.*sweep\.toml': invalid TOML \(nested "
                                         r"too deeply to read\)$"):
        load_sweep(tmp_path / "sweep.toml", tmp_path / "out")


def test_check_int_says_its_upper_bound() -> None:
    """Without `what`, a value at `high` was told "expected an int >= 0": the bound unsaid."""
    with pytest.raises(ValueError, match=r"^n: expected an int >= 0 and < 5; got 5$"):
        check_int(5, "n", high=5)
