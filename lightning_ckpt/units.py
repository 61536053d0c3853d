"""Parse and validate user-facing sizes: `"6GiB"`, `"300 MiB"`, `"1.5GB"`, `123456`."""

from __future__ import annotations

import math
import re

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: int | float | str, name: str = "memory_budget") -> int:
    """Bytes from an int or a string with a unit (B, KB/MB/GB/TB decimal, KiB/MiB/GiB/TiB binary)."""
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is a bool, not a size; give bytes as an int or a string like '6GiB'.")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive number of bytes; give e.g. 6 * 2**30 or '6GiB'.")
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"{name}={value!r} has type {type(value).__name__}; give bytes as an int or a string like '6GiB'.")
    m = _PATTERN.match(value)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS and unit != "":
        raise ValueError(
            f"{name}={value!r} is not a size lightning-ckpt can read; write a number with one of the units "
            "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. '6GiB'."
        )
    number = float(m.group(1))
    result = int(number * _UNITS.get(unit, 1))
    if result <= 0:
        raise ValueError(f"{name}={value!r} is not positive; a memory budget must be more than 0 bytes.")
    return result
