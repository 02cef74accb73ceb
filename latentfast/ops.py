"""Public op functions: read the arguments, allocate the outputs, call the op ``torch.ops.latentfast.*``.

Every function takes ``backend="auto" | "cpp" | "cuda" | "triton" | "torch"``, which is passed to
the op (the op's dispatch-key kernel picks the implementation, see :mod:`latentfast.backends`), so
these functions trace under ``torch.compile(fullgraph=True)`` on every backend. The op itself
checks shapes, dtypes, devices and overlapping outputs; what is checked here is what is needed to
size the outputs, and the public contract (an ``out=`` of exactly the requested dtype).
"""
from __future__ import annotations

import operator
from collections.abc import Sequence

import numpy as np
import torch

from . import _ops  # noqa: F401  (defines torch.ops.latentfast.*)
from . import backends  # noqa: F401  (registers their kernels)
from .errors import ArgumentTypeError, IndexOutOfRangeError, InvalidArgumentError

NORMALIZE_DTYPES = _ops.FLOAT_OUT_DTYPES


def as_int(name: str, value, *, minimum: int | None = None) -> int:
    """``value`` as a Python int (numpy and torch integers included, bools refused), at least ``minimum``."""
    if isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be an int, got bool {value!r}")
    try:
        result = operator.index(value)
    except TypeError:
        raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if minimum is not None and result < minimum:
        raise InvalidArgumentError(f"{name} must be an int >= {minimum}, got {result}")
    return result


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


