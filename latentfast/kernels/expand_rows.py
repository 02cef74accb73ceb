"""Triton kernel of ``latentfast::expand_rows_into``: packed rows -> padded, white-filled, cast batch."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import check_expand_rows
from ._launch import launch, tile
from ._rounding import cast_rounded

# The tile is the same for every batch: W (the batch's widest row) changes from batch to batch, and a
# tile derived from it would compile the kernel again for each new power of two. 64 columns cover
# typical latent widths in one or two column blocks.
BLOCK_R, BLOCK_W = tile(64, 64)


# Nothing is specialized on argument values: the sizes change with every batch, and no load or
# store here is contiguous across lanes by a known stride, so specializing would buy nothing but
# a compile per new batch geometry. (The pointers' dtypes still select one compiled kernel per out dtype.)
@triton.jit(do_not_specialize=["x_ptr", "offsets_ptr", "widths_ptr", "white_ptr", "out_ptr", "n_lines",
                               "lines_per_row", "W"])
def _expand_rows_kernel(
    x_ptr,
    offsets_ptr,
    widths_ptr,
    white_ptr,
    out_ptr,
    n_lines,
    lines_per_row,
    W,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """out[b, c, y, x] = x[offsets[b] + (c*h + y) * widths[b] + x]  if x < widths[b]
                       = white[c*h + y]                           otherwise   (cast via float32 to out's dtype).

    x: packed float16 rows, row b = [C, h, widths[b]] contiguous from offsets[b] (int64 [B]);
    widths: int32 [B]; white: float16 [C*h]; out: contiguous [B, C, h, W].
    Lines are (b, c, y), n_lines = B*C*h; a program handles a BLOCK_R x BLOCK_W tile of lines x columns.
    """
    lines = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)
    line_ok = lines < n_lines
    row = lines // lines_per_row
    line_in_row = lines % lines_per_row
    width = tl.load(widths_ptr + row, mask=line_ok, other=0).to(tl.int64)
    start = tl.load(offsets_ptr + row, mask=line_ok, other=0)
    white = tl.load(white_ptr + line_in_row, mask=line_ok, other=0.0)
    real = line_ok[:, None] & (cols[None, :] < width[:, None])
    src = start[:, None] + line_in_row[:, None] * width[:, None] + cols[None, :]
    values = tl.load(x_ptr + src, mask=real, other=0.0)
    values = tl.where(real, values, white[:, None])
    mask = line_ok[:, None] & (cols < W)[None, :]
    # through float32: one rounding to bfloat16, to nearest even as torch does
    values = cast_rounded(values.to(tl.float32), out_ptr.dtype.element_ty)
    tl.store(out_ptr + lines[:, None] * W + cols[None, :], values, mask=mask)


def _check_on_device(packed, packed_offsets, widths, white, W: int, lines: int) -> None:
    """The row checks of :func:`~latentfast.reference.check_expand_rows`, queued on the device
    without a host sync (a failed check stops the stream with a device-side assert)."""
    ends = packed_offsets + lines * widths.to(torch.int64)
    valid = (widths >= 0).all() & (widths <= W).all() & (packed_offsets >= 0).all() & (ends <= packed.numel()).all()
    if white is None:
        valid = valid & (widths == W).all()
    torch._assert_async(valid, f"expand_rows: every row needs 0 <= width <= W={W}, to lie inside packed, and a "
                               "white column unless it is W wide")


def expand_rows_into(
    packed: torch.Tensor, packed_offsets: torch.Tensor, widths: torch.Tensor, white, out: torch.Tensor
) -> None:
    """One launch for the whole batch. ``white`` may be None only when every row is W wide.

    Rows are checked before the launch: on the host for CPU tensors (the interpreter), on the
    device for CUDA tensors."""
    B, C, H, W = out.shape
    if out.device.type == "cuda":
        _check_on_device(packed, packed_offsets, widths, white, W, C * H)
    else:
        check_expand_rows(packed, packed_offsets, widths, white, out)
    n_lines = B * C * H
    if n_lines == 0 or W == 0:
        return
    if white is None:  # nothing is padded (checked above); any float16 values do for the masked lanes
        white = torch.zeros(C * H, dtype=torch.float16, device=out.device)
    grid = (triton.cdiv(n_lines, BLOCK_R), triton.cdiv(W, BLOCK_W))
    launch(_expand_rows_kernel, grid, "out", out, packed, packed_offsets, widths, white.reshape(-1), out, n_lines,
           C * H, W, BLOCK_R=BLOCK_R, BLOCK_W=BLOCK_W)
