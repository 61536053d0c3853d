"""Apply a plan to live modules with non-reentrant `torch.utils.checkpoint`, undoably.

Each segment of consecutive blocks becomes one checkpointed region, opened by a
forward pre-hook on its first block and closed by a forward hook on its last (the
pattern of torch's composable `checkpoint`). The region's hooks stay outermost
(`hook_order`): it opens before every other pre-hook of its first block and closes after
every other forward hook of its last, so each hook of a user or a strategy runs once in
the forward and once in the recompute, on the same arguments. No module is wrapped or replaced, so
the module tree and every `state_dict` key stay as they were. RNG and autocast
state are restored for the recompute by torch; the module state a segment's forward writes
(BatchNorm statistics, spectral norm's vectors, QAT observers) by `state_guard`: a recompute runs
on the state the forward saw and leaves the state the forward left. A block that
is its own segment may keep some op calls from the forward instead of recomputing
them (`keep_ops`, built in `apply_selective`). Segments may nest (`inner_segments`): the
outer one saves only its input, and in its recompute each inner segment is again a checkpointed
region, saving only its own input until its own backward recomputes it (multi-level checkpointing).
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import _checkpoint_without_reentrant_generator

from lightning_ckpt.apply.hook_order import put_first, put_last, stands_behind
from lightning_ckpt.apply.selective import SelectiveKeep, validate_keep_ops
from lightning_ckpt.apply.state_guard import Stacked, StateGuard, StateRestore
from lightning_ckpt.planning.nested_model import validate_nested
from lightning_ckpt.profiling.forward_state.applied_marks import mark, refuse_marked
from lightning_ckpt.profiling.structure.block_calls import CallSites
from lightning_ckpt.profiling.structure.chain_check import receives_output, tensor_version

__all__ = ["AppliedPlan", "apply_plan", "apply_segments"]

Span = tuple[int, int]


def _first_tensor(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    return None


class _Segment:
    """One checkpointed region spanning blocks[first..last] (a picklable callable object).

    `running` is shared by the segments of one applied plan: the spans whose recompute is
    running, innermost last. A segment's hooks act outside every recompute and inside the
    recompute of a segment that encloses it (`ancestors`), where it is a region again.
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        first_index: int,
        guard_batchnorm: bool,
        determinism_check: str,
        early_stop: bool,
        selective: SelectiveKeep | None = None,
        running: list[Span] | None = None,
        ancestors: Collection[Span] = (),
    ) -> None:
        self.blocks = list(blocks)
        self.selective = selective
        self.early_stop = early_stop
        self.first_index = first_index
        self.span = (first_index, first_index + len(self.blocks) - 1)
        self.guard_batchnorm = guard_batchnorm
        # the module state the segment's forward writes, found at its first forward (`state_guard`)
        self.state_guard = StateGuard(self.blocks) if guard_batchnorm else None
        self.determinism_check = determinism_check
        self.running = [] if running is None else running
        self.ancestors = frozenset(ancestors)
        self._gen = None
        self._calls: list[tuple[tuple, dict]] = []
        self._last_out: Any = None
        self._last_version: int | None = None
        self.sites: CallSites | None = None  # the plan's, set by `_CallHooks`

    @property
    def enabled(self) -> bool:
        return not self.running or self.running[-1] in self.ancestors

    # -- contexts of the forward and the recompute (the recompute's: own hooks off, the forward's state;
    # a selective block adds torch's selective checkpoint modes and the replay of kept draws)
    def _context_fn(self):
        if self.state_guard is not None:
            forward, restore = self.state_guard.contexts()
        else:
            forward, restore = contextlib.nullcontext(), None
        recompute = _RecomputeContext(self, restore)
        if self.selective is None:
            return forward, recompute
        keep_forward, keep_recompute = self.selective.contexts(recompute)
        return Stacked(forward, keep_forward), keep_recompute

    # -- the function the recompute reruns: the whole segment from its input, with the
    # extra arguments each later block received in that same forward (`calls`), all as the
    # caller passed them. Each block is called as a module, so every other hook on it runs
    # once, as in the forward (a user's pre-hook transforms the input once; under ZeRO-3,
    # DeepSpeed gathers the block's parameters and re-wraps its input and output). The plan's
    # hooks are told which block call each one repeats (`CallSites.cursor`).
    def recompute(self, calls: list, *args: Any, **kwargs: Any) -> Any:
        self.sites.cursor = self.first_index
        out = self.blocks[0](*args, **kwargs)
        for k, blk in enumerate(self.blocks[1:], start=1):
            rest, kw = calls[k]
            self.sites.cursor = self.first_index + k
            out = blk(_first_tensor(out), *rest, **kw)
        return out

    # -- the plan's hooks (`_CallHooks`) hand each block call of the segment to these, with its position k
    def enter(self, k: int, module: nn.Module, args: tuple, kwargs: dict, late: bool) -> None:
        if not self.enabled:
            return
        if k == 0:
            if self._gen is not None:
                self._abandon()
                raise RuntimeError(
                    f"checkpointed segment starting at block {self.first_index} was entered again before its last "
                    f"block (block {self.first_index + len(self.blocks) - 1}) ran; the blocks of a segment must be "
                    "called in order, once each per forward. Plan with one block per segment for this model."
                )
            if not torch.is_grad_enabled():
                return
            if late:
                warnings.warn(
                    f"a forward pre-hook registered on block {self.first_index} with prepend=True after the "
                    "checkpointing plan was applied ran before the hook that opens its checkpointed segment, so its "
                    "effect would be applied twice in the recompute; this call runs without checkpointing that "
                    "segment and the segment's hook is moved in front for the next calls. Register such hooks "
                    "before applying the plan to avoid this.",
                    stacklevel=3,
                )
                return
            self._calls = [((), {})] * len(self.blocks)
            self._last_out = None
            fn = functools.partial(self.recompute, self._calls)
            self._gen = _checkpoint_without_reentrant_generator(
                fn, True, self._context_fn, self.determinism_check, False, self.early_stop, *args, **kwargs
            )
            try:
                next(self._gen)
            except BaseException:
                # the region did not open: e.g. an enclosing segment's recompute stops early (torch's
                # early stop) once it has saved this region's input, from inside this pre-hook
                self._gen = None
                self._calls = []
                raise
            return
        if self._gen is None:
            return
        # the previous block's output as the caller received it, or an alias of it that identity autograd
        # Functions put in between (DeepSpeed ZeRO-3 wraps every module's inputs and outputs): `receives_output`
        if not args or not receives_output(args[0], self._last_out, self._last_version):
            self._abandon()
            hint = (
                " A forward pre-hook registered on it with prepend=True after the plan was applied ran first "
                "and may have changed it; register such hooks before applying the plan."
                if late else ""
            )
            raise RuntimeError(
                f"block {self.first_index + k} of a checkpointed segment did not receive the previous block's "
                "output as its first argument (the same tensor or an unmodified alias of it: same storage, "
                "offset, shape, strides, dtype and requires_grad, not written in place), so the segment cannot be "
                "rebuilt from its input. Give such blocks a segment each (policy='full') or pass the chain's "
                f"blocks in call order.{hint}"
            )
        self._calls[k] = (tuple(args[1:]), dict(kwargs))

    def leave(self, k: int, output: Any) -> None:
        if not self.enabled or self._gen is None:
            return
        if k == len(self.blocks) - 1:
            gen, self._gen = self._gen, None
            self._last_out = None
            self._last_version = None
            self._calls = []  # the recompute holds its own reference until the backward: nothing outlives the step
            try:
                next(gen)
            except StopIteration:
                pass
            else:  # pragma: no cover - torch contract
                raise AssertionError("checkpoint generator was not exhausted")
        else:
            self._last_out = _first_tensor(output)
            self._last_version = tensor_version(self._last_out)

    def detach(self) -> None:
        """Drop a region left open (the plan's hooks are removed by `_CallHooks.detach`)."""
        self._abandon()

    def _abandon(self) -> None:
        gen, self._gen = self._gen, None
        self._last_out = None
        self._last_version = None
        self._calls = []
        if gen is not None:
            gen.close()

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_gen"] = None
        state["_last_out"] = None
        state["_last_version"] = None
        state["_calls"] = []
        return state


