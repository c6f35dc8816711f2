"""TransformerLens-style hook points: name a tensor, read it, or replace it.

A `HookPoint` is an identity module whose `__call__` skips all nn.Module machinery when
no function is attached, and `setup_hooks` binds it as a plain attribute of its parent, so an
unhooked forward pays one attribute read, one call and one check per point (~0.1 µs).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _torch_module

HookFn = Callable[[torch.Tensor, "HookPoint"], torch.Tensor | None]
NameFilter = str | Sequence[str] | Callable[[str], bool] | None


class HookPoint(nn.Module):
    """Identity on a named tensor; attached functions may read or replace it."""

    def __init__(self) -> None:
        super().__init__()
        self.name = ""
        self.fns: list[HookFn] = []

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if not self.fns:
            return x
        for fn in self.fns:
            out = fn(x, self)
            if out is not None:
                # checked here, where the hook is known: a list or another dtype failed deep
                # in the forward, and a scalar or a slice broadcast into the residual unsaid
                if not (isinstance(out, torch.Tensor) and out.shape == x.shape
                        and out.dtype == x.dtype and out.device == x.device):
                    got = (f"{tuple(out.shape)} {out.dtype} on {out.device}"
                           if isinstance(out, torch.Tensor) else type(out).__name__)
                    raise ValueError(f"hook {getattr(fn, '__name__', fn)!r} at {self.name!r}: "
                                     f"expected None or a tensor like its input, "
                                     f"{tuple(x.shape)} {x.dtype} on {x.device}; got {got}")
                x = out
        return x

    def extra_repr(self) -> str:
        return self.name

    # PyTorch's module hooks are registered with a warning: they never fire (this call skips
    # nn.Module's). A tool that hooks every module (a summary) keeps working; a user learns
    # where to look.
    def register_forward_hook(self, *args: Any, **kwargs: Any) -> Any:
        self._warn_module_hook()
        return super().register_forward_hook(*args, **kwargs)

    def register_forward_pre_hook(self, *args: Any, **kwargs: Any) -> Any:
        self._warn_module_hook()
        return super().register_forward_pre_hook(*args, **kwargs)

    # the backward ones too: with no `bwd_hooks` here, a TransformerLens user wanting a
    # point's gradient tries these first, and they registered without a word
    def register_full_backward_hook(self, *args: Any, **kwargs: Any) -> Any:
        self._warn_module_hook()
        return super().register_full_backward_hook(*args, **kwargs)

    def register_full_backward_pre_hook(self, *args: Any, **kwargs: Any) -> Any:
        self._warn_module_hook()
        return super().register_full_backward_pre_hook(*args, **kwargs)

    def register_backward_hook(self, *args: Any, **kwargs: Any) -> Any:
        self._warn_module_hook()
        return super().register_backward_hook(*args, **kwargs)

    def _warn_module_hook(self) -> None:
        warnings.warn(  # one text for every point: a tool hooking them all warns once
            "PyTorch's module hooks never run on a normlab HookPoint; attach fn(tensor, hook) "
            "with model.hooks, run_with_hooks or run_with_cache (for gradients: "
            "run_with_cache(detach=False), or tensor.register_hook inside a hook)",
            stacklevel=3,
        )


def torch_hooked(module: nn.Module) -> bool:
    """Whether a call of `module` would run PyTorch's own hooks (`register_forward_hook` and
    the like, on it or global), the test `nn.Module.__call__` makes. Shortcuts that skip a
    module's call (a fused kernel, an idle dropout) take this as their cue to call it."""
    m = _torch_module
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks or m._global_forward_hooks
                or m._global_forward_pre_hooks or m._global_backward_hooks
                or m._global_backward_pre_hooks)


def _refuse_point(value: object, where: str) -> None:
    """A HookPoint is a module, so callable: taken as a filter it returned every name (truthy)
    and matched every point, its function attached to all of them."""
    if isinstance(value, nn.Module):
        named = f" (use its name, {value.name!r})" if isinstance(value, HookPoint) else ""
        raise ValueError(f"{where}: expected a hook name or a function of a name; got the "
                         f"module {type(value).__name__}{named}")


def _matcher(names_filter: NameFilter) -> Callable[[str], bool]:
    _refuse_point(names_filter, "names_filter")
    if names_filter is None:
        return lambda name: True
    if isinstance(names_filter, str):
        return lambda name: name == names_filter
    if callable(names_filter):
        return names_filter
    names = (list(names_filter) if isinstance(names_filter, Iterable)
             and not isinstance(names_filter, Mapping) else [None])
    if not all(isinstance(n, str) for n in names):  # 123 was "'int' object is not iterable"
        raise ValueError(f"names_filter: expected a hook name, a list of names or a function "
                         f"of a name; got {_shown(names_filter)}")
    wanted = set(names)
    return lambda name: name in wanted


