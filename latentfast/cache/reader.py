"""Open, read, inspect and verify a latent cache (see :mod:`latentfast.cache.format`)."""
from __future__ import annotations

import operator
import os
import time
import warnings
import zlib
from typing import Any

import numpy as np
import torch

from ..errors import CacheCorruptError, IncompleteCacheError
from . import format as fmt


class LatentCache:
    """Read-only, worker-safe view of a built latent cache.

    ``cache[i]`` is a float16 ``[C, h, w_i]`` copy. ``expected`` (a dict of meta fields, e.g.
    from :func:`latentfast.cache.cache_meta_for`) that disagrees with the cache raises
    ``ValueError`` naming every differing field. ``white_column`` (``[C, h, 1]``) serves caches
    that store none. The data file is memory-mapped lazily in each process; pickling carries
    paths, meta and the small index arrays only.
    """

    def __init__(self, cache_dir: str | os.PathLike, split: str = "train", expected: Any = None, white_column: Any = None):
        self.cache_dir = os.fspath(cache_dir)
        self.split = split
        meta_path = fmt.cache_path(self.cache_dir, split, "meta")
        if not os.path.exists(meta_path):
            if fmt.build_in_progress(self.cache_dir, split):
                raise IncompleteCacheError(
                    f"latent cache {self.cache_dir} (split {split!r}) is incomplete: its build was interrupted "
                    f"before writing {meta_path}. Re-run the same `latentfast cache build` command to resume it."
                )
            raise FileNotFoundError(f"latent cache meta {meta_path} does not exist (no cache for split {split!r} in {self.cache_dir})")
        meta = fmt.read_meta(meta_path)
        if "format_version" in meta and meta.get("complete") is not True:
            raise IncompleteCacheError(
                f"latent cache {meta_path} has no completion mark: the build did not finish. "
                f"Re-run the same `latentfast cache build` command to resume it."
            )
        if expected is not None:
            diffs = fmt.stamp_differences(meta, expected)
            if diffs:
                lines = "\n".join(f"  {k}: cache has {have!r}, expected {want!r}" for k, have, want in diffs)
                raise ValueError(
                    f"latent cache {meta_path} was built for a different encoder/geometry:\n{lines}\n"
                    f"Rebuild it with: {fmt.rebuild_command(self.cache_dir, split, meta, expected)}"
                )
        self.meta = meta
        self._data_path = fmt.cache_path(self.cache_dir, split, "data")
        self._load_index()
        self.white_column = self._resolve_white(white_column)
        self._mm: np.ndarray | None = None
        self._data: torch.Tensor | None = None
        self._set_geometry()

    def _set_geometry(self) -> None:
        """Plain ints for the per-row hot path."""
        self._row_shape = (self.channels, self.latent_h, self.w_max)
        self._line_elements = self.channels * self.latent_h
        self._row_elements = self._line_elements * self.w_max

    # -- opening and validation -------------------------------------------------------------
    def _load_index(self) -> None:
        m = self.meta
        n, C, h, w_max = m["n"], m["channels"], m["latent_h"], m["w_max"]
        widths = _load_npy(fmt.cache_path(self.cache_dir, self.split, "widths"), "widths")
        wpath = fmt.cache_path(self.cache_dir, self.split, "widths")
        if widths.ndim != 1 or not np.issubdtype(widths.dtype, np.integer):
            raise ValueError(f"latent cache widths {wpath} must be a 1-D integer array, got {widths.dtype} {widths.shape}")
        if len(widths) != n:
            raise ValueError(f"latent cache widths {wpath} has {len(widths)} rows but the meta says n={n}")
        if n and (widths.min() < 1 or widths.max() > w_max):
            bad = int(np.flatnonzero((widths < 1) | (widths > w_max))[0])
            raise ValueError(f"latent cache widths {wpath}: row {bad} has width {int(widths[bad])}, outside [1, w_max={w_max}]")
        self.widths = widths.astype(np.int32, copy=False)
        if self.layout == "ragged":
            opath = fmt.cache_path(self.cache_dir, self.split, "offsets")
            offsets = _load_npy(opath, "offsets")
            if offsets.shape != (n + 1,):
                raise ValueError(f"latent cache offsets {opath} must have n + 1 = {n + 1} entries, got shape {offsets.shape}")
            self.row_starts = self._row_starts_from_widths()
            if not np.array_equal(offsets, self.row_starts):
                raise ValueError(f"latent cache offsets {opath} disagree with the widths (row i must span C*h*w_i elements, back to back)")
        else:
            self.row_starts = self._row_starts_from_widths()
        expected_bytes = int(self.row_starts[-1]) * 2
        try:
            actual = os.path.getsize(self._data_path)
        except OSError:
            raise FileNotFoundError(f"latent cache data file {self._data_path} does not exist") from None
        if actual != expected_bytes:
            what = "shorter" if actual < expected_bytes else "longer"
            raise ValueError(
                f"latent cache data file {self._data_path} is {what} than the meta implies: "
                f"expected {expected_bytes} bytes ({self.layout} layout, n={n}, C={C}, h={h}, w_max={w_max}), found {actual}"
            )

    def _resolve_white(self, given: Any) -> torch.Tensor | None:
        shape = (self.channels, self.latent_h, 1)
        path = fmt.cache_path(self.cache_dir, self.split, "white")
        stored = None
        if os.path.exists(path):
            stored = _load_npy(path, "white column")
            if stored.shape != shape:
                raise ValueError(f"latent cache white column {path} must have shape {list(shape)}, got {list(stored.shape)}")
            stored = torch.from_numpy(stored.astype(np.float16))
        if given is None:
            return stored
        given = torch.as_tensor(given).detach().to("cpu", torch.float16)
        if tuple(given.shape) != shape:
            raise ValueError(f"white_column must have shape [C, h, 1] = {list(shape)}, got {list(given.shape)}")
        if stored is not None and not torch.equal(stored, given):
            raise ValueError(f"white_column disagrees with the one stored in {path}; omit the argument to use the stored one")
        return given.contiguous()

    # -- geometry ---------------------------------------------------------------------------
    @property
    def layout(self) -> str:
        return self.meta.get("layout", "padded")

    @property
    def channels(self) -> int:
        return int(self.meta["channels"])

    @property
    def latent_h(self) -> int:
        return int(self.meta["latent_h"])

    @property
    def w_max(self) -> int:
        return int(self.meta["w_max"])

    def __len__(self) -> int:
        return int(self.meta["n"])

    def __repr__(self) -> str:
        return f"LatentCache({self.cache_dir!r}, split={self.split!r}, n={len(self)}, layout={self.layout!r}, C={self.channels}, h={self.latent_h}, w_max={self.w_max})"

    # -- data access ------------------------------------------------------------------------
    def _memmap(self) -> np.ndarray:
        """The whole data file as a flat read-only float16 array, opened once per process."""
        if self._mm is None:
            if self.row_starts[-1] == 0:
                self._mm = np.zeros(0, dtype=np.float16)
            else:
                mm = np.memmap(self._data_path, dtype=np.float16, mode="r", shape=(int(self.row_starts[-1]),))
                self._mm = mm.view(np.ndarray)  # plain-array slicing is cheaper; the view keeps the map open
        return self._mm

    def __getitem__(self, i: int) -> torch.Tensor:
        n = self.meta["n"]
        i = operator.index(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"latent cache index {i} out of range for {n} rows")
        w = int(self.widths[i])
        start = int(self.row_starts[i])
        data = self._mm if self._mm is not None else self._memmap()
        if self.meta.get("layout") == "ragged":
            row = data[start : start + self._line_elements * w].reshape(self._row_shape[0], self._row_shape[1], w)
        else:
            row = data[start : start + self._row_elements].reshape(self._row_shape)[:, :, :w]
        return torch.from_numpy(row.copy())  # a copy: never hand out a view of the map

    def gather_source(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``(data, row_offsets, widths, pitch)`` for batch gathers.

        ``data`` is a 1-D float16 tensor over the whole (read-only) data file; row i's line
        ``(c, y)`` starts at element ``row_offsets[i] + (c * h + y) * pitch_i``, where
        ``pitch_i`` is ``pitch`` (w_max) for the padded layout and the row's own width when
        ``pitch`` is 0 (ragged). Never write through ``data``."""
        if self._data is None:
            with warnings.catch_warnings():  # torch warns that the memmap is not writable
                warnings.simplefilter("ignore", UserWarning)
                self._data = torch.from_numpy(self._memmap())
            self._row_offsets = torch.from_numpy(np.ascontiguousarray(self.row_starts[:-1]))
            self._widths_t = torch.from_numpy(np.ascontiguousarray(self.widths))
        pitch = self.w_max if self.layout == "padded" else 0
        return self._data, self._row_offsets, self._widths_t, pitch

    def read_batch(self, indices, **kwargs):
        from .decode import read_batch

        return read_batch(self, indices, **kwargs)

    def prefetch(self, indices) -> None:
        """Start reading rows ``indices`` into the page cache and return at once (see :mod:`.prefetch`)."""
        from .prefetch import prefetch

        prefetch(self, indices)

    # -- pickling: paths, meta and the small index only -------------------------------------
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for key in ("_mm", "_data", "_row_offsets", "_widths_t", "row_starts"):
            state.pop(key, None)  # row_starts: recomputed from the widths (validated equal on open)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.row_starts = self._row_starts_from_widths()
        self._mm = None
        self._data = None
        self._set_geometry()

    def _row_starts_from_widths(self) -> np.ndarray:
        if self.layout == "ragged":
            return fmt.ragged_offsets(self.widths, self.channels, self.latent_h)
        return np.arange(len(self) + 1, dtype=np.int64) * fmt.row_elements(self.meta)


def _load_npy(path: str, what: str) -> np.ndarray:
    try:
        return np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise FileNotFoundError(f"latent cache {what} file {path} does not exist") from None
    except ValueError as exc:
        raise ValueError(f"latent cache {what} file {path} is not a valid .npy array: {exc}") from None


def verify_cache(cache_dir: str | os.PathLike, split: str = "train") -> dict:
    """Recompute every block checksum, check every value is finite and every width valid.

    Raises :class:`CacheCorruptError` naming the first bad block or row; returns
    ``{"rows", "bytes", "blocks", "checksummed", "seconds", "gb_per_s"}``."""
    start = time.perf_counter()
    cache = LatentCache(cache_dir, split)  # validates sizes, widths and offsets
    data = cache._memmap()
    n = len(cache)
    checksum = cache.meta.get("checksum")
    sums = None
    if checksum is not None:
        if checksum.get("algorithm") != fmt.CHECKSUM_ALGORITHM:
            raise CacheCorruptError(f"latent cache {cache_dir}: unknown checksum algorithm {checksum.get('algorithm')!r}")
        block_rows = int(checksum["block_rows"])
        spath = fmt.cache_path(cache_dir, split, "checksums")
        sums = _load_npy(spath, "checksums")
        blocks = -(-n // block_rows)
        if sums.shape != (blocks,):
            raise CacheCorruptError(f"latent cache checksums {spath} must hold {blocks} entries, got shape {sums.shape}")
    else:
        block_rows = fmt.block_row_count(cache.meta)
    scratch = np.empty(int(max(1, block_rows * fmt.row_elements(cache.meta))), dtype=np.uint16)
    for b, r0, r1, e0, e1 in fmt.block_bounds(cache.row_starts, n, block_rows):
        block = data[e0:e1]
        if sums is not None and zlib.crc32(block) != int(sums[b]):
            raise CacheCorruptError(f"latent cache {cache._data_path}: block {b} (rows {r0}..{r1 - 1}) fails its CRC-32 checksum")
        bad = fmt.first_nonfinite(block, scratch)
        if bad >= 0:
            row = int(np.searchsorted(cache.row_starts, e0 + bad, side="right")) - 1
            raise CacheCorruptError(f"latent cache {cache._data_path}: row {row} (block {b}) holds a non-finite value")
    if cache.white_column is not None and not torch.isfinite(cache.white_column.float()).all():
        raise CacheCorruptError(f"latent cache {cache_dir}: the white column holds a non-finite value")
    seconds = time.perf_counter() - start
    nbytes = int(cache.row_starts[-1]) * 2
    return {
        "rows": n,
        "bytes": nbytes,
        "blocks": -(-n // block_rows),
        "checksummed": sums is not None,
        "seconds": seconds,
        "gb_per_s": nbytes / seconds / 1e9 if seconds > 0 else float("inf"),
    }


def inspect_cache(cache_dir: str | os.PathLike, split: str = "train", bins: int = 10) -> dict:
    """Meta, row count, bytes on disk, padding waste and a latent-width histogram."""
    cache = LatentCache(cache_dir, split)
    files = {}
    for kind in ("data", "widths", "meta", "offsets", "white", "checksums"):
        path = fmt.cache_path(cache_dir, split, kind)
        if os.path.exists(path):
            files[os.path.basename(path)] = os.path.getsize(path)
    real = int(cache.widths.sum(dtype=np.int64)) * cache.channels * cache.latent_h * 2
    padded = len(cache) * fmt.row_elements(cache.meta) * 2
    data_bytes = int(cache.row_starts[-1]) * 2
    from .prefetch import resident_bytes

    edges = np.unique(np.linspace(1, cache.w_max + 1, min(bins, cache.w_max) + 1).astype(np.int64))
    counts, _ = np.histogram(cache.widths, bins=edges)
    return {
        "meta": cache.meta,
        "n": len(cache),
        "layout": cache.layout,
        "files": files,
        "bytes_on_disk": sum(files.values()),
        "data_bytes": data_bytes,
        "resident_bytes": resident_bytes(cache._data_path),  # in the page cache now (None: the OS cannot say)
        "padding_waste_pct": 100.0 * (data_bytes - real) / data_bytes if data_bytes else 0.0,
        "padded_layout_bytes": padded,
        "histogram": [(int(lo), int(hi) - 1, int(c)) for lo, hi, c in zip(edges[:-1], edges[1:], counts)],  # inclusive bounds
    }
