"""One-off probe behind a twenty-eighth-session number in docs/performance.md; not make bench.

native.c as it is against native.c at git revision REV, A/B in one process: both builds are
loaded (the kernels' C signatures must be the same at both) and `native`'s library is swapped
between them round by round. Timed: `native.attention` forward and backward under a causal
mask at a training step's shape (128 x 17 keys) and at 64 keys, and under a mask per row
(left padding, causal: a batch of prompts) forward alone at 16 and 64 keys and forward and
backward at 17; an encoder's source padding ([B, 1, 1, S]) forward at 17 keys;
bench_train_step's normlab `pre` step (3 steps a call); bench_decode's n5d1 decodes, cached and
uncached (`pre`). Each line prints the medians and REV / now as median [min, max].

    .venv/bin/python benchmarks/probes/native_rev_ab.py REV [THREADS]
"""
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import N5d1Decoder, ab, probe_header

from bench_train_step import base_config, build_contender, model_config, real_batch
from normlab import allocator
from normlab.model import native

USAGE = "usage: native_rev_ab.py REV [THREADS], THREADS >= 1"
if not 2 <= len(sys.argv) <= 3 or (len(sys.argv) == 3 and not (sys.argv[2].isdigit()
                                                                  and int(sys.argv[2]) >= 1)):
    sys.exit(USAGE)
rev = sys.argv[1]
root = Path(__file__).resolve().parents[2]
try:
    old_src = subprocess.run(["git", "show", f"{rev}:src/normlab/model/native.c"], cwd=root,
                             capture_output=True, check=True).stdout
except subprocess.CalledProcessError as e:
    sys.exit(f"native_rev_ab.py: git show {rev}:src/normlab/model/native.c failed: "
             f"{e.stderr.decode().strip()}")
allocator.keep_freed_memory()
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
now_lib = native.load()
print(f"{torch.get_num_threads()} thread(s); kernels: {native.describe()}")
safe = "".join(c if c.isalnum() else "_" for c in rev)  # a REV such as origin/main
here = Path(__file__).resolve().parent / f"native_rev_{safe}.c"
here.write_bytes(old_src)  # native builds what SOURCE names (and caches the build by content)
try:
    native.SOURCE, native._lib, native._tried = here, None, False
    old_lib = native.load()
finally:
    here.unlink()
    native.SOURCE = Path(native.__file__).with_name("native.c")
if now_lib is None or old_lib is None:
    sys.exit("native_rev_ab.py: a build of native.c failed")
probe_header("native_rev_ab.py", f"native.c at {rev} (the 'before') against the working tree")
names = (rev[:9], "now")


def switch(on: bool) -> None:
    native._lib = now_lib if on else old_lib


def warm_ab(label: str, fn, inner: int) -> None:
    """`ab` after one call with each build (a first call's costs are not the build's)."""
    for on in (False, True):
        switch(on)
        fn()
    ab(label, switch, fn, inner, rounds=15, names=names)


def attention_case(b: int, t: int, mask: str, train: bool):
    """`native.attention` on [b, 4, t, 16] under a causal mask, a left padding per row (0-3
    keys, causal, each query seeing its own key) or a source padding per row ([b, 1, 1, t])."""
    g = torch.Generator().manual_seed(t)
    q, k, v = (torch.randn(b, 4, t, 16, generator=g).requires_grad_(train) for _ in range(3))
    scale = torch.full((4,), 0.25)
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
    real = torch.arange(t)[None, :] >= (torch.arange(b) % 4)[:, None]  # [b, t]
    m = {"causal": causal,
         "left padded": (causal & real[:, None, None, :]) | torch.eye(t, dtype=torch.bool),
         "source padded": real.flip(-1)[:, None, None, :]}[mask]
    gz = torch.randn(b, 4, t, 16, generator=g)

    def fn() -> None:
        with torch.set_grad_enabled(train):
            z = native.attention(q, k, v, scale, m)
            if train:
                torch.autograd.grad(z, (q, k, v), gz)
    return fn


print("native.attention, 4 heads of 16 (ms per call):")
for b, t, mask, train in ((128, 17, "causal", True), (34, 64, "causal", True),
                          (128, 17, "left padded", True), (256, 16, "left padded", False),
                          (64, 64, "left padded", False), (128, 17, "source padded", False)):
    label = f"{mask} {b}x{t} {'fwd+bwd' if train else 'fwd'}"
    warm_ab(label, attention_case(b, t, mask, train), 10)
run = base_config()
print("training step, 3 steps a call; n5d1 decodes (ms per call):")
step = build_contender("normlab", model_config(run, 64, "pre"), run, real_batch(run))[1]
warm_ab("pre step", step, 3)
dec = N5d1Decoder(run)
warm_ab("n5d1 cached", lambda: dec.decode(True), 1)
warm_ab("n5d1 uncached", lambda: dec.decode(False), 1)
