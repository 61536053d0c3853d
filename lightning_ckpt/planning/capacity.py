"""The largest batch size whose best plan fits the budget, found from the model alone.

Predicted memory grows with the batch size, so feasibility is monotone: grow an
upper bound by doubling, then bisect. No trial runs, no out-of-memory errors.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_ckpt.costs.block_costs import StepCost
from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.planning.policies import InfeasibleBudgetError, make_plan

CostAt = Callable[[int], StepCost]


def plan_if_fits(
    cost: StepCost, budget_bytes: int, policy: str = "optimal", every_k: int | None = None, metric: str = "flops",
    granularity: str = "block",
    max_levels: int = 2,
) -> Plan | None:
    """The policy's plan when it fits the budget, else None."""
    try:
        plan = make_plan(
            cost, policy, budget_bytes, every_k=every_k, metric=metric, granularity=granularity, max_levels=max_levels
        )
    except InfeasibleBudgetError:
        return None
    return plan if plan.fits else None


def largest_batch(
    cost_at: CostAt,
    budget_bytes: int,
    policy: str = "optimal",
    multiple: int = 1,
    upper: int | None = None,
    limit: int = 1 << 20,
    every_k: int | None = None,
    metric: str = "flops",
    granularity: str = "block",
    max_levels: int = 2,
) -> tuple[int, Plan | None]:
    """(B, plan at B): the largest multiple of `multiple` whose plan fits; (0, None) if none.

    `upper`, when given, is a batch size known not to fit (the search stays below it).
    `limit` caps the doubling so a model whose memory does not grow still ends.
    """
    if multiple < 1:
        raise ValueError(f"batch_multiple={multiple} must be a positive integer (e.g. 8).")

    def fits(k: int) -> Plan | None:  # k counts multiples
        return plan_if_fits(cost_at(k * multiple), budget_bytes, policy, every_k, metric, granularity, max_levels)

    lo, lo_plan = 0, None
    if upper is not None:
        hi = max(1, upper // multiple + (1 if upper % multiple else 0))
    else:
        hi = 1
        while hi * multiple <= limit:
            plan = fits(hi)
            if plan is None:
                break
            lo, lo_plan = hi, plan
            hi *= 2
        else:
            raise ValueError(
                f"every batch size up to {limit} fits {budget_bytes} bytes: the profile shows no memory growth with "
                "the batch size, so there is no largest batch. Check that the blocks see the batch."
            )
    # [invariant] fits(lo) (or lo == 0), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        plan = fits(mid)
        if plan is not None:
            lo, lo_plan = mid, plan
        else:
            hi = mid
    return lo * multiple, lo_plan
