"""One-off probe behind a fourteenth-session number in docs/performance.md; not part of make bench.

Embedding lookups as `table[ids]` (indexing; normlab before the fourteenth session) or
`F.embedding(ids, table)` (`normlab.model.positions.lookup` now):

    .venv/bin/python benchmarks/probes/embedding_backward.py micro
        forward + backward time of both on the training batch's shapes ([128, 17] ids into a
        16-token vocabulary and into the 8 digit positions, plus a GPT-2-sized table) at one
        and two threads, and whether the gradient is the same bitwise over 20 backward
        passes at two threads and equal to the one-thread gradient
    .venv/bin/python benchmarks/probes/embedding_backward.py index|embedding BENCH [args]
        a benchmark module (bench_train_step, ...) with every lookup done one way, so
        alternating processes give a before/after of the change
"""
import importlib
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import normlab.model.positions as positions
import normlab.model.transformer as transformer
from common import median, paired_timing

RULES: dict[str, Callable[..., torch.Tensor]] = {  # (table, ids[, what]) as `lookup` takes
    "index": lambda table, ids, what="": table[ids],
    "embedding": lambda table, ids, what="": F.embedding(ids, table),
}
USAGE = "usage: embedding_backward.py micro | index|embedding BENCH [its arguments]"


def timed(fn: Callable[[], object], n: int = 50) -> float:
    """Median µs per call over 9 rounds of n calls (`common.paired_timing`, 5 warm-up calls)."""
    return 1e6 * median(paired_timing({"fn": fn}, repeats=9, inner=n, warmup=5)["fn"])


def grad(rule: str, table: torch.Tensor, ids: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    table.grad = None
    RULES[rule](table, ids).backward(g)
    return table.grad.clone()


def step(rule: str, table: torch.Tensor, ids: torch.Tensor,
         g: torch.Tensor) -> Callable[[], None]:
    return lambda: RULES[rule](table, ids).backward(g)


def micro() -> None:
    torch.manual_seed(0)
    cases = [(16, (128, 17), "tokens, quick-grid batch"), (8, (128, 17), "digit positions"),
             (50257, (8, 1024), "GPT-2 vocabulary")]
    for vocab, shape, what in cases:
        table = torch.randn(vocab, 64, requires_grad=True)
        ids = torch.randint(0, vocab, shape)
        g = torch.randn(*shape, 64)
        for rule in RULES:
            torch.set_num_threads(1)
            one = grad(rule, table, ids, g)
            us1 = timed(step(rule, table, ids, g))
            torch.set_num_threads(2)
            twos = [grad(rule, table, ids, g) for _ in range(20)]
            us2 = timed(step(rule, table, ids, g))
            same = all(torch.equal(twos[0], x) for x in twos)
            spread = max(float((twos[0] - x).abs().max()) for x in twos)
            print(f"{what:26s} vocab {vocab:5d} ids {shape}: {rule:9s} fwd+bwd {us1:7.1f} us "
                  f"(1 thread) {us2:7.1f} us (2 threads); 2-thread grads identical over 20: "
                  f"{same} (spread {spread:.1e}); equal to 1 thread: {torch.equal(one, twos[0])}")


if len(sys.argv) < 2:
    sys.exit(USAGE)
if sys.argv[1] == "micro":
    micro()
elif sys.argv[1] in RULES and len(sys.argv) > 2:
    positions.lookup = transformer.lookup = RULES[sys.argv[1]]
    bench = sys.argv[2]
    sys.argv = [f"{bench}.py", *sys.argv[3:]]
    module = importlib.import_module(bench)
    if hasattr(module, "main"):
        module.main()
else:
    sys.exit(USAGE)
