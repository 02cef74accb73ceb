"""One way to read a ``device=`` argument, for every job of the library.

``torch.device("cuda") != torch.device("cuda:0")``, so code that compares a tensor's device
(always indexed) with a user's ``"cuda"`` refuses correct input. Every public ``device=``
argument goes through :func:`as_device`, which gives CUDA devices their index.
"""
from __future__ import annotations

import math

import torch

from .errors import ArgumentTypeError, InvalidArgumentError


def as_device(device, *, name: str = "device") -> torch.device:
    """``device`` (a str such as ``"cpu"``/``"cuda"``/``"cuda:1"``, an int CUDA index, or a
    :class:`torch.device`) as a ``torch.device``; a CUDA device without an index gets the current
    one (when CUDA is available). ``name`` is the argument's name in error messages."""
    if isinstance(device, torch.device):
        resolved = device
    elif isinstance(device, str):
        try:
            resolved = torch.device(device)
        except RuntimeError as exc:
            raise InvalidArgumentError(f"{name} must name a device such as 'cpu' or 'cuda:0', got {device!r}") from exc
    elif isinstance(device, int) and not isinstance(device, bool):
        if device < 0:
            raise InvalidArgumentError(f"{name} must be a CUDA index >= 0, got {device}")
        resolved = torch.device("cuda", device)
    elif hasattr(device, "__index__") and not isinstance(device, bool):  # numpy integers
        return as_device(int(device.__index__()), name=name)
    else:
        raise ArgumentTypeError(f"{name} must be a str, int or torch.device, got {type(device).__name__}")
    if resolved.type == "cuda" and resolved.index is None and torch.cuda.is_available():
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved


def same_device(a, b) -> bool:
    """Whether two device arguments name the same device (``"cuda"`` equals ``"cuda:<current>"``)."""
    return as_device(a) == as_device(b)


def map_tensors(fn, value):
    """``value`` with every tensor ``t`` in it (nested dicts, lists, tuples and namedtuples) replaced by
    ``fn(t)``; other values are kept. The one tree walk for moving batches or results between devices."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {key: map_tensors(fn, item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        mapped = [map_tensors(fn, item) for item in value]
        return type(value)(*mapped) if hasattr(value, "_fields") else type(value)(mapped)
    return value


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
