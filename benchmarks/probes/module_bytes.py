"""What a layer of a built model holds beyond its weights: Python's module, hook-point and
tensor objects. `transformer.MODULE_BYTES`, which `build_model`'s memory check adds for every
module of every layer, must stay below the smallest of these per module so that the check
refuses no model that would fit. Each configuration is built in a fresh process (1000 layers,
after one warm-up build), and its resident memory's growth per layer is printed beside its
weights per layer and, beyond them, per module.

Usage: `.venv/bin/python benchmarks/probes/module_bytes.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys

CONFIGS = [
    {"norm_placement": "none", "d_model": 8, "n_heads": 2},
    {"norm_placement": "none", "d_model": 64},
    {"norm_placement": "pre", "d_model": 8, "n_heads": 2},
    {"norm_placement": "qkv", "d_model": 8, "n_heads": 2},
    {"norm_placement": "pre", "d_model": 64},
    {"arch": "encoder_decoder", "norm_placement": "none", "d_model": 8, "n_heads": 2},
]
LAYERS = 1000

CHILD = """
import json, sys
from normlab import ModelConfig, build_model
from normlab.model.transformer import footprint
kw, layers = json.loads(sys.argv[1]), int(sys.argv[2])
depth = {"n_layers": layers} if kw.get("arch") != "encoder_decoder" else {
    "n_encoder_layers": layers // 2, "n_decoder_layers": layers // 2}
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
build_model(ModelConfig(**kw, **{k: 2 for k in depth}))  # warm: imports, first allocations
cfg = ModelConfig(**kw, **depth)
before = rss()
model = build_model(cfg)
fp = footprint(type(model), cfg)
print(json.dumps({"resident": (rss() - before) / layers, "weights": fp.total / layers,
                  "modules": fp.modules / layers}))
"""


def main() -> None:
    print("| config | resident KiB a layer | weights KiB a layer | beyond the weights | "
          "modules a layer | KiB a module |")
    print("|---|---|---|---|---|---|")
    for kw in CONFIGS:
        out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(kw), str(LAYERS)],
                             capture_output=True, text=True, check=True).stdout
        got = json.loads(out)
        beyond = (got["resident"] - got["weights"]) / 1024
        print(f"| {kw} | {got['resident'] / 1024:.0f} | {got['weights'] / 1024:.1f} | "
              f"{beyond:.0f} | {got['modules']:g} | {beyond / got['modules']:.2f} |")


if __name__ == "__main__":
    main()
