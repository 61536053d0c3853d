"""Find the ordered chain of blocks to plan over.

`blocks` is a dotted path to a container of blocks (`"encoder.layers"`); or a list
of dotted paths and glob patterns (`["stem", "layer1.*", "head"]`, where `*` stays
within one path component) naming a chain of modules of any classes, in call
order; or None to pick the largest container whose children all share one class
(ties: the one with more parameters). Unknown paths get an error that lists the
candidates; so does a string that names one block (children of different classes)
rather than their container. Names leave out the `_orig_mod` of `torch.compile` wrappers (either form is accepted).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

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


def _uncompiled(module: nn.Module) -> nn.Module:
    """A compiled module's original: the blocks of a compiled container are the original's children."""
    while "_orig_mod" in module._modules:
        module = module._modules["_orig_mod"]
    return module


def _is_container(module: nn.Module) -> bool:
    """An nn.ModuleList / nn.Sequential, or a module whose children all share one class."""
    return isinstance(module, (nn.ModuleList, nn.Sequential)) or len({type(c) for c in module.children()}) <= 1


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _match(pattern: str, name: str) -> bool:
    """Glob match component by component: `layer1.*` matches `layer1.0`, not `layer1.0.conv`."""
    pp, nn_ = pattern.split("."), name.split(".")
    return len(pp) == len(nn_) and all(fnmatch.fnmatchcase(n, p) for p, n in zip(pp, nn_))


def plain_name(name: str) -> str:
    """`name` without the `_orig_mod` components that `torch.compile` wrappers add."""
    return ".".join(p for p in name.split(".") if p != "_orig_mod")


def resolve_chain(model: nn.Module, patterns: Sequence[str]) -> tuple[list[str], list[nn.Module]]:
    """Modules named by dotted paths / glob patterns, in the order given."""
    # a compiled module and the original inside it are one block: keep the wrapper, by its plain name
    named = [(plain_name(n), m) for n, m in model.named_modules() if n and n.split(".")[-1] != "_orig_mod"]
    names: list[str] = []
    for pat in patterns:
        if not isinstance(pat, str) or not pat.strip():
            raise ValueError(f"blocks entry {pat!r} must be a non-empty dotted path or glob pattern such as 'layer1.*'.")
        hits = [n for n, _ in named if _match(plain_name(pat.strip()), n)]
        if not hits:
            listing = ", ".join(repr(n) for n, _ in named if "." not in n) or "none"
            raise ValueError(
                f"blocks entry {pat!r} matches no submodule of {type(model).__name__}; its top-level modules are "
                f"{listing}. Use dotted paths such as 'layer1.0' or patterns such as 'layer1.*'."
            )
        for n in hits:
            if n in names:
                raise ValueError(f"module {n!r} is named twice in blocks (by {pat!r}); list each block once.")
            names.append(n)
    for a in names:
        for b in names:
            if b.startswith(a + "."):
                raise ValueError(
                    f"blocks names both {a!r} and its submodule {b!r}; blocks must not nest. Keep one of them."
                )
    lookup = dict(named)
    return names, [lookup[n] for n in names]


def resolve_blocks(model: nn.Module, blocks: str | Sequence[str] | None) -> tuple[str, list[str], list[nn.Module]]:
    """-> (container path, block names, block modules) in call order."""
    if blocks is not None and not isinstance(blocks, str):
        patterns = list(blocks)
        if not patterns:
            raise ValueError("blocks=[] names no modules; give dotted paths or glob patterns, or None to auto-detect.")
        names, modules = resolve_chain(model, patterns)
        return "", names, modules
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
            container = _uncompiled(model.get_submodule(path))
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
        if not _is_container(container):
            classes = ", ".join(dict.fromkeys(type(c).__name__ for c in container.children()))
            parent = path.rpartition(".")[0]
            siblings = (
                f"or blocks={parent!r} to plan over it and its siblings"
                if parent and _is_container(_uncompiled(model.get_submodule(parent)))
                else "or the path of the container of the blocks" + (f", one of {listing}" if candidates else "")
            )
            raise ValueError(
                f"blocks={blocks!r} names one {type(container).__name__}, whose children are of different classes "
                f"({classes}): a string names the container of the blocks (an nn.ModuleList, an nn.Sequential or "
                f"a module whose children share one class), not a block. Write blocks=[{path!r}] (a one-element "
                f"list) to checkpoint that module alone, {siblings}."
            )
    container = _uncompiled(model.get_submodule(path))  # a `torch.compile` wrapper passes attribute lookups on
    path = plain_name(path)
    names = [f"{path}.{n}" if path else n for n, _ in container.named_children()]
    return path, names, list(container.children())
