"""Spread a step's encode calls across a process group, then hand every latent back to its owner.

One call of :func:`offload_encode` per step, entered by every rank of the group (also ranks with
no units), runs:

1. one ``all_gather`` of a fixed-size float64 tensor per rank: a status flag and error text, the unit count, and
   per unit its predicted seconds, dtype code, rank and shape (exact in float64). A rank with more
   units than the row capacity says so in its header and every rank repeats the gather once with
   the larger capacity, so the common case stays a single collective;
2. the same plan on every rank (:func:`plan_assignment` on the gathered numbers);
3. the units that move go out with one ``batch_isend_irecv``, packed into one message per
   (sender, receiver) pair; each rank encodes its own kept units while they travel, then the
   units it received;
4. one ``all_gather`` of every rank's status, error text and the shapes/dtypes of the latents it
   made for others: an encode that raised on any rank makes every rank raise, naming that rank,
   instead of leaving peers blocked in a transfer that never comes;
5. latents go back to their owners with one ``batch_isend_irecv``, packed the same way.

Every wait honors ``timeout`` (default: the group's own timeout).
"""
from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..errors import OffloadEncodeError
from .plan import Plan, plan_assignment

MAX_NDIM = 6
DEFAULT_CAPACITY = 32  # unit rows per rank in the first (usually only) metadata gather
MESSAGE_CHARS = 256  # error text carried per rank in the status gather
WIRE_DTYPES = (
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.bool,
)  # fmt: skip
UNIT_ROW = 3 + MAX_NDIM  # seconds, dtype code, ndim, shape
LATENT_ROW = 2 + MAX_NDIM  # dtype code, ndim, shape
OK, FAILED = 0.0, 1.0
PACK_ALIGN = 16  # bytes; segment alignment inside a packed message, so views of any dtype are legal


def _describe(tensor: torch.Tensor, what: str) -> list[float]:
    """``[dtype code, ndim, *shape padded to MAX_NDIM]`` of a tensor that can travel."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in WIRE_DTYPES:
        raise ValueError(f"{what} has dtype {tensor.dtype}; supported: {WIRE_DTYPES}")
    if tensor.ndim > MAX_NDIM:
        raise ValueError(f"{what} must have at most {MAX_NDIM} dims, got shape {tuple(tensor.shape)}")
    shape = list(tensor.shape) + [0] * (MAX_NDIM - tensor.ndim)
    return [float(WIRE_DTYPES.index(tensor.dtype)), float(tensor.ndim), *map(float, shape)]


def _undescribe(row: list[float]) -> tuple[torch.dtype, tuple[int, ...]]:
    dtype, ndim = WIRE_DTYPES[int(row[0])], int(row[1])
    return dtype, tuple(int(x) for x in row[2 : 2 + ndim])


def _status(errors: list[BaseException]) -> list[float]:
    """``[flag, *error text as code points padded to MESSAGE_CHARS]``: the head of every gathered row."""
    message = f"{type(errors[0]).__name__}: {errors[0]}" if errors else ""
    codes = [float(ord(ch)) for ch in message[:MESSAGE_CHARS]]
    return [FAILED if errors else OK] + codes + [0.0] * (MESSAGE_CHARS - len(codes))


def _decode_text(codes: list[float]) -> str:
    return "".join(chr(int(c)) for c in codes if c > 0)


def _segment_bytes(spec: tuple[torch.dtype, tuple[int, ...]]) -> int:
    """Bytes a tensor takes in a packed message, rounded up so every segment starts aligned."""
    dtype, shape = spec
    size = torch.Size(shape).numel() * dtype.itemsize
    return -(-size // PACK_ALIGN) * PACK_ALIGN


def _packed_size(specs) -> int:
    return sum(_segment_bytes(spec) for spec in specs)


def _pack(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Several tensors as one uint8 message (one transfer per peer instead of one per tensor)."""
    specs = [(t.dtype, tuple(t.shape)) for t in tensors]
    buffer = torch.empty(_packed_size(specs), dtype=torch.uint8, device=device)
    offset = 0
    for tensor, spec in zip(tensors, specs):
        size = tensor.numel() * tensor.dtype.itemsize
        buffer[offset : offset + size].copy_(tensor.contiguous().reshape(-1).view(torch.uint8))
        offset += _segment_bytes(spec)
    return buffer


def _unpack(buffer: torch.Tensor, specs) -> list[torch.Tensor]:
    """The tensors of a packed message, as views into it."""
    out, offset = [], 0
    for dtype, shape in specs:
        size = torch.Size(shape).numel() * dtype.itemsize
        out.append(buffer[offset : offset + size].view(dtype).reshape(shape))
        offset += _segment_bytes((dtype, shape))
    return out


