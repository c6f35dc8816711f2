"""A/B timing for probes (one switch flipped off and on, alternating, in one process), and the
set-ups several probes time. Probes put `benchmarks/` on sys.path before importing this."""
import random
import statistics as st
import sys
import time
from collections.abc import Callable

import torch

from bench_collapse import SEED, SIGMA, eval_data, naive_sweep, random_model
from bench_train_step import model_config
from common import header, machine_info

from normlab import build_model
from normlab.analysis.collapse import (
    DEFAULT_MAX_TOKENS,
    Perturbation,
    find_sparse_rows,
    measure_collapse,
)
from normlab.analysis.data import chunk_copies
from normlab.config import RunConfig
from normlab.model import native
from normlab.model.generate import greedy_decode
from normlab.tasks.addition import (
    aux_positions,
    eval_sets,
    make_prompts,
    max_lengths,
    next_aux_position,
)


def threads_from_argv(usage: str) -> None:
    """A probe's one optional argument, THREADS (default 1): set torch's thread count and print
    it with the kernels that run; anything else exits with the usage line."""
    if len(sys.argv) > 2 or (len(sys.argv) == 2 and not (sys.argv[1].isdigit()
                                                          and int(sys.argv[1]) >= 1)):
        sys.exit(f"usage: {usage} [THREADS], THREADS >= 1")
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    print(f"{torch.get_num_threads()} thread(s); kernels: {native.describe()}")


def probe_header(name: str, extra: str | None = None) -> None:
    """Print the machine facts and the commit (`common.header`), then `extra`, by default
    this process's malloc setting."""
    info = machine_info(torch.get_num_threads())
    print(header(name, info, f"git {info['git']}; {extra or 'malloc: ' + info['malloc']}"))


def ab(label: str, switch: Callable[[bool], None], fn: Callable[[], object], inner: int,
       rounds: int = 15, names: tuple[str, str] = ("unbound", "bound")) -> list[float]:
    """Print ms per call of `fn` with the switch off and on, and off / on; return the ratios."""
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(rounds):
        for on in (False, True) if r % 2 == 0 else (True, False):
            switch(on)
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            times[on].append((time.perf_counter() - t0) / inner * 1e3)
    switch(True)
    ratios = [u / b for u, b in zip(times[False], times[True], strict=True)]
    off, on = names
    print(f"  {label:24s} {off} {st.median(times[False]):8.3f} ms, {on} "
          f"{st.median(times[True]):8.3f} ms, {off} / {on} {st.median(ratios):.3f} "
          f"[{min(ratios):.3f}, {max(ratios):.3f}]")
    return ratios


def shuffled(ways: dict, rounds: int, warmup: int = 2, seed: int = 0) -> dict:
    """Seconds per call of each of `ways` (name -> fn), every round in a new random order
    (`seed`), after `warmup` calls each: for more than two contenders, where `ab`'s
    alternation leaves an order effect."""
    for fn in ways.values():
        for _ in range(warmup):
            fn()
    times: dict = {name: [] for name in ways}
    rng = random.Random(seed)
    for _ in range(rounds):
        order = list(ways.items())
        rng.shuffle(order)
        for name, fn in order:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return times


def cell_prompts(run: RunConfig, label: str) -> tuple[list[list[int]], int]:
    """A bench_decode cell (an extrapolation cell, "n5d1" or "n2d3"): its first 256 questions
    as decoder prompts, and max_new."""
    sets = eval_sets(run.validate())
    cell = next(c for c in sets["extrapolation"] if c.label == label)
    prompts = make_prompts([q for q, _ in sets["extrapolation"][cell][:256]], "decoder")
    return prompts, max_lengths([cell])[1] + 1


def n5d1_prompts(run: RunConfig) -> tuple[list[list[int]], int]:
    """bench_decode's n5d1 cell: its first 256 questions as decoder prompts, and max_new."""
    return cell_prompts(run, "n5d1")


class N5d1Decoder:
    """bench_decode's n5d1 cell as the decoding probes time it: a decoder of the quick-grid
    size (random weights, seed 0) and greedy decoding of the cell's 256 prompts, forced to
    max_new tokens, with the digit positions computed step by step."""

    def __init__(self, run: RunConfig, placement: str = "pre") -> None:
        self.prompts, self.max_new = n5d1_prompts(run)
        torch.manual_seed(0)
        self.model = build_model(model_config(run, run.model.d_model, placement)).eval()

    def decode(self, cached: bool, prompts: list[list[int]] | None = None) -> list[list[int]]:
        """The cell's prompts, or `prompts` (some of them), decoded."""
        return greedy_decode(self.model, self.prompts if prompts is None else prompts,
                             max_new=self.max_new, eos=-1,
                             aux_fn=aux_positions, aux_next=next_aux_position,
                             use_cache=cached)


class Sweep:
    """bench_collapse's set-up (qkv, random weights, 64 examples, 16 draws) and its contenders."""

    def __init__(self) -> None:
        run, self.model = random_model()
        self.model.eval()
        self.data = eval_data(run, 64)
        self.rows = find_sparse_rows(self.model, self.data, threshold=0.9)
        self.pert = Perturbation(self.model)
        self.chunk = chunk_copies(self.data, DEFAULT_MAX_TOKENS, 16)

    def naive(self) -> None:
        naive_sweep(self.model, self.data, self.rows, self.pert, SIGMA, 16, self.chunk)

    def vectorised(self) -> dict:
        return measure_collapse(self.model, self.data, sigmas=[SIGMA], n_draws=16,
                                threshold=0.9, theory_draws=1, seed=SEED)

    def ab(self, switch: Callable[[bool], None], names: tuple[str, str]) -> None:
        """Both contenders A/B, 9 rounds each."""
        ab("naive loop", switch, self.naive, 1, rounds=9, names=names)
        ab("measure_collapse", switch, self.vectorised, 1, rounds=9, names=names)
