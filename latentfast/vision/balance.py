"""Spread a step's encode calls across a process group, then hand every latent back to its owner.

One call of :func:`offload_encode` per step, entered by every rank of the group (also ranks with
no units), runs these steps:

1. **header** -- one ``all_gather`` of a fixed-size float64 row per rank: a status flag and error
   text, the unit count, and the arguments that must agree (``capacity``, ``bandwidth``). Its size
   depends on nothing a rank passes, so a rank with bad input or a different setting makes every
   rank raise :class:`OffloadEncodeError` instead of desynchronizing the group;
2. **units** -- one ``all_gather`` of every unit's predicted seconds, latent bytes, dtype and
   shape (exact in float64), as many rows as the largest rank has units;
3. **plan** -- the same :func:`plan_assignment` on every rank, from the gathered numbers;
4. **units out, encode** -- moved units travel in one ``batch_isend_irecv``, packed into one
   message per (sender, receiver) pair; each rank encodes its kept units while they travel, then
   the units it received;
5. **status** -- one ``all_gather`` of every rank's status and the shapes/dtypes of the latents
   it made for others: an encode that raised on any rank makes every rank raise, naming that
   rank, instead of leaving peers blocked in a transfer that never comes;
6. **latents back** -- to their owners with one ``batch_isend_irecv``, packed the same way.

Gathered rows come back to the host in one copy per gather. Every wait honors ``timeout``
(default: the group's own timeout); a timeout raises :class:`OffloadEncodeError` naming the step.
"""
from __future__ import annotations

import dataclasses
import datetime
import math
import operator
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..devices import as_device
from ..distributed import (all_gather_rows, check_collective_device, failed_ranks, pack, packed_size, status_row,
                           status_text, unpack)
from ..checks import as_int
from ..errors import ArgumentTypeError, InvalidArgumentError, OffloadEncodeError
from .plan import Plan, as_bandwidth, plan_assignment

MAX_NDIM = 6
DEFAULT_CAPACITY = 4096  # most units one rank may bring to a step (bounds every rank's metadata buffers)
MESSAGE_CHARS = 256  # error text carried per rank in the header and status gathers
WIRE_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
)  # fmt: skip
UNIT_ROW = 4 + MAX_NDIM  # seconds, latent bytes, dtype code, ndim, shape
LATENT_ROW = 2 + MAX_NDIM  # dtype code, ndim, shape

Spec = tuple[torch.dtype, tuple[int, ...]]


# ---- wire formats -------------------------------------------------------------------------------


def _describe(tensor: torch.Tensor, what: str) -> list[float]:
    """``[dtype code, ndim, *shape padded to MAX_NDIM]`` of a tensor that can travel."""
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in WIRE_DTYPES:
        raise InvalidArgumentError(f"{what} has dtype {tensor.dtype}; supported: {WIRE_DTYPES}")
    if tensor.ndim > MAX_NDIM:
        raise InvalidArgumentError(f"{what} must have at most {MAX_NDIM} dims, got shape {tuple(tensor.shape)}")
    shape = list(tensor.shape) + [0] * (MAX_NDIM - tensor.ndim)
    return [float(WIRE_DTYPES.index(tensor.dtype)), float(tensor.ndim), *map(float, shape)]


def _undescribe(row: list[float]) -> Spec:
    dtype, ndim = WIRE_DTYPES[int(row[0])], int(row[1])
    return dtype, tuple(int(x) for x in row[2 : 2 + ndim])


def _status(errors: list[BaseException]) -> list[float]:
    """The head of every status row: the flag and this rank's first error (:func:`latentfast.distributed.status_row`)."""
    return status_row(errors, MESSAGE_CHARS)


# ---- the group ----------------------------------------------------------------------------------


@dataclasses.dataclass
class _Group:
    """The balancing group as one rank sees it, with the collectives every step uses."""

    group: dist.ProcessGroup
    rank: int
    size: int
    device: torch.device
    timeout: datetime.timedelta | None

    def wait(self, work, stage: str) -> None:
        try:
            work.wait() if self.timeout is None else work.wait(self.timeout)
        except RuntimeError as exc:  # a peer that never came, or a broken group
            raise OffloadEncodeError(f"offload_encode: waiting for the group at {stage} failed on rank {self.rank}: {exc}") from exc

    def all_gather(self, row: list[float], stage: str) -> list[list[float]]:
        """Every rank's ``row`` (same length on every rank), back on the host in one copy."""
        mine = torch.tensor(row, dtype=torch.float64, device=self.device)
        return all_gather_rows(mine, group=self.group, wait=lambda work: self.wait(work, stage))

    def exchange(self, ops: list[dist.P2POp], stage: str) -> None:
        for work in dist.batch_isend_irecv(ops) if ops else []:
            self.wait(work, stage)


