"""One-off probe behind a thirty-second-session note in docs/performance.md; not part of make
bench.

What would a kernel for a whole cached decoding step give? `decode_step_kernel.c` runs every
block of bench_decode's n5d1 step (`pre`, the quick-grid size, random weights, seed 0; glibc
keeping freed memory, as the benchmarks run) in one C call, each thread taking its own rows
through all the blocks (the file says how). Python only looks up the embeddings and RoPE's
tables before it and applies the final norm and the unembedding after it. Its logits must match
the model's (within 1e-4). Then, with `decode_step_floor.py`'s set-up:

- the second of the three steps, the model's, the floor's (written out by hand over torch's ops
  and normlab's kernels) and the kernel's, in turn, median of 41 rounds (after 5);
- the whole cached decode, the same decode with the kernel taking every single-token step (the
  model's forward swapped for the kernel's on those calls; the prompt forward and
  `greedy_decode`'s loop are the model's), and the uncached decode, side by side as
  `bench_decode.py` times them (median of 21 after 5); all three must write the same tokens.
  The kernel's steps skip most of what the model's forward does around its blocks (its input
  checks, positions from the mask, the causal mask, hook points, `append_kv`'s checks), so the
  speed-up with them bounds what a kernel taken into the model, which would keep some of that,
  could give.

    .venv/bin/python benchmarks/probes/decode_step_kernel.py [THREADS]
"""
import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import probe_header, threads_from_argv
from decode_step_floor import (
    cell,
    e,
    floor_step,
    h,
    layers,
    max_new,
    model,
    model_step,
    prompts,
    second_step,
    step_times,
)

from common import median, paired_timing
from normlab.model import native
from normlab.model.transformer import KVCache

SOURCE = Path(__file__).with_name("decode_step_kernel.c")
cfg = model.cfg
D, M, L = cfg.d_model, cfg.d_mlp, cfg.n_layers
assert (h * e == D <= 256 and max(3 * D, M) <= 1024 and D % 32 == 0 and M % 32 == 0
        and e <= 64 and not cfg.norm_gain_offset
        and all(blk.ln1.b is not None and blk.ln2.b is not None for blk in model.blocks)), \
    "decode_step_kernel.py: the kernel is written for this cell's model"


