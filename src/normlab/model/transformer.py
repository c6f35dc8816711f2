"""The models: a decoder-only LM (GPT style) and an encoder-decoder (the paper's template).

Both are built from one `Stack` (embedding, positions, blocks, final norm), so a decoder-only
model's hooks read `blocks.0.attn.hook_pattern` and an encoder-decoder's read
`encoder.blocks.0...`, `decoder.blocks.0.cross_attn...`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace

import torch
from torch import nn

from normlab.checks import check_int, format_bytes, memory_bytes
from normlab.model.block import PLACEMENTS, Block, dropped
from normlab.model.config import ModelConfig
from normlab.model.hooks import HookedModule, HookPoint
from normlab.model.norms import make_norm
from normlab.model.positions import PosEmbed, Rotary, lookup


@dataclass
class KVCache:
    """Keys/values of earlier decoding steps, one dict per block (self and cross).

    A block's self-attention keys/values sit in buffers with room to grow
    (`attention.append_kv`); `capacity` reserves that many positions up front, as greedy
    decoding does (the prompt plus `max_new`), so no buffer is copied or over-sized.
    """

    layers: list[dict[str, dict[str, torch.Tensor]]] = field(default_factory=list)
    length: int = 0
    masked: bool = False
    """Filled under a key mask: a step without one would attend to the cached padding."""
    memory: torch.Tensor | None = None
    """The source whose cross-attention keys and values the cache keeps (encoder-decoder)."""
    memory_mask: torch.Tensor | None = None
    """The source mask the cache was filled under: a step without it read the source's padding."""

    @classmethod
    def empty(cls, n_layers: int, capacity: int = 0) -> KVCache:
        capacity = check_int(capacity, "capacity", what="a number of positions >= 0")
        if not capacity:
            return cls([{} for _ in range(n_layers)], 0)
        reserve = torch.tensor(capacity)  # one tensor, shared by every block's dict
        return cls([{"self": {"reserve": reserve}} for _ in range(n_layers)], 0)


class Embed(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.W_E = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))

    def forward(self, tokens: torch.Tensor, name: str = "tokens") -> torch.Tensor:
        return lookup(self.W_E, tokens, name)