def _group_of(group, group_rank, group_size, device, timeout) -> _Group:
    """Argument checks that need no peer (a mistake here is the caller's, on every rank alike)."""
    try:
        group_rank, group_size = operator.index(group_rank), operator.index(group_size)
    except TypeError as exc:
        raise ArgumentTypeError(f"group_rank and group_size must be ints, got {group_rank!r} and {group_size!r}") from exc
    if group_size < 1 or not 0 <= group_rank < group_size:
        raise InvalidArgumentError(f"group_rank must be in [0, group_size), got group_rank={group_rank}, group_size={group_size}")
    if group_size != dist.get_world_size(group) or group_rank != dist.get_rank(group):
        raise InvalidArgumentError(
            f"group_rank/group_size ({group_rank}/{group_size}) disagree with the process group "
            f"({dist.get_rank(group)}/{dist.get_world_size(group)})"
        )
    if timeout is not None and not isinstance(timeout, datetime.timedelta):
        raise ArgumentTypeError(f"timeout must be a datetime.timedelta or None, got {timeout!r}")
    return _Group(dist.group.WORLD if group is None else group, group_rank, group_size, as_device(device), timeout)


def _raise_if_failed(rows: list[list[float]], group_rank: int, stage: str, local_errors: list[BaseException]) -> None:
    """Raise on every rank if any rank flagged a failure; this rank's own error becomes the cause.

    The error is popped out of ``local_errors`` so the raising frame does not keep it: a frame
    that references its own exception forms a cycle, and a process group reachable from such a
    cycle may only be freed after ``destroy_process_group``, which aborts the process."""
    failed = failed_ranks(rows)
    if not failed:
        return
    details = "; ".join(f"rank {r}: {status_text(rows[r][1 : 1 + MESSAGE_CHARS])}" for r in failed)
    where = "this rank" if group_rank in failed else f"rank(s) {failed}"
    cause = local_errors.pop() if local_errors else None
    raise OffloadEncodeError(f"offload_encode failed at {stage} on {where} ({details})", failed) from cause


def _raise_unless_uniform(values: list[float], name: str) -> None:
    """A setting every rank must share (the plan is computed on every rank from it)."""
    if len(set(values)) > 1:
        differing = [r for r, v in enumerate(values) if v != values[0]]
        shown = ["none" if name == "bandwidth" and v == 0 else v for v in values]
        raise OffloadEncodeError(f"offload_encode: {name} must be the same on every rank, got {shown} (rank order)", differing)


# ---- steps 1-3: metadata and plan ---------------------------------------------------------------


def _local_units(local_tensors, seconds, latent_bytes, device: torch.device, errors: list) -> tuple[list, list]:
    """This rank's tensors and unit rows, validated here; a failure is recorded in ``errors``
    (reported to every rank by the header gather), never raised before the collectives."""
    if errors:
        return [], []
    try:
        tensors, seconds = list(local_tensors), [float(s) for s in seconds]
        latent = [0.0] * len(tensors) if latent_bytes is None else [float(b) for b in latent_bytes]
        if not len(seconds) == len(latent) == len(tensors):
            raise InvalidArgumentError(
                f"got {len(tensors)} local_tensors, {len(seconds)} local_predicted_seconds and {len(latent)} local_latent_bytes"
            )
        rows = []
        for i, (tensor, cost, size) in enumerate(zip(tensors, seconds, latent)):
            described = _describe(tensor, f"local_tensors[{i}]")
            if as_device(tensor.device) != device:
                raise InvalidArgumentError(f"local_tensors[{i}] must be on {device}, got {tensor.device}")
            if not (math.isfinite(cost) and cost >= 0):
                raise InvalidArgumentError(f"local_predicted_seconds[{i}] must be finite and >= 0, got {cost}")
            if not (math.isfinite(size) and size >= 0 and size == int(size)):
                raise InvalidArgumentError(f"local_latent_bytes[{i}] must be a whole number >= 0, got {size}")
            rows.append([cost, size, *described])
        return tensors, rows
    except Exception as exc:  # noqa: BLE001 -- reported to every rank, then raised there
        errors.append(exc)
        return [], []


