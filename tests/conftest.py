"""Shared test helpers: which backends can run an op here, and poisoned output buffers."""
from __future__ import annotations

import torch

from latentfast import backends


def runnable_backends(op: str, device_type: str = "cpu") -> list[str]:
    """Every concrete backend that can run ``op`` on ``device_type`` tensors in this process."""
    return [name for name, why in backends.availability(op, device_type).items() if not why]


def poisoned_like(shape, dtype, device="cpu") -> torch.Tensor:
    """An output buffer full of garbage (NaN for floats, 0x5A bytes otherwise) so a kernel that
    skips an element is caught."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(0x5A)
    return t


