"""The engine's blocks as calls: the chain of calls a step makes of the blocks it was given, read once
after `bind` (`profiling.structure.block_calls`), and the applied plan's count of calls started again at every step.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_ckpt.engine.engine_inputs import block_signature
from lightning_ckpt.profiling.structure.block_calls import BlocksNeverRan


def _distinct(names: list[str], blocks: list[torch.nn.Module]) -> list[tuple[str, torch.nn.Module]]:
    """(name without its call index, module) of each module of `blocks` once, in order of first call."""
    seen: dict[int, tuple[str, torch.nn.Module]] = {}
    for n, b in zip(names, blocks):
        seen.setdefault(id(b), (n.split("#")[0], b))
    return list(seen.values())


def read_calls(engine: Any, batch: Any) -> None:
    """Once after `bind`: the blocks become the chain of calls a step on `batch` makes of them
    (`profiling.structure.block_calls`: a module called several times per step is one block per call)."""
    read = getattr(engine.driver, "call_chain", None)
    if engine._calls_read or read is None:
        return
    distinct = _distinct(engine.block_names, engine.blocks)
    try:
        blocks, names = read(batch, [b for _, b in distinct], [n for n, _ in distinct])
    except BlocksNeverRan:
        raise
    except Exception:  # noqa: BLE001 - a step that fails on a slice is reported by profiling, with what to do
        if len(distinct) != len(engine.blocks):
            raise
        return
    if names != engine.block_names:
        if len(blocks) != len(set(map(id, blocks))) or [n.split("#")[0] for n in names] != engine.block_names:
            engine.driver.info(
                f"lightning-ckpt: the step makes {len(blocks)} block calls of the {len(set(map(id, blocks)))} "
                f"blocks named, in this order: {', '.join(names)}; each call is planned on its own."
            )
        engine.blocks, engine.block_names, engine.signature = blocks, names, block_signature(names, blocks)
    engine._calls_read = True


def new_step(engine: Any) -> None:
    """A step begins: the applied plan counts block calls from the first again; a step that called a block
    another number of times than the plan's chain has calls of it is said once."""
    if engine._applied is None:
        return
    odd = engine._applied.new_step()
    if odd and not engine._odd_calls_told:
        engine._odd_calls_told = True
        where = {id(b): n.split("#")[0] for b, n in zip(engine.blocks, engine.block_names)}
        said = ", ".join(
            f"{where.get(id(m), type(m).__name__)!r} {got} times (planned {want})" for m, (got, want) in odd.items()
        )
        engine.driver.warn(
            f"lightning-ckpt: the last step called {said} with grad enabled; the plan was made for the calls of "
            "the step profiled, so its memory prediction does not hold for such steps. Keep the number of block "
            "calls per step fixed, or leave such blocks out of blocks=[...]."
        )
