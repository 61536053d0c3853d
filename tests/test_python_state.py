"""Blocks whose forward writes Python state a recompute cannot replay (an attribute that decides a
branch, a list a step sums and clears, `random` draws) are found per block while profiling and stay
kept by every policy: training is bit-identical to training without the library, the plan's table
says why, a budget that only fits by checkpointing such a block fails before the first step, and
`allow_python_state` lets the user plan them as before."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from models import loop_steps
from oracles import all_plans, chainable, walk_peak
from test_policies import random_cost
from torch import nn

from lightning_ckpt import auto_checkpoint, make_plan
from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.engine.step_profile import profile_model
from lightning_ckpt.engine.target_plan import cost_at
from lightning_ckpt.planning.memory_model import predict_peak
from lightning_ckpt.planning.policies import InfeasibleBudgetError
from lightning_ckpt.planning.recompute_cost import recompute_cost
from lightning_ckpt.planning.segment_shapes import every_k_segments
from lightning_ckpt.profiling.memory.static_memory import static_memory

D, BATCH, N_BLOCKS, STATEFUL = 8, 8, 5, 2
REASONS = {
    "branch": "writes self.calls (0 -> 1)",
    "moe": "adds items of self.aux_losses (0 -> 1)",
    "random": "draws from Python's random",
}


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, hidden), nn.Linear(hidden, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.up(x).relu())


class Stateful(Block):
    """A block whose forward writes Python state: a counter deciding a branch, a list of router losses
    (as an MoE layer keeps them), or a draw from Python's `random`."""

    def __init__(self, kind: str, hidden: int) -> None:
        super().__init__(hidden)
        self.kind, self.calls, self.aux_losses = kind, 0, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if self.kind == "branch":
            self.calls += 1
            h = h.relu() if self.calls % 2 else h.tanh()
        elif self.kind == "moe":
            h = h.relu()
            self.aux_losses.append(h.square().mean())
        else:
            h = h.relu() * (1.0 + random.random())
        return x + self.down(h)


class Net(nn.Module):
    def __init__(self, kind: str, hidden: int = 4 * D, stateful_hidden: int = 4 * D) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(
            Stateful(kind, stateful_hidden) if i == STATEFUL else Block(hidden) for i in range(N_BLOCKS)
        )
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)


def _step_fn(model: Net):
    def step(batch):
        x, y = batch
        loss = (model(x) - y).square().mean()
        aux = model.blocks[STATEFUL].aux_losses
        if aux:  # the step sums the router losses and clears them, as an MoE training step does
            loss = loss + 0.01 * torch.stack(aux).sum()
            aux.clear()
        return loss

    return step


def _batches(n: int = 3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, D, generator=g), torch.randn(BATCH, generator=g)) for _ in range(n)]


def _train(model: Net, batches, handle=None):
    random.seed(0)
    return loop_steps(_step_fn(model), batches, torch.optim.SGD(model.parameters(), lr=0.05), handle)


@pytest.mark.parametrize("kind", ["branch", "moe", "random"])
def test_a_block_writing_python_state_is_kept_and_training_is_bit_identical(kind):
    plain = Net(kind)
    reference = _train(plain, _batches())
    model = Net(kind)
    random.seed(123)
    handle = auto_checkpoint(
        model, "1GiB", example_batch=_batches(1)[0], step_fn=_step_fn(model), blocks="blocks", policy="full",
        cost_metric="flops", verbose=False,
    )
    plan = handle.plan
    assert plan.checkpointed == tuple(i for i in range(N_BLOCKS) if i != STATEFUL)
    assert plan.rows[STATEFUL].kept_because == REASONS[kind]
    row = next(line for line in str(plan).splitlines() if line.split()[:1] == [str(STATEFUL)])
    assert row.split()[2] == "keep" and row.endswith(f"kept: {REASONS[kind]}")
    assert model.blocks[STATEFUL].calls == 0 and model.blocks[STATEFUL].aux_losses == []  # profiling left no trace
    losses = _train(model, _batches(), handle)
    assert all(torch.equal(a, b) for a, b in zip(losses, reference))
    ours, theirs = model.state_dict(), plain.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    handle.remove()


