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

A cache in object storage maps sparse local copies of the two tables (see
:mod:`latentfast.cache.remote.files`): a block's bytes are there only once fetched, so the block
check first asks the storage to make the block's byte ranges local (``storage.local``: one round
trip for every block a batch needs; a local cache's storage is None, nothing to do) and only then
checks its CRC. Every read of the tables goes through that check (the read path's) or through
:meth:`ItemBlocks.check_all` (whoever wants the whole table: the reader's ``row_starts``, ``widths``
and ``shapes`` of such a cache call it first), so no byte that was not fetched is ever read: a
block of zeros would fail its CRC and its row checks anyway (shapes are positive). A block that
fails is fetched again (``storage.refetch``) before it is refused, naming the objects and byte ranges.
"""
from __future__ import annotations

import zlib

import numpy as np

from ...errors import CacheCorruptError, InvalidArgumentError
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


def table_ranges(array: np.ndarray, r0: np.ndarray, r1: np.ndarray):
    """``(byte starts, byte ends)`` in its file of rows ``[r0, r1)`` of a table mapped from a ``.npy``
    (its header first), or None for a table read whole into memory (nothing more to fetch)."""
    if not isinstance(array, np.memmap):
        return None
    row = array.strides[0] if array.ndim else array.itemsize
    return array.offset + np.asarray(r0, np.int64) * row, array.offset + np.asarray(r1, np.int64) * row


class ItemBlocks:
    """One opened cache's shapes and offsets blocks, and which of them this process has checked.
    ``storage``: None (a local cache), or what makes byte ranges of a sparse copy local (see the module)."""

    def __init__(self, cache_dir: str, split: str, meta: dict, shapes: np.ndarray, offsets: np.ndarray, storage=None):
        self.cache_dir, self.split, self.meta, self.storage = cache_dir, split, meta, storage
        self.shapes, self.offsets, self.n = shapes, offsets, len(shapes)
        self.units_per_element = fmt.LATENT_DTYPES[meta.get("dtype", "float16")] // fmt.UNIT_BYTES
        entry = meta["index_blocks"]
        self.block_items = entry.get("block_items") if isinstance(entry, dict) else None
        if not isinstance(self.block_items, int) or isinstance(self.block_items, bool) or self.block_items < 1:
            raise CacheCorruptError(f"latent cache meta {fmt.cache_path(cache_dir, split, 'meta')}: index_blocks must be "
                                    f"{{'block_items': a positive integer}}, got {entry!r}")
        self._crcs: np.ndarray | None = None
        self._checked = np.zeros(0, dtype=bool)
        self._units: np.ndarray | None = None

    def __getstate__(self) -> dict:  # each process checks for itself
        return {**self.__dict__, "_crcs": None, "_checked": np.zeros(0, dtype=bool), "_units": None}

    def unit_counts(self) -> np.ndarray:
        """int32 ``[N]``: each item's size in 2-byte units (what the batch gather copies), filled in as
        its block is checked (zero until then: a batch's items are checked before it is gathered).
        Untouched pages of it are never allocated, so it costs what the blocks read so far cost."""
        if self._units is None:
            self._units = np.zeros(self.n, dtype=np.int32)
            for b in np.flatnonzero(self._checked).tolist():
                self._fill_units(b * self.block_items, min(self.n, (b + 1) * self.block_items))
        return self._units

    def _fill_units(self, r0: int, r1: int) -> None:
        units = np.diff(self.offsets[r0: r1 + 1]) * self.units_per_element
        if units.size and units.max() > np.iinfo(np.int32).max:
            raise CacheCorruptError(f"latent cache {self.cache_dir}: item {r0 + int(np.argmax(units))} has {int(units.max()) * 2} "
                                    f"bytes, too large for the batch gather (int32 widths of 2-byte units)")
        self._units[r0:r1] = units

    def _requests(self, blocks: np.ndarray) -> list:
        """``(path, byte starts, byte ends)`` of the shapes and offsets rows of ``blocks`` (what the storage
        makes local), or nothing for tables held in memory."""
        r0 = blocks * self.block_items
        r1 = np.minimum(self.n, r0 + self.block_items)
        found = []
        for kind, table, end in (("shapes", self.shapes, r1), ("offsets", self.offsets, r1 + 1)):
            ranges = table_ranges(table, r0, end)
            if ranges is not None:
                found.append((fmt.cache_path(self.cache_dir, self.split, kind), *ranges))
        return found

    def _sums(self) -> np.ndarray:
        if self._crcs is None:
            path = fmt.cache_path(self.cache_dir, self.split, CRC_KIND)
            if self.storage is not None:
                self.storage.local([(path, None, None)])
            crcs = fmt.load_npy(path, "index checksums")
            blocks = -(-self.n // self.block_items)
            if crcs.shape != (blocks,) or crcs.dtype != np.uint32:
                raise CacheCorruptError(f"latent cache index checksums {path} must be uint32 [{blocks}], got {crcs.dtype} {list(crcs.shape)}")
            fmt.check_recorded(self.cache_dir, self.split, self.meta, (CRC_KIND,))
            self._crcs, self._checked = crcs, np.zeros(blocks, dtype=bool)
        return self._crcs

    def check(self, index) -> None:
        """Check every block holding items ``index`` (ints in range) not checked yet in this process
        (a cache in object storage: all of them fetched at once first)."""
        sums = self._sums()
        blocks = np.unique(np.asarray(index, dtype=np.int64) // self.block_items)
        todo = blocks[~self._checked[blocks]]
        if self.storage is not None and len(todo):
            self.storage.local(self._requests(todo))
        for b in todo.tolist():
            r0, r1 = b * self.block_items, min(self.n, (b + 1) * self.block_items)
            spath, opath = (fmt.cache_path(self.cache_dir, self.split, k) for k in ("shapes", "offsets"))
            if _block_crc(self.shapes, self.offsets, r0, r1) != int(sums[b]) and not self._fetched_again(b, sums):
                where = [self.storage.where(p, int(s[0]), int(e[0])) for p, s, e in self._requests(np.asarray([b]))] \
                    if self.storage is not None else []
                where = where or [spath, opath]  # (a local cache, or tables read whole)
                raise CacheCorruptError(f"latent cache index {' / '.join(where)}: block {b} (items {r0}..{r1 - 1}) fails its "
                                        f"CRC-32 checksum; rerun the build to repair it")
            check_rows(self.shapes[r0:r1], self.offsets[r0: r1 + 1], r0, int(self.meta["channels"]), spath, opath)
            self._checked[b] = True
            if self._units is not None:
                self._fill_units(r0, r1)

    def _fetched_again(self, b: int, sums: np.ndarray) -> bool:
        """Whether block ``b`` of a cache in object storage passes its CRC once fetched again (bytes damaged
        on the way, or on the local disk); a local cache's block is what it is."""
        if self.storage is None:
            return False
        r0, r1 = b * self.block_items, min(self.n, (b + 1) * self.block_items)
        for _ in range(2):
            self.storage.refetch(self._requests(np.asarray([b])))
            if _block_crc(self.shapes, self.offsets, r0, r1) == int(sums[b]):
                return True
        return False

    def check_all(self) -> None:
        """Check every block (what reading all shapes, a sampler over them, or ``verify`` needs)."""
        self._sums()
        self.check(np.flatnonzero(~self._checked) * self.block_items)

    def item_at(self, unit: int) -> int:
        """The item whose elements hold element offset ``unit`` (in ``[0, offsets[-1])``), checking the
        blocks it needs: those next to blocks already checked (a fetched chunk's neighbours of a batch)."""
        while True:
            checked = np.flatnonzero(self._checked)
            firsts = self.offsets[np.minimum(checked * self.block_items, self.n)]
            k = int(np.searchsorted(firsts, unit, side="right")) - 1
            if k < 0:  # before the first checked block: check the one before it
                self.check([(int(checked[0]) - 1) * self.block_items] if len(checked) else [0])
                continue
            b = int(checked[k])
            r0, r1 = b * self.block_items, min(self.n, (b + 1) * self.block_items)
            if unit < int(self.offsets[r1]):
                return r0 + int(np.searchsorted(self.offsets[r0: r1 + 1], unit, side="right")) - 1
            if r1 == self.n:
                raise InvalidArgumentError(f"element {unit} lies past the end of latent cache {self.cache_dir} ({int(self.offsets[r1])} elements)")
            self.check([r1])  # past this block: the next one
