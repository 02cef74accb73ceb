"""Running a builder's encoder: its device and batch size checked once, no autograd, under autocast when asked, the latents back as float32 on the CPU."""
from __future__ import annotations

import contextlib

import torch

from ...devices import as_device
from ...errors import InvalidArgumentError


def encode(fn, pixels: torch.Tensor, device: torch.device, autocast_dtype: torch.dtype | None, **kwargs) -> torch.Tensor:
    """``fn(pixels on device, **kwargs)`` without gradients (under ``torch.autocast`` of
    ``autocast_dtype`` when given), as a float32 CPU tensor (a tuple of them, e.g. ``(mean, std)``,
    when ``fn`` returns a tuple)."""
    autocast = torch.autocast(device_type=device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    with torch.no_grad(), autocast:
        z = fn(pixels.to(device), **kwargs)
    if isinstance(z, tuple):
        return tuple(t.float().cpu() for t in z)
    return z.float().cpu()


def prepare(encoder, device, batch_size):
    """``(encoder on the device, the device)`` after checking ``batch_size`` is a positive int."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be a positive int, got {batch_size!r}")
    device = as_device(device)
    return (encoder.to(device) if hasattr(encoder, "to") else encoder), device
