"""Sizes in and out: parse `"6GiB"`, `"300 MiB"`, `"1.5GB"`, `"20G"`, `123456`; print bytes as `"1.5 KiB"`."""

from __future__ import annotations

import math
import re
import unicodedata

_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    # the one-letter shorthands of docker, the JVM and torch's memory summaries: binary
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*$", re.IGNORECASE)
# The largest size read: 1 PiB. No machine holds that much memory (the largest single hosts hold tens
# of TiB, the largest accelerators a few hundred GiB), and it stays far below 2**63, where the
# planner's int64 arithmetic (budget + bytes already held) would overflow. Whether a budget is more
# than the training device has is another question, answered where the device is known.
MAX_BYTES = 2**50


def parse_bytes(value: int | float | str, name: str = "memory_budget") -> int:
    """Bytes from a number or a string with a unit, in any case, with or without a space.

    Units: B; KB, MB, GB, TB (powers of 1000); KiB, MiB, GiB, TiB (powers of 1024); and the
    shorthands K, M, G, T, which mean KiB, MiB, GiB, TiB ('300M', '20G', '1.5 g'), as in docker,
    the JVM and torch's memory summaries. A number is a whole number of bytes (3.0 is read as 3,
    3.7 is refused); a string with a larger unit is rounded down to a whole byte ('1.1KiB': 1126).
    Refused: less than one byte, negative sizes, more than 1 PiB (`MAX_BYTES`), and digits or
    letters other than ASCII ones ('５GiB').
    """
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is a bool, not a size; give bytes as an int or a string like '6GiB'.")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive number of bytes; give e.g. 6 * 2**30 or '6GiB'.")
        if value < 1:
            raise ValueError(_under_one_byte(name, value))
        if value != int(value):
            raise ValueError(
                f"{name}={value!r} is not a whole number of bytes; give bytes as an int (e.g. {int(value)}) or a "
                "string with a unit like '6GiB' or '1.5GiB' (a float such as 3.0 is read as 3 bytes)."
            )
        return _at_most_max(name, value, int(value))
    if not isinstance(value, str):
        raise ValueError(f"{name}={value!r} has type {type(value).__name__}; give bytes as an int or a string like '6GiB'.")
    _refuse_non_ascii(name, value)
    m = _PATTERN.match(value)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS and unit != "":
        if value.strip().startswith("-") and _PATTERN.match(value.strip()[1:]):
            raise ValueError(
                f"{name}={value!r} is negative; a size is a positive number of bytes, e.g. "
                f"{value.strip()[1:].strip()!r}."
            )
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
    if unit in ("", "b") and total != result:
        raise ValueError(
            f"{name}={value!r} is not a whole number of bytes; write whole bytes (e.g. '{result}B') or a larger "
            "unit such as '1.5KiB'."
        )
    return _at_most_max(name, value, result)


def _at_most_max(name: str, value: int | float | str, result: int) -> int:
    if result > MAX_BYTES:
        raise ValueError(
            f"{name}={value!r} is {result:,} bytes, more than the 1 PiB (2**50 = {MAX_BYTES:,} bytes) "
            "lightning-ckpt reads and more memory than any machine holds; it is the per-device peak of one "
            "training step: give e.g. '80GiB'."
        )
    return result


def _refuse_non_ascii(name: str, value: str) -> None:
    """Only ASCII digits and letters are read: '５GiB' (a full-width digit) says which character to retype."""
    odd = [c for c in value if not c.isascii()]
    if not odd:
        return
    shown = ", ".join(f"{c!r} ({unicodedata.name(c, f'U+{ord(c):04X}')})" for c in dict.fromkeys(odd))
    ascii_form = "".join(_ascii_twin(c) for c in value)
    fix = f"write {ascii_form.strip()!r}" if ascii_form.isascii() and _PATTERN.match(ascii_form) else "write e.g. '6GiB'"
    raise ValueError(f"{name}={value!r} contains {shown}; only ASCII digits 0-9 and ASCII unit letters are read: {fix}.")


def _ascii_twin(c: str) -> str:
    """The ASCII character `c` stands for: a decimal digit of any script, a full-width letter or a space
    ('５' -> '5'); anything else (a superscript '²' is no digit of the number) stays as it is."""
    if c.isascii():
        return c
    if unicodedata.decimal(c, None) is not None:
        return str(unicodedata.decimal(c))
    if 0xFF01 <= ord(c) <= 0xFF5E:  # the full-width forms of '!' to '~'
        return chr(ord(c) - 0xFEE0)
    return " " if c.isspace() else c


def _under_one_byte(name: str, value: float | str) -> str:
    return (
        f"{name}={value!r} is less than one byte; give bytes as a number (e.g. 6 * 2**30) or a string like '6GiB'. "
        "A fraction of the device's memory (such as 0.9) is not supported."
    )


def format_bytes(n: float) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB'."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
