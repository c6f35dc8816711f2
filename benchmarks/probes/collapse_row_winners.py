"""One-off probe behind a twenty-ninth-session note in docs/performance.md; not make bench.

Since the twenty-seventh session an unhooked layer's short rows (<= 64 keys on CPU) run
`native.attention`, which never forms the pattern; yet until the twenty-ninth the collapse
sweep read `hook_pattern` there (`collapse._PatternWinners`), which sends each site's layer
back to the explicit path. This probe times the sweep reading the pattern at every site
against reading the rows' q and k (`collapse._RowWinners`, which leaves every layer to the
kernel, or to the explicit path with `NORMLAB_NATIVE_ATTENTION=0`), on bench_collapse's set-up
(`abtime.Sweep`: `qkv`, random weights, 64 examples, 16 draws): first that both readers give
the same result (every field but the timings), then the perturbed forwards' time
(`sweep_seconds`) under each, alternating, 15 rounds; printed as ms and pattern / rows (above 1:
reading q and k is faster).

    .venv/bin/python benchmarks/probes/collapse_row_winners.py [THREADS]
"""
import statistics as st
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import Sweep, probe_header, threads_from_argv

from normlab import allocator
from normlab.analysis import collapse

allocator.keep_freed_memory()
threads_from_argv("collapse_row_winners.py")
probe_header("collapse_row_winners.py")
TIMINGS = ("sweep_seconds", "rows_per_s")
RULE = collapse._winners


def by_pattern(site: collapse.Site, part: object, example: torch.Tensor, head: torch.Tensor,
               qpos: torch.Tensor, attendable: torch.Tensor) -> collapse._PatternWinners:
    """`_winners` choosing the pattern at every width."""
    return collapse._PatternWinners(site, example, head, qpos)


def by_rows(site: collapse.Site, part: object, *rows: torch.Tensor) -> collapse._RowWinners:
    """`_winners` choosing q and k at every width (rows: example, head, qpos, attendable)."""
    return collapse._RowWinners(site, *rows)


def reader(rows: bool) -> None:
    collapse._winners = by_rows if rows else by_pattern


def same(a: object, b: object) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(k in TIMINGS or same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    return a == b


sweep = Sweep()
results = []
for rows in (False, True):
    reader(rows)
    results.append(sweep.vectorised())
print("the same result from both readers (timings aside):", same(*results))
times: dict[bool, list[float]] = {False: [], True: []}
for r in range(15):
    for rows in (False, True) if r % 2 == 0 else (True, False):
        reader(rows)
        times[rows].append(sweep.vectorised()["sweep_seconds"])
collapse._winners = RULE
ratios = [p / q for p, q in zip(times[False], times[True], strict=True)]
print(f"  sweep_seconds: pattern {1e3 * st.median(times[False]):.1f} ms, rows "
      f"{1e3 * st.median(times[True]):.1f} ms, pattern / rows {st.median(ratios):.3f} "
      f"[{min(ratios):.3f}, {max(ratios):.3f}]")
