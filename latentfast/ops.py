"""Public op functions: check the arguments, then dispatch to the chosen backend.

Every function takes ``backend="auto" | "cpp" | "cuda" | "triton" | "torch"`` (see
:mod:`latentfast.backends`).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import backends

NORMALIZE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_out_tensor(name: str, tensor, shape, dtype: torch.dtype, device: torch.device) -> None:
    """Raise a clear error unless ``tensor`` is a contiguous tensor of exactly this shape/dtype/device."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(tensor.shape)}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} must have dtype {dtype}, got {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"{name} must be on {device}, got {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {tuple(tensor.stride())}")


def normalize_uint8(
    x: torch.Tensor,
    *,
    num_views: int = 1,
    dtype: torch.dtype = torch.float32,
    backend: str = "auto",
    out: torch.Tensor | Sequence[torch.Tensor] | None = None,
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
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.uint8:
        raise ValueError(f"x must be uint8 pixels, got dtype {x.dtype}")
    if x.ndim < 4:
        raise ValueError(f"x must be [..., C, T, H, W] (at least 4-D), got shape {tuple(x.shape)}")
    if isinstance(num_views, bool) or not isinstance(num_views, int) or num_views < 1:
        raise ValueError(f"num_views must be a positive int, got {num_views!r}")
    frames_total = int(x.shape[-3])
    if frames_total % num_views != 0:
        raise ValueError(f"T={frames_total} (x.shape[-3]) is not divisible by num_views={num_views}")
    if dtype not in NORMALIZE_DTYPES:
        raise ValueError(f"dtype must be one of {NORMALIZE_DTYPES}, got {dtype}")
    view_shape = (*x.shape[:-3], frames_total // num_views, *x.shape[-2:])

    if out is None:
        outputs = [torch.empty(view_shape, dtype=dtype, device=x.device) for _ in range(num_views)]
    else:
        if isinstance(out, torch.Tensor):
            if num_views != 1:
                raise ValueError(f"out must be a sequence of {num_views} tensors when num_views={num_views}")
            outputs = [out]
        else:
            outputs = list(out)
            if len(outputs) != num_views:
                raise ValueError(f"out must hold num_views={num_views} tensors, got {len(outputs)}")
        for view, tensor in enumerate(outputs):
            check_out_tensor(f"out[{view}]", tensor, view_shape, dtype, x.device)
        if len({t.data_ptr() for t in outputs}) != len(outputs) and x.numel():
            raise ValueError("out tensors must not alias each other")

    fn, _ = backends.kernel("normalize_uint8_into", x.device.type, backend)
    if x.numel():
        fn(x, outputs)
    return outputs[0] if num_views == 1 else outputs


# ---- cache decode (issue 4) -----------------------------------------------------------------
GATHER_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_gather_source(data, row_offsets, widths, pitch) -> None:
    for name, tensor, dtype in (("data", data, torch.float16), ("row_offsets", row_offsets, torch.int64),
                                ("widths", widths, torch.int32)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.dtype != dtype or tensor.dim() != 1 or not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(
                f"{name} must be a contiguous 1-D {dtype} CPU tensor, got {tensor.dtype} {tuple(tensor.shape)} "
                f"on {tensor.device}"
            )
    if widths.numel() != row_offsets.numel():
        raise ValueError(f"widths has {widths.numel()} rows but row_offsets has {row_offsets.numel()}")
    if isinstance(pitch, bool) or not isinstance(pitch, int) or pitch < 0:
        raise ValueError(f"pitch must be an int >= 0 (0 = ragged layout), got {pitch!r}")


def as_row_indices(indices, n_rows: int) -> torch.Tensor:
    """``indices`` (ints, numpy array or tensor) as a contiguous int64 CPU tensor, every one in ``[0, n_rows)``.

    Raises IndexError naming the first bad position and value. (numpy: this runs once per batch and
    must cost microseconds.)
    """
    if isinstance(indices, torch.Tensor):
        array = indices.detach().cpu().numpy()
    else:
        array = np.asarray(indices)
    if array.ndim != 1 or (array.size and array.dtype.kind not in "iu"):
        raise TypeError(f"indices must be a 1-D sequence of ints, got {array.dtype} {array.shape}")
    array = np.ascontiguousarray(array, dtype=np.int64)
    if array.size and (array.min() < 0 or array.max() >= n_rows):
        position = int(np.flatnonzero((array < 0) | (array >= n_rows))[0])
        raise IndexError(f"indices[{position}] = {int(array[position])} is out of range for a cache of {n_rows} rows")
    return torch.from_numpy(array)


def _batch_width(selected_widths: torch.Tensor, width) -> int:
    widest = int(selected_widths.max()) if selected_widths.numel() else 0
    if width is None:
        return widest
    if isinstance(width, bool) or not isinstance(width, int) or width < widest:
        raise ValueError(f"width must be an int >= the batch's widest row ({widest}), got {width!r}")
    return width


def _check_white(white, channels: int, latent_h: int):
    """``white`` ([C, h, 1] or C*h values, float16 after conversion) flattened, or None."""
    if white is None:
        return None
    if not isinstance(white, torch.Tensor) or white.numel() != channels * latent_h:
        got = tuple(white.shape) if isinstance(white, torch.Tensor) else type(white).__name__
        raise ValueError(f"white must be a tensor of C*h = {channels * latent_h} values ([C, h, 1]), got {got}")
    return white.reshape(-1).to(torch.float16).contiguous()


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
    ``W`` = ``width`` or the widest requested row; columns past a row's width are ``white``
    (``[C, h, 1]``), which may be None only when no row needs padding. Duplicates and any order are
    fine; an index outside ``[0, N)`` raises IndexError naming it.
    """
    _check_gather_source(data, row_offsets, widths, pitch)
    if dtype not in GATHER_DTYPES:
        raise ValueError(f"dtype must be one of {GATHER_DTYPES}, got {dtype}")
    index = as_row_indices(indices, row_offsets.numel())
    W = _batch_width(widths[index], width)
    white = _check_white(white, channels, latent_h)
    shape = (index.numel(), channels, latent_h, W)
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    else:
        check_out_tensor("out", out, shape, dtype, torch.device("cpu"))
    fn, _ = backends.kernel("gather_rows_into", "cpu", backend)
    fn(data, row_offsets, widths, pitch, index, white, out)
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
    _check_gather_source(data, row_offsets, widths, pitch)
    index = as_row_indices(indices, row_offsets.numel())
    needed = channels * latent_h * int(widths[index].sum())
    if out is None:
        out = torch.empty(needed, dtype=torch.float16)
    elif not (isinstance(out, torch.Tensor) and out.dtype == torch.float16 and out.dim() == 1
              and out.is_contiguous() and out.device.type == "cpu" and out.numel() >= needed):
        got = f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"out must be a contiguous 1-D float16 CPU tensor of >= {needed} elements, got {got}")
    fn, _ = backends.kernel("gather_rows_packed_into", "cpu", backend)
    fn(data, row_offsets, widths, pitch, index, channels, latent_h, out)
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
    on the packed tensor's device. ``packed_offsets`` (int64 [B]) says where each row starts."""
    device = packed.device
    if packed.dtype != torch.float16 or packed.dim() != 1 or not packed.is_contiguous():
        raise ValueError(f"packed must be a contiguous 1-D float16 tensor, got {packed.dtype} {tuple(packed.shape)}")
    for name, tensor, expected in (("packed_offsets", packed_offsets, torch.int64), ("widths", widths, torch.int32)):
        if tensor.dtype != expected or tensor.dim() != 1 or tensor.device != device or not tensor.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous 1-D {expected} tensor on {device}, got {tensor.dtype} "
                f"{tuple(tensor.shape)} on {tensor.device}"
            )
    if packed_offsets.numel() != widths.numel():
        raise ValueError(f"packed_offsets has {packed_offsets.numel()} rows but widths has {widths.numel()}")
    if dtype not in GATHER_DTYPES:
        raise ValueError(f"dtype must be one of {GATHER_DTYPES}, got {dtype}")
    if width is None:
        W = _batch_width(widths, None)  # a device sync on CUDA; read_batch passes width to avoid it
    elif isinstance(width, bool) or not isinstance(width, int) or width < 0:
        raise ValueError(f"width must be an int >= 0, got {width!r}")
    else:
        W = width
    ends = packed_offsets + channels * latent_h * widths.to(torch.int64)
    valid = (widths >= 0).all() & (widths <= W).all() & (packed_offsets >= 0).all() & (ends <= packed.numel()).all()
    message = f"expand_rows: every row needs 0 <= width <= W={W} and to lie inside packed's {packed.numel()} elements"
    if device.type == "cpu":
        if not bool(valid):
            raise ValueError(message)
    else:  # checked on the device, without a host sync
        torch._assert_async(valid, message)
    white = _check_white(white, channels, latent_h)
    if white is not None:
        white = white.to(device)
    shape = (widths.numel(), channels, latent_h, W)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    else:
        check_out_tensor("out", out, shape, dtype, device)
    fn, _ = backends.kernel("expand_rows_into", device.type, backend)
    fn(packed, packed_offsets, widths, white, out)
    return out


# ---- replay (issue 6) -----------------------------------------------------------------------
