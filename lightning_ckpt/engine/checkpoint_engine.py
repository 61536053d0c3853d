"""`CheckpointEngine`: profile, plan, apply, re-plan per batch shape and undo, for every front end.

The callback, `auto_checkpoint` (plain loops, Fabric) and any other front end own only what is
theirs (where batches come from, what a step is, how to log); the engine owns the rest:

- the blocks and what was profiled of them, kept while the blocks stay the same;
- a plan per batch shape (`shape_plans.ShapePlans`), made on rank 0 and broadcast to every rank; when
  the ranks' batches differ in shape every rank runs the plan of the elementwise-largest;
- the applied plan, switched when the shape changes (hooks only, kept when the regions are the same).

A front end hands it a `StepDriver` (`engine.engine_inputs`): one step's profile on slices of a batch, the static memory,
the collectives and the messages. Nothing here imports Lightning.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from lightning_ckpt.apply.segments import AppliedPlan
from lightning_ckpt.engine.engine_inputs import EngineSettings, StepDriver, allowed_python_state, block_signature, unchained
from lightning_ckpt.engine.rank_zero import plan_on_rank_zero
from lightning_ckpt.apply.recompute_errors import explain_checkpoint_error
from lightning_ckpt.engine.measured_steps import MeasuredStep, Reserves, judge_step
from lightning_ckpt.engine.model_prep import Prepared, prepare_model
from lightning_ckpt.engine.planned_costs import PlannedCosts
from lightning_ckpt.engine.target_plan import (batch_error, check_host_memory, fits_target, plan_for_max_at, plan_for_target,
                                               refuse_state_over_budget, with_offloaded)
from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.costs.linear_fit import Profile
from lightning_ckpt.costs.machine_rates import MachineRates
from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.planning.policies import InfeasibleBudgetError, python_state_note
from lightning_ckpt.profiling.forward_state.applied_marks import refuse_marked
from lightning_ckpt.profiling.structure.layer_skipping import find_layer_skipping
from lightning_ckpt.profiling.passes.profile_budget import ProfileBudget, ProfileBudgetError, batch_bytes
from lightning_ckpt.profiling.structure.shapes import BatchShape, shape_of
from lightning_ckpt.profiling.memory.static_memory import StaticMemory
from lightning_ckpt.engine.shape_plans import CostSource, ShapeDecision, ShapePlans, largest_shape, met_again, same_regions
from lightning_ckpt.engine.shape_plans import describe as describe_decision
from lightning_ckpt.engine.step_calls import new_step, read_calls
from lightning_ckpt.engine.step_grads import GradFields, grad_fields
from lightning_ckpt.engine.step_grads import follow as follow_grads


class CheckpointEngine:
    """The plan for each batch's shape, applied to the blocks; see the module docstring."""

    def __init__(self, settings: EngineSettings, driver: StepDriver, told: set[str] | None = None) -> None:
        self.settings, self.driver = settings, driver
        self.plan: Plan | None = None
        self.profile: Profile | None = None  # the first profile (the first batch's shape)
        self.blocks: list[torch.nn.Module] = []
        self.block_names: list[str] = []
        self.shape: BatchShape | None = None  # the shape the applied plan was made for
        self.profiled_steps = 0  # real batches profiled
        self.signature: list | None = None
        # once, before the first plan: (shape, rank 0's static memory, grads_accumulate) -> a checkpoint's `ResumedPlan`
        self.resume_with: Callable[[BatchShape, Callable[[], StaticMemory], bool], Any] | None = None
        self._shapes: ShapePlans | None = None
        self._prepared: Prepared | None = None  # what `engine.model_prep.prepare_model` changed for this fit
        # what was said of the model (hazards, settings changed), each once: shared by the engines planning
        # the candidate chains of one model (`chain_levels.engine_for_chain`)
        self._told: set[str] = set() if told is None else told
        self._applied: AppliedPlan | None = None
        self._static: StaticMemory | None = None
        self._costs = PlannedCosts()  # each planned shape's cost while its plan is cached; plans of equal costs
        self._cost: StepCost | None = None
        self._rates: MachineRates | None = None
        self._find_max = False
        self._batch_idx = 0
        self.reserves = Reserves()  # budget held back per shape for memory a measured step showed (`measured`)
        self._held_batch_bytes = 0  # the batch whose prefixes are profiled (`_profile_budget`)
        self._grads: GradFields | None = None  # the driver's gradients the cached plans were made for (`step_grads`)
        # `block_signature` of the modules `bind` was given, and each of them (weakly: identity, not life)
        self._bound: tuple[list, list[weakref.ref]] | None = None
        self._calls_read = False  # whether `blocks` is the chain of calls read off a step (`read_calls`)
        self._odd_calls_told = False
        self._skipping = False  # the model skips layers at random in training (`profiling.structure.layer_skipping`)

    # ------------------------------------------------------------------ binding and state

    def bind(
        self, blocks: list[torch.nn.Module], names: list[str], settings: EngineSettings | None = None,
        model: torch.nn.Module | None = None,
    ) -> None:
        """Plan these blocks from now on: what was profiled is kept while the blocks are the same;
        plans are made again (the budget, the optimizer or the settings may have changed). With `model`
        (the module the blocks belong to), what makes its recompute differ from its forward is turned
        off until `close` (`engine.model_prep.prepare_model`: HF's `use_cache`, HF's own checkpointing)."""
        self.close()
        signature = block_signature(names, blocks)
        same = self._bound is not None and self._bound[0] == signature and [r() for r in self._bound[1]] == blocks
        if self._shapes is None or not same:  # other blocks (another model's too): what was profiled is void
            self.profile, self._costs, self._cost = None, PlannedCosts(), None
            self._shapes = ShapePlans(self._profile_shape, self._plan_shape, room_fn=self._pass_room)
            self._calls_read = False
        self._shapes.forget_plans()
        self.settings = settings or self.settings
        self._bound = signature, [weakref.ref(b) for b in blocks]
        if not self._calls_read:
            self.blocks, self.block_names, self.signature = list(blocks), list(names), signature
        self._static, self.shape = None, None
        self._skipping = model is not None and bool(find_layer_skipping(model))  # LayerDrop: one block per segment
        if model is not None:
            self._prepared = prepare_model(
                model, keep_hf_checkpointing=self.settings.keep_hf_checkpointing, warn=self._warn_once
            )
            for hazard in self._prepared.hazards:  # what it can only report, said once
                self._warn_once(f"lightning-ckpt: {hazard}.")

    def _warn_once(self, message: str) -> None:
        if message not in self._told:
            self._told.add(message)
            self.driver.warn(message)

    def close(self) -> None:
        """Remove the applied plan and put back what `bind` changed on the model."""
        self.remove()
        if self._prepared is not None:
            self._prepared.restore()
            self._prepared = None

    def release(self) -> None:
        """Let go of the model (its fit ended): `close`, and the blocks dropped with what was profiled of
        them; the last plan, profile and cost stay readable, and the next `bind` starts as the first did."""
        self.close()
        self.blocks, self._bound, self._calls_read = [], None, False

    def measured(self, peak_bytes: int, what: str = "measured") -> MeasuredStep:
        """The step just run under the applied plan peaked at `peak_bytes` here (collective: every rank calls it);
        over the budget, its shape is planned again now with the excess held in reserve (`engine.measured_steps`)."""
        peak = max(self.driver.all_gather(int(peak_bytes)))
        assert self.shape is not None and self.plan is not None, "a step was measured before any plan was applied"
        return judge_step(self.reserves, self.shape, self.plan, peak, self.settings.budget_bytes, what, self._replan)

    def _replan(self, shape: BatchShape) -> Plan | None:
        """Plan `shape` again now (rank 0 plans, every rank applies); when none fits, its plan stays, the error raised."""
        old, self.shape = self._shapes.forget(shape), None  # not in place: `step_shape` plans it again
        try:
            decision = self.step_shape(shape)
        except (InfeasibleBudgetError, ValueError):
            if old is not None:
                self._shapes.settle(shape, old.plan)
            self.shape = shape  # its plan was never taken off
            raise
        return None if decision is None else decision.plan

    @property
    def plan_measured(self) -> bool:
        """Whether a step under the applied plan was judged (`measured`): not for a shape's first plan, nor for
        each plan made for it again (the step's gradients changed, a reserve, a resumed plan)."""
        return self.reserves.was_measured(self.shape, self.plan)

    def explain(self, err: BaseException, model: torch.nn.Module | None = None) -> BaseException:
        """`err` made clear when it came from a recompute that did not repeat its forward (else `err`)."""
        return explain_checkpoint_error(err, model) if self.applied else err

    @property
    def cost(self) -> StepCost | None:
        """The step's cost the applied plan was made from."""
        return self._cost

    @property
    def applied(self) -> bool:
        return self._applied is not None and self._applied.active

    @property
    def plans(self) -> dict[BatchShape, Plan]:
        """The plan made for every batch shape since `bind`."""
        return {} if self._shapes is None else {d.shape: d.plan for d in self._shapes.plans.values()}

    @property
    def profile_shape(self) -> BatchShape | None:
        """The batch shape `profile` was made at (None without one)."""
        families = [] if self._shapes is None else self._shapes.families.values()
        return next((s for f in families for s, p, _ in f.profiles.values() if p is self.profile), None)

    @property
    def profile_runs(self) -> int:
        """How many shapes were profiled (each on a few small slices of a batch)."""
        return 0 if self._shapes is None else self._shapes.profile_runs

    @property
    def slice_error(self) -> str | None:
        return None if self._shapes is None else self._shapes.slice_error

    def describe(self, decision: ShapeDecision) -> str:
        """One line on how `decision` was reached (for logs)."""
        assert self._shapes is not None
        return describe_decision(decision, self._shapes)

    def remove(self) -> None:
        """Take the applied plan off the blocks (they run as they were)."""
        if self._applied is not None:
            self._applied.remove()
            self._applied = None

    # ------------------------------------------------------------------ planning

    def plan_max(self, batch: Any) -> Plan:
        """Profile `batch` and plan the largest batch (a multiple of `batch_multiple`) whose plan fits;
        nothing is applied: batches come at that size and are planned when they arrive."""
        self._require_bound()
        read_calls(self, batch)
        self._find_max = True
        try:
            plan = self._plan_everywhere(batch, 0, [shape_of(batch)]).plan
        finally:
            self._find_max = False
        self._shapes.forget_plans()
        self.plan = plan
        return plan

    def preview(self, batch: Any, batch_size: int | None = None) -> Plan:
        """Profile `batch` and plan its shape (at `batch_size` when given) without applying anything: the
        plan is cached for when its batches come (`step`, `step_shape`). Collective, as `step`."""
        self._require_bound()
        read_calls(self, batch)
        self.remove()
        shape = shape_of(batch)
        if batch_size is None or batch_size == shape.batch_size:
            return self._plan_everywhere(batch, 0, self.driver.all_gather(shape)).plan
        self.prime(batch)
        at = shape.with_batch_size(batch_size)
        plan = plan_on_rank_zero(lambda: self._shapes.plan_for(None, at).plan, self.driver.broadcast, self.driver.rank)
        return self._shapes.settle(at, plan).plan

    def step(self, batch: Any, batch_idx: int = 0) -> ShapeDecision | None:
        """Make the plan for `batch`'s shape the applied one, before its step runs; None when it already is.

        Collective on several ranks: every rank calls it at every step (the shapes are gathered)."""
        self._require_bound()
        if not self._calls_read:  # read once after `bind`
            read_calls(self, batch)
        if self._applied is not None:  # a plan counts its block calls
            new_step(self)
        follow_grads(self)  # plans count the gradients a step holds as the driver says now
        own = shape_of(batch)  # read once: passed on to what plans it
        shapes = self.driver.all_gather(own)  # every rank's, so that all decide alike
        shape = shapes[0] if len(shapes) == 1 or len(set(shapes)) == 1 else largest_shape(shapes)
        if shape == self.shape and self._in_place(shape):  # the shape of the step before: nothing to do
            return None
        decision = self._plan_everywhere(batch, batch_idx, shapes, own)
        self._switch_to(decision, shape)
        return decision

    def prime(self, batch: Any) -> None:
        """Profile `batch` (every rank) without planning: plans at other batch sizes of its shape
        come from this profile (`step_shape`)."""
        self._require_bound()
        read_calls(self, batch)
        self.remove()
        shape = shape_of(batch)
        if shape not in self._shapes.profiled_shapes:
            self._shapes.profile_own(batch, shape)

    def step_shape(self, shape: BatchShape) -> ShapeDecision | None:
        """Make the plan for `shape` the applied one, from what was profiled (no batch needed: a
        profiled shape at another batch size); None when it already is."""
        self._require_bound()
        new_step(self)
        follow_grads(self)  # plans count the gradients a step holds as the driver says now
        if self._in_place(shape):
            return None
        hit = self._shapes.cached(shape)
        if hit is not None:
            decision = met_again(hit)
        else:
            plan = plan_on_rank_zero(lambda: self._shapes.plan_for(None, shape).plan, self.driver.broadcast, self.driver.rank)
            decision = self._shapes.settle(shape, plan)
        self._switch_to(decision, shape)
        return decision

    def _in_place(self, shape: BatchShape) -> bool:
        """The plan for `shape` is the one in effect (applied, or planned only while the model's own
        checkpointing stays in charge)."""
        kept_off = self._prepared is not None and not self._prepared.may_apply
        return shape == self.shape and self.plan is not None and (self._applied is not None or kept_off)

    def _require_bound(self) -> None:
        if self._bound is None:
            raise RuntimeError("the engine has no blocks (none bound yet, or released): call bind(blocks, names) first.")

    def _switch_to(self, decision: ShapeDecision, shape: BatchShape) -> None:
        plan = decision.plan
        if self._prepared is not None and not self._prepared.may_apply:
            pass  # the model's own checkpointing stays in charge (keep_hf_checkpointing): planned, not applied
        elif self._applied is None or not same_regions(plan, self.plan):
            self.remove()
            self._applied = self.driver.apply(self.blocks, self.block_names, plan, self.settings.guard_batchnorm)
        self.plan, self.shape = plan, shape
        self._cost = self._costs.by_shape.get(shape, self._cost)

    def _plan_everywhere(
        self, batch: Any, batch_idx: int, shapes: list[BatchShape], shape: BatchShape | None = None
    ) -> ShapeDecision:
        """The plan for `batch`'s shape (`shape`, when known): cached, resumed, or profiled (every rank) and
        planned on rank 0."""
        shape = shape_of(batch) if shape is None else shape
        if len(set(shapes)) > 1:  # the ranks' batches differ: every rank runs the plan of the largest
            return self._plan_largest(batch, shape, shapes, batch_idx)
        if (hit := self._shapes.cached(shape)) is not None:
            return met_again(hit)
        self._shapes.grow_corners = len(shapes) == 1  # one process: see `ShapePlans.grow_corners`
        self._batch_idx = batch_idx  # profiling takes the applied plan off first (`_profile_shape`): a shape costed
        # from a fit keeps it, and when its plan has the same regions it is not applied again

        def rank_zero_static() -> StaticMemory:  # every rank checks a resumed plan alike: against rank 0's
            if self.driver.rank == 0 and self._static is None:
                self._static = self.driver.static_memory()
            return self.driver.broadcast(self._static if self.driver.rank == 0 else None)

        def resumed_or_planned() -> Plan | None:
            resume, self.resume_with = self.resume_with, None
            resumed = None if resume is None else resume(shape, rank_zero_static, self.driver.grads_accumulate)
            if resumed is not None and resumed.profile is not None:  # registered at the shape it was made at
                self._shapes.add_profile(resumed.profile_shape, resumed.profile)
                self.profile = resumed.profile
            if resumed is not None and resumed.plan is not None:  # checked for this very shape: no profile
                check_host_memory(static := rank_zero_static(), self.settings.request())  # host memory as planned
                self._costs.by_shape[shape] = resumed.cost
                return with_offloaded(resumed.plan, static)
            return self._shapes.plan_for(batch, shape).plan

        try:
            plan = plan_on_rank_zero(resumed_or_planned, self.driver.broadcast, self.driver.rank)
        except BaseException:
            self.remove()  # no plan for this shape: the blocks run as they were
            raise
        return self._shapes.settle(shape, plan)

    def _plan_largest(self, batch: Any, shape: BatchShape, shapes: list[BatchShape], batch_idx: int) -> ShapeDecision:
        """The plan of the ranks' largest shape on every rank. When some rank's shape was never
        profiled, every rank profiles its own batch (collectively, as sharded parameters are gathered)
        and all profiles are shared before rank 0 plans."""
        largest = largest_shape(shapes)
        hit = self._shapes.cached(largest)
        if hit is not None:
            return met_again(hit)
        self._batch_idx = batch_idx
        self.remove()
        if any(s not in self._shapes.profiled_shapes for s in shapes):
            profile = None
            try:
                profile = self._shapes.profile_own(batch, shape)
            except Exception as err:  # noqa: BLE001 - every rank must reach the exchange below
                self.driver.warn(f"lightning-ckpt: rank {self.driver.rank} failed to profile ({err}).")
            mine = (shape, None if profile is None else profile.to_dict())
            for other, data in self.driver.all_gather(mine):
                if data is not None:
                    self._shapes.add_profile(other, Profile.from_dict(data))
        plan = plan_on_rank_zero(lambda: self._shapes.plan_for(None, largest).plan, self.driver.broadcast, self.driver.rank)
        return self._shapes.settle(largest, plan)

    def _profile_shape(self, batch: Any, own: bool) -> Profile:
        """Profile the blocks on slices of `batch` (`own`: the batch of the step about to run; else a
        prefix of it at a shorter length)."""
        s = self.settings
        self.remove()  # profiling runs the model as it is without a plan
        refuse_marked(self.blocks, self.block_names, "profile the blocks")  # another plan runs on them
        try:
            profile = self.driver.profile(
                batch, self.blocks, self.block_names, batch_idx=self._batch_idx, probes=s.probe_batch_sizes,
                check=s.check_batch_size, rates=self._rates,
                calibrate_keeps=own and self._rates is None and s.granularity == "op" and s.cost_metric == "time",
                time_blocks=s.cost_metric == "ms",  # only that metric reads the blocks' measured forward times
                budget=self._profile_budget(batch, own),
            )
        except ProfileBudgetError as err:  # no profile fits: as a plan that cannot (the same error on every rank)
            raise InfeasibleBudgetError(f"the training batch of shape ({shape_of(batch).describe()}): {err}") from None
        profile = allowed_python_state(profile, s.allow_python_state, self.block_names)
        profile = unchained(profile) if self._skipping else profile
        self.profiled_steps += own
        if self._rates is None:
            self._rates = profile.probes[0].rates
        if self.profile is None:
            self.profile = profile
        return profile

    def _profile_budget(self, batch: Any, own: bool) -> ProfileBudget:
        """Profiling's room (`profiling.passes.profile_budget`): the budget less the static memory (optimizer state
        once it exists) and, beside a prefix of the step's batch, that batch."""
        self._static = self._static or self.driver.static_memory()
        refuse_state_over_budget(self._static, self.settings.budget_bytes, f"the training batch of shape ({shape_of(batch).describe()})")
        self._held_batch_bytes = batch_bytes(batch) if own else self._held_batch_bytes
        state = getattr(self.driver, "optimizer_state_exists", lambda: True)()  # none before the first step
        held = (0 if own else self._held_batch_bytes) - (0 if state else self._static.optimizer_state_bytes)
        return ProfileBudget(self.settings.budget_bytes, self._static.resident_bytes + held, info=self.driver.info)

    def longest_length(self, shape: BatchShape | None = None) -> int | None:
        """The longest sequence (or packed row) at `shape`'s batch size whose best plan fits the budget, from
        the profiles alone (default: the applied plan's shape); None when its length was never fitted."""
        self._require_bound()
        shape = shape or self.shape
        if shape is None or self.settings.budget_bytes is None:
            return None
        static = self._static or self.driver.static_memory()
        request = self.settings.request()

        def fits(cost_of: Callable[..., StepCost], at: BatchShape) -> bool:
            costs = CostSource(cost_of, *grad_fields(self.driver))
            return fits_target(costs, static, self.reserves.request(request, at), at.batch_size)

        return self._shapes.longest_length(shape, fits)

    def _pass_room(self, batch: Any) -> int | None:
        """The bytes a profiling pass may hold beside `batch` and what stays resident (None: no budget)."""
        if self.settings.budget_bytes is None:
            return None
        budget = self._profile_budget(batch, True)
        return budget.budget_bytes - budget.resident_bytes - batch_bytes(batch)

    def _held_note(self) -> str:
        """`python_state_note` of the blocks kept for the Python state they write, seen in any pass of the profile."""
        return python_state_note(self.profile.at(self.profile.probes[-1].batch_size))

    def _plan_shape(self, cost_of: Callable[..., StepCost], shape: BatchShape) -> Plan | None:
        """Rank 0's plan at `shape` from `cost_of` (None on the other ranks, which take rank 0's)."""
        if self.driver.rank != 0:
            return None
        if self._static is None:
            self._static = self.driver.static_memory()
        request = self.reserves.request(self.settings.request(), shape)
        costs = CostSource(cost_of, *grad_fields(self.driver))
        if self._find_max:
            plan, cost = plan_for_max_at(
                costs, self._static, request, self.settings.batch_multiple, shape, self._held_note, self.driver.info
            )
        else:
            make = functools.partial(plan_for_target, costs, self._static, request, shape.batch_size)
            try:  # the plan of a shape whose cost equals an earlier one's is that shape's (`planned_costs`)
                plan, cost = self._costs.plan(cost_of, shape, (request, self._static, costs.grad_fields), make)
            except InfeasibleBudgetError as err:
                note = "" if "allow_python_state" in str(err) else self._held_note()
                longest = self.longest_length(shape) if shape.batch_size == 1 else None
                raise batch_error(err, shape, note, longest) from None
        self._costs.keep(shape, cost, self._shapes.is_cached)
        self._cost = cost
        return plan
