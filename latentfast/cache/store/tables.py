"""A shaped cache's per-item index (shapes and offsets), mapped and checked a block of items at a time.

The writer's finish step writes ``{split}.latents.index.crc32.npy`` (uint32, one CRC-32 per block of
``block_items`` items: of the block's rows of the shapes file, then its offsets ``[r0, r1]``) and the meta
entry ``index_blocks: {"block_items": ...}``. A reader of such a cache maps the two tables and checks only
their last block when it opens (its end offset sizes the data file: the cost is the same at 10^3 and 10^9
items); :class:`ItemBlocks` checks
each block the first time an item of it is read (a batch, ``cache[i]``, a prefetch), in each process:
its CRC, then that its shapes have the meta's channels and positive sizes and its offsets advance by
each item's size. A damaged block raises :class:`CacheCorruptError` before any item of it is read.
Caches without the entry (older ones) are checked whole when they open, by the same
:func:`check_rows`.
"""
from __future__ import annotations

import zlib

import numpy as np

from ...errors import CacheCorruptError
from . import format as fmt

BLOCK_ITEMS = 8192  # items per checked block: ~200 KiB of shapes and offsets, ~100 us to check
CRC_KIND = "index_crc32"


def check_rows(shapes: np.ndarray, offsets: np.ndarray, first: int, channels: int, spath: str, opath: str) -> None:
    """Check items ``first ..`` (``shapes`` their rows, ``offsets`` their offsets and the next one's):
    positive sizes, ``channels`` channels, at most :data:`format.MAX_ROW_ELEMENTS` elements, each offset
    the previous plus the item's size. :class:`CacheCorruptError` names the file and the first bad item."""
    sizes, exact = np.ones(len(shapes)), np.ones(len(shapes), dtype=np.int64)
    for k in range(shapes.shape[1]):  # (columns multiplied: numpy's prod along a short axis is ~20x slower)
        sizes *= shapes[:, k]
        exact *= shapes[:, k]
    if len(shapes) and (shapes.min() < 1 or np.any(shapes[:, 0] != channels) or sizes.max() > fmt.MAX_ROW_ELEMENTS):
        bad = (shapes.min(axis=1) < 1) | (shapes[:, 0] != channels) | (sizes > fmt.MAX_ROW_ELEMENTS)
        item = int(np.flatnonzero(bad)[0])
        raise CacheCorruptError(f"latent cache shapes {spath}: item {first + item} has shape {shapes[item].tolist()} "
                                f"(needs positive sizes and channels={channels})")
    if not np.array_equal(np.diff(offsets), exact):
        raise CacheCorruptError(f"latent cache offsets {opath} disagree with the shapes (item i must span prod(shapes[i]) "
                                f"elements, back to back)")


def _block_crc(shapes: np.ndarray, offsets: np.ndarray, r0: int, r1: int) -> int:
    return zlib.crc32(np.ascontiguousarray(offsets[r0: r1 + 1]), zlib.crc32(np.ascontiguousarray(shapes[r0:r1])))


def index_files(shapes: np.ndarray, offsets: np.ndarray) -> tuple[bytes, dict]:
    """``(the CRC file's bytes, meta entry)`` of int64 ``shapes [N, ndim]`` and ``offsets [N + 1]``."""
    n = len(shapes)
    crcs = [_block_crc(shapes, offsets, r0, min(n, r0 + BLOCK_ITEMS)) for r0 in range(0, n, BLOCK_ITEMS)]
    return fmt.npy_bytes(np.asarray(crcs, dtype=np.uint32)), {"block_items": BLOCK_ITEMS}


class ItemBlocks:
    """One opened cache's shapes and offsets blocks, and which of them this process has checked."""

    def __init__(self, cache_dir: str, split: str, meta: dict, shapes: np.ndarray, offsets: np.ndarray):
        self.cache_dir, self.split, self.meta = cache_dir, split, meta
        self.shapes, self.offsets, self.n = shapes, offsets, len(shapes)
        entry = meta["index_blocks"]
        self.block_items = entry.get("block_items") if isinstance(entry, dict) else None
        if not isinstance(self.block_items, int) or isinstance(self.block_items, bool) or self.block_items < 1:
            raise CacheCorruptError(f"latent cache meta {fmt.cache_path(cache_dir, split, 'meta')}: index_blocks must be "
                                    f"{{'block_items': a positive integer}}, got {entry!r}")
        self._crcs: np.ndarray | None = None
        self._checked = np.zeros(0, dtype=bool)

    def __getstate__(self) -> dict:  # each process checks for itself
        return {**self.__dict__, "_crcs": None, "_checked": np.zeros(0, dtype=bool)}

    def _sums(self) -> np.ndarray:
        if self._crcs is None:
            path = fmt.cache_path(self.cache_dir, self.split, CRC_KIND)
            crcs = fmt.load_npy(path, "index checksums")
            blocks = -(-self.n // self.block_items)
            if crcs.shape != (blocks,) or crcs.dtype != np.uint32:
                raise CacheCorruptError(f"latent cache index checksums {path} must be uint32 [{blocks}], got {crcs.dtype} {list(crcs.shape)}")
            fmt.check_recorded(self.cache_dir, self.split, self.meta, (CRC_KIND,))
            self._crcs, self._checked = crcs, np.zeros(blocks, dtype=bool)
        return self._crcs

    def check(self, index) -> None:
        """Check every block holding items ``index`` (ints in range) not checked yet in this process."""
        sums = self._sums()
        blocks = np.unique(np.asarray(index, dtype=np.int64) // self.block_items)
        for b in blocks[~self._checked[blocks]].tolist():
            r0, r1 = b * self.block_items, min(self.n, (b + 1) * self.block_items)
            spath, opath = (fmt.cache_path(self.cache_dir, self.split, k) for k in ("shapes", "offsets"))
            if _block_crc(self.shapes, self.offsets, r0, r1) != int(sums[b]):
                raise CacheCorruptError(f"latent cache index {spath} / {opath}: block {b} (items {r0}..{r1 - 1}) fails its "
                                        f"CRC-32 checksum; rerun the build to repair it")
            check_rows(self.shapes[r0:r1], self.offsets[r0: r1 + 1], r0, int(self.meta["channels"]), spath, opath)
            self._checked[b] = True

    def check_all(self) -> None:
        """Check every block (what reading all shapes, a sampler over them, or ``verify`` needs)."""
        self._sums()
        for b in np.flatnonzero(~self._checked).tolist():
            self.check([b * self.block_items])