def _full_peak_without_the_hazard(kind: str, accumulate: bool = False) -> int:
    """The `full` plan's peak of a wide model, had its block no Python state: a budget that only fits
    by checkpointing that block (keeping it holds what it saves through the next block's backward). Planned
    with last step's gradients alive in the forward (`cost_at`): `auto_checkpoint` reads them so from a model
    that has gradients (`_with_gradients`); with `accumulate`, alive through the whole step."""
    model = Net(kind, hidden=32 * D, stateful_hidden=32 * D)
    batch = _batches(1)[0]
    profile = profile_model(model, list(model.blocks), _step_fn(model), batch, timing=False)
    cost = dataclasses.replace(cost_at(profile, BATCH, static_memory(model, [])), grads_accumulate=accumulate)
    assert cost.blocks[STATEFUL].unreplayable == (REASONS[kind],)
    plain = dataclasses.replace(cost, blocks=tuple(dataclasses.replace(b, unreplayable=()) for b in cost.blocks))
    budget = make_plan(plain, "full").predicted_peak_bytes
    assert make_plan(cost, "full").predicted_peak_bytes > budget  # every other block checkpointed: over it
    return budget


def _with_gradients(model: Net) -> Net:
    """`model` with the gradients of a step, as a loop that zeroes them after the forward has them at the next
    (a step of two samples: no block writes its Python state at that size)."""
    x, y = _batches(1)[0]
    _step_fn(model)((x[:2], y[:2])).backward()
    return model


# known miss: a profiling pass holds last step's gradients (kept to be put back) beside those its own backward
# makes, where the step frees them before its backward; at this budget no pass fits, so profiling refuses
# (naming the `full` plan's peak) before the planner can name the block. Strict: it fails once that is fixed.
GRADS_HELD_TWICE = pytest.mark.xfail(strict=True, reason="the profiling pass holds last step's gradients twice")


@GRADS_HELD_TWICE
@pytest.mark.parametrize("kind", ["branch", "moe"])
def test_a_budget_that_needs_the_block_checkpointed_fails_before_the_first_step(kind):
    budget = _full_peak_without_the_hazard(kind)
    model = _with_gradients(Net(kind, hidden=32 * D, stateful_hidden=32 * D))
    attribute = {"branch": r"writes self\.calls", "moe": r"adds items of self\.aux_losses"}[kind]
    with pytest.raises(InfeasibleBudgetError, match=rf"block 2 'blocks\.2' \({attribute}.*allow_python_state=True"):
        auto_checkpoint(
            model, budget, example_batch=_batches(1)[0], step_fn=_step_fn(model), blocks="blocks",
            cost_metric="flops", verbose=False,
        )
    allowed = auto_checkpoint(  # the user says the write is harmless: planned as before
        model, budget, example_batch=_batches(1)[0], step_fn=_step_fn(model), blocks="blocks", cost_metric="flops",
        verbose=False, allow_python_state=["blocks.2"],
    )
    assert STATEFUL in allowed.plan.checkpointed and allowed.plan.fits
    allowed.remove()


def test_allow_python_state_is_checked():
    model = Net("branch")
    with pytest.raises(ValueError, match=r"allow_python_state='yes' must be True, False or a list of block names"):
        auto_checkpoint(model, "1GiB", example_batch=_batches(1)[0], step_fn=_step_fn(model), blocks="blocks",
                        allow_python_state="yes")
    with pytest.raises(ValueError, match=r"allow_python_state names \['blocks\.9'\], which are not blocks"):
        auto_checkpoint(model, "1GiB", example_batch=_batches(1)[0], step_fn=_step_fn(model), blocks="blocks",
                        cost_metric="flops", allow_python_state=["blocks.9"], verbose=False)


# ----------------------------------------------------------------------------- planning


def _marked(cost: StepCost, kept: set[int]) -> StepCost:
    blocks = tuple(
        dataclasses.replace(b, unreplayable=(f"writes self.n{i} (0 -> 1)",) if i in kept else ())
        for i, b in enumerate(cost.blocks)
    )
    return dataclasses.replace(cost, blocks=blocks)


POLICY_RUNS = [
    ("none", {}), ("full", {}), ("sqrt", {}), ("every_k", {"every_k": 2}), ("every_k", {}), ("greedy", {}),
    ("optimal", {"max_levels": 1}), ("optimal", {"max_levels": 2}),
]


