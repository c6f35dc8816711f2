"""A/B timing for probes: one switch flipped off and on, alternating, in one process."""
import statistics as st
import time
from collections.abc import Callable


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
