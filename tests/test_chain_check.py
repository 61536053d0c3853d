"""The chain check: the previous output itself or an unmodified alias chains; copies and other views do not."""

from __future__ import annotations

import pytest
import torch
from models import IdentityWrap

from lightning_ckpt.profiling.structure.chain_check import receives_output, tensor_version


def _out():
    return torch.randn(4, 6, requires_grad=True) * 1  # a non-leaf, like a block's output


@pytest.mark.parametrize(
    "feed",
    [lambda x: x, IdentityWrap.apply, lambda x: IdentityWrap.apply(IdentityWrap.apply(x)), lambda x: x.view_as(x)],
    ids=["itself", "identity_function", "two_identity_functions", "view_as"],
)
def test_aliases_chain(feed):
    out = _out()
    assert receives_output(feed(out), out, tensor_version(out))


@pytest.mark.parametrize(
    "feed",
    [
        lambda x: x.clone(),
        lambda x: x + 0,
        lambda x: x.detach(),  # no longer requires grad
        lambda x: x.t(),  # strides
        lambda x: x[1:],  # offset and shape
        lambda x: x[:, :3],  # shape
        lambda x: x.view(torch.int32),  # dtype
        lambda x: x.reshape(6, 4),  # shape
        lambda x: IdentityWrap.apply(x.clone()),
        lambda x: None,
        lambda x: [x],
    ],
    ids=["clone", "plus_zero", "detached", "transposed", "sliced_rows", "sliced_columns", "dtype_view", "reshaped",
         "wrapped_clone", "none", "list"],
)
def test_copies_and_other_views_do_not_chain(feed):
    out = _out()
    assert not receives_output(feed(out), out, tensor_version(out))


def test_an_in_place_write_between_blocks_breaks_the_chain():
    out = _out()
    version = tensor_version(out)
    alias = IdentityWrap.apply(out)
    with torch.no_grad():
        alias.add_(1)  # aliases share the version counter
    assert not receives_output(alias, out, version)
    assert not receives_output(out, out, version)
    assert receives_output(alias, out)  # without a version only the layout is compared


def test_no_memory_no_alias():
    """Empty and meta tensors have no address to compare: only the object itself chains."""
    for out in (torch.empty(0, requires_grad=True) * 1, torch.empty(3, 4, device="meta")):
        assert receives_output(out, out)
        assert not receives_output(out.view_as(out), out)


def test_conjugate_and_negative_views_do_not_chain():
    """Same memory, same layout, other values."""
    z = torch.randn(3, dtype=torch.complex64)
    assert not receives_output(z.conj(), z)
    assert not receives_output(torch._neg_view(z), z)
    assert receives_output(IdentityWrap.apply(z), z)