def _marked_case(seed: int, frac: float, n: int, marks: set[int]):
    """A random cost with the blocks in `marks` must-keep, and a budget `frac` of the way between the
    `full` and `none` peaks of the same cost unmarked -> (unmarked cost, cost, kept, budget)."""
    plain = random_cost(random.Random(seed), n)
    kept = {i for i in marks if i < n}
    lo, hi = (predict_peak(plain, s).peak_bytes for s in (every_k_segments(n, 1), []))
    return plain, _marked(plain, kept), kept, int(min(lo, hi) + frac * abs(hi - lo))


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10**6), frac=st.floats(0.0, 1.0), n=st.integers(1, 9), marks=st.sets(st.integers(0, 8)))
def test_no_policy_puts_a_must_keep_block_in_a_segment(seed, frac, n, marks):
    plain, cost, kept, budget = _marked_case(seed, frac, n, marks)
    for policy, extra in POLICY_RUNS:
        needs = policy in ("greedy", "optimal") or (policy == "every_k" and not extra)
        try:
            plan = make_plan(cost, policy, budget if needs else None, **extra)
        except InfeasibleBudgetError as err:
            assert not kept or "allow_python_state=True" in str(err)
            continue
        inside = {i for a, b in (*plan.segments, *plan.inner_segments) for i in range(a, b + 1)}
        assert not inside & kept, (policy, extra, plan.segments, plan.inner_segments, kept)
        assert all(plan.rows[i].kept_because for i in kept)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), frac=st.floats(0.0, 1.0), n=st.integers(1, 8), marks=st.sets(st.integers(0, 7)))
def test_optimal_with_must_keep_blocks_is_the_best_plan_that_keeps_them(seed, frac, n, marks):
    """Brute force over every plan that leaves the marked blocks out of segments."""
    plain, cost, kept, budget = _marked_case(seed, frac, n, marks)
    best = None
    for segs in all_plans(n):
        if not chainable(plain, segs) or any(a <= i <= b for a, b in segs for i in kept):
            continue
        peak = walk_peak(plain, segs).peak_bytes
        if peak <= budget and (best is None or (recompute_cost(plain, segs), peak) < best):
            best = (recompute_cost(plain, segs), peak)
    try:
        plan = make_plan(cost, "optimal", budget, max_levels=1)
    except InfeasibleBudgetError:
        assert best is None
        return
    assert best == (recompute_cost(plain, list(plan.segments)), plan.predicted_peak_bytes)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**6), frac=st.floats(0.0, 1.0), n=st.integers(1, 12))
def test_costs_without_must_keep_blocks_plan_as_before(seed, frac, n):
    """Marking a block must-keep that the plan keeps anyway changes nothing: same segments and peak."""
    cost = random_cost(random.Random(seed), n)
    lo, hi = (predict_peak(cost, s).peak_bytes for s in (every_k_segments(n, 1), []))
    budget = int(min(lo, hi) + frac * abs(hi - lo))
    for policy in ("greedy", "optimal"):
        try:
            plan = make_plan(cost, policy, budget, max_levels=1)
        except InfeasibleBudgetError:
            continue
        outside = set(range(n)) - set(plan.checkpointed)
        again = make_plan(_marked(cost, outside), policy, budget, max_levels=1)
        assert (again.recompute_flops, again.predicted_peak_bytes) == (plan.recompute_flops, plan.predicted_peak_bytes)
        if policy == "greedy":
            assert again.segments == plan.segments


def test_segments_given_by_hand_may_not_hold_a_must_keep_block():
    cost = _marked(random_cost(random.Random(0), 4), {1})
    with pytest.raises(ValueError, match=r"must stay kept: block 1 'b1' \(writes self\.n1 \(0 -> 1\)\)"):
        make_plan(cost, "manual", segments=[(0, 2)])


def test_the_watch_names_each_write_of_a_forward():
    import numpy as np

    from lightning_ckpt.profiling.forward_state.forward_hazards import PythonStateWatch

    class Writes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(2, 2)
            self.inner.flag, self.seen, self.mode = False, {}, "a"

        def forward(self, x):
            self.inner.flag = True
            self.seen["x"] = x
            return self.inner(x) * float(np.random.rand())

    block, quiet = Writes(), Block(4 * D)
    watch = PythonStateWatch(2)
    for i, b in enumerate((block, quiet)):
        watch.before(i, b)
        b(torch.ones(1, 2 if i == 0 else D))
        watch.after(i)
    assert watch.reasons == [
        {"writes self.inner.flag (False -> True)", "adds items of self.seen (0 -> 1)", "draws from numpy.random"},
        set(),
    ]


