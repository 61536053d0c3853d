"""Which modules run under an applied plan: set when a plan is applied, cleared when it is removed.

A second plan on the same blocks would checkpoint them twice (torch then fails in the backward with a
`CheckpointError`), and profiling blocks that run a plan measures the plan, not the blocks; both are
refused with what to do, by `apply` and by the profiler, which read the mark here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from torch import nn

MARK = "_lightning_ckpt_applied"  # attribute set on each block of an applied plan: how many regions hold it


def mark(blocks: Iterable[nn.Module], on: bool) -> None:
    for b in blocks:
        count = getattr(b, MARK, 0) + (1 if on else -1)
        if count > 0:
            object.__setattr__(b, MARK, count)
        elif hasattr(b, MARK):
            object.__delattr__(b, MARK)


def marked(blocks: Sequence[nn.Module], names: Sequence[str] | None = None) -> list[str]:
    """Names (or indices) of the blocks that run under an applied plan."""
    names = list(names) if names is not None else [str(i) for i in range(len(blocks))]
    return [n for n, b in zip(names, blocks) if getattr(b, MARK, 0)]


def refuse_marked(blocks: Sequence[nn.Module], names: Sequence[str] | None, doing: str) -> None:
    """ValueError when any of `blocks` runs under an applied plan, saying what to do."""
    found = marked(blocks, names)
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise ValueError(
            f"cannot {doing}: {len(found)} block(s) already run under an applied plan ({shown}). Remove that "
            "plan first (`handle.remove()` / `AppliedPlan.remove()`), or keep it and do not plan these blocks again."
        )
