"""One-off probe behind a ninth-session note in docs/performance.md; not part of make bench.

`benchmarks/bench_decode.py` with `EXPLICIT_MAX_KEYS_CPU` overridden, to see whether the
explicit-path rule for short rows changes the cached / uncached decoding ratio (0 = SDPA
whenever no hook reads the pattern, as before the ninth session; 64 = the current rule):

    .venv/bin/python benchmarks/probes/decode_attn_rule.py KEYS --threads T --out FILE
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import normlab.model.attention as attention  # noqa: E402

attention.EXPLICIT_MAX_KEYS_CPU = int(sys.argv[1])
sys.argv = ["bench_decode.py", *sys.argv[2:]]
import bench_decode  # noqa: E402

bench_decode.main()