def _all_gather_rows(row: torch.Tensor, group, group_size: int, timeout) -> list[list[float]]:
    gathered = [torch.empty_like(row) for _ in range(group_size)]
    work = dist.all_gather(gathered, row, group=group, async_op=True)
    _wait(work, timeout)
    return [t.cpu().tolist() for t in gathered]


def _wait(work, timeout: datetime.timedelta | None) -> None:
    if timeout is None:
        work.wait()
    else:
        work.wait(timeout)


def _exchange(ops: list[dist.P2POp], timeout) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            _wait(work, timeout)


def _raise_if_failed(statuses: list[list[float]], group_rank: int, stage: str, local_errors: list[BaseException]) -> None:
    """Raise on every rank if any rank flagged a failure; this rank's own error becomes the cause.

    The error is popped out of ``local_errors`` so the raising frame does not keep it: a frame
    that references its own exception forms a cycle, and a process group reachable from such a
    cycle may only be freed after ``destroy_process_group``, which aborts the process."""
    failed = [r for r, row in enumerate(statuses) if row[0] != OK]
    if not failed:
        return
    details = "; ".join(f"rank {r}: {_decode_text(statuses[r][1 : 1 + MESSAGE_CHARS])}" for r in failed)
    where = "this rank" if group_rank in failed else f"rank(s) {failed}"
    cause = local_errors.pop() if local_errors else None
    raise OffloadEncodeError(f"offload_encode failed at {stage} on {where} ({details})", failed) from cause


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
        device: where metadata and received tensors live (the process group's device). Passed
            explicitly because a rank with no units has no tensor to take it from.
        timeout: for every wait; ``None`` uses the group's timeout.
        capacity: unit rows per rank in the first metadata gather (more units cost a second one).
        return_plan: also return the :class:`Plan` that was executed.
        failure: this rank already failed preparing its units: still join the collectives, but
            only to make every rank raise :class:`OffloadEncodeError` naming this rank.

    Every rank of the group must call this in the same step (entry must be rank-uniform). If any
    rank's inputs are invalid or its ``encode_fn`` raises, every rank raises
    :class:`OffloadEncodeError` naming the failing rank(s).
    """
    device = torch.device(device)
    if group_size < 1 or not 0 <= group_rank < group_size:
        raise ValueError(f"group_rank must be in [0, group_size), got group_rank={group_rank}, group_size={group_size}")
    if group_size != dist.get_world_size(group) or group_rank != dist.get_rank(group):
        raise ValueError(
            f"group_rank/group_size ({group_rank}/{group_size}) disagree with the process group "
            f"({dist.get_rank(group)}/{dist.get_world_size(group)})"
        )
    if group is None:
        group = dist.group.WORLD
    capacity = max(int(capacity), 1)

    # 1. Metadata: validate locally, but report failure through the gather so no peer blocks.
    local_errors: list[BaseException] = []  # at most one: this rank's first failure
    tensors: list[torch.Tensor] = []
    rows: list[list[float]] = []
    if failure is not None:  # appended, not re-raised here: that would tie this frame into its traceback
        local_errors.append(failure)
    else:
        try:
            tensors = list(local_tensors)
            seconds = [float(s) for s in local_predicted_seconds]
            if len(seconds) != len(tensors):
                raise ValueError(f"got {len(tensors)} local_tensors but {len(seconds)} local_predicted_seconds")
            for i, (tensor, cost) in enumerate(zip(tensors, seconds)):
                described = _describe(tensor, f"local_tensors[{i}]")
                if tensor.device != device:
                    raise ValueError(f"local_tensors[{i}] must be on {device}, got {tensor.device}")
                if not cost >= 0 or cost == float("inf"):
                    raise ValueError(f"local_predicted_seconds[{i}] must be finite and >= 0, got {cost}")
                rows.append([cost, *described])
        except Exception as exc:  # noqa: BLE001 -- reported to every rank, then re-raised below
            local_errors.append(exc)
            tensors, rows = [], []

    def gather_units(cap: int) -> list[list[float]]:
        body = [x for row in rows[:cap] for x in row]
        body += [0.0] * (cap * UNIT_ROW - len(body))
        payload = torch.tensor(_status(local_errors) + [float(len(rows))] + body, dtype=torch.float64, device=device)
        return _all_gather_rows(payload, group, group_size, timeout)

    gathered = gather_units(capacity)
    _raise_if_failed(gathered, group_rank, "input validation", local_errors)
    counts = [int(row[1 + MESSAGE_CHARS]) for row in gathered]
    if max(counts, default=0) > capacity:
        gathered = gather_units(max(counts))
    body_start = 2 + MESSAGE_CHARS
    unit_rows = [
        [g[body_start + i * UNIT_ROW : body_start + (i + 1) * UNIT_ROW] for i in range(n)]
        for g, n in zip(gathered, counts)
    ]

    # 2. The same plan everywhere.
    costs = [[row[0] for row in per_rank] for per_rank in unit_rows]
    shapes = [[_undescribe(row[1:]) for row in per_rank] for per_rank in unit_rows]
    nbytes = [[torch.Size(s).numel() * d.itemsize for d, s in per_rank] for per_rank in shapes]
    plan = plan_assignment(costs, nbytes)
    moves = [(r, i, dest) for r in range(group_size) for i, dest in enumerate(plan.assignment[r]) if dest != r]
    incoming = [(r, i) for r, i, dest in moves if dest == group_rank]
    moved_between: dict[tuple[int, int], list[int]] = {}  # (owner, helper) -> owner's unit indices, in order
    for r, i, dest in moves:
        moved_between.setdefault((r, dest), []).append(i)

    # 3. Units out, one packed message per (sender, receiver) pair; encode the kept units while
    #    they travel, then the received ones.
    ops, unpack = [], []
    for peer in range(group_size):
        if peer == group_rank:
            continue
        outgoing = [tensors[i] for i in moved_between.get((group_rank, peer), [])]
        if outgoing:
            ops.append(dist.P2POp(dist.isend, _pack(outgoing, device), group=group, group_peer=peer))
        arriving = [(peer, i) for i in moved_between.get((peer, group_rank), [])]
        if arriving:
            buffer = torch.empty(_packed_size([shapes[r][i] for r, i in arriving]), dtype=torch.uint8, device=device)
            ops.append(dist.P2POp(dist.irecv, buffer, group=group, group_peer=peer))
            unpack.append((arriving, buffer))
    works = dist.batch_isend_irecv(ops) if ops else []

    latents: list[torch.Tensor | None] = [None] * len(tensors)
    made_for_others: dict[tuple[int, int], torch.Tensor] = {}

    def encode(tensor: torch.Tensor, what: str) -> torch.Tensor:
        latent = encode_fn(tensor)
        _describe(latent, f"encode_fn's result for {what}")
        return latent.to(device).contiguous()

    try:
        for i, dest in enumerate(plan.assignment[group_rank]):
            if dest == group_rank:
                latents[i] = encode(tensors[i], f"local unit {i}")
    except Exception as exc:  # noqa: BLE001
        local_errors.append(exc)
    for work in works:
        _wait(work, timeout)
    received = {}
    for arriving, buffer in unpack:
        received.update(zip(arriving, _unpack(buffer, [shapes[r][i] for r, i in arriving])))
    if not local_errors:
        try:
            for r, i in incoming:
                made_for_others[(r, i)] = encode(received[(r, i)], f"rank {r}'s unit {i}")
        except Exception as exc:  # noqa: BLE001
            local_errors.append(exc)

    # 4. Status and the shapes of latents made for others, in one gather.
    incoming_per_rank = [0] * group_size
    for *_, dest in moves:
        incoming_per_rank[dest] += 1
    most_incoming = max(incoming_per_rank)
    body = []
    if not local_errors:
        body = [x for key in incoming for x in _describe(made_for_others[key], "latent")]
    body += [0.0] * (most_incoming * LATENT_ROW - len(body))
    payload = torch.tensor(_status(local_errors) + body, dtype=torch.float64, device=device)
    statuses = _all_gather_rows(payload, group, group_size, timeout)
    _raise_if_failed(statuses, group_rank, "encode", local_errors)

    # 5. Latents back to their owners, one packed message per pair. A helper's latent rows are in
    #    the order of its incoming moves; both sides walk the moves in that same order.
    latent_specs: dict[tuple[int, int], tuple[torch.dtype, tuple[int, ...]]] = {}
    seen_by_helper = [0] * group_size
    for r, i, dest in moves:
        start = 1 + MESSAGE_CHARS + seen_by_helper[dest] * LATENT_ROW
        seen_by_helper[dest] += 1
        if r == group_rank:
            latent_specs[(r, i)] = _undescribe(statuses[dest][start : start + LATENT_ROW])
    ops, unpack = [], []
    for peer in range(group_size):
        if peer == group_rank:
            continue
        made = [made_for_others[(peer, i)] for i in moved_between.get((peer, group_rank), [])]
        if made:
            ops.append(dist.P2POp(dist.isend, _pack(made, device), group=group, group_peer=peer))
        mine = moved_between.get((group_rank, peer), [])
        if mine:
            buffer = torch.empty(_packed_size([latent_specs[(group_rank, i)] for i in mine]), dtype=torch.uint8, device=device)
            ops.append(dist.P2POp(dist.irecv, buffer, group=group, group_peer=peer))
            unpack.append((mine, buffer))
    _exchange(ops, timeout)
    for mine, buffer in unpack:
        for i, latent in zip(mine, _unpack(buffer, [latent_specs[(group_rank, i)] for i in mine])):
            latents[i] = latent
    return (latents, plan) if return_plan else latents
