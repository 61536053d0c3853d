"""Does a block's first argument carry the previous block's output? The test behind multi-block segments.

A checkpointed segment is rebuilt by feeding each block's output straight to the next
block, so blocks may share a segment only if, in the real forward, each one received the
previous block's output: the same tensor object, or an alias of it that identity autograd
Functions (as DeepSpeed ZeRO-3 inserts around every module) put in between.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["receives_output", "tensor_version"]


def tensor_version(t: torch.Tensor | None) -> int | None:
    """The version counter of `t` (bumped by every in-place write), or None where it has none."""
    if t is None:
        return None
    try:
        return t._version
    except RuntimeError:  # inference-mode tensors keep no version counter
        return None


def receives_output(arg: Any, output: torch.Tensor | None, output_version: int | None = None) -> bool:
    """True if `arg` (the next block's first argument) is `output` (the previous block's), unchanged.

    `output` must still be referenced by the caller, so that its memory cannot have been
    freed and handed to another tensor; `output_version` is `tensor_version(output)` taken
    when the block returned it, to catch an in-place write between the two blocks (the
    rebuilt segment would pass the unwritten output on).

    The rule. Under ZeRO stage 3 no block receives the previous block's output object:
    DeepSpeed's `DeepSpeedZeRoOffload._register_deepspeed_module`
    (deepspeed/runtime/zero/parameter_offload.py) puts on every module a forward hook,
    `_pre_backward_module_hook`, that replaces the module's output by
    `apply_to_tensors_only(PreBackwardFunctionForModule.apply, output)`, and a forward
    pre-hook, `_post_backward_module_hook`, that replaces its inputs the same way with
    `PostBackwardFunctionModule` (`apply_to_tensors_only` is in deepspeed/runtime/zero/utils.py).
    Both Functions return `x.detach()` from `forward` and hand the gradient back unchanged
    from `backward`; they only count and fire DeepSpeed's gather and release. So block i+1
    gets a new tensor on the same storage, with the same storage offset, sizes, strides,
    dtype and device, that requires grad exactly when block i's output does. That is the
    rule here: the same object, or a tensor equal to `output` in all of those. Without
    grad there is no graph to follow (a frozen block's output has no `grad_fn`), so the
    rule reads the tensors, not the autograd graph.

    Why this is enough for the recompute: non-reentrant checkpointing takes only the values
    of the tensors the recompute saves; gradients flow through the graph of the real
    forward. Same storage and layout (and no in-place write since) means the same values,
    and the same `requires_grad` means the recompute saves the same tensors. A copy (`x.clone()`,
    `x + 0`) has its own storage, a `detach()` drops `requires_grad`, a transpose changes
    strides, a slice the offset or sizes: none of them counts.
    """
    if not isinstance(arg, torch.Tensor) or not isinstance(output, torch.Tensor):
        return False
    if output_version is not None and tensor_version(arg) != output_version:
        return False  # written in place since the previous block returned it (aliases share the counter)
    if arg is output:
        return True
    if arg.layout != torch.strided or output.layout != torch.strided:
        return False
    if (
        arg.device != output.device
        or arg.dtype != output.dtype
        or arg.shape != output.shape
        or arg.stride() != output.stride()
        or arg.storage_offset() != output.storage_offset()
        or arg.requires_grad != output.requires_grad
        or arg.is_conj() != output.is_conj()  # a conj or neg view reads the same memory as other values
        or arg.is_neg() != output.is_neg()
    ):
        return False
    try:
        mine, theirs = arg.untyped_storage(), output.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensor subclasses and wrappers without a storage
        return False
    if output.device.type == "meta" or theirs.nbytes() == 0:
        return False  # no memory, so no address to compare: only the object itself counts
    return mine.data_ptr() == theirs.data_ptr()
