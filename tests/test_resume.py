"""A checkpoint's plan on resume: reused when the run matches, re-planned or refused when not (a
multi-level plan nested deeper than max_levels included); used only for the batch shape it was made
for; a stored state checked field by field and by the memory model before use, every tampering said
in one line naming the checkpoint; through Lightning, longer sequences than the checkpoint's within
the budget at every step (by a tracker of the test's own)."""

from __future__ import annotations

import dataclasses
import re

import lightning.pytorch as pl
import pytest
import torch
from lit_models import LitChain, TokenData, make_trainer

from lightning_ckpt import ActivationCheckpointing
from lightning_ckpt.frontends.lightning.resume import (
    block_signature,
    callback_state,
    resumed_plan,
)
from lightning_ckpt.costs.block_costs import BlockCost, StepCost
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.planning.policies import make_plan
from lightning_ckpt.profiling.structure.shapes import BatchShape
from lightning_ckpt.profiling.memory.static_memory import StaticMemory
from lightning_ckpt.profiling.memory.tracker import LiveBytesTracker

BLOCKS = [torch.nn.Linear(4, 4) for _ in range(3)]
NAMES = ["blocks.0", "blocks.1", "blocks.2"]
COST = StepCost(blocks=tuple(BlockCost(n, saved_bytes=100, input_bytes=5) for n in NAMES), batch_size=8)
PLAN = dataclasses.replace(make_plan(COST, "full"), budget_bytes=10_000)  # as planned at that budget
SHAPE = BatchShape(8, ((8, 16), (8,)))  # token ids and labels at sequence length 16
NO_STATIC = StaticMemory(0, 0, 0, 0, 0)  # COST has none


def _state(**changes):
    state = callback_state(PLAN, None, COST, block_signature(NAMES, BLOCKS), 10_000, "full", SHAPE)
    return {**state, **changes}


def _resume(state, target=8, budget=10_000, policy="full", strict=False, blocks=BLOCKS):
    return resumed_plan(
        state, block_signature(NAMES, blocks), target, budget, policy, strict=strict, shape=SHAPE, static=NO_STATIC
    )


def test_matching_state_gives_back_plan_and_cost():
    resumed = _resume(_state())
    assert resumed.plan == PLAN and resumed.cost == COST and resumed.profile is None
    assert _resume(_state(), target="max").plan == PLAN


@pytest.mark.parametrize("state", [None, {}, {"plan": None}])
def test_nothing_saved_means_plan_again(state):
    assert _resume(state) is None


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"blocks": [torch.nn.Linear(4, 5)] + BLOCKS[1:]}, r"the blocks changed \(checkpoint: 3 blocks, now: 3 blocks"),
        ({"target": 16}, r"the plan is for batch 8, target_batch_size is 16"),
        ({"budget": 20_000}, r"memory_budget or policy changed"),
        ({"policy": "optimal"}, r"memory_budget or policy changed"),
    ],
)
def test_mismatch_replans_with_info_or_raises_when_strict(kwargs, problem, caplog):
    import logging

    with caplog.at_level(logging.INFO):
        assert _resume(_state(), **kwargs) is None
    assert "does not match this run" in caplog.text and "Planning again" in caplog.text
    with pytest.raises(ValueError, match=rf"does not match this run: .*{problem}.* strict_resume=True, so stopping"):
        _resume(_state(), strict=True, **kwargs)


# a plan that rebuilds block 1 inside the recompute of segment (0, 2), and one nested a level deeper
NESTED = dataclasses.replace(make_plan(COST, "manual", segments=[(0, 2)], inner_segments=[(1, 1)]), budget_bytes=10_000)
DEEPER = dataclasses.replace(
    make_plan(COST, "manual", segments=[(0, 2)], inner_segments=[(0, 1), (0, 0)]), budget_bytes=10_000
)


def _resume_optimal(plan, max_levels, strict):
    """`plan` saved by a run with policy optimal, resumed by the same run at `max_levels`."""
    state = callback_state(plan, None, COST, block_signature(NAMES, BLOCKS), 10_000, "optimal", SHAPE)
    return resumed_plan(
        state, block_signature(NAMES, BLOCKS), 8, 10_000, "optimal", strict=strict, max_levels=max_levels,
        shape=SHAPE, static=NO_STATIC,
    )


