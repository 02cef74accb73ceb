"""Batched cotangent scatter: per-branch leaf gradients -> per-microbatch cotangents in one arena.

After the distribution loss is differentiated, each branch ``k`` has one gradient
``[b_local, N_k, D_k]`` covering all selected rows of this rank. The trainer replays microbatch by
microbatch, so it needs, for every selected microbatch ``m`` and branch ``k``, the rows of ``m`` --
once as they are (``local``) and once times the world size (``scaled``, cancelling FSDP's
gradient averaging). ``scatter_cotangents`` writes all of them in one pass into one contiguous
arena and returns views into it, so moving the whole set to the CPU is one transfer. A training
loop passes the previous step's result as ``reuse=``: its arena (already paged in) and its views
are kept, which on the CPU is most of the cost of a small scatter and all but the copy of a large
one.
"""
from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .. import backends  # noqa: F401  (registers the kernels of torch.ops.latentfast.*)

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

    Every view of one kind (local or scaled) is made together on first access: with equal
    microbatch sizes one strided view per branch is unbound into its microbatches, which costs a
    third of making each view separately (a tensor view costs about as much as a small kernel
    launch). A later scatter into the same arena (``reuse=``) keeps the views and marks these
    blocks ``expired``: reading them then raises instead of returning the new step's values.
    """

    __slots__ = ("arena", "expired", "_layout", "_scaled", "_views")

    def __init__(self, arena: torch.Tensor, layout, scaled: bool, views=None):
        self.arena = arena
        self.expired = False
        self._layout = layout
        self._scaled = scaled
        self._views: tuple[tuple[torch.Tensor, ...], ...] | None = views

    def __len__(self) -> int:
        return len(self._layout)

    def __getitem__(self, index):
        if self.expired:
            raise RuntimeError(
                "these cotangents were overwritten: the cache reused its arena in a later finalize()."
                " Read them before the next step, or offload_finalized_to_cpu() to keep a copy"
            )
        views = self._views
        if views is None:
            views = self._views = self._make_views()
        return views[index]

    def _make_views(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        base = self.arena.storage_offset()
        layout, part = self._layout, 1 if self._scaled else 0
        if not layout:
            return ()
        size = layout[0][0][1][0]
        if len(layout) > 1 and all(blocks[0][1][0] == size for blocks in layout):
            # equal microbatches: branch k's blocks sit every `period` elements
            period = layout[1][0][0] - layout[0][0][0]
            per_branch = [
                self.arena.as_strided(
                    (len(layout), *shape), (period, shape[1] * shape[2], shape[2], 1), base + offset + part * count
                ).unbind(0)
                for offset, shape, count in layout[0]
            ]
            return tuple(zip(*per_branch))
        return tuple(
            tuple(
                self.arena.as_strided(shape, (shape[1] * shape[2], shape[2], 1), base + offset + part * count)
                for offset, shape, count in blocks
            )
            for blocks in layout
        )

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
    reuse: ScatteredCotangents | None = None,
) -> ScatteredCotangents:
    """Split each ``grads[k]`` by ``batch_sizes`` and store every block as-is and times ``scale``.

    Args:
        grads: per-branch gradients ``[b_local, N_k, D_k]``, any strides, one floating dtype
            (float32, float64, float16, bfloat16) and one device.
        batch_sizes: positive microbatch sizes in collection order, summing to ``b_local``.
        scale: the factor of the scaled copy (the world size, for FSDP averaging). The product is
            computed in float32 (float64 for float64 input) and rounded once.
        out: optional contiguous 1-D arena of :func:`arena_numel` elements, grads' dtype/device.
        reuse: optional earlier result to overwrite (instead of ``out``): its arena is written
            again and, with the same layout, its views are kept, so a training loop makes neither
            pages nor views after its first step. ``reuse``'s blocks expire (reading them raises).

    Returns:
        :class:`ScatteredCotangents` -- ``local[m][k]`` and ``scaled[m][k]`` are contiguous views
        into ``arena`` (made on first access); segment ``(m, k)`` is ``[local | scaled]``,
        microbatch-major.
    """
    if isinstance(grads, torch.Tensor) or not isinstance(grads, Sequence):
        raise TypeError(f"grads must be a sequence of tensors, got {type(grads).__name__}")
    if not grads:
        raise ValueError("grads must hold at least one branch gradient, got an empty sequence")
    first = grads[0]
    if not isinstance(first, torch.Tensor):
        raise TypeError(f"grads[0] must be a torch.Tensor, got {type(first).__name__}")
    dtype, device = first.dtype, first.device
    if dtype not in SCATTER_DTYPES:
        raise ValueError(f"grads[0] dtype must be one of {SCATTER_DTYPES}, got {dtype}")
    sizes = _checked_sizes(batch_sizes)
    b_local = sum(sizes)
    slabs = []
    for k, grad in enumerate(grads):
        if not isinstance(grad, torch.Tensor):
            raise TypeError(f"grads[{k}] must be a torch.Tensor, got {type(grad).__name__}")
        shape = grad.shape
        if len(shape) != 3:
            raise ValueError(f"grads[{k}] must be [b_local, N, D], got shape {tuple(shape)}")
        if grad.dtype != dtype or grad.device != device:
            raise ValueError(f"grads[{k}] is {grad.dtype} on {grad.device}, but grads[0] is {dtype} on {device}")
        if shape[0] != b_local:
            raise ValueError(f"grads[{k}] has {shape[0]} rows, but batch_sizes {list(sizes)} sum to {b_local}")
        slabs.append((shape[1], shape[2]))
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float, got {type(scale).__name__}")

    numel = 2 * b_local * sum(n * d for n, d in slabs)
    label = "out"
    if reuse is not None:
        if out is not None:
            raise ValueError("pass out or reuse, not both")
        if not isinstance(reuse, ScatteredCotangents):
            raise TypeError(f"reuse must be a ScatteredCotangents, got {type(reuse).__name__}")
        out, label = reuse.arena, "reuse.arena"
    if out is None:
        arena = torch.empty(numel, dtype=dtype, device=device)
    else:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"{label} must be a torch.Tensor, got {type(out).__name__}")
        if out.ndim != 1 or out.numel() != numel or not out.is_contiguous():
            raise ValueError(
                f"{label} must be a contiguous 1-D tensor of {numel} elements, got shape {tuple(out.shape)}"
                f" strides {tuple(out.stride())}"
            )
        if out.dtype != dtype or out.device != device:
            raise ValueError(f"{label} must be {dtype} on {device}, got {out.dtype} on {out.device}")
        arena = out

    layout = _layout(tuple(slabs), sizes)
    local_views = scaled_views = None
    if reuse is not None:
        reuse.local.expired = reuse.scaled.expired = True  # before the kernel overwrites them
        if reuse.local._layout == layout:
            local_views, scaled_views = reuse.local._views, reuse.scaled._views
    if numel:
        torch.ops.latentfast.scatter_cotangents_into(grads, sizes, float(scale), arena, backend)
    return ScatteredCotangents(
        CotangentBlocks(arena, layout, False, local_views), CotangentBlocks(arena, layout, True, scaled_views), arena
    )


def _checked_sizes(batch_sizes) -> tuple[int, ...]:
    if isinstance(batch_sizes, torch.Tensor) or not isinstance(batch_sizes, Sequence) or not batch_sizes:
        raise ValueError(f"batch_sizes must be a non-empty sequence of ints, got {batch_sizes!r}")
    sizes = tuple(batch_sizes)
    if set(map(type, sizes)) == {int} and min(sizes) > 0:  # the usual case, checked in bulk
        return sizes
    for m, size in enumerate(sizes):
        if type(size) is not int or size <= 0:  # bool is not int here
            raise ValueError(f"batch_sizes[{m}] must be a positive int, got {size!r}")
    return sizes
