"""Which rank encodes which unit: a deterministic makespan planner (every rank computes the same plan).

Costs are quantized to integer nanoseconds before planning, so every comparison and sum is exact:
the plan depends only on the gathered inputs, never on floating-point summation order, and
equal loads really compare equal (identical shapes have identical predicted costs).

Algorithm: longest-processing-time first (LPT), then a local search that repeatedly relieves the
most loaded rank by the best single move or pairwise swap with another rank, until no move or
swap lowers it or the makespan is within ``PLAN_TOLERANCE`` of the lower bound. The resulting groups of units are then matched to ranks so as many bytes as
possible stay home, and units that can go home without raising the makespan go home. If the
result is not strictly better than not balancing at all, nothing moves.
"""
from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import numpy as np

NS_PER_SECOND = 1_000_000_000
# The local search stops within this fraction of the lower bound: costs are measured predictions
# with noise of several percent, so polishing the plan further buys nothing but planner time.
PLAN_TOLERANCE = 1e-3


@dataclasses.dataclass(frozen=True)
class Plan:
    """A balancing plan over ``m`` ranks.

    ``assignment[r][i]`` is the rank that encodes rank ``r``'s ``i``-th unit. ``loads[k]`` is the
    predicted seconds rank ``k`` spends encoding; ``makespan = max(loads)``; ``lower_bound =
    max(total / m, largest unit)`` (no plan can beat it); ``home_makespan`` is the makespan of not
    balancing. ``moved_bytes`` is the size of the units that leave home (``None`` when no bytes
    were given); ``moved_units`` counts them.
    """

    assignment: tuple[tuple[int, ...], ...]
    loads: tuple[float, ...]
    makespan: float
    lower_bound: float
    home_makespan: float
    moved_units: int
    moved_bytes: int | None


def _to_nanoseconds(costs_per_rank: Sequence[Sequence[float]]) -> list[np.ndarray]:
    out = []
    for rank, costs in enumerate(costs_per_rank):
        array = np.asarray(costs, dtype=np.float64).reshape(-1)
        if not np.all(np.isfinite(array)) or np.any(array < 0):
            raise ValueError(f"costs_per_rank[{rank}] must be finite and >= 0 seconds, got {array.tolist()}")
        out.append(np.rint(array * NS_PER_SECOND).astype(np.int64))
    return out


def _loads(bins: np.ndarray, costs: np.ndarray, num_bins: int) -> np.ndarray:
    """Exact integer load of every bin."""
    loads = np.zeros(num_bins, dtype=np.int64)
    np.add.at(loads, bins, costs)
    return loads


def lpt_bins(costs: np.ndarray, num_bins: int) -> np.ndarray:
    """Plain LPT: units in decreasing cost (ties by input order) each go to the least loaded bin
    (ties by lowest bin index). Returns the bin of every unit."""
    bins = np.empty(len(costs), dtype=np.int64)
    heap = [(0, b) for b in range(num_bins)]
    for unit in np.argsort(-costs, kind="stable").tolist():
        load, b = heapq.heappop(heap)
        bins[unit] = b
        heapq.heappush(heap, (load + int(costs[unit]), b))
    return bins


NEAR_BINS = 8  # swap partners tried first: units on the least loaded bins (cheap, usually enough)
NO_STEP = np.iinfo(np.int64).max


