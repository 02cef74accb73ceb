"""Predicted encode seconds per pixel shape ``(T, H, W)``: the costs the balancing plan works on.

The table is measured, not modeled: each shape is encoded a few times after a warm-up and the
median is kept; across ranks the slowest measurement wins (a plan made from optimistic costs
overloads the slow ranks). An unknown shape is an error unless interpolation is asked for, so a
missing entry never silently turns into a bad plan.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.distributed as dist

Shape = tuple[int, int, int]
INTERPOLATIONS = (None, "voxels")


def _shape_key(t, h, w) -> Shape:
    key = (int(t), int(h), int(w))
    if min(key) < 1:
        raise ValueError(f"(t, h, w) must be positive, got {key}")
    return key


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class EncodeCostModel:
    """Measured encode seconds per ``(T, H, W)``.

    Args:
        seconds_by_shape: ``{(t, h, w): seconds}``.
        interpolation: ``None`` (unknown shapes raise) or ``"voxels"``: predict an unknown shape
            from a least-squares line ``a + b * t*h*w`` through the measured shapes (a
            proportional scale when only one is known), never below zero.
    """

    def __init__(self, seconds_by_shape: Mapping[Shape, float] | None = None, *, interpolation: str | None = None):
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {interpolation!r}")
        self.interpolation = interpolation
        self.seconds_by_shape: dict[Shape, float] = {}
        for shape, seconds in (seconds_by_shape or {}).items():
            seconds = float(seconds)
            if not seconds >= 0 or seconds == float("inf"):
                raise ValueError(f"seconds for shape {shape} must be finite and >= 0, got {seconds}")
            self.seconds_by_shape[_shape_key(*shape)] = seconds

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
            raise KeyError(
                f"no measured encode time for (t, h, w)={key}; measured shapes: {known}. "
                "Measure it, or construct EncodeCostModel(..., interpolation='voxels')"
            )
        return self._voxel_fit(key[0] * key[1] * key[2])

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
        (``warmup`` runs, then the median of ``repeats``). With ``torch.distributed`` initialized,
        every rank of ``group`` must call this, and the tables are merged by max."""
        if repeats < 1 or warmup < 0:
            raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
        device = torch.device(device)
        generator = torch.Generator().manual_seed(seed)
        table: dict[Shape, float] = {}
        for shape in sorted({_shape_key(*s) for s in shapes}):
            clip = (torch.rand((channels, *shape), generator=generator) * 2 - 1).to(device=device, dtype=dtype)
            for _ in range(warmup):
                encode_fn(clip)
            runs = []
            for _ in range(repeats):
                _synchronize(device)
                start = time.perf_counter()
                encode_fn(clip)
                _synchronize(device)
                runs.append(time.perf_counter() - start)
            table[shape] = statistics.median(runs)
        model = cls(table, interpolation=interpolation)
        if dist.is_available() and dist.is_initialized():
            model = model.merged_across_ranks(group=group, device=device)
        return model

    def merged_across_ranks(self, *, group: dist.ProcessGroup | None = None, device: torch.device | str = "cpu") -> EncodeCostModel:
        """Every rank of ``group`` calls this; all get the union of shapes, each at its max seconds."""
        device = torch.device(device)
        count = torch.tensor([len(self.seconds_by_shape)], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
        rows = torch.full((int(count.item()), 4), -1.0, dtype=torch.float64, device=device)
        for row, (shape, seconds) in enumerate(sorted(self.seconds_by_shape.items())):
            rows[row] = torch.tensor([*shape, seconds], dtype=torch.float64)
        gathered = [torch.empty_like(rows) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, rows, group=group)
        merged: dict[Shape, float] = {}
        for t, h, w, seconds in torch.cat(gathered).cpu().tolist():
            if seconds >= 0:
                key = (int(t), int(h), int(w))
                merged[key] = max(merged.get(key, 0.0), seconds)
        return EncodeCostModel(merged, interpolation=self.interpolation)

    def __repr__(self) -> str:
        return f"EncodeCostModel({len(self.seconds_by_shape)} shapes, interpolation={self.interpolation!r})"