def test_the_callback_takes_allow_python_state():
    from lightning_ckpt import ActivationCheckpointing

    cb = ActivationCheckpointing(8, "1GiB", allow_python_state=["blocks.2"])
    assert cb._settings["allow_python_state"] == ("blocks.2",)
    with pytest.raises(ValueError, match=r"allow_python_state=1 must be True, False or a list of block names"):
        ActivationCheckpointing(8, "1GiB", allow_python_state=1)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10**6), frac=st.floats(0.0, 1.0), n=st.integers(1, 9), marks=st.sets(st.integers(0, 8)))
def test_the_multi_level_planner_keeps_must_keep_blocks_out_of_every_segment(seed, frac, n, marks):
    from lightning_ckpt.planning.nested_planner import solve_nested

    plain = random_cost(random.Random(seed), n)
    kept = {i for i in marks if i < n}
    lo, hi = (predict_peak(plain, s).peak_bytes for s in (every_k_segments(n, 1), []))
    budget = int(min(lo, hi) + frac * abs(hi - lo))
    found = solve_nested(_marked(plain, kept), budget, "flops", 3, slots=64)
    if found is not None:
        assert not {i for a, b in found.segments for i in range(a, b + 1)} & kept
        assert predict_peak(plain, found.segments, None, found.inner).peak_bytes <= budget


def test_what_a_strategys_hooks_keep_on_a_module_is_not_the_models_state():
    """DeepSpeed ZeRO-3's gather hooks count pending gradients on each module (`ds_grads_remaining`,
    `applied_pre_backward_ref_cnt`); they run again in a recompute by design, so they mark nothing.
    The same write under a name of the model's own marks its block."""
    from lightning_ckpt.profiling.forward_state.forward_hazards import PythonStateWatch

    block = torch.nn.Linear(2, 2)
    block.ds_grads_remaining, block.applied_pre_backward_ref_cnt, block.calls = 0, 0, 0
    watch = PythonStateWatch(1)
    watch.before(0, block)
    block.ds_grads_remaining += 1
    block.applied_pre_backward_ref_cnt += 1
    watch.after(0)
    assert watch.reasons[0] == set()
    watch.before(0, block)
    block.calls += 1
    watch.after(0)
    assert watch.reasons[0] == {"writes self.calls (0 -> 1)"}


class WritesAtLargerBatches(Block):
    """Writes a counter only for batches of more than two samples: the smaller probe does not see it."""

    def __init__(self, hidden: int) -> None:
        super().__init__(hidden)
        self.large_batches, self.aux_losses = 0, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 2:
            self.large_batches += 1
        return super().forward(x)


def test_a_write_only_the_larger_probe_sees_keeps_the_block():
    """Probes of 1 and 2 samples, check of 4: only the check sees the write. The block is kept at the batch
    size planned (8) even where every other block is checkpointed, and the plan says why."""
    model = Net("branch")
    model.blocks[STATEFUL] = WritesAtLargerBatches(4 * D)
    blocks = list(model.blocks)
    profile = profile_model(model, blocks, _step_fn(model), _batches(1)[0], probe_batch_sizes=(1, 2), check_batch_size=4,
                            timing=False)
    assert profile.probes[0].blocks[STATEFUL].unreplayable == ()
    cost = cost_at(profile, BATCH, static_memory(model, []))
    assert cost.blocks[STATEFUL].unreplayable == ("writes self.large_batches (0 -> 1)",)
    plan = make_plan(cost, "full")
    assert STATEFUL not in plan.checkpointed and len(plan.checkpointed) == N_BLOCKS - 1
    assert "large_batches" in str(plan)


def test_the_refusal_names_a_write_only_the_larger_probe_sees():
    """A budget that the kept block makes too small for the batch: the error names the write the check slice saw.
    The step accumulates (every gradient alive through it, none yet while profiling, so the check slice has room)."""
    model = Net("branch", hidden=32 * D, stateful_hidden=32 * D)
    model.blocks[STATEFUL] = WritesAtLargerBatches(32 * D)
    with pytest.raises(InfeasibleBudgetError, match=r"block 2 'blocks\.2' \(writes self\.large_batches \(0 -> 1\)\).*"
                       r"allow_python_state=True"):
        auto_checkpoint(
            model, _full_peak_without_the_hazard("branch", accumulate=True), example_batch=_batches(1)[0],
            step_fn=_step_fn(model), blocks="blocks", cost_metric="flops", verbose=False, probe_batch_sizes=(1, 2),
            check_batch_size=4, accumulate_grad_batches=2,
        )
