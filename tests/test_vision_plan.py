"""The balancing planner: optimality on small instances, never worse than LPT or no balancing, ties."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from latentfast.vision import Plan, lpt_makespan, plan_assignment
from latentfast.vision.plan import NS_PER_SECOND


def brute_force_makespan(costs_per_rank) -> float:
    """Exact optimum by enumerating every assignment (tiny instances only), on the same ns grid."""
    costs = [round(c * NS_PER_SECOND) for per_rank in costs_per_rank for c in per_rank]
    m = len(costs_per_rank)
    best = None
    for assignment in itertools.product(range(m), repeat=len(costs)):
        loads = [0] * m
        for cost, rank in zip(costs, assignment):
            loads[rank] += cost
        best = max(loads) if best is None else min(best, max(loads))
    return best / NS_PER_SECOND


def random_instance(rng, ranks, low, high, sigma=1.0):
    return [rng.lognormal(0.0, sigma, size=int(rng.integers(low, high + 1))).tolist() for _ in range(ranks)]


def check_consistent(plan: Plan, costs_per_rank) -> None:
    """Loads, makespan and lower bound are what the assignment says they are."""
    m = len(costs_per_rank)
    assert [len(a) for a in plan.assignment] == [len(c) for c in costs_per_rank]
    loads = [0] * m
    for r, per_rank in enumerate(costs_per_rank):
        for i, cost in enumerate(per_rank):
            dest = plan.assignment[r][i]
            assert 0 <= dest < m
            loads[dest] += round(cost * NS_PER_SECOND)
    assert plan.loads == tuple(x / NS_PER_SECOND for x in loads)
    assert plan.makespan == max(loads) / NS_PER_SECOND
    flat = [round(c * NS_PER_SECOND) for per_rank in costs_per_rank for c in per_rank]
    assert plan.lower_bound == max(-(-sum(flat) // m), max(flat, default=0)) / NS_PER_SECOND
    assert plan.makespan >= plan.lower_bound
    moved = sum(dest != r for r, row in enumerate(plan.assignment) for dest in row)
    assert plan.moved_units == moved


def test_small_instances_against_brute_force():
    rng = np.random.default_rng(1)
    ratios = []
    for _ in range(150):
        ranks = int(rng.integers(2, 4))
        costs = random_instance(rng, ranks, 0, 7 // ranks + 1)
        if sum(map(len, costs)) > 7:
            costs = [c[:2] for c in costs]
        plan = plan_assignment(costs)
        check_consistent(plan, costs)
        optimum = brute_force_makespan(costs)
        assert optimum <= plan.makespan <= lpt_makespan(costs)
        assert plan.makespan <= plan.home_makespan
        assert plan.makespan <= optimum * (4 / 3)  # Graham's LPT bound holds for the start point
        ratios.append(plan.makespan / optimum if optimum else 1.0)
    assert np.mean(ratios) <= 1.01, f"mean makespan/optimum {np.mean(ratios):.4f}"
    assert np.mean(np.isclose(ratios, 1.0)) >= 0.9  # optimal on the vast majority


@pytest.mark.parametrize("ranks", [8, 32])
def test_never_above_lpt_or_no_balancing_and_close_to_lower_bound(ranks):
    rng = np.random.default_rng(ranks)
    ratios = []
    for _ in range(20):
        costs = random_instance(rng, ranks, 4, 16)
        plan = plan_assignment(costs)
        check_consistent(plan, costs)
        assert plan.makespan <= lpt_makespan(costs)
        assert plan.makespan <= plan.home_makespan
        ratios.append(plan.makespan / plan.lower_bound)
    assert np.mean(ratios) <= 1.03


def test_same_input_same_plan():
    rng = np.random.default_rng(7)
    costs = random_instance(rng, 16, 0, 12)
    sizes = [[int(x) for x in rng.integers(1, 10**6, size=len(c))] for c in costs]
    assert plan_assignment(costs, sizes) == plan_assignment([list(c) for c in costs], [list(s) for s in sizes])


def test_balanced_input_moves_nothing():
    plan = plan_assignment([[1.0, 2.0], [3.0], [1.5, 1.5]], [[10, 10], [10], [10, 10]])
    assert plan.assignment == ((0, 0), (1,), (2, 2))
    assert plan.moved_units == 0 and plan.moved_bytes == 0 and plan.makespan == plan.home_makespan == 3.0


def test_equal_makespans_prefer_fewer_moved_bytes():
    # Either unit of rank 0 can move to rank 1 for the same makespan: move the small one.
    plan = plan_assignment([[2.0, 2.0], []], [[1000, 10], []])
    assert plan.assignment == ((0, 1), ())
    assert plan.moved_bytes == 10 and plan.makespan == 2.0
    plan = plan_assignment([[2.0, 2.0], []], [[10, 1000], []])
    assert plan.assignment == ((1, 0), ()) and plan.moved_bytes == 10


def test_units_go_home_when_it_costs_nothing():
    # Rank 0 must shed work; rank 1's own unit never needs to leave.
    plan = plan_assignment([[4.0, 3.0, 1.0], [2.0]], [[1, 1, 1], [1]])
    assert plan.assignment[1] == (1,)
    assert plan.makespan == 5.0 and plan.moved_units == 1


def test_lower_bound_set_by_the_largest_unit():
    plan = plan_assignment([[10.0], [1.0], [1.0]])
    assert plan.lower_bound == 10.0 and plan.makespan == 10.0 and plan.moved_units == 0


def test_edge_cases():
    assert plan_assignment([[], []]).assignment == ((), ())
    assert plan_assignment([[1.0, 2.0]]).assignment == ((0, 0),)
    assert plan_assignment([[0.0, 0.0], []]).moved_units == 0
    assert plan_assignment([[1.0]], None).moved_bytes is None
    with pytest.raises(ValueError, match="at least one rank"):
        plan_assignment([])
    with pytest.raises(ValueError, match=r"costs_per_rank\[1\] must be finite"):
        plan_assignment([[1.0], [float("nan")]])
    with pytest.raises(ValueError, match=r"costs_per_rank\[0\] must be finite"):
        plan_assignment([[-1.0]])
    with pytest.raises(ValueError, match="nesting"):
        plan_assignment([[1.0, 2.0]], [[1]])