class Stack(nn.Module):
    """Embedding -> positions -> blocks -> final norm (if the placement has one)."""

    def __init__(self, cfg: ModelConfig, n_layers: int, *, causal: bool, cross: bool,
                 names: tuple[str, str] = ("tokens", "aux")) -> None:
        super().__init__()
        self.cfg, self.causal = cfg, causal
        # what its errors call the ids and aux positions: an encoder-decoder's are src/src_aux
        # and tgt/tgt_aux (a bad source and a bad target said the same "tokens: ...")
        self.names = names
        self.embed = Embed(cfg)
        self.hook_embed = HookPoint()
        self.pos_embed = PosEmbed(cfg) if cfg.position_table else None
        if self.pos_embed is not None:
            self.hook_pos_embed = HookPoint()
        self.rotary = Rotary(cfg.d_head, cfg.rope_theta) if cfg.pos_encoding == "rope" else None
        if cfg.n_aux_positions:
            self.W_aux = nn.Parameter(torch.empty(cfg.n_aux_positions, cfg.d_model))
            self.hook_aux_embed = HookPoint()
        else:
            self.W_aux = None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, causal=causal, cross=cross) for _ in range(n_layers))
        self.ln_final = (
            make_norm(cfg, cfg.d_model) if PLACEMENTS[cfg.norm_placement].final else None
        )

    def run(
        self,
        tokens: torch.Tensor,
        *,
        key_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        memory: torch.Tensor | None = None,
        memory_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        aux: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [batch, pos] -> residual [batch, pos, d_model] after the final norm.

        key_mask [batch, past + pos] marks real (non-pad) tokens, cached ones included.
        aux [batch, pos]: the task-supplied positions, needed iff `n_aux_positions > 0`.
        segments [batch, pos]: packed rows (see `tasks.addition.make_batch(pack=True)`); a
        segment is a run of one id (an id used again later is another segment), a token attends
        only within its segment and positions restart at each segment's start.
        """
        tok, aux_name = self.names
        if not isinstance(tokens, torch.Tensor):  # numpy's or a list: torch's TypeError
            raise ValueError(f"{tok}: expected a tensor of [batch, pos] ids; got "
                             f"{type(tokens).__name__}")
        if tokens.ndim != 2:
            raise ValueError(f"{tok}: expected [batch, pos] ids, got shape {tuple(tokens.shape)}")
        if tokens.device != self.embed.W_E.device:  # meta ids gave NaN logits on a CPU model
            raise ValueError(f"{tok}: on {tokens.device}, the model on "
                             f"{self.embed.W_E.device}; expected them on one device")
        b, p = tokens.shape
        past = cache.length if cache is not None else 0
        if past and (kept := cache.layers[0].get("self", {}).get("k")) is not None \
                and kept.shape[0] != b:  # torch's "expanded size" error
            raise ValueError(f"{tok}: expected the cache's batch of {kept.shape[0]} rows; "
                             f"got {b}")
        if memory is not None and memory.shape[0] != b:  # a target of 1 row broadcast unseen
            raise ValueError(f"tgt: expected the source's batch of {memory.shape[0]} rows; "
                             f"got {b}")
        if past:
            _check_cache(cache, key_mask, memory, "attention_mask" if self.causal else "src_mask",
                         memory_mask)
        if positions is not None and positions.is_floating_point():  # RoPE turned by 0.5
            raise ValueError(f"positions: expected integer positions; got {positions.dtype}")
        if aux is not None and self.W_aux is None:  # ignored without a word
            raise ValueError(f"{aux_name}: this model takes no aux positions "
                             "(ModelConfig.n_aux_positions = 0); expected None")
        _check_width(key_mask, (b, past + p), "attention_mask" if self.causal else "src_mask",
                     "the cached positions and these" if past else f"the {tok}")
        _check_width(aux, (b, p), aux_name, f"the {tok}")
        _check_width(positions, (b, p), "positions", f"the {tok}")
        if memory is not None:
            _check_width(memory_mask, memory.shape[:2], "src_mask", "the source")
        # The model's own positions (counted along the row, from a segment's start, or over
        # a row's real tokens) never pass past + p - 1: a bound known without reading them
        # back from the device (`PosEmbed`). Positions passed in have none.
        top = None if positions is not None else past + p - 1
        if segments is not None:
            if cache is not None or key_mask is not None or not self.causal:
                raise ValueError("segments: only for a causal forward without cache or key_mask")
            if segments.shape != tokens.shape:
                raise ValueError(f"segments: expected shape {tuple(tokens.shape)}, "
                                 f"got {tuple(segments.shape)}")
            start = _segment_starts(segments)  # once: the positions and the mask both read it
            if positions is None:
                positions = _segment_positions(segments, start)
        if positions is None:
            # over a row's real tokens, for an encoder's source too: counted along the row, a
            # left-padded source's tokens took other positions than unpadded (logits 1.2 off)
            if key_mask is not None:
                positions = (key_mask.bool().long().cumsum(-1) - 1).clamp(min=0)[:, past:]
            else:
                positions = torch.arange(past, past + p, device=tokens.device).expand(b, p)
        x = self.hook_embed(self.embed(tokens, tok))
        if self.pos_embed is not None:
            x = x + self.hook_pos_embed(self.pos_embed(positions, top))
        if self.W_aux is not None:
            if aux is None:
                raise ValueError(
                    "this model has ModelConfig.n_aux_positions > 0: pass `aux` positions "
                    "[batch, pos] (see normlab.tasks.addition.aux_positions)"
                )
            x = x + self.hook_aux_embed(lookup(self.W_aux, aux, aux_name))
        rope = self.rotary(positions) if self.rotary is not None else None
        x = dropped(self.drop, x)
        mask = self._self_mask(b, p, past, key_mask, tokens.device)
        if segments is not None:  # block-diagonal: causal within each packed problem
            # by run, as positions restart: an id used again later in a row ([1, 1, 2, 2, 1]) is
            # another problem, which its id alone let see the first one's tokens
            runs = start.cumsum(-1)
            mask = mask & (runs[:, None, :, None] == runs[:, None, None, :])
        # bool, as the encoder reads the same mask: a float one would be an additive bias to SDPA
        mem_mask = None if memory_mask is None else memory_mask.bool()[:, None, None, :]
        for i, block in enumerate(self.blocks):
            x = block(
                x,
                mask=mask,
                rope=rope,
                memory=memory,
                memory_mask=mem_mask,
                cache=None if cache is None else cache.layers[i],
            )
        if cache is not None:
            cache.length = past + p
            cache.masked |= key_mask is not None
            cache.memory = memory
            if past == 0:
                cache.memory_mask = memory_mask
        return self.ln_final(x) if self.ln_final is not None else x

    def _self_mask(
        self, b: int, p: int, past: int, key_mask: torch.Tensor | None, device: torch.device
    ) -> torch.Tensor | None:
        """Boolean [batch|1, 1, qpos, kpos]; a query always sees itself (no all-masked rows)."""
        if not self.causal and key_mask is None:
            return None
        qi = torch.arange(past, past + p, device=device)[:, None]
        kj = torch.arange(past + p, device=device)[None, :]
        allowed = (
            (kj <= qi) if self.causal else torch.ones(p, past + p, dtype=torch.bool, device=device)
        )
        allowed = allowed[None, None]
        if key_mask is not None:
            allowed = allowed & key_mask[:, None, None, :].bool()
            allowed = allowed | (kj == qi)[None, None]
        return allowed


def _check_cache(cache: KVCache, key_mask: torch.Tensor | None, memory: torch.Tensor | None,
                 mask_name: str, memory_mask: torch.Tensor | None = None) -> None:
    """A step must read what its cache was filled from: without the mask the prefill had, it
    attended to the cached padding; with another source, it read the first one's cross keys
    and values (each silently: tests/test_model.py shows both)."""
    if cache.masked and key_mask is None:
        raise ValueError(f"{mask_name}: the cache was filled under one; expected one over the "
                         "cached positions and these at every step")
    kept = cache.memory
    if kept is not None and memory is not kept and not (
            memory is not None and memory.shape == kept.shape and torch.equal(memory, kept)):
        raise ValueError("memory: expected the source the cache was filled with (it keeps "
                         "that source's cross-attention keys and values); start a new cache "
                         "(model.new_cache()) for another source")
    was = cache.memory_mask  # and its mask: without it a step read the source's padding
    if kept is not None and memory_mask is not was and (
            was is None or memory_mask is None or memory_mask.shape != was.shape
            or not torch.equal(memory_mask.bool(), was.bool())):
        raise ValueError("src_mask: expected the source mask the cache was filled under at "
                         "every step (" + ("none" if was is None else "one") + " then, "
                         + ("none" if memory_mask is None else "another") + " now)")


def _check_width(t: torch.Tensor | None, shape: tuple[int, ...], name: str, of: str) -> None:
    """A per-token input must be [batch, pos] with every position: width 1 would broadcast
    unseen. One row for the whole batch is fine (Hugging Face's `position_ids` convention)."""
    if t is None:
        return
    b, n = shape
    if t.ndim != 2 or t.shape[1] != n or t.shape[0] not in (1, b):
        rows = "1" if b == 1 else f"{b} or 1"
        raise ValueError(f"{name}: expected shape ({rows}, {n}), one per position of {of}; "
                         f"got {tuple(t.shape)}")


def _segment_starts(segments: torch.Tensor) -> torch.Tensor:
    """[batch, pos] True where a segment's run begins (its id differs from the one before)."""
    start = torch.ones_like(segments, dtype=torch.bool)
    start[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return start


def _segment_positions(segments: torch.Tensor,
                       start: torch.Tensor | None = None) -> torch.Tensor:
    """[batch, pos] index of each token within its segment (0 at every segment start);
    `start`: `_segment_starts(segments)`, where the caller has it already."""
    idx = torch.arange(segments.shape[1], device=segments.device).expand_as(segments)
    start = _segment_starts(segments) if start is None else start
    return idx - torch.where(start, idx, torch.zeros_like(idx)).cummax(-1).values


def _init_weights(model: nn.Module, cfg: ModelConfig, n_layers: int) -> None:
    """GPT-2 style: N(0, 0.02) everywhere, output projections shrunk by sqrt(2 * depth)."""
    out_std = cfg.init_std / math.sqrt(2 * max(n_layers, 1))
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("W_O", "W_out"):
            nn.init.normal_(p, std=out_std)
        elif leaf.startswith("W_"):
            nn.init.normal_(p, std=cfg.init_std)


class DecoderLM(Stack, HookedModule):
    """GPT-style causal LM: `model(tokens) -> logits [batch, pos, vocab]`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, cfg.n_layers, causal=True, cross=False)
        self.W_U = (
            None if cfg.tie_embeddings else nn.Parameter(torch.empty(cfg.d_model, cfg.vocab_size))
        )
        _init_weights(self, cfg, cfg.n_layers)
        self.setup_hooks()

    def unembed(self, x: torch.Tensor) -> torch.Tensor:
        return x @ (self.embed.W_E.T if self.W_U is None else self.W_U)

    def forward(
        self,
        tokens: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        cache: KVCache | None = None,
        aux: torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
    ) -> torch.Tensor:
        _check_mask_values(attention_mask, "attention_mask",
                           cache.length if cache is not None else 0)
        x = self.run(tokens, key_mask=attention_mask, positions=positions, cache=cache, aux=aux,
                     segments=segments)
        return self.unembed(x)

    def new_cache(self, capacity: int = 0) -> KVCache:
        """An empty cache; `capacity` positions reserved in each block (see `KVCache`)."""
        return KVCache.empty(len(self.blocks), capacity)


def _check_mask_values(mask: torch.Tensor | None, name: str, past: int = 0) -> None:
    """A mask of numbers holds 0 and 1 only: it is read as bool, so an additive mask (Hugging
    Face's 0 / -inf) attended to the padding and masked the real tokens, and -1, 0.5 or 2
    counted as real, each without a word. A bool mask needs no check (nor a device read).
    Only the columns from `past` on (a cached step's new tokens): the cached ones were checked
    when they were new, and a decoding step costs O(batch), not O(batch x all keys)."""
    if mask is None or mask.dtype == torch.bool or torch.compiler.is_compiling():
        return  # (a graph break under compile)
    if past and mask.ndim == 2:  # any other shape is refused by the width check after
        mask = mask[:, past:]
    if not bool(((mask == 0) | (mask == 1)).all()):
        bad = mask[(mask != 0) & (mask != 1)][0].item()
        raise ValueError(f"{name}: expected a bool mask or 0/1 values (1 = a real token); "
                         f"got {bad}")


def _check_src_mask(src_mask: torch.Tensor | None) -> None:
    """Every source row has a real token: else the decoder's cross-attention attends to
    nothing, NaN on one path and 0 on another (SDPA, past 64 keys on CPU), so an answer that
    depends on the source's length and the batch it is in. Its values are 0/1
    (`_check_mask_values`)."""
    _check_mask_values(src_mask, "src_mask")
    if (src_mask is not None and src_mask.numel() and not torch.compiler.is_compiling()
            and not bool(src_mask.bool().any(-1).all())):  # (a graph break under compile)
        row = int((~src_mask.bool().any(-1)).nonzero()[0, 0])
        raise ValueError(f"src_mask: row {row} has no real source token; expected at least "
                         "one per row")


class EncoderDecoderLM(HookedModule):
    """Encoder (bidirectional) + decoder (causal, cross-attending): `model(src, tgt)`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = Stack(cfg, cfg.n_encoder_layers, causal=False, cross=False,
                             names=("src", "src_aux"))
        self.decoder = Stack(cfg, cfg.n_decoder_layers, causal=True, cross=True,
                             names=("tgt", "tgt_aux"))
        self.W_U = (
            None if cfg.tie_embeddings else nn.Parameter(torch.empty(cfg.d_model, cfg.vocab_size))
        )
        _init_weights(self, cfg, cfg.n_encoder_layers + cfg.n_decoder_layers)
        self.setup_hooks()

    def encode(
        self, src: torch.Tensor, src_mask: torch.Tensor | None = None,
        aux: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if isinstance(src, torch.Tensor) and src.ndim == 2 and src.shape[1] == 0:
            # cross-attention over no keys gave exactly 0, and logits that looked normal
            raise ValueError("src: expected at least one source position; got none")
        _check_src_mask(src_mask)
        return self.encoder.run(src, key_mask=src_mask, aux=aux)

    def decode(
        self,
        tgt: torch.Tensor,
        memory: torch.Tensor,
        src_mask: torch.Tensor | None = None,
        cache: KVCache | None = None,
        aux: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of `tgt` cross-attending to `memory` (`encode`'s output). `src_mask` is
        checked as `encode` checks it on a first call (no cache, or an empty one), not at every
        cached step: a memory kept from another batch may be given another mask."""
        if cache is None or cache.length == 0:
            _check_src_mask(src_mask)
        return self._decode(tgt, memory, src_mask, cache, aux)

    def _decode(self, tgt: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor | None,
                cache: KVCache | None, aux: torch.Tensor | None) -> torch.Tensor:
        x = self.decoder.run(tgt, memory=memory, memory_mask=src_mask, cache=cache, aux=aux)
        return x @ (self.decoder.embed.W_E.T if self.W_U is None else self.W_U)

    def forward(
        self,
        src: torch.Tensor,
        tgt: torch.Tensor,
        src_mask: torch.Tensor | None = None,
        src_aux: torch.Tensor | None = None,
        tgt_aux: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # `encode` checked src_mask: checked again, a GPU waited on the encoder to launch more
        return self._decode(tgt, self.encode(src, src_mask, src_aux), src_mask, None, tgt_aux)

    def new_cache(self, capacity: int = 0) -> KVCache:
        """An empty decoder cache; `capacity` positions reserved in each block (see `KVCache`)."""
        return KVCache.empty(len(self.decoder.blocks), capacity)


Model = DecoderLM | EncoderDecoderLM


@contextlib.contextmanager
def evaluating(model: Model) -> Iterator[None]:
    """Eval mode (no dropout) and no autograd for the block; each module's mode is restored
    (greedy decoding and every analysis run their forwards in it).

    Afterwards every module gets its own mode back, so a model in mixed modes keeps its mix
    (it used to come back all in the top module's mode). A model already all in
    eval mode is left alone, which skips two walks of `nn.Module.__setattr__` over every
    submodule (~0.5 ms on a 4-layer model; `benchmarks/probes/evaluating_cost.py` finds no
    change in the collapse sweep's time within its noise).
    """
    modes = [(m, m.training) for m in model.modules()]
    if any(was for _, was in modes):
        model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, was in modes:  # also undoes a mode the block itself switched
            if m.training != was:
                m.training = was


def build_model(cfg: ModelConfig) -> Model:
    """The one constructor: `arch` picks the class, everything else is in `cfg`."""
    cfg.validate()
    cls = DecoderLM if cfg.arch == "decoder" else EncoderDecoderLM
    # Each of a deep model's tensors is small, so the allocator grants them all and the kernel
    # kills the process once they are written: sized first, such a model is refused in a line.
    limit = memory_bytes() if torch.get_default_device().type == "cpu" else None
    if limit is not None:
        with contextlib.suppress(RuntimeError):  # shapes that overflow: the build names them
            if (fp := footprint(cls, cfg)).need > limit:
                raise ValueError(_too_large(cls, cfg, limit, fp))
    try:
        return cls(cfg)
    # torch's allocator names only a byte count, its size check only a shape
    except (RuntimeError, MemoryError) as err:
        if isinstance(err, RuntimeError) and not any(  # "Overflow when unpacking long" too
                w in str(err).lower() for w in ("allocate", "overflow")):
            raise
        raise ValueError(_too_large(cls, cfg, limit)) from err


# Python's own bytes for each module of a layer (with its hook points and tensor objects), kept
# below what every model measured holds so that no model that fits is refused: 2.63-2.78 KiB a
# module beyond the weights, 45 KiB a layer under `none` (17 modules), 63 under `pre` (23), 87
# under `qkv` (32) (torch 2.13, Linux; benchmarks/probes/module_bytes.py)
MODULE_BYTES = 2560


@dataclass
class Footprint:
    total: int  # bytes of every weight and table
    shallow: int  # bytes at one layer in each stack
    per_layer: dict[str, int]  # bytes a layer, by depth field
    modules: int  # modules in all layers of all stacks
    largest: tuple[str, list[int]]  # the largest tensor, as named at one layer

    @property
    def need(self) -> int:
        """Bytes the model cannot be built in less than: its tensors and its layers' modules."""
        return self.total + MODULE_BYTES * self.modules


def footprint(cls: type[Model], cfg: ModelConfig) -> Footprint:
    """The bytes of `cfg`'s weights and tables without allocating them, from the model built
    on the meta device (shapes, no memory) one layer deep in each stack: the rest is that
    layer's bytes again for every further layer, so a million layers are sized in
    milliseconds. RuntimeError where even the shapes overflow torch's size arithmetic."""
    stacks = {"n_layers": ""} if cls is DecoderLM else {"n_encoder_layers": "encoder.",
                                                          "n_decoder_layers": "decoder."}
    with torch.device("meta"):
        model = cls(replace(cfg, **dict.fromkeys(stacks, 1)))
    tensors = [*model.named_parameters(), *model.named_buffers()]
    size = {name: t.numel() * t.element_size() for name, t in tensors}
    per_layer = {f: sum(b for name, b in size.items() if name.startswith(f"{at}blocks.0."))
                 for f, at in stacks.items()}
    shallow = sum(size.values())
    total = shallow + sum(b * (getattr(cfg, f) - 1) for f, b in per_layer.items())
    name, big = max(tensors, key=lambda nt: nt[1].numel())
    names = [n for n, _ in model.named_modules()]
    modules = sum(getattr(cfg, f) * sum(n.startswith(f"{at}blocks.0") for n in names)
                  for f, at in stacks.items())
    return Footprint(total, shallow, per_layer, modules, (name, list(big.shape)))


def _too_large(cls: type[Model], cfg: ModelConfig, limit: int | None,
               fp: Footprint | None = None) -> str:
    """Which of `cfg`'s sizes made the model too large: its depth where one layer a stack
    takes at most a quarter of `limit` bytes (this machine's memory) and the tables beside the
    layers fit, but all of it, modules too, does not; else (a layer, or a table, that is itself
    a large share: its width) the fields within 4x of its largest tensor's largest dimension
    (d_mlp is 4 d_model by default); where even a shape overflows, of the largest size. `fp`:
    `footprint(cls, cfg)`, where known."""
    sizes = {f.name: v for f in fields(cfg) for v in [getattr(cfg, f.name)]
             if isinstance(v, int) and not isinstance(v, bool)}
    try:
        fp = fp or footprint(cls, cfg)
    except RuntimeError:
        top = max(sizes.values())
        why = "too large for torch to size the model's tensors"
    else:
        layer = sum(fp.per_layer.values())  # one layer in each stack
        weights = f"the model's weights and tables take {format_bytes(fp.total)}"
        modules = (f"and its modules at least {format_bytes(MODULE_BYTES * fp.modules)} more, "
                   f"beyond this machine's {format_bytes(limit or 0)} of memory and swap")
        if limit is not None and 4 * layer <= limit and fp.shallow - layer <= limit < fp.need:
            deep = {f: b * getattr(cfg, f) for f, b in fp.per_layer.items()}
            named = ", ".join(f"ModelConfig.{f} = {getattr(cfg, f)}" for f, b in deep.items()
                              if 2 * b >= max(deep.values()))  # the stacks that hold the most
            each = ", ".join(f"{format_bytes(b)} a layer of {f}" for f, b in fp.per_layer.items())
            return f"{named}: {weights} ({each}) {modules}; expected a smaller size"
        name, shape = fp.largest
        top = max(shape)
        beyond = ("more than could be allocated" if limit is None or fp.total > limit
                  else modules)
        why = f"{weights}, {beyond} (the largest, {name}, is {shape})"
    named = ", ".join(f"ModelConfig.{k} = {v}" for k, v in sorted(
        sizes.items(), key=lambda kv: -kv[1]) if 4 * v >= top)
    return f"{named}: {why}; expected a smaller size"
