"""Checks of arguments shared by every layer, so each refuses bad input alike, in one line.

A whole-number argument (a seed, a count, a size) passes when it is an integer, numpy's
included, and at least `low`. A bool is refused: `True` would pass as 1 unseen. So is a float,
even a whole one: `int()` would round 1.7 down unseen, and a size read as 2.0 is a typo.
A real-valued argument (a noise level, a fraction) passes when it is a finite real number,
numpy's included and a bool not, in its range. Config files are checked against their
dataclass's hints instead (`normlab.config.typed`). `first_line` cuts another library's error
to the one line such an error quotes.
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported where a model is checked: the command parses first
    from torch import nn


def is_int(value: object) -> bool:
    """An integer (Python's or numpy's), and not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(value: object, name: str, *, low: int = 0, high: int | None = None,
              what: str | None = None) -> int:
    """`value` as a Python int if it is an integer >= `low` (and < `high`, where given); else a
    one-line ValueError "`name`: expected `what`; got `value`" (`what` defaults to "an int >=
    `low`")."""
    if not is_int(value) or value < low or (high is not None and value >= high):  # type: ignore[operator]
        bounds = f"an int >= {low}" + (f" and < {high}" if high is not None else "")
        raise ValueError(f"{name}: expected {what or bounds}; got {value!r}")
    return int(value)  # type: ignore[call-overload]


def is_real(value: object) -> bool:
    """A real number (Python's or numpy's, float32 included), and not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def is_seconds(value: object) -> bool:
    """A duration as result files record it: a finite real number >= 0."""
    return is_real(value) and 0 <= value < math.inf  # type: ignore[operator]


def is_fraction(value: object) -> bool:
    """A real number in [0, 1], as a rate or an accuracy is (NaN is not)."""
    return is_real(value) and 0 <= value <= 1  # type: ignore[operator]


def check_real(value: object, name: str, *, what: str,
               ok: Callable[[float], bool] = lambda v: True) -> float:
    """`value` as a Python float if it is a finite real number for which `ok` holds; else a
    one-line ValueError "`name`: expected `what`; got `value`". NaN and inf are always
    refused: every real-valued argument here feeds arithmetic that they would turn to NaN."""
    try:  # a 400-digit int overflows float(): refused here, where the field is named
        number = float(value) if is_real(value) else math.nan  # type: ignore[arg-type]
    except OverflowError:
        number = math.nan
    if not math.isfinite(number) or not ok(number):
        raise ValueError(f"{name}: expected {what}; got {value!r}")
    return number


#: the largest noise level: a score's (1 + eps)^2 passes float32's 3.4e38 from eps ~ 2e19, and
#: the sweep counted the argmax of inf and NaN scores as collapse (a row's winner is long gone
#: at 1e6)
MAX_SIGMA = 1e6


def check_sigma(value: object, name: str = "sigma") -> float:
    """One noise level: a finite number in [0, MAX_SIGMA]."""
    sigma = check_real(value, name, what="a finite number >= 0", ok=lambda v: v >= 0)
    if sigma > MAX_SIGMA:
        raise ValueError(f"{name}: expected at most {MAX_SIGMA:g} (noise past it overflows "
                         f"float32 attention scores); got {value!r}")
    return sigma


def check_sigmas(sigmas: object, name: str = "sigmas") -> list[float]:
    """Noise levels: one number or a non-empty sequence of finite numbers >= 0, as floats."""
    if callable(getattr(sigmas, "tolist", None)):  # a numpy array or torch tensor, as numbers
        sigmas = sigmas.tolist()  # type: ignore[union-attr]
    if is_real(sigmas):
        return [check_sigma(sigmas)]
    try:
        if isinstance(sigmas, str | bytes | Mapping | AbstractSet):  # a set has no order
            raise TypeError
        items = list(sigmas)  # type: ignore[call-overload]
    except TypeError:  # not a collection (None, a 0-d tensor)
        raise ValueError(f"{name}: expected a list of numbers >= 0; got {sigmas!r}") from None
    if not items:
        raise ValueError(f"{name}: expected at least one sigma")
    return [check_sigma(s, f"{name}[{i}]") for i, s in enumerate(items)]


#: torch threads a run or an analysis may ask for (a sweep's runs may be for bigger hosts);
#: libgomp crashes the process (exit 139) far above this
MAX_THREADS = 1024


def check_threads(value: object, name: str) -> int:
    """A torch thread count: an int in [1, MAX_THREADS]."""
    n = check_int(value, name, low=1)
    if n > MAX_THREADS:
        raise ValueError(f"{name}: expected at most {MAX_THREADS}; got {n}")
    return n


def check_seed(value: object, name: str = "seed") -> int:
    """A seed for torch's and numpy's generators, checked before any work (torch's overflow
    error past 2**64 - 1 names no field; numpy refuses a negative one only when it is used).
    One range for every seed, the one a run config can hold: TOML's integers are 64-bit
    signed, so a larger `train.seed` could not be written down and read back losslessly."""
    seed = check_int(value, name, what="an int in [0, 2**63)")
    if seed >= 2**63:
        raise ValueError(f"{name}: expected an int in [0, 2**63); got {value!r}")
    return seed


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """" (did you mean 'x'?)" for the closest of `choices` to a misspelt `word`, else ""."""
    if not isinstance(word, str):  # a key from Python (from_dict), not from TOML
        return ""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def first_line(err: BaseException) -> str:
    """An exception's message cut to one line (transformers' run to tables and advice); a first
    line that ends in a colon ("Validation error for field 'n_layer':") keeps the next."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()] or [type(err).__name__]
    return " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def check_on_cpu(model: nn.Module) -> None:
    """The analyses build their inputs, masks and noise on the CPU and read results back as
    numpy: a model on another device is refused in one line, not deep inside a forward."""
    weight = next(model.parameters(), None)  # a stand-in model may have none
    if weight is not None and weight.device.type != "cpu":
        raise ValueError(f"model: expected a model on the CPU, where the analyses run; got one "
                         f"on {weight.device} (call model.cpu() first)")


def memory_bytes() -> int | None:
    """This machine's memory and swap together (what no allocation can exceed), or None where
    the system does not say."""
    try:
        info = dict(ln.split(":", 1) for ln in Path("/proc/meminfo").read_text().splitlines())
        return sum(int(info[k].split()[0]) * 1024 for k in ("MemTotal", "SwapTotal"))
    except (OSError, KeyError, ValueError):
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            return None


def format_bytes(n: float) -> str:
    """A size for a message: GiB, MiB or KiB, one decimal."""
    for size, unit in ((2**30, "GiB"), (2**20, "MiB")):
        if n >= size:
            return f"{n / size:,.1f} {unit}"
    return f"{n / 2**10:,.1f} KiB"
