"""Make a model's forward repeatable before it is profiled and checkpointed, and put it back after.

    prepared = prepare_model(model, keep_hf_checkpointing=False, warn=None)   # before profiling
    prepared.may_apply       # False when HF's own checkpointing stays in charge: apply no plan
    prepared.restore()       # when the fit ends (or `with prepare_model(model) as prepared:`)

`prepare_model` sets `use_cache=False` in every HF config of the tree (`module.config`, through peft's
wrappers, sub-configs) that has `use_cache=True`, whatever its `is_decoder` says (GPT-NeoX's is False and
its forward fills a cache; an encoder that ignores the flag loses nothing): the cache grows on every call, so a recompute sees other shapes (torch's "different
number of tensors" error, or a shape error) and the cache keeps each step's keys and values alive. It
turns HF's (and diffusers') own activation checkpointing off through the model's disable method; `restore`
puts back each module's flag and checkpoint function (so the kwargs, `every_n_layers` and offloading
come back) and the input embeddings' require-grad hook. What it can only report (`Prepared.hazards`)
comes from `profiling.forward_state.forward_hazards.static_hazards`.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lightning_ckpt.profiling.forward_state.forward_hazards import static_hazards
from lightning_ckpt.profiling.structure.model_configs import configs_phrase, fills_cache, hf_configs, module_label

__all__ = ["ModelCompatWarning", "Prepared", "prepare_model"]

_DISABLE_METHODS = ("activation_checkpointing_disable", "gradient_checkpointing_disable", "disable_gradient_checkpointing")
_MISSING = object()


class ModelCompatWarning(UserWarning):
    """lightning-ckpt changed a setting of the model for the fit (it is set back at the end)."""


def _flag_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(p, m) for p, m in model.named_modules() if isinstance(m.__dict__.get("gradient_checkpointing"), bool)]


def _describe_checkpointing(flagged: list[tuple[str, nn.Module]]) -> str:
    """`every layer, use_reentrant=False` or `3 of 6 layers, ...`, from the flags and checkpoint function."""
    mods = [m for _, m in flagged]
    layers = [m for m in mods if any(c.__name__ == "GradientCheckpointingLayer" for c in type(m).__mro__)] or mods
    on = [m for m in layers if m.gradient_checkpointing]
    parts = ["every layer" if len(on) == len(layers) else f"{len(on)} of {len(layers)} layers"]
    func = next((m.__dict__.get("_gradient_checkpointing_func") for m in mods if m.gradient_checkpointing), None)
    inner = func.func if isinstance(func, functools.partial) else func
    if isinstance(func, functools.partial) and func.keywords:
        parts.append(", ".join(f"{k}={v!r}" for k, v in func.keywords.items()))
    if "save_on_cpu" in getattr(getattr(inner, "__code__", None), "co_names", ()):
        parts.append("saved activations offloaded to the CPU")
    elif inner is not None and inner is not torch.utils.checkpoint.checkpoint:
        parts.append(f"through {getattr(inner, '__qualname__', 'a custom checkpoint function')}")
    return ", ".join(parts)


def _owners(model: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(path, module, disable method) of the outermost modules whose class has a disable method."""
    owners: list[tuple[str, nn.Module, str]] = []
    for path, module in model.named_modules():
        if any(path == p or path.startswith(p + ".") or not p for p, _, _ in owners):
            continue
        method = next((n for n in _DISABLE_METHODS if callable(getattr(type(module), n, None))), None)
        if method is not None and any(isinstance(m.__dict__.get("gradient_checkpointing"), bool) for m in module.modules()):
            owners.append((path, module, method))
    return owners


@dataclass
class Prepared:
    """What `prepare_model` changed and found. `restore()` undoes the changes (once; idempotent).

    `use_cache_off`: where `use_cache` was turned off. `hf_checkpointing`: HF's own checkpointing as found
    (a description) or None. `hf_checkpointing_kept`: left on (`keep_hf_checkpointing=True`); then
    `may_apply` is False and a plan must not be applied on top. `hazards`: what it can only report.
    `messages`: the warnings it gave."""

    use_cache_off: tuple[str, ...] = ()
    hf_checkpointing: str | None = None
    hf_checkpointing_kept: bool = False
    hazards: tuple[str, ...] = ()
    messages: tuple[str, ...] = ()
    _undo: list[Callable[[], None]] = field(default_factory=list, repr=False)

    @property
    def may_apply(self) -> bool:
        """Whether a lightning-ckpt plan may be applied (not when HF's checkpointing stays on)."""
        return not self.hf_checkpointing_kept

    @property
    def restored(self) -> bool:
        return not self._undo

    def restore(self) -> None:
        """Put every changed setting back as it was, last change first."""
        while self._undo:
            self._undo.pop()()

    def __enter__(self) -> "Prepared":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.restore()


