"""Sizes as users write them: bytes, decimal and binary units, the one-letter shorthands."""

from __future__ import annotations

import re

import pytest

from lightning_ckpt.units import parse_bytes


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (123456, 123456),
        (3.0, 3),
        ("1.1KiB", 1126),
        ("1024TiB", 2**50),
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


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (3.7, r"^memory_budget=3\.7 is not a whole number of bytes; give bytes as an int \(e\.g\. 3\) .* 3\.0 is read as 3"),
        ("3.7", r"^memory_budget='3\.7' is not a whole number of bytes; write whole bytes \(e\.g\. '3B'\)"),
        ("2.5B", r"^memory_budget='2\.5B' is not a whole number of bytes"),
    ],
)
def test_fractions_of_a_byte_are_refused(value, match):
    with pytest.raises(ValueError, match=match):
        parse_bytes(value)


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        (2**80, "1,208,925,819,614,629,174,706,176"),
        ("1e30", "1,000,000,000,000,000,019,884,624,838,656"),
        (1e30, "1,000,000,000,000,000,019,884,624,838,656"),
        ("1025TiB", "1,126,999,418,470,400"),
        (2**50 + 1, "1,125,899,906,842,625"),
    ],
)
def test_more_than_a_machine_holds_is_refused(value, shown):
    """Beyond 1 PiB the planner's int64 arithmetic would overflow after profiling; refused when read."""
    with pytest.raises(
        ValueError,
        match=rf"^memory_budget={re.escape(repr(value))} is {shown} bytes, more than the 1 PiB \(2\*\*50 = "
        r"1,125,899,906,842,624 bytes\) .* give e\.g\. '80GiB'",
    ):
        parse_bytes(value)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("-5MiB", r"^memory_budget='-5MiB' is negative; a size is a positive number of bytes, e\.g\. '5MiB'"),
        (" - 2 G", r"is negative; .* e\.g\. '2 G'"),
        ("-1e3", r"^memory_budget='-1e3' is negative"),
    ],
)
def test_negative_sizes_say_so(value, match):
    with pytest.raises(ValueError, match=match):
        parse_bytes(value)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ("\uff15GiB", r"'５' \(FULLWIDTH DIGIT FIVE\); only ASCII digits 0-9 .* write '5GiB'"),
        ("\uff15\uff27\uff49\uff22", r"FULLWIDTH LATIN CAPITAL LETTER G.*: write '5GiB'"),
        ("\u0665GiB", r"ARABIC-INDIC DIGIT FIVE.*: write '5GiB'"),
        ("5\u00a0GiB", r"NO-BREAK SPACE.*: write '5 GiB'"),
        ("5\u00b2GiB", r"SUPERSCRIPT TWO.*: write e\.g\. '6GiB'"),  # not a digit of the number: no guess
    ],
)
def test_only_ascii_digits_are_read(value, match):
    """Not normalised: '5²GiB' would become '52GiB'; the message names the character and the ASCII spelling."""
    with pytest.raises(ValueError, match=rf"^memory_budget={re.escape(repr(value))} contains .*{match}"):
        parse_bytes(value)
