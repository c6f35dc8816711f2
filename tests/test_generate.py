"""greedy_decode refuses what it cannot decode in one line naming its own argument."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from normlab import ModelConfig, build_model
from normlab.model.generate import greedy_decode
from normlab.tasks.addition import BOS, EOS, aux_positions, encode, next_aux_position


def cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=16, d_model=32, n_heads=4, n_layers=2, d_mlp=64, max_len=16,
                pos_encoding="rope", init_std=0.3)
    return ModelConfig(**(base | kw))


def prompt(question: str) -> list[int]:
    return [BOS, *encode(question), EOS]


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_a_model_on_the_meta_device_is_refused_before_any_forward(arch: str) -> None:
    """A meta model ran a whole forward, then failed in torch with "Tensor.item() cannot be
    called on meta tensors"."""
    model = build_model(cfg(arch=arch)).to("meta")
    forwards = []
    model.register_forward_pre_hook(lambda *_: forwards.append(1))
    with pytest.raises(ValueError, match=r"^model: \S+ \(\d+ tensors in all\) is on the meta "
                                         r"device; expected a model with its weights loaded"):
        greedy_decode(model, [[1, 2]], max_new=3, eos=2)
    assert forwards == []
    with pytest.raises(ValueError, match=r"^model: .* is on the meta device"):
        greedy_decode(model, [[1, 2]], max_new=0, eos=2)  # refused with nothing to generate


def test_prompts_on_the_meta_device_are_refused() -> None:
    """A meta [batch, pos] tensor failed in `.tolist()` with torch's NotImplementedError
    "Cannot copy out of meta tensor; no data!"."""
    model = build_model(cfg())
    meta = torch.ones(2, 3, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match=r"^prompts: on the meta device, no ids to read"):
        greedy_decode(model, meta, max_new=2, eos=2)
    ids = torch.ones(2, 3, dtype=torch.long)  # the same ids with data decode
    assert greedy_decode(model, ids, max_new=2, eos=-1) == greedy_decode(
        model, ids.tolist(), max_new=2, eos=-1)


@pytest.mark.parametrize("bad", ["no", "False", 1, 0, None, np.True_])
def test_use_cache_takes_only_a_bool(bad: object) -> None:
    """Any truthy value was taken as True: use_cache="no" decoded with the cache."""
    model = build_model(cfg())
    with pytest.raises(ValueError, match=rf"^use_cache: expected True or False; got "
                                         rf"{re.escape(repr(bad))}$"):
        greedy_decode(model, [[1, 2]], max_new=2, eos=2, use_cache=bad)  # type: ignore[arg-type]


def test_use_cache_true_and_false_still_agree() -> None:
    model = build_model(cfg())
    prompts = [[1, 5, 6], [7]]
    cached = greedy_decode(model, prompts, max_new=4, eos=-1, use_cache=True)
    assert cached == greedy_decode(model, prompts, max_new=4, eos=-1, use_cache=False)
    assert all(len(row) == 4 for row in cached)


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
@pytest.mark.parametrize(
    ("aux_next", "error"),
    [
        # torch.cat's "Tensors must have same number of dimensions: got 2 and 3"
        (lambda prev, tok: prev[:, None], r"got shape \(2, 1\), torch\.int64 on cpu$"),
        (lambda prev, tok: prev[:1], r"got shape \(1,\), torch\.int64 on cpu$"),
        (lambda prev, tok: prev.float(), r"got shape \(2,\), torch\.float32 on cpu$"),
        (lambda prev, tok: prev > 0, r"got shape \(2,\), torch\.bool on cpu$"),
        (lambda prev, tok: prev.tolist(), r"got list$"),
        (lambda prev, tok: prev.to("meta"), r"got shape \(2,\), torch\.int64 on meta$"),
    ],
)
def test_an_aux_next_result_that_is_not_a_batch_of_places_is_named(arch, aux_next,
                                                                    error: str) -> None:
    """A wrong result failed inside torch.cat (shape) or in the next forward (a float or bool
    `aux`, named as the forward's argument)."""
    model = build_model(cfg(arch=arch, n_aux_positions=4))
    with pytest.raises(ValueError, match=r"^aux_next: expected a \[batch\] integer tensor "
                                         r"\(shape \(2,\), on cpu\); " + error):
        greedy_decode(model, [prompt("12+3"), prompt("4")], max_new=3, eos=-1,
                      aux_fn=aux_positions, aux_next=aux_next)


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_a_negative_place_from_aux_next_is_named(arch: str) -> None:
    """A negative place came back from the next forward as an IndexError naming its `aux`
    (on a GPU, an index out of the table is a device-side assert)."""
    model = build_model(cfg(arch=arch, n_aux_positions=4))
    with pytest.raises(ValueError, match=r"^aux_next: expected places >= 0; got -1$"):
        greedy_decode(model, [prompt("12+3"), prompt("4")], max_new=3, eos=-1,
                      aux_fn=aux_positions, aux_next=lambda prev, tok: prev * 0 - 1)


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_aux_next_in_int32_or_past_the_table_decodes_as_aux_fn(arch: str,
                                                               use_cache: bool) -> None:
    """What the checks let through decodes as before: int32 places are places, and places
    past the table (a generated run of digits) are clamped to its last, as `aux_fn`'s are."""
    model = build_model(cfg(arch=arch, n_aux_positions=4))
    with torch.no_grad():  # only digits score above 0: generated runs outgrow the table
        model.W_U[:, :4] = model.W_U[:, 14:] = 0
    prompts = [prompt(q) for q in ("12+N3", "N45-67", "5")]
    kw = {"max_new": 7, "eos": -1, "aux_fn": aux_positions, "use_cache": use_cache}
    want = greedy_decode(model, prompts, **kw)
    assert any(all(4 <= t <= 13 for t in row[:5]) for row in want)  # a run of 5 digits
    int32 = greedy_decode(model, prompts, aux_next=lambda p, t: next_aux_position(p, t).int(),
                          **kw)
    assert int32 == want == greedy_decode(model, prompts, aux_next=next_aux_position, **kw)