@pytest.mark.parametrize(("plan", "levels", "max_levels"), [(NESTED, 2, 1), (DEEPER, 3, 2), (DEEPER, 3, 1)])
def test_plan_nested_deeper_than_max_levels_replans_or_raises_when_strict(plan, levels, max_levels, caplog):
    import logging

    with caplog.at_level(logging.INFO):
        assert _resume_optimal(plan, max_levels, strict=False) is None
    problem = f"the plan nests segments {levels} levels deep, max_levels is {max_levels}"
    assert problem in caplog.text and "Planning again" in caplog.text
    with pytest.raises(ValueError, match=rf"does not match this run: {problem}\. strict_resume=True, so stopping"):
        _resume_optimal(plan, max_levels, strict=True)


@pytest.mark.parametrize(("plan", "max_levels"), [(NESTED, 2), (NESTED, 3), (DEEPER, 3), (PLAN, 1)])
def test_plan_within_max_levels_is_kept_with_its_inner_segments(plan, max_levels):
    resumed = _resume_optimal(plan, max_levels, strict=True)
    assert resumed.plan == plan and resumed.plan.inner_segments == plan.inner_segments


# ----------------------------------------------------------------------------- a stored plan checked before use

# a budget only checkpointing meets: with 1000 B of static memory `full` peaks at 1115 B, `none` at 1300 B
STATIC = StaticMemory(1000, 0, 0, 0, 0)
COSTED = dataclasses.replace(COST, static_bytes=1000)
TIGHT = 1200
FULL = make_plan(COSTED, "full", TIGHT)
CKPT = "/runs/fit/step=2.ckpt"
LONGER = BatchShape(8, ((8, 32), (8,)))  # the same samples, twice as long
PROFILE = Profile(probes=tuple(dataclasses.replace(COSTED, batch_size=b) for b in (1, 2)))


def _tight_state(profile=None):
    return callback_state(FULL, profile, COSTED, block_signature(NAMES, BLOCKS), TIGHT, "full", SHAPE, SHAPE)


def _resume_tight(state, strict=False, static=STATIC, shape=SHAPE, target=8):
    return resumed_plan(
        state, block_signature(NAMES, BLOCKS), target, TIGHT, "full", strict=strict, shape=shape, static=static,
        checkpoint=CKPT,
    )


def _lines(recwarn) -> list[str]:
    return [str(w.message) for w in recwarn if "lightning-ckpt" in str(w.message)]


def test_a_sound_plan_is_used_for_the_shape_it_was_made_for(recwarn):
    resumed = _resume_tight(_tight_state(PROFILE))
    assert resumed.plan == FULL and resumed.cost == COSTED and resumed.shape == SHAPE
    assert resumed.profile == PROFILE and resumed.profile_shape == SHAPE
    assert not _lines(recwarn)
    # with target_batch_size='max' the plan's batch size is its own: the samples' shape decides
    assert _resume_tight(_tight_state(), shape=BatchShape(2, ((2, 16), (2,))), target="max").plan == FULL


def test_another_shape_is_planned_anew_keeping_the_profile_at_its_own_shape(caplog):
    import logging

    for strict in (False, True):  # a new shape is no mismatch: strict_resume does not stop for it
        with caplog.at_level(logging.INFO):
            resumed = _resume_tight(_tight_state(PROFILE), strict=strict, shape=LONGER)
        assert resumed.plan is None and resumed.cost is None
        assert resumed.profile == PROFILE and resumed.profile_shape == SHAPE
    assert f"the plan in checkpoint {CKPT} was made for batch shape (batch 8, tensors [8, 16], [8])" in caplog.text
    assert "this batch has shape (batch 8, tensors [8, 32], [8]), so it is profiled and planned as any new" in caplog.text


def _set(path, value):
    """A change to the stored state: the entry at `path` (keys and indices) set to `value`, or deleted."""

    def change(state):
        *head, last = path
        node = state
        for key in head:
            node = node[key]
        if value is _set:
            del node[last]
        else:
            node[last] = value
        return state

    return change