def _gather_units(g: _Group, rows: list, errors: list, capacity: int, bandwidth: float | None) -> list[list[list[float]]]:
    """Steps 1-2: the fixed-size header, then every rank's unit rows; raises on every rank if any
    rank failed, disagrees on ``capacity``/``bandwidth`` or brings more than ``capacity`` units."""
    headers = g.all_gather(_status(errors) + [float(len(rows)), float(capacity), float(bandwidth or 0.0)], "the header gather")
    _raise_if_failed(headers, g.rank, "input validation", errors)
    counts = [int(h[-3]) for h in headers]
    _raise_unless_uniform([h[-2] for h in headers], "capacity")
    _raise_unless_uniform([h[-1] for h in headers], "bandwidth")
    over = [r for r, n in enumerate(counts) if n > capacity]
    if over:
        raise OffloadEncodeError(f"offload_encode: rank(s) {over} bring {[counts[r] for r in over]} units, more than capacity={capacity}", over)
    most = max(counts)
    if most == 0:
        return [[] for _ in counts]
    body = [x for row in rows for x in row] + [0.0] * ((most - len(rows)) * UNIT_ROW)
    gathered = g.all_gather(body, "the unit gather")
    return [[flat[i * UNIT_ROW : (i + 1) * UNIT_ROW] for i in range(n)] for flat, n in zip(gathered, counts)]


@dataclasses.dataclass
class _Moves:
    """The plan as transfers: which units leave which rank for which, in one agreed order."""

    plan: Plan
    specs: list[list[Spec]]  # the shape/dtype of every rank's units
    between: dict[tuple[int, int], list[int]]  # (owner, helper) -> the owner's unit indices, in order
    incoming: dict[int, list[tuple[int, int]]]  # helper -> (owner, unit index) it encodes, owners in rank order

    @classmethod
    def plan_for(cls, unit_rows: list[list[list[float]]], bandwidth: float | None) -> _Moves:
        """Step 3: the same plan on every rank, from the gathered numbers."""
        costs = [[row[0] for row in rows] for rows in unit_rows]
        specs = [[_undescribe(row[2:]) for row in rows] for rows in unit_rows]
        nbytes = [[math.prod(shape) * dtype.itemsize for dtype, shape in rank_specs] for rank_specs in specs]
        latent = [[int(row[1]) for row in rows] for rows in unit_rows] if bandwidth else None
        plan = plan_assignment(costs, nbytes, bandwidth=bandwidth, latent_bytes_per_rank=latent)
        between: dict[tuple[int, int], list[int]] = {}
        incoming: dict[int, list[tuple[int, int]]] = {}
        for r, row in enumerate(plan.assignment):
            for i, dest in enumerate(row):
                if dest != r:
                    between.setdefault((r, dest), []).append(i)
                    incoming.setdefault(dest, []).append((r, i))
        return cls(plan, specs, between, incoming)


# ---- steps 4-6: transfers and encode ------------------------------------------------------------


def _encode(encode_fn, tensor: torch.Tensor, device: torch.device, what: str) -> torch.Tensor:
    latent = encode_fn(tensor)
    _describe(latent, f"encode_fn's result for {what}")
    return latent.to(device).contiguous()


