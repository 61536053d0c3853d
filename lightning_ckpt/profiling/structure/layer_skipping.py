"""LayerDrop: where a model may skip whole layers in training, a context in which every layer runs (for
profiling the worst-case step) with the model's random draws unchanged, and the note that tells users
why their plan then checkpoints each block on its own."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from numbers import Real
from typing import Any

from torch import nn

# `layerdrop`, `encoder_layerdrop`, `speech_encoder_layerdrop`, `layer_drop` (ESM's config); not
# `layer_dropout` (a drop-path rate) nor other dropouts.
_NAME = re.compile(r"layer_?drop(?!out)", re.IGNORECASE)

# The probability set while every layer must run. Not 0.0: HF models draw only under
# `if self.training and self.layerdrop > 0.0:`, so 0.0 would also drop their `torch.rand([])` calls and
# move the global random stream. The smallest positive float keeps that test true (the draw happens)
# while `draw < p` is False for every float32 draw (p is 0.0 in float32); only a draw of exactly 0.0
# could still skip where a model compares in float64 or with `<=` (odds 2**-53 or 2**-24 a draw).
ALWAYS_RUN_PROBABILITY = math.ulp(0.0)


@dataclass(frozen=True)
class LayerSkipping:
    """`owner.attribute = probability` skips layers in training: `owner` is the module path (`""` for
    the root), or that path with `.config` (`"config"` for the root's) for an attribute of its config."""

    owner: str
    attribute: str
    probability: float

    @property
    def name(self) -> str:
        return f"{self.owner}.{self.attribute}" if self.owner else self.attribute


def _is_probability(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and value > ALWAYS_RUN_PROBABILITY


def _config_of(module: nn.Module) -> Any:
    """The module's `config` object if it has attributes to read (a HF config or any plain object)."""
    cfg = module.__dict__.get("config")
    if cfg is None or isinstance(cfg, (nn.Module, dict, str, bytes, Real)):
        return None
    return cfg if hasattr(cfg, "__dict__") else None


def _holders(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """(owner, object) for every module of the tree and every distinct config they hold, in tree order."""
    seen: set[int] = set()
    for path, module in model.named_modules():
        yield path, module
        cfg = _config_of(module)
        if cfg is not None and id(cfg) not in seen:
            seen.add(id(cfg))
            yield (f"{path}.config" if path else "config"), cfg


def _settings(model: nn.Module) -> list[tuple[Any, LayerSkipping]]:
    found = []
    for owner, holder in _holders(model):
        for key, value in list(vars(holder).items()):
            if _NAME.search(key) and _is_probability(value):
                found.append((holder, LayerSkipping(owner, key, float(value))))
    return found


def find_layer_skipping(model: nn.Module) -> tuple[LayerSkipping, ...]:
    """Every LayerDrop probability above 0 in the tree: attributes of modules, and of the configs they
    hold, whose name says `layerdrop` / `layer_drop` (HF copies `encoder_layerdrop` into a layer stack's
    `self.layerdrop` at init; the Wav2Vec2 family reads `config.layerdrop` at each forward). A config
    shared by several modules is listed once, under the first module that holds it. Inside
    `layers_always_run` nothing is found."""
    return tuple(entry for _, entry in _settings(model))


@contextmanager
def layers_always_run(model: nn.Module) -> Iterator[tuple[LayerSkipping, ...]]:
    """Inside, every LayerDrop probability of the tree is `ALWAYS_RUN_PROBABILITY`, so in training every
    layer runs while the model draws the same random numbers as with LayerDrop on; on exit (also on an
    exception) each attribute gets back its original object (value and type). Yields what it changed;
    nested use changes nothing more."""
    settings = _settings(model)
    originals = [(holder, entry.attribute, getattr(holder, entry.attribute)) for holder, entry in settings]
    changed: list[tuple[Any, str, Any]] = []
    try:
        for holder, key, value in originals:
            try:
                setattr(holder, key, ALWAYS_RUN_PROBABILITY)
            except Exception as error:
                raise TypeError(
                    f"cannot set {type(holder).__name__}.{key} (now {value!r}) to turn LayerDrop off while "
                    f"profiling: {error}; set it to 0.0 before training, or make it writable"
                ) from error
            changed.append((holder, key, value))
        yield tuple(entry for _, entry in settings)
    finally:
        for holder, key, value in reversed(changed):
            setattr(holder, key, value)


def layer_skipping_note(found: tuple[LayerSkipping, ...] | list[LayerSkipping]) -> str:
    """One sentence for users: which settings skip layers, what the plan does about it, how to opt out."""
    if not found:
        return ""
    names = ", ".join(f"{entry.name}={entry.probability:g}" for entry in found)
    # a module attribute is what the forward reads; a config value may only have been copied at init
    example = next((e for e in found if not e.owner.endswith("config")), found[0])
    return (
        f"LayerDrop is on ({names}): blocks may be skipped at random in training, so the plan checkpoints "
        f"each block on its own (no segment spans several blocks); to allow multi-block segments, set "
        f"{'each of these' if len(found) > 1 else 'it'} to 0.0 before training (for example "
        f"{example.name}=0.0)."
    )
