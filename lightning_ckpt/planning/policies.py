"""Choose which blocks to checkpoint and how to group them into segments.

Policies: `none`, `full`, `every_k`, `sqrt`, `greedy` and `optimal`. `optimal` is an
exact dynamic program over the chain for the memory model of `memory_model`: the
least recompute whose predicted peak fits the budget (ties: the lower peak); past its
time limit (2 s by default) the best plan found, with a proven gap to the optimum.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence

from lightning_ckpt.planning.chain_planner import ChainSolution, solve_chain
from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.costs.budget_error import InfeasibleBudgetError
from lightning_ckpt.planning.memory_model import (
    predict_peak,
    segment_of,
    validate_segments,
)
from lightning_ckpt.planning.nested_model import recompute_counts, validate_nested
from lightning_ckpt.planning.nested_planner import NESTED_MAX_BLOCKS, least_nested_recompute, solve_nested
from lightning_ckpt.planning.op_options import (
    GRANULARITIES,
    Keeps,
    describe_keeps,
    kept_bytes,
    kept_value,
    validate_keeps,
)
from lightning_ckpt.planning.plan import BlockRow, Plan
from lightning_ckpt.units import format_bytes
from lightning_ckpt.planning.segment_shapes import (
    chainable,
    every_k_segments,
    kept_blocks_in,
    kept_phrase,
    must_keep,
    runs_to_segments,
    split_unchainable,
    sqrt_segments,
)
from lightning_ckpt.planning.recompute_cost import (
    block_recompute,
    metric_rates,
    plan_recompute,
    recompute_cost,
)

POLICIES = ("none", "full", "every_k", "sqrt", "greedy", "optimal")


# ----------------------------------------------------------------------------- greedy


def greedy_segments(cost: StepCost, budget_bytes: int, metric: str = "flops") -> list[tuple[int, int]]:
    """Checkpoint blocks in order of bytes freed per unit of recompute until the plan fits.

    After each added block both groupings (one segment per block, merged runs) are
    tried and the first that fits wins.
    """
    rates = metric_rates(cost, metric)
    n = cost.n_blocks

    def ratio(i: int) -> float:
        b = cost.blocks[i]
        freed = b.saved_bytes - b.input_bytes
        c = block_recompute(b, metric, rates)
        if c > 0:
            return freed / c
        return math.inf if freed > 0 else -math.inf

    order = sorted(set(range(n)) - set(must_keep(cost)), key=lambda i: (-ratio(i), i))
    chosen: list[int] = []
    if predict_peak(cost, []).peak_bytes <= budget_bytes:
        return []
    for i in order:
        chosen.append(i)
        for merge in (False, True):
            segs = split_unchainable(cost, runs_to_segments(chosen, merge))
            if predict_peak(cost, segs).peak_bytes <= budget_bytes:
                return segs
    raise InfeasibleBudgetError(_infeasible_message(cost, budget_bytes, "greedy"))


# ----------------------------------------------------------------------------- optimal


def optimal_segments(
    cost: StepCost, budget_bytes: int, metric: str = "flops", max_segment_blocks: int | None = None
) -> list[tuple[int, int]]:
    """Exact minimum-recompute plan under the memory model; among those, the lowest peak.

    Solved by `chain_planner.solve_chain`, a backward Pareto DP over (suffix demand,
    recompute) on the element form of `memory_model`, with no time limit; tests/oracles.py
    holds the brute force and the reference DP it is checked against.
    """
    return optimal_choice(cost, budget_bytes, metric, max_segment_blocks, time_limit_s=None)[0]


def optimal_choice(
    cost: StepCost, budget_bytes: int, metric: str = "flops", max_segment_blocks: int | None = None,
    granularity: str = "block", time_limit_s: float | None = 2.0,
) -> tuple[list[tuple[int, int]], dict]:
    """`optimal_segments` and, at granularity "op", the op calls kept per block (`op_options`).

    time_limit_s: the planner is exact when it finishes within this many seconds (chains of
    hundreds of blocks take well under one); past it, it returns the best plan found, whose
    distance to the optimum it proves (`solve_chain`, `Plan.gap`). None: no limit.
    """
    found = _optimal(cost, budget_bytes, metric, max_segment_blocks, granularity, time_limit_s)
    return found.segments, found.keeps


def _optimal(
    cost: StepCost, budget_bytes: int, metric: str, max_segment_blocks: int | None, granularity: str,
    time_limit_s: float | None,
) -> ChainSolution:
    if granularity == "op" and not any(b.ops for b in cost.blocks):
        raise ValueError(
            "granularity='op' plans which op outputs each block keeps, but this profile has no per-op costs "
            "(BlockCost.ops is empty for every block). Profile with the per-op profile (profile_model records it), "
            "or use granularity='block'."
        )
    found = solve_chain(cost, budget_bytes, metric, max_segment_blocks, granularity=granularity, time_limit_s=time_limit_s)
    if found is None:
        raise InfeasibleBudgetError(_infeasible_message(cost, budget_bytes, "optimal"))
    return found


# ----------------------------------------------------------------------------- entry point


def _infeasible_message(cost: StepCost, budget_bytes: int, policy: str, max_levels: int = 1) -> str:
    floor = cost.static_bytes + cost.device_grad_bytes + cost.optimizer_transient_bytes
    if policy != "optimal":
        levels = ""
    elif max_levels > 1 and cost.n_blocks <= NESTED_MAX_BLOCKS:
        levels = f" (with segments nested up to {max_levels} levels deep)"
    elif max_levels > 1:
        levels = (
            f" (nested segments were not searched: the chain has {cost.n_blocks} blocks, over the "
            f"{NESTED_MAX_BLOCKS} the multi-level planner takes)"
        )
    else:
        levels = " (max_levels=1: raise it to let segments be rebuilt in nested segments, which holds fewer boundaries)"
    held = python_state_note(cost)
    return (
        f"policy={policy!r} found no plan for batch_size={cost.batch_size} within memory_budget="
        f"{format_bytes(budget_bytes)}: parameters, gradients and optimizer state alone take "
        f"{format_bytes(floor)} and no choice of checkpointed blocks{levels} brings the activations under the rest. "
        f"Lower target_batch_size or raise memory_budget.{held}"
    )


def python_state_note(cost: StepCost) -> str:
    """For a budget that does not fit: the blocks kept because their forward writes Python state
    (`must_keep`), what they write and what to do; "" when there are none."""
    kept = must_keep(cost)
    return "" if not kept else (
        f" Blocks whose forward writes Python state a recompute cannot replay stay kept, never checkpointed: "
        f"{kept_phrase(cost, kept)}. If that write is harmless when repeated (a counter nothing reads, a "
        "list cleared every step), pass allow_python_state=True (or the block names) to let them be checkpointed;"
        " otherwise move the write out of the block's forward."
    )


def nested_slots(n_blocks: int, single_level_fits: bool) -> int:
    """Memory slots of the multi-level search (`nested_planner`: its work grows as n^3 x slots).

    1024 up to 48 blocks, fewer past them. When a single-level plan fits, a quarter as many
    (256 at 48 blocks: 0.2 s there against 0.4-0.55 s of CPU time on this project's machine): nesting
    can then only recompute less, and on the two examples at nine budgets from `full` to `none` the
    finer search found no cheaper plan the coarser one missed (it found the CNN's at `full`'s peak
    at both). No bound rules the search out: nesting saves boundary bytes at almost no recompute,
    and the single-level optimum still falls with every MiB added (the encoder's by 0.15 ms)."""
    slots = max(256, min(1024, 1024 * 48 // max(1, n_blocks)))
    return max(64, slots // 4) if single_level_fits else slots


def optimal_nested(
    cost: StepCost, budget_bytes: int, metric: str = "flops", granularity: str = "block",
    time_limit_s: float | None = 2.0, max_levels: int = 2,
) -> tuple[ChainSolution | None, tuple[tuple[int, int], ...]]:
    """The exact single-level optimum (`solve_chain`), replaced by a multi-level plan
    (`nested_planner`) only when that one fits and recomputes strictly less, or when no
    single-level plan fits. Returns (the single-level solution or None, the inner segments);
    with inner segments the solution's segments and gap are the multi-level plan's."""
    try:
        plain = _optimal(cost, budget_bytes, metric, None, granularity, time_limit_s)
    except InfeasibleBudgetError:
        plain = None
    if max_levels < 2 or not 0 < cost.n_blocks <= NESTED_MAX_BLOCKS or (plain is not None and not plain.segments):
        return plain, ()
    if plain is not None and _nesting_cannot_win(cost, plain, metric):
        return plain, ()
    nested = solve_nested(cost, budget_bytes, metric, max_levels, slots=nested_slots(cost.n_blocks, plain is not None))
    if nested is None or not nested.inner or kept_blocks_in(cost, nested.segments):
        return plain, ()
    ours = recompute_cost(cost, nested.segments, metric, None, nested.inner)
    if plain is not None and not ours < recompute_cost(cost, plain.segments, metric, plain.keeps) * (1 - 1e-12):
        return plain, ()
    peak = predict_peak(cost, nested.segments, None, nested.inner).peak_bytes
    if peak > budget_bytes:  # pragma: no cover - the slots round every need up
        return plain, ()
    return ChainSolution(ours, peak, list(nested.segments)), nested.inner


def _nesting_cannot_win(cost: StepCost, plain: ChainSolution, metric: str) -> bool:
    """Whether every plan with an inner segment recomputes more than `plain` by a margin far above rounding
    (`nested_planner.least_nested_recompute`), so that the multi-level search could only return `plain`."""
    found = least_nested_recompute(cost, metric)
    if found is None:
        return False
    bound, scale = found
    ours = recompute_cost(cost, plain.segments, metric, plain.keeps)
    return ours >= 0 and bound - ours > 1e-9 * (scale + abs(ours))


class PartialStepWarning(UserWarning):
    """A plan was made against a budget for a step cost without its static memory."""


def warn_without_static(cost: StepCost) -> None:
    """Warn when `cost` has trainable blocks but no static memory: the budget is then compared with the
    activations and gradients only, and parameters and optimizer state are missing from the peak."""
    if cost.static_bytes == 0 and (cost.outside_grad_bytes or any(b.grad_bytes for b in cost.blocks)):
        warnings.warn(
            "make_plan got a StepCost with static_bytes=0 but trainable parameters: parameters, buffers and "
            "optimizer state are not in its predicted peak, so the plan may not fit the budget. Build the cost "
            "with lightning_ckpt.step_cost(profile, batch_size, static_memory(model, [optimizer])) (or pass "
            "static_bytes= to Profile.at); auto_checkpoint and the callback do this for you.",
            PartialStepWarning, stacklevel=3,
        )


def make_plan(
    cost: StepCost,
    policy: str = "optimal",
    budget_bytes: int | None = None,
    every_k: int | None = None,
    metric: str = "flops",
    segments: Sequence[tuple[int, int]] | None = None,
    granularity: str = "block",
    keeps: Keeps | None = None,
    time_limit_s: float | None = 2.0,
    max_levels: int = 2,
    inner_segments: Sequence[tuple[int, int]] = (),
) -> Plan:
    """Build the `Plan` of `policy` for `cost`.

    granularity="op" lets `optimal` keep op outputs inside blocks it checkpoints alone
    (`op_options`); the other policies checkpoint whole blocks. `keeps` gives those op
    calls by hand, with `segments`.

    `none`, `full`, `sqrt` and `every_k` (with `every_k` given) have a fixed shape and
    may not fit: check `plan.fits`. `every_k` without `k` picks the smallest k that
    fits. `greedy` and `optimal` need a budget and raise `InfeasibleBudgetError`
    when nothing fits. `segments` builds a plan by hand (policy "manual").

    `metric` is `flops` by default here (machine-independent, no measured rates needed); the callback
    and `auto_checkpoint` plan in `time`: pass ``metric="time"`` to get their plan for the same cost.
    The cost should be the whole step's (`step_cost(profile, batch, static_memory(model, [opt]))`):
    a budgeted plan for a cost without static memory warns (`PartialStepWarning`).

    time_limit_s bounds the `optimal` planner's search: it is exact when it finishes in
    time (chains of a thousand blocks usually do, in under a second); otherwise the plan
    is the best found and `plan.gap` says how far above the optimum it can be (proven).
    None searches until the optimum is found.

    max_levels lets `optimal` rebuild a segment under an inner plan of its own, nested up to
    that many levels (1: single-level plans only). It does so only when that fits a budget
    no single-level plan fits, or recomputes less (`optimal_nested`). `inner_segments` gives
    such segments by hand, with `segments`.
    """
    if not isinstance(max_levels, int) or isinstance(max_levels, bool) or max_levels < 1:
        raise ValueError(
            f"max_levels={max_levels!r} must be an integer >= 1: 1 plans single-level segments, 2 lets a "
            "segment's recompute checkpoint inner segments, 3 lets those nest once more."
        )
    if policy not in POLICIES and not (policy == "manual" and segments is not None):
        raise ValueError(f"policy={policy!r} is not a known policy; choose one of {', '.join(POLICIES)}.")
    metric_rates(cost, metric)  # an unknown metric, or `time` without measured rates, fails here
    if budget_bytes is not None:
        warn_without_static(cost)
    n = cost.n_blocks
    needs_budget = policy in ("greedy", "optimal") or (policy == "every_k" and every_k is None)
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity={granularity!r} is not known; choose one of {', '.join(GRANULARITIES)}.")
    if needs_budget and budget_bytes is None:
        raise ValueError(f"policy={policy!r} chooses blocks to fit a budget, so it needs budget_bytes; none was given.")
    gap, inner = 0.0, tuple(inner_segments)
    if inner and segments is None:
        raise ValueError("inner_segments are given by hand with the segments around them: pass segments as well.")
    if segments is not None:
        segs = list(segments)
    elif policy == "none":
        segs = []
    elif policy == "full":
        segs = split_unchainable(cost, every_k_segments(n, 1))
    elif policy == "sqrt":
        segs = split_unchainable(cost, sqrt_segments(n))
    elif policy == "every_k":
        if every_k is not None:
            segs = split_unchainable(cost, every_k_segments(n, every_k))
        else:
            segs = _smallest_fitting_k(cost, budget_bytes)
    elif policy == "greedy":
        segs = greedy_segments(cost, budget_bytes, metric)
    else:
        found, inner = optimal_nested(cost, budget_bytes, metric, granularity, time_limit_s, max_levels)
        if found is None:
            raise InfeasibleBudgetError(_infeasible_message(cost, budget_bytes, "optimal", max_levels))
        segs, keeps, gap = found.segments, found.keeps, found.gap
    segs = validate_segments(n, segs)
    held = kept_blocks_in(cost, segs)
    if held:
        raise ValueError(
            f"the segments put blocks in a segment that must stay kept: {kept_phrase(cost, held)}. A recompute "
            "would repeat those writes (and may take another branch or leave stale tensors behind); leave these "
            "blocks out of the segments, or allow the write with allow_python_state when it is harmless."
        )
    if not chainable(cost, segs):
        raise ValueError(
            "a segment spans a block that does not take the previous block's output as its first argument; "
            "such blocks can only be checkpointed one per segment."
        )
    plan = build_plan(
        cost, segs, policy if segments is None else "manual", budget_bytes, metric, keeps, granularity, inner
    )
    return dataclasses.replace(plan, gap=gap) if gap else plan


def _smallest_fitting_k(cost: StepCost, budget_bytes: int) -> list[tuple[int, int]]:
    for k in range(1, max(cost.n_blocks, 1) + 1):
        segs = split_unchainable(cost, every_k_segments(cost.n_blocks, k))
        if predict_peak(cost, segs).peak_bytes <= budget_bytes:
            return segs
    raise InfeasibleBudgetError(_infeasible_message(cost, budget_bytes, "every_k"))


def build_plan(
    cost: StepCost,
    segments: Sequence[tuple[int, int]],
    policy: str,
    budget_bytes: int | None,
    metric: str = "flops",
    keeps: Keeps | None = None,
    granularity: str = "block",
    inner_segments: Sequence[tuple[int, int]] = (),
) -> Plan:
    segs = validate_segments(cost.n_blocks, segments)
    inner = validate_nested(cost.n_blocks, segs, inner_segments)
    if inner and not chainable(cost, inner):
        raise ValueError(
            "an inner segment spans a block that does not take the previous block's output as its first argument; "
            "such blocks can only be checkpointed one per segment."
        )
    kept = validate_keeps(cost, segs, keeps)
    if any(a <= p <= b for p in kept for a, b in inner):
        raise ValueError(
            "op outputs can be kept only in a top-level segment of one block, but the keeps name a block inside an "
            "inner segment; drop those keeps or the inner segment."
        )
    peak = predict_peak(cost, segs, kept, inner)
    owner = segment_of(cost.n_blocks, segs)
    levels = [int(owner[i] >= 0) + sum(a <= i <= b for a, b in inner) for i in range(cost.n_blocks)]
    runs = recompute_counts(cost.n_blocks, segs, inner)
    rates = cost.rates  # estimated times are shown whenever the profile measured rates
    rows = tuple(
        BlockRow(
            i, b.name, owner[i] >= 0, owner[i], b.saved_bytes, b.input_bytes, int(b.fwd_flops), float(b.fwd_ms),
            fwd_mem_bytes=int(b.fwd_mem_bytes),
            fwd_rng_bytes=int(b.fwd_rng_bytes),
            fwd_comm_bytes=int(b.fwd_comm_bytes),
            gather_bytes=int(b.gather_bytes),
            fwd_est_ms=None if rates is None else block_recompute(b, "time", rates),
            kept_bytes=kept_bytes(b, kept.get(i, ())),
            kept_flops=int(kept_value(b, kept.get(i, ()), "flops", None)),
            kept_est_ms=0.0 if rates is None else kept_value(b, kept.get(i, ()), "time", rates),
            keeps=describe_keeps(b, kept[i]) if i in kept else "",
            level=levels[i],
            recomputes=runs[i],
            kept_because="; ".join(b.unreplayable),
        )
        for i, b in enumerate(cost.blocks)
    )
    fwd_flops = int(cost.meta.get("step_fwd_flops", sum(b.fwd_flops for b in cost.blocks)))
    return Plan(
        policy=policy,
        batch_size=cost.batch_size,
        segments=tuple(segs),
        predicted_peak_bytes=peak.peak_bytes,
        peak_phase=peak.phase,
        budget_bytes=None if budget_bytes is None else int(budget_bytes),
        static_bytes=int(cost.static_bytes),
        recompute_flops=int(plan_recompute(cost, segs, "flops", None, kept, inner)),
        recompute_ms=float(plan_recompute(cost, segs, "ms", None, kept, inner)),
        step_flops=3 * fwd_flops,
        rows=rows,
        cost_metric=metric,
        recompute_est_ms=None if rates is None else float(plan_recompute(cost, segs, "time", rates, kept, inner)),
        rates=None if rates is None else rates.to_dict(),
        granularity=granularity,
        keeps=tuple(sorted(kept.items())),
        inner_segments=tuple(inner),
    )
