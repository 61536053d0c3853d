"""Sizes as users write them: bytes, decimal and binary units, the one-letter shorthands."""

from __future__ import annotations

import pytest

from lightning_ckpt.units import parse_bytes


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (123456, 123456),
        (1.5, 1),
        ("6GiB", 6 * 2**30),
        ("300 MiB", 300 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("2kb", 2000),
        ("512B", 512),
        ("300M", 300 * 2**20),
        ("20G", 20 * 2**30),
        ("1.5 g", int(1.5 * 2**30)),
        ("8k", 8 * 2**10),
        (" 2 T ", 2 * 2**40),
    ],
)
def test_sizes_people_type(value, expected):
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("value", [0.5, 0.9, "0.5B", "1e-12 GiB"])
def test_less_than_one_byte_is_refused(value):
    with pytest.raises(
        ValueError,
        match=rf"memory_budget={value!r} is less than one byte; give bytes .* or a string like '6GiB'\. "
        r"A fraction of the device's memory \(such as 0\.9\) is not supported",
    ):
        parse_bytes(value)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (0, r"memory_budget=0 must be a positive number of bytes"),
        (-3.0, r"memory_budget=-3.0 must be a positive number of bytes"),
        ("0G", r"memory_budget='0G' is not positive"),
        ("6 gigs", r"memory_budget='6 gigs' is not a size .* also written K, M, G, T"),
        ("1e400GiB", r"memory_budget='1e400GiB' is too large"),
        (True, r"memory_budget=True is a bool"),
        ([6], r"memory_budget=\[6\] has type list"),
    ],
)
def test_sizes_that_cannot_be_read(value, match):
    with pytest.raises(ValueError, match=match):
        parse_bytes(value)


def test_the_name_in_the_message_is_the_argument_given():
    with pytest.raises(ValueError, match=r"^reserve=0\.25 is less than one byte"):
        parse_bytes(0.25, "reserve")
