"""What the distributed jobs share (balanced encode, gradient replay): where a collective runs, packed messages, and gathering one status row per rank so that every rank raises together."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .devices import as_device
from .errors import InvalidArgumentError

# ---- where a collective runs ----------------------------------------------------------------------


def _device_types(backend: str) -> set[str] | None:
    """Device types a process group backend serves (``"cpu:gloo,cuda:nccl"`` lists them itself);
    None for a backend torch does not describe."""
    if ":" in backend:
        return {part.split(":")[0].strip() for part in backend.split(",")}
    capability = getattr(dist.Backend, "backend_capability", {})
    types = capability.get(backend.lower())
    return set(types) if types is not None else None


def collective_device(data_device, backend: str, *, current_cuda=None) -> torch.device:
    """The device on which a ``backend`` collective should move tensors that live on ``data_device``.

    The data's own device when the backend serves it; otherwise the current CUDA device (NCCL with
    CPU features; ``current_cuda`` overrides which one, for tests), or the CPU. Raises
    :class:`~latentfast.errors.InvalidArgumentError` when no device the backend serves is usable.
    """
    data_device = as_device(data_device, name="data_device")
    served = _device_types(backend)
    if served is None or data_device.type in served:
        return data_device
    if "cuda" in served:
        if current_cuda is not None:
            return as_device(current_cuda, name="current_cuda")
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
    if "cpu" in served:
        return torch.device("cpu")
    raise InvalidArgumentError(
        f"replay collectives: the process group backend {backend!r} serves {sorted(served)} tensors, the features"
        f" are on {data_device} and no device it serves is available here; keep the features on a served device"
    )


def check_collective_device(device: torch.device, backend: str, current_cuda_index: int | None) -> None:
    """Raise :class:`InvalidArgumentError` unless ``device`` can carry this group's collectives:
    under NCCL it must be this process's current CUDA device (NCCL communicators are bound to it)."""
    if backend == "nccl" and (device.type != "cuda" or device.index != current_cuda_index):
        raise InvalidArgumentError(
            f"device must be this process's current CUDA device (cuda:{current_cuda_index}) for an NCCL group, got "
            f"{device}; call torch.cuda.set_device(local_rank) first, or pass device='cuda'"
        )


# ---- packed messages: many tensors, one transfer --------------------------------------------------
PACK_ALIGN = 16  # bytes; segment alignment inside a packed message, so views of any dtype are legal


def _segment_bytes(spec: tuple[torch.dtype, tuple[int, ...]]) -> int:
    """Bytes a tensor takes in a packed message, rounded up so every segment starts aligned."""
    dtype, shape = spec
    return -(-math.prod(shape) * dtype.itemsize // PACK_ALIGN) * PACK_ALIGN


def packed_size(specs) -> int:
    """Bytes of the message :func:`pack` makes of tensors with these ``(dtype, shape)`` specs."""
    return sum(_segment_bytes(spec) for spec in specs)


def pack(tensors, device) -> torch.Tensor:
    """Several tensors (any dtypes, shapes and strides) as one uint8 buffer on ``device``, each
    segment aligned: one transfer or message instead of one per tensor."""
    specs = [(t.dtype, tuple(t.shape)) for t in tensors]
    buffer = torch.empty(packed_size(specs), dtype=torch.uint8, device=device)
    offset = 0
    for tensor, spec in zip(tensors, specs):
        size = tensor.numel() * tensor.dtype.itemsize
        buffer[offset : offset + size].copy_(tensor.detach().contiguous().reshape(-1).view(torch.uint8))
        offset += _segment_bytes(spec)
    return buffer


def unpack(buffer: torch.Tensor, specs) -> list[torch.Tensor]:
    """The tensors of a packed message, as views into ``buffer``."""
    out, offset = [], 0
    for dtype, shape in specs:
        size = math.prod(shape) * dtype.itemsize
        out.append(buffer[offset : offset + size].view(dtype).reshape(shape))
        offset += _segment_bytes((dtype, shape))
    return out


# ---- status rows: every rank learns every rank's state, so all raise together ----------------------
OK, FAILED = 0.0, 1.0


def all_gather_rows(row: torch.Tensor, *, group=None, wait=None) -> list[list]:
    """Every rank's 1-D ``row`` (same length and dtype on every rank, on a device the group's
    backend serves), in rank order: one ``all_gather`` and one copy to the host. ``wait(work)``
    replaces ``work.wait()`` (e.g. to apply a timeout and name the step that failed)."""
    out = torch.empty((dist.get_world_size(group), row.numel()), dtype=row.dtype, device=row.device)
    work = dist.all_gather(list(out.unbind(0)), row.contiguous(), group=group, async_op=True)
    work.wait() if wait is None else wait(work)
    return out.cpu().tolist()


def status_row(errors: list[BaseException], chars: int) -> list[float]:
    """``[flag, *the first error's text as code points padded to chars]``: a row that says whether
    this rank failed, and why."""
    message = f"{type(errors[0]).__name__}: {errors[0]}" if errors else ""
    codes = [float(ord(ch)) for ch in message[:chars]]
    return [FAILED if errors else OK] + codes + [0.0] * (chars - len(codes))


def status_text(codes: list[float]) -> str:
    """The error text a :func:`status_row` carries (its codes after the flag)."""
    return "".join(chr(int(c)) for c in codes if c > 0)


def failed_ranks(rows: list[list[float]]) -> list[int]:
    """The ranks whose gathered :func:`status_row` flags a failure."""
    return [rank for rank, row in enumerate(rows) if row[0] != OK]
