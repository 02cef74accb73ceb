"""Which rank encodes which unit: a deterministic planner for the step's encode time.

Every rank computes the same plan from the same gathered numbers. Costs are quantized to integer
nanoseconds first, so every sum and comparison is exact and a plan never depends on summation
order; a step whose total predicted time does not fit that grid (over ~146 years) is refused.

Every moved unit costs network traffic (pixels out, latents back), so the plan starts from
"everything at home" and moves only what lowers the most loaded rank:

1. **Coarse moves: the public anchor's.** The move-once heuristic of cosmos-framework's
   ``plan_rebalance`` (``vae_load_balance.py``, re-implemented here on the quantized costs):
   from the most to the least loaded rank, the unit whose cost is nearest half their gap, each
   unit at most once. Every later step only lowers the step time, so no plan is ever worse than
   the anchor's.
2. **Local search to the goal** (the lower bound plus ``PLAN_TOLERANCE``): the most loaded rank
   is relieved by a single move, else a pairwise swap with one of the least loaded ranks; among
   the steps that reach the goal the one that moves the fewest bytes, else the one that lowers
   the rank the most.
3. **Home where free, lighter where free.** Moved units that can go home without raising the
   step time go home, or trade places with a visitor of their home; a moved unit trades places
   with a lighter unit of its owner when that keeps the step time (bytes given). If the result
   does not beat not balancing, nothing moves.
4. **Never behind plain LPT.** Without ``bandwidth`` moves cost nothing in the model, so a plan
   behind LPT's makespan is simply worse: unless the plan is provably optimal, LPT's makespan is
   computed, a plan behind it searches on toward it (with more swap partners), and where it still
   falls short LPT's own placement starts a search too (it moves more units: only then).

Transfer-aware mode (``bandwidth=``): a moved unit's bytes cost ``bytes / bandwidth`` seconds on
its owner's link and the same on its helper's (pixels out and, with ``latent_bytes_per_rank``,
latents back). The planner then minimizes the predicted step time, every rank's encode load plus
its transfer time, and reports it in :class:`Plan`; the local search also starts from home and
from LPT's placement (both heuristics ignore transfers) and the best plan wins.

Memory is linear in the units: nothing is sized units x units or ranks x ranks. Time is
near-linear in the units whatever the skew: one sort of all units (by rank, then cost), the
anchor's moves (at most 10,000), LPT (a heap over the ranks), and the local search, whose steps
(at most ``4 * (units + ranks) + 16``) each cost O(log) heap and list operations (each rank's
units stay sorted across moves) plus a scan of a few candidate units, or of at most
``SWAP_SCAN`` units of the most loaded rank per swap partner. The search's total work is capped
at ``WORK_PER_UNIT`` candidates per unit and rank: a budget counted in work, not seconds, so every
rank still computes the same plan (all units of a 100,000-unit step on one of 1,024 ranks: about
3 s on a loaded 2-core host; bench/RESULTS.md). The hot loops are written for CPython: flat
lists, bare names, keys built only for candidates that can still win.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from bisect import bisect_left, bisect_right  # bare names: the hot loops call them thousands of times
from collections.abc import Sequence
from heapq import heapify, heappop, heappush, heapreplace, nsmallest

import numpy as np

from ..errors import ArgumentTypeError, InvalidArgumentError
from ..checks import as_int

NS_PER_SECOND = 1_000_000_000
# Loads are exact integer nanoseconds; a step longer than this (about 146 years) is refused rather
# than overflowing.
MAX_TOTAL_NS = 2**62
# The local search stops within this fraction of the lower bound: costs are measured predictions
# with noise of several percent, so polishing the plan further only moves more units.
PLAN_TOLERANCE = 1.5e-3
SWAP_PARTNERS = 4  # swaps are tried with the few least loaded ranks (cheap, usually enough)
SWAP_SCAN = 512  # at most this many units of the most loaded rank are tried per swap partner
# The local search's budget: candidates examined per unit and rank of the step, over all its
# steps on one plan. It bounds the planner's time linearly in the step's size whatever the skew,
# and, unlike a wall-clock limit, gives every rank the same plan.
WORK_PER_UNIT = 16
ANCHOR_MAX_ITERATIONS = 10_000  # plan_rebalance's own default


@dataclasses.dataclass(frozen=True)
class Plan:
    """A balancing plan over ``m`` ranks.

    ``assignment[r][i]`` is the rank that encodes rank ``r``'s ``i``-th unit. ``loads[k]`` is the
    predicted seconds rank ``k`` spends encoding; ``makespan = max(loads)``; ``lower_bound =
    max(total / m, largest unit)`` (no plan can beat it); ``home_makespan`` is the makespan of not
    balancing. ``moved_bytes`` is the size of the units that leave home (``None`` when no bytes
    were given); ``moved_units`` counts them.

    ``transfer_seconds[k]`` is the predicted time rank ``k``'s link spends on moved units (zero
    without ``bandwidth``) and ``step_seconds = max(loads[k] + transfer_seconds[k])`` the predicted
    step time the planner minimized (equal to ``makespan`` without ``bandwidth``).
    """

    assignment: tuple[tuple[int, ...], ...]
    loads: tuple[float, ...]
    makespan: float
    lower_bound: float
    home_makespan: float
    moved_units: int
    moved_bytes: int | None
    transfer_seconds: tuple[float, ...]
    step_seconds: float
    bandwidth: float | None


# ---- inputs -------------------------------------------------------------------------------------


def _as_array(values, name: str) -> np.ndarray:
    try:
        return np.asarray(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise ArgumentTypeError(f"{name} must be a sequence of numbers, got {values!r}") from exc


def _flat(per_rank, name: str) -> tuple[np.ndarray, list[int]]:
    """All ranks' values as one float64 array (one numpy call, not one per rank), and the counts."""
    if isinstance(per_rank, (str, bytes)) or not hasattr(per_rank, "__len__"):
        raise ArgumentTypeError(f"{name} must be a sequence with one sequence of numbers per rank, got {per_rank!r}")
    try:
        counts = [len(values) for values in per_rank]
        flat = np.fromiter(itertools.chain.from_iterable(per_rank), dtype=np.float64, count=sum(counts))
    except (TypeError, ValueError) as exc:
        for rank, values in enumerate(per_rank):  # name the rank that holds the bad value
            _as_array(values, f"{name}[{rank}]")
        raise ArgumentTypeError(f"{name} must hold one sequence of numbers per rank: {exc}") from exc
    return flat, counts


