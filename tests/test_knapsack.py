"""Tests for the 0/1 knapsack solvers: optimality, feasibility, certificates, errors.

Optimality is checked against enumeration of every subset on small instances,
against PyTorch's `dp_knapsack` for the quantised Hirschberg DP, and against a
dense integer DP on the hard families (strongly correlated, subset-sum). Feasibility
is the package's one definition, `_common.fits`: real memory sum <= budget_limit(cap).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_ckpt.solvers import (
    dp_knapsack_hirschberg,
    exact_knapsack,
    greedy_knapsack,
    solve_knapsack,
)
from lightning_ckpt.solvers._common import budget_limit, fits, fits_exactly
from lightning_ckpt.solvers._hirschberg import hirschberg_select

SOLVERS = [greedy_knapsack, dp_knapsack_hirschberg, exact_knapsack]
OPTIMAL = [dp_knapsack_hirschberg, exact_knapsack]


def _masks(n: int) -> np.ndarray:
    return ((np.arange(1 << n)[:, None] >> np.arange(n)) & 1).astype(np.float64)


def brute_force(w: np.ndarray, v: np.ndarray, cap: float) -> float:
    """Best value over all subsets that fit; sums are exact for the binary grid data used here."""
    if len(w) == 0:
        return 0.0
    masks = _masks(len(w))
    return float(np.where(masks @ w <= budget_limit(cap), masks @ v, -np.inf).max())


def check_answer(w, v, cap, answer, check_fit: bool = True) -> None:
    """Partition of the indices, value = fsum over the selection, the selection fits."""
    value, saved, recomputed = answer
    assert sorted(saved + recomputed) == list(range(len(w)))
    assert saved == sorted(saved) and recomputed == sorted(recomputed)
    assert value == math.fsum(np.asarray(v, dtype=float)[saved].tolist())
    if check_fit:
        assert fits(np.asarray(w, dtype=float)[saved].tolist(), cap)


# --- hand-written tables ---------------------------------------------------------

CASES = [
    # (memory, runtimes, max_memory, optimal value, optimal saved set or None if tied)
    ([1, 3, 4, 5], [1, 4, 5, 7], 7, 9, [1, 2]),
    ([10, 20, 30], [60, 100, 120], 50, 220, [1, 2]),
    ([1, 10], [2, 10], 10, 10, [1]),  # greedy takes the better ratio and is stuck
    ([0, 5], [3, 1], 0, 3, [0]),  # zero memory, positive runtime: always saved
    ([1, 1], [0, 2], 10, 2, [1]),  # zero runtime: never saved
    ([11, 2], [100, 1], 10, 1, [1]),  # heavier than the budget
    ([1, 2], [1, 1], 0, 0, []),  # capacity 0
    ([2, 2, 2], [1, 1, 1], 4, 2, None),  # ties
    ([1e-4, 1e-4], [1.0, 2.0], 1e-4, 2.0, [1]),  # PyTorch's sliding Hirschberg saves both
    # Real sums 2.8e-17 and 2**-53 over the budget: noise within the 2**-40 allowance of `fits`
    # (with no allowance, as "fits" was defined before, only one item fitted in each).
    ([0.1, 0.1, 0.1], [1, 1, 1], 0.3, 3, [0, 1, 2]),
    ([0.5, 0.5 + 2**-53], [1, 1], 1.0, 2, [0, 1]),
    ([0.5, 0.5 + 2**-41], [1, 1], 1.0, 2, [0, 1]),  # just inside the allowance
    ([0.5, 0.5 + 2**-39], [1, 1], 1.0, 1, None),  # over the allowance: only one fits
    ([0.25, 0.75], [1, 1], 1.0, 2, [0, 1]),  # real sum exactly the budget
    ([2.0**38, 1.0, 1.0], [3, 2, 2], 2.0**38, 4, [1, 2]),  # whole numbers: no allowance
]


@pytest.mark.parametrize("w, v, cap, best, saved", CASES)
def test_exact_knapsack_hand_written(w, v, cap, best, saved):
    answer = exact_knapsack(w, v, cap)
    check_answer(w, v, cap, answer)
    assert answer[0] == best
    if saved is not None:
        assert answer[1] == saved


@pytest.mark.parametrize("w, v, cap, best, saved", CASES[:-1])  # last: 2.7e15 quanta wide
def test_hirschberg_hand_written(w, v, cap, best, saved):
    answer = dp_knapsack_hirschberg(w, v, cap)
    check_answer(w, v, cap, answer)
    assert answer[0] == best


def test_greedy_is_feasible_and_not_optimal():
    assert greedy_knapsack([1, 10], [2, 10], 10)[0] == 2
    for w, v, cap, best, _ in CASES:
        answer = greedy_knapsack(w, v, cap)
        check_answer(w, v, cap, answer)
        assert answer[0] <= best


@pytest.mark.parametrize("solver", SOLVERS)
def test_empty_input(solver):
    assert solver([], [], 1.0) == (0.0, [], [])
    assert solver([], [], 0.0) == (0.0, [], [])


@pytest.mark.parametrize("solver", SOLVERS)
def test_infinite_budget_saves_every_useful_item(solver):
    assert solver([1.0, 5.0, 2.0], [1.0, 0.0, 3.0], math.inf) == (4.0, [0, 2], [1])


# --- brute force on random instances ------------------------------------------------


def random_instance(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, float]:
    """Small instance on an exact binary grid, with the awkward cases mixed in."""
    n = int(rng.integers(0, 11))
    kind = int(rng.integers(0, 5))
    w = rng.integers(0, 20, n).astype(float)
    v = rng.integers(0, 15, n).astype(float)
    if kind == 1:
        w /= 8  # binary fractions
    elif kind == 2:
        v = w.copy()  # subset-sum
    elif kind == 3:
        v = w + 3  # strongly correlated
    elif kind == 4:
        v = rng.random(n).round(3) * 100  # float runtimes with ties
    w[rng.random(n) < 0.1] = 0.0
    v[rng.random(n) < 0.1] = 0.0
    cap = float(rng.integers(0, int(w.sum()) + 3)) if rng.random() < 0.9 else 0.0
    if kind == 1:
        cap /= 8
    return w, v, cap


def test_optimal_solvers_match_brute_force_on_10000_instances():
    rng = np.random.default_rng(20260103)
    for _ in range(10_000):
        w, v, cap = random_instance(rng)
        best = brute_force(w, v, cap)
        for solver in OPTIMAL:
            answer = solver(w.tolist(), v.tolist(), cap)
            check_answer(w, v, cap, answer)
            assert answer[0] == pytest.approx(best, rel=1e-12, abs=1e-12), (solver, w, v, cap)
        g = greedy_knapsack(w.tolist(), v.tolist(), cap)
        check_answer(w, v, cap, g)
        assert g[0] <= best + 1e-9


def test_hirschberg_divide_and_conquer_path_matches_brute_force():
    """leaf=1 forces the two-row DP and the capacity split at every level."""
    rng = np.random.default_rng(7)
    for _ in range(1500):
        n = int(rng.integers(1, 11))
        q = rng.integers(1, 12, n)
        v = rng.integers(1, 20, n).astype(float)
        cap = int(rng.integers(0, int(q.sum()) + 2))
        picked = hirschberg_select(q, v, cap, leaf=1)
        assert len(set(picked.tolist())) == len(picked)
        assert int(q[picked].sum()) <= cap
        assert v[picked].sum() == brute_force(q.astype(float), v, float(cap))


@settings(max_examples=200, deadline=None)
@given(
    items=st.lists(
        st.tuples(
            st.one_of(st.just(0.0), st.floats(0, 50, allow_subnormal=False)),
            st.one_of(st.just(0.0), st.integers(0, 30).map(float), st.floats(0, 1e6)),
        ),
        max_size=8,
    ),
    fraction=st.floats(0, 1.2),
)
def test_exact_knapsack_property(items, fraction):
    """Arbitrary floats: the answer fits, and is optimal within the stated certificate."""
    w = np.array([x for x, _ in items], dtype=float)
    v = np.array([y for _, y in items], dtype=float)
    cap = float(w.sum() * fraction)
    sol = solve_knapsack(w.tolist(), v.tolist(), cap)
    check_answer(w, v, cap, sol.as_tuple())
    assert_certificate(w, v, cap, sol)


def assert_certificate(w: np.ndarray, v: np.ndarray, cap: float, sol) -> None:
    """Every T with real weight <= budget_limit(cap) - |T| * grid is worth <= value + tolerance."""
    cap_q = Fraction(budget_limit(cap))
    grid = Fraction(sol.grid)
    for mask in _masks(len(w)).astype(bool):
        weight = sum((Fraction(x) for x in w[mask]), Fraction(0))
        if weight <= cap_q - int(mask.sum()) * grid:
            assert math.fsum(v[mask].tolist()) <= sol.value + sol.value_tolerance


# --- what "exact" means --------------------------------------------------------------


def test_integer_memory_is_solved_with_no_capacity_slack():
    rng = np.random.default_rng(3)
    w = rng.integers(1, 10**9, 12).astype(float)  # byte counts
    v = rng.integers(1, 10**12, 12).astype(float)  # FLOPs
    sol = solve_knapsack(w, v, float(w.sum() // 2))
    assert sol.grid == 0.0 and not sol.coarsened
    assert sol.value == brute_force(w, v, float(w.sum() // 2))
    # Built on cap, then widened: exact where scaling by the limit's last bit would overflow.
    w, v = rng.integers(1, 1000, 400).astype(float), rng.integers(1, 1000, 400).astype(float)
    sol = solve_knapsack(w, v, 151.0)
    assert sol.grid == 0.0 and sol.value == dense_dp(w, v, 151) and w.sum() > 512 * 151


def test_general_floats_get_a_2_pow_40_grid_and_the_guarantee_holds():
    rng = np.random.default_rng(4)
    for _ in range(40):
        w = 10 ** rng.uniform(-6, 0, 10)  # full mantissas over six decades: no exact scaling
        v = rng.uniform(0, 1, 10)
        cap = float(w.sum() * rng.uniform(0.2, 0.8))
        sol = solve_knapsack(w, v, cap)
        assert sol.grid == pytest.approx(cap * 2.0**-40, rel=1e-15)
        check_answer(w, v, cap, sol.as_tuple())
        assert_certificate(w, v, cap, sol)


def test_budget_fallback_coarsens_and_states_its_slack():
    rng = np.random.default_rng(5)
    w = rng.uniform(0.1, 1.0, 12)
    v = w.copy()  # subset-sum on floats: the hardest case
    cap = float(w.sum() / 2)
    sol = solve_knapsack(w, v, cap, state_budget=1)
    assert sol.coarsened and sol.grid > cap * 2.0**-40
    check_answer(w, v, cap, sol.as_tuple())
    assert_certificate(w, v, cap, sol)


def test_value_tolerance_is_rounding_sized():
    sol = solve_knapsack([1.0] * 100, [1.0] * 100, 50.0)
    assert sol.value == 50.0
    assert 0 < sol.value_tolerance < 1e-10


# --- against PyTorch -----------------------------------------------------------------


def test_hirschberg_matches_torch_dp_knapsack():
    from torch._functorch._activation_checkpointing.knapsack import dp_knapsack

    rng = np.random.default_rng(11)
    for _ in range(150):
        n = int(rng.integers(1, 13))
        w = rng.uniform(0, 1, n)
        w[rng.random(n) < 0.2] = 0.0
        v = rng.integers(0, 50, n).astype(float)  # exact in torch's float32 DP
        cap = float(rng.uniform(0, max(w.sum(), 1e-3)))
        _, torch_saved, _ = dp_knapsack(w.tolist(), v.tolist(), cap)
        ours = dp_knapsack_hirschberg(w.tolist(), v.tolist(), cap, feasible=False)
        check_answer(w, v, cap, ours, check_fit=False)
        assert ours[0] == float(v[torch_saved].sum())
        safe = dp_knapsack_hirschberg(w.tolist(), v.tolist(), cap)
        check_answer(w, v, cap, safe)  # always fits
        if safe[0] != ours[0]:  # only when dp_knapsack's own answer does not fit
            assert not fits(w[torch_saved].tolist(), cap)
        q = np.rint(w * 10_000)  # same quantised budget as dp_knapsack
        assert q[ours[1]].sum() <= round(cap * 10_000)


def test_hirschberg_quantisation_bound_on_real_weights():
    """Over budget on the real values by at most (saved + 1) / (2 * scale)."""
    rng = np.random.default_rng(12)
    for _ in range(300):
        n = int(rng.integers(1, 10))
        w = rng.uniform(0, 1e-3, n)
        v = rng.uniform(0, 1, n)
        cap = float(rng.uniform(0, w.sum()))
        _, saved, _ = dp_knapsack_hirschberg(w, v, cap, feasible=False)
        assert w[saved].sum() <= cap + (len(saved) + 1) / 20_000 + 1e-12
        check_answer(w, v, cap, dp_knapsack_hirschberg(w, v, cap))  # the default always fits


def test_hirschberg_memory_is_linear_in_the_budget():
    import tracemalloc

    rng = np.random.default_rng(13)
    q_cap = 400_000
    w = rng.integers(1, 40_000, 40) / 10_000
    v = rng.uniform(1, 2, 40)
    tracemalloc.start()
    dp_knapsack_hirschberg(w, v, q_cap / 10_000)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2 * 8 * (q_cap + 1) + 2_000_000  # two float64 rows plus small change


# --- hard families -------------------------------------------------------------------


def dense_dp(w: np.ndarray, v: np.ndarray, cap: int) -> float:
    """Trusted value-only DP over integer weights."""
    row = np.zeros(cap + 1)
    for wi, vi in zip(w.astype(np.int64).tolist(), v.tolist()):
        if wi <= cap:
            np.maximum(row[wi:], row[: cap + 1 - wi] + vi, out=row[wi:])
    return float(row[-1])


@pytest.mark.parametrize("family", ["strongly_correlated", "subset_sum", "inverse_strongly"])
@pytest.mark.parametrize("seed", [0, 1])
def test_hard_families_at_n_1000_are_exact_and_fast(family, seed):
    rng = np.random.default_rng(seed)
    r = 1000
    w = rng.integers(1, r + 1, 1000).astype(float)
    v = {"strongly_correlated": w + r // 10, "subset_sum": w.copy(), "inverse_strongly": w}[family]
    if family == "inverse_strongly":
        w = w + r // 10
    cap = math.floor(w.sum() * rng.uniform(0.3, 0.7))
    sol = solve_knapsack(w, v, float(cap))
    # Fast as work done, not time: the core DP stays within n * max weight states, the O(n r) of
    # Pisinger's balanced DP, where the dense DP fills n * cap cells (about 200 times more). Without
    # the surrogate bound the correlated families need up to 3.2 million states here.
    assert sol.states <= len(w) * int(w.max()), sol.states
    assert sol.grid == 0.0 and not sol.coarsened
    check_answer(w, v, cap, sol.as_tuple())
    assert sol.value == dense_dp(w, v, cap)


def test_large_easy_instance_is_fast():
    rng = np.random.default_rng(9)
    w = rng.uniform(1, 100, 10_000)
    v = w * np.exp(rng.normal(0, 1, 10_000))
    sol = solve_knapsack(w, v, w.sum() / 2)
    # Fast as work done, not time: on uncorrelated items bound fixing leaves a core of about 1 % of
    # the items and the core DP's bounds prune it to a few states per item (about 25 thousand here);
    # without the core's own fixing 41 thousand, without its bound pruning 2.4 million.
    assert sol.states <= 3 * len(w), sol.states
    assert not sol.coarsened
    check_answer(w, v, w.sum() / 2, sol.as_tuple())
    assert sol.as_tuple() == exact_knapsack(w, v, w.sum() / 2)


# --- input validation ----------------------------------------------------------------


@pytest.mark.parametrize("solver", SOLVERS)
def test_errors_say_what_was_received_and_what_to_do(solver):
    name = solver.__name__
    mismatch = rf"{name}: got 2 memory entries but 1 runtimes.*equal length"
    with pytest.raises(ValueError, match=mismatch):
        solver([1.0, 2.0], [1.0], 1.0)
    with pytest.raises(ValueError, match=r"memory\[1\] = -2.0.*>= 0.*clamp"):
        solver([1.0, -2.0], [1.0, 1.0], 1.0)
    with pytest.raises(ValueError, match=r"runtimes\[0\] = nan.*finite"):
        solver([1.0], [math.nan], 1.0)
    with pytest.raises(ValueError, match=r"runtimes\[0\] = inf"):
        solver([1.0], [math.inf], 1.0)
    with pytest.raises(ValueError, match=r"max_memory=-1.0 is not a usable budget.*pass 0.0"):
        solver([1.0], [1.0], -1.0)
    with pytest.raises(ValueError, match=r"max_memory=nan"):
        solver([1.0], [1.0], math.nan)
    with pytest.raises(ValueError, match=r"max_memory='a lot' is not a number"):
        solver([1.0], [1.0], "a lot")
    with pytest.raises(ValueError, match=r"memory has shape \(1, 2\).*flat list"):
        solver([[1.0, 2.0]], [1.0, 2.0], 1.0)


def test_import_does_not_pull_in_the_compile_adapter():
    import subprocess
    import sys

    code = "import sys, lightning_ckpt.solvers; print('compile_adapter' in str(list(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"




# --- what "fits" means, and grid-aligned memory --------------------------------------


def test_fits_is_the_real_sum_against_the_budget_limit():
    assert budget_limit(0.0) == 0.0 and budget_limit(math.inf) == math.inf
    assert budget_limit(1.0) == 1.0 + 2.0**-40 and not fits([1e-300], 0.0)
    assert fits([3 * 1e-4, 2 * 1e-4], 5 * 1e-4)  # 5 quanta against 5, 5e-20 over in reals
    assert not fits_exactly([3 * 1e-4, 2 * 1e-4], 5 * 1e-4)
    assert fits([0.5, 0.5 + 2**-41], 1.0) and not fits([0.5, 0.5 + 2**-39], 1.0)
    for cap in (1.0, 12345.0, 2.0**39 - 1):  # whole numbers: exactly sum <= cap
        assert fits([cap - 1, 1.0], cap) and not fits([cap, 1.0], cap)


def as_memory(k: int, form: int) -> float:
    """k quanta of 1e-4 as a caller may compute them (not always the same float)."""
    return [k * 1e-4, k / 10_000, float(f"{k}e-4")][form]


def grid_optimum(k: list[int], v: list[float], m: int) -> float:
    """Best runtime over subsets of at most m quanta: integer weights, no float sums."""
    masks = _masks(len(k))
    return float(np.where(masks @ np.array(k, float) <= m, masks @ np.array(v), -np.inf).max())


def test_hirschberg_on_grid_aligned_weights_is_optimal_and_fits():
    """Whole multiples of the 1e-4 quantum, up to float representation, fit iff they fit on the
    grid: the DP answer fits and is worth what `exact_knapsack` and enumeration find (ratio 1).
    With no allowance 3 x 1e-4 + 2 x 1e-4 did not fit 5 x 1e-4: the DP kept down to 0.92."""
    rng = np.random.default_rng(20260104)
    cases = [([3, 2], [1.0, 1.0], 5, 0), ([3, 2], [1.0, 1.0], 5, 2), ([1, 2], [1.0, 1.0], 3, 0)]
    for _ in range(600):
        k = rng.integers(1, 10, int(rng.integers(3, 13))).tolist()
        cases.append((k, rng.random(len(k)).tolist(), int(rng.integers(1, 31)), rng.integers(3)))
    for k, v, m, form in cases:
        w, cap = [as_memory(x, form) for x in k], as_memory(m, form)
        answer = dp_knapsack_hirschberg(w, v, cap)
        check_answer(w, v, cap, answer)
        best = exact_knapsack(w, v, cap)[0]
        assert answer[0] == pytest.approx(best, rel=1e-12) == grid_optimum(k, v, m)
    assert dp_knapsack_hirschberg([3 * 1e-4, 2 * 1e-4], [1.0, 1.0], 5 * 1e-4)[0] == 2.0


def test_exact_knapsack_reads_decimal_units_exactly():
    """Too wide for a binary scaling in int64, memory is read in whole decimal units (k x 1e-4;
    bytes / 1e9, as PyTorch's partitioner passes sizes): grid 0, and dense DP agrees."""
    rng = np.random.default_rng(8)
    for _ in range(150):
        k, parts = rng.integers(1, 200, rng.integers(10, 25)), rng.integers(1, 300, 4)
        w, v = [as_memory(int(x), rng.integers(3)) for x in k], rng.random(len(k)).tolist()
        cap = sum(as_memory(int(p), rng.integers(3)) for p in parts)  # a few more roundings
        sol, answer = solve_knapsack(w, v, cap), dp_knapsack_hirschberg(w, v, cap)
        check_answer(w, v, cap, sol.as_tuple())
        check_answer(w, v, cap, answer)
        best = pytest.approx(dense_dp(k, np.array(v), int(parts.sum())), rel=1e-12)
        assert sol.grid == 0.0 and sol.value == best and answer[0] == best
    for _ in range(30):  # budgets half-way between two units
        b, v, m = rng.integers(1, 5000, 60), rng.random(60), int(rng.integers(20_000, 100_000))
        cap = (m + 0.5) / 1e9
        sol = solve_knapsack((b / 1e9).tolist(), v.tolist(), cap)
        check_answer(b / 1e9, v, cap, sol.as_tuple())
        assert sol.grid == 0.0 and sol.value == pytest.approx(dense_dp(b, v, m), rel=1e-12)


@settings(max_examples=300, deadline=None)
@given(
    items=st.lists(st.tuples(st.integers(0, 40), st.floats(0, 100)), max_size=10),
    quanta=st.integers(0, 200),
    form=st.integers(0, 2),
)
def test_hirschberg_grid_aligned_property(items, quanta, form):
    """Random grid-aligned instances: DP value == exact value == grid optimum, and it fits."""
    k, v = [x for x, _ in items], [y for _, y in items]
    w, cap = [as_memory(x, form) for x in k], as_memory(quanta, form)
    answer = dp_knapsack_hirschberg(w, v, cap)
    check_answer(w, v, cap, answer)
    best = pytest.approx(grid_optimum(k, v, quanta), rel=1e-12, abs=1e-300)
    sol = solve_knapsack(w, v, cap)
    assert answer[0] == best and sol.value == best and sol.grid == 0.0
