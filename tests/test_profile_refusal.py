"""A batch no pass can profile within the budget is refused before any pass goes over it, with the numbers:
every call is watched by a live-storage count of the test's own (`storage_oracle`), which never goes over the
budget; the `full` plan's peak the message bounds from below is checked against planning's prediction, and
the longest sequence it names is trained at, measured within the budget."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from models import TinyChain, tokens_batch
from storage_oracle import LiveStorages, step_state
from torch import nn

from lightning_ckpt import InfeasibleBudgetError, auto_checkpoint, make_plan
from lightning_ckpt.engine.step_profile import profile_model
from lightning_ckpt.engine.target_plan import cost_at
from lightning_ckpt.profiling.passes.profile_budget import ProfileBudget
from lightning_ckpt.profiling.passes.profile_refusal import SEARCH_PASSES, longest_prefix
from lightning_ckpt.profiling.memory.static_memory import static_memory
from lightning_ckpt.units import format_bytes


class _Residual(nn.Module):
    """Four residual MLP blocks on feature vectors (no token dimension), the loss their mean square."""

    def __init__(self, d: int = 64, hidden: int = 256) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d)) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return x.square().mean()


def test_longest_prefix_halves_until_one_fits_then_bisects_within_its_passes():
    tried: list[int] = []

    def pass_at(x: int) -> int | None:
        tried.append(x)
        return 10 * x if x <= 37 else None

    assert longest_prefix(100, pass_at) == (37, 25, {25: 250, 37: 370})
    assert tried == [50, 25, 37, 43, 40, 38] and len(tried) == SEARCH_PASSES
    assert longest_prefix(100, lambda x: None, passes=3) == (0, 12, {})  # 50, 25, 12: none fits
    assert longest_prefix(100, lambda x: x, lo=60)[0] == 99  # from a prefix known to fit


def test_a_budget_below_the_full_plan_at_batch_one_is_refused_before_any_pass_goes_over_it():
    model = _Residual()
    batch = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    blocks, names = list(model.blocks), [f"blocks.{i}" for i in range(4)]
    static = static_memory(model)
    free = profile_model(model, blocks, model, batch, names=names, timing=False)
    full_one = make_plan(cost_at(free, 1, static), "full").predicted_peak_bytes
    held = static.resident_bytes + batch.untyped_storage().nbytes()
    budget = held + (full_one - held) // 2  # half of what `full` adds at batch 1
    with LiveStorages() as mode:
        mode.count(step_state(model) + [batch])
        with pytest.raises(InfeasibleBudgetError) as refused:
            profile_model(model, blocks, model, batch, names=names, timing=False,
                          budget=ProfileBudget(budget, static.resident_bytes, info=lambda _: None))
    short = refused.value.shortfall
    assert mode.peak <= budget < short.at_least_bytes <= full_one, (mode.peak, budget, short.at_least_bytes, full_one)
    assert short.largest_batch == 0 and short.longest_tokens is None  # (no token dimension: none looked for)
    assert re.fullmatch(
        rf"lightning-ckpt: the training batch of shape \(batch 8, tensors \[8, 64\]\) was refused before profiling went "
        rf"over memory_budget={re.escape(format_bytes(budget))}: beside the .* it leaves .* a pass on 1 sample\(s\) under "
        rf"checkpointing .* the `full` plan's peak at batch 8 is at least {re.escape(format_bytes(short.at_least_bytes))}\. "
        r"No batch fits at this size, not even 1 sample\. Multi-level plans .* cannot be profiled within this budget "
        r"either\. Raise memory_budget above .*", str(refused.value)), str(refused.value)
    assert all(p.grad is None for p in model.parameters())


def test_one_long_sequence_is_refused_with_the_longest_length_that_fits_which_then_trains_within_the_budget():
    """Batch 1 of 64 tokens: unplanned and under checkpointing the whole sequence does not fit, and only one
    prefix does (too few to fit the length): bounded passes on prefixes under checkpointing find the longest that
    fits (the search's prefixes then cost it, and no plan fits, multi-level ones included). A batch of that
    length is then planned and its step measured within the budget."""
    torch.manual_seed(0)
    model = TinyChain(n_blocks=4, d=32)

    def loss(b):
        return F.cross_entropy(model(b[0]), b[1])

    budget = 370_619  # between the `full` plan's peak at 48 tokens and at 64, as the oracle measures them

    def checkpointed(length: int):
        return auto_checkpoint(model, budget, example_batch=tokens_batch(1, length), step_fn=loss, blocks="blocks",
                               cost_metric="flops", verbose=False, info=lambda _: None)

    with LiveStorages() as mode:
        mode.count(step_state(model) + list(tokens_batch(1, 64)))
        with pytest.raises(InfeasibleBudgetError, match=r"At batch 1 the longest sequence that fits is (\d+) tokens of 64") as refused:
            checkpointed(64)
    assert mode.peak <= budget, (mode.peak, budget)
    longest = refused.value.shortfall.longest_tokens
    assert re.search(rf"the `full` plan's peak at batch 1 is at least .*, about .* extrapolated from the passes on "
                     rf"prefixes of .*{longest} tokens under checkpointing\. .* no plan fits either, multi-level ones .* "
                     rf"the sequence length \(to {longest} tokens\)\.$", str(refused.value)), str(refused.value)
    handle = checkpointed(longest)
    batch = tokens_batch(1, longest, seed=3)
    with LiveStorages() as mode:
        mode.count(step_state(model) + list(batch))
        handle.step(batch)
        loss(batch).backward()
    handle.remove()
    assert handle.plan.fits and mode.peak <= budget, (mode.peak, budget)


class _OtherBranchAgain(nn.Module):
    """A block whose second run takes another branch (its forward reads a count it writes): it cannot be run
    again under checkpointing as its forward ran."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.linear = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.calls = torch.zeros(())  # (a tensor it reads and writes, not an argument)

    def forward(self, x):
        self.calls += 1
        h = self.linear(x)
        return self.out(h.exp() if self.calls.item() % 2 else h)


def test_a_batch_that_cannot_be_profiled_under_checkpointing_is_refused_with_why():
    torch.manual_seed(0)
    model = nn.Sequential(*(_OtherBranchAgain() for _ in range(3)))
    batch = torch.randn(4, 256, 16, generator=torch.Generator().manual_seed(1))
    static = static_memory(model)
    budget = static.resident_bytes + batch.untyped_storage().nbytes() + 300 * 1024  # under one sample's unplanned pass
    with LiveStorages() as mode:
        mode.count(step_state(model) + [batch])
        with pytest.raises(InfeasibleBudgetError, match=r"a pass on 1 sample\(s\) unplanned \(not under checkpointing: block "
                           r"call \d run again saved .*\) needs more: .* the unplanned step's peak at batch 4 is at least .* "
                           r"The `full` plan's peak could not be measured"):
            profile_model(model, list(model), lambda x: model(x).square().mean(), batch, timing=False,
                          budget=ProfileBudget(budget, static.resident_bytes, info=lambda _: None))
    assert mode.peak <= budget, (mode.peak, budget)
