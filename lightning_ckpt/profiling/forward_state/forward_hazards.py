"""What in a model's forward a recompute would repeat or that keeps tensors alive, found without
changing it.

    static_hazards(model, configs) -> list[str]      # read off the model: output_* flags, LayerDrop, spectral norm
    forward_hazards(model, run) -> tuple[str, ...]   # run a forward, report the state it changed (then put back)
    live_bytes_per_step(step, n_steps) -> tuple[int, ...]   # live bytes growing step to step
    PythonStateWatch(n_blocks)                       # per block: Python state its forward writes

`static_hazards` reports `output_attentions` / `output_hidden_states` (every layer's maps or outputs
stay alive to the loss), LayerDrop (`layer_skipping`: plans then checkpoint each block alone) and spectral
norm (its power iteration updates buffers again in a recompute). `forward_hazards` finds buffers
written in place outside normalization layers (whose statistics the apply stage guards), Python
attributes that change, and tensors kept on modules (alive past their block, so never freed).
"""

from __future__ import annotations

import gc
import random
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_ckpt.profiling.structure.layer_skipping import find_layer_skipping, layer_skipping_note
from lightning_ckpt.profiling.structure.model_configs import configs_phrase, module_label
from lightning_ckpt.profiling.memory.tracker import LiveBytesTracker

_MODULE_DICTS = ("_parameters", "_buffers", "_modules")




def static_hazards(model: nn.Module, configs: list[tuple[str, Any]]) -> list[str]:
    found = []
    for where, cfg in configs:
        for key, what in (("output_attentions", "attention maps"), ("output_hidden_states", "outputs")):
            if getattr(cfg, key, False) is True:
                found.append(f"{key}=True in {configs_phrase([where])}: the forward returns every layer's {what}, which "
                             "stay alive to the loss, so checkpointing frees less than planned; set it False for "
                             "training unless the loss needs them")
    note = layer_skipping_note(find_layer_skipping(model))
    if note:
        found.append(note.rstrip("."))
    return found


_PLAIN_TYPES = frozenset({bool, int, float, str, type(None)})  # (most attributes: one look-up, no isinstance)


def _plain(value: Any) -> bool:
    if type(value) in _PLAIN_TYPES or isinstance(value, (bool, int, float, str, type(None))):
        return True
    return isinstance(value, tuple) and all(_plain(v) for v in value)


def _holds_tensors(value: Any) -> bool:
    items = value.values() if isinstance(value, dict) else value
    return any(isinstance(v, torch.Tensor) for v in items)


def _attributes(module: nn.Module, skip: frozenset[str] | tuple[str, ...] = _MODULE_DICTS) -> dict[str, tuple]:
    attrs: dict[str, tuple] = {}
    for key, value in vars(module).items():
        if key in skip:
            continue
        found = _attribute(value)
        if found is not None:
            attrs[key] = found
    return attrs


def _attribute(value: Any) -> tuple | None:
    """How `_attributes` keeps one value: by value, by object, by length; None: not kept."""
    if _plain(value):
        return ("plain", value)
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value))
    if isinstance(value, (list, dict)):
        return ("container", len(value))
    return None


def _snapshot(module: nn.Module) -> tuple[dict[str, tuple], dict[str, tuple[int, int, torch.Tensor]]]:
    attrs = _attributes(module)
    buffers = {} if isinstance(module, nn.modules.batchnorm._NormBase) else {
        key: (id(buf), buf._version, buf.detach().clone()) for key, buf in module._buffers.items() if buf is not None
    }
    return attrs, buffers


def forward_hazards(model: nn.Module, run: Callable[[], Any]) -> tuple[str, ...]:
    """Call `run()` (one forward of `model`, or a whole step) and report what it changed that a recompute
    would change again or that keeps tensors alive: buffers written in place outside normalization layers,
    plain Python attributes (numbers, strings, flags), tensors and lists or dicts of tensors stored on
    modules. Buffers and Python attributes are put back afterwards; the model's outputs are discarded."""
    before = [(path, module, *_snapshot(module)) for path, module in model.named_modules()]
    try:
        run()
    finally:
        found = []
        for path, module, attrs, buffers in before:
            where = module_label(path, module)
            for key, (id_, version, copy) in buffers.items():
                buf = module._buffers.get(key)
                if buf is not None and (id(buf) != id_ or buf._version != version):
                    found.append(f"{where} writes its buffer {key!r} in its forward: a recompute writes it again "
                                 "(and may compute with the new value); keep this block or make the update idempotent")
                    with torch.no_grad():
                        if id(buf) == id_:
                            buf.copy_(copy)
                        else:
                            module._buffers[key] = copy
            for key, value in vars(module).items():
                kind, old = attrs.get(key, (None, None))
                if kind == "plain" and _plain(value) and old != value:
                    found.append(f"{where} changes its attribute {key!r} in its forward ({old!r} -> {value!r}): a "
                                 "recompute changes it again and may take another path")
                    setattr(module, key, old)
                elif isinstance(value, torch.Tensor) and (kind, old) != ("tensor", id(value)):
                    found.append(f"{where} keeps a tensor in its attribute {key!r}: it stays alive past the block (and "
                                 "the step), so checkpointing cannot free it")
                elif kind == "container" and isinstance(value, (list, dict)) and len(value) != old and _holds_tensors(value):
                    found.append(f"{where} adds tensors to its attribute {key!r} in its forward: they stay alive past the "
                                 "block (and the step), so checkpointing cannot free them")
    return tuple(found)