def _bad_rank(bad: np.ndarray, counts: list[int]) -> int:
    """The rank holding the first flagged value."""
    return int(np.searchsorted(np.cumsum(counts), int(np.argmax(bad)), side="right"))


def quantize_costs(costs_per_rank: Sequence[Sequence[float]]) -> list[list[int]]:
    """Predicted seconds -> exact integer nanoseconds per rank (the grid every plan is computed on).

    Raises :class:`InvalidArgumentError` for a cost that is not finite and >= 0, or for a step whose
    total does not fit ``MAX_TOTAL_NS``."""
    flat, counts = _flat(costs_per_rank, "costs_per_rank")
    ns = _quantized(flat, counts).tolist()
    offsets = np.cumsum([0, *counts]).tolist()
    return [ns[offsets[r] : offsets[r + 1]] for r in range(len(counts))]


def _quantized(flat: np.ndarray, counts: list[int]) -> np.ndarray:
    """The costs as int64 nanoseconds; their total fits ``MAX_TOTAL_NS``, so no int64 sum of them overflows."""
    bad = ~(np.isfinite(flat) & (flat >= 0))
    if bad.any():
        rank = _bad_rank(bad, counts)
        start = sum(counts[:rank])
        values = flat[start : start + counts[rank]].tolist()
        raise InvalidArgumentError(f"costs_per_rank[{rank}] must be finite and >= 0 seconds, got {values}")
    ns = np.rint(flat * NS_PER_SECOND)
    if float(ns.sum()) > MAX_TOTAL_NS:
        raise InvalidArgumentError(
            f"costs_per_rank: the step's total predicted time must be at most {MAX_TOTAL_NS / NS_PER_SECOND:.3g} s "
            f"so every load is exact in integer nanoseconds, got {float(flat.sum()):.3g} s"
        )
    return ns.astype(np.int64)


def as_bandwidth(bandwidth, name: str = "bandwidth") -> float | None:
    """A link's bytes per second as a float (``None`` stays ``None``); numpy numbers welcome."""
    if bandwidth is None:
        return None
    if isinstance(bandwidth, (bool, str, bytes)) or not hasattr(bandwidth, "__float__"):
        raise ArgumentTypeError(f"{name} must be a number of bytes per second, got {bandwidth!r}")
    if not (math.isfinite(float(bandwidth)) and float(bandwidth) > 0):
        raise InvalidArgumentError(f"{name} must be finite and > 0 bytes per second, got {bandwidth}")
    return float(bandwidth)


def _byte_counts(bytes_per_rank, counts: list[int], name: str) -> np.ndarray:
    """Flattened whole, non-negative byte counts (int64) with the same nesting as the costs."""
    flat, got = _flat(bytes_per_rank, name)
    if got != counts:
        raise InvalidArgumentError(f"{name} must match costs_per_rank's nesting {counts}, got {got}")
    bad = ~(np.isfinite(flat) & (flat >= 0) & (flat == np.floor(flat)))
    if bad.any():
        rank = _bad_rank(bad, counts)
        start = sum(counts[:rank])
        raise InvalidArgumentError(f"{name}[{rank}] must be whole numbers of bytes >= 0, got {flat[start : start + counts[rank]].tolist()}")
    if float(flat.sum()) >= 2**63:
        raise InvalidArgumentError(f"{name}: the step's bytes must total less than 2**63, got {float(flat.sum()):.3g}")
    return flat.astype(np.int64)


@dataclasses.dataclass
class _Problem:
    """The flattened, quantized instance: units ``offsets[r]`` to ``offsets[r + 1] - 1`` belong to rank ``r``."""

    num_ranks: int
    offsets: list[int]
    cost: list[int]  # encode ns
    weight: list[int]  # bytes (or 1 per unit when no bytes were given): what "fewest moved" counts
    xfer: list[int]  # ns on each end's link when the unit moves (0 without bandwidth)
    home: list[int]
    home_load: list[int]  # encode ns per rank when nothing moves
    total: int  # encode ns of the whole step
    largest: int  # encode ns of the dearest unit
    transfer_aware: bool
    bytes_vary: bool  # units differ in size: worth trading a moved unit for a lighter one
    sorted_costs: list[int]  # cost of sorted_units[i]
    sorted_units: list[int]  # every unit by (home rank, cost, unit): each rank's slice cheapest first

    def by_cost(self, r: int) -> tuple[list[int], list[int]]:
        """``(costs, units)`` of rank ``r``'s own units, cheapest first (ties: lowest unit first),
        as fresh lists."""
        lo, hi = self.offsets[r], self.offsets[r + 1]
        return self.sorted_costs[lo:hi], self.sorted_units[lo:hi]