class _CallHooks:
    """The applied plan's hooks: one forward pre-hook and one forward hook per block module, which
    tell each block call its entry in the chain (`CallSites`: counted from `new_step`, or named by
    a recompute) and hand it to the segments that hold it, an enclosing segment first on the way in
    and last on the way out. The pre-hook runs before every other pre-hook of the module, the
    forward hook after every other forward hook (`hook_order`)."""

    def __init__(self, blocks: Sequence[nn.Module], segments: Sequence[_Segment], running: list[Span]) -> None:
        self.sites = CallSites(blocks)
        self.running = running
        self.by_entry: list[list[_Segment]] = [[] for _ in blocks]
        for seg in sorted(segments, key=lambda g: (g.span[0], -g.span[1])):
            seg.sites = self.sites
            for k in range(seg.span[0], seg.span[1] + 1):
                self.by_entry[k].append(seg)
        self._stacks: dict[nn.Module, list] = {}  # modules as keys: a deep copy maps them to its own
        self._handles: list[Any] = []
        self._pre_ids: dict[nn.Module, int] = {}
        self._post_ids: dict[nn.Module, int] = {}

    def pre_hook(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hooks = module._forward_pre_hooks
        mine = self._pre_ids.get(module)
        late = mine is not None and stands_behind(hooks, mine, {mine: 0})
        # forward hooks registered after the plan's move behind its hook, before they run
        post = self._post_ids.get(module)
        if post is not None:
            put_last(module._forward_hooks, {post: 0})
        k = self.sites.next_call(module)
        self._stacks.setdefault(module, []).append(k)
        if k is None:
            return
        for seg in self.by_entry[k]:
            seg.enter(k - seg.first_index, module, args, kwargs, late)

    def post_hook(self, module: nn.Module, args: tuple, output: Any) -> None:
        # pre-hooks registered in front of the plan's after it was applied go behind it from the next call
        mine = self._pre_ids.get(module)
        if mine is not None:
            put_first(module._forward_pre_hooks, {mine: 0})
        stack = self._stacks.get(module)
        k = stack.pop() if stack else None
        if k is None:
            return
        for seg in reversed(self.by_entry[k]):
            seg.leave(k - seg.first_index, output)

    def new_step(self) -> dict[nn.Module, tuple[int, int]]:
        """Count block calls from the start again (a training step begins). -> the modules whose calls with
        grad in the step that ended (when one ran) differ from the chain's: module -> (calls, entries)."""
        counted = self.sites.count  # the modules the plan hooks (those in a segment)
        odd = {
            m: (counted.get(m, 0), len(ks)) for m, ks in self.sites.entries.items()
            if counted and m in self._pre_ids and counted.get(m, 0) != len(ks)
        }
        self.sites.reset()
        return odd

    def attach(self, modules: Sequence[nn.Module]) -> None:
        for m in modules:
            pre = m.register_forward_pre_hook(self.pre_hook, prepend=True, with_kwargs=True)
            post = m.register_forward_hook(self.post_hook, always_call=True)
            self._handles += [pre, post]
            self._pre_ids[m], self._post_ids[m] = pre.id, post.id

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self._stacks.clear()


class _RecomputeContext:
    """Entered around each recompute: the state the forward saw put in place (`StateRestore`, or
    any context: torch enters it as given), the segment's span pushed on the plan's running stack
    (its own hooks and its ancestors' go quiet; the segments inside it open again)."""

    def __init__(self, segment: _Segment, guard: StateRestore | Any | None) -> None:
        self.segment = segment
        self.guard = guard

    def __enter__(self) -> None:
        self.segment.running.append(self.segment.span)
        try:
            if self.guard is not None:
                self.guard.__enter__()
        except BaseException:
            self.segment.running.pop()
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            if self.guard is not None:
                self.guard.__exit__(*exc)
        finally:
            running = self.segment.running
            for k in range(len(running) - 1, -1, -1):
                if running[k] == self.segment.span:
                    del running[k]
                    break


class AppliedPlan:
    """Handle of an applied plan; `remove()` restores the modules exactly."""

    def __init__(
        self,
        segments: list[_Segment],
        spans: list[Span],
        keep_ops: dict[int, frozenset[tuple[str, int]]] | None = None,
        inner_segments: list[Span] | None = None,
        marked_blocks: Sequence[nn.Module] = (),
        hooks: _CallHooks | None = None,
    ) -> None:
        self._segments = segments
        self._hooks = hooks
        self._marked = list(marked_blocks)  # blocks marked as running under this plan (`applied_marks`)
        self.segments = spans
        self.inner_segments = inner_segments or []
        self.keep_ops = keep_ops or {}  # block index -> the op-call keys kept (an empty set: plain checkpointing)

    def remove(self) -> None:
        if self._hooks is not None:
            self._hooks.detach()
            self._hooks = None
        for seg in self._segments:
            seg.detach()
        mark(self._marked, False)
        self._marked = []
        self._segments = []
        self.segments = []
        self.inner_segments = []
        self.keep_ops = {}

    @property
    def active(self) -> bool:
        return bool(self._segments)

    def new_step(self) -> dict[nn.Module, tuple[int, int]]:
        """A training step begins: block calls are counted from the first again (each call of a module
        called several times per step is its own entry). -> for the step that ended, the modules
        called with grad another number of times than the chain has entries: (calls, entries)."""
        return {} if self._hooks is None else self._hooks.new_step()


def apply_segments(
    blocks: Sequence[nn.Module],
    segments: Sequence[tuple[int, int]],
    guard_batchnorm: bool = True,
    determinism_check: str = "default",
    early_stop: bool = True,
    keep_ops: Mapping[int, Collection[tuple[str, int]]] | None = None,
    inner_segments: Sequence[Span] = (),
) -> AppliedPlan:
    """Checkpoint each `(first, last)` segment of `blocks`; returns an undo handle.

    `early_stop` (torch's default) ends each recompute at the last tensor backward
    needs, skipping the trailing ops of the segment's last block.

    `keep_ops` maps a block that is its own segment `(i, i)` to the op calls of its forward
    to keep instead of recomputing, each named `(op name, call index)` as
    `profiling.work.op_keys.OpCallCounter` numbers them, e.g. `{3: [("aten.addmm.default", 0)]}`.
    Kept random calls (dropout's `bernoulli_`) keep their draws; the rest draw again as in
    the forward. Keys the block's first forward never makes raise a ValueError there.
    A one-block inner segment may keep op calls too.

    `inner_segments` nest inside `segments` (see `validate_nested`): an outer segment's
    forward saves its input only; its recompute saves the activations of its blocks outside
    its inner segments and only the input of each inner segment, which is recomputed in turn
    when the backward reaches it. Every level replays dropout and guards the state its forward writes.
    """
    from lightning_ckpt.planning.memory_model import validate_segments

    spans = validate_segments(len(blocks), segments)
    inner = validate_nested(len(blocks), spans, inner_segments)
    refuse_marked([blocks[i] for a, b in spans for i in range(a, b + 1)], None, "apply a plan")
    keeps = validate_keep_ops(keep_ops, spans, len(blocks), inner)
    running: list[Span] = []
    objs = []
    # on a shared first block the parent opens first and on a shared last block the child closes first
    everything = sorted(spans + inner, key=lambda s: (s[0], -s[1]))
    for a, b in everything:
        selective = SelectiveKeep(a, keeps[a]) if keeps.get(a) and a == b else None
        ancestors = [s for s in everything if s[0] <= a and b <= s[1] and s != (a, b)]
        objs.append(_Segment(
            blocks[a : b + 1], a, guard_batchnorm, determinism_check, early_stop, selective, running, ancestors
        ))
    hooks = _CallHooks(blocks, objs, running)
    in_plan = {id(blocks[i]) for a, b in spans for i in range(a, b + 1)}
    hooks.attach([m for m in hooks.sites.modules if id(m) in in_plan])
    marked = [m for m in hooks.sites.modules if id(m) in in_plan]
    mark(marked, True)
    return AppliedPlan(objs, spans, keeps, inner, marked_blocks=marked, hooks=hooks)


def apply_plan(
    blocks: Sequence[nn.Module],
    plan: Any,
    guard_batchnorm: bool = True,
    determinism_check: str = "default",
    early_stop: bool = True,
) -> AppliedPlan:
    """Apply a `Plan` to the blocks it was made for: its segments, the inner segments rebuilt
    inside them and the op calls it keeps (`apply_segments`); returns the undo handle."""
    if len(blocks) != plan.n_blocks:
        raise ValueError(
            f"the plan was made for a chain of {plan.n_blocks} blocks, but {len(blocks)} blocks were given; pass "
            "the blocks the plan's profile was taken on, in call order."
        )
    return apply_segments(
        blocks, plan.segments, guard_batchnorm, determinism_check, early_stop, keep_ops=plan.keep_ops or None,
        inner_segments=plan.inner_segments,
    )
