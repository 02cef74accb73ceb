"""Public op functions: check the arguments, then dispatch to the chosen backend.

Every function takes ``backend="auto" | "cpp" | "cuda" | "triton" | "torch"`` (see
:mod:`latentfast.backends`).
"""
from __future__ import annotations

from collections.abc import Sequence

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


# ---- replay (issue 6) -----------------------------------------------------------------------