def _units_out_and_encode(g: _Group, m: _Moves, tensors: list, encode_fn, errors: list) -> tuple[list, dict]:
    """Step 4: moved units travel while this rank encodes the ones it kept; then it encodes the
    ones it received. Returns this rank's latents (``None`` where a helper encodes) and the
    latents made for others by ``(owner, unit index)``."""
    ops, arriving = [], []
    for peer in range(g.size):
        if peer == g.rank:
            continue
        outgoing = [tensors[i] for i in m.between.get((g.rank, peer), [])]
        if outgoing:
            ops.append(dist.P2POp(dist.isend, pack(outgoing, g.device), group=g.group, group_peer=peer))
        incoming = [(peer, i) for i in m.between.get((peer, g.rank), [])]
        if incoming:
            buffer = torch.empty(packed_size([m.specs[r][i] for r, i in incoming]), dtype=torch.uint8, device=g.device)
            ops.append(dist.P2POp(dist.irecv, buffer, group=g.group, group_peer=peer))
            arriving.append((incoming, buffer))
    works = dist.batch_isend_irecv(ops) if ops else []
    latents: list[torch.Tensor | None] = [None] * len(tensors)
    try:
        for i, dest in enumerate(m.plan.assignment[g.rank]):
            if dest == g.rank:
                latents[i] = _encode(encode_fn, tensors[i], g.device, f"local unit {i}")
    except Exception as exc:  # noqa: BLE001 -- reported to every rank in the status gather
        errors.append(exc)
    for work in works:
        g.wait(work, "the unit transfers")
    received = {}
    for incoming, buffer in arriving:
        received.update(zip(incoming, unpack(buffer, [m.specs[r][i] for r, i in incoming])))
    made: dict[tuple[int, int], torch.Tensor] = {}
    if not errors:
        try:
            for r, i in m.incoming.get(g.rank, []):
                made[(r, i)] = _encode(encode_fn, received[(r, i)], g.device, f"rank {r}'s unit {i}")
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
    return latents, made


def _gather_status(g: _Group, m: _Moves, made: dict, errors: list) -> dict[tuple[int, int], Spec]:
    """Step 5: every rank's status and the specs of the latents it made for others; raises on
    every rank if any encode failed. Returns the spec of the latent of every unit of this rank that moved."""
    most_incoming = max(map(len, m.incoming.values()), default=0)
    body = [] if errors else [x for key in m.incoming.get(g.rank, []) for x in _describe(made[key], "latent")]
    body += [0.0] * (most_incoming * LATENT_ROW - len(body))
    statuses = g.all_gather(_status(errors) + body, "the status gather")
    _raise_if_failed(statuses, g.rank, "encode", errors)
    specs = {}
    for helper, keys in m.incoming.items():  # a helper's latent rows follow the order of its incoming moves
        for k, key in enumerate(keys):
            if key[0] == g.rank:  # only this rank's own units come back to it
                start = 1 + MESSAGE_CHARS + k * LATENT_ROW
                specs[key] = _undescribe(statuses[helper][start : start + LATENT_ROW])
    return specs


def _latents_back(g: _Group, m: _Moves, made: dict, latent_specs: dict, latents: list) -> None:
    """Step 6: latents made for others go home, one packed message per pair; fills ``latents``."""
    ops, arriving = [], []
    for peer in range(g.size):
        if peer == g.rank:
            continue
        done = [made[(peer, i)] for i in m.between.get((peer, g.rank), [])]
        if done:
            ops.append(dist.P2POp(dist.isend, pack(done, g.device), group=g.group, group_peer=peer))
        mine = m.between.get((g.rank, peer), [])
        if mine:
            buffer = torch.empty(packed_size([latent_specs[(g.rank, i)] for i in mine]), dtype=torch.uint8, device=g.device)
            ops.append(dist.P2POp(dist.irecv, buffer, group=g.group, group_peer=peer))
            arriving.append((mine, buffer))
    g.exchange(ops, "the latent transfers")
    for mine, buffer in arriving:
        for i, latent in zip(mine, unpack(buffer, [latent_specs[(g.rank, i)] for i in mine])):
            latents[i] = latent


