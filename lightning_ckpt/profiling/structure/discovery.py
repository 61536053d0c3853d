"""Find the chains to plan over from the bytes one training step saves, when no blocks are named:
one chain of block calls per level of the module tree (`candidate_chains`), each in the order the
calls run (a module called k times with autograd on is k blocks); the default covers nearly the
most bytes with the smallest largest block, the others are its `alternatives` (`engine.chain_levels`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from lightning_ckpt.profiling.structure.batch import batch_size_of, slice_batch
from lightning_ckpt.profiling.structure.call_sequence import CallSequence, record_calls
from lightning_ckpt.profiling.passes.profile_budget import AT_LIMIT, SliceRoom, batch_bytes, reached_bytes, released, why_stopped
from lightning_ckpt.profiling.passes.profile_refusal import ProfileRefused, Shortfall
from lightning_ckpt.profiling.structure.shapes import shape_of
from lightning_ckpt.units import format_bytes

__all__ = ["ChainChoice", "discover_chain"]

NEAR_BEST_SHARE = 0.02  # of the step's saved bytes: candidates this close to the best coverage compete
REST = "(the rest of the step)"


@dataclass(frozen=True)
class ChainChoice:
    """A chain `discover_chain` offers. Bytes are what the probed slice's forward saves.

    names, modules: the block calls in call order; a module called several times appears once per
    call, named `path#k` (k: its place among the module's grad-enabled calls, `call_index`), a module
    called once by its dotted path. covered_bytes: what the blocks save (`entry_saved_bytes` each);
    step_bytes: what the whole step saves. left_out: (call name, bytes) of the calls outside the chain
    that save something, and ("(the rest of the step)", bytes) for the rest. probe_batch_size: the
    slice it was measured on. level: which blocks these are ("the children of encoder.layers.*.blocks").
    grad_off_calls: blocks called with autograd off (a chain only of those is offered when no block
    of its level runs with autograd on, such as reversible layers inside an autograd.Function).
    alternatives: the other candidates (each with no alternatives of its own).
    """

    names: tuple[str, ...]
    modules: tuple[nn.Module, ...]
    covered_bytes: int
    step_bytes: int
    left_out: tuple[tuple[str, int], ...]
    probe_batch_size: int
    level: str = ""
    call_index: tuple[int, ...] = ()
    entry_saved_bytes: tuple[int, ...] = ()
    grad_off_calls: int = 0
    alternatives: tuple[ChainChoice, ...] = ()

    @property
    def covered_share(self) -> float:
        return self.covered_bytes / self.step_bytes if self.step_bytes else 1.0

    @property
    def largest_entry_bytes(self) -> int:
        return max(self.entry_saved_bytes, default=0)

    @property
    def candidates(self) -> tuple[ChainChoice, ...]:
        """This chain, then its alternatives: the candidates `engine.chain_levels.choose_chain` takes."""
        return (self, *self.alternatives)

    def summary(self) -> str:
        """One short phrase: level, number of blocks, first..last, share of the bytes."""
        first, last = (self.names[0], self.names[-1]) if self.names else ("-", "-")
        return f"{self.level or 'a chain'} ({len(self.names)} blocks, {first}..{last}, {100 * self.covered_share:.1f}%)"

    def __str__(self) -> str:
        first, last = (self.names[0], self.names[-1]) if self.names else ("-", "-")
        rest = ", ".join(f"{n} {format_bytes(b)}" for n, b in self.left_out) or "nothing"
        distinct = len({id(m) for m in self.modules})
        calls = f" (calls of {distinct} modules)" if distinct < len(self.modules) else ""
        level = f" The blocks: {self.level}." if self.level else ""
        others = "; ".join(a.summary() for a in self.alternatives)
        also = f" Also found: {others}." if others else ""
        return (
            f"blocks=None: chose {len(self.names)} blocks from {first} to {last}{calls}, which save "
            f"{format_bytes(self.covered_bytes)} of the {format_bytes(self.step_bytes)} the step saves "
            f"({100 * self.covered_share:.1f}%) at batch {self.probe_batch_size}; left out: {rest}. They stay in the "
            f"memory model; name blocks=[...] to plan over others.{level}{also}"
        )

    def to_dict(self) -> dict:
        out = {
            "names": list(self.names), "covered_bytes": self.covered_bytes, "step_bytes": self.step_bytes,
            "left_out": [list(x) for x in self.left_out], "probe_batch_size": self.probe_batch_size,
            "level": self.level, "call_index": list(self.call_index),
            "entry_saved_bytes": list(self.entry_saved_bytes), "grad_off_calls": self.grad_off_calls,
        }
        if self.alternatives:
            out["alternatives"] = [a.to_dict() for a in self.alternatives]
        return out


def _is_container(module: nn.Module) -> bool:
    """A ModuleList (of any length: a list of one shared layer run six times is a chain), or a
    Sequential of two or more children of one class (a Sequential of mixed layers, such as an MLP,
    is one module, not a list of blocks)."""
    children = list(module.children())
    if isinstance(module, nn.ModuleList):
        return len(children) >= 1
    return isinstance(module, nn.Sequential) and len(children) >= 2 and len({type(c) for c in children}) == 1


class _Tree:
    """The module tree, opened level by level."""

    def __init__(self, called: set[nn.Module]) -> None:
        self.called = called
        self._holds: dict[nn.Module, bool] = {}

    def holds(self, m: nn.Module) -> bool:
        """Whether a list of blocks sits somewhere below `m`."""
        if m not in self._holds:
            self._holds[m] = any(_is_container(c) or self.holds(c) for c in m.children())
        return self._holds[m]

    def frontier(self, m: nn.Module, k: int, listed: bool = False, inside: bool = False) -> list[tuple]:
        """(module, listed, inside) covering `m` with `k` levels of lists left to open; listed: a child
        of a list (a block), inside: a block or within one. A list gives its children as blocks, one
        level down; a module with a list among its children is a level of its own: its other children
        (a U-Net's mid block next to its down and up blocks) are one level down too; a module with
        lists only deeper is passed through."""
        if k == 0 or not (_is_container(m) or self.holds(m)):
            return [(m, listed, inside)]
        if _is_container(m):
            return [x for c in m.children() for x in self.frontier(c, k - 1, True, True)]
        level = any(_is_container(c) for c in m.children())
        out = []
        for c in m.children():
            out.extend(self.frontier(c, k if _is_container(c) or not level else k - 1, False, inside))
        return out

    def resolve(self, m: nn.Module, listed: bool, inside: bool) -> list[tuple]:
        """A module never called itself (a ModuleList, a ModuleDict) stands for its called descendants."""
        if m in self.called:
            return [(m, listed, inside)]
        boxed = _is_container(m)
        return [x for c in m.children() for x in self.resolve(c, listed or boxed, inside or boxed)]


@dataclass(frozen=True)
class _Candidate:
    choice: ChainChoice
    calls: tuple[int, ...]  # the entries' indices in the call sequence


def _level_text(paths: list[str]) -> str:
    """'the children of a.*.{b,c}, d': where the blocks sit, with list indices as '*'."""
    groups: dict[str, list[str]] = {}  # parent's parent -> the parents' last names, in call order
    for path in paths:
        parent = ".".join("*" if p.isdigit() else p for p in path.rpartition(".")[0].split("."))
        above, _, last = parent.rpartition(".")
        names = groups.setdefault(above if above else parent, [])
        if above and last not in names:
            names.append(last)
    shown = [
        "the model" if not p and not n else p if not n else f"{p}.{n[0]}" if len(n) == 1 else f"{p}.{{{','.join(n)}}}"
        for p, n in groups.items()
    ]
    more = f" and {len(shown) - 4} more" if len(shown) > 4 else ""
    return f"the children of {', '.join(shown[:4])}{more}"


def _outermost(seq: CallSequence, modules: set[nn.Module]) -> list[int]:
    """The calls of `modules` made while no other call of them runs."""
    within = [False] * len(seq.calls)
    out = []
    for i, c in enumerate(seq.calls):
        above = c.parent >= 0 and within[c.parent]
        within[i] = above or c.module in modules
        if c.module in modules and not above:
            out.append(i)
    return out


def _entries(seq: CallSequence, live: list[int], lo: int, hi: int) -> list[int]:
    """Every grad-enabled outermost call of the modules with a live call in [lo, hi], leaving out the
    modules also called outside it: a chain holds all of a module's calls in the step (the k-th call
    of a module is its k-th entry, `profiling.structure.block_calls`)."""
    calls = seq.calls
    kept = {calls[i].module for i in live if lo <= i <= hi}
    while kept:
        entries = [i for i in _outermost(seq, kept) if calls[i].grad_enabled]
        outside = {calls[i].module for i in entries if not lo <= i <= hi}
        if not outside:
            return entries
        kept -= outside
    return []


def _chain(seq: CallSequence, tree: _Tree, front: list[tuple], batch: int) -> _Candidate | None:
    """The chain a frontier gives: its outermost calls from the first block call to the last one
    whose output needs a gradient (`_entries`)."""
    kinds: dict[nn.Module, tuple[bool, bool]] = {}  # module -> (listed, inside)
    for item in front:
        for r, listed, inside in tree.resolve(*item):
            was = kinds.get(r, (False, False))
            kinds[r] = (was[0] or listed, was[1] or inside)
    calls = seq.calls
    outer = _outermost(seq, set(kinds))
    live = [i for i in outer if calls[i].grad_enabled and calls[i].output_requires_grad]
    blocks = [i for i in live if kinds[calls[i].module][1]]
    grad_off = 0
    if blocks:
        entries = _entries(seq, live, blocks[0], blocks[-1])
    else:  # no block call with autograd on: offered as they are, saving nothing (`describe_nothing_saved`)
        entries = [i for i in outer if kinds[calls[i].module][1]]
        grad_off = len(entries)
    if not entries:
        return None
    left = {i: calls[i].saved_bytes for i in outer}
    for i in entries:  # what each outermost call holds beyond the entries inside it
        j = i
        while j >= 0 and j not in left:
            j = calls[j].parent
        if j >= 0:
            left[j] -= calls[i].saved_bytes
    left_out = [(calls[i].name, b) for i, b in left.items() if b > 0]
    covered = sum(calls[i].saved_bytes for i in entries)
    step = seq.step_saved_bytes
    rest = step - covered - sum(b for _, b in left_out)
    if rest > 0:
        left_out.append((REST, rest))
    modules = tuple(calls[i].module for i in entries)
    index = _occurrences(modules)
    several = {m for m, k in zip(modules, index) if k > 0}
    listed = [calls[i].path for i in entries if kinds.get(calls[i].module, (False,))[0]]
    choice = ChainChoice(
        names=tuple(f"{calls[i].path}#{k}" if calls[i].module in several else calls[i].path for i, k in zip(entries, index)),
        modules=modules, covered_bytes=covered, step_bytes=step, left_out=tuple(left_out), probe_batch_size=batch,
        level=_level_text(listed), call_index=index, entry_saved_bytes=tuple(calls[i].saved_bytes for i in entries),
        grad_off_calls=grad_off,
    )
    return _Candidate(choice, tuple(entries))


def _occurrences(modules: tuple[nn.Module, ...]) -> tuple[int, ...]:
    seen: dict[nn.Module, int] = {}
    out = []
    for m in modules:
        out.append(seen.get(m, 0))
        seen[m] = out[-1] + 1
    return tuple(out)


def _within(seq: CallSequence, inner: int, outer: int) -> bool:
    while inner >= 0 and inner != outer:
        inner = seq.calls[inner].parent
    return inner == outer


def _wraps(seq: CallSequence, a: _Candidate, b: _Candidate) -> bool:
    """Whether `b`'s blocks are `a`'s, one level in (ALBERT's layer group around its one layer):
    as many, each inside its counterpart, saving the same bytes."""
    return (
        len(a.calls) == len(b.calls)
        and a.choice.entry_saved_bytes == b.choice.entry_saved_bytes
        and all(_within(seq, j, i) for i, j in zip(a.calls, b.calls))
    )


def candidate_chains(model: nn.Module, seq: CallSequence, batch: int) -> list[ChainChoice]:
    """One chain per level of the module tree, coarsest first, from the step's call sequence.

    At level 1 the model is opened down to its outermost lists of blocks (every `nn.ModuleList`, and
    `nn.Sequential` of one class), whose children are the blocks; each further level opens the blocks
    that hold lists themselves (a Swin stage into its blocks and downsample layer). A chain runs from
    the first block call to the last one (calls made with autograd off are no blocks) and takes the
    calls in between whose output needs a gradient, of modules not also called outside that span. A
    level that repeats another's blocks, or wraps them one to one (ALBERT's layer group around its
    one layer), is left out."""
    tree = _Tree(seq.called())
    found: list[_Candidate] = []
    previous = None
    for k in range(1, 64):
        front = tree.frontier(model, k)
        key = [(id(m), listed, inside) for m, listed, inside in front]
        if key == previous:
            break
        previous = key
        cand = _chain(seq, tree, front, batch)
        if cand is None or any(c.choice.names == cand.choice.names or _wraps(seq, c, cand) for c in found):
            continue
        found.append(cand)
    return [c.choice for c in found]


def default_index(candidates: list[ChainChoice]) -> int:
    """Among the candidates covering within NEAR_BEST_SHARE of the step's bytes of the best one, the
    one whose largest block saves least (ties: more blocks, then the coarser level)."""
    best = max(c.covered_bytes for c in candidates)
    near = [
        i for i, c in enumerate(candidates) if c.covered_bytes >= best - NEAR_BEST_SHARE * c.step_bytes
    ]
    return min(near, key=lambda i: (candidates[i].largest_entry_bytes, -len(candidates[i].names), i))


def discover_chain(
    model: nn.Module, step_fn: Callable[[Any], torch.Tensor], batch: Any, probe_batch_size: int = 2,
    room: SliceRoom | None = None,
) -> ChainChoice:
    """The default chain of `model` for `step_fn(batch)`, with the other levels' chains as its
    `alternatives` (see the module docstring), measured on a slice of `probe_batch_size` samples.
    All state is left as found; no backward runs. With `room` (`profile_budget`), the forward stays
    within it: stopped at it, it runs again on one sample, and stopped there too, the batch is
    refused (`profile_refusal.ProfileRefused`) before anything went over the budget."""
    size = min(probe_batch_size, batch_size_of(batch))
    seq, reached = _read_calls(model, step_fn, batch, size, room)
    if seq is None and size > 1:  # stopped at the room: one sample, when the model trains on one
        try:
            seq, one = _read_calls(model, step_fn, batch, 1, room)
            size, reached = (1, one) if seq is None else (1, reached)
        except ValueError:  # (a BatchNorm refuses one sample in training)
            seq = None
    if seq is None:
        assert room is not None
        raise ProfileRefused(Shortfall(
            room.budget_bytes, room.outside_bytes, shape_of(batch).describe(), batch_size_of(batch), size, reached,
            pass_words="reading which blocks there are (blocks=None: a forward with nothing saved for backward, less "
                       "than any plan's step holds)",
        ))
    candidates = candidate_chains(model, seq, size)
    if not candidates:
        raise ValueError(
            f"{type(model).__name__} has no nn.ModuleList (or nn.Sequential of two or more modules of one class) "
            "whose modules run in the training step, so there is no chain to find. Pass blocks=[...] naming the "
            "modules to checkpoint, in call order."
        )
    chosen = default_index(candidates)
    others = tuple(c for i, c in enumerate(candidates) if i != chosen)
    return replace(candidates[chosen], alternatives=others)



def _read_calls(
    model: nn.Module, step_fn: Callable[[Any], Any], batch: Any, size: int, room: SliceRoom | None,
) -> tuple[CallSequence | None, int | None]:
    """(`record_calls` on the first `size` samples of `batch` within `room`, None when it was stopped there;
    what it held then); a `ProfileBudgetError` when the device itself ran out of memory."""
    small = slice_batch(batch, size)
    if room is None:
        return record_calls(model, step_fn, small), None
    limit, reason = room.room_bytes - batch_bytes(small), None
    try:
        return record_calls(model, step_fn, small, limit), None
    except torch.OutOfMemoryError as err:  # its frames hold the forward's tensors: let go of them first
        reason, reached = why_stopped(err), reached_bytes(err, room.room_bytes)
    released()
    if reason != AT_LIMIT:
        raise room.refusal(size, reason)
    return None, reached
