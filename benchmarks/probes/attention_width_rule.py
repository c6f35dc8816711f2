"""One-off probe behind twenty-ninth- and thirtieth-session numbers in docs/performance.md;
not make bench.

What a session's rule for `native.attention` past 64 keys (`attention.KERNEL_BOUNDS_CPU`) does
to a whole model: a `pre` decoder (4 layers, 4 heads, d_model 4 x d_head, RoPE) on random
tokens, about 2176 positions a batch, where the rule before it and its own route differently.
The twenty-eighth session's rule was 4096 key floats with no key count; the twenty-ninth's 256
keys and 8192 key floats: d_head 32 at 192 and 256 keys, d_head 64 at 96 and 128 (the kernel
under the twenty-ninth's, SDPA before). The thirtieth's adds 512 keys and 4096 key floats: d_head
8 at 384 and 512 keys (the kernel again, as under the twenty-eighth's; SDPA under the
twenty-ninth's). Each case times a training step (forward, backward, fused AdamW) and a forward
alone (no autograd, as evaluation runs), the two rules alternating in one process (`abtime.ab`,
15 rounds); printed as ms a call under each and old / new (above 1: the new rule is faster).

    .venv/bin/python benchmarks/probes/attention_width_rule.py [THREADS]
"""
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from abtime import ab, probe_header, threads_from_argv

from normlab import allocator, build_model
from normlab.model import ModelConfig
from normlab.model import attention as attention_mod

allocator.keep_freed_memory()
threads_from_argv("attention_width_rule.py")
probe_header("attention_width_rule.py")
POSITIONS = 2176
RULES = {28: ((10**9, 4096),), 29: ((256, 8192),), 30: ((256, 8192), (512, 4096))}
CASES = ((32, 192, 29), (32, 256, 29), (64, 96, 29), (64, 128, 29), (8, 384, 30), (8, 512, 30))


def rule(session: int) -> Callable[[bool], None]:
    """The switch `abtime.ab` flips: `session`'s (keys, key floats) bounds when on, the rule
    before it when off."""
    def switch(new: bool) -> None:
        attention_mod.KERNEL_BOUNDS_CPU = RULES[session if new else session - 1]
    return switch


def calls(d_head: int, keys: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """A training step and a forward of the case's model on its batch."""
    torch.manual_seed(0)
    cfg = ModelConfig(d_model=4 * d_head, n_heads=4, n_layers=4, max_len=keys,
                      pos_encoding="rope", norm_placement="pre")
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    g = torch.Generator().manual_seed(keys)
    tokens = torch.randint(0, cfg.vocab_size, (POSITIONS // keys, keys), generator=g)
    targets = torch.randint(0, cfg.vocab_size, tokens.shape, generator=g)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        logits = model(tokens)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
        opt.step()

    def forward() -> None:
        with torch.no_grad():
            model(tokens)

    return step, forward


print("case (session): old rule (SDPA here) / new rule (the kernel here), ms a call, median of "
      "15 rounds")
for d_head, keys, session in CASES:
    step, forward = calls(d_head, keys)
    switch = rule(session)
    for f in (step, forward):
        for new in (False, True):
            switch(new)
            f()
    ab(f"train d{d_head} {keys} keys ({session})", switch, step, inner=1, names=("old", "new"))
    ab(f"infer d{d_head} {keys} keys ({session})", switch, forward, inner=3,
       names=("old", "new"))
