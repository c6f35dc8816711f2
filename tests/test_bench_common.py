"""benchmarks/common.py: the load warning counts only load beyond the run's own threads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import common


def _info(start: float, threads: int) -> dict[str, object]:
    return {"loadavg_1m_at_start": start, "threads": threads, "cpu_count": 2}


@pytest.mark.parametrize(
    ("start", "now", "threads", "flagged"),
    [
        (0.2, 1.9, 2, False),  # a 2-thread run loads the machine by itself
        (0.2, 1.0, 1, False),  # a 1-thread run, nothing else
        (0.2, 1.7, 1, True),   # a 1-thread run and another busy process
        (0.2, 2.7, 2, True),   # 2 threads and more
        (1.1, 0.3, 1, True),   # load left by an earlier job at the start
    ],
)
def test_load_note_counts_only_load_beyond_the_runs_threads(
    monkeypatch: pytest.MonkeyPatch, start: float, now: float, threads: int, flagged: bool
) -> None:
    monkeypatch.setattr(common.os, "getloadavg", lambda: (now, now, now))
    note = common.load_note(_info(start, threads))
    assert note.startswith("MEASURED UNDER LOAD") is flagged
    if flagged:
        assert f"{max(start, now):.2f} on 2 CPUs, {threads} thread(s)" in note