TAMPERED = [
    # the reported edits: no segments (the prediction and table left as they were), floats, missing rows
    (_set(["plan", "segments"], []), r"the plan's table does not show its segments; its stored predicted peak of 1115 "
     r"bytes is not the memory model's 1300 bytes for its own step cost; with this run's static memory \(1000 B\) the "
     r"memory model predicts 1\.3 KiB for it, over the budget of 1\.2 KiB"),
    (_set(["plan", "segments"], [[0.0, 0.0], [1.0, 1.0], [2.5, 2.5]]), r"plan\.segments\[0\]\[0\] is 0\.0 \(float\), not an int"),
    (_set(["plan", "rows"], _set), r"plan\.rows is missing"),
    (_set(["plan", "rows"], "rows"), r"plan\.rows is 'rows' \(str\), not a list"),
    (_set(["plan", "batch_size"], True), r"plan\.batch_size is True \(bool\), not an int"),
    (_set(["plan", "recompute_ms"], float("nan")), r"plan\.recompute_ms is nan \(float\), not a finite number"),
    (_set(["plan", "extra"], 1), r"plan has field\(s\) Plan does not know: extra"),
    (_set(["cost", "blocks", 0, "saved_bytes"], "100"), r"cost\.blocks\[0\]\.saved_bytes is '100' \(str\), not an int"),
    (_set(["shape", "batch_size"], 0), r"shape\.batch_size is 0, below 1"),
    (_set(["profile"], "profile"), r"profile is 'profile' \(str\), not a mapping of Profile fields"),
    (_set(["shape"], None), r"it does not say which batch shape the plan was made for \(saved by an earlier version\)"),
    # what only `from_dict` finds, caught and said
    (_set(["cost", "blocks", 0, "input_saved_bytes"], 10), r"it cannot be read back \(ValueError: BlockCost 'blocks\.0': "
     r"input_saved_bytes=10 exceeds input_bytes=5"),
    # segments that do not apply to the chain
    (_set(["plan", "segments"], [[0, 5]]), r"its segments cannot be applied: segment \(0, 5\) is outside the chain of 3 blocks"),
    (_set(["plan", "segments"], [[0, 1], [1, 2]]), r"segment \(1, 2\) overlaps the previous segment ending at 1"),
    # predictions that do not hold: lowered, or a step cost made larger with its prediction left alone
    (_set(["plan", "predicted_peak_bytes"], 900), r"its stored predicted peak of 900 bytes is not the memory model's 1115"),
    (_set(["cost", "blocks", 1, "saved_bytes"], 500),
     r"is not the memory model's 1510 bytes .* predicts 1\.5 KiB for it, over the budget of 1\.2 KiB"),
]


@pytest.mark.parametrize(("tamper", "problem"), TAMPERED)
def test_a_tampered_plan_is_planned_again_with_one_line_naming_the_checkpoint(tamper, problem, recwarn):
    import copy

    state = tamper(copy.deepcopy(_tight_state(PROFILE)))
    assert _resume_tight(state) is None  # nothing of it is used: profiled and planned afresh
    lines = _lines(recwarn)
    assert len(lines) == 1, lines
    named = rf"the plan in checkpoint {re.escape(CKPT)} does not match this run: .*{problem}"
    assert re.search(rf"^lightning-ckpt: {named}", lines[0]) and lines[0].endswith(" Planning again.")
    with pytest.raises(ValueError, match=rf"{named}.* strict_resume=True, so stopping"):
        _resume_tight(copy.deepcopy(state), strict=True)


def test_a_plan_over_the_budget_with_this_runs_static_memory_is_planned_again(recwarn):
    larger = dataclasses.replace(STATIC, optimizer_state_bytes=200)  # e.g. another optimizer's state
    assert _resume_tight(_tight_state(), static=larger) is None
    (line,) = _lines(recwarn)
    assert "with this run's static memory (1.2 KiB) the memory model predicts 1.3 KiB for it, over the budget" in line
    assert _resume_tight(_tight_state()).plan == FULL  # with the static memory it was made with


def test_a_state_that_is_not_a_mapping_is_planned_again(recwarn):
    assert _resume_tight(["plan"]) is None
    assert "the callback state is list, not a mapping" in _lines(recwarn)[0]


# ----------------------------------------------------------------------------- resumed through Lightning


