"""Public op functions: read the arguments, allocate the outputs, call the op ``torch.ops.latentfast.*``.

Every function takes ``backend="auto" | "cpp" | "cuda" | "triton" | "torch"``, which is passed to
the op (the op's dispatch-key kernel picks the implementation, see :mod:`latentfast.backends`), so
these functions trace under ``torch.compile(fullgraph=True)`` on every backend. The op itself
checks shapes, dtypes, devices and overlapping outputs; what is checked here is what is needed to
size the outputs, and the public contract (an ``out=`` of exactly the requested dtype). Integer
arguments accept any integer type (numpy's too) and are refused, naming the argument, outside the
int64 range the ops' schemas hold; outputs too large for int64 sizes are refused before allocating.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from . import _ops  # noqa: F401  (defines torch.ops.latentfast.*)
from . import backends  # noqa: F401  (registers their kernels)
from .checks import FLOAT_DTYPES, INT64_MAX, as_int, as_row_indices, batch_width, check_out_tensor, int_array
from .checks import as_size as _as_size
from .errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["normalize_uint8", "gather_rows", "gather_rows_packed", "expand_rows", "read_spans"]


def _prefix_out(out, dtype: torch.dtype, needed: int, unit: str) -> torch.Tensor:
    """A new 1-D CPU output of ``needed`` elements, or ``out`` checked to hold at least that many
    (the caller returns its filled prefix)."""
    if out is None:
        return torch.empty(needed, dtype=dtype)
    if not (isinstance(out, torch.Tensor) and out.dtype == dtype and out.dim() == 1 and out.is_contiguous()
            and out.device.type == "cpu" and out.numel() >= needed):
        got = f"{out.dtype} {tuple(out.shape)} on {out.device}" if isinstance(out, torch.Tensor) else type(out).__name__
        kind = str(dtype).removeprefix("torch.")
        raise InvalidArgumentError(f"out must be a contiguous 1-D {kind} CPU tensor of >= {needed} {unit}, got {got}")
    return out


def _check_elements(name: str, count: int) -> None:
    """Refuse an output of more elements than int64 counts (the product of sizes, exact in Python).
    A symbolic count (under ``torch.compile``, a value of the data) is left to the allocation."""
    if not torch.compiler.is_compiling() and count > INT64_MAX:
        raise InvalidArgumentError(f"{name} would hold {count} elements, more than int64 can count")


def _check_host_tensor(name: str, tensor) -> None:
    """The cache's data and index tensors must be CPU tensors: their values are read on the host."""
    if not isinstance(tensor, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise InvalidArgumentError(f"{name} must be a CPU tensor (its values are read on the host), got {tensor.device}")


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
        views are written in a single pass over ``x``; an ``out`` overlapping ``x`` or another
        output is refused. A meta ``x`` gives meta outputs (shapes only), like any torch op.
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
    if dtype not in FLOAT_DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
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
    if dtype not in FLOAT_DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    for name, tensor in (("data", data), ("row_offsets", row_offsets), ("widths", widths)):
        _check_host_tensor(name, tensor)
    pitch, channels, latent_h = _as_size("pitch", pitch), _as_size("channels", channels), _as_size("latent_h", latent_h)
    index = as_row_indices(indices, row_offsets.numel())
    if width is not None and torch.compiler.is_compiling():  # the widest row is a value: trust width
        W = _as_size("width", width)
    else:
        W = batch_width(widths[index], width)
    shape = (index.numel(), channels, latent_h, W)
    _check_elements("out", index.numel() * channels * latent_h * W)
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
    for name, tensor in (("data", data), ("row_offsets", row_offsets), ("widths", widths)):
        _check_host_tensor(name, tensor)
    pitch, channels, latent_h = _as_size("pitch", pitch), _as_size("channels", channels), _as_size("latent_h", latent_h)
    index = as_row_indices(indices, row_offsets.numel())
    needed = channels * latent_h * int(widths[index].sum())
    _check_elements("the packed rows", needed)
    out = _prefix_out(out, torch.float16, needed, "elements")
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

    Every row must have ``0 <= width <= W`` and lie inside ``packed`` (checked by every backend: on
    the host for CPU tensors, on the device without a host sync for CUDA tensors), and rows narrower
    than W need ``white``. Meta tensors give a meta result (shapes only), given ``width``."""
    for name, tensor in (("packed", packed), ("packed_offsets", packed_offsets), ("widths", widths)):
        if not isinstance(tensor, torch.Tensor):
            raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    device = packed.device
    if dtype not in FLOAT_DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype}")
    channels, latent_h = _as_size("channels", channels), _as_size("latent_h", latent_h)
    if width is None and widths.device.type == "meta":
        raise InvalidArgumentError("width must be given when widths is a meta tensor (W is its largest value)")
    W = batch_width(widths, None) if width is None else _as_size("width", width)
    _check_elements("out", widths.numel() * channels * latent_h * W)
    shape = (widths.numel(), channels, latent_h, W)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=device)
    else:
        check_out_tensor("out", out, shape, dtype, device)
    white = flat_white(white, channels, latent_h, device)
    torch.ops.latentfast.expand_rows_into(packed, packed_offsets, widths, white, out, backend)
    return out


# ---- file reads: byte spans of an open file by parallel pread workers ---------------------------------
def _int64_vector(name: str, values) -> torch.Tensor:
    """``values`` (ints, numpy array or integer tensor) as a contiguous 1-D int64 CPU tensor (traceable
    for a tensor: no numpy round trip under ``torch.compile``)."""
    if isinstance(values, torch.Tensor) and not (values.is_floating_point() or values.is_complex()
                                                 or values.dtype == torch.bool) and values.dim() == 1:
        return values.to("cpu", torch.int64).contiguous()
    return torch.from_numpy(np.ascontiguousarray(int_array(name, values), dtype=np.int64))


def read_spans(fd: int, offsets, lengths, *, threads: int = 16, out: torch.Tensor | None = None,
               backend: str = "auto") -> torch.Tensor:
    """Bytes ``[offsets[k], offsets[k] + lengths[k])`` of the open file ``fd``, every k, back to back in a
    uint8 tensor, read by ``threads`` pread workers at once (random reads of a cold file run at the
    disk's queue depth, not one at a time). ``out`` (uint8, 1-D, contiguous) may be longer than needed;
    the filled prefix is returned. A span past the end of the file raises."""
    fd = as_int("fd", fd, minimum=0)
    threads = as_int("threads", threads, minimum=1)
    offsets, lengths = _int64_vector("offsets", offsets), _int64_vector("lengths", lengths)
    total = int(lengths.clamp(min=0).sum())
    out = _prefix_out(out, torch.uint8, total, "bytes")
    torch.ops.latentfast.read_spans_into(fd, offsets, lengths, threads, out, backend)
    return out[:total]


# ---- latent sampling: mean + std * eps, eps keyed by (seed, epoch, item key) ----------------------------
SAMPLE_DTYPES = _ops.SAMPLE_DTYPES


def sample_latents(mean: torch.Tensor, std: torch.Tensor, item_seeds: torch.Tensor, *,
                   out: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """``out[b] = mean[b] + std[b] * eps(item_seeds[b], element)`` for a ``[B, ...]`` batch, in one pass.

    ``eps`` is :mod:`latentfast.sampling`'s counter-based draw (Philox4x32-10 keyed by the item seed,
    Box-Muller in float32): an item's draw depends only on its seed and its own shape, never on the
    batch. ``mean``, ``std``: the same shape, float16 / bfloat16 / float32 each, any strides.
    ``item_seeds``: int64 ``[B]`` from :func:`latentfast.sampling.item_seeds`. ``out``: any strides and
    float dtype, of mean's shape and device (written in place and returned), else a new tensor of
    mean's dtype. The math is float32, rounded once to out's dtype.
    """
    for name, value in (("mean", mean), ("std", std), ("item_seeds", item_seeds)) + ((("out", out),) if out is not None else ()):
        if not isinstance(value, torch.Tensor):
            raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if out is None:
        if mean.dtype not in SAMPLE_DTYPES:
            raise InvalidArgumentError(f"mean must be float16, bfloat16 or float32, got {mean.dtype}")
        if not torch.compiler.is_compiling() and mean.numel() * mean.element_size() > INT64_MAX:
            raise InvalidArgumentError(f"out would take {mean.numel() * mean.element_size()} bytes, more than int64 counts")
        out = torch.empty(mean.shape, dtype=mean.dtype, device=mean.device)
    torch.ops.latentfast.sample_latents_into(mean, std, item_seeds, out, backend)
    return out
