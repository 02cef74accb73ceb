"""Batches from a shaped cache (image buckets, video), and from any cache opened with ``verify_rows``.

:func:`latentfast.cache.read_batch` hands such caches here first. A batch of a shaped cache must
hold items of one shape (:class:`~latentfast.cache.sampler.ShapeBucketBatchSampler` makes such
batches). Items are stored back to back, C-contiguous, so a batch of one shape is a ragged gather
of one "line" per item (C = h = 1, width = the item's element count): the same compiled gather,
pinned ring and cold-read path as line caches serve it, through a flat view of the cache, and the
result is reshaped to ``[B, *shape]``.
"""
from __future__ import annotations

import numpy as np
import torch

from ... import ops
from ...devices import as_device
from ...errors import InvalidArgumentError


def intercepts(cache) -> bool:
    """Whether :func:`read_batch` (here) must serve ``cache`` instead of the plain line gather."""
    return bool(getattr(cache, "shaped", False) or getattr(cache, "verify_rows", False))


def read_batch(cache, indices, *, device="cpu", dtype=None, width=None, out=None, **gather_kwargs):
    """Rows ``indices`` of a shaped cache as ``(latents [B, *shape] of dtype on device, shapes [B, ndim]
    int64 on the CPU)``; items of different shapes raise ``InvalidArgumentError`` (a ``ValueError``)
    naming them. A line cache opened with ``verify_rows`` has its rows' checksum blocks checked, then
    is read as usual. ``gather_kwargs`` (``backend``, ...) go to the line gather unchanged."""
    from .gather import read_batch as gather

    index = ops.as_row_indices(indices, len(cache))
    if getattr(cache, "verify_rows", False):
        cache.verify_items(index.numpy())
    if not getattr(cache, "shaped", False):
        return gather(_GatherView(cache), index, device=device, dtype=dtype, width=width, out=out, **gather_kwargs)
    if width is not None:
        raise InvalidArgumentError(f"width applies to line caches only; a shaped cache's batch has its items' shape, got width={width!r}")
    shape, shapes = batch_shape(cache.shapes, index.numpy())
    B, numel = index.numel(), int(np.prod(shape)) if shape else 0
    flat_out = None
    if out is not None:
        dtype = torch.float16 if dtype is None else dtype
        ops.check_out_tensor("out", out, (B, *shape), dtype, as_device(device))
        flat_out = out.view(B, 1, 1, numel)
    if B == 0:
        return torch.empty((0,) * (1 + shapes.shape[1]), dtype=dtype or torch.float16), torch.from_numpy(shapes)
    latents, _ = gather(_GatherView(cache, flat_width=numel), index, device=device, dtype=dtype, out=flat_out, **gather_kwargs)
    return latents.view(B, *shape), torch.from_numpy(shapes)


def batch_shape(all_shapes: np.ndarray, index: np.ndarray) -> tuple[tuple[int, ...], np.ndarray]:
    """``(shape, shapes [B, ndim])`` of the items ``index``; raises naming the shapes if they differ."""
    shapes = np.ascontiguousarray(all_shapes[index])
    if len(shapes) == 0:
        return (), shapes
    differs = np.any(shapes != shapes[0], axis=1)
    if differs.any():
        kinds, first = np.unique(shapes, axis=0, return_index=True)
        listed = ", ".join(f"{kinds[k].tolist()} (e.g. indices[{int(first[k])}] = {int(index[first[k]])})"
                           for k in np.argsort(first)[:6])
        raise InvalidArgumentError(
            f"a batch of a shaped cache must hold items of one shape; indices name {len(kinds)} shapes: {listed}. "
            f"Batch with ShapeBucketBatchSampler(cache.shapes, ...)"
        )
    return tuple(int(x) for x in shapes[0]), shapes


class _GatherView:
    """The cache as the line gather sees it. ``flat_width`` set: every item is one line of that many
    elements (C = h = 1, no white column), for a batch whose items all have that size."""

    shaped = False
    verify_rows = False

    def __init__(self, cache, flat_width: int | None = None):
        self._cache = cache
        if flat_width is not None:
            self.channels = self.latent_h = 1
            self.w_max = flat_width
            self.white_column = None
            self.widths = cache.gather_source()[2].numpy()  # each item's element count (cached by the cache)

    def __getattr__(self, name):
        return getattr(self._cache, name)

    def __len__(self) -> int:
        return len(self._cache)
