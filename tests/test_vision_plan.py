"""The balancing planner: exactness, never worse than not balancing or than the public anchor
(cosmos-framework's plan_rebalance), few units moved, close to optimal, transfer-aware mode,
large instances in linear memory, and clear errors."""
from __future__ import annotations

import itertools
import math
import tracemalloc

import numpy as np
import pytest

from latentfast.bench.bench_balance import (  # the anchor, re-implemented independently of the library
    anchor_assignment, cosmos_plan_rebalance, evaluate, random_instance,
)
from latentfast.errors import ArgumentTypeError, InvalidArgumentError
from latentfast.vision import Plan, lpt_makespan, plan_assignment
from latentfast.vision.plan import NS_PER_SECOND, move_once_moves, quantize_costs


def anchor_result(costs_per_rank) -> tuple[float, int]:
    """``(makespan seconds, units moved)`` of the anchor run on the same integer-nanosecond costs
    every planner here gets."""
    ns = quantize_costs(costs_per_rank)
    makespan, moved, _ = evaluate(anchor_assignment(ns), ns, ns)
    return makespan / NS_PER_SECOND, moved


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


def step_loads(plan: Plan, costs_per_rank, bytes_per_rank=None, bandwidth=None, latent=None) -> list[int]:
    """Per-rank encode + transfer ns of ``plan``, from its assignment alone (independent formula)."""
    m = len(costs_per_rank)
    loads = [0] * m
    for r, per_rank in enumerate(costs_per_rank):
        for i, cost in enumerate(per_rank):
            dest = plan.assignment[r][i]
            loads[dest] += round(cost * NS_PER_SECOND)
            if dest != r and bandwidth is not None:
                size = bytes_per_rank[r][i] + (latent[r][i] if latent else 0)
                transfer = math.ceil(size * NS_PER_SECOND / bandwidth)
                loads[dest] += transfer
                loads[r] += transfer
    return loads