def _rank_order(ns: np.ndarray, ranks: np.ndarray, largest: int) -> np.ndarray:
    """Every unit by (home rank, cost, unit), in one stable sort: one packed int64 key where rank
    and cost fit in it (ranks come in runs, so this is several times faster than lexsort)."""
    shift = largest.bit_length()
    if shift + int(ranks[-1] if len(ranks) else 0).bit_length() <= 62:
        return np.argsort((ranks << shift) | ns, kind="stable")
    return np.lexsort((ns, ranks))


def _problem(costs_per_rank, bytes_per_rank, bandwidth, latent_bytes_per_rank) -> _Problem:
    flat, counts = _flat(costs_per_rank, "costs_per_rank")
    if not counts:
        raise InvalidArgumentError("costs_per_rank must list at least one rank, got an empty sequence")
    ns = _quantized(flat, counts)
    cost, n = ns.tolist(), len(ns)
    weight, bytes_vary = [1] * n, False
    if bytes_per_rank is not None:
        weights = _byte_counts(bytes_per_rank, counts, "bytes_per_rank")
        weight, bytes_vary = weights.tolist(), bool(n) and bool((weights != weights[0]).any())
    xfer = [0] * n
    if bandwidth is not None:
        if bytes_per_rank is None:
            raise InvalidArgumentError("bandwidth needs bytes_per_rank (the bytes each unit sends when it moves)")
        bandwidth = as_bandwidth(bandwidth)
        latent = [0] * n
        if latent_bytes_per_rank is not None:
            latent = _byte_counts(latent_bytes_per_rank, counts, "latent_bytes_per_rank").tolist()
        xfer = [math.ceil((w + b) * NS_PER_SECOND / bandwidth) for w, b in zip(weight, latent)]
        if sum(cost) + 2 * sum(xfer) > MAX_TOTAL_NS:
            raise InvalidArgumentError(
                f"bandwidth={bandwidth} predicts transfers longer than {MAX_TOTAL_NS / NS_PER_SECOND:.3g} s in total"
            )
    elif latent_bytes_per_rank is not None:
        raise InvalidArgumentError("latent_bytes_per_rank is only used with bandwidth=")
    m = len(counts)
    offsets = [0, *itertools.accumulate(counts)]
    ranks = np.repeat(np.arange(m, dtype=np.int64), counts)
    ends = np.concatenate(([0], np.cumsum(ns)))[offsets]  # exact: the total fits int64 (checked above)
    largest = int(ns.max()) if n else 0
    order = _rank_order(ns, ranks, largest).tolist()
    # Both lists share their int objects with ``cost`` and with each rank (linear memory, lightly).
    home = list(itertools.chain.from_iterable(itertools.repeat(r, k) for r, k in enumerate(counts)))
    return _Problem(
        m, offsets, cost, weight, xfer, home, np.diff(ends).tolist(), int(ends[-1]), largest,
        bandwidth is not None and any(xfer), bytes_vary, list(map(cost.__getitem__, order)), order,
    )  # fmt: skip


# ---- assignments --------------------------------------------------------------------------------


class _Assignment:
    """Where every unit is encoded, with exact per-rank step loads (encode + transfer ns).

    A unit at home adds its cost to its home rank. A moved unit adds cost + transfer to its helper
    and its transfer to its home rank (the owner's link sends the pixels and receives the latent).
    Only moved units are tracked one by one, so the bookkeeping costs what the plan moves, not
    what the step holds.
    """

    def __init__(self, problem: _Problem):
        self.p = problem
        self.where = list(problem.home)
        self.load = list(problem.home_load)
        self.away: set[int] = set()  # units encoded away from home
        self.visitors: dict[int, set[int]] = {}  # rank -> units of other ranks encoded there
        self.gone = [0] * problem.num_ranks  # rank -> how many of its own units are encoded elsewhere
        self._sorted: list = [None] * problem.num_ranks  # rank -> units_on(rank), built on use
        self.work = 0  # candidates the local search examined (see WORK_PER_UNIT)

    def leave_home(self, moves: list[tuple[int, int]]) -> None:
        """Apply ``(unit, helper)`` moves of units still at home, before any :meth:`units_on`
        (the anchor's moves): :meth:`move` without its general cases."""
        p, load, where, visitors, gone = self.p, self.load, self.where, self.visitors, self.gone
        for u, dest in moves:
            c, t, h = p.cost[u], p.xfer[u], where[u]
            load[h] -= c - t
            load[dest] += c + t
            where[u] = dest
            gone[h] += 1
            visitors.setdefault(dest, set()).add(u)
        self.away.update(u for u, _ in moves)

    def units_on(self, r: int) -> tuple[list[int], list[int]]:
        """``(costs, units)`` of every unit encoded on ``r``, cheapest first; built on first use,
        then kept up to date by every move (callers must not change them)."""
        on = self._sorted[r]
        if on is None:  # r's own units still here (already in order), then its few visitors put in place
            p, where = self.p, self.where
            on = p.by_cost(r)
            if self.gone[r]:
                units = [u for u in on[1] if where[u] == r]
                on = (list(map(p.cost.__getitem__, units)), units)
            for v in self.visitors.get(r, ()):
                i = _position(on, p.cost[v], v)
                on[0].insert(i, p.cost[v])
                on[1].insert(i, v)
            self._sorted[r] = on
        return on

    def move(self, u: int, dest: int) -> None:
        p, load, src = self.p, self.load, self.where[u]
        c, t, h = p.cost[u], p.xfer[u], p.home[u]
        if src == h:
            load[h] -= c
            self.gone[h] += 1
        else:
            load[src] -= c + t
            load[h] -= t
            self.visitors[src].discard(u)
        if dest == h:
            load[h] += c
            self.gone[h] -= 1
            self.away.discard(u)
        else:
            load[dest] += c + t
            load[h] += t
            self.away.add(u)
            self.visitors.setdefault(dest, set()).add(u)
        self.where[u] = dest
        self._take(src, u)
        self._put(dest, u)

    def _take(self, r: int, u: int) -> None:
        """Drop ``u`` from ``r``'s sorted units (if built): a bisection and a C-speed shift,
        not a rebuild, so a rank holding most of the step costs O(log) per move."""
        on = self._sorted[r]
        if on is not None:
            i = _position(on, self.p.cost[u], u)
            del on[0][i], on[1][i]

    def _put(self, r: int, u: int) -> None:
        on = self._sorted[r]
        if on is not None:
            i = _position(on, self.p.cost[u], u)
            on[0].insert(i, self.p.cost[u])
            on[1].insert(i, u)

    def makespan(self) -> int:
        return max(self.load, default=0)

    def moved(self) -> tuple[int, int]:
        """``(bytes moved, units moved)``: what ties between equal step times are decided by."""
        return sum(map(self.p.weight.__getitem__, self.away)), len(self.away)

    def encode_loads(self) -> list[int]:
        """Per-rank encode ns (the load without transfers)."""
        if not self.p.transfer_aware:
            return list(self.load)
        loads = list(self.p.home_load)
        for u in self.away:
            loads[self.p.home[u]] -= self.p.cost[u]
            loads[self.where[u]] += self.p.cost[u]
        return loads


