"""The plain data a checkpoint stores (a plan, a step cost, a profile), checked field by field.

A stored dict may have been edited, truncated or written by another version. Before it is rebuilt
with `from_dict`, every field of the dataclass must be there (or have a default) with its annotated
type: an int is an int (a bool or a float is not), a number is finite, a size is not negative, a
pair is two entries; no field the dataclass does not know. `problems` names each field that is not,
so that a resumed run says what was wrong instead of failing inside `from_dict` or running on it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.planning.plan import Plan

# what `to_dict` writes beside the fields and `from_dict` recomputes (checked only for being there)
_DERIVED: dict[type, frozenset[str]] = {Plan: frozenset({"checkpointed", "recompute_share", "fits"})}
# measured differences of times, and the stretches of a block's backward (`BlockCost.bwd_phase_bytes`: what they
# hold above the backward's start may be below it)
_SIGNED = frozenset({"keep_saved_ms", "keep_draws_saved_ms", "bwd_phase_bytes"})
_LEAST = {"segment": -1, "batch_size": 1}  # every other number is >= 0 (-1: a block in no segment)
# `dict`-typed fields whose entries are read as typed values: the rates are a `MachineRates.to_dict()`
_KEYS: dict[str, dict[str, Any]] = {
    "rates": dict(typing.get_type_hints(MachineRates)),
    "meta": {"rates": MachineRates | None, "step_fwd_flops": float, "keep_calibration_s": float},
}
_MAX_SHOWN = 4  # problems named in one message


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _shown(value: Any) -> str:
    text = repr(value)
    return f"{text if len(text) <= 40 else text[:37] + '...'} ({type(value).__name__})"


def _kind(tp: Any) -> str:
    if tp is type(None):
        return "None"
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_kind(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is tuple:
        return "a list"
    if dataclasses.is_dataclass(tp):
        return f"a mapping of {tp.__name__} fields"
    return {bool: "a bool", int: "an int", float: "a finite number", str: "a string"}.get(tp, "a mapping")


def problems(cls: type, data: Any, where: str) -> list[str]:
    """What in `data` keeps it from being the `to_dict()` of a `cls` (a dataclass), each as
    '<where>.<field> is <value>, not <type>'; empty when nothing does."""
    if not isinstance(data, Mapping):
        return [f"{where} is {_shown(data)}, not {_kind(cls)}"]
    hints, found, names = _hints(cls), [], set()
    for f in dataclasses.fields(cls):
        names.add(f.name)
        if f.name in data:
            found += _check(hints[f.name], data[f.name], f"{where}.{f.name}", f.name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            found.append(f"{where}.{f.name} is missing")
    unknown = sorted(map(str, set(data) - names - _DERIVED.get(cls, frozenset())))
    if unknown:
        found.append(f"{where} has field(s) {cls.__name__} does not know: {', '.join(unknown)}")
    return found


def value_problems(tp: Any, value: Any, where: str) -> list[str]:
    """What keeps `value` from being of type `tp` (an annotation of these dataclasses' fields)."""
    return _check(tp, value, where, where.rsplit(".", 1)[-1])


def _check(tp: Any, value: Any, where: str, name: str) -> list[str]:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return []
        alternatives = [a for a in args if a is not type(None)]
        if len(alternatives) == 1:
            return _check(alternatives[0], value, where, name)
        if any(not _check(a, value, where, name) for a in alternatives):
            return []
        return [f"{where} is {_shown(value)}, not {_kind(tp)}"]
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return [f"{where} is {_shown(value)}, not a list"]
        if len(args) == 2 and args[1] is Ellipsis:
            args = (args[0],) * len(value)
        elif len(value) != len(args):
            return [f"{where} has {len(value)} entries, not {len(args)}"]
        return [p for i, (a, v) in enumerate(zip(args, value)) for p in _check(a, v, f"{where}[{i}]", name)]
    if dataclasses.is_dataclass(tp):
        return problems(tp, value, where)
    if tp is dict or origin is dict:
        if not isinstance(value, Mapping):
            return [f"{where} is {_shown(value)}, not a mapping"]
        keys = _KEYS.get(name, {})
        return [p for k, kt in keys.items() if k in value for p in _check(kt, value[k], f"{where}[{k!r}]", k)]
    if tp not in (bool, int, float, str):
        return []  # an annotation this reader does not know: `from_dict` decides
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = {
        bool: isinstance(value, bool), str: isinstance(value, str), int: number and isinstance(value, int),
        float: number and (isinstance(value, int) or math.isfinite(value)),
    }[tp]
    if not ok:
        return [f"{where} is {_shown(value)}, not {_kind(tp)}"]
    least = _LEAST.get(name, 0)
    if number and name not in _SIGNED and value < least:
        return [f"{where} is {value!r}, below {least}"]
    return []


def summary(found: list[str]) -> str:
    """The first few problems, and how many more there are."""
    more = len(found) - _MAX_SHOWN
    return "; ".join(found[:_MAX_SHOWN]) + (f"; and {more} more" if more > 0 else "")