def check_consistent(plan: Plan, costs_per_rank, bytes_per_rank=None, bandwidth=None, latent=None) -> None:
    """Loads, makespan, step time and lower bound are what the assignment says they are."""
    m = len(costs_per_rank)
    assert [len(a) for a in plan.assignment] == [len(c) for c in costs_per_rank]
    assert all(0 <= dest < m for row in plan.assignment for dest in row)
    encode = step_loads(plan, costs_per_rank)
    steps = step_loads(plan, costs_per_rank, bytes_per_rank, bandwidth, latent)
    assert plan.loads == tuple(x / NS_PER_SECOND for x in encode)
    assert plan.makespan == max(encode) / NS_PER_SECOND
    assert plan.step_seconds == max(steps) / NS_PER_SECOND
    assert plan.transfer_seconds == tuple((s - e) / NS_PER_SECOND for s, e in zip(steps, encode))
    flat = [round(c * NS_PER_SECOND) for per_rank in costs_per_rank for c in per_rank]
    assert plan.lower_bound == max(-(-sum(flat) // m), max(flat, default=0)) / NS_PER_SECOND
    home = [sum(round(c * NS_PER_SECOND) for c in per_rank) for per_rank in costs_per_rank]
    assert plan.home_makespan == max(home) / NS_PER_SECOND
    assert plan.lower_bound <= plan.makespan and plan.step_seconds <= plan.home_makespan
    moved = [(r, i) for r, row in enumerate(plan.assignment) for i, dest in enumerate(row) if dest != r]
    assert plan.moved_units == len(moved)
    if bytes_per_rank is not None:
        assert plan.moved_bytes == sum(bytes_per_rank[r][i] for r, i in moved)


# ---- quality ------------------------------------------------------------------------------------


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
        assert optimum <= plan.makespan <= anchor_result(costs)[0]
        ratios.append(plan.makespan / optimum if optimum else 1.0)
    assert np.mean(ratios) <= 1.005, f"mean makespan/optimum {np.mean(ratios):.4f}"
    assert np.mean(np.isclose(ratios, 1.0)) >= 0.9  # optimal on the vast majority


def test_the_anchors_moves_are_reproduced_exactly():
    """The planner's own copy of the anchor (its coarse phase) makes the same moves as the
    independent re-implementation above, ties included (equal costs, empty ranks)."""
    rng = np.random.default_rng(3)
    for trial in range(60):
        costs = random_instance(rng, int(rng.integers(2, 12)), 0, 9)
        if trial % 3 == 0:  # many equal costs: identical shapes have identical predictions
            costs = [[float(rng.integers(1, 4)) for _ in row] for row in costs]
        assert move_once_moves(costs) == cosmos_plan_rebalance(dict(enumerate(quantize_costs(costs))))


@pytest.mark.parametrize(
    "ranks, low, high, skewed",
    [(2, 4, 4, False), (2, 4, 4, True), (8, 4, 16, False), (64, 4, 16, False), (64, 4, 16, True), (64, 16, 16, False)],
    ids=["2x4", "2x4-skewed", "8x4-16", "64x4-16", "64x4-16-skewed", "64x16"],
)
def test_never_worse_than_the_anchor_and_moves_few_units(ranks, low, high, skewed):
    rng = np.random.default_rng(ranks * 10 + skewed)
    ours, theirs = [], []
    for _ in range(60 if ranks < 64 else 25):
        costs = random_instance(rng, ranks, low, high, skewed=skewed)
        plan = plan_assignment(costs)
        check_consistent(plan, costs)
        anchor_makespan, anchor_moved = anchor_result(costs)
        assert plan.makespan <= anchor_makespan  # on every instance
        ours.append(plan.moved_units)
        theirs.append(anchor_moved)
    assert np.mean(ours) <= 1.5 * np.mean(theirs) + 1, (np.mean(ours), np.mean(theirs))


def test_the_issues_instance_where_lpt_and_local_search_lost_to_the_anchor():
    costs = [[2.1998, 2.0801, 0.4198, 1.7609], [1.4838, 4.7006, 0.1946, 2.3121]]
    plan = plan_assignment(costs)
    check_consistent(plan, costs)
    assert plan.makespan <= anchor_result(costs)[0] == 7.6271
    assert plan.makespan / plan.lower_bound < 1.007  # the old planner's 1.0488


@pytest.mark.parametrize("ranks, units, bound", [(8, (4, 16), 1.0025), (64, (16, 16), 1.001)], ids=["8x4-16", "64x16"])
def test_local_search_beats_plain_lpt_on_average(ranks, units, bound):
    """Tight bounds on the mean makespan / lower bound: plain LPT (what the planner would be without
    its local search and anchor start) and the anchor alone both fail them, on the same instances."""
    rng = np.random.default_rng(17)
    ours, lpt, anchor = [], [], []
    for _ in range(80 if ranks == 8 else 30):
        costs = random_instance(rng, ranks, *units)
        plan = plan_assignment(costs)
        ours.append(plan.makespan / plan.lower_bound)
        lpt.append(lpt_makespan(costs) / plan.lower_bound)
        anchor.append(anchor_result(costs)[0] / plan.lower_bound)
    assert np.mean(ours) <= bound < np.mean(lpt) < np.mean(anchor), (np.mean(ours), np.mean(lpt), np.mean(anchor))


@pytest.mark.parametrize("ranks", [2, 8, 32, 64])
def test_never_behind_plain_lpt_and_still_moves_few_units(ranks):
    """Without bandwidth moves cost nothing in the model, so a plan behind plain LPT's makespan is
    simply worse. Before: behind LPT on 16 (2 ranks), 4 (8), 5 (32) and 2 (64) of 100 instances,
    by up to 3.4%. The moves stay bound against the anchor's."""
    rng = np.random.default_rng([19, ranks])
    behind, ours, theirs = [], [], []
    for _ in range(100 if ranks < 64 else 50):
        costs = random_instance(rng, ranks, 4, 16)
        plan = plan_assignment(costs)
        if plan.makespan > lpt_makespan(costs):
            behind.append(plan.makespan / lpt_makespan(costs))
        ours.append(plan.moved_units)
        theirs.append(anchor_result(costs)[1])
    assert not behind, behind
    assert np.mean(ours) <= 1.5 * np.mean(theirs) + 1, (np.mean(ours), np.mean(theirs))


SKEWED_STEPS = {  # issue 26's slow steps: 41 s and 19 s before (100,000 units on one rank: > 600 s)
    "all 30,000 units on 1 of 1,024 ranks": lambda rng: [rng.lognormal(0, 1, 30_000).tolist()] + [[]] * 1023,
    "16 of 1,024 ranks at 4,096 units": lambda rng: [rng.lognormal(0, 1, 4096 if r < 16 else 16).tolist() for r in range(1024)],
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SKEWED_STEPS))
def test_skewed_large_steps_plan_consistently_and_never_behind_lpt(name):
    """Measured: about 0.4 s and 2.5 s (bench/RESULTS.md); a quadratic search did not finish."""
    costs = SKEWED_STEPS[name](np.random.default_rng(26))
    plan = plan_assignment(costs)  # the time is measured in latentfast/bench/bench_balance.py
    check_consistent(plan, costs)
    assert plan.makespan <= lpt_makespan(costs)  # and never behind the anchor: it is the first start


def test_same_input_same_plan():
    rng = np.random.default_rng(7)
    costs = random_instance(rng, 16, 0, 12)
    sizes = [[int(x) for x in rng.integers(1, 10**6, size=len(c))] for c in costs]
    first = plan_assignment(costs, sizes)
    assert first == plan_assignment([np.asarray(c) for c in costs], [np.asarray(s, dtype=np.int64) for s in sizes])
    assert first == plan_assignment(costs, sizes, max_steps=np.int64(10**9))


# ---- what moves ---------------------------------------------------------------------------------


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


def test_local_search_moves_prefer_fewer_bytes():
    # Found by search: several equally good moves off the busiest rank differ only in size.
    costs = [[3.0], [2.0, 1.0], [], [1.0, 3.0, 2.0, 3.0, 3.0]]
    sizes = [[20], [30, 20], [], [30, 20, 20, 30, 30]]
    plan = plan_assignment(costs, sizes)
    check_consistent(plan, costs, sizes)
    assert plan.makespan == 5.0 and plan.moved_bytes <= 90  # 5.0: optimal (18 s of whole seconds on 4 ranks)


def test_a_moved_unit_trades_places_with_a_lighter_one_at_home():
    # The anchor sends the 5 s unit (46 bytes; as near half the gap as the 4 s one, and first) to
    # rank 1: loads 10 and 11. The 4 s unit (22 bytes) can take its place, rank 0 getting the
    # second back (11) and rank 1 giving it up (10): the same makespan, fewer bytes moved.
    costs, sizes = [[5.0, 6.0, 4.0], [6.0]], [[46, 36, 22], [45]]
    plan = plan_assignment(costs, sizes)
    check_consistent(plan, costs, sizes)
    assert plan.makespan == 11.0 and plan.assignment == ((0, 0, 1), (1,)) and plan.moved_bytes == 22


def test_units_go_home_when_it_costs_nothing():
    # Rank 0 must shed work; rank 1's own unit never needs to leave.
    plan = plan_assignment([[4.0, 3.0, 1.0], [2.0]], [[1, 1, 1], [1]])
    assert plan.assignment[1] == (1,)
    assert plan.makespan == 5.0 and plan.moved_units == 1
    # The anchor sends the 5 s unit to rank 1 and the 4 s unit to rank 2; the 4 s unit can come
    # back without raising the makespan (4 + 1 <= 5): one unit moves, not two.
    plan = plan_assignment([[4.0, 5.0, 1.0], [], []])
    assert plan.assignment == ((0, 1, 0), (), ()) and plan.makespan == 5.0 and plan.moved_units == 1


def test_lower_bound_set_by_the_largest_unit():
    plan = plan_assignment([[10.0], [1.0], [1.0]])
    assert plan.lower_bound == 10.0 and plan.makespan == 10.0 and plan.moved_units == 0


def test_edge_cases():
    assert plan_assignment([[], []]).assignment == ((), ())
    assert plan_assignment([[1.0, 2.0]]).assignment == ((0, 0),)
    assert plan_assignment([[0.0, 0.0], []]).moved_units == 0
    assert plan_assignment([[1.0]], None).moved_bytes is None
    assert plan_assignment([[3.0, 1.0], []], max_steps=0).makespan == 3.0  # the anchor's moves alone


# ---- transfer-aware mode ------------------------------------------------------------------------


def transfer_instance(seed: int):
    rng = np.random.default_rng(seed)
    costs = random_instance(rng, 4, 1, 8, skewed=True)
    sizes = [[int(s) for s in rng.integers(10**5, 10**6, size=len(c))] for c in costs]
    latent = [[s // 50 for s in row] for row in sizes]
    return costs, sizes, latent


@pytest.mark.parametrize("seed", range(6))
def test_transfer_aware_plan_reports_and_minimizes_the_step_time(seed):
    costs, sizes, latent = transfer_instance(seed)
    free = plan_assignment(costs, sizes)
    for bandwidth in (1e12, 1e7, 1e6, 1e4):
        plan = plan_assignment(costs, sizes, bandwidth=bandwidth, latent_bytes_per_rank=latent)
        check_consistent(plan, costs, sizes, bandwidth, latent)
        assert plan.bandwidth == bandwidth
        # Never worse than not balancing, or than the transfer-blind plan, once transfers count.
        assert plan.step_seconds <= plan.home_makespan
        assert plan.step_seconds <= max(step_loads(free, costs, sizes, bandwidth, latent)) / NS_PER_SECOND
    slow = plan_assignment(costs, sizes, bandwidth=1.0)  # a byte per second: nothing is worth moving
    assert slow.moved_units == 0 and slow.step_seconds == slow.home_makespan
    fast = plan_assignment(costs, sizes, bandwidth=1e15)  # transfers ~free: balances like the transfer-blind plan
    assert fast.moved_units > 0 and fast.step_seconds <= free.makespan + 1e-6


def test_transfers_are_charged_to_both_ends():
    # Rank 0 holds 4 s of work, rank 1 nothing; moving the 2 s unit (1 MB + 1 MB latent at 1 MB/s)
    # costs 2 s on each link: 2 + 2 on both ranks = 4 s, no better than home. A 10 MB/s link makes
    # it worth it: 2.2 s on each rank.
    slow = plan_assignment([[2.0, 2.0], []], [[10**6, 10**6], []], bandwidth=1e6, latent_bytes_per_rank=[[10**6, 10**6], []])
    assert slow.moved_units == 0 and slow.step_seconds == 4.0
    fast = plan_assignment([[2.0, 2.0], []], [[10**6, 10**6], []], bandwidth=1e7, latent_bytes_per_rank=[[10**6, 10**6], []])
    assert fast.moved_units == 1 and fast.step_seconds == pytest.approx(2.2) and fast.transfer_seconds == (0.2, 0.2)


# ---- exactness, size, errors --------------------------------------------------------------------


def test_huge_costs_are_refused_not_overflowed():
    with pytest.raises(InvalidArgumentError, match="costs_per_rank: the step's total predicted time must be at most"):
        plan_assignment([[1e10, 1.0], [0.5]])  # used to overflow int64 ns into a negative load
    plan = plan_assignment([[4e9, 1.0], [0.5]])  # fits: every load exact to the nanosecond
    assert plan.loads == (4e9, 1.5) and plan.makespan == 4e9 and plan.moved_units == 1


def test_large_instance_in_linear_memory():
    """10^6 equal-cost units on 2,048 ranks (rank 0 with three times its share) used to build a
    units x units matrix (a MemoryError)."""
    per_rank = 488
    costs = [[0.01] * (3 * per_rank)] + [[0.01] * per_rank for _ in range(2047)]
    tracemalloc.start()
    plan = plan_assignment(costs)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    units = sum(map(len, costs))
    assert units > 10**6 and plan.makespan == pytest.approx(0.01 * math.ceil(units / 2048))  # the optimum
    assert peak < 400 * units, f"{peak / units:.0f} bytes per unit"  # a units x units int64 table: 8e6 per unit


def test_invalid_arguments_are_named():
    with pytest.raises(InvalidArgumentError, match="at least one rank"):
        plan_assignment([])
    with pytest.raises(InvalidArgumentError, match=r"costs_per_rank\[1\] must be finite"):
        plan_assignment([[1.0], [float("nan")]])
    with pytest.raises(InvalidArgumentError, match=r"costs_per_rank\[0\] must be finite"):
        plan_assignment([[-1.0]])
    with pytest.raises(ArgumentTypeError, match=r"costs_per_rank\[0\]"):
        plan_assignment([["fast"]])
    with pytest.raises(ArgumentTypeError, match="costs_per_rank must be a sequence"):
        plan_assignment(3.0)
    with pytest.raises(InvalidArgumentError, match="nesting"):
        plan_assignment([[1.0, 2.0]], [[1]])
    with pytest.raises(InvalidArgumentError, match=r"bytes_per_rank\[0\] must be whole numbers"):
        plan_assignment([[1.0]], [[1.5]])
    with pytest.raises(InvalidArgumentError, match="bandwidth needs bytes_per_rank"):
        plan_assignment([[1.0]], bandwidth=1e9)
    with pytest.raises(InvalidArgumentError, match="bandwidth must be finite and > 0"):
        plan_assignment([[1.0]], [[1]], bandwidth=0.0)
    with pytest.raises(ArgumentTypeError, match="bandwidth must be a number"):
        plan_assignment([[1.0]], [[1]], bandwidth="1GB/s")
    with pytest.raises(InvalidArgumentError, match="only used with bandwidth"):
        plan_assignment([[1.0]], [[1]], latent_bytes_per_rank=[[1]])
    with pytest.raises(ArgumentTypeError, match="max_steps must be an int"):
        plan_assignment([[1.0]], max_steps=2.5)