def offload_encode(
    local_tensors: Sequence[torch.Tensor],
    local_predicted_seconds: Sequence[float],
    encode_fn: Callable[[torch.Tensor], torch.Tensor],
    *,
    group: dist.ProcessGroup | None,
    group_rank: int,
    group_size: int,
    device: torch.device | str,
    timeout: datetime.timedelta | None = None,
    capacity: int = DEFAULT_CAPACITY,
    bandwidth: float | None = None,
    local_latent_bytes: Sequence[int] | None = None,
    return_plan: bool = False,
    failure: BaseException | None = None,
) -> list[torch.Tensor] | tuple[list[torch.Tensor], Plan]:
    """Encode this rank's units somewhere in ``group`` and return their latents in local order.

    Args:
        local_tensors: this rank's encode inputs (possibly none), each on ``device``.
        local_predicted_seconds: predicted encode seconds of each (the plan's costs).
        encode_fn: called as ``encode_fn(tensor)`` at call time, on whichever rank the plan picks.
            It must be the same function on every rank and return a tensor.
        group, group_rank, group_size: the balancing group (``None`` = the default group) and this
            rank's place in it.
        device: where metadata and received tensors live (the process group's device), read with
            :func:`latentfast.devices.as_device` (``"cuda"`` is the current CUDA device); under
            NCCL it must be the current CUDA device. Passed explicitly because a rank with no
            units has no tensor to take it from.
        timeout: for every wait; ``None`` uses the group's timeout.
        capacity: the most units one rank may bring (every rank sizes its metadata buffers by
            the largest count); the same on every rank.
        bandwidth: bytes per second of each rank's link, the same on every rank (e.g. from
            :func:`measure_link_bandwidth`). When given, the plan minimizes the predicted step
            time including transfers (pixels out, latents back); see :func:`plan_assignment`.
        local_latent_bytes: predicted bytes of each unit's latent (the way back), with ``bandwidth``.
        return_plan: also return the :class:`Plan` that was executed.
        failure: this rank already failed preparing its units: still join the collectives, but
            only to make every rank raise :class:`OffloadEncodeError` naming this rank.

    Every rank of the group must call this in the same step (entry must be rank-uniform). If any
    rank's inputs are invalid, its settings differ from the others', or its ``encode_fn`` raises,
    every rank raises :class:`OffloadEncodeError` naming the failing rank(s).
    """
    g = _group_of(group, group_rank, group_size, device, timeout)
    errors: list[BaseException] = []  # at most one: this rank's first failure, reported to every rank
    if failure is not None:  # appended, not re-raised here: that would tie this frame into its traceback
        errors.append(failure)
    capacity, bandwidth = _settings(g, capacity, bandwidth, errors)
    tensors, rows = _local_units(local_tensors, local_predicted_seconds, local_latent_bytes, g.device, errors)
    unit_rows = _gather_units(g, rows, errors, capacity, bandwidth)
    moves = _Moves.plan_for(unit_rows, bandwidth)
    latents, made = _units_out_and_encode(g, moves, tensors, encode_fn, errors)
    latent_specs = _gather_status(g, moves, made, errors)
    _latents_back(g, moves, made, latent_specs, latents)
    return (latents, moves.plan) if return_plan else latents


def _settings(g: _Group, capacity, bandwidth, errors: list) -> tuple[int, float | None]:
    """``capacity`` and ``bandwidth`` read, and the device checked against the group's backend; a
    bad one is recorded in ``errors`` (every rank raises after the header gather), not raised
    here, where the peers would be left waiting."""
    try:
        check_collective_device(g.device, dist.get_backend(g.group), _current_cuda_index())
        return as_int("capacity", capacity, minimum=1), as_bandwidth(bandwidth)
    except (InvalidArgumentError, ArgumentTypeError) as exc:
        errors.append(exc)
        if dist.get_backend(g.group) == "nccl":
            g.device = torch.device("cuda", torch.cuda.current_device())  # where NCCL can still report it
        return DEFAULT_CAPACITY, None


def _current_cuda_index() -> int | None:
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def measure_link_bandwidth(
    *, group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu", nbytes: int = 8 << 20, repeats: int = 5
) -> float:
    """Bytes per second one rank's link moves, measured by every rank of ``group`` at once: each
    sends ``nbytes`` to the next rank and receives as much from the previous one, ``repeats``
    times (median); the slowest rank's figure is returned on every rank, so passing it to
    :class:`VisionEncoder` (``link_bandwidth=``) keeps the plan identical everywhere."""
    device, size, rank = as_device(device), dist.get_world_size(group), dist.get_rank(group)
    nbytes, repeats = as_int("nbytes", nbytes, minimum=1), as_int("repeats", repeats, minimum=1)
    if size < 2:
        raise InvalidArgumentError(f"measure_link_bandwidth needs a group of at least 2 ranks, got {size}")
    out, into = torch.zeros(nbytes, dtype=torch.uint8, device=device), torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats + 1):  # the first round warms the connections up
        dist.barrier(group=group)
        start = time.perf_counter()
        ops = [
            dist.P2POp(dist.isend, out, group=group, group_peer=(rank + 1) % size),
            dist.P2POp(dist.irecv, into, group=group, group_peer=(rank - 1) % size),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    rate = torch.tensor([nbytes / statistics.median(times[1:])], dtype=torch.float64, device=device)
    dist.all_reduce(rate, op=dist.ReduceOp.MIN, group=group)
    return float(rate.item())


__all__ = ["OffloadEncodeError", "check_collective_device", "measure_link_bandwidth", "offload_encode"]