def _hook_pairs(fwd_hooks: object) -> list[tuple[str | Callable[[str], bool], HookFn]]:
    """`fwd_hooks` as a list of (name or filter, fn) pairs: one pair not in a list, or a dict,
    was "too many values to unpack", and a fn that is none failed inside the forward."""
    if isinstance(fwd_hooks, str | Mapping) or not isinstance(fwd_hooks, Iterable):
        raise ValueError(f"fwd_hooks: expected a list of (name, fn) pairs; got "
                         f"{_shown(fwd_hooks)}")
    pairs = list(fwd_hooks)
    for i, pair in enumerate(pairs):
        if isinstance(pair, tuple | list) and pair:
            _refuse_point(pair[0], f"fwd_hooks[{i}]")
        if not (isinstance(pair, tuple | list) and len(pair) == 2
                and (isinstance(pair[0], str) or callable(pair[0])) and callable(pair[1])):
            one = " (one pair: put it in a list)" if isinstance(pair, str) else ""
            raise ValueError(f"fwd_hooks[{i}]: expected a (name or filter, fn) pair{one}; got "
                             f"{_shown(pair)}")
    return [(name, fn) for name, fn in pairs]


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class HookedModule(nn.Module):
    """Mixin for a root model: hook discovery, `run_with_hooks`, `run_with_cache`."""

    def setup_hooks(self) -> None:
        """Name every HookPoint by its dotted path and bind it; call at the end of `__init__`.

        Binding puts each HookPoint also in its parent's `__dict__`, so `self.hook_q` in a
        forward is a plain attribute read. A registered submodule is otherwise found by
        `nn.Module.__getattr__`: an unused point then cost ~0.75 µs against ~0.13 µs bound, and
        the model's 80-108 points 7.5-9.4% of a batch-1 forward (benchmarks/probes/hook_lookup.py).
        The HookPoint stays registered (`named_modules`, `model.blocks[0].attn.hook_q`), and
        assigning a new module to the name replaces both, since `nn.Module.__setattr__` drops
        the plain attribute. A point or block swapped in later is found by name when hooks are
        attached (`_refresh_hooks`).
        """
        points = {}
        for name, module in self.named_modules():
            if isinstance(module, HookPoint):
                module.name = name
                points[name] = module
                parent, _, attr = name.rpartition(".")
                vars(self.get_submodule(parent))[attr] = module
        # whole, then swapped in: a refresh never shows another thread a half-built registry
        self._hook_points: dict[str, HookPoint] = points

    def hook_points(self) -> dict[str, HookPoint]:
        self._refresh_hooks()
        return self._hook_points

    def hook_names(self) -> list[str]:
        return list(self.hook_points())

    def _refresh_hooks(self) -> None:
        """Find the points again if a module was swapped since `setup_hooks`: otherwise a
        function would be attached to a point the forward no longer calls, and never run."""
        found = [m for m in self.modules() if isinstance(m, HookPoint)]
        if len(found) != len(self._hook_points) or any(
            hp is not m for hp, m in zip(self._hook_points.values(), found, strict=True)
        ):
            self.setup_hooks()

    def _in_place(self, name: str, hp: HookPoint) -> bool:
        """Whether `hp` is still the module at `name`: a walk down `_modules`, a few dict reads
        (it runs for every name attached)."""
        module: nn.Module | None = self
        for part in name.split("."):
            module = module._modules.get(part)
            if module is None:
                return False
        return module is hp

    def _resolve(self, name: str | Callable[[str], bool]) -> list[HookPoint]:
        if callable(name):
            return [hp for n, hp in self.hook_points().items() if name(n)]
        hp = self._hook_points.get(name)
        if hp is None or not self._in_place(name, hp):
            hp = self.hook_points().get(name)
        if hp is None:
            raise ValueError(f"unknown hook {name!r}; see model.hook_names() for the valid names")
        return [hp]

    @contextlib.contextmanager
    def hooks(
        self, fwd_hooks: Sequence[tuple[str | Callable[[str], bool], HookFn]] = ()
    ) -> Iterator[HookedModule]:
        """Attach `(name_or_filter, fn)` pairs for the duration of the block."""
        pairs = _hook_pairs(fwd_hooks)
        attached: list[tuple[HookPoint, HookFn]] = []
        try:
            for name, fn in pairs:
                for hp in self._resolve(name):
                    hp.fns.append(fn)
                    attached.append((hp, fn))
            yield self
        finally:
            for hp, fn in reversed(attached):
                # this block's own entry, the last one of fn (`reset_hooks` in the block may
                # have removed it): `remove` took the first, an outer block's copy of the same
                # fn, and the hooks left ran in another order
                at = [i for i, f in enumerate(hp.fns) if f is fn]
                if at:
                    del hp.fns[at[-1]]

    def reset_hooks(self) -> None:
        for hp in self.hook_points().values():
            hp.fns.clear()

    def run_with_hooks(
        self,
        *args: Any,
        fwd_hooks: Sequence[tuple[str | Callable[[str], bool], HookFn]] = (),
        **kwargs: Any,
    ) -> Any:
        """Forward with `fn(tensor, hook)` attached; a returned tensor replaces the original."""
        with self.hooks(fwd_hooks):
            return self(*args, **kwargs)

    def run_with_cache(
        self, *args: Any, names_filter: NameFilter = None, detach: bool = True, **kwargs: Any
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        """Forward and return `(output, cache)` with every (filtered) hooked tensor."""
        if isinstance(names_filter, Iterator):  # read once: a typo in a generator went unsaid
            names_filter = list(names_filter)
        match = _matcher(names_filter)
        points = self.hook_points()
        if isinstance(names_filter, str):
            self._resolve(names_filter)
        elif names_filter is not None and not callable(names_filter):
            for name in names_filter:  # a typo in a list is refused, as in a single name
                self._resolve(name)
        cache: dict[str, torch.Tensor] = {}

        def saver(name: str) -> HookFn:
            # filed under the name this model knows the point by: `hook.name` is the last
            # model's to set it up, so a block shared with another model lost its keys here
            def save(x: torch.Tensor, hook: HookPoint) -> None:
                cache[name] = x.detach() if detach else x
            return save

        with self.hooks([(name, saver(name)) for name in points if match(name)]):
            out = self(*args, **kwargs)
        return out, cache
