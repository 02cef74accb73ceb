"""Batched cotangent scatter: per-branch leaf gradients -> per-microbatch cotangents in one arena.

After the distribution loss is differentiated, each branch ``k`` has one gradient
``[b_local, N_k, D_k]`` covering all selected rows of this rank. The trainer replays microbatch by
microbatch, so it needs, for every selected microbatch ``m`` and branch ``k``, the rows of ``m`` --
as they are (``local``) and times the world size (``scaled``, cancelling FSDP's gradient
averaging). ``scatter_cotangents`` writes the scaled blocks in one pass (one launch on a GPU) into
one contiguous arena and returns views into it, so moving them to the CPU is one transfer.

The local blocks cost no copy where none is needed: with ``scale == 1`` they are the scaled
blocks, and when every gradient is contiguous and already of the output dtype they are views of
the gradients (``split``, as a trainer would write it). Otherwise (strided gradients, or a dtype
change such as float32 gradients of bfloat16 features) the same pass writes them into the arena
as well. (Writing only the copy a trainer needs is what keeps the op at or above the speed of the
per-block Python loop at every size.) A training loop passes the previous step's result as
``reuse=``: its arena (already paged in) and its views are kept, which on the CPU is most of the
cost of a small scatter.
"""
from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .. import backends  # noqa: F401  (registers the kernels of torch.ops.latentfast.*)
from .._ops import SCATTER_DTYPES  # the op's schema owns the dtypes it takes
from ..errors import ArgumentTypeError, InvalidArgumentError, ReplayError



def arena_numel(grad_shapes: Sequence[Sequence[int]], batch_sizes: Sequence[int], copies: int = 2) -> int:
    """Elements of an arena holding ``copies`` copies of branch shapes ``[b_local, N_k, D_k]``."""
    return copies * sum(batch_sizes) * sum(int(shape[1]) * int(shape[2]) for shape in grad_shapes)


def arena_copies(grads: Sequence[torch.Tensor], scale: float, dtype: torch.dtype | None = None) -> int:
    """How many copies of every block :func:`scatter_cotangents` writes: 1 when the local blocks
    need no memory of their own (``scale == 1``, or every gradient contiguous and of ``dtype``),
    else 2."""
    dtype = grads[0].dtype if dtype is None else dtype
    if float(scale) == 1.0 or all(g.is_contiguous() and g.dtype == dtype for g in grads):
        return 1
    return 2


def arena_size(grads: Sequence[torch.Tensor], batch_sizes: Sequence[int], *, scale: float, dtype=None) -> int:
    """Elements of the arena :func:`scatter_cotangents` writes for these arguments (the size of ``out=``)."""
    return arena_numel([g.shape for g in grads], batch_sizes, arena_copies(grads, scale, dtype))


@functools.lru_cache(maxsize=256)
def _layout(slab_shapes: tuple[tuple[int, int], ...], batch_sizes: tuple[int, ...], copies: int):
    """Per microbatch, per branch: (arena offset of the block's first copy, its shape, its numel)."""
    layout, offset = [], 0
    for size in batch_sizes:
        blocks = []
        for tokens, channels in slab_shapes:
            count = size * tokens * channels
            blocks.append((offset, (size, tokens, channels), count))
            offset += copies * count
        layout.append(tuple(blocks))
    return tuple(layout)


class _Lease:
    """Shared by the local and scaled blocks of one scatter: set when a later scatter reuses the arena."""

    __slots__ = ("expired",)

    def __init__(self) -> None:
        self.expired = False


class CotangentBlocks(Sequence):
    """``blocks[m][k]``: the block of microbatch ``m``, branch ``k`` -- a view into the arena (copy
    ``copy`` of each segment), or of the gradients themselves (``source`` a tuple of them).

    Every view is made on first access: with equal microbatch sizes one strided view per branch is
    unbound into its microbatches, which costs a third of making each view separately (a tensor
    view costs about as much as a small kernel launch). Once a later scatter reuses the arena the
    blocks are ``expired``: reading them raises instead of returning the new step's values.
    """

    __slots__ = ("source", "_lease", "_layout", "_copy", "_views")

    def __init__(self, source, layout, copy: int, lease: _Lease, views=None):
        self.source = source  # the arena tensor, or the tuple of gradients split by the layout
        self._lease = lease
        self._layout = layout
        self._copy = copy
        self._views: tuple[tuple[torch.Tensor, ...], ...] | None = views

    @property
    def expired(self) -> bool:
        return self._lease.expired

    def __len__(self) -> int:
        return len(self._layout)

    def __getitem__(self, index):
        if self._lease.expired:
            raise ReplayError(
                "these cotangents were overwritten: their arena was reused by a later scatter (the replay cache's next"
                " finalize()). Read them before the next step, or offload_finalized_to_cpu() to keep a copy"
            )
        views = self._views
        if views is None:
            views = self._views = self._make_views()
        return views[index]

    def _make_views(self) -> tuple[tuple[torch.Tensor, ...], ...]:
        layout = self._layout
        if not layout:
            return ()
        if isinstance(self.source, tuple):
            sizes = [blocks[0][1][0] for blocks in layout]
            return tuple(zip(*(grad.split(sizes) for grad in self.source)))
        arena = self.source  # views are made from slices of it: no storage_offset(), so they also trace
        size = layout[0][0][1][0]
        if len(layout) > 1 and all(blocks[0][1][0] == size for blocks in layout):
            # equal microbatches: branch k's blocks sit every `period` elements
            period = layout[1][0][0] - layout[0][0][0]
            per_branch = [
                arena[offset + self._copy * count :].as_strided(
                    (len(layout), *shape), (period, shape[1] * shape[2], shape[2], 1)
                ).unbind(0)
                for offset, shape, count in layout[0]
            ]
            return tuple(zip(*per_branch))
        return tuple(
            tuple(arena.narrow(0, offset + self._copy * count, count).view(shape) for offset, shape, count in blocks)
            for blocks in layout
        )

    def __repr__(self) -> str:
        kind = "gradient views" if isinstance(self.source, tuple) else f"arena copy {self._copy}"
        branches = len(self._layout[0]) if self._layout else 0
        return f"CotangentBlocks({kind}, microbatches={len(self)}, branches={branches}, expired={self.expired})"


