"""The prefix lower bound is a bound: never above the least recompute of any prefix choice."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from lightning_ckpt.planning.prefix_bound import PrefixBound, _lower_hull


def test_lower_hull_drops_points_above_chords_and_keeps_least_y_per_x():
    pts = [(0, 0), (2, 5), (1, 1), (2, 2), (4, 4), (3, 4)]
    assert _lower_hull(pts) == [(0, 0), (4, 4)]  # (1, 1) and (2, 2) lie on the chord
    assert _lower_hull([(0, 0), (1, 0), (2, 3), (3, 3)]) == [(0, 0), (1, 0), (3, 3)]


@pytest.mark.parametrize("seed", range(80))
def test_bound_never_exceeds_the_best_prefix_choice(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 5)
    saved = np.array([rng.randint(0, 50) for _ in range(n)], dtype=np.int64)
    cost = np.array([rng.randint(0, 30) for _ in range(n)], dtype=np.int64)
    W = np.concatenate(([0], np.cumsum(saved)))
    # options may keep more than the block saves (kept random draws) and cost close to 0
    options = [[(rng.randint(0, 60), rng.randint(0, int(c))) for _ in range(rng.randint(0, 3))] for c in cost]
    lb = PrefixBound(saved, cost, W, options)
    for p in range(n + 1):
        choices = [[(0, 0), (int(saved[i]), int(cost[i]))] + [(int(saved[i]) - k, int(cost[i]) - v) for k, v in options[i]]
                   for i in range(p)]
        for h in range(0, int(W[p]) + 2, max(1, int(W[p]) // 7)):
            best = min(
                (sum(c for _, c in pick) for pick in itertools.product(*choices) if W[p] - sum(f for f, _ in pick) <= h),
                default=float("inf"),
            )
            got = float(lb.bound(p, np.array([float(h)]))[0])
            assert got <= best + 1e-9, (p, h, got, best)
        assert float(lb.bound(p, np.array([float(W[p])]))[0]) == 0.0
