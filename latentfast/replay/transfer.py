"""Moving replay tensors between devices and ranks with as few copies and host syncs as possible.

* :func:`copy_tensors` -- copies of many tensors on another device: the small ones (losses,
  counters, metadata) packed into one transfer, the large ones (feature store, cotangent arena)
  each one asynchronous copy, then one wait;
* :func:`collective_device` -- where a collective of this process group can run for tensors on
  a given device (NCCL serves only CUDA tensors: CPU features go to the current CUDA device).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..devices import as_device, pack, unpack
from ..errors import InvalidArgumentError

SMALL_BYTES = 1 << 16  # tensors up to this size share one packed transfer


def copy_tensors(tensors: Sequence[torch.Tensor], device) -> list[torch.Tensor]:
    """Detached copies of ``tensors`` on ``device``, in order; always new memory.

    Small tensors from one source device travel together as one byte buffer (one transfer instead
    of one per tensor); large ones are copied asynchronously (to pinned host memory when leaving a
    GPU). The host waits once, at the end, for every source GPU.
    """
    device = as_device(device)
    out: list[torch.Tensor | None] = [None] * len(tensors)
    small: dict[torch.device, list[int]] = {}
    waits = set()
    for i, tensor in enumerate(tensors):
        if tensor.device != device and tensor.numel() * tensor.element_size() <= SMALL_BYTES:
            small.setdefault(tensor.device, []).append(i)
            continue
        out[i] = tensor.detach().to(device, non_blocking=tensor.is_cuda, copy=True)
        if tensor.is_cuda:
            waits.add(tensor.device)
    for indices in small.values():
        for i, tensor in zip(indices, _packed_copy([tensors[i] for i in indices], device)):
            out[i] = tensor
    for source in waits:
        torch.cuda.current_stream(source).synchronize()
    return out


def _packed_copy(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """One transfer for all of ``tensors`` (one source device): packed where they are, the buffer
    moved, then typed views of the received buffer."""
    specs = [(t.dtype, tuple(t.shape)) for t in tensors]
    return unpack(pack(tensors, tensors[0].device).to(device), specs)


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
