"""Find the ordered chain of blocks to plan over.

`blocks` is a dotted path to a container of blocks (`"encoder.layers"`), or None to
pick the largest container whose children all share one class (ties: the one
with more parameters). Unknown paths get an error that lists the candidates.
"""

from __future__ import annotations

from torch import nn


def candidate_containers(model: nn.Module) -> list[tuple[str, int]]:
    """(path, number of blocks) of every container of >= 2 children of one class."""
    found = []
    for path, module in model.named_modules():
        children = list(module.children())
        if len(children) < 2 or not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        if len({type(c) for c in children}) == 1:
            found.append((path, len(children)))
    return found


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def resolve_blocks(model: nn.Module, blocks: str | None) -> tuple[str, list[str], list[nn.Module]]:
    """-> (container path, block names, block modules) in call order."""
    candidates = candidate_containers(model)
    listing = ", ".join(f"{p or '<root>'!r} ({n} blocks)" for p, n in candidates) or "none"
    if blocks is None:
        if not candidates:
            raise ValueError(
                f"{type(model).__name__} has no container (nn.ModuleList or nn.Sequential) of two or more blocks of "
                "one class, so there is no chain to checkpoint automatically. Pass blocks='path.to.container' "
                "naming the ordered container of your repeated blocks."
            )
        path = max(candidates, key=lambda c: (c[1], _param_count(model.get_submodule(c[0]))))[0]
    else:
        if not isinstance(blocks, str) or not blocks.strip():
            raise ValueError(f"blocks={blocks!r} must be a dotted path such as 'encoder.layers' or None to auto-detect.")
        path = blocks.strip()
        try:
            container = model.get_submodule(path)
        except AttributeError:
            raise ValueError(
                f"blocks={blocks!r} is not a submodule of {type(model).__name__}; containers of repeated blocks "
                f"found: {listing}. Pass one of those paths, or None to pick the largest."
            ) from None
        if len(list(container.children())) < 1:
            raise ValueError(
                f"blocks={blocks!r} names a {type(container).__name__} without child modules; it must name the "
                f"container that holds the blocks in call order. Candidates found: {listing}."
            )
    container = model.get_submodule(path)
    names = [f"{path}.{n}" if path else n for n, _ in container.named_children()]
    return path, names, list(container.children())
