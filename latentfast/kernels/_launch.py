"""What every Triton launch of latentfast shares: the device it runs on and the tile it covers.

- :func:`launch` runs a kernel under its tensors' CUDA device (``torch.cuda.device``, as the
  bitsandbytes and flash-attention wrappers do): Triton launches on the *current* device's current
  stream, so a tensor on ``cuda:1`` used from a process whose current device is ``cuda:0`` would
  otherwise be written by a kernel queued on ``cuda:0``'s stream, ordered after none of the work
  on ``cuda:1``. On CPU tensors (Triton's interpreter) the guard does nothing.
- :func:`tile` is the one place a kernel's 2-D tile (rows x columns) is chosen.

Kernels compute program offsets in int64 before multiplying (``tl.program_id(0).to(tl.int64) *
BLOCK``): a grid of more than 2**31 / BLOCK programs is possible for thin inputs.
"""
from __future__ import annotations

import contextlib

import torch
import triton

from ..errors import InvalidArgumentError

# elements of one program's tile: 2048 keeps a tile's registers small on a GPU (16 per thread at
# 4 warps) and its interpreted numpy arrays small on a CPU
TILE_ELEMENTS = 2048


def tile(columns: int, max_columns: int) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_W)``: a tile of :data:`TILE_ELEMENTS`, ``BLOCK_W`` the power of two >= ``columns``
    (at least 16, at most ``max_columns``). A kernel that sees many widths passes a constant ``columns``,
    so its tile, a ``tl.constexpr``, never changes (each new value would compile the kernel again)."""
    block_w = max(16, min(triton.next_power_of_2(max(columns, 1)), max_columns))
    return max(1, TILE_ELEMENTS // block_w), block_w


def device_guard(device: torch.device):
    """Make ``device`` the current CUDA device for the duration of a ``with`` block (no-op off CUDA)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def launch(kernel, grid: tuple[int, ...], name: str, tensor: torch.Tensor, *args, **constexprs) -> None:
    """``kernel[grid](*args, **constexprs)`` under ``tensor``'s device (``name`` labels it in errors).

    Refuses a device Triton cannot run on here (a meta tensor, a CPU tensor without the
    interpreter) with an error naming the argument, instead of Triton's "0 active drivers"."""
    device = tensor.device
    interpreted = not isinstance(kernel, triton.runtime.JITFunction)  # jit gives an InterpretedFunction then
    if device.type != "cuda" and not (device.type == "cpu" and interpreted):
        raise InvalidArgumentError(
            f"{name} is on {device}: the Triton kernels run on CUDA tensors, or on CPU tensors under Triton's "
            "interpreter (TRITON_INTERPRET=1 set before Triton is imported)"
        )
    with device_guard(device):
        kernel[grid](*args, **constexprs)
