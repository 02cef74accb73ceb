"""Triton kernel of ``latentfast::expand_rows_into``: packed rows -> padded, white-filled, cast batch."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._rounding import cast_rounded


@triton.jit
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
    lines = (tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)
    cols = (tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)).to(tl.int64)
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
    # through float32: one rounding to bfloat16, to nearest even as torch does (on the GPU; Triton's
    # interpreter truncates instead)
    values = cast_rounded(values.to(tl.float32), out_ptr.dtype.element_ty)
    tl.store(out_ptr + lines[:, None] * W + cols[None, :], values, mask=mask)


def expand_rows_into(
    packed: torch.Tensor, packed_offsets: torch.Tensor, widths: torch.Tensor, white, out: torch.Tensor
) -> None:
    """One launch for the whole batch. ``white`` may be None only when every row is W wide."""
    B, C, H, W = out.shape
    n_lines = B * C * H
    if n_lines == 0 or W == 0:
        return
    if white is None:  # nothing is padded (the caller checked); any float16 values do for the masked lanes
        white = torch.zeros(C * H, dtype=torch.float16, device=out.device)
    block_w = min(triton.next_power_of_2(W), 256)
    block_r = max(1, 2048 // block_w)
    grid = (triton.cdiv(n_lines, block_r), triton.cdiv(W, block_w))
    _expand_rows_kernel[grid](
        packed, packed_offsets, widths, white.reshape(-1), out, n_lines, C * H, W, BLOCK_R=block_r, BLOCK_W=block_w
    )
