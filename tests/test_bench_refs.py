"""benchmarks/nanogpt_ref.py: the training-step references compute what they claim to."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from nanogpt_ref import NanoGPT
from normlab import ModelConfig, build_model


@pytest.mark.parametrize("rope", [False, True])
def test_both_attention_paths_give_the_same_model(rope: bool) -> None:
    """nanoGPT's explicit attention (the `nanogpt-manual` reference) is its SDPA path's
    function: same weights, same logits, causal (a later token changes no earlier logit)."""
    torch.manual_seed(0)
    flash = NanoGPT(16, 64, 2, 4, 256, 32, rope=rope)
    manual = NanoGPT(16, 64, 2, 4, 256, 32, rope=rope, flash=False)
    manual.load_state_dict(flash.state_dict())
    tokens = torch.randint(0, 16, (3, 17))
    out = manual(tokens)
    torch.testing.assert_close(out, flash(tokens), atol=1e-5, rtol=1e-5)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 16
    torch.testing.assert_close(manual(changed)[:, :-1], out[:, :-1])


def test_the_reference_has_normlab_pre_decoders_parameter_count() -> None:
    cfg = ModelConfig(vocab_size=16, d_model=64, n_heads=4, n_layers=2, d_mlp=256, max_len=32,
                      norm_placement="pre", pos_encoding="learned")
    ours = sum(p.numel() for p in build_model(cfg).parameters())
    for flash in (True, False):
        ref = NanoGPT(16, 64, 2, 4, 256, 32, flash=flash)
        assert sum(p.numel() for p in ref.parameters()) == ours


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("flash", [False, True])
def test_the_reference_builds_nothing_on_the_cpu(rope: bool, flash: bool) -> None:
    """On a GPU its RoPE tables must be where q and k are (they were built on the CPU and
    broke both nanoGPT contenders on CUDA): the `meta` device stands in for a GPU
    (tests/test_device.py says why)."""
    meta = torch.device("meta")
    model = NanoGPT(16, 64, 2, 4, 256, 32, rope=rope, flash=flash).to(meta)
    out = model(torch.randint(0, 16, (3, 17)).to(meta))
    assert out.device == meta and out.shape == (3, 17, 16)
    out.sum().backward()


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
@pytest.mark.parametrize("kind", ["normlab", "nanogpt", "nanogpt-manual", "x-transformers"])
def test_every_contender_steps_in_the_precision_asked(kind: str, precision: str) -> None:
    """`--precision bfloat16` puts every contender's forward under the autocast normlab's
    training loop uses, not normlab's alone: its first projection comes out in bfloat16."""
    from bench_train_step import build_contender, x_transformers_status
    from normlab.config import RunConfig

    if kind == "x-transformers" and not x_transformers_status()[0]:
        pytest.skip("x-transformers is not installed")
    cfg = ModelConfig(vocab_size=16, d_model=32, n_heads=4, n_layers=1, d_mlp=64, max_len=32,
                      norm_placement="pre", pos_encoding="rope")
    batch = {"tokens": torch.randint(1, 16, (4, 9)), "targets": torch.randint(0, 16, (4, 9))}
    model, step = build_contender(kind, cfg, RunConfig(), batch, precision=precision)
    seen: list[torch.dtype] = []
    if kind == "normlab":
        with model.hooks([("blocks.0.mlp.hook_pre", lambda x, hook: seen.append(x.dtype))]):
            step()
    else:
        linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        handle = linear.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
        step()
        handle.remove()
    assert seen == [getattr(torch, precision)]


@pytest.mark.parametrize("kind", ["nanogpt", "nanogpt-manual", "x-transformers"])
def test_every_contender_decays_the_same_weights(kind: str, monkeypatch: pytest.MonkeyPatch
                                                 ) -> None:
    """The references' parameters are not named `W_*`: under normlab's rule AdamW decayed none
    of them. By nanoGPT's rule (ndim >= 2) they decay as many weights as normlab's model of the
    same sizes does, and only matrices."""
    import bench_train_step
    from bench_train_step import build_contender, x_transformers_status
    from normlab.config import RunConfig

    if kind == "x-transformers" and not x_transformers_status()[0]:
        pytest.skip("x-transformers is not installed")
    made: list[torch.optim.Optimizer] = []

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        made.append(opt := make_optimizer(*args, **kwargs))
        return opt

    from normlab.train import make_optimizer

    monkeypatch.setattr(bench_train_step, "make_optimizer", spy)
    cfg = ModelConfig(vocab_size=16, d_model=32, n_heads=4, n_layers=2, d_mlp=64, max_len=32,
                      norm_placement="pre", pos_encoding="rope")
    batch = {"tokens": torch.randint(1, 16, (4, 9)), "targets": torch.randint(0, 16, (4, 9))}
    decayed = {}
    for k in ("normlab", kind):
        build_contender(k, cfg, RunConfig(), batch)
        groups = {g["weight_decay"]: g["params"] for g in made[-1].param_groups}
        assert set(groups) == {RunConfig().train.weight_decay, 0.0}
        assert all(p.ndim >= 2 for p in groups[RunConfig().train.weight_decay])
        assert all(p.ndim < 2 or k == "normlab" for p in groups[0.0])
        decayed[k] = sum(p.numel() for p in groups[RunConfig().train.weight_decay])
    assert decayed[kind] == decayed["normlab"] > 0
