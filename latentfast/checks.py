"""Argument checks every layer shares (ints, row indices, output tensors, dtype sets), without the op layer.

Parsing an int must not load the compiled library: the samplers, the planner and the vision units
import these checks, and :mod:`latentfast.ops` re-exports them for its own arguments.
"""
from __future__ import annotations

import operator

import numpy as np
import torch

from .errors import ArgumentTypeError, IndexOutOfRangeError, InvalidArgumentError

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what the normalize and gather ops write
INT64_MAX = (1 << 63) - 1  # the largest value an ``int`` argument of an op's schema holds


def as_int(name: str, value, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a Python int (numpy and torch integers included, bools refused), in ``[minimum, maximum]``."""
    if isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be an int, got bool {value!r}")
    try:
        result = operator.index(value)
    except TypeError:
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if minimum is not None and result < minimum:
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {result}")
    if maximum is not None and result > maximum:
        raise InvalidArgumentError(f"{name} must be an int <= {maximum}, got {result}")
    return result


def as_size(name: str, value) -> int:
    """A size or pitch argument of an op: an int in ``[0, 2**63 - 1]``."""
    return as_int(name, value, minimum=0, maximum=INT64_MAX)


def int_array(name: str, values) -> np.ndarray:
    """``values`` (ints, numpy array or tensor) as a 1-D numpy array of an integer dtype, kept as given."""
    array = np.asarray(values.detach().cpu() if isinstance(values, torch.Tensor) else values)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ArgumentTypeError(f"{name} must be a 1-D sequence of ints, got {array.dtype} {array.shape}")
    return array


def as_row_indices(indices, n_rows: int) -> torch.Tensor:
    """``indices`` (ints, numpy array or tensor) as a contiguous int64 CPU tensor, every one in ``[0, n_rows)``.

    Raises IndexOutOfRangeError naming the first bad position and value. (numpy: this runs once per
    batch and must cost microseconds.) Under ``torch.compile`` a tensor's values are unknown at trace
    time: it is only converted, and the kernels check every index before copying anything.
    """
    if isinstance(indices, torch.Tensor):
        if indices.dim() != 1 or indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
            raise ArgumentTypeError(f"indices must be a 1-D tensor of ints, got {indices.dtype} {tuple(indices.shape)}")
        if indices.device.type == "meta":
            raise InvalidArgumentError("indices is a meta tensor: the rows to read are its values, which it has none of")
        if torch.compiler.is_compiling():
            return indices.to("cpu", torch.int64).contiguous()
    array = int_array("indices", indices)
    # range-check in the array's own dtype: a uint64 index above 2**63 must be reported as itself,
    # not as the negative int64 it would wrap to
    if array.size and (array.min() < 0 or array.max() >= n_rows):
        position = int(np.flatnonzero((array < 0) | (array >= n_rows))[0])
        raise IndexOutOfRangeError(f"indices[{position}] = {int(array[position])} is out of range for a cache of {n_rows} rows")
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64))


def check_out_tensor(name: str, tensor, shape, dtype: torch.dtype, device: torch.device) -> None:
    """Raise a clear error unless ``tensor`` is a contiguous tensor of exactly this shape/dtype/device."""
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(shape):
        raise InvalidArgumentError(f"{name} must have shape {tuple(shape)}, got {tuple(tensor.shape)}")
    if tensor.dtype != dtype:
        raise InvalidArgumentError(f"{name} must have dtype {dtype}, got {tensor.dtype}")
    if tensor.device != device:
        raise InvalidArgumentError(f"{name} must be on {device}, got {tensor.device}")
    if not tensor.is_contiguous():
        raise InvalidArgumentError(f"{name} must be contiguous, got strides {tuple(tensor.stride())}")


def batch_width(selected_widths, width) -> int:
    """W of a batch: ``width`` (an int >= the widest selected row) or, when None, that widest row.

    ``selected_widths``: the batch's row widths (numpy array or tensor). Without ``width``, the
    widest row is read back (a device sync for a CUDA tensor; callers that know W pass it).
    """
    widest = int(selected_widths.max()) if len(selected_widths) else 0
    if width is None:
        return widest
    width = as_size("width", width)
    if width < widest:
        raise InvalidArgumentError(f"width must be an int >= the batch's widest row ({widest}), got {width}")
    return width
