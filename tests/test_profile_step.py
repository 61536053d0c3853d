"""Probe sizes against the first training batch: too large raises, a check size too large is skipped."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_ckpt.integrations.profile_step import probe_sizes


def _batch(n: int):
    return torch.zeros(n, 3), torch.zeros(n, dtype=torch.long)


def test_sizes_within_the_batch_are_used_as_given():
    assert probe_sizes(_batch(8), (1, 2), 4) == 4
    assert probe_sizes(_batch(2), (1, 2), None) is None


@pytest.mark.parametrize(
    ("n", "probes", "match"),
    [
        (4, (8, 16), (r"^probe_batch_sizes=\(8, 16\) but the first training batch has 4 samples; the probes are "
                      r"slices of that batch\. Set probe_batch_sizes to two sizes <= 4, e\.g\. \(1, 2\)\.$")),
        (3, (1, 4), r"probe_batch_sizes=\(1, 4\) but the first training batch has 3 samples"),
        (1, (1, 2), r"the first training batch has 1 sample\(s\); profiling fits a line through two batch sizes"),
    ],
)
def test_probe_larger_than_the_batch_raises(n, probes, match):
    with pytest.raises(ValueError, match=match):
        probe_sizes(_batch(n), probes, None)


def test_check_larger_than_the_batch_is_skipped_and_said(caplog):
    with caplog.at_level(logging.INFO):
        assert probe_sizes(_batch(3), (1, 2), 4) is None
    assert "check_batch_size=4 is larger than the first training batch (3 samples)" in caplog.text
