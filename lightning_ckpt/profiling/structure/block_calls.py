"""Blocks are calls: the k-th entry of a chain is one call of a module within a training step.

A chain is a list of modules in the order the step calls them, where a module called several
times per step (a layer shared by every depth, one encoder run on two views, a discriminator on
real and fake images) appears once per call. Its hooks are registered once per module
(`hook_calls`); each call is told its entry by counting the module's calls since the pass began
(`CallSites`). `call_chain` records, in one forward without saved activations, which calls of
the named modules a step makes, so that an explicit list of modules becomes its chain of calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_ckpt.profiling.structure.layer_skipping import layers_always_run

__all__ = ["BlocksNeverRan", "CallSites", "call_chain", "call_names", "hook_calls", "occurrences", "TooManyCalls"]


class TooManyCalls(RuntimeError):
    """A module ran more often within one step than the chain has entries for it."""


class BlocksNeverRan(ValueError):
    """A named block made no call with grad enabled in the step."""


def occurrences(blocks: Sequence[nn.Module]) -> list[int]:
    """Per entry, how many earlier entries are the same module (the call's index within the step)."""
    seen: dict[int, int] = {}
    out = []
    for m in blocks:
        out.append(seen.get(id(m), 0))
        seen[id(m)] = out[-1] + 1
    return out


def call_names(names: Sequence[str], blocks: Sequence[nn.Module]) -> list[str]:
    """`names` with `#k` appended to every entry of a module that has several (`k`: its call index)."""
    counts: dict[int, int] = {}
    for m in blocks:
        counts[id(m)] = counts.get(id(m), 0) + 1
    return [
        f"{name.split('#')[0]}#{k}" if counts[id(m)] > 1 else name
        for name, m, k in zip(names, blocks, occurrences(blocks))
    ]


def distinct(blocks: Sequence[nn.Module]) -> list[nn.Module]:
    """The modules of `blocks`, each once, in order of first entry."""
    return list({id(m): m for m in blocks}.values())


class CallSites:
    """Which entry of `blocks` each call of one of its modules is, counted from `reset`.

    `grad_only`: only calls made with grad enabled count (a training step's calls under `no_grad`
    are not entries); passes that run the whole step without grad count every call."""

    def __init__(self, blocks: Sequence[nn.Module], grad_only: bool = True, names: Sequence[str] = ()) -> None:
        self.blocks = list(blocks)
        self.names = list(names)
        self.grad_only = grad_only
        # keyed by the modules themselves (not their ids), so that a deep copy of the model maps them to its own
        self.entries: dict[nn.Module, list[int]] = {}
        for k, m in enumerate(self.blocks):
            self.entries.setdefault(m, []).append(k)
        self.modules = distinct(self.blocks)
        self.count: dict[nn.Module, int] = {}
        self.cursor: int | None = None  # set by a recompute: the entry it calls next

    def reset(self) -> None:
        self.count = {}

    def expected(self, module: nn.Module) -> int:
        return len(self.entries.get(module, ()))

    def next_call(self, module: nn.Module, strict: bool = False) -> int | None:
        """The entry of this call of `module` (None: a call that is no entry). Past the module's
        last entry: `TooManyCalls` when `strict`, else counting starts over (the next step)."""
        if self.cursor is not None:
            k, self.cursor = self.cursor, None
            return k
        if self.grad_only and not torch.is_grad_enabled():
            return None
        ks = self.entries.get(module)
        if ks is None:
            return None
        n = self.count.get(module, 0)
        if n >= len(ks):
            if strict:
                name = self.names[ks[0]].split("#")[0] if self.names else type(module).__name__
                raise TooManyCalls(
                    f"block {name!r} ran a {_nth(n + 1)} time with grad enabled in one step, but the plan's chain has "
                    f"{len(ks)} call(s) of it per step (read from the step profiled). A step must call each block as "
                    "often as the profiled one: a module whose number of calls depends on the batch cannot be a "
                    "block (leave it out of blocks=[...]); in a loop of your own, call handle.step(batch) before "
                    "every training step."
                )
            n = 0
        self.count[module] = n + 1
        return ks[n]


def hook_calls(
    sites: CallSites,
    pre: Callable[..., Any] | None,
    post: Callable[..., Any] | None = None,
    *,
    with_kwargs: bool = False,
    prepend: bool = False,
    strict: bool = False,
    pre_last: Callable[[int | None, nn.Module], Any] | None = None,
) -> list:
    """One forward pre-hook and one forward hook per module of `sites`: `pre(k, module, args[, kwargs])`
    and `post(k, module, args, output)` for the calls that are entries (`k`). With `pre_last`, one more
    pre-hook, after every other the module has: `pre_last(k, module)` for every call (`k` None: no entry).
    -> the handles. Each hook is one Python call between the module and `pre` or `post`: they run
    around every block call of every pass."""
    stacks: dict[int, list] = {}
    handles = []
    next_call = sites.next_call
    for m in sites.modules:
        stack = stacks.setdefault(id(m), [])

        def before(module, args, kwargs=None, _stack=stack):
            k = next_call(module, strict)
            _stack.append(k)
            if k is not None and pre is not None:
                return pre(k, module, args, kwargs) if with_kwargs else pre(k, module, args)
            return None

        def after(module, args, output, _stack=stack):
            k = _stack.pop() if _stack else None
            if k is not None and post is not None:
                post(k, module, args, output)

        handles.append(m.register_forward_pre_hook(before, prepend=prepend, with_kwargs=with_kwargs))
        if pre_last is not None:
            handles.append(m.register_forward_pre_hook(
                lambda module, args, _stack=stack: pre_last(_stack[-1] if _stack else None, module)
            ))
        handles.append(m.register_forward_hook(after, always_call=True))
    return handles


def _nth(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def call_chain(
    model: nn.Module, modules: Sequence[nn.Module], names: Sequence[str], step_fn: Callable[[Any], Any], batch: Any
) -> tuple[list[nn.Module], list[str]]:
    """The chain of calls the step makes of `modules` (named `names`): one entry per call made with grad
    enabled, in call order, names with `#k` for a module called several times. One forward of
    `step_fn(batch)` with no activation saved (no backward runs); the caller holds the model's state."""
    name_of = {id(m): n for m, n in zip(modules, names)}
    order: list[nn.Module] = []
    depth = [0]

    def pre(module, args):
        if depth[0] == 0 and torch.is_grad_enabled():
            order.append(module)
        depth[0] += 1

    def post(module, args, out):
        depth[0] -= 1

    handles = []
    for m in distinct(modules):
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post, always_call=True))
    try:
        with layers_always_run(model), torch.autograd.graph.saved_tensors_hooks(lambda t: None, _no_unpack):
            step_fn(batch)
    finally:
        for h in handles:
            h.remove()
    missing = [name_of[id(m)] for m in distinct(modules) if all(o is not m for o in order)]
    if missing:
        raise BlocksNeverRan(
            f"blocks {missing} never ran with grad enabled in the training step, so there is nothing of theirs to "
            "checkpoint; leave them out of blocks=[...] (each listed block must run in every step)."
        )
    return order, call_names([name_of[id(m)] for m in order], order)


def _no_unpack(_: Any) -> Any:
    raise RuntimeError("call_chain runs a forward only; no backward can run on it")