def _warn(message: str) -> None:
    warnings.warn(message, ModelCompatWarning, stacklevel=3)


def prepare_model(
    model: nn.Module, *, keep_hf_checkpointing: bool = False, warn: Callable[[str], None] | None = None
) -> Prepared:
    """Make `model`'s forward repeatable for training with lightning-ckpt; see the module docstring.

    At most one warning for the caches and one for HF's checkpointing, through `warn` (default:
    `warnings.warn` with `ModelCompatWarning`; a Lightning front end passes `rank_zero_warn`)."""
    warn = warn or _warn
    configs = hf_configs(model)
    undo: list[Callable[[], None]] = []
    messages: list[str] = []

    cached = [(where, cfg) for where, cfg in configs if fills_cache(cfg)]
    for _, cfg in cached:
        cfg.use_cache = False
        undo.append(functools.partial(setattr, cfg, "use_cache", True))
    if cached:
        messages.append(
            f"lightning-ckpt: set use_cache=False for training in {configs_phrase([w for w, _ in cached])}: with "
            "use_cache=True the forward may fill a key/value cache that every call extends, so the recompute of a "
            "checkpointed block sees longer keys than its forward did (torch's 'different number of tensors was saved' "
            "CheckpointError or a shape error in backward) and the cache keeps each step's keys and values alive. HF's "
            "own gradient checkpointing turns it off for the same reason. It is set back to True when the fit ends."
        )

    flagged, owners = _flag_modules(model), _owners(model)
    described = _describe_checkpointing(flagged) if any(m.gradient_checkpointing for _, m in flagged) else None
    kept = bool(described) and keep_hf_checkpointing
    whose = ", ".join(module_label(path, owner) for path, owner, _ in owners) or type(model).__name__
    if described and kept:
        messages.append(
            f"lightning-ckpt: HF activation checkpointing is on in {whose} ({described}) and stays in charge "
            "(keep_hf_checkpointing=True): lightning-ckpt profiles and reports but applies no plan of its own."
        )
    elif described:
        undo.extend(_disable_hf_checkpointing(flagged, owners))
        messages.append(
            f"lightning-ckpt: HF activation checkpointing was on in {whose} ({described}); it is turned off for "
            "this fit, where lightning-ckpt plans which blocks to checkpoint, and turned back on as it was when the "
            "fit ends. Pass keep_hf_checkpointing=True to leave HF's in charge (then no plan is applied)."
        )
    for message in messages:
        warn(message)
    return Prepared(
        use_cache_off=tuple(w for w, _ in cached), hf_checkpointing=described, hf_checkpointing_kept=kept,
        hazards=tuple(static_hazards(model, configs)), messages=tuple(messages), _undo=undo,
    )


def _disable_hf_checkpointing(
    flagged: list[tuple[str, nn.Module]], owners: list[tuple[str, nn.Module, str]]
) -> list[Callable[[], None]]:
    """Turn the flags off through the owners' own methods; return the undo steps."""
    saved = [(m, m.gradient_checkpointing, m.__dict__.get("_gradient_checkpointing_func", _MISSING)) for _, m in flagged]
    hooks = [(o, list(getattr(o, "_require_grads_hooks", None) or ())) for _, o, _ in owners]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # transformers 5 deprecates the gradient_* names
        for _, owner, method in owners:
            getattr(owner, method)()
    for _, module in flagged:  # a flag no owner's method reaches
        module.gradient_checkpointing = False

    def put_back() -> None:
        for module, flag, func in saved:
            module.gradient_checkpointing = flag
            if func is not _MISSING:
                module._gradient_checkpointing_func = func
        for owner, before in hooks:
            if before and not getattr(owner, "_require_grads_hooks", None):
                owner.enable_input_require_grads()  # HF's disable removed the input embeddings' hook

    return [put_back]