class ScatteredCotangents(NamedTuple):
    """``local[m][k]`` / ``scaled[m][k]``: ``[batch_sizes[m], N_k, D_k]`` views into ``arena`` (the
    local ones possibly into the gradients, see :func:`scatter_cotangents`)."""

    local: CotangentBlocks
    scaled: CotangentBlocks
    arena: torch.Tensor

    @property
    def expired(self) -> bool:
        """True once a later ``scatter_cotangents(reuse=...)`` overwrote the arena."""
        return self.scaled.expired

    def tensors(self) -> list[torch.Tensor]:
        """The buffers every block is a view of: the arena, then the gradients the local blocks view."""
        return [self.arena, *self.local.source] if isinstance(self.local.source, tuple) else [self.arena]

    def rebuilt(self, tensors: Sequence[torch.Tensor]) -> "ScatteredCotangents":
        """The same blocks over copies of :meth:`tensors` (e.g. on another device); never expires."""
        if self.expired:
            raise ReplayError("cannot copy expired cotangents: their arena was reused by a later scatter")
        lease, arena = _Lease(), tensors[0]
        local_source = tuple(tensors[1:]) if isinstance(self.local.source, tuple) else arena
        return ScatteredCotangents(
            CotangentBlocks(local_source, self.local._layout, self.local._copy, lease),
            CotangentBlocks(arena, self.scaled._layout, self.scaled._copy, lease),
            arena,
        )


def scatter_cotangents(
    grads: Sequence[torch.Tensor],
    batch_sizes: Sequence[int],
    *,
    scale: float,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
    out: torch.Tensor | None = None,
    reuse: ScatteredCotangents | None = None,
) -> ScatteredCotangents:
    """Split each ``grads[k]`` by ``batch_sizes`` into local blocks and blocks times ``scale``.

    Args:
        grads: per-branch gradients ``[b_local, N_k, D_k]``, any strides, one floating dtype
            (float32, float64, float16, bfloat16) and one device.
        batch_sizes: positive microbatch sizes in collection order, summing to ``b_local``.
        scale: the factor of the scaled blocks (the world size, for FSDP averaging). The product is
            computed in float32 (float64 for float64 input) and rounded once to ``dtype``.
        dtype: dtype of the cotangents (default: the gradients'), one of the four above.
        out: optional contiguous 1-D arena of :func:`arena_size` elements, of ``dtype`` on the
            grads' device.
        reuse: optional earlier result to overwrite (instead of ``out``): its arena is written
            again and, with the same layout, its views are kept, so a training loop makes neither
            pages nor views after its first step. ``reuse`` expires (reading it raises), and a
            result can be reused once: reusing an expired one raises.

    Returns:
        :class:`ScatteredCotangents`. Segment ``(m, k)`` of the arena (microbatch-major) holds the
        scaled block, preceded by the local block when it could not be a view (2 copies).
    """
    sizes = _checked_sizes(batch_sizes)
    b_local = sum(sizes)
    dtype_in, device, slabs, slab_sum = _check_grads(grads, b_local, sizes)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ArgumentTypeError(f"scale must be a float, got {type(scale).__name__}")
    dtype = dtype_in if dtype is None else dtype
    if dtype not in SCATTER_DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {SCATTER_DTYPES}, got {dtype}")
    scale = float(scale)
    copies = arena_copies(grads, scale, dtype)
    layout = _layout(slabs, sizes, copies)
    arena = _target_arena(out, reuse, copies * b_local * slab_sum, dtype, device)
    local, scaled = _blocks(grads, arena, layout, copies, scale, reuse)
    if arena.numel():
        scales = [1.0, scale] if copies == 2 else [scale]
        torch.ops.latentfast.scatter_cotangents_into(list(grads), list(sizes), scales, arena, backend)
    return ScatteredCotangents(local, scaled, arena)


