"""Apply a plan in a form `torch.compile` traces: each checkpointed block's forward runs through
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`, which dynamo turns into its checkpoint
higher-order op, so a compiled model keeps one graph with the regions inside it. Compiled code cannot
run a region of several blocks from hooks, so every checkpointed block is a region of its own here.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_ckpt.apply.segments import AppliedPlan
from lightning_ckpt.apply.state_guard import StateGuard
from lightning_ckpt.profiling.forward_state.applied_marks import mark, refuse_marked

__all__ = [
    "CompiledRegion",
    "apply_compiled_segments",
    "compiled_modules",
    "eager_only",
    "one_block_segments",
    "traced_module",
]


def traced_module(module: nn.Module) -> nn.Module:
    """The module whose code runs: the original inside a `torch.compile` wrapper (`_orig_mod`)."""
    while isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        module = module._orig_mod
    return module


def _is_compiled(module: nn.Module) -> bool:
    return isinstance(module, torch._dynamo.eval_frame.OptimizedModule) or (
        getattr(module, "_compiled_call_impl", None) is not None  # `module.compile()` in place
    )


def compiled_modules(root: nn.Module, blocks: Sequence[nn.Module]) -> list[str]:
    """Names of the compiled modules (`torch.compile(m)` or `m.compile()`) that run any of `blocks`."""
    targets = {id(traced_module(b)) for b in blocks} | {id(b) for b in blocks}
    found = []
    for name, module in root.named_modules(remove_duplicate=False):
        if not _is_compiled(module):
            continue
        if any(id(m) in targets for m in module.modules()):
            found.append(name or "<root>")
    return found


@contextlib.contextmanager
def eager_only() -> Iterator[None]:
    """Run what is inside without dynamo: compiled functions run their original code and dynamo
    neither compiles nor marks anything, so nothing of it is left in the compile caches."""
    with torch.compiler.set_stance("force_eager"):
        yield


def one_block_segments(segments: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Every block of every segment as a segment of its own (the form compiled code runs)."""
    return [(i, i) for a, b in segments for i in range(a, b + 1)]


def _traced_body(region: "CompiledRegion", fn: Any, *args: Any, **kwargs: Any) -> Any:
    """The region's body under compile: traced by dynamo; run eagerly only when dynamo gave up on it."""
    if not torch.compiler.is_compiling():
        region.ran_eagerly()
    return fn(*args, **kwargs)


class CompiledRegion:
    """Set as a block's `forward`: the block's own forward under non-reentrant checkpoint.

    Traced by dynamo (a checkpoint higher-order op; inductor saves the block's input and
    recomputes the rest in the backward graph). Run eagerly it is torch's checkpoint with RNG
    state preserved and the recompute run on the module state the forward saw (`StateGuard`), as the
    hook-based regions do.
    A small class, not a closure, so `copy.deepcopy` and pickling keep working.
    """

    def __init__(self, module: nn.Module, name: str, guard_batchnorm: bool, warn_eager: bool) -> None:
        self.module = module
        self.name = name
        self.guard_batchnorm = guard_batchnorm
        self.warn_eager = warn_eager
        self.previous = module.__dict__.get("forward")  # an instance `forward` set before ours
        # the state the block's forward writes, found at its first eager forward (`state_guard`)
        self.state_guard = StateGuard([module]) if guard_batchnorm else None

    def _context_fn(self) -> tuple[Any, Any]:
        if self.state_guard is None:
            return contextlib.nullcontext(), contextlib.nullcontext()
        return self.state_guard.contexts()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fn = self.previous if self.previous is not None else functools.partial(type(self.module).forward, self.module)
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        if torch.compiler.is_compiling():
            # under dynamo a custom `context_fn` means selective checkpointing: leave it out. The
            # recompute is the backward graph's, which never writes BatchNorm buffers again.
            body = functools.partial(_traced_body, self, fn)
            return checkpoint(body, *args, use_reentrant=False, **kwargs)
        self.ran_eagerly()
        return checkpoint(fn, *args, use_reentrant=False, context_fn=self._context_fn, **kwargs)

    def ran_eagerly(self) -> None:
        """Warn once when the model is compiled but this region runs eagerly."""
        if not self.warn_eager:
            return
        self.warn_eager = False
        warnings.warn(
            f"lightning-ckpt: checkpointed block {self.name!r} ran eagerly although the model is compiled: "
            "dynamo could not trace it as a checkpoint region (a graph break inside the block), so torch runs "
            "that code eagerly and a recompute may update BatchNorm statistics again. Find the break with "
            "torch._dynamo.explain(model)(batch) and remove it, or leave that block out of `blocks`.",
            stacklevel=3,
        )

    def attach(self) -> None:
        self.module.forward = self  # a plain attribute: module tree and state_dict keys unchanged

    def detach(self) -> None:
        if self.module.__dict__.get("forward") is not self:
            return
        if self.previous is not None:
            self.module.forward = self.previous
        else:
            del self.module.forward


def apply_compiled_segments(
    blocks: Sequence[nn.Module],
    segments: Sequence[tuple[int, int]],
    names: Sequence[str] | None = None,
    guard_batchnorm: bool = True,
    warn_eager: bool = False,
) -> AppliedPlan:
    """Checkpoint every block of `segments`, each as its own region; returns an undo handle.

    `names` label the blocks in the warning given when a region runs eagerly under compile
    (`warn_eager`).
    """
    from lightning_ckpt.planning.memory_model import validate_segments

    spans = one_block_segments(validate_segments(len(blocks), segments))
    chosen = [blocks[i] for i, _ in spans]
    refuse_marked(chosen, None, "apply a plan")
    regions = []
    for i, _ in spans:
        region = CompiledRegion(
            traced_module(blocks[i]), names[i] if names else f"block {i}", guard_batchnorm, warn_eager
        )
        region.attach()
        regions.append(region)
    mark(chosen, True)
    return AppliedPlan(regions, spans, marked_blocks=chosen)
