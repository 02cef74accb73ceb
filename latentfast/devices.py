"""One way to read a ``device=`` argument, for every job of the library.

``torch.device("cuda") != torch.device("cuda:0")``, so code that compares a tensor's device
(always indexed) with a user's ``"cuda"`` refuses correct input. Every public ``device=``
argument goes through :func:`as_device`, which gives CUDA devices their index.
"""
from __future__ import annotations

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