_MODULE_INTERNALS = frozenset(vars(nn.Module()))  # torch's own (hook tables, `training`): never the user's state
# What strategies' own module hooks keep on a module: DeepSpeed ZeRO-3 counts a module's pending
# gradients and backward passes (`ds_grads_remaining`, `applied_pre_backward_ref_cnt`, ...) in the
# hooks that gather its parameters. Those hooks run again in a recompute by design (DeepSpeed's own
# activation checkpointing relies on it), so these writes are not the model's state.
_STRATEGY_PREFIXES = ("ds_", "_ds_", "__ds")
_STRATEGY_ATTRIBUTES = frozenset({"applied_pre_backward_ref_cnt", "pre_bwd_fn", "post_bwd_fn"})


_NOT_MODEL_STATE = _MODULE_INTERNALS | _STRATEGY_ATTRIBUTES


def _model_state(module: nn.Module) -> dict[str, tuple]:
    """`_attributes` of what the model itself keeps on `module` (not torch's, not a strategy's), less
    its tensors: the numbers, strings, flags and container lengths `PythonStateWatch` compares."""
    attrs: dict[str, tuple] = {}
    for key, value in vars(module).items():  # (`_attributes`, with the other keys skipped first)
        if key in _NOT_MODEL_STATE or key.startswith(_STRATEGY_PREFIXES):
            continue
        if type(value) in _PLAIN_TYPES:  # (what `_attribute` makes of it, without its calls)
            attrs[key] = ("plain", value)
            continue
        found = _attribute(value)
        if found is not None and found[0] != "tensor":
            attrs[key] = found
    return attrs


def _global_draws() -> tuple[Any, Any]:
    """Python's `random` state and NumPy's global state, to compare before and after a forward."""
    try:
        import numpy as np

        state = np.random.get_state()
        np_state = (state[0], state[1].tobytes(), *state[2:])
    except ImportError:  # pragma: no cover
        np_state = None
    return random.getstate(), np_state


_MISSING = object()


class PythonStateWatch:
    """Python state each block's forward writes, which a recompute cannot replay: a number, string or
    flag attribute that changes (it may decide a branch), a list or dict that grows or shrinks (an MoE
    layer appending its router loss), draws from Python's `random` or NumPy's global generator.

    `before(i, block)` as block i's forward starts, `after(i)` as it ends (forward hooks);
    `reasons[i]` then holds one phrase per write, for `BlockCost.unreplayable`."""

    def __init__(self, n_blocks: int) -> None:
        self.reasons: list[set[str]] = [set() for _ in range(n_blocks)]
        self._open: dict[int, tuple] = {}

    def before(self, i: int, block: nn.Module) -> None:
        attrs = [(path, m, _model_state(m)) for path, m in block.named_modules()]
        self._open[i] = (attrs, _global_draws())

    def after(self, i: int) -> None:
        if i not in self._open:
            return
        attrs, (py_rng, np_rng) = self._open.pop(i)
        found = self.reasons[i]
        for path, module, old_attrs in attrs:
            where = f"self.{path}." if path else "self."
            now = vars(module)
            for key, (kind, old) in old_attrs.items():  # (the keys `_model_state` kept: only these are read again)
                value = now.get(key, _MISSING)
                if type(value) in _PLAIN_TYPES:  # (what `_attribute` makes of it, without its calls)
                    new_kind, new = "plain", value
                else:
                    new_kind, new = (None, None) if value is _MISSING else _attribute(value) or (None, None)
                if kind == "plain" and new_kind == "plain" and old != new:
                    found.add(f"writes {where}{key} ({old!r} -> {new!r})")
                elif kind == "container" and new_kind == "container" and old != new:
                    found.add(f"{'adds' if new > old else 'removes'} items of {where}{key} ({old} -> {new})")
        py_now, np_now = _global_draws()
        if py_now != py_rng:
            found.add("draws from Python's random")
        if np_now != np_rng:
            found.add("draws from numpy.random")


def live_bytes_per_step(step: Callable[[int], Any], n_steps: int) -> tuple[int, ...]:
    """Bytes of the tensor storages made from the first call on and still alive after each of `n_steps`
    calls `step(0)`, `step(1)`, ... (counted by `LiveBytesTracker`, after a garbage collection). A training
    step that keeps nothing settles after its first step or two (gradients and optimizer state exist);
    a rise every step means something keeps each step's tensors alive."""
    live = []
    with LiveBytesTracker() as tracker:
        for i in range(n_steps):
            step(i)
            gc.collect()
            live.append(tracker.live_bytes)
    return tuple(live)
