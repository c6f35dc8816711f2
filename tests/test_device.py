"""Off the CPU, a model builds nothing on the CPU: every tensor its forward, backward, packed
rows or cached decoding step makes is on its inputs' device.

No GPU has ever run these tests (none is lent to this project), so they run on PyTorch's
`meta` device: tensors with shapes and no data, where mixing in a CPU tensor raises the same
"same device" error a GPU's would. A table built on the CPU inside a forward (positions,
masks, RoPE angles, a cache's buffers) is what they catch; numbers and speed on a GPU are
left to the GPU table (`benchmarks/gpu/run.sh`).
"""

from __future__ import annotations

import pytest
import torch

from normlab import ModelConfig, build_model
from normlab.model.config import PLACEMENTS
from normlab.train import loss_on

META = torch.device("meta")


def tiny(**kw) -> ModelConfig:
    base = dict(d_model=32, n_heads=4, n_layers=2, d_mlp=64, max_len=16, vocab_size=16,
                n_aux_positions=4)
    return ModelConfig(**(base | kw))


def on_meta(*shape: int, high: int = 16) -> torch.Tensor:
    return torch.randint(0, high, shape).to(META)


def backward_reaches_every_weight(model: torch.nn.Module, out: torch.Tensor) -> None:
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.device == META for p in model.parameters())


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("pos", ["rope", "none", "learned", "sinusoidal"])
def test_a_decoder_trains_off_the_cpu(placement: str, pos: str) -> None:
    """Every kind of positions. An additive table (learned, sinusoidal) reads nothing back
    either: the positions the model counts itself are below a bound it knows (`PosEmbed`),
    where it read their largest back from the device, which `meta` cannot answer."""
    model = build_model(tiny(norm_placement=placement, pos_encoding=pos)).to(META)
    mask = torch.ones(3, 9, dtype=torch.bool).to(META)
    logits = model(on_meta(3, 9), attention_mask=mask, aux=on_meta(3, 9, high=4))
    assert logits.device == META and logits.shape == (3, 9, 16)
    backward_reaches_every_weight(model, logits)


def test_the_training_loss_reads_nothing_back_off_the_cpu() -> None:
    """`loss_on`, the training step's forward, loss and token count, reads no value back to
    the host, where a GPU would wait for the forward to finish: on `meta`, any read raises."""
    model = build_model(tiny(norm_placement="qkv", pos_encoding="rope")).to(META)
    batch = {"tokens": on_meta(3, 9), "targets": on_meta(3, 9), "aux": on_meta(3, 9, high=4)}
    loss, n_tok = loss_on(model, batch)
    assert loss.device == n_tok.device == META and loss.shape == n_tok.shape == ()
    backward_reaches_every_weight(model, loss)


def test_packed_rows_train_off_the_cpu() -> None:
    """Packing builds per-segment positions and a block-diagonal mask in the forward."""
    model = build_model(tiny(norm_placement="qkv", pos_encoding="rope")).to(META)
    segments = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2, 2]] * 2).to(META)
    logits = model(on_meta(2, 9), segments=segments, aux=on_meta(2, 9, high=4))
    backward_reaches_every_weight(model, logits)


@pytest.mark.parametrize("placement", ["pre", "qkv"])
def test_an_encoder_decoder_trains_off_the_cpu(placement: str) -> None:
    model = build_model(tiny(arch="encoder_decoder", norm_placement=placement,
                             pos_encoding="rope")).to(META)
    logits = model(on_meta(3, 7), on_meta(3, 5), None, on_meta(3, 7, high=4),
                   on_meta(3, 5, high=4))
    assert logits.shape == (3, 5, 16)
    backward_reaches_every_weight(model, logits)


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
@pytest.mark.parametrize("placement", ["pre", "qkv"])
def test_a_cached_decode_steps_off_the_cpu(arch: str, placement: str) -> None:
    """The prompt's forward fills the key/value cache, then steps append one position each
    (the buffers greedy decoding reserves, and their frontier)."""
    model = build_model(tiny(arch=arch, norm_placement=placement, pos_encoding="rope"))
    model = model.to(META).eval()
    cache = model.new_cache(6 + 3)
    with torch.no_grad():
        if arch == "decoder":
            mask = torch.ones(2, 6, dtype=torch.bool).to(META)
            model(on_meta(2, 6), attention_mask=mask, cache=cache, aux=on_meta(2, 6, high=4))
            for _ in range(3):
                mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.bool).to(META)], 1)
                step = model(on_meta(2, 1), attention_mask=mask, cache=cache,
                             aux=on_meta(2, 1, high=4))
        else:
            memory = model.encode(on_meta(2, 6), None, on_meta(2, 6, high=4))
            model.decode(on_meta(2, 1), memory, None, cache=cache, aux=on_meta(2, 1, high=4))
            for _ in range(3):
                step = model.decode(on_meta(2, 1), memory, None, cache=cache,
                                    aux=on_meta(2, 1, high=4))
    assert step.device == META and step.shape == (2, 1, 16)
