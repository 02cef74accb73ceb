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