def normalize_uint8(
    x: torch.Tensor,
    *,
    num_views: int = 1,
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | Sequence[torch.Tensor] | None = None,
    backend: str = "auto",
) -> torch.Tensor | list[torch.Tensor]:
    """uint8 pixels -> ``x / 127.5 - 1`` in ``dtype``, split camera-major into ``num_views`` views.

    Args:
        x: uint8 ``[..., C, T, H, W]`` (at least 4-D), any strides.
        num_views: views packed along T; view ``v`` is frames ``[v*F, (v+1)*F)``, ``F = T / num_views``.
        dtype: float32, bfloat16 or float16; the value is computed in float32 and rounded once.
        out: optional preallocated contiguous output(s) of shape ``[..., C, F, H, W]``: a tensor
            when ``num_views == 1``, else a sequence of ``num_views`` tensors.

    Returns:
        One tensor when ``num_views == 1``, else a list of ``num_views`` contiguous tensors. All
        views are written in a single pass over ``x``.
    """
    if not isinstance(x, torch.Tensor):
        raise ArgumentTypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.uint8:
        raise InvalidArgumentError(f"x must be uint8 pixels, got dtype {x.dtype}")
    if x.ndim < 4:
        raise InvalidArgumentError(f"x must be [..., C, T, H, W] (at least 4-D), got shape {tuple(x.shape)}")
    num_views = as_int("num_views", num_views, minimum=1)
    frames_total = int(x.shape[-3])
    if frames_total % num_views != 0:
        raise InvalidArgumentError(f"T={frames_total} (x.shape[-3]) is not divisible by num_views={num_views}")
    if dtype not in NORMALIZE_DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {NORMALIZE_DTYPES}, got {dtype}")
    view_shape = (*x.shape[:-3], frames_total // num_views, *x.shape[-2:])

    if out is None:
        outputs = [torch.empty(view_shape, dtype=dtype, device=x.device) for _ in range(num_views)]
    else:
        if isinstance(out, torch.Tensor):
            if num_views != 1:
                raise InvalidArgumentError(f"out must be a sequence of {num_views} tensors when num_views={num_views}")
            outputs = [out]
        else:
            outputs = list(out)
            if len(outputs) != num_views:
                raise InvalidArgumentError(f"out must hold num_views={num_views} tensors, got {len(outputs)}")
        for view, tensor in enumerate(outputs):
            check_out_tensor(f"out[{view}]", tensor, view_shape, dtype, x.device)
    torch.ops.latentfast.normalize_uint8_into(x, outputs, backend)
    return outputs[0] if num_views == 1 else outputs


# ---- cache decode: gather rows out of the cache's flat data, expand packed rows on the device ----
GATHER_DTYPES = _ops.FLOAT_OUT_DTYPES


def as_row_indices(indices, n_rows: int) -> torch.Tensor:
    """``indices`` (ints, numpy array or tensor) as a contiguous int64 CPU tensor, every one in ``[0, n_rows)``.

    Raises IndexOutOfRangeError naming the first bad position and value. (numpy: this runs once per
    batch and must cost microseconds.) Under ``torch.compile`` a tensor's values are unknown at trace
    time: it is only converted, and the kernels check every index before copying anything.
    """
    if isinstance(indices, torch.Tensor):
        if indices.dim() != 1 or indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
            raise ArgumentTypeError(f"indices must be a 1-D tensor of ints, got {indices.dtype} {tuple(indices.shape)}")
        if torch.compiler.is_compiling():
            return indices.to("cpu", torch.int64).contiguous()
        array = indices.detach().cpu().numpy()
    else:
        array = np.asarray(indices)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise ArgumentTypeError(f"indices must be a 1-D sequence of ints, got {array.dtype} {array.shape}")
    array = np.ascontiguousarray(array, dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() >= n_rows):
        position = int(np.flatnonzero((array < 0) | (array >= n_rows))[0])
        raise IndexOutOfRangeError(f"indices[{position}] = {int(array[position])} is out of range for a cache of {n_rows} rows")
    return torch.from_numpy(array)


def batch_width(selected_widths, width) -> int:
    """W of a batch: ``width`` (an int >= the widest selected row) or, when None, that widest row.

    ``selected_widths``: the batch's row widths (numpy array or tensor). Without ``width``, the
    widest row is read back (a device sync for a CUDA tensor; callers that know W pass it).
    """
    widest = int(selected_widths.max()) if len(selected_widths) else 0
    if width is None:
        return widest
    width = as_int("width", width)
    if width < widest:
        raise InvalidArgumentError(f"width must be an int >= the batch's widest row ({widest}), got {width}")
    return width


def flat_white(white, channels: int, latent_h: int, device=None):
    """``white`` ([C, h, 1] or C*h values) as a contiguous float16 vector on ``device``, or None."""
    if white is None:
        return None
    if not isinstance(white, torch.Tensor) or white.numel() != channels * latent_h:
        got = tuple(white.shape) if isinstance(white, torch.Tensor) else type(white).__name__
        raise InvalidArgumentError(f"white must be a tensor of C*h = {channels * latent_h} values ([C, h, 1]), got {got}")
    return white.reshape(-1).to(device=device, dtype=torch.float16).contiguous()


def gather_rows(
    data: torch.Tensor,
    row_offsets: torch.Tensor,
    widths: torch.Tensor,
    pitch: int,
    indices,
    *,
    channels: int,
    latent_h: int,
    white: torch.Tensor | None = None,
    width: int | None = None,
    dtype: torch.dtype = torch.float16,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Rows ``indices`` of a flat float16 cache as one padded batch ``[B, C, h, W]`` of ``dtype``.

    Row ``i``'s line ``(c, y)`` starts at ``row_offsets[i] + (c*h + y) * pitch`` (padded layout,
    ``pitch = w_max``) or, with ``pitch = 0``, at ``row_offsets[i] + (c*h + y) * widths[i]`` (ragged).
    ``W`` = ``width`` or the widest requested row (pass ``width`` under ``torch.compile``: the widest
    row is a value); columns past a row's width are ``white`` (``[C, h, 1]``), which may be None only
    when no row needs padding. Duplicates and any order are fine; an index outside ``[0, N)`` raises
    IndexOutOfRangeError naming it.
    """
    if dtype not in GATHER_DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {GATHER_DTYPES}, got {dtype}")
    pitch = as_int("pitch", pitch, minimum=0)
    channels, latent_h = as_int("channels", channels, minimum=0), as_int("latent_h", latent_h, minimum=0)
    index = as_row_indices(indices, row_offsets.numel())
    W = batch_width(widths[index], width) if width is None or not torch.compiler.is_compiling() else width
    shape = (index.numel(), channels, latent_h, W)
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    else:
        check_out_tensor("out", out, shape, dtype, torch.device("cpu"))
    white = flat_white(white, channels, latent_h)
    torch.ops.latentfast.gather_rows_into(data, row_offsets, widths, pitch, index, white, out, backend)
    return out


def gather_rows_packed(
    data: torch.Tensor,
    row_offsets: torch.Tensor,
    widths: torch.Tensor,
    pitch: int,
    indices,
    *,
    channels: int,
    latent_h: int,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The real columns of rows ``indices``, back to back as ``[C, h, w_i]`` each, in a 1-D float16 tensor.

    ``out`` (e.g. a pinned staging slot) may be longer than needed; the rows fill its start and the
    filled prefix is returned.
    """
    pitch = as_int("pitch", pitch, minimum=0)
    channels, latent_h = as_int("channels", channels, minimum=0), as_int("latent_h", latent_h, minimum=0)
    index = as_row_indices(indices, row_offsets.numel())
    needed = channels * latent_h * int(widths[index].sum())
    if out is None:
        out = torch.empty(needed, dtype=torch.float16)
    elif not (isinstance(out, torch.Tensor) and out.dtype == torch.float16 and out.dim() == 1
              and out.is_contiguous() and out.device.type == "cpu" and out.numel() >= needed):
        got = f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise InvalidArgumentError(f"out must be a contiguous 1-D float16 CPU tensor of >= {needed} elements, got {got}")
    torch.ops.latentfast.gather_rows_packed_into(data, row_offsets, widths, pitch, index, channels, latent_h, out, backend)
    return out[:needed]


def expand_rows(
    packed: torch.Tensor,
    packed_offsets: torch.Tensor,
    widths: torch.Tensor,
    white: torch.Tensor | None,
    *,
    channels: int,
    latent_h: int,
    width: int | None = None,
    dtype: torch.dtype = torch.float16,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Packed rows (as :func:`gather_rows_packed` writes them) -> padded ``[B, C, h, W]`` of ``dtype``,
    on the packed tensor's device. ``packed_offsets`` (int64 [B]) says where each row starts.

    Every row must have ``0 <= width <= W`` and lie inside ``packed``: checked on the host for CPU
    tensors, and on the device without a host sync (``torch._assert_async``) for CUDA tensors."""
    device = packed.device
    if dtype not in GATHER_DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {GATHER_DTYPES}, got {dtype}")
    channels, latent_h = as_int("channels", channels, minimum=0), as_int("latent_h", latent_h, minimum=0)
    W = batch_width(widths, None) if width is None else as_int("width", width, minimum=0)
    if device.type == "cuda":
        ends = packed_offsets + channels * latent_h * widths.to(torch.int64)
        valid = (widths >= 0).all() & (widths <= W).all() & (packed_offsets >= 0).all() & (ends <= packed.numel()).all()
        torch._assert_async(valid, f"expand_rows: every row needs 0 <= width <= W={W} and to lie inside packed")
    shape = (widths.numel(), channels, latent_h, W)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    else:
        check_out_tensor("out", out, shape, dtype, device)
    white = flat_white(white, channels, latent_h, device)
    torch.ops.latentfast.expand_rows_into(packed, packed_offsets, widths, white, out, backend)
    return out
