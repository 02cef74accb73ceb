"""The writer's working tables: per-item columns in files and a bounded table of key hashes.

:class:`~latentfast.cache.LatentCacheWriter` keeps nothing per item in Python objects: each item's
shape, CRC-32, source hash, info and key go to a :class:`Column` (rows appended to a file in the
writer's build folder ``.{split}.latents.building``, staged in memory up to :data:`STAGE_BYTES`),
and its key's 64-bit hash to a :class:`HashRuns` table (a bounded table in memory, then sorted run
files), which finds the items whose key hash equals a new key's (the writer then compares their key
bytes). So the writer's memory is the same at 10^3 and 10^9 items (but for the runs' small fences);
the tables' pages are the page cache's, and every file is written front to back (issue 33: a hash
table in a mapped file, written at random, had the kernel's writeback throttle the writer past 3*10^7).

The tables are derived, never the truth: the progress log is. A writer that resumes an interrupted
build rebuilds them from the log, and one that finishes reads them back into the index files.
"""
from __future__ import annotations

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


class _Slots:
    """An in-memory open-addressing table (linear probing, at most half full) of ``uint64`` hashes,
    each with an item: the newest entries of a :class:`HashRuns`."""

    def __init__(self, slots: int):
        self.hashes, self.items = np.zeros(slots, np.uint64), np.zeros(slots, np.uint64)  # items: item + 1 (0: empty)
        self.mask, self.count = slots - 1, 0

    def find(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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
        return which, found

    def find_one(self, h: int) -> list[int]:
        found, slot = [], h & self.mask
        while stored := int(self.items[slot]):
            if int(self.hashes[slot]) == h:
                found.append(stored - 1)
            slot = (slot + 1) & self.mask
        return found

    def add_one(self, h: int, item: int) -> None:
        slot = h & self.mask
        while self.items[slot]:
            slot = (slot + 1) & self.mask
        self.hashes[slot], self.items[slot] = h, item + 1
        self.count += 1

    def add(self, hashes: np.ndarray, stored: np.ndarray) -> None:
        """Place ``hashes`` with ``stored`` (item + 1 each); the caller keeps the table at most half full."""
        mask = np.uint64(self.mask)
        slot = hashes & mask
        pending = np.arange(len(hashes))
        while pending.size:
            free = self.items[slot] == 0
            # of the pending entries that found a free slot, the first to name each slot takes it
            taken, first = np.unique(slot[free], return_index=True)
            winners = np.flatnonzero(free)[first]
            self.hashes[taken], self.items[taken] = hashes[pending[winners]], stored[pending[winners]]
            lost = np.ones(len(pending), dtype=bool)
            lost[winners] = False
            pending, slot = pending[lost], (slot[lost] + np.uint64(1)) & mask
        self.count += len(hashes)

    def entries(self, below: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(hashes, stored)`` of every entry (of items under ``below``, if given)."""
        full = self.items != 0 if below is None else (self.items != 0) & (self.items <= np.uint64(below))  # (stored: item + 1)
        return self.hashes[full], self.items[full]


class _Run:
    """Entries sorted by hash in a file written once, front to back: 16-byte records ``(hash, item + 1)``,
    read through a read-only map; ``fence`` holds every ``stride``-th hash (in memory), so a lookup
    reads one stretch of ``stride`` records (one page at the default 256)."""

    def __init__(self, path: str, count: int, top_item: int, stride: int, fence: np.ndarray):
        self.path, self.count, self.top_item, self.stride, self.fence = path, count, top_item, stride, fence
        # a read-only map (clean pages the kernel may drop), as a plain array (a memmap's per-call costs are numpy's slowest)
        self.records = np.asarray(np.memmap(path, dtype=np.uint64, mode="r", shape=(count, 2)))

    def find(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(which, items)`` of the entries equal to ``hashes[which]``."""
        keys = self.records[:, 0]
        block = np.maximum(np.searchsorted(self.fence, hashes, side="left") - 1, 0)
        # the first record >= the hash lies in (block * stride, (block + 1) * stride]: a binary search there
        lo, hi = block * self.stride, np.minimum((block + 1) * self.stride, self.count)
        while (open_ := lo < hi).any():
            mid = np.minimum((lo + hi) >> 1, self.count - 1)
            below = open_ & (keys[mid] < hashes)
            lo, hi = np.where(below, mid + 1, lo), np.where(open_ & ~below, mid, hi)
        which, found = [], []
        active = np.arange(len(hashes))
        while active.size:  # the equal records from there on (several only in a true 64-bit collision)
            active, lo = active[lo < self.count], lo[lo < self.count]
            hit = keys[lo] == hashes[active]
            active, lo = active[hit], lo[hit]
            which.append(active)
            found.append(self.records[lo, 1].astype(np.int64) - 1)
            lo = lo + 1
        return which, found

    def find_one(self, h: int) -> list[int]:
        """The items of the records equal to ``h`` (:meth:`find` of one hash, without numpy's per-call costs)."""
        h = np.uint64(h)  # (once: numpy converts a Python int above 2^63 slowly at every call)
        lo = max(int(self.fence.searchsorted(h)) - 1, 0) * self.stride
        stretch = self.records[lo: lo + self.stride + 1]
        at = int(stretch[:, 0].searchsorted(h))
        found = []
        while at < len(stretch) and stretch[at, 0] == h:
            found.append(int(stretch[at, 1]) - 1)
            at += 1
        if at == len(stretch) and found:  # (equal records past the stretch: a true 64-bit collision)
            at += lo
            while at < self.count and self.records[at, 0] == h:
                found.append(int(self.records[at, 1]) - 1)
                at += 1
        return found


class HashRuns:
    """The items stored under ``uint64`` hashes, in bounded memory and with sequential writes: ``find``
    gives the items stored under a hash (several, in a true 64-bit collision), ``add`` stores new ones.

    The newest entries live in an in-memory open-addressing table of ``memory_slots`` slots (16 bytes
    each, allocated at once: the memory held is the same from the first item on); when half of them are
    used, its entries go, sorted by hash, to a new run
    file ``{path}.run{n}`` (one sequential write), and the two newest runs are merged into one while the
    older is no larger than the newer (a binary counter: about log2(N / (memory_slots / 2)) runs), by a
    two-way merge streamed ``chunk`` records at a time. A lookup probes the table, then each run's fence
    and one stretch of it. So the memory is bounded (the table, a merge's chunks and each run's fence
    of at most ``fence_max`` hashes), whatever the count, and no page of a file is written twice."""

    def __init__(self, path: str, memory_slots: int = 1 << 18, chunk: int = 1 << 17, stride: int = 256,
                 fence_max: int = 1 << 16):
        self.path, self.memory_slots, self.chunk, self.stride, self.fence_max = path, memory_slots, chunk, stride, fence_max
        self._made = 0  # run files named so far
        self._runs: list[_Run] = []
        self._remove_stale()
        self._table = _Slots(memory_slots)
        self.count = 0

    def _remove_stale(self) -> None:
        """Delete run files of an earlier writer (derived data: the caller rebuilds them from its log)."""
        folder, name = os.path.split(self.path)
        for entry in os.listdir(folder or "."):
            if entry.startswith(name + ".run") and entry[len(name) + 4:].isdigit():
                os.unlink(os.path.join(folder, entry))

    def find(self, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(which, items)``: for each stored item whose hash equals ``hashes[which]``, that position and the item."""
        hashes = np.asarray(hashes, dtype=np.uint64)
        which, found = self._table.find(hashes)
        for run in self._runs:
            w, f = run.find(hashes)
            which += w
            found += f
        if not which:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(which).astype(np.int64), np.concatenate(found)

    def find_one(self, h: int) -> list[int]:
        """The items stored under hash ``h`` (the one-key path of :meth:`find`)."""
        found = self._table.find_one(h)
        for run in self._runs:
            found += run.find_one(h)
        return found

    def add_one(self, h: int, item: int) -> None:
        """Store ``item`` under hash ``h`` (the one-key path of :meth:`add`)."""
        self._table.add_one(h, item)
        self.count += 1
        self._flush_if_full()

    def add(self, hashes: np.ndarray, items: np.ndarray) -> None:
        """Store ``items`` (int64) under ``hashes`` (uint64)."""
        hashes, stored = np.asarray(hashes, dtype=np.uint64), np.asarray(items, dtype=np.uint64) + np.uint64(1)
        lo = 0
        while lo < len(hashes):  # (in pieces that fill the table exactly: every run but a retained one is as long)
            hi = min(len(hashes), lo + self.memory_slots // 2 - self._table.count)
            self._table.add(hashes[lo:hi], stored[lo:hi])
            self.count += hi - lo
            self._flush_if_full()
            lo = hi

    def _flush_if_full(self) -> None:
        """A full table written out as a run, then runs merged while the older is no larger than the newer."""
        if 2 * self._table.count < self.memory_slots:
            return
        hashes, stored = self._table.entries()
        order = np.argsort(hashes, kind="stable")
        self._table = _Slots(self.memory_slots)
        self._runs.append(self._write_run([np.stack([hashes[order], stored[order]], axis=1)], len(order)))
        while len(self._runs) >= 2 and self._runs[-2].count <= self._runs[-1].count:
            older, newer = self._runs[-2:]
            self._runs[-2:] = [self._write_run(self._merged(older, newer), older.count + newer.count)]
            self._drop(older, newer)

    def _merged(self, a: _Run, b: _Run):
        """The records of runs ``a`` and ``b`` in hash order (``a``'s first among equal hashes), ``chunk`` at a time."""
        ia = ib = 0
        while ia < a.count or ib < b.count:
            ca, cb = np.array(a.records[ia: ia + self.chunk]), np.array(b.records[ib: ib + self.chunk])
            if not len(ca) or not len(cb):
                yield ca if len(ca) else cb
                ia, ib = ia + len(ca), ib + len(cb)
                continue
            # every record up to the smaller of the two chunks' last hashes is in hand: merge those
            cut = min(ca[-1, 0], cb[-1, 0])
            na, nb = int(np.searchsorted(ca[:, 0], cut, side="right")), int(np.searchsorted(cb[:, 0], cut, side="right"))
            both = np.concatenate([ca[:na], cb[:nb]])
            yield both[np.argsort(both[:, 0], kind="stable")]
            ia, ib = ia + na, ib + nb

    def _write_run(self, pieces, most: int) -> _Run | None:
        """A new run file of the records in ``pieces`` (sorted, at most ``most`` in all), written front to
        back; None if there were none."""
        stride = self.stride
        while most > stride * self.fence_max:
            stride *= 2
        path = f"{self.path}.run{self._made}"
        self._made += 1
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        count, top, fence = 0, 0, []
        try:
            for piece in pieces:
                if len(piece):
                    pwrite_all(fd, np.ascontiguousarray(piece), 16 * count)
                    fence.append(piece[-count % stride:: stride, 0].copy())  # (every stride-th record of the run)
                    count += len(piece)
                    top = max(top, int(piece[:, 1].max()) - 1)
        finally:
            os.close(fd)
        if not count:
            os.unlink(path)
            return None
        return _Run(path, count, top, stride, np.concatenate(fence))

    def _drop(self, *runs: _Run) -> None:
        for run in runs:
            run.records = run.fence = None  # (unmapped once no array views it)
            os.unlink(run.path)

    def retain(self, below: int) -> None:
        """Forget every entry whose item is ``below`` or more (what a cut of the items keeps)."""
        hashes, stored = self._table.entries(below)
        self._table = _Slots(self.memory_slots)
        self._table.add(hashes, stored)
        runs, self._runs = self._runs, []
        for run in runs:
            if run.top_item < below:
                self._runs.append(run)
                continue
            kept = (piece[piece[:, 1] <= np.uint64(below)] for piece in
                    (np.array(run.records[lo: lo + self.chunk]) for lo in range(0, run.count, self.chunk)))
            if (new := self._write_run(kept, run.count)) is not None:
                self._runs.append(new)
            self._drop(run)
        self.count = self._table.count + sum(run.count for run in self._runs)

    def memory_bytes(self) -> int:
        """Bytes of memory the table and the runs' fences hold (the runs' records are the page cache's)."""
        return self._table.hashes.nbytes + self._table.items.nbytes + sum(run.fence.nbytes for run in self._runs)

    def clear(self) -> None:
        """Forget every entry."""
        self._drop(*self._runs)
        self._runs = []
        self._table = _Slots(self.memory_slots)
        self.count = 0

    def close(self) -> None:
        """Forget every entry and delete the run files (of no use without the table's entries)."""
        self.clear()
