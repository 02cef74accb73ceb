"""Predicted encode seconds per pixel shape ``(T, H, W)``: the costs the balancing plan works on.

The table is measured, not modeled: each shape is encoded a few times after a warm-up and the
median is kept; across ranks the slowest measurement wins (a plan made from optimistic costs
overloads the slow ranks). An unknown shape is an error unless interpolation is asked for, so a
missing entry never silently turns into a bad plan. ``measure`` also records the size of each
shape's latent, which the transfer-aware plan counts for the way back.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.distributed as dist

from ..devices import as_device
from ..errors import InvalidArgumentError, MissingCostError

Shape = tuple[int, int, int]
INTERPOLATIONS = (None, "voxels")


def _shape_key(t, h, w) -> Shape:
    key = (int(t), int(h), int(w))
    if min(key) < 1:
        raise InvalidArgumentError(f"(t, h, w) must be positive, got {key}")
    return key


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class EncodeCostModel:
    """Measured encode seconds per ``(T, H, W)``.

    Args:
        seconds_by_shape: ``{(t, h, w): seconds}``.
        interpolation: ``None`` (unknown shapes raise :class:`~latentfast.errors.MissingCostError`,
            a ``KeyError``) or ``"voxels"``: predict an unknown shape from a least-squares line
            ``a + b * t*h*w`` through the measured shapes (a proportional scale when only one is
            known), never below zero.
        latent_bytes_by_shape: ``{(t, h, w): bytes of one clip's latent}`` (recorded by :meth:`measure`).
    """

    def __init__(
        self,
        seconds_by_shape: Mapping[Shape, float] | None = None,
        *,
        interpolation: str | None = None,
        latent_bytes_by_shape: Mapping[Shape, int] | None = None,
    ):
        if interpolation not in INTERPOLATIONS:
            raise InvalidArgumentError(f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")
        self.interpolation = interpolation
        self.seconds_by_shape: dict[Shape, float] = {}
        for shape, seconds in (seconds_by_shape or {}).items():
            seconds = float(seconds)
            if not (math.isfinite(seconds) and seconds >= 0):
                raise InvalidArgumentError(f"seconds for shape {shape} must be finite and >= 0, got {seconds}")
            self.seconds_by_shape[_shape_key(*shape)] = seconds
        self.latent_bytes_by_shape: dict[Shape, int] = {}
        for shape, size in (latent_bytes_by_shape or {}).items():
            if int(size) != size or size < 0:
                raise InvalidArgumentError(f"latent bytes for shape {shape} must be a whole number >= 0, got {size}")
            self.latent_bytes_by_shape[_shape_key(*shape)] = int(size)

    @property
    def encode_seconds_benchmarked(self) -> bool:
        """Whether a cost table is installed (what makes balancing available)."""
        return bool(self.seconds_by_shape)

    def predicted_encode_seconds(self, t: int, h: int, w: int) -> float:
        key = _shape_key(t, h, w)
        if key in self.seconds_by_shape:
            return self.seconds_by_shape[key]
        if self.interpolation is None or not self.seconds_by_shape:
            known = sorted(self.seconds_by_shape)
            raise MissingCostError(
                f"no measured encode time for (t, h, w)={key}; measured shapes: {known}. "
                "Measure it, or construct EncodeCostModel(..., interpolation='voxels')"
            )
        return self._voxel_fit(key[0] * key[1] * key[2])

    def predicted_latent_bytes(self, t: int, h: int, w: int) -> int | None:
        """Bytes of one ``(t, h, w)`` clip's latent: measured, else scaled by voxels from the
        measured shapes; ``None`` when no latent size was recorded."""
        key = _shape_key(t, h, w)
        if key in self.latent_bytes_by_shape or not self.latent_bytes_by_shape:
            return self.latent_bytes_by_shape.get(key)
        per_voxel = statistics.fmean(b / (s[0] * s[1] * s[2]) for s, b in self.latent_bytes_by_shape.items())
        return round(per_voxel * key[0] * key[1] * key[2])

    def _voxel_fit(self, voxels: int) -> float:
        points = sorted((t * h * w, s) for (t, h, w), s in self.seconds_by_shape.items())
        xs = [float(v) for v, _ in points]
        ys = [s for _, s in points]
        if len(set(xs)) < 2:
            return max(0.0, statistics.fmean(ys) * voxels / xs[0])
        slope, intercept = statistics.linear_regression(xs, ys)
        return max(0.0, intercept + slope * voxels)

    @classmethod
    def measure(
        cls,
        encode_fn: Callable[[torch.Tensor], torch.Tensor],
        shapes: Iterable[Shape],
        *,
        channels: int = 3,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        warmup: int = 1,
        repeats: int = 5,
        group: dist.ProcessGroup | None = None,
        interpolation: str | None = None,
        seed: int = 0,
    ) -> EncodeCostModel:
        """Time ``encode_fn`` on a random ``[channels, t, h, w]`` clip in [-1, 1] per shape
        (``warmup`` runs, then the median of ``repeats``) and record its latent's size. With
        ``torch.distributed`` initialized, every rank of ``group`` must call this, and the tables
        are merged by max."""
        if repeats < 1 or warmup < 0:
            raise InvalidArgumentError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
        device = as_device(device)
        generator = torch.Generator().manual_seed(seed)
        table: dict[Shape, float] = {}
        latent_bytes: dict[Shape, int] = {}
        for shape in sorted({_shape_key(*s) for s in shapes}):
            clip = (torch.rand((channels, *shape), generator=generator) * 2 - 1).to(device=device, dtype=dtype)
            for _ in range(warmup):
                encode_fn(clip)
            runs = []
            for _ in range(repeats):
                _synchronize(device)
                start = time.perf_counter()
                latent = encode_fn(clip)
                _synchronize(device)
                runs.append(time.perf_counter() - start)
            table[shape] = statistics.median(runs)
            latent_bytes[shape] = latent.numel() * latent.element_size()
        model = cls(table, interpolation=interpolation, latent_bytes_by_shape=latent_bytes)
        if dist.is_available() and dist.is_initialized():
            model = model.merged_across_ranks(group=group, device=device)
        return model

    def merged_across_ranks(self, *, group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu") -> EncodeCostModel:
        """Every rank of ``group`` calls this; all get the union of shapes, each at its max seconds
        (and max latent bytes)."""
        device = as_device(device)
        count = torch.tensor([len(self.seconds_by_shape)], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        rows = torch.full((int(count.item()), 5), -1.0, dtype=torch.float64)
        for row, (shape, seconds) in enumerate(sorted(self.seconds_by_shape.items())):
            rows[row] = torch.tensor([*shape, seconds, self.latent_bytes_by_shape.get(shape, -1)], dtype=torch.float64)
        rows = rows.to(device)
        gathered = torch.empty((dist.get_world_size(group), *rows.shape), dtype=rows.dtype, device=device)
        dist.all_gather(list(gathered.unbind(0)), rows, group=group)
        merged: dict[Shape, float] = {}
        sizes: dict[Shape, int] = {}
        for t, h, w, seconds, size in gathered.reshape(-1, 5).cpu().tolist():  # one copy back
            if seconds >= 0:
                key = (int(t), int(h), int(w))
                merged[key] = max(merged.get(key, 0.0), seconds)
                if size >= 0:
                    sizes[key] = max(sizes.get(key, 0), int(size))
        return EncodeCostModel(merged, interpolation=self.interpolation, latent_bytes_by_shape=sizes)

    def __repr__(self) -> str:
        return f"EncodeCostModel({len(self.seconds_by_shape)} shapes, interpolation={self.interpolation!r})"
