"""Pure-torch reference of every op: the fallback on any device and the oracle of every test.

Each function here implements the *kernel form* declared in :mod:`latentfast._ops` (same
name, same arguments), written for clarity rather than speed.
"""
from __future__ import annotations

import torch


def normalize_uint8_into(x: torch.Tensor, out: list[torch.Tensor]) -> None:
    """``out[v] = (x[..., v*F:(v+1)*F, :, :] / 127.5 - 1)`` in float32, rounded to ``out[v].dtype``.

    ``x``: uint8 ``[..., C, T, H, W]``; ``out``: ``len(out)`` views of ``[..., C, T/len(out), H, W]``.
    """
    frames = x.shape[-3] // len(out)
    for view, target in enumerate(out):
        part = x.narrow(-3, view * frames, frames)
        target.copy_(part.to(torch.float32).div_(127.5).sub_(1.0))


# ---- cache decode (issue 4) -----------------------------------------------------------------


# ---- replay (issue 6) -----------------------------------------------------------------------
def scatter_cotangents_into(
    grads: list[torch.Tensor], batch_sizes: list[int], scale: float, arena: torch.Tensor
) -> None:
    """Split per-branch leaf gradients into per-microbatch blocks, each stored twice in ``arena``.

    ``grads[k]``: ``[b_local, N_k, D_k]`` (any strides); ``batch_sizes``: the microbatch sizes,
    summing to ``b_local``; ``arena``: contiguous 1-D of ``2 * b_local * sum_k N_k * D_k``
    elements. Segment ``(m, k)`` (microbatch-major, branch-minor) holds
    ``grads[k][rows of m]`` followed by ``grads[k][rows of m] * scale``.
    """
    offset, row = 0, 0
    for size in batch_sizes:
        for grad in grads:
            block = grad[row : row + size]
            count = block.numel()
            arena[offset : offset + count].view_as(block).copy_(block)
            torch.mul(block, scale, out=arena[offset + count : offset + 2 * count].view_as(block))
            offset += 2 * count
        row += size