def _best_step(costs, bins, loads, top, partner_bins):
    """Best move (a unit of ``top`` onto the least loaded bin) or swap (a unit of ``top`` with a
    smaller unit on one of ``partner_bins``), scored by the larger of the two new loads.
    Returns ``(score, top_unit, partner_unit or -1, target_bin)``."""
    top_load = int(loads[top])
    on_top = np.flatnonzero(bins == top)
    if len(on_top) == 0:
        return NO_STEP, -1, -1, -1
    top_costs = costs[on_top]
    other_loads = loads.copy()
    other_loads[top] = NO_STEP
    target = int(np.argmin(other_loads))
    move_score = np.maximum(top_load - top_costs, loads[target] + top_costs)
    i = int(np.argmin(move_score))
    best = (int(move_score[i]), int(on_top[i]), -1, target)
    is_partner = np.zeros(len(loads), dtype=bool)
    is_partner[partner_bins] = True
    is_partner[top] = False
    partners = np.flatnonzero(is_partner[bins])
    if len(partners):
        delta = top_costs[:, None] - costs[partners][None, :]
        swap_score = np.maximum(top_load - delta, loads[bins[partners]][None, :] + delta)
        swap_score[delta <= 0] = NO_STEP
        flat = int(np.argmin(swap_score))
        if int(swap_score.flat[flat]) < best[0]:
            u, v = divmod(flat, len(partners))
            best = (int(swap_score.flat[flat]), int(on_top[u]), int(partners[v]), int(bins[partners[v]]))
    return best


def _improve(costs: np.ndarray, bins: np.ndarray, num_bins: int, max_steps: int, good_enough: int) -> np.ndarray:
    """Move/swap local search on the most loaded bin. Every accepted step lowers the top bin
    without raising its partner to that level, so the sorted load vector strictly decreases and
    the search terminates; ``max_steps`` caps the planner's time, and it stops once the makespan
    is ``<= good_enough``. Swap partners are first sought on the few least loaded bins, and on
    all bins only before giving up."""
    bins = bins.copy()
    loads = _loads(bins, costs, num_bins)
    all_bins = np.arange(num_bins)
    for _ in range(max_steps if num_bins > 1 else 0):
        top = int(np.argmax(loads))
        if loads[top] <= good_enough:
            break
        near = np.argsort(loads, kind="stable")[: NEAR_BINS + 1]
        score, unit, partner, target = _best_step(costs, bins, loads, top, near)
        if score >= loads[top] and num_bins > NEAR_BINS + 1:
            score, unit, partner, target = _best_step(costs, bins, loads, top, all_bins)
        if score >= loads[top]:
            break
        delta = int(costs[unit]) - (int(costs[partner]) if partner >= 0 else 0)
        bins[unit] = target
        if partner >= 0:
            bins[partner] = top
        loads[top] -= delta
        loads[target] += delta
    return bins


def _bins_to_ranks(bins: np.ndarray, homes: np.ndarray, weights: np.ndarray, num_ranks: int) -> np.ndarray:
    """Name each (anonymous) bin after a rank, greedily keeping the heaviest home weight in place."""
    kept = np.zeros((num_ranks, num_ranks), dtype=np.int64)
    np.add.at(kept, (bins, homes), weights)
    bin_rank = np.full(num_ranks, -1, dtype=np.int64)
    rank_taken = np.zeros(num_ranks, dtype=bool)
    order = np.argsort(-kept.reshape(-1), kind="stable")
    for flat in order[: int(np.count_nonzero(kept))].tolist():
        b, r = divmod(flat, num_ranks)
        if bin_rank[b] < 0 and not rank_taken[r]:
            bin_rank[b], rank_taken[r] = r, True
    free_ranks = iter(np.flatnonzero(~rank_taken).tolist())
    for b in range(num_ranks):
        if bin_rank[b] < 0:
            bin_rank[b] = next(free_ranks)
    return bin_rank[bins]


def _send_home_where_free(costs, ranks, homes, weights, num_ranks) -> np.ndarray:
    """Return moved units home (heaviest first) wherever that keeps the makespan."""
    ranks = ranks.copy()
    loads = _loads(ranks, costs, num_ranks)
    makespan = int(loads.max())
    away = np.flatnonzero(ranks != homes)
    for unit in away[np.argsort(-weights[away], kind="stable")].tolist():
        home = int(homes[unit])
        if loads[home] + costs[unit] <= makespan:
            loads[ranks[unit]] -= costs[unit]
            loads[home] += costs[unit]
            ranks[unit] = home
    return ranks


