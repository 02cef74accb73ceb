"""The writer's working tables: per-item columns in files and a file-backed hash of key hashes.

:class:`~latentfast.cache.LatentCacheWriter` keeps nothing per item in Python objects: each item's
shape, CRC-32, source hash, info and key go to a :class:`Column` (rows appended to a file in the
writer's build folder ``.{split}.latents.building``, staged in memory up to :data:`STAGE_BYTES`),
and its key's 64-bit hash to a :class:`HashSlots` table (a mapped file), which finds the items whose
key hash equals a new key's (the writer then compares their key bytes). So the writer's memory is
the same at 10^3 and 10^9 items; the tables' pages are the page cache's.

The tables are derived, never the truth: the progress log is. A writer that resumes an interrupted
build rebuilds them from the log, and one that finishes reads them back into the index files.
"""
from __future__ import annotations

import mmap
import os

import numpy as np

from .durable import pwrite_all

STAGE_BYTES = 1 << 20  # a column's rows held in memory before one write: ~1 write per 40,000 tiny items


class Column:
    """Rows of ``dtype`` (``width`` values each; ``width`` 0: a flat run of bytes or values) appended
    to the file at ``path`` (created empty), read back from it."""

    def __init__(self, path: str, dtype, width: int = 0):
        self.path, self.dtype, self.width = path, np.dtype(dtype), width
        self.row_bytes = self.dtype.itemsize * max(1, width)
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.rows = 0  # rows appended (in the file or staged)
        self._stage = bytearray()
        self._written = 0  # bytes in the file

    def append(self, rows, count: int) -> None:
        """Append ``count`` rows given as their bytes (a bytes-like object or a C-contiguous array)."""
        self._stage += rows if rows.__class__ is bytes else memoryview(rows).cast("B")  # (not `+= array`: numpy would broadcast)
        self.rows += count
        if len(self._stage) >= STAGE_BYTES:
            self.write_out()

    def write_out(self) -> None:
        """Write the staged rows to the file (what a read or a sync of the file needs first)."""
        if self._stage:
            pwrite_all(self.fd, self._stage, self._written)
            self._written += len(self._stage)
            self._stage = bytearray()

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Rows ``[lo, hi)`` (a ``[hi - lo, width]`` array, or flat for ``width`` 0)."""
        start = lo * self.row_bytes - self._written
        if start >= 0:  # rows still staged (a recent row, e.g. a field value just stored): no write, no read
            raw = bytes(self._stage[start: start + (hi - lo) * self.row_bytes])
        else:
            self.write_out()
            raw = os.pread(self.fd, (hi - lo) * self.row_bytes, lo * self.row_bytes)
        if len(raw) != (hi - lo) * self.row_bytes:
            raise OSError(f"writer table {self.path}: rows {lo}..{hi} read short (the file was changed under the writer?)")
        array = np.frombuffer(raw, dtype=self.dtype)
        return array.reshape(-1, self.width) if self.width else array

    def chunks(self, rows: int):
        """``(lo, rows [lo, lo + rows))`` over the whole column, in order."""
        for lo in range(0, self.rows, rows):
            yield lo, self.read(lo, min(self.rows, lo + rows))

    def truncate(self, rows: int) -> None:
        """Keep the first ``rows`` rows only."""
        self.write_out()
        os.ftruncate(self.fd, rows * self.row_bytes)
        self.rows, self._written = rows, rows * self.row_bytes

    def sync(self) -> None:
        """The rows durable in the file (a column renamed into the finished cache: the key bytes)."""
        self.write_out()
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class HashSlots:
    """An open-addressing table (linear probing, at most half full) of ``uint64`` hashes, each with
    an item, in a mapped file: ``find`` gives the items stored under a hash (several, in a true
    64-bit collision), ``add`` stores new ones; it doubles (rebuilt into a new file) as it fills."""

    def __init__(self, path: str, slots: int = 1 << 16):
        self.path, self.count = path, 0
        self._map(path, slots)

    def _map(self, path: str, slots: int) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, 16 * slots)  # sparse: zeros (empty slots) cost no disk until written
            self._mm = mmap.mmap(fd, 16 * slots)
        finally:
            os.close(fd)
        table = np.frombuffer(self._mm, dtype=np.uint64).reshape(2, slots)
        self.hashes, self.items = table[0], table[1]  # items: item + 1 (0: an empty slot)
        self.mask = slots - 1

    def find(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(which, items)``: for each stored item whose hash equals ``hashes[which]``, that position and the item."""
        hashes = np.asarray(hashes, dtype=np.uint64)
        which, found = [], []
        active = np.arange(len(hashes))
        slot = hashes & np.uint64(self.mask)
        while active.size:
            stored = self.items[slot]
            full = stored != 0
            hit = full & (self.hashes[slot] == hashes[active])
            if hit.any():
                which.append(active[hit])
                found.append(stored[hit].astype(np.int64) - 1)
            active, slot = active[full], (slot[full] + np.uint64(1)) & np.uint64(self.mask)
        if not which:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(which), np.concatenate(found)

    def find_one(self, h: int) -> list[int]:
        """The items stored under hash ``h`` (the one-key path of :meth:`find`)."""
        found, slot = [], h & self.mask
        while stored := int(self.items[slot]):
            if int(self.hashes[slot]) == h:
                found.append(stored - 1)
            slot = (slot + 1) & self.mask
        return found

    def add_one(self, h: int, item: int) -> None:
        """Store ``item`` under hash ``h`` (the one-key path of :meth:`add`)."""
        if 2 * (self.count + 1) > self.mask + 1:
            self._grow(self.count + 1)
        slot = h & self.mask
        while self.items[slot]:
            slot = (slot + 1) & self.mask
        self.hashes[slot], self.items[slot] = h, item + 1
        self.count += 1

    def add(self, hashes: np.ndarray, items: np.ndarray) -> None:
        """Store ``items`` (int64) under ``hashes`` (uint64), growing the table first if it would be over half full."""
        hashes, items = np.asarray(hashes, dtype=np.uint64), np.asarray(items, dtype=np.uint64) + np.uint64(1)
        if 2 * (self.count + len(hashes)) > self.mask + 1:
            self._grow(self.count + len(hashes))
        self._place(hashes, items)
        self.count += len(hashes)

    def _place(self, hashes: np.ndarray, items: np.ndarray) -> None:
        mask = np.uint64(self.mask)
        slot = hashes & mask
        pending = np.arange(len(hashes))
        while pending.size:
            free = self.items[slot] == 0
            # of the pending entries that found a free slot, the first to name each slot takes it
            taken, first = np.unique(slot[free], return_index=True)
            winners = np.flatnonzero(free)[first]
            self.hashes[taken], self.items[taken] = hashes[pending[winners]], items[pending[winners]]
            lost = np.ones(len(pending), dtype=bool)
            lost[winners] = False
            pending, slot = pending[lost], (slot[lost] + np.uint64(1)) & mask

    def _grow(self, needed: int) -> None:
        slots = self.mask + 1
        while 2 * needed > slots:
            slots *= 2
        self._rebuild(slots)

    def retain(self, below: int) -> None:
        """Forget every entry whose item is ``below`` or more (what a cut of the items keeps)."""
        self._rebuild(self.mask + 1, below)

    def _rebuild(self, slots: int, below: int | None = None) -> None:
        """The entries (of items under ``below``, if given) placed again in a new file of ``slots`` slots."""
        old_mm, old_hashes, old_items = self._mm, self.hashes, self.items
        self._map(self.path + ".new", slots)
        self.count = 0
        for lo in range(0, len(old_items), 1 << 20):  # (in steps: the rehash's temporaries stay small)
            stored = old_items[lo: lo + (1 << 20)]
            full = np.flatnonzero(stored if below is None else (stored != 0) & (stored <= np.uint64(below)))  # (stored: item + 1)
            self._place(old_hashes[lo: lo + (1 << 20)][full], stored[full])
            self.count += len(full)
        del old_hashes, old_items, stored  # (the old map closes only once no array views it)
        old_mm.close()
        os.replace(self.path + ".new", self.path)

    def clear(self) -> None:
        """Forget every entry (the table shrinks back to its first size)."""
        self.close()
        self._map(self.path, 1 << 16)
        self.count = 0

    def close(self) -> None:
        if self._mm is not None:
            self.hashes = self.items = None
            self._mm.close()
            self._mm = None
