"""The prefix lower bounds are bounds: never above the least recompute of any prefix plan."""

from __future__ import annotations

import itertools
import math
import random

import numpy as np
import pytest

from lightning_ckpt.planning.prefix_bound import ChainBound, PrefixBound, _lower_hull


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


def prefix_plans(p, saved, x, o, rc, tails, seg, chains, options):
    """(bytes freed, cost) of every plan of blocks 0..p-1, freed as `ChainBound` counts it (a
    segment's first block frees its saved bytes less its boundary, plus o); a last segment may
    run on past block p - 1 (then its overhead and tail fall to what follows)."""
    out = []

    def walk(i, freed, cost):
        if i == p:
            out.append((freed, cost))
            return
        walk(i + 1, freed, cost)  # keep block i
        first = saved[i] - x[i] + o[i]
        for k, v in options[i]:  # block i checkpointed alone, keeping k bytes
            walk(i + 1, freed + first - k, cost + rc[i] - tails[i] + seg - v)
        w, c = first, 0
        for j in range(i, p):
            if j > i and not chains[j]:
                break
            w, c = w + (saved[j] if j > i else 0), c + rc[j]
            walk(j + 1, freed + w, cost + c - tails[j] + seg)
            if j == p - 1:
                out.append((freed + w, cost + c))

    walk(0, 0, 0)
    return out


def random_chain(rng, n, ops):
    saved = np.array([rng.choice((0, rng.randint(0, 60))) for _ in range(n)], dtype=np.int64)
    x = np.array([rng.choice((0, rng.randint(0, 30))) for _ in range(n)], dtype=np.int64)
    o = np.array([rng.choice((0, int(v), rng.randint(0, int(v)))) if i else 0 for i, v in enumerate(x)], dtype=np.int64)
    rc = np.array([rng.choice((0, rng.randint(0, 40))) for _ in range(n)], dtype=np.int64)
    tails = np.array([rng.choice((0, rng.randint(0, int(c)))) for c in rc], dtype=np.int64)
    chains = np.array([i > 0 and rng.random() < 0.8 for i in range(n)])
    options = [[(rng.randint(0, 70), rng.randint(0, int(c) + 5)) for _ in range(rng.randint(0, 2) if ops else 0)] for c in rc]
    return saved, x, o, rc, tails, rng.choice((0, 0, rng.randint(0, 9))), chains, options


@pytest.mark.parametrize("seed", range(150))
def test_chain_bound_never_exceeds_the_best_prefix_plan(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 7)
    saved, x, o, rc, tails, seg, chains, options = random_chain(rng, n, ops=seed % 2 == 1)
    lb = ChainBound(saved, x, o, rc, tails, seg, chains, options if seed % 2 else None)
    W = np.concatenate(([0], np.cumsum(saved)))
    for p in range(n + 1):
        plans = prefix_plans(p, saved, x, o, rc, tails, seg, chains, options)
        most = max(f for f, _ in plans)
        for h in sorted({int(W[p] - most), int(W[p] - most) - 1, *range(-5, int(W[p]) + 6, max(1, int(W[p]) // 9))}):
            best = min((c for f, c in plans if W[p] - f <= h), default=math.inf)
            got = float(lb.bound(p, np.array([float(h)]))[0])
            assert got <= best + lb.slack, (p, h, got, best)
            assert (got == math.inf) == (best == math.inf), (p, h, got, best)


@pytest.mark.parametrize("seed", range(40))
def test_chain_bound_equals_the_knapsack_bound_without_boundaries(seed):
    """With free boundaries segments cost nothing extra: the Lagrangian bound is the linear
    relaxation itself (its best price is one block's cost per byte, all of them on the grid)."""
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    saved, _, _, rc, _, _, _, _ = random_chain(rng, n, ops=False)
    zero = np.zeros(n, dtype=np.int64)
    chain = ChainBound(saved, zero, zero, rc, zero, 0, np.ones(n, dtype=bool))
    knap = PrefixBound(saved, rc, np.concatenate(([0], np.cumsum(saved))))
    for p in range(n + 1):
        h = np.arange(-3.0, float(chain.W[p]) + 3.0, 0.5)
        assert np.allclose(chain.bound(p, h), knap.bound(p, h), rtol=0, atol=1e-6)