def build(out_dir: str) -> ctypes.CDLL:
    """Compile the kernel with native.c's first flags; exit with the compiler's error if not."""
    so = Path(out_dir) / "decode_step_kernel.so"
    cmd = [*native.compiler(), *native.FLAG_SETS[0], "-shared", "-fPIC", str(SOURCE), "-o",
           str(so)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:  # one line: the compiler's first error, or its last word
        lines = done.stderr.strip().splitlines() or ["no message"]
        first = next((ln for ln in lines if "error" in ln), lines[-1])
        sys.exit(f"decode_step_kernel.py: could not build {SOURCE.name}: {first}")
    lib = ctypes.CDLL(str(so))
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.probe_step.argtypes = [p, p, p, i64, *[p] * 11, i64, i64, p, i64, i64, i64, i64,
                               ctypes.c_float, ctypes.c_int]
    return lib


def ptrs(ts: list[torch.Tensor]) -> ctypes.Array:
    return (ctypes.c_void_p * len(ts))(*[t.data_ptr() for t in ts])


def run(lib: ctypes.CDLL) -> None:
    ln1, w_qkv, w_o, scale, ln2, w_in, w_out = zip(*layers, strict=True)  # the floor's, by layer
    weights = [[n.w for n in ln1], [n.b for n in ln1], w_qkv, w_o, [n.w for n in ln2],
               [n.b for n in ln2], w_in, w_out, scale]  # in the order probe_step takes them
    assert all(t.is_contiguous() for ts in weights for t in ts)
    arrays = [ptrs(list(w)) for w in weights]
    threads = torch.get_num_threads()

    def kernel_step(cache: KVCache, nxt: torch.Tensor, m: torch.Tensor, a: torch.Tensor
                    ) -> torch.Tensor:
        """The second step in one C call: logits [b, vocab]; the cache's buffers get position
        `cache.length` (its views and length are the caller's to move on)."""
        b, n = nxt.shape[0], cache.length
        kv = [layer["self"] for layer in cache.layers]
        cap = kv[0]["buf_k"].shape[2]
        assert (n < cap and n + 1 <= native.ATTN_MAX_KEYS and m.dtype is torch.bool
                and m.shape == (b, n + 1) and m.is_contiguous()), "the step's inputs"
        x = model.embed.W_E[nxt] + model.W_aux[a]  # [b, d_model], written in place
        rope = model.rotary((m.sum(-1) - 1)[:, None])
        cos, sin = rope.cos.reshape(b, e), rope.sin.reshape(b, e)
        lib.probe_step(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), L, *arrays,
                       ptrs([c["buf_k"] for c in kv]), ptrs([c["buf_v"] for c in kv]), cap, n,
                       m.data_ptr(), b, D, h, M, cfg.norm_eps, threads)
        return model.unembed(model.ln_final(x))

    forward = model.forward

    def kernel_forward(ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                       cache: KVCache | None = None, aux: torch.Tensor | None = None,
                       **kw: Any) -> torch.Tensor:
        """The model's forward, but a cached single-token step is the kernel's."""
        if cache is None or ids.shape[1] != 1 or not cache.length or kw or aux is None:
            return forward(ids, attention_mask=attention_mask, cache=cache, aux=aux, **kw)
        assert attention_mask is not None
        n = cache.length
        logits = kernel_step(cache, ids[:, 0], attention_mask, aux[:, 0])
        for layer in cache.layers:  # as append_kv leaves the cache after a step
            c = layer["self"]
            c["k"], c["v"] = c["buf_k"][:, :, :n + 1], c["buf_v"][:, :, :n + 1]
            c["filled"].fill_(n + 1)
        cache.length = n + 1
        return logits[:, None]

    def kernel_decode() -> list[list[int]]:
        """The cached decode (`cell.decode`), its single-token steps the kernel's."""
        model.forward = kernel_forward
        try:
            return cell.decode(True)
        finally:
            del model.forward  # the class's forward again

    with torch.no_grad():
        diff = (model_step(*second_step(prompts)) - kernel_step(*second_step(prompts))
                ).abs().max().item()
        assert diff < 1e-4, f"decode_step_kernel.py: the kernel's logits are {diff} off the model's"
        steps = step_times(prompts, (("model", model_step), ("floor", floor_step),
                                     ("kernel", kernel_step)))
    outs = [cell.decode(True), kernel_decode(), cell.decode(False)]
    assert outs[0] == outs[1] == outs[2], "decode_step_kernel.py: the decodes' tokens differ"
    times = paired_timing({"cached": lambda: cell.decode(True), "kernel": kernel_decode,
                           "uncached": lambda: cell.decode(False)}, repeats=21, warmup=5)
    ms = {k: 1e3 * median(v) for k, v in times.items()}
    print(f"n5d1, {len(prompts)} prompts, {max_new} new tokens, {L} "
          f"blocks; median ms; the kernel's logits within {diff:.1e} of the model's; the "
          "three decodes write the same tokens")
    print(f"  one step: model {steps['model']:.2f}, floor {steps['floor']:.2f}, kernel "
          f"{steps['kernel']:.2f} (kernel / model {steps['kernel'] / steps['model']:.3f})")
    print(f"  cached decode {ms['cached']:.1f}, with the kernel's steps {ms['kernel']:.1f}, "
          f"uncached {ms['uncached']:.1f}")
    print(f"  speed-up: cached {ms['uncached'] / ms['cached']:.2f}, with the kernel's steps "
          f"{ms['uncached'] / ms['kernel']:.2f}")


def main() -> None:
    threads_from_argv("decode_step_kernel.py")
    probe_header("decode_step_kernel.py")
    with tempfile.TemporaryDirectory() as out_dir:
        run(build(out_dir))


if __name__ == "__main__":
    main()
