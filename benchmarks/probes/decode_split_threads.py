"""One-off probe behind a note in the thirty-fourth section of docs/performance.md; not part
of make bench.

Two-thread decoding (row 3) misses 3× on the quick grid's n5d1 because a cached step pays a
per-call cost (Python, dispatch) that torch's two intra-op threads do not shrink (thirtieth and
thirty-second sections). Could the two threads instead each decode half the prompts, one
torch thread each, as two Python threads? torch releases the GIL inside its ops, so the halves'
arithmetic could overlap; the Python between the ops holds it, so their per-call costs could
not. bench_decode's n5d1 cell (`pre`, the quick-grid size, random weights, seed 0, the recipe's
256 evaluation prompts; glibc keeping freed memory, as the benchmarks run): the cached and the
uncached decode of all prompts on two intra-op threads, as bench_decode times them, against
the same decodes split in two Python threads with torch set to one thread for the duration
(`torch.set_num_threads` is process-wide: set in a worker it would change the other decodes'
count too). Contenders alternate (`paired_timing`, 21 repeats after 5 warm-up rounds); the
split decodes must write the same tokens as the whole ones.

    .venv/bin/python benchmarks/probes/decode_split_threads.py
"""
import sys
import threading
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import N5d1Decoder, probe_header

from bench_train_step import base_config
from common import median, paired_timing
from normlab import allocator

allocator.keep_freed_memory()
torch.set_num_threads(2)
cell = N5d1Decoder(base_config())
prompts, half = cell.prompts, len(cell.prompts) // 2


def whole(cached: bool) -> list[list[int]]:
    return cell.decode(cached)


def split(cached: bool) -> list[list[int]]:
    """Each half of the prompts decoded in its own Python thread, torch on one thread."""
    out: list[list[list[int]]] = [[], []]

    def work(i: int, rows: list[list[int]]) -> None:
        out[i] = cell.decode(cached, rows)

    torch.set_num_threads(1)
    try:
        workers = [threading.Thread(target=work, args=(0, prompts[:half])),
                   threading.Thread(target=work, args=(1, prompts[half:]))]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        torch.set_num_threads(2)
    return out[0] + out[1]


def main() -> None:
    probe_header("decode_split_threads.py", "two threads: torch's intra-op pair, or two Python "
                 "threads of one torch thread each")
    with torch.no_grad():
        for cached in (True, False):
            assert split(cached) == whole(cached), "decode_split_threads.py: tokens differ"
        times = paired_timing({"cached": lambda: whole(True), "cached, split": lambda: split(True),
                               "uncached": lambda: whole(False),
                               "uncached, split": lambda: split(False)}, repeats=21, warmup=5)
    ms = {name: 1e3 * median(ts) for name, ts in times.items()}
    print(f"n5d1, {len(prompts)} prompts ({half} a thread when split), {cell.max_new} new "
          f"tokens; median ms of 21; the split decodes write the same tokens")
    for name, t in ms.items():
        print(f"  {name}: {t:.1f}")
    print(f"  speed-up as bench_decode measures it: {ms['uncached'] / ms['cached']:.2f}; with "
          f"the cached decode split: {ms['uncached'] / ms['cached, split']:.2f}; both split: "
          f"{ms['uncached, split'] / ms['cached, split']:.2f}")


if __name__ == "__main__":
    main()
