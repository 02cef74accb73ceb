"""Batched cotangent scatter: per-branch leaf gradients -> per-microbatch cotangents in one arena.

After the distribution loss is differentiated, each branch ``k`` has one gradient
``[b_local, N_k, D_k]`` covering all selected rows of this rank. The trainer replays microbatch by
microbatch, so it needs, for every selected microbatch ``m`` and branch ``k``, the rows of ``m`` --
once as they are (``local``) and once times the world size (``scaled``, cancelling FSDP's
gradient averaging). ``scatter_cotangents`` writes all of them in one pass into one contiguous
arena and returns views into it, so moving the whole set to the CPU is one transfer.
"""
from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .. import backends

SCATTER_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def arena_numel(grad_shapes: Sequence[Sequence[int]], batch_sizes: Sequence[int]) -> int:
    """Elements of the arena for branch shapes ``[b_local, N_k, D_k]`` and these microbatches."""
    return 2 * sum(batch_sizes) * sum(int(shape[1]) * int(shape[2]) for shape in grad_shapes)


@functools.lru_cache(maxsize=256)
def _layout(slab_shapes: tuple[tuple[int, int], ...], batch_sizes: tuple[int, ...]):
    """Per microbatch, per branch: (arena offset of the local block, its shape, its numel)."""
    layout, offset = [], 0
    for size in batch_sizes:
        blocks = []
        for tokens, channels in slab_shapes:
            count = size * tokens * channels
            blocks.append((offset, (size, tokens, channels), count))
            offset += 2 * count
        layout.append(tuple(blocks))
    return tuple(layout)


class CotangentBlocks(Sequence):
    """``blocks[m][k]``: the block of microbatch ``m``, branch ``k`` -- a view into the arena.

    A microbatch's views are made when it is first indexed: creating a tensor view costs about as
    much as launching a small kernel, and the trainer reaches one microbatch at a time anyway.
    """

    __slots__ = ("arena", "_layout", "_scaled", "_views")

    def __init__(self, arena: torch.Tensor, layout, scaled: bool):
        self.arena = arena
        self._layout = layout
        self._scaled = scaled
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}

    def __len__(self) -> int:
        return len(self._layout)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self[m] for m in range(*index.indices(len(self))))
        m = range(len(self._layout))[index]  # IndexError and negative indices as for a tuple
        views = self._views.get(m)
        if views is None:
            base = self.arena.storage_offset()
            views = tuple(
                self.arena.as_strided(shape, (shape[1] * shape[2], shape[2], 1), base + offset + (count if self._scaled else 0))
                for offset, shape, count in self._layout[m]
            )
            self._views[m] = views
        return views

    def __repr__(self) -> str:
        kind = "scaled" if self._scaled else "local"
        return f"CotangentBlocks({kind}, microbatches={len(self)}, branches={len(self._layout[0]) if self._layout else 0})"


def arena_views(
    arena: torch.Tensor, slab_shapes: Sequence[Sequence[int]], batch_sizes: Sequence[int]
) -> tuple[CotangentBlocks, CotangentBlocks]:
    """(local, scaled) blocks of an arena laid out by :func:`scatter_cotangents`.

    ``slab_shapes[k] = (N_k, D_k)``. Used again after the arena moved (e.g. to the CPU) to rebuild
    the views on the new copy.
    """
    layout = _layout(tuple((int(n), int(d)) for n, d in slab_shapes), tuple(int(b) for b in batch_sizes))
    return CotangentBlocks(arena, layout, scaled=False), CotangentBlocks(arena, layout, scaled=True)


class ScatteredCotangents(NamedTuple):
    """``local[m][k]`` / ``scaled[m][k]``: ``[batch_sizes[m], N_k, D_k]`` views into ``arena``."""

    local: CotangentBlocks
    scaled: CotangentBlocks
    arena: torch.Tensor


def scatter_cotangents(
    grads: Sequence[torch.Tensor],
    batch_sizes: Sequence[int],
    *,
    scale: float,
    backend: str = "auto",
    out: torch.Tensor | None = None,
) -> ScatteredCotangents:
    """Split each ``grads[k]`` by ``batch_sizes`` and store every block as-is and times ``scale``.

    Args:
        grads: per-branch gradients ``[b_local, N_k, D_k]``, any strides, one floating dtype
            (float32, float64, float16, bfloat16) and one device.
        batch_sizes: positive microbatch sizes in collection order, summing to ``b_local``.
        scale: the factor of the scaled copy (the world size, for FSDP averaging). The product is
            computed in float32 (float64 for float64 input) and rounded once.
        out: optional contiguous 1-D arena of :func:`arena_numel` elements, grads' dtype/device.

    Returns:
        :class:`ScatteredCotangents` -- ``local[m][k]`` and ``scaled[m][k]`` are contiguous views
        into ``arena`` (made on first access); segment ``(m, k)`` is ``[local | scaled]``,
        microbatch-major.
    """
    if isinstance(grads, torch.Tensor) or not isinstance(grads, Sequence):
        raise TypeError(f"grads must be a sequence of tensors, got {type(grads).__name__}")
    grads = list(grads)
    if not grads:
        raise ValueError("grads must hold at least one branch gradient, got an empty sequence")
    for k, grad in enumerate(grads):
        if not isinstance(grad, torch.Tensor):
            raise TypeError(f"grads[{k}] must be a torch.Tensor, got {type(grad).__name__}")
        if grad.ndim != 3:
            raise ValueError(f"grads[{k}] must be [b_local, N, D], got shape {tuple(grad.shape)}")
        if grad.dtype not in SCATTER_DTYPES:
            raise ValueError(f"grads[{k}] dtype must be one of {SCATTER_DTYPES}, got {grad.dtype}")
        if grad.dtype != grads[0].dtype or grad.device != grads[0].device:
            raise ValueError(
                f"grads[{k}] is {grad.dtype} on {grad.device}, but grads[0] is {grads[0].dtype} on {grads[0].device}"
            )
    if isinstance(batch_sizes, torch.Tensor) or not isinstance(batch_sizes, Sequence) or not batch_sizes:
        raise ValueError(f"batch_sizes must be a non-empty sequence of ints, got {batch_sizes!r}")
    sizes = []
    for m, size in enumerate(batch_sizes):
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ValueError(f"batch_sizes[{m}] must be a positive int, got {size!r}")
        sizes.append(int(size))
    b_local = sum(sizes)
    for k, grad in enumerate(grads):
        if grad.shape[0] != b_local:
            raise ValueError(f"grads[{k}] has {grad.shape[0]} rows, but batch_sizes {sizes} sum to {b_local}")
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")

    numel = arena_numel([g.shape for g in grads], sizes)
    if out is None:
        arena = torch.empty(numel, dtype=grads[0].dtype, device=grads[0].device)
    else:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if out.ndim != 1 or out.numel() != numel or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous 1-D tensor of {numel} elements, got shape {tuple(out.shape)}"
                f" strides {tuple(out.stride())}"
            )
        if out.dtype != grads[0].dtype or out.device != grads[0].device:
            raise ValueError(f"out must be {grads[0].dtype} on {grads[0].device}, got {out.dtype} on {out.device}")
        arena = out

    fn, _ = backends.kernel("scatter_cotangents_into", arena.device.type, backend)
    if numel:
        fn(grads, sizes, float(scale), arena)
    local, scaled = arena_views(arena, [tuple(g.shape[1:]) for g in grads], sizes)
    return ScatteredCotangents(local, scaled, arena)