def _position(on: tuple[list[int], list[int]], c: int, u: int) -> int:
    """Where unit ``u`` of cost ``c`` is (or belongs) in ``(costs, units)`` sorted by (cost, unit):
    found by bisection even in long runs of equal costs."""
    costs = on[0]
    lo = bisect_left(costs, c)
    return bisect_left(on[1], u, lo, bisect_right(costs, c, lo))


def _score(a: _Assignment, steps) -> tuple[int, int]:
    """``(highest load among the ranks touched, bytes added)`` if every ``(unit, dest)`` of
    ``steps`` were applied."""
    p, delta, added = a.p, {}, 0
    for u, dest in steps:
        src, c, t, h = a.where[u], p.cost[u], p.xfer[u], p.home[u]
        if src == h:
            delta[h] = delta.get(h, 0) - c
        else:
            delta[src] = delta.get(src, 0) - c - t
            delta[h] = delta.get(h, 0) - t
        if dest == h:
            delta[h] = delta.get(h, 0) + c
        else:
            delta[dest] = delta.get(dest, 0) + c + t
            delta[h] = delta.get(h, 0) + t
        added += p.weight[u] * ((dest != h) - (src != h))
    return max(a.load[r] + d for r, d in delta.items()), added


# ---- the coarse phase: cosmos-framework's move-once heuristic -----------------------------------


