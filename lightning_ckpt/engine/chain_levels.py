"""Choose among the chains `discover_chain` offers (one per level of the module tree) once each is
planned: the feasible one that recomputes least, or the one that fits the largest batch, with one
line for the user saying which and why; and the message for a chain whose blocks save nothing.
A chain whose every block is a run of another's blocks (`coarser_cut`) is not profiled while that
finer chain fits: under the `optimal` policy its plans are among the finer chain's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lightning_ckpt.planning.nested_planner import NESTED_MAX_BLOCKS
from lightning_ckpt.planning.plan import Plan
from lightning_ckpt.planning.policies import InfeasibleBudgetError
from lightning_ckpt.profiling.structure.discovery import NEAR_BEST_SHARE, REST, ChainChoice
from lightning_ckpt.units import format_bytes

__all__ = [
    "ChainScore", "choose_chain", "coarser_cut", "contenders", "describe_nothing_saved", "engine_for_chain", "pick_chain",
    "plan_score", "skips_coarser",
]


@dataclass(frozen=True)
class ChainScore:
    """How one candidate chain planned. feasible: its plan fits the budget at `batch_size`.
    recompute_cost: what the plan recomputes per step, in `unit` ("s": seconds; "flop" when planned
    by FLOPs). batch_size: the batch it was planned at (when maximizing it: the largest that fits)."""

    feasible: bool
    recompute_cost: float
    batch_size: int
    unit: str = "s"


def _cost(score: ChainScore) -> str:
    x = score.recompute_cost
    if score.unit == "s":
        for scale, name in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
            if x >= scale:
                return f"{x / scale:.3g} {name}"
        return "0 s" if x == 0 else f"{x * 1e6:.3g} µs"
    if score.unit == "flop":
        for scale, name in ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP")):
            if x >= scale:
                return f"{x / scale:.3g} {name}"
        return f"{x:.3g} FLOP"
    return f"{x:.3g} {score.unit}"


def _what(choice: ChainChoice) -> str:
    first, last = (choice.names[0], choice.names[-1]) if choice.names else ("-", "-")
    return f"{choice.level or 'a chain'} ({len(choice.names)} blocks, {first}..{last})"


def _check(candidates: Sequence[ChainChoice], scores: Sequence[ChainScore]) -> None:
    if len(candidates) != len(scores) or not candidates:
        raise ValueError(
            f"choose_chain got {len(candidates)} candidate chains and {len(scores)} scores; pass one ChainScore "
            "per candidate, in the same order, and at least one candidate (ChainChoice.candidates)."
        )
    for i, s in enumerate(scores):
        if not isinstance(s, ChainScore) or math.isnan(s.recompute_cost) or s.recompute_cost < 0 or s.batch_size < 1:
            raise ValueError(
                f"score {i} is {s!r}; each must be a ChainScore with a recompute_cost of 0 or more and a "
                "batch_size of 1 or more."
            )


def choose_chain(
    candidates: Sequence[ChainChoice], scores: Sequence[ChainScore], maximize_batch: bool = False
) -> tuple[int, str]:
    """The index of the feasible candidate that recomputes least (ties: the first), or with
    `maximize_batch` the one that fits the largest batch (ties: the least recompute, then the first),
    and one line naming it, why, and what the others would have cost. Raises ValueError when none is
    feasible (its message names each candidate and the batch it could not fit)."""
    _check(candidates, scores)
    feasible = [i for i, s in enumerate(scores) if s.feasible]
    if not feasible:
        each = "; ".join(f"{_what(c)} cannot fit batch {s.batch_size}" for c, s in zip(candidates, scores))
        raise ValueError(
            f"none of the {len(candidates)} candidate chains fits the memory budget: {each}. Raise the budget or "
            "lower the batch size."
        )
    if maximize_batch:
        best = min(feasible, key=lambda i: (-scores[i].batch_size, scores[i].recompute_cost, i))
        why = "the largest batch that fits of the chains found"
    else:
        best = min(feasible, key=lambda i: (scores[i].recompute_cost, i))
        why = "the least recompute of the chains that fit"
    s = scores[best]
    line = (
        f"blocks=None: planning over {_what(candidates[best])}, which recomputes {_cost(s)} per step at batch "
        f"{s.batch_size}, {why}"
    )
    others = []
    for i, (c, o) in enumerate(zip(candidates, scores)):
        if i == best:
            continue
        if not o.feasible:
            others.append(f"{_what(c)} cannot fit batch {o.batch_size}")
        else:
            others.append(f"{_what(c)} recomputes {_cost(o)} per step at batch {o.batch_size}")
    return best, line + ("; " + "; ".join(others) if others else "") + "."


def describe_nothing_saved(choice: ChainChoice) -> str | None:
    """The message for a chain whose blocks save 0 B for backward (checkpointing them cannot lower
    memory), None for one that saves something."""
    if choice.covered_bytes > 0:
        return None
    if choice.step_bytes == 0:
        return (
            "blocks=None: the training step saves nothing for backward, so there is no activation memory for "
            "checkpointing to lower; train without it (policy='none')."
        )
    why = (
        f" (their {choice.grad_off_calls} calls run with autograd off, as reversible layers inside an "
        "autograd.Function do, which keeps only what that Function saves)"
        if choice.grad_off_calls else ""
    )
    better = [a for a in choice.alternatives if a.covered_bytes > 0]
    named = [(n, b) for n, b in choice.left_out if n != REST]
    if better:
        alt = max(better, key=lambda a: a.covered_bytes)
        todo = f"plan over {_what(alt)}, which holds {format_bytes(alt.covered_bytes)}, instead"
    elif named:
        n, b = max(named, key=lambda x: x[1])
        todo = (
            f"name blocks=[...] among the modules that do save (the most: {n}, {format_bytes(b)}), or train without "
            "checkpointing (policy='none')"
        )
    else:
        todo = "train without checkpointing (policy='none')"
    return (
        f"blocks=None: the chosen blocks, {_what(choice)}, hold 0 B of the {format_bytes(choice.step_bytes)} the "
        f"step saves for backward{why}, so checkpointing them cannot lower memory; {todo}."
    )


def plan_score(plan: Plan) -> ChainScore:
    """What `plan` recomputes per step, in the metric it was planned by."""
    if plan.cost_metric == "flops":
        return ChainScore(plan.fits, float(plan.recompute_flops), plan.batch_size, "flop")
    ms = plan.recompute_est_ms if plan.cost_metric == "time" and plan.recompute_est_ms is not None else plan.recompute_ms
    return ChainScore(plan.fits, max(0.0, ms) / 1e3, plan.batch_size, "s")


def contenders(choice: ChainChoice) -> list[ChainChoice]:
    """The candidates worth planning: those whose blocks cover nearly as many of the step's saved bytes as
    the best-covering one (`NEAR_BEST_SHARE`), the default first."""
    best = max(c.covered_bytes for c in choice.candidates)
    room = NEAR_BEST_SHARE * max(choice.step_bytes, 1)
    return [c for c in choice.candidates if c.covered_bytes >= best - room and c.covered_bytes > 0] or [choice]


def skips_coarser(policy: str, granularity: str) -> bool:
    """Whether a coarser cut of a finer contender can go unplanned (`coarser_cut`): only the `optimal` policy
    over whole blocks searches every grouping of consecutive blocks into segments (nested or not)."""
    return policy == "optimal" and granularity == "block"


def coarser_cut(coarse: ChainChoice, fine: ChainChoice) -> bool:
    """Whether each block of `coarse` is a run of consecutive blocks of `fine` (module calls inside it),
    the runs together all of `fine`'s blocks, each saving what its run saves (the coarse block's own code
    saves nothing more). Then checkpointing a coarse block is checkpointing its run as one segment: every
    plan of `coarse`, nested ones included, is a plan of `fine`, and the `optimal` plan of `fine` recomputes
    no more. Modules called more than once, and finer chains too long for the nested planner, say no."""
    n = len(fine.names)
    if not len(coarse.names) < n <= NESTED_MAX_BLOCKS or any(coarse.call_index) or any(fine.call_index):
        return False
    if len(coarse.entry_saved_bytes) != len(coarse.names) or len(fine.entry_saved_bytes) != n:
        return False
    pos = 0
    for block, saved in zip(coarse.modules, coarse.entry_saved_bytes):
        inside = {id(m) for m in block.modules()}
        start = pos
        while pos < n and id(fine.modules[pos]) in inside:
            pos += 1
        if pos == start or sum(fine.entry_saved_bytes[start:pos]) != saved:
            return False
    return pos == n


def _cuts(found: Sequence[ChainChoice]) -> dict[int, int]:
    """index -> the index of a finer contender it is a coarser cut of, itself no cut of another."""
    finer = {i: j for i, c in enumerate(found) for j, f in enumerate(found) if i != j and coarser_cut(c, f)}
    out = {}
    for i, j in finer.items():
        while j in finer:
            j = finer[j]
        out[i] = j
    return out


def pick_chain(
    choice: ChainChoice, plan_fn: Callable[[ChainChoice], Plan], target_batch_size: int, maximize_batch: bool = False,
    skip_coarser: bool = False,
) -> tuple[int, str]:
    """Plan each of `contenders(choice)` with `plan_fn` (an `InfeasibleBudgetError` counts as not fitting
    `target_batch_size`) and choose among them (`choose_chain`). -> (index into `contenders(choice)`, the
    line to say). When none fits, the default's error is raised, naming the others. `skip_coarser`
    (`skips_coarser`): a coarser cut of another contender (`coarser_cut`) is planned only when no other fits."""
    found = contenders(choice)
    cuts = _cuts(found) if skip_coarser else {}
    planned = [i for i in range(len(found)) if i not in cuts]
    scores: dict[int, ChainScore] = {}
    errors: dict[int, InfeasibleBudgetError | None] = {}

    def score(indices: list[int]) -> None:
        for i in indices:
            try:
                scores[i] = plan_score(plan_fn(found[i]))
                errors[i] = None
            except InfeasibleBudgetError as err:
                scores[i] = ChainScore(False, 0.0, max(1, target_batch_size))
                errors[i] = err

    score(planned)
    if cuts and not any(scores[i].feasible for i in planned):
        planned = list(range(len(found)))
        score(sorted(cuts))
        cuts = {}
    if not any(scores[i].feasible for i in planned):
        others = "; ".join(f"{_what(c)} cannot either" for c in found[1:])
        first = errors[0] if errors[0] is not None else InfeasibleBudgetError("the plan does not fit the budget")
        raise InfeasibleBudgetError(
            f"{first} (planned over {_what(found[0])}" + (f"; {others}" if others else "") + ")"
        ) from None
    best, line = choose_chain([found[i] for i in planned], [scores[i] for i in planned], maximize_batch)
    skipped = [
        f"{_what(found[i])} is not planned: each of its blocks is a run of those of {_what(found[j])}, whose plans "
        "include its own" for i, j in sorted(cuts.items())
    ]
    if skipped:
        line = line[:-1] + "; " + "; ".join(skipped) + "."
    return planned[best], line


def engine_for_chain(
    choice: ChainChoice,
    make_engine: Callable[[ChainChoice], object],
    plan_fn: Callable[[object], Plan],
    target_batch_size: int,
    maximize_batch: bool,
    info: Callable[[str], None],
    skip_coarser: bool = False,
) -> tuple[object, ChainChoice]:
    """With `blocks=None`: the engine bound to the chain to plan over. One contender (`contenders`): its
    engine, nothing planned. Several: each is bound (`make_engine`), profiled and planned (`plan_fn`, nothing
    applied), then closed; the chosen one (`pick_chain`, which with `skip_coarser` leaves out coarser cuts of
    a finer contender) is returned with its profile kept, said in one line. A chain whose blocks save nothing
    is refused (`describe_nothing_saved`)."""
    found = contenders(choice)
    nothing = describe_nothing_saved(found[0])
    if nothing is not None:
        raise ValueError(nothing)
    if len(found) == 1:
        return make_engine(found[0]), found[0]
    engines: dict[int, object] = {}

    def planned(cand: ChainChoice) -> Plan:
        engine = make_engine(cand)
        engines[next(i for i, c in enumerate(found) if c is cand)] = engine
        try:
            return plan_fn(engine)
        finally:
            engine.close()

    index, line = pick_chain(choice, planned, target_batch_size, maximize_batch, skip_coarser)
    info(f"lightning-ckpt: {line}")
    return engines[index], found[index]
