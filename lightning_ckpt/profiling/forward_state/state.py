"""Everything a profiling step may change, put back as it was: RNG streams, buffers (the
same objects, shapes and values), `.grad` and `requires_grad` of every parameter, train/eval
modes, torchmetrics states and modules' Python attributes; and a check that no parameter was
written in place."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import nn


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Restore torch's CPU and CUDA generators, Python's `random` and NumPy's global state on exit."""
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    py_rng = random.getstate()
    try:
        import numpy as np

        np_rng = np.random.get_state()
    except ImportError:  # pragma: no cover
        np_rng = None
    try:
        yield
    finally:
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(py_rng)
        if np_rng is not None:
            import numpy as np

            np.random.set_state(np_rng)


@contextlib.contextmanager
def preserved_state(model: nn.Module) -> Iterator[None]:
    """Restore RNG streams, buffers, `.grad` and `requires_grad` of every parameter, train
    modes, torchmetrics states and the Python attributes of modules on exit; `.grad` is None inside.

    Every buffer goes back as the object it was, under its name (a forward that
    rebinds `self.ema = ...` gets its original tensor back), with its values and shape (a buffer a
    forward resized, as QAT observers resize `min_val` from [0] to [C], is set back with `set_`).
    Everything is put back even when one item fails; then one `StateRestoreError` names each failure."""
    held = _held_tensors(model)
    named = list(model.named_parameters())
    params = [p for _, p in named]
    grads = [p.grad for p in params]
    requires = [p.requires_grad for p in params]
    modules = [(path, m, _is_metric(m)) for path, m in model.named_modules()]  # (`modules()` is this order)
    modes = [(m, m.training) for _, m, _ in modules]
    metrics = [(m, _metric_state(m)) for _, m, metric in modules if metric]
    attrs = [(path, m, _python_attributes(m)) for path, m, metric in modules if not metric]
    with preserved_rng():
        for p in params:
            p.grad = None
        try:
            yield
        finally:
            failed: list[str] = []
            with torch.no_grad():  # (one context for every buffer's copy)
                for item in held:
                    _restore(item, failed)
            for (name, p), g, r in zip(named, grads, requires):
                try:  # (each item restored whatever the others do: failures are reported together)
                    _restore_grad(p, g, r)
                except Exception as err:
                    _failed(failed, name, "grad", err)
            for m, mode in modes:
                m.training = mode
            for path, m, saved in attrs:
                for key, value in saved.items():
                    try:
                        _restore_attribute(m, key, value)
                    except Exception as err:
                        _failed(failed, path or "<model>", key, err)
            for m, state in metrics:
                for k, v in state.items():
                    setattr(m, k, v)
            if failed:
                raise StateRestoreError(
                    f"profiling could not put {len(failed)} item(s) of the model back as they were: "
                    + "; ".join(failed)
                    + ". The others were restored. The model is no longer exactly as before profiling: make these "
                    "buffers or attributes plain tensors the forward writes in place (or re-creates with the same "
                    "shape), or report the failing type."
                )


class StateRestoreError(RuntimeError):
    """Some buffers, parameters or attributes could not be put back after profiling (each one named)."""


class _HeldTensor(NamedTuple):  # (a tuple: made for every buffer of every probe)
    """A buffer as found: where it lives, the object and a copy of its values."""

    module: nn.Module
    path: str
    name: str
    kind: str  # the module's table it lives in: "_buffers"
    obj: torch.Tensor | None
    copy: torch.Tensor | None
    shape: tuple[int, ...] | None


def _held_tensors(model: nn.Module) -> list[_HeldTensor]:
    held = []
    for path, m in model.named_modules(remove_duplicate=False):
        for name, b in m._buffers.items():
            copy = None if b is None else b.detach().clone()
            shape = None if b is None else tuple(b.shape)
            held.append(_HeldTensor(m, path or "<model>", name, "_buffers", b, copy, shape))
    return held


def _failed(failed: list[str], path: str, name: str, err: Exception) -> None:
    failed.append(f"{path}.{name} ({type(err).__name__}: {err})")


def _restore(item: _HeldTensor, failed: list[str]) -> None:
    try:  # (each item restored whatever the others do: failures are reported together)
        _put_back(item)
    except Exception as err:
        _failed(failed, item.path, item.name, err)


