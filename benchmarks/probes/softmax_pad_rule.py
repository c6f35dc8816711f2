"""One-off probe behind a twelfth-session number in docs/performance.md; not part of make bench.

Runs one benchmark of `benchmarks/` with `attention.SOFTMAX_MIN_KEYS_CPU` overridden (0 = no
padding, plain `softmax(-1)` on every row, as before the twelfth session; 16 = the current
rule), so alternating processes give a before/after of the short-row softmax padding:

    .venv/bin/python benchmarks/probes/softmax_pad_rule.py KEYS BENCH --threads T --out FILE

BENCH is a benchmark module's name, e.g. bench_collapse, bench_decode, bench_train_step, or
a probe script's (collapse_prof: it runs on import; its arguments follow it).
"""
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import normlab.model.attention as attention

if len(sys.argv) < 3 or not sys.argv[1].isdigit():
    sys.exit("usage: softmax_pad_rule.py KEYS BENCH [its arguments]; KEYS: an int >= 0, "
             "e.g. 0 (no padding) or 16")
attention.SOFTMAX_MIN_KEYS_CPU = int(sys.argv[1])
bench = sys.argv[2]
sys.argv = [f"{bench}.py", *sys.argv[3:]]
module = importlib.import_module(bench)
if hasattr(module, "main"):
    module.main()