def plan_assignment(
    costs_per_rank: Sequence[Sequence[float]],
    bytes_per_rank: Sequence[Sequence[int]] | None = None,
    *,
    max_steps: int | None = None,
) -> Plan:
    """Plan which rank encodes each unit.

    Args:
        costs_per_rank: ``costs_per_rank[r][i]`` = predicted seconds of rank ``r``'s ``i``-th unit
            (finite, >= 0). Its length is the number of ranks; a rank may have no units.
        bytes_per_rank: same nesting, bytes of each unit. When given, ties between equally good
            plans keep the most bytes home and ``Plan.moved_bytes`` is reported; otherwise the most
            units stay home.
        max_steps: cap on local-search steps (default ``4 * units + 16``).

    Pure and deterministic: the same input gives the same plan on every rank.
    """
    num_ranks = len(costs_per_rank)
    if num_ranks < 1:
        raise ValueError("costs_per_rank must list at least one rank")
    per_rank = _to_nanoseconds(costs_per_rank)
    counts = [len(c) for c in per_rank]
    costs = np.concatenate(per_rank) if per_rank else np.zeros(0, np.int64)
    homes = np.repeat(np.arange(num_ranks, dtype=np.int64), counts)
    if bytes_per_rank is None:
        weights = np.ones(len(costs), dtype=np.int64)
    else:
        if len(bytes_per_rank) != num_ranks or any(len(b) != n for b, n in zip(bytes_per_rank, counts)):
            raise ValueError(
                f"bytes_per_rank must match costs_per_rank's nesting {counts}, got {[len(b) for b in bytes_per_rank]}"
            )
        weights = np.concatenate([np.asarray(b, dtype=np.int64).reshape(-1) for b in bytes_per_rank])
        if np.any(weights < 0):
            raise ValueError("bytes_per_rank must be >= 0")

    home_loads = _loads(homes, costs, num_ranks)
    total = int(costs.sum())
    largest = int(costs.max()) if len(costs) else 0
    lower_bound = max(-(-total // num_ranks), largest)

    ranks = homes
    if len(costs) and int(home_loads.max()) > lower_bound:
        steps = 4 * len(costs) + 16 if max_steps is None else int(max_steps)
        good_enough = lower_bound + int(lower_bound * PLAN_TOLERANCE)
        bins = _improve(costs, lpt_bins(costs, num_ranks), num_ranks, steps, good_enough)
        candidate = _bins_to_ranks(bins, homes, weights, num_ranks)
        candidate = _send_home_where_free(costs, candidate, homes, weights, num_ranks)
        candidate_loads = _loads(candidate, costs, num_ranks)
        if int(candidate_loads.max()) < int(home_loads.max()):
            ranks = candidate

    loads = _loads(ranks, costs, num_ranks)
    moved = ranks != homes
    offsets = np.cumsum([0, *counts])
    assignment = tuple(tuple(ranks[offsets[r] : offsets[r + 1]].tolist()) for r in range(num_ranks))
    return Plan(
        assignment=assignment,
        loads=tuple(float(x) / NS_PER_SECOND for x in loads.tolist()),
        makespan=float(loads.max()) / NS_PER_SECOND,
        lower_bound=lower_bound / NS_PER_SECOND,
        home_makespan=float(home_loads.max()) / NS_PER_SECOND,
        moved_units=int(moved.sum()),
        moved_bytes=None if bytes_per_rank is None else int(weights[moved].sum()),
    )


def lpt_makespan(costs_per_rank: Sequence[Sequence[float]]) -> float:
    """Makespan (seconds) of plain LPT on the same quantized costs; the baseline the planner must not exceed."""
    per_rank = _to_nanoseconds(costs_per_rank)
    costs = np.concatenate(per_rank) if per_rank else np.zeros(0, np.int64)
    if not len(costs):
        return 0.0
    bins = lpt_bins(costs, len(per_rank))
    return float(_loads(bins, costs, len(per_rank)).max()) / NS_PER_SECOND


__all__ = ["Plan", "plan_assignment", "lpt_bins", "lpt_makespan", "NS_PER_SECOND"]
