"""The Pareto frontier of planner states: keep the (demand, cost) pairs no other pair beats or
equals on both, and the beam's cut of bounded scores. Used by `chain_planner`'s backward DP,
whose states are nondecreasing in both, so the frontier is exact (see its docstring).
"""

from __future__ import annotations

import numpy as np


def within(score: np.ndarray, cap: float, keep: int) -> np.ndarray:
    """Mask of the entries whose bounded `score` is <= `cap` and, with `keep` > 0, among
    the `keep` lowest scores (the beam run's cut)."""
    ok = score <= cap
    if keep and score.shape[0] > keep:
        best = np.zeros(score.shape[0], dtype=bool)
        best[np.argpartition(score, keep - 1)[:keep]] = True
        ok &= best
    return ok


def pareto_prune(d: np.ndarray, c: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[recurrence] The states no other beats or equals on both D and C: D ascending,
    C strictly falling; of equal D only the least C."""
    if d.shape[0] <= 1:
        return d, c, b
    order = pareto_order(d, c)
    return d[order], c[order], b[order]


def pareto_order(d: np.ndarray, c: np.ndarray) -> np.ndarray:
    """The indices `pareto_prune` keeps, in its order."""
    if d.shape[0] <= 1:
        return np.arange(d.shape[0])
    order = np.argsort(d, kind="stable")
    cs = c[order]
    keep = np.empty(cs.shape[0], dtype=bool)
    keep[0] = True
    np.less(cs[1:], np.minimum.accumulate(cs)[:-1], out=keep[1:])
    order = order[keep]
    ds = d[order]
    # equal D are not ordered by C: of a run of equal D the last kept has the least C
    if ds.shape[0] > 1:
        last = np.empty(ds.shape[0], dtype=bool)
        last[-1] = True
        np.not_equal(ds[:-1], ds[1:], out=last[:-1])
        if not last.all():
            order = order[last]
    return order