def _put_back(item: _HeldTensor) -> None:
    """Put one buffer back; the caller runs it without grad."""
    table = getattr(item.module, item.kind)
    if table.get(item.name) is not item.obj:  # rebound by assignment in forward (or deleted)
        table[item.name] = item.obj
    if item.copy is None:
        return
    if tuple(item.obj.shape) != item.shape:  # resized in forward: take the old shape and values back
        item.obj.set_(item.copy)
    else:
        item.obj.copy_(item.copy)


def _restore_grad(p: torch.Tensor, grad: torch.Tensor | None, requires: bool) -> None:
    p.grad = grad
    if p.requires_grad != requires:
        p.requires_grad_(requires)


_MODULE_INTERNALS = frozenset(vars(nn.Module()))
_PLAIN_TYPES = frozenset({bool, int, float, str, type(None)})  # (most attributes: one look-up, no isinstance)


def _python_attributes(m: nn.Module) -> dict[str, tuple[str, Any]]:
    """A module's own attributes a forward may write: numbers, strings and flags by value, tensors by
    object, lists and dicts by their items (shallow)."""
    saved: dict[str, tuple[str, Any]] = {}
    for key, value in vars(m).items():
        if key in _MODULE_INTERNALS or key.startswith("__"):
            continue
        if type(value) in _PLAIN_TYPES or isinstance(value, (bool, int, float, str, type(None))):
            saved[key] = ("plain", value)
        elif isinstance(value, torch.Tensor):
            saved[key] = ("tensor", value)
        elif type(value) is list:
            saved[key] = ("list", (value, list(value)))
        elif type(value) is dict:
            saved[key] = ("dict", (value, dict(value)))
    return saved


def _restore_attribute(m: nn.Module, key: str, saved: tuple[str, Any]) -> None:
    kind, value = saved
    now = vars(m).get(key, _MISSING)
    if kind in ("plain", "tensor"):
        if now is not value:
            setattr(m, key, value)
    elif kind == "list":
        obj, items = value
        if now is not obj:
            setattr(m, key, obj)
        if len(obj) != len(items) or any(a is not b for a, b in zip(obj, items)):
            obj[:] = items
    else:
        obj, items = value
        if now is not obj:
            setattr(m, key, obj)
        if obj.keys() != items.keys() or any(obj[k] is not v for k, v in items.items()):
            obj.clear()
            obj.update(items)


_MISSING = object()


@contextlib.contextmanager
def unchanged_parameters(model: nn.Module) -> Iterator[None]:
    """Raise on exit when a parameter of `model` was written in place inside (its `_version` moved).

    Parameters are not copied (that would double a large model's memory), so such a write cannot
    be undone, only reported. An exception already on its way out is left to propagate."""
    named = list(model.named_parameters())
    versions = [p._version for _, p in named]
    yield
    changed = [name for (name, p), v in zip(named, versions) if p._version != v]
    if changed:
        shown = ", ".join(changed[:3]) + (f" and {len(changed) - 3} more" if len(changed) > 3 else "")
        raise RuntimeError(
            f"the training step modified {len(changed)} parameter(s) in place during profiling ({shown}); "
            "lightning-ckpt runs it on slices of the first batch to measure it and keeps no copy of the "
            "parameters, so the model is no longer as it was before fit. Change parameters only through the "
            "optimizers (their steps are skipped while profiling) or in a hook profiling does not run, such "
            "as on_train_batch_end."
        )


def _is_metric(m: nn.Module) -> bool:
    """A torchmetrics `Metric` (duck-typed: its states live outside buffers)."""
    return isinstance(_defaults_of(m), dict) and hasattr(m, "_update_count")


def _defaults_of(m: nn.Module) -> Any:
    """`getattr(m, "_defaults", None)`. A module whose lookups are torch's own gets the plain lookup
    only: torch's `__getattr__`, which a miss falls back to (and which formats an error message for
    every module without one), returns a parameter, buffer or module, never a dict."""
    cls = type(m)
    if cls.__getattribute__ is not object.__getattribute__ or cls.__getattr__ is not nn.Module.__getattr__:
        return getattr(m, "_defaults", None)
    try:
        return object.__getattribute__(m, "_defaults")
    except AttributeError:
        return None


def _metric_state(m: nn.Module) -> dict:
    import copy

    keys = [*m._defaults, "_update_count", "_computed"]
    return {k: copy.deepcopy(getattr(m, k)) for k in keys if hasattr(m, k)}
