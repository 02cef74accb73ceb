"""Triton kernel of ``latentfast::normalize_uint8_into``."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import launch, tile
from ._rounding import cast_rounded


# n_rows changes with the batch and frame_offset with the view: neither is specialized, so they do not
# compile the kernel again. H, W and the strides stay specialized (fixed for a dataset's resolution;
# a unit W stride lets the loads vectorize).
@triton.jit(do_not_specialize=["n_rows", "L1", "F", "frame_offset"])
def _normalize_view_kernel(
    x_ptr,
    out_ptr,
    n_rows,
    L1,
    F,
    H,
    W,
    frame_offset,
    stride_l0,
    stride_l1,
    stride_t,
    stride_h,
    stride_w,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """out[l0, l1, t, h, w] = x[l0, l1, frame_offset + t, h, w] / 127.5 - 1   (float32 math).

    x: uint8 with lead dims (L0, L1), frames T >= frame_offset + F, H, W, any strides.
    out: contiguous [L0, L1, F, H, W] of the output dtype. Rows are (l0, l1, t, h); a program
    handles a BLOCK_R x BLOCK_W tile of rows x columns.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_W + tl.arange(0, BLOCK_W)
    h = rows % H
    rest = rows // H
    t = rest % F
    rest = rest // F
    l1 = rest % L1
    l0 = rest // L1
    in_row = l0 * stride_l0 + l1 * stride_l1 + (t + frame_offset) * stride_t + h * stride_h
    mask = (rows < n_rows)[:, None] & (cols < W)[None, :]
    x = tl.load(x_ptr + in_row[:, None] + cols[None, :] * stride_w, mask=mask, other=0)
    y = x.to(tl.float32) / 127.5 - 1.0
    out = cast_rounded(y, out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * W + cols[None, :], out, mask=mask)


def _as_two_lead_dims(x: torch.Tensor) -> list[torch.Tensor]:
    """Views of ``x`` with exactly two lead dims before (T, H, W); extra lead dims that cannot be
    merged by a view are peeled off into separate launches (never copied)."""
    if x.dim() == 4:
        return [x.unsqueeze(0)]
    if x.dim() == 5:
        return [x]
    try:
        return [x.view(-1, *x.shape[-4:])]
    except RuntimeError:
        return [part for sub in x.unbind(0) for part in _as_two_lead_dims(sub)]


def normalize_uint8_into(x: torch.Tensor, out: list[torch.Tensor]) -> None:
    """One launch per view (and per peeled lead part); the views cover disjoint frame ranges, so each
    input byte is read once."""
    frames = x.shape[-3] // len(out)
    parts = _as_two_lead_dims(x)
    block_r, block_w = tile(x.shape[-1], 512)
    for view, target in enumerate(out):
        flat_target = target.view(-1, *target.shape[-3:])  # contiguous, so always a view
        start = 0
        for part in parts:
            lead = part.shape[0] * part.shape[1]
            dst = flat_target[start : start + lead]
            start += lead
            L0, L1, _, H, W = part.shape
            n_rows = L0 * L1 * frames * H
            if n_rows == 0 or W == 0:
                continue
            grid = (triton.cdiv(n_rows, block_r), triton.cdiv(W, block_w))
            launch(_normalize_view_kernel, grid, "out", dst, part, dst, n_rows, L1, frames, H, W, view * frames,
                   *part.stride(), BLOCK_R=block_r, BLOCK_W=block_w)