class StepPeaks(pl.Callback):
    """The peak of live tensor bytes of each training step by a tracker of its own, from after the plan for
    the batch is in place: the parameters, buffers, gradients, optimizer state and the batch adopted."""

    def __init__(self) -> None:
        self.peaks: list[int] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.tracker = LiveBytesTracker()
        self.tracker.__enter__()
        state = [*pl_module.parameters(), *pl_module.buffers(), *(p.grad for p in pl_module.parameters())]
        state += [v for s in trainer.optimizers[0].state.values() for v in s.values()]
        self.tracker.adopt([*state, *batch])
        self.tracker.reset_peak()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # before the module's own hook
        self.tracker.__exit__(None, None, None)
        self.peaks.append(self.tracker.peak_bytes)


def _callback(budget, **kw):
    return ActivationCheckpointing(8, memory_budget=budget, cost_metric="flops", verbose=False, report=False, **kw)


def _fit_chain(callbacks, seq, max_steps, ckpt_path=None):
    pl.seed_everything(0, verbose=False)
    trainer = make_trainer(callbacks, max_steps=max_steps)
    trainer.fit(LitChain(), datamodule=TokenData(8, n=32, seq=seq), ckpt_path=ckpt_path)
    return trainer


@pytest.fixture(scope="module")
def short_checkpoint(tmp_path_factory):
    """(budget, checkpoint): one step on sequences of 16 at a budget half way between `none` and `full` at
    length 32, saved. At 16 nothing is checkpointed, a plan that would run over the budget at 32."""
    probe = _callback("1GiB", policy="none")
    _fit_chain([probe], seq=32, max_steps=1)
    none_long, full_long = (make_plan(probe.cost, p).predicted_peak_bytes for p in ("none", "full"))
    budget = (none_long + full_long) // 2
    cb = _callback(budget)
    trainer = _fit_chain([cb], seq=16, max_steps=1)
    assert cb.plan.segments == () and cb.plan.fits, "the short sequences should need no checkpointing"
    path = tmp_path_factory.mktemp("resume") / "short.ckpt"
    trainer.save_checkpoint(path)
    return budget, path


def test_resume_on_longer_sequences_plans_them_and_every_step_is_within_the_budget(short_checkpoint, caplog):
    import logging

    budget, path = short_checkpoint
    cb, peaks = _callback(budget), StepPeaks()
    with caplog.at_level(logging.INFO):
        _fit_chain([cb, peaks], seq=32, max_steps=3, ckpt_path=path)
    assert (
        f"the plan in checkpoint {path} was made for batch shape (batch 8, tensors [8, 16], [8]); this batch has "
        "shape (batch 8, tensors [8, 32], [8]), so it is profiled and planned as any new shape"
    ) in caplog.text
    assert cb.profiled_steps == 1 and cb.plan.segments and cb.plan.fits
    assert len(peaks.peaks) == 2
    for step, peak in enumerate(peaks.peaks):
        assert peak <= budget, f"step {step} peaked at {peak} bytes, over the budget of {budget}"


def test_a_tampered_checkpoint_is_planned_again_naming_it(short_checkpoint, tmp_path, recwarn):
    budget, path = short_checkpoint
    ckpt = torch.load(path, weights_only=False)
    state = next(v for k, v in ckpt["callbacks"].items() if "ActivationCheckpointing" in k)
    state["plan"]["segments"] = [[0.0, 5.0]]  # floats: once silently truncated to a segment of every block
    tampered = tmp_path / "tampered.ckpt"
    torch.save(ckpt, tampered)
    cb = _callback(budget)
    _fit_chain([cb], seq=16, max_steps=2, ckpt_path=tampered)
    lines = [line for line in _lines(recwarn) if "does not match this run" in line]
    assert len(lines) == 1 and f"checkpoint {tampered} does not match this run: plan.segments[0][0] is 0.0" in lines[0]
    assert cb.profiled_steps == 1 and cb.plan.segments == () and cb.plan.fits
    problem = rf"checkpoint {re.escape(str(tampered))} does not match this run: plan\.segments\[0\]\[0\] is 0\.0"
    with pytest.raises(ValueError, match=rf"{problem} \(float\), not an int.* strict_resume=True, so stopping"):
        _fit_chain([_callback(budget, strict_resume=True)], seq=16, max_steps=2, ckpt_path=tampered)