def _blocks(grads, arena, layout, copies: int, scale: float, reuse) -> tuple[CotangentBlocks, CotangentBlocks]:
    """(local, scaled) blocks of a new scatter; ``reuse`` expires here, before its arena is overwritten,
    and hands over its arena views when the layout is the same."""
    views = {}
    if reuse is not None:
        reuse.scaled._lease.expired = True
        for old in (reuse.local, reuse.scaled):
            if old.source is arena and old._layout == layout:
                views[old._copy] = old._views
    lease = _Lease()
    scaled = CotangentBlocks(arena, layout, copies - 1, lease, views.get(copies - 1))
    if copies == 2:
        return CotangentBlocks(arena, layout, 0, lease, views.get(0)), scaled
    if scale == 1.0:
        return scaled, scaled
    return CotangentBlocks(tuple(grads), layout, 0, lease), scaled


def _check_grads(grads, b_local: int, sizes) -> tuple[torch.dtype, torch.device, tuple[tuple[int, int], ...], int]:
    """(dtype, device, per-branch ``(N, D)``, sum of ``N * D``) of valid gradients."""
    if isinstance(grads, torch.Tensor) or not isinstance(grads, Sequence):
        raise ArgumentTypeError(f"grads must be a sequence of tensors, got {type(grads).__name__}")
    if not grads:
        raise InvalidArgumentError("grads must hold at least one branch gradient, got an empty sequence")
    if not isinstance(grads[0], torch.Tensor):
        raise ArgumentTypeError(f"grads[0] must be a torch.Tensor, got {type(grads[0]).__name__}")
    dtype, device = grads[0].dtype, grads[0].device
    if dtype not in SCATTER_DTYPES:
        raise InvalidArgumentError(f"grads[0] dtype must be one of {SCATTER_DTYPES}, got {dtype}")
    slabs, slab_sum = [], 0
    for k, grad in enumerate(grads):
        if not isinstance(grad, torch.Tensor):
            raise ArgumentTypeError(f"grads[{k}] must be a torch.Tensor, got {type(grad).__name__}")
        shape = grad.shape
        if len(shape) != 3:
            raise InvalidArgumentError(f"grads[{k}] must be [b_local, N, D], got shape {tuple(shape)}")
        if grad.dtype != dtype or grad.device != device:
            raise InvalidArgumentError(f"grads[{k}] is {grad.dtype} on {grad.device}, but grads[0] is {dtype} on {device}")
        if shape[0] != b_local:
            raise InvalidArgumentError(f"grads[{k}] has {shape[0]} rows, but batch_sizes {list(sizes)} sum to {b_local}")
        slabs.append((shape[1], shape[2]))
        slab_sum += shape[1] * shape[2]
    return dtype, device, tuple(slabs), slab_sum


def _checked_sizes(batch_sizes) -> tuple[int, ...]:
    if isinstance(batch_sizes, torch.Tensor) or not isinstance(batch_sizes, Sequence) or not batch_sizes:
        raise InvalidArgumentError(f"batch_sizes must be a non-empty sequence of ints, got {batch_sizes!r}")
    sizes = tuple(batch_sizes)
    if set(map(type, sizes)) == {int} and min(sizes) > 0:  # the usual case, checked in bulk
        return sizes
    for m, size in enumerate(sizes):
        if type(size) is not int or size <= 0:  # bool is not int here
            raise InvalidArgumentError(f"batch_sizes[{m}] must be a positive int, got {size!r}")
    return sizes


def _target_arena(out, reuse, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The arena to write: ``reuse``'s, ``out``, or a new one; checked against the layout."""
    label = "out"
    if reuse is not None:
        if out is not None:
            raise InvalidArgumentError("pass out or reuse, not both")
        if not isinstance(reuse, ScatteredCotangents):
            raise ArgumentTypeError(f"reuse must be a ScatteredCotangents, got {type(reuse).__name__}")
        if reuse.expired:
            raise ReplayError(
                "reuse was already overwritten by a later scatter_cotangents(reuse=...): two live results would share"
                " one arena. Pass the most recent result"
            )
        out, label = reuse.arena, "reuse.arena"
    if out is None:
        return torch.empty(numel, dtype=dtype, device=device)
    if not isinstance(out, torch.Tensor):
        raise ArgumentTypeError(f"{label} must be a torch.Tensor, got {type(out).__name__}")
    if out.ndim != 1 or out.numel() != numel or not out.is_contiguous():
        raise InvalidArgumentError(
            f"{label} must be a contiguous 1-D tensor of {numel} elements, got shape {tuple(out.shape)}"
            f" strides {tuple(out.stride())}"
        )
    if out.dtype != dtype or out.device != device:
        raise InvalidArgumentError(f"{label} must be {dtype} on {device}, got {out.dtype} on {out.device}")
    return out