@pytest.mark.parametrize(
    ("arch", "aux_fn", "error"),
    [
        # a 4-digit number's thousands are place 4, past a 4-place table [0, 4)
        ("decoder", aux_positions, r"aux_fn\(prompts\[1\], 'sequence'\): expected places in "
                                   r"\[0, 4\); got 4$"),
        ("encoder_decoder", aux_positions, r"aux_fn\(prompts\[1\], 'question'\): expected "
                                           r"places in \[0, 4\); got 4$"),
        ("decoder", lambda ids, part: [-1] * len(ids),
         r"aux_fn\(prompts\[0\], 'sequence'\): expected places in \[0, 4\); got -1$"),
        # the decoder's start row [bos]: a float was cut to an int unseen, -1 an IndexError
        ("encoder_decoder", lambda ids, part: [-1 if part == "answer" else 0] * len(ids),
         r"aux_fn\(\[1\], 'answer'\): expected places in \[0, 4\); got -1$"),
        ("encoder_decoder", lambda ids, part: [0.5 if part == "answer" else 0] * len(ids),
         r"aux_fn's positions\[0\]: expected integers; got 0\.5$"),
    ],
)
def test_prompt_places_outside_the_table_name_aux_fn_and_the_row(arch, aux_fn, error) -> None:
    """They came back from the forward as "IndexError: aux: expected ids in [0, 4), got
    values from 0 to 4", naming an argument greedy_decode does not take, and no row."""
    model = build_model(cfg(arch=arch, n_aux_positions=4))
    with pytest.raises(ValueError, match="^" + error):
        greedy_decode(model, [prompt("123+4"), prompt("1234+5")], max_new=2, eos=-1,
                      aux_fn=aux_fn)
    # a table one place larger holds them
    model = build_model(cfg(arch=arch, n_aux_positions=5))
    assert len(greedy_decode(model, [prompt("123+4"), prompt("1234+5")], max_new=2, eos=-1,
                             aux_fn=aux_positions)[1]) == 2


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
@pytest.mark.parametrize("use_cache", [True, False])
def test_a_batch_of_prompts_of_two_lengths_decodes_as_each_alone(arch: str,
                                                                 use_cache: bool) -> None:
    """With digit positions: the source's positions padded on the other side than its tokens
    passed every test, and a batch then decoded otherwise than its prompts alone."""
    torch.manual_seed(0)
    model = build_model(cfg(arch=arch, n_aux_positions=6, n_encoder_layers=1,
                            n_decoder_layers=1)).eval()
    prompts = [prompt("12+345"), prompt("1+2"), prompt("7")]
    kw = dict(max_new=5, eos=-1, aux_fn=aux_positions, aux_next=next_aux_position,
              use_cache=use_cache)
    alone = [greedy_decode(model, [p], **kw)[0] for p in prompts]
    assert greedy_decode(model, prompts, **kw) == alone
    assert len({tuple(a) for a in alone}) > 1  # the rows are not all one answer
