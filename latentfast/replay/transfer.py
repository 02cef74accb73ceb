"""Moving replay tensors between devices and ranks with as few copies and host syncs as possible.

* :func:`copy_tensors` -- copies of many tensors on another device: the small ones (losses,
  counters, metadata) packed into one transfer, the large ones (feature store, cotangent arena)
  each one asynchronous copy, then one wait.

Where a collective runs (:func:`latentfast.distributed.collective_device`) and the packed messages
themselves are :mod:`latentfast.distributed`'s, shared with the balanced encode.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from ..devices import as_device
from ..distributed import pack, unpack

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
