"""Errors raised in a recompute, explained: torch's `CheckpointError` (or any error raised inside a
checkpointed block's recompute) becomes a `RecomputeMismatchError` that names the block, the likely
cause and the fix.

    explain_checkpoint_error(err, model=None) -> BaseException   # torch's CheckpointError made clear
    explained_checkpoint_errors(model=None)                      # the same, as a context manager
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.utils.checkpoint import CheckpointError

from lightning_ckpt.profiling.structure.model_configs import configs_phrase, fills_cache, hf_configs, module_label


class RecomputeMismatchError(CheckpointError):
    """The recompute of a checkpointed block did not repeat its forward."""


def _recompute_frames(err: BaseException) -> list[Any] | None:
    """The frames below torch's recompute, innermost last; None when `err` was not raised in one."""
    tb, frames, inside = err.__traceback__, [], False
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "recompute_fn" and code.co_filename.replace("\\", "/").endswith("torch/utils/checkpoint.py"):
            inside, frames = True, []
        elif inside:
            frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames if inside else None


def _module_of(frames: list[Any], model: nn.Module | None) -> str | None:
    """The outermost module whose forward ran under the recompute, by name when `model` holds it."""
    for frame in frames:
        module = frame.f_locals.get("self")
        if isinstance(module, nn.Module) and frame.f_code.co_name == "forward":
            if model is not None:
                for path, m in model.named_modules():
                    if m is module:
                        return module_label(path, m)
            return type(module).__name__
    return None


def explain_checkpoint_error(err: BaseException, model: nn.Module | None = None) -> BaseException:
    """A `RecomputeMismatchError` (a CheckpointError) naming the likely cause and the fix, for torch's
    CheckpointError or any error raised inside a recompute; any other error is returned unchanged.
    With `model`, its HF configs that still have `use_cache=True` are named."""
    if isinstance(err, RecomputeMismatchError):
        return err
    frames = _recompute_frames(err)
    if not isinstance(err, CheckpointError) and frames is None:
        return err
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    where = _module_of(frames or [], model)
    what = f"the recompute of a checkpointed block{f' ({where})' if where else ''} did not repeat its forward ({first})"
    if "already unpacked once" in str(err):
        causes = [
            "a backward ran twice through the same checkpointed region (retain_graph=True, or a second loss backward "
            "through the same forward) or a custom autograd Function reads ctx.saved_tensors twice; fix: keep those "
            "blocks (do not checkpoint them) or run one backward per forward"
        ]
    else:
        causes = []
        cached = [w for w, cfg in (hf_configs(model) if model is not None else []) if fills_cache(cfg)]
        if cached:
            causes.append(
                f"use_cache=True in {configs_phrase(cached)}: the forward may fill a key/value cache that the recompute "
                "extends again; fix: call lightning_ckpt.prepare_model(model) before training (it turns "
                "use_cache off for the fit), or set config.use_cache = False"
            )
        elif model is None:
            causes.append(
                "a cache the forward fills (HF models with config.use_cache=True: every call extends the key/value "
                "cache); fix: prepare_model(model) before training, or set config.use_cache = False"
            )
        causes.append(
            "a forward that differs between runs: it reads or changes Python state (a counter, a flag set on the "
            "first call, Python's `random`), or tensors it stored on a module; fix: make the block depend only on its "
            "inputs, parameters and torch's RNG, or keep that block (forward_hazards(model, run) lists such state)"
        )
        causes.append(
            "a global module hook (torch.nn.modules.module.register_module_forward_pre_hook) that makes tensors or "
            "changes the arguments: it runs before a checkpointed segment opens in the forward but inside it in the "
            "recompute (a hook on the block module itself runs inside the segment both times); fix: register it on "
            "the modules with module.register_forward_pre_hook"
        )
    lines = [what + "."] + [f"Likely cause {i}: {c}." for i, c in enumerate(causes, 1)]
    new = RecomputeMismatchError("\n".join(lines))
    new.__cause__ = err
    return new


@contextlib.contextmanager
def explained_checkpoint_errors(model: nn.Module | None = None) -> Iterator[None]:
    """Re-raise what `explain_checkpoint_error` turns into a `RecomputeMismatchError`; others pass through."""
    try:
        yield
    except Exception as err:
        explained = explain_checkpoint_error(err, model)
        if explained is err:
            raise
        raise explained from err
