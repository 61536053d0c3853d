"""Sizes in and out: parse `"6GiB"`, `"300 MiB"`, `"1.5GB"`, `"20G"`, `123456`; print bytes as `"1.5 KiB"`."""

from __future__ import annotations

import math
import re

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    # the one-letter shorthands of docker, the JVM and torch's memory summaries: binary
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: int | float | str, name: str = "memory_budget") -> int:
    """Bytes from a number or a string with a unit, in any case, with or without a space.

    Units: B; KB, MB, GB, TB (powers of 1000); KiB, MiB, GiB, TiB (powers of 1024); and the
    shorthands K, M, G, T, which mean KiB, MiB, GiB, TiB ('300M', '20G', '1.5 g'), as in docker,
    the JVM and torch's memory summaries. Anything that comes to less than one byte is refused.
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is a bool, not a size; give bytes as an int or a string like '6GiB'.")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive number of bytes; give e.g. 6 * 2**30 or '6GiB'.")
        if value < 1:
            raise ValueError(_under_one_byte(name, value))
        return int(value)
    if not isinstance(value, str):
        raise ValueError(f"{name}={value!r} has type {type(value).__name__}; give bytes as an int or a string like '6GiB'.")
    m = _PATTERN.match(value)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS and unit != "":
        raise ValueError(
            f"{name}={value!r} is not a size lightning-ckpt can read; write a number with one of the units "
            "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024; also written K, M, G, T), "
            "e.g. '6GiB' or '6G'."
        )
    number = float(m.group(1))
    total = number * _UNITS.get(unit, 1)
    if not math.isfinite(total):
        raise ValueError(f"{name}={value!r} is too large to be a number of bytes; give e.g. '6GiB'.")
    result = int(total)
    if number == 0:
        raise ValueError(f"{name}={value!r} is not positive; a memory budget must be more than 0 bytes.")
    if result < 1:
        raise ValueError(_under_one_byte(name, value))
    return result


def _under_one_byte(name: str, value: float | str) -> str:
    return (
        f"{name}={value!r} is less than one byte; give bytes as a number (e.g. 6 * 2**30) or a string like '6GiB'. "
        "A fraction of the device's memory (such as 0.9) is not supported."
    )


def format_bytes(n: float) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