def _nearest_half(costs: list[int], units: list[int], spread: int) -> int | None:
    """Position (in the cost-sorted lists) of the unit ``plan_rebalance`` picks: cost nearest
    ``spread / 2``, the lowest local index among ties; ``None`` when even that one would not
    shrink the gap."""
    i = bisect_right(costs, spread // 2)  # positions [0, i) have 2 * cost <= spread
    if i:  # just below half: the first unit of the largest such cost
        position = bisect_left(costs, costs[i - 1])
        gap = spread - 2 * costs[position]
        if i < len(costs) and (2 * costs[i] - spread, units[i]) < (gap, units[position]):
            position, gap = i, 2 * costs[i] - spread
    elif costs:  # every unit is above half: the first, the cheapest
        position, gap = 0, 2 * costs[0] - spread
    else:
        return None
    return position if gap < spread else None


def _move_once(p: _Problem, max_iterations: int = ANCHOR_MAX_ITERATIONS) -> list[tuple[int, int]]:
    """The public anchor on the quantized costs: cosmos-framework's ``plan_rebalance``
    (``vae_load_balance.py``, NVIDIA, OpenMDW-1.1), re-implemented with heaps and sorted lists.

    Repeatedly, from the most to the least loaded rank (lowest rank among ties), it offloads the
    not-yet-moved unit owned by the former whose cost is nearest half their gap (lowest local
    index among ties), while that shrinks the gap; no unit moves twice; at most
    ``max_iterations`` moves. Returns the same moves as ``(unit, to_rank)``, in order.
    """
    totals = list(p.home_load)
    high = [(-x, r) for r, x in enumerate(totals)]
    low = [(x, r) for r, x in enumerate(totals)]
    heapify(high)
    heapify(low)
    available: list = [None] * p.num_ranks  # owner -> its unmoved units' (costs, ids), cheapest first
    moves = []
    for _ in range(max_iterations if p.num_ranks > 1 else 0):
        x, over = high[0]
        while -x != totals[over]:  # heap entries are dropped once stale
            heappop(high)
            x, over = high[0]
        y, under = low[0]
        while y != totals[under]:
            heappop(low)
            y, under = low[0]
        spread = -x - y
        if spread <= 0:
            break
        if available[over] is None:
            available[over] = p.by_cost(over)
        costs, units = available[over]
        position = _nearest_half(costs, units, spread)
        if position is None:
            break
        cost, unit = costs.pop(position), units.pop(position)
        moves.append((unit, under))
        x = totals[over] = -x - cost
        y = totals[under] = y + cost
        # The heaps' tops are over's and under's current entries: replaced in place, the other
        # two entries go stale and are dropped when they surface.
        heapreplace(high, (-x, over))
        heapreplace(low, (y, under))
        heappush(high, (-y, under))
        heappush(low, (x, over))
    return moves


def move_once_moves(costs_per_rank: Sequence[Sequence[float]]) -> list[tuple[int, int, int]]:
    """The moves of cosmos-framework's ``plan_rebalance`` on the quantized costs, as its
    ``(local_index, from_rank, to_rank)``, in order: the candidate :func:`plan_assignment` starts from."""
    p = _problem(costs_per_rank, None, None, None)
    return [(u - p.offsets[p.home[u]], p.home[u], dest) for u, dest in _move_once(p)]


# ---- the local search ---------------------------------------------------------------------------


def _around(costs: list[int], value: float, width: int) -> range:
    """Positions of a sorted cost list around ``value`` (where the best step must be)."""
    i = bisect_left(costs, value)
    return range(max(i - width, 0), min(i + width, len(costs)))


def _best_move(a: _Assignment, top: int, bottom: int, goal: int):
    """The best single move off ``top``: a unit with a cost near half the gap to the least loaded
    rank goes there (with transfers, also the same units back home). Returns its key
    ``(max(score, goal), bytes added, score, ((unit, dest),))`` or ``None``."""
    p, lt, lb = a.p, a.load[top], a.load[bottom]
    costs, units = a.units_on(top)
    near = _around(costs, (lt - lb) / 2, 2)
    if p.transfer_aware:
        keys = []
        for u in (units[i] for i in near):
            for dest in {bottom, p.home[u]} - {top}:
                score, added = _score(a, ((u, dest),))
                keys.append((max(score, goal), added, score, ((u, dest),)))
        return min(keys, default=None)
    if bottom == top or not costs or costs[0] >= lt - lb:  # no unit fits in the gap: none lowers top
        return None
    best = None
    for i in near:  # inlined: the common case, and the planner's hot loop
        c, u = costs[i], units[i]
        score, h = (lt - c if lt - c > lb + c else lb + c), p.home[u]
        key = (score if score > goal else goal, p.weight[u] * ((bottom != h) - (top != h)), score, u)
        if best is None or key < best:
            best = key
    return None if best is None else (*best[:3], ((best[3], bottom),))


def _best_swap(a: _Assignment, top: int, bottom: int, goal: int, partners: int):
    """The best swap of a unit on ``top`` with a smaller one on the least loaded rank, the
    partner's unit chosen near the cost that would balance the two; when that does not reach
    ``goal``, the next ``partners - 1`` least loaded ranks are tried too. Same key as
    :func:`_best_move`; ``None`` when no swap lowers ``top``."""
    best = _swap_with(a, top, bottom, goal, None)
    if best is None or best[2] > goal:
        for r in nsmallest(partners + 1, range(a.p.num_ranks), key=a.load.__getitem__):
            if r not in (top, bottom):
                best = _swap_with(a, top, r, goal, best)
    return best


def _swap_with(a: _Assignment, top: int, r: int, goal: int, best):
    """``best`` or a better swap between ``top`` and ``r`` that lowers ``top``. Each unit on
    ``top`` is tried with the (at most two) cheaper units of ``r`` nearest the cost that would
    balance the two ranks."""
    theirs, their_units = a.units_on(r)
    a.work += min(len(a.units_on(top)[0]), SWAP_SCAN)  # what the scan below examines, at most
    if not theirs:
        return best
    # Keys above this lose to ``best`` or leave ``top`` no lower: never built.
    cut = a.load[top] - 1 if best is None else min(best[0], a.load[top] - 1)
    if a.p.transfer_aware:
        flat = _swap_scored(a, top, r, goal, cut, theirs, their_units)
    else:
        flat = _swap_unscored(a, top, r, goal, cut, theirs, their_units)
    if flat is None:
        return best
    here = (*flat[:3], ((flat[3], r), (flat[4], top)))
    return here if best is None or here < best else best


def _swap_candidates(a: _Assignment, top: int, r: int, theirs: list[int]):
    """``(cost, unit, position on r)`` of each pair :func:`_swap_with` tries, ``r``'s unit cheaper."""
    half_gap, last = (a.load[top] - a.load[r]) / 2, len(theirs) - 1
    mine, my_units = a.units_on(top)
    step = _stride(len(mine))
    for cu, u in zip(mine[::step], my_units[::step]):
        j = bisect_left(theirs, cu - half_gap)
        for j in range(j - 1 if j else 0, j + 1 if j <= last else j):
            if theirs[j] >= cu:
                break  # ascending: the next one is no cheaper
            yield cu, u, j


def _swap_scored(a: _Assignment, top: int, r: int, goal: int, cut: int, theirs: list[int], their_units: list[int]):
    """The best ``(max(score, goal), bytes added, score, u, v)`` at most ``cut``, transfers counted."""
    flat = None
    for _, u, j in _swap_candidates(a, top, r, theirs):
        v = their_units[j]
        score, added = _score(a, ((u, r), (v, top)))
        key = (score if score > goal else goal, added, score, u, v)
        if key[0] <= cut and (flat is None or key < flat):
            flat = key
    return flat


def _swap_unscored(a: _Assignment, top: int, r: int, goal: int, cut: int, theirs: list[int], their_units: list[int]):
    """:func:`_swap_scored` without transfers, where only ``top`` and ``r`` change, by the cost
    difference: the planner's hot loop. Candidates are judged on their step time, then on bytes
    added, and a key is built only for those that can still win (``cut`` falls with every new best)."""
    p, lt, lr = a.p, a.load[top], a.load[r]
    home, weight, half_gap = p.home, p.weight, (lt - lr) / 2
    mine, my_units = a.units_on(top)
    # Only a cost difference d with lt - d <= cut and lr + d <= cut can win, which bounds the
    # units of top worth trying by r's cheapest and dearest units.
    first = bisect_left(mine, theirs[0] + max(lt - cut, 1))
    end = bisect_right(mine, theirs[-1] + cut - lr, first)
    theirs = theirs + [math.inf]  # a sentinel at both ends (index -1 too): never cheaper than a unit
    flat, fewest = None, math.inf  # the best key so far and its bytes added
    step = _stride(end - first)
    for cu, u in zip(mine[first:end:step], my_units[first:end:step]):
        j = bisect_left(theirs, cu - half_gap)
        for j in (j - 1, j):  # the two units either side of the balancing cost (inlined _swap_candidates)
            delta = cu - theirs[j]
            if delta <= 0:
                continue
            score = lt - delta if lt - delta > lr + delta else lr + delta
            clipped = score if score > goal else goal
            if clipped > cut:
                continue
            v, hu = their_units[j], home[u]
            hv = home[v]
            added = weight[u] * ((r != hu) - (top != hu)) + weight[v] * ((top != hv) - (r != hv))
            if clipped == cut and added > fewest:
                continue
            key = (clipped, added, score, u, v)
            if flat is None or key < flat:
                flat, cut, fewest = key, clipped, added
    return flat


def _stride(count: int) -> int:
    """Every how many of a rank's ``count`` candidate units a swap tries: all of them up to
    ``SWAP_SCAN``, beyond that an even spread of ``SWAP_SCAN`` across their costs (a rank holding
    most of a large step would otherwise cost a scan of all its units per step)."""
    return -(-count // SWAP_SCAN) if count > SWAP_SCAN else 1


def _local_search(a: _Assignment, goal: int, max_steps: int, partners: int = SWAP_PARTNERS) -> _Assignment:
    """Relieve the most loaded rank by the best move, else the best swap, while that lowers it and
    it is above ``goal``: the lowest resulting load (down to ``goal``), then the fewest bytes.
    Every step lowers the top rank and leaves every rank it touches below the old top, so the
    sorted load vector strictly decreases and the search terminates."""
    load, home = a.load, a.p.home
    high = [(-x, r) for r, x in enumerate(load)]
    low = [(x, r) for r, x in enumerate(load)]
    heapify(high)
    heapify(low)
    budget = WORK_PER_UNIT * (len(a.p.cost) + a.p.num_ranks)
    for _ in range(max_steps):
        a.work += 1
        if a.work > budget:
            break
        while -high[0][0] != load[high[0][1]]:
            heappop(high)
        while low[0][0] != load[low[0][1]]:
            heappop(low)
        top, bottom = high[0][1], low[0][1]
        if load[top] <= goal:
            break
        step = _best_move(a, top, bottom, goal)
        if step is None or step[2] >= load[top]:
            step = _best_swap(a, top, bottom, goal, partners)
            if step is None or step[2] >= load[top]:
                break
        touched = {top}
        for u, dest in step[3]:
            touched.add(dest)
            touched.add(home[u])
            a.move(u, dest)
        for r in touched:
            heappush(high, (-load[r], r))
            heappush(low, (load[r], r))
    return a


def _send_home_where_free(a: _Assignment) -> _Assignment:
    """Moved units go back home (heaviest first) wherever that keeps the step time."""
    p, limit, load, home, cost = a.p, a.makespan(), a.load, a.p.home, a.p.cost
    for u in _heaviest_first(a):
        if p.transfer_aware:
            fits = _score(a, ((u, home[u]),))[0] <= limit
        else:  # inlined: only the home rank's load rises
            fits = load[home[u]] + cost[u] <= limit
        if fits:
            a.move(u, home[u])
    return a


def _home_swaps(a: _Assignment, scan: int = 64) -> _Assignment:
    """Each moved unit ``u`` (heaviest first) goes home in exchange for a visitor ``v`` of its
    home, which takes ``u``'s place, when that keeps the step time: ``u`` stops travelling and
    ``v`` travels no more than before (it goes home if ``u`` sat on its home), so fewer units and
    bytes move. Homes with more than ``scan`` visitors are left alone (the scan stays linear)."""
    p, limit, where, load, home, cost = a.p, a.makespan(), a.where, a.load, a.p.home, a.p.cost
    for u in _heaviest_first(a):
        h, r, c = home[u], where[u], cost[u]
        visitors = a.visitors.get(h, ())
        if r == h or not visitors or len(visitors) > scan:
            continue
        for v in sorted(visitors) if len(visitors) > 1 else visitors:  # lowest unit first: deterministic
            d = c - cost[v]  # h gains d, r loses it
            if load[h] + d > limit or load[r] - d > limit:
                continue
            if p.transfer_aware and _score(a, ((u, h), (v, r)))[0] > limit:
                continue
            a.move(u, h)
            a.move(v, r)
            break
    return a


def _heaviest_first(a: _Assignment) -> list[int]:
    """The moved units, heaviest first (ties: lowest unit first)."""
    units = sorted(a.away)
    if a.p.bytes_vary:  # stable, also reversed: equal weights keep their order
        units.sort(key=a.p.weight.__getitem__, reverse=True)
    return units


def _lighter_substitutes(a: _Assignment, scan: int = 8) -> _Assignment:
    """Each moved unit (heaviest first) trades places with a lighter unit still at its home when
    that keeps the step time: the same work moves, fewer bytes travel. Candidates are the home
    units whose cost keeps both ranks within the step time (at most ``scan`` of them)."""
    p, limit, where, weight, load = a.p, a.makespan(), a.where, a.p.weight, a.load
    sorted_costs, offsets, home, cost = p.sorted_costs, p.offsets, p.home, p.cost
    for u in _heaviest_first(a):
        h, r, c = home[u], where[u], cost[u]
        if r == h:
            continue
        # h's own units (its slice of the global order) whose cost keeps h (which gets u back and
        # loses v) and r (which trades u for v) within the limit; those still at home are candidates
        lo = bisect_left(sorted_costs, c - (limit - load[h]), offsets[h], offsets[h + 1])
        hi = bisect_right(sorted_costs, c + (limit - load[r]), lo, min(offsets[h + 1], lo + scan))
        if hi - lo < 2:  # u alone (it lies in its own window)
            continue
        lighter = [v for v in p.sorted_units[lo:hi] if where[v] == h and weight[v] < weight[u]]
        for v in sorted(lighter, key=lambda v: (weight[v], v)) if len(lighter) > 1 else lighter:
            # Without transfers only h and r change, by the cost difference: the window is the test.
            if not p.transfer_aware or _score(a, ((u, h), (v, r)))[0] <= limit:
                a.move(u, h)
                a.move(v, r)
                break
    return a


# ---- the plan -----------------------------------------------------------------------------------


def _key(a: _Assignment) -> tuple[int, int, int]:
    """Lower is better: step time, then bytes moved, then units moved."""
    return (a.makespan(), *a.moved())


def _lpt_start(p: _Problem, bins: list[int]) -> _Assignment:
    """Plain LPT's placement (``bins``, from :func:`_lpt`), each bin named after the rank whose
    units it holds the most bytes of (greedily, heaviest first), so what LPT keeps together stays
    home where it can."""
    kept: dict[tuple[int, int], int] = {}
    for b, h, w in zip(bins, p.home, p.weight):
        kept[(b, h)] = kept.get((b, h), 0) + w
    name, taken = {}, set()
    for (b, h), _ in sorted(kept.items(), key=lambda item: (-item[1], item[0])):
        if b not in name and h not in taken:
            name[b] = h
            taken.add(h)
    free = iter(sorted(set(range(p.num_ranks)) - taken))
    name.update({b: next(free) for b in range(p.num_ranks) if b not in name})
    a = _Assignment(p)
    a.leave_home([(u, name[b]) for u, b in enumerate(bins) if name[b] != p.home[u]])
    return a


def _balanced(p: _Problem, lower: int, max_steps: int) -> _Assignment:
    """The move-once heuristic's moves from home (so no plan is worse than the anchor's), taken by
    the local search down to the goal and sent home where free. With transfers (which the
    heuristic ignores) the search also starts from home alone and from plain LPT, and the best
    plan wins: step time, then bytes moved, then units moved. Without transfers a plan must not
    be behind plain LPT either: one that is searches on toward LPT's makespan, and where it still
    falls short LPT's own placement starts a search too (it moves more units, so only then)."""
    goal = lower + int(lower * PLAN_TOLERANCE)
    anchor = _Assignment(p)
    anchor.leave_home(_move_once(p))
    if p.transfer_aware:
        return min((_searched(a, goal, max_steps) for a in (anchor, _Assignment(p), _lpt_start(p, _lpt(p)[0]))), key=_key)
    best = _searched(anchor, goal, max_steps)
    if best.makespan() <= _count_bound(p):  # optimal: LPT cannot be ahead
        return best
    lpt_makespan = _lpt_makespan(p)
    if best.makespan() > lpt_makespan:  # on toward LPT, swaps tried with more ranks
        best = _searched(best, lpt_makespan, max_steps, partners=4 * SWAP_PARTNERS)
    if best.makespan() > lpt_makespan:
        best = min(best, _searched(_lpt_start(p, _lpt(p)[0]), goal, max_steps), key=_key)
    return best


def _lpt_makespan(p: _Problem) -> int:
    """Plain LPT's makespan alone: a heap of loads (which of equally loaded ranks takes a unit
    changes no load, so ties need no bookkeeping), a third of :func:`lpt_bins`' time."""
    ordered = sorted(p.cost, reverse=True)
    loads = ordered[: p.num_ranks] + [0] * (p.num_ranks - len(ordered))  # the dearest each open a rank
    heapify(loads)
    for c in itertools.islice(ordered, p.num_ranks, None):
        heapreplace(loads, loads[0] + c)
    return max(loads)


def _count_bound(p: _Problem) -> int:
    """A lower bound on any plan's makespan, often tight where units cost alike: for every j, the
    j dearest units each cost at least the j-th dearest, and some rank encodes ceil(j / ranks)
    of them."""
    ordered = np.sort(np.asarray(p.cost, dtype=np.int64))[::-1]
    per_rank = -(-np.arange(1, len(ordered) + 1) // p.num_ranks)
    return int((ordered * per_rank).max(initial=0))  # <= the total: fits int64


def _lpt(p: _Problem) -> tuple[list[int], int]:
    """Plain LPT's bin of every unit and its makespan (exact integer sums)."""
    bins = lpt_bins(np.asarray(p.cost, dtype=np.int64), p.num_ranks)
    loads = np.zeros(p.num_ranks, dtype=np.int64)
    np.add.at(loads, bins, np.asarray(p.cost, dtype=np.int64))
    return bins.tolist(), int(loads.max(initial=0))


def _searched(a: _Assignment, goal: int, max_steps: int, partners: int = SWAP_PARTNERS) -> _Assignment:
    """``a`` after the local search down to ``goal``, then home where free (and lighter units
    where bytes vary)."""
    a = _home_swaps(_send_home_where_free(_local_search(a, goal, max_steps, partners)))
    return _lighter_substitutes(a) if a.p.bytes_vary else a


def plan_assignment(
    costs_per_rank: Sequence[Sequence[float]],
    bytes_per_rank: Sequence[Sequence[int]] | None = None,
    *,
    bandwidth: float | None = None,
    latent_bytes_per_rank: Sequence[Sequence[int]] | None = None,
    max_steps: int | None = None,
) -> Plan:
    """Plan which rank encodes each unit.

    Args:
        costs_per_rank: ``costs_per_rank[r][i]`` = predicted seconds of rank ``r``'s ``i``-th unit
            (finite, >= 0). Its length is the number of ranks; a rank may have no units.
        bytes_per_rank: same nesting, bytes of each unit. When given, ties between equally good
            plans move the fewest bytes and ``Plan.moved_bytes`` is reported; otherwise the fewest units.
        bandwidth: bytes per second of each rank's link. When given (with ``bytes_per_rank``), a
            moved unit costs ``(bytes + latent bytes) / bandwidth`` seconds on its owner and on its
            helper, and the plan minimizes the predicted step time (``Plan.step_seconds``).
        latent_bytes_per_rank: same nesting, bytes of each unit's latent (the way back); only with
            ``bandwidth``. Default: the way back is not counted.
        max_steps: cap on local-search steps (default ``4 * (units + ranks) + 16``).

    Pure and deterministic: the same input gives the same plan on every rank. Never a higher
    step time than not balancing, or than cosmos-framework's ``plan_rebalance`` on the same costs;
    without ``bandwidth`` never a higher makespan than plain LPT (:func:`lpt_makespan`) either.
    """
    p = _problem(costs_per_rank, bytes_per_rank, bandwidth, latent_bytes_per_rank)
    steps = 4 * (len(p.cost) + p.num_ranks) + 16 if max_steps is None else as_int("max_steps", max_steps, minimum=0)
    lower = max(-(-p.total // p.num_ranks), p.largest)
    home_makespan = max(p.home_load)
    best = None
    if p.num_ranks > 1 and home_makespan > lower:
        best = _balanced(p, lower, steps)
        if best.makespan() >= home_makespan:
            best = None
    best = _Assignment(p) if best is None else best  # not balancing
    return _plan_of(p, best, home_makespan, lower, bytes_given=bytes_per_rank is not None, bandwidth=bandwidth)


def _plan_of(p: _Problem, a: _Assignment, home_makespan: int, lower: int, *, bytes_given: bool, bandwidth) -> Plan:
    encode, where = a.encode_loads(), a.where
    moved_bytes, moved_units = a.moved()
    transfers = [(s - e) / NS_PER_SECOND for s, e in zip(a.load, encode)] if p.transfer_aware else [0.0] * p.num_ranks
    return Plan(
        assignment=tuple([tuple(where[lo:hi]) for lo, hi in zip(p.offsets, p.offsets[1:])]),
        loads=tuple([x / NS_PER_SECOND for x in encode]),
        makespan=max(encode, default=0) / NS_PER_SECOND,
        lower_bound=lower / NS_PER_SECOND,
        home_makespan=home_makespan / NS_PER_SECOND,
        moved_units=moved_units,
        moved_bytes=moved_bytes if bytes_given else None,
        transfer_seconds=tuple(transfers),
        step_seconds=a.makespan() / NS_PER_SECOND,
        bandwidth=None if bandwidth is None else float(bandwidth),
    )


def lpt_bins(costs: np.ndarray, num_bins: int) -> np.ndarray:
    """Plain LPT: units in decreasing cost (ties by input order) each go to the least loaded bin
    (ties by lowest bin index). Returns the bin of every unit."""
    bins = np.empty(len(costs), dtype=np.int64)
    heap = [(0, b) for b in range(num_bins)]
    for unit in np.argsort(-np.asarray(costs), kind="stable").tolist():
        load, b = heappop(heap)
        bins[unit] = b
        heappush(heap, (load + int(costs[unit]), b))
    return bins


def lpt_makespan(costs_per_rank: Sequence[Sequence[float]]) -> float:
    """Makespan (seconds) of plain LPT (every unit placed afresh) on the same quantized costs."""
    costs = [c for per_rank in quantize_costs(costs_per_rank) for c in per_rank]
    if not costs:
        return 0.0
    loads = [0] * len(costs_per_rank)
    for unit, b in enumerate(lpt_bins(np.array(costs, dtype=np.int64), len(costs_per_rank)).tolist()):
        loads[b] += costs[unit]
    return max(loads) / NS_PER_SECOND


__all__ = ["NS_PER_SECOND", "PLAN_TOLERANCE", "Plan", "lpt_bins", "lpt_makespan", "move_once_moves", "plan_assignment", "quantize_costs"]
