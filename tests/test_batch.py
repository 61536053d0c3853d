"""Batches of every kind a Lightning loader yields: their size, slices and per-sample tensors."""

from __future__ import annotations

import dataclasses
from collections import UserDict, namedtuple
from collections.abc import Mapping
from functools import cached_property
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from transformers import BatchEncoding

from lightning_ckpt.profiling.structure.batch import batch_size_of, batch_tensors, first_tensor, slice_batch, tensors_in

Pair = namedtuple("Pair", "first second")


@dataclasses.dataclass
class Sample:
    first: Any
    second: Any = None


@dataclasses.dataclass(frozen=True)
class FrozenSample:
    first: Any
    second: Any = None


@dataclasses.dataclass(frozen=True, slots=True)
class SlottedSample:
    first: Any
    second: Any = None


@dataclasses.dataclass
class CountedSample:
    tokens: torch.Tensor

    @cached_property
    def n_rows(self) -> int:
        return self.tokens.shape[0]


class ReadOnlyMapping(Mapping):
    """A Mapping that is not a dict."""

    def __init__(self, items):
        self._items = dict(items)

    def __getitem__(self, key):
        return self._items[key]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)


def _structure(obj: Any) -> Any:
    """Types and non-tensor values of a batch, nested as the batch is; tensors by their trailing shape."""
    if isinstance(obj, torch.Tensor):
        return ("tensor", tuple(obj.shape[1:]))
    if isinstance(obj, UserDict):
        return type(obj), _structure(obj.data)
    if dataclasses.is_dataclass(obj):
        return type(obj), tuple(_structure(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, Mapping):
        return type(obj), tuple((k, _structure(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj), tuple(_structure(v) for v in obj)
    return obj


def _assert_first_rows(batch: Any, n: int) -> Any:
    """Slice `batch` to `n` and check the slice against it, tensor by tensor; -> the slice."""
    size = batch_size_of(batch)
    sliced = slice_batch(batch, n)
    assert type(sliced) is type(batch)
    assert _structure(sliced) == _structure(batch)
    pairs = list(zip(tensors_in(batch), tensors_in(sliced), strict=True))
    for old, new in pairs:
        if old.dim() > 0 and old.shape[0] == size:
            assert new.shape == (n, *old.shape[1:]) and torch.equal(new, old[:n])
            assert new.untyped_storage().nbytes() == n * old[0].numel() * old.element_size()  # a copy
        else:
            assert new is old
    return sliced


X, Y = torch.arange(8 * 3.0).reshape(8, 3), torch.arange(8)
BATCHES = {
    "tensor": X,
    "tuple": (X, Y),
    "list": [X, Y],
    "dict": {"x": X, "y": Y},
    "namedtuple": Pair(X, Y),
    "dataclass": Sample(X, Y),
    "frozen dataclass": FrozenSample(X, Y),
    "slotted frozen dataclass": SlottedSample(X, Y),
    "UserDict": UserDict(x=X, y=Y),
    "BatchEncoding": BatchEncoding({"input_ids": X, "labels": Y}),
    "Mapping": ReadOnlyMapping({"x": X, "y": Y}),
    "nested": {"inputs": [Pair(X, {"y": Y})], "meta": FrozenSample(BatchEncoding({"x": X}), "tag"), "n": 3},
}


@pytest.mark.parametrize("kind", BATCHES)
def test_every_batch_kind_has_a_size_and_slices_to_its_own_type(kind):
    batch = BATCHES[kind]
    assert batch_size_of(batch) == 8
    assert first_tensor(batch) is X
    assert all(t.shape[0] == 8 for t in batch_tensors(batch))
    sliced = _assert_first_rows(batch, 3)
    assert batch_size_of(sliced) == 3


def _tiny_tokenizer():
    import tokenizers  # installed with transformers, which requires it
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[UNK]": 1, "the": 2, "cat": 3, "sat": 4, "on": 5, "mat": 6}
    tok = tokenizers.Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


def test_hf_collator_batch_stays_a_batch_encoding():
    from transformers import DataCollatorWithPadding

    tokenizer = _tiny_tokenizer()
    texts = ["the cat sat", "the cat", "the cat sat on the mat", "mat", "on the mat"]
    features = [{**tokenizer(t), "labels": i % 2} for i, t in enumerate(texts)]
    batch = DataCollatorWithPadding(tokenizer, return_tensors="pt")(features)
    assert isinstance(batch, BatchEncoding) and batch["input_ids"].shape == (5, 6)
    assert batch_size_of(batch) == 5
    sliced = _assert_first_rows(batch, 2)
    assert isinstance(sliced, BatchEncoding) and list(sliced.keys()) == list(batch.keys())
    assert sliced.input_ids.shape == (2, 6) and sliced["labels"].tolist() == [0, 1]  # attribute access still works
    assert sliced.n_sequences == batch.n_sequences


def test_hf_model_output_keeps_items_and_fields_in_step():
    from transformers.modeling_outputs import BaseModelOutput

    out = BaseModelOutput(last_hidden_state=torch.zeros(6, 4, 2), hidden_states=(torch.ones(6, 4, 2),))
    sliced = _assert_first_rows(out, 2)
    assert sliced["last_hidden_state"] is sliced.last_hidden_state and sliced.last_hidden_state.shape == (2, 4, 2)


def test_scalars_and_shared_tensors_pass_through_unsliced():
    causal = torch.ones(5, 5).tril()  # shared by every sample
    vocab = torch.zeros(100, 4)
    step = torch.tensor(7)
    batch = {"x": torch.zeros(8, 5), "mask": causal, "y": torch.zeros(8), "table": vocab, "step": step}
    assert batch_size_of(batch) == 8
    assert batch_tensors(batch) == [batch["x"], batch["y"]]
    sliced = _assert_first_rows(batch, 2)
    assert sliced["mask"] is causal and sliced["table"] is vocab and sliced["step"] is step


def test_batch_size_is_the_most_common_leading_dimension_ties_go_to_the_first():
    assert batch_size_of((torch.zeros(5, 5), torch.zeros(8, 2), torch.zeros(8))) == 8
    assert batch_size_of((torch.zeros(3, 2), torch.zeros(8))) == 3
    assert batch_size_of([torch.tensor(1.0), Sample(torch.zeros(4))]) == 4  # scalars do not count


def test_cached_values_of_the_whole_batch_are_dropped_from_a_slice():
    batch = CountedSample(torch.zeros(8, 2))
    assert batch.n_rows == 8
    assert slice_batch(batch, 3).n_rows == 3


@pytest.mark.parametrize(
    ("batch", "held"),
    [
        ({"loss_scale": torch.tensor(2.0)}, r"dict that holds no tensor with a batch dimension \(only 1 scalar"),
        (Sample(["a", "b"], 3), r"Sample that holds no tensor with a batch dimension \(no tensors at all\)"),
    ],
)
def test_batch_without_a_batch_dimension_says_what_it_got(batch, held):
    said = rf"cannot tell the batch size: the batch is a {held}.*tensors of shape \[batch"
    with pytest.raises(ValueError, match=said):
        batch_size_of(batch)
    with pytest.raises(ValueError, match=held):
        slice_batch(batch, 1)


def test_slicing_more_samples_than_the_batch_has_is_refused():
    with pytest.raises(ValueError, match=r"cannot slice 9 samples from a batch of 8; give 1 <= n <= 8"):
        slice_batch((X, Y), 9)


CONTAINERS = ("list", "tuple", "dict", "namedtuple", "dataclass", "frozen", "UserDict", "BatchEncoding", "Mapping")


def _container(kind: str, children: list) -> Any:
    items = {f"k{i}": c for i, c in enumerate(children)}
    first, second = (children + [None, None])[:2]
    return {
        "list": lambda: list(children),
        "tuple": lambda: tuple(children),
        "dict": lambda: items,
        "namedtuple": lambda: Pair(first, second),
        "dataclass": lambda: Sample(first, second),
        "frozen": lambda: FrozenSample(first, second),
        "UserDict": lambda: UserDict(items),
        "BatchEncoding": lambda: BatchEncoding(items),
        "Mapping": lambda: ReadOnlyMapping(items),
    }[kind]()


@st.composite
def nested_batches(draw) -> tuple[Any, int]:
    size = draw(st.integers(2, 6))
    trailing = st.lists(st.integers(1, 3), max_size=2)
    per_sample = trailing.map(lambda rest: torch.randn(size, *rest))
    shared = st.integers(size + 1, size + 4).map(lambda s: torch.randn(s, 2))
    scalar = st.floats(-1, 1).map(torch.tensor)
    plain = st.one_of(st.none(), st.integers(0, 9), st.text("ab", max_size=2))
    leaves = st.one_of(per_sample, per_sample, per_sample, shared, scalar, plain)
    tree = draw(
        st.recursive(
            leaves,
            lambda children: st.tuples(st.sampled_from(CONTAINERS), st.lists(children, max_size=3)).map(
                lambda kc: _container(*kc)
            ),
            max_leaves=10,
        )
    )
    dims = [t.shape[0] for t in tensors_in(tree) if t.dim() > 0]
    assume(dims.count(size) > max((dims.count(d) for d in dims if d != size), default=0))
    return tree, size


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow])
@given(nested_batches(), st.data())
def test_slicing_to_n_gives_a_batch_of_n(batch_and_size, data):
    batch, size = batch_and_size
    n = data.draw(st.integers(1, size))
    assert batch_size_of(batch) == size
    sliced = _assert_first_rows(batch, n)
    assert batch_size_of(sliced) == n
    assert len(batch_tensors(sliced)) == len(batch_tensors(batch))
