"""The HF configs of a model, read by duck type (no transformers import): which configs the tree holds
(through wrappers and sub-configs), which of them fill a key/value cache, and how to name them and
the modules that hold them in a message."""

from __future__ import annotations

from typing import Any

from torch import nn


def module_label(path: str, module: nn.Module) -> str:
    return f"{type(module).__name__} at {path!r}" if path else type(module).__name__


def is_hf_config(obj: Any) -> bool:
    """A HF config by duck type: `to_dict` and `model_type` (no transformers import)."""
    return callable(getattr(obj, "to_dict", None)) and hasattr(obj, "model_type")


def hf_configs(model: nn.Module) -> list[tuple[str, Any]]:
    """(whose, config) for every distinct HF config of the tree and their sub-configs; a module's own
    `config` names it before a wrapper that forwards attribute lookups to it (peft's)."""
    found: dict[int, tuple[str, Any]] = {}

    def add(whose: str, cfg: Any) -> None:
        if id(cfg) in found:
            return
        found[id(cfg)] = (whose, cfg)
        for key, value in list(vars(cfg).items()):
            if is_hf_config(value):
                add(f"{whose} ({key})", value)

    modules = list(model.named_modules())
    for path, module in modules:
        if is_hf_config(module.__dict__.get("config")):
            add(module_label(path, module), module.__dict__["config"])
    for path, module in modules:
        try:
            cfg = getattr(module, "config", None)
        except Exception:  # a property that fails on a partly built module
            continue
        if is_hf_config(cfg):
            add(module_label(path, module), cfg)
    return list(found.values())


def fills_cache(cfg: Any) -> bool:
    """`use_cache=True` in the config: its forward may fill a key/value cache. `is_decoder` does not say
    whether it does (GPT-NeoX's config has `is_decoder=False` and its forward fills one), so any config
    that asks for a cache counts; one whose forward ignores the flag (a BERT-style encoder) loses nothing."""
    return getattr(cfg, "use_cache", None) is True


def configs_phrase(names: list[str]) -> str:
    return ("the HF config of " if len(names) == 1 else "the HF configs of ") + ", ".join(names)
