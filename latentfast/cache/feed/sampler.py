"""Batch samplers over a latent cache: batches of rows of similar width (line caches) or of one shape
(aspect buckets, video sizes), seeded, sharded by rank with the same number of batches on every rank,
resumable mid-epoch (also at another world size), optionally drawn from a window of a few chunks of
the data file at a time (remote storage: each chunk fetched about once per epoch), and able to show
the next batches to a reader that reads ahead; and :class:`LookaheadSampler`, which has the next
batches' rows read into the page cache while the loop runs.

At scale (10^8-10^9 items) a sampler keeps one small integer per item (its bucket's id, its chunk's id,
its width's rank, each in the smallest unsigned dtype that holds them), never ``[N, ndim]`` shapes: a
shapes table (a cache's is mapped) is read :data:`PLAN_BLOCK` rows at a time. An epoch's plan is
arrays (:class:`Batches`: the items in batch order, int32 below 2^31 items, and each batch's bounds),
not a list per batch, computed with numpy a block at a time; its order is the one the list-building
code of before gave for the same seed (the same generator calls, in the same order), so a state saved
by any earlier version resumes exactly. The passes that touch every item at random (the shuffle, the
grouping by (bucket, window), the sort of each part by width) run in the native library where it is
built (``csrc/cpu/plan_epoch.cpp``: numpy's draws and results, its memory reads prefetched; at 10^8
items numpy's wait for one cache miss per item), else in numpy: the same plan either way."""
from __future__ import annotations

import collections
import math
import operator
import zlib
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler

from ...backends import native
from ...checks import as_int
from ...errors import ArgumentTypeError, InvalidArgumentError
from ..store.format import CHUNK_BYTES
from ..store.layout import ELEMENT_BYTES
from . import coldread
from .coldread import DEFAULT_LOOKAHEAD


SAMPLER_CHUNK_BYTES = 64 * CHUNK_BYTES  # 1 MiB: 64 of the local chunk cache's chunks, several items of any usual size
PLAN_BLOCK = 1 << 20  # items (or shape rows) handled at once while planning: temporaries of a few MiB whatever N
GROUP_RUNS = 4096  # up to this many keys, a block's items of each key are moved as one slice
TABLE_KEYS = 1 << 24  # shape keys ranked by a lookup table up to this many (~80 MiB), else by a sorted list
# the native library's planning passes (csrc/cpu/plan_epoch.cpp), or None: numpy's, the reference
# (the same plan either way; without the library, or with this set to None, as tests do)
NATIVE = native if native.LIB is not None else None


def item_chunks(cache, chunk_bytes: int = SAMPLER_CHUNK_BYTES) -> np.ndarray:
    """Each item's chunk of its data file, for the samplers' ``chunks=``: int64 ``[N]``, item ``i`` in
    chunk ``(byte offset of its first byte) // chunk_bytes``.

    ``cache``: a :class:`~latentfast.cache.LatentCache` (its latent data file: a records cache's other
    fields live in files of their own, in the same item order and smaller, so the latents' offsets
    stand for the record), or int byte offsets ``[N]`` of each item's first byte in one file.
    An item that runs past its chunk's end belongs to the chunk where it starts; reading it brings
    the first bytes of the next chunk with it, so at most one local chunk (16 KiB) per chunk boundary
    may be fetched twice in an epoch. ``chunk_bytes``: the unit of locality, best a multiple of the
    local chunk cache's (:data:`~latentfast.cache.remote.chunks.CHUNK_BYTES`) holding several items
    (a chunk smaller than an item makes each item a chunk of its own)."""
    chunk_bytes = as_int("chunk_bytes", chunk_bytes, minimum=1)
    if hasattr(cache, "shard_chunks"):  # a sharded cache: each shard's file cut apart (store/shards.py)
        return cache.shard_chunks(chunk_bytes)
    if hasattr(cache, "row_starts"):
        starts, unit, n = cache.row_starts, ELEMENT_BYTES, len(cache.row_starts) - 1
    else:
        starts = np.asarray(cache)
        if starts.ndim != 1 or (starts.size and starts.dtype.kind not in "iu"):
            raise InvalidArgumentError(f"item_chunks takes a LatentCache or int byte offsets [N], got {starts.dtype} {list(starts.shape)}")
        if starts.size and starts.min() < 0:
            raise InvalidArgumentError(f"item byte offsets must be >= 0, got {int(starts.min())}")
        unit, n = 1, len(starts)
    chunks = np.empty(n, dtype=np.int64)
    for r0 in range(0, n, PLAN_BLOCK):  # (a block at a time: the mapped offsets are never copied whole)
        chunks[r0 : r0 + PLAN_BLOCK] = np.asarray(starts[r0 : min(n, r0 + PLAN_BLOCK)], dtype=np.int64) * unit // chunk_bytes
    return chunks


class Batches(Sequence):
    """An epoch's batches held as arrays, not as a list of lists (Python ints cost ~36 bytes an item;
    this, the bytes of ``items``' dtype): batch ``k`` is ``items[starts[k]:ends[k]]``. Indexing gives
    a batch as a list of ints, slicing a list of them, iteration every batch in order; it compares
    equal to a list of the same batches. ``nbytes``: the bytes of its arrays."""

    def __init__(self, items: np.ndarray, starts: np.ndarray, ends: np.ndarray):
        self.items, self.starts, self.ends = items, starts, ends

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self._batch(j) for j in range(*k.indices(len(self)))]
        k = operator.index(k)
        k = k + len(self) if k < 0 else k
        if not 0 <= k < len(self):
            raise IndexError(f"batch {k} out of range: the plan has {len(self)} batches")
        return self._batch(k)

    def _batch(self, k: int) -> list[int]:
        return self.items[self.starts[k] : self.ends[k]].tolist()

    def __iter__(self) -> Iterator[list[int]]:
        for first in range(0, len(self), 4096):  # (bounds as Python ints a few thousand at a time)
            for start, end in zip(self.starts[first : first + 4096].tolist(), self.ends[first : first + 4096].tolist()):
                yield self.items[start:end].tolist()

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(mine == list(theirs) for mine, theirs in zip(self, other))

    __hash__ = None

    def __repr__(self) -> str:
        return f"Batches({len(self)} batches of {int((self.ends - self.starts).sum())} items)"

    def select(self, index) -> Batches:
        """The batches ``index`` (int positions), in that order (the items are shared, not copied)."""
        return Batches(self.items, self.starts[index], self.ends[index])

    @property
    def nbytes(self) -> int:
        return self.items.nbytes + self.starts.nbytes + self.ends.nbytes


class ShardedBatchSampler(Sampler[list[int]]):
    """What both samplers share: a subclass says how an epoch's batches are made (``_plan``, from a
    generator seeded by ``(seed, epoch)``) and how many there are (``_total_batches``); this class shards them.

    The epoch's batches are one global list (:meth:`epoch_batches`), the same at any world size. From the global position
    ``p`` where the pass starts (0, or where a resumed run left off), rank ``r`` of ``world_size``
    takes batches ``p + r, p + r + world_size, ...``; every rank gets the same number of batches:
    with ``drop_last`` the batches that do not divide evenly are dropped, without it the epoch's
    first batches are repeated to fill the last round (so every item is seen at least once per
    epoch). Call :meth:`set_epoch` before each epoch (as with ``DistributedSampler``).

    ``state_dict()`` records the epoch and the global ``position`` (batches handed out across all
    ranks: ranks step together, so any rank's state serves; pass ``consumed``, what the training
    loop really used, when a DataLoader prefetches); ``load_state_dict()`` continues from exactly
    there, at this world size or another: the remaining batches of the epoch, none twice, none lost
    (a state without ``position``, from before, is read as ``consumed * world_size``).
    :meth:`upcoming` lets a reader look ahead (:class:`LookaheadSampler`) without consuming anything.

    ``chunks`` (int ``[N]``, each item's chunk of the data file, see :func:`item_chunks`) with
    ``chunk_window=K``: chunk-aware shuffling for remote storage. Each epoch the chunks are taken in
    a seeded random order, ``K`` at a time; a window's items are shuffled and batched the
    subclass's way (buckets as without chunks), and the window's batches shuffled; a bucket's items
    left over from one window (fewer than a batch) open its first batch in the next, so the batches
    and their count are those of a full shuffle: every item once per epoch, the same short batches
    and ``drop_last``. A rank then reads about ``K`` chunks at a time, each chunk in one stretch of
    the epoch, so a local chunk cache that holds a few windows (leftovers reach one window on)
    fetches each chunk about once per epoch per node; the price is that a batch mixes items of
    ``K`` chunks, not of the whole cache (``latentfast/bench/bench_sampler.py`` measures both). Choose ``K``
    so a window holds a batch of each bucket: a bucket with fewer items per window waits for later
    windows, and the chunks its batches come from may be fetched again. The order is the same at
    any world size, so every node reads from every chunk of a window (not a share of the chunks).
    The sampler keeps each item's chunk as a dense id in the smallest dtype that holds them.

    Memory: :attr:`nbytes` is what the sampler keeps per item (a few bytes an item: ids in small
    dtypes); an epoch's plan adds its items (4 bytes each below 2^31 items) and 16 bytes per batch,
    for as long as the epoch is iterated.
    """

    def __init__(self, n_items: int, batch_size: int, *, seed: int, rank: int, world_size: int, drop_last: bool,
                 chunks=None, chunk_window: int | None = None):
        values = {name: as_int(name, value, minimum=low) for name, value, low in (
            ("batch_size", batch_size, 1), ("world_size", world_size, 1), ("rank", rank, 0), ("seed", seed, 0))}
        if values["rank"] >= values["world_size"]:
            raise InvalidArgumentError(f"rank must be < world_size={values['world_size']}, got {values['rank']}")
        self.batch_size, self.seed = values["batch_size"], values["seed"]
        self.rank, self.world_size = values["rank"], values["world_size"]
        self.drop_last = bool(drop_last)
        self.n_items = int(n_items)
        self.epoch = 0
        self.start = 0  # global position (batches of the epoch, all ranks) where this pass began
        self.consumed = 0  # batches this rank handed out since ``start``
        self._epoch_batches: Batches | None = None  # this rank's batches of the epoch being iterated
        self._set_chunks(chunks, chunk_window)

    def _set_chunks(self, chunks, chunk_window) -> None:
        self.chunk_window = self._chunk_fingerprint = self._chunk_of = None
        if chunks is None:
            if chunk_window is not None:
                raise InvalidArgumentError(f"chunk_window={chunk_window!r} needs chunks= (each item's chunk, see item_chunks)")
            return
        if chunk_window is None:
            raise InvalidArgumentError("chunks= needs chunk_window=K: how many chunks a window of the epoch draws from")
        self.chunk_window = as_int("chunk_window", chunk_window, minimum=1)
        ids = np.asarray(chunks)
        if ids.ndim != 1 or len(ids) != self.n_items:
            raise InvalidArgumentError(f"chunks must be one chunk id per item ({self.n_items}), got shape {list(ids.shape)}")
        if ids.size and ids.dtype.kind not in "iu":
            raise ArgumentTypeError(f"chunks must be integers, got {ids.dtype}")
        crc = 0  # of the ids as int64 bytes, a block at a time: a resumed run must window the same chunks
        for r0 in range(0, len(ids), PLAN_BLOCK):
            crc = zlib.crc32(np.ascontiguousarray(ids[r0 : r0 + PLAN_BLOCK], dtype=np.int64), crc)
        self._chunk_fingerprint = crc
        self._chunk_of = _bucket_ids(ids)  # dense 0..n_chunks-1, in file order
        self._n_chunks = _id_count(self._chunk_of)

    @property
    def nbytes(self) -> int:
        """Bytes of the per-item arrays this sampler keeps (its ids; not the caller's arrays, not a plan)."""
        return sum(a.nbytes for a in self._per_item_arrays())

    def _per_item_arrays(self) -> list[np.ndarray]:
        return [] if self._chunk_of is None else [self._chunk_of]

    def _stream(self, rng: np.random.Generator, buckets: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(items, window_of_chunk)``: every item, grouped by window of ``chunk_window`` chunks (windows
        in the epoch's random chunk order), in random order within a window; with ``buckets``, grouped
        by bucket first. ``window_of_chunk``: each chunk's window."""
        rank_of_chunk = np.empty(self._n_chunks, dtype=np.int64)
        rank_of_chunk[_permutation(rng, self._n_chunks)] = np.arange(self._n_chunks)
        window_of_chunk = rank_of_chunk // self.chunk_window
        windows = int(window_of_chunk.max(initial=0)) + 1
        bound = windows * (1 if buckets is None else _id_count(buckets))

        def keys_of(r0: int) -> np.ndarray:  # items r0.. 's groups, (bucket, window) as one int, made in item order
            key = window_of_chunk[self._chunk_of[r0 : r0 + PLAN_BLOCK]]
            return key if buckets is None else buckets[r0 : r0 + PLAN_BLOCK] * np.int64(windows) + key

        if NATIVE is not None and self.n_items <= 2**32 and bound <= 2**32:
            return _shuffled_groups(rng, self.n_items, keys_of, bound), window_of_chunk
        shuffled = np.arange(self.n_items, dtype=_index_dtype(self.n_items))
        _shuffle(rng, shuffled)  # the draws (and the order) of rng.permutation(n_items), in 4 bytes an item
        keys = np.empty(self.n_items, dtype=_id_dtype(bound))
        for r0 in range(0, self.n_items, PLAN_BLOCK):
            keys[r0 : r0 + PLAN_BLOCK] = keys_of(r0)
        return _group(keys, bound, shuffled), window_of_chunk

    @staticmethod
    def _in_window_order(batch_windows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The order of batches: by window, shuffled within each: ``np.lexsort((rng.permutation(len(batch_windows)),
        batch_windows))``, as the batches in the order of their draw grouped stably by window (a counting sort)."""
        tie = _permutation(rng, len(batch_windows))
        by_tie = np.empty_like(tie)
        by_tie[tie] = np.arange(len(tie))
        return _group(batch_windows, int(batch_windows.max(initial=0)) + 1, by_tie)

    def _plan(self, rng: np.random.Generator) -> Batches:
        raise NotImplementedError

    def _total_batches(self) -> int:
        raise NotImplementedError

    def epoch_batches(self) -> Batches:
        """Every batch of the current epoch in order, all ranks' (the same at any world size)."""
        return self._plan(np.random.default_rng([self.seed, self.epoch]))

    def rank_batches(self) -> Batches:
        """This rank's batches of the current epoch from the position the pass began at, in order
        (ignoring what was consumed since): a :class:`Batches` (a sequence of lists of ints)."""
        batches = self.epoch_batches()
        rest = np.arange(min(self.start, len(batches)), len(batches))
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % self.world_size]
        elif len(rest):  # the last round filled with the epoch's first batches
            rest = np.concatenate([rest, np.arange(-len(rest) % self.world_size) % len(batches)])
        return batches.select(rest[self.rank :: self.world_size])

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._epoch_batches = self.rank_batches()
        start = self.consumed
        for position in range(start, len(batches)):
            self.consumed = position + 1
            yield batches[position]
        self.start = self.consumed = 0  # a finished epoch: the next iteration starts the epoch over
        self._epoch_batches = None

    def upcoming(self, count: int) -> list[list[int]]:
        """The next ``count`` (or fewer, at the epoch's end) batches the iteration will hand out,
        without handing them out (``consumed`` is unchanged)."""
        count = as_int("count", count, minimum=0)
        if self._epoch_batches is None:
            self._epoch_batches = self.rank_batches()
        return self._epoch_batches[self.consumed : self.consumed + count]

    def __len__(self) -> int:
        total = self._total_batches()
        return total // self.world_size if self.drop_last else -(-total // self.world_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = as_int("epoch", epoch, minimum=0)
        self.start = self.consumed = 0
        self._epoch_batches = None

    def state_dict(self, consumed: int | None = None) -> dict:
        """``consumed``: batches this rank's training loop really used since the pass began; pass it
        when a DataLoader prefetches (the sampler has then handed out more batches than were consumed)."""
        consumed = self.consumed if consumed is None else as_int("consumed", consumed, minimum=0)
        return {"seed": self.seed, "epoch": self.epoch, "position": self.start + consumed * self.world_size,
                "consumed": consumed, "rank": self.rank, "world_size": self.world_size, "batch_size": self.batch_size,
                "drop_last": self.drop_last, "items": self.n_items, "chunk_window": self.chunk_window,
                "chunks_crc32": self._chunk_fingerprint}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("seed", "batch_size", "drop_last", "items", "chunk_window", "chunks_crc32"):
            if key in state and state[key] != mine[key]:
                raise InvalidArgumentError(f"state_dict was saved with {key}={state[key]}, this sampler has {mine[key]}")
        for key in ("epoch", "consumed"):
            if key not in state:
                raise InvalidArgumentError(f"state_dict has no {key!r}: not a sampler's state_dict (keys {sorted(state)})")
        position = state.get("position")
        if position is None:  # saved before positions were recorded: ranks stepped together
            position = int(state["consumed"]) * int(state.get("world_size", self.world_size))
        self.epoch, self.start, self.consumed = int(state["epoch"]), as_int("position", position, minimum=0), 0
        self._epoch_batches = None


class WidthBucketBatchSampler(ShardedBatchSampler):
    """Batches of rows of similar width (line caches; see :class:`ShardedBatchSampler` for sharding,
    epochs, resuming and ``chunks``/``chunk_window``).

    Each epoch: a seeded permutation of all rows is cut into chunks of ``batch_size *
    bucket_batches`` rows; each chunk is sorted by width (so its batches are narrow or wide
    together, cutting padding) and cut into batches; the batch order is then shuffled, a short last
    batch kept last (or dropped with ``drop_last``). With ``chunks``, the same within each window of
    chunks (a window's rows left over from whole batches open the next window's first batch).
    The sampler keeps each row's width rank (among the distinct widths) in the smallest dtype.
    """

    def __init__(self, widths: Sequence[int] | np.ndarray, batch_size: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, drop_last: bool = False, bucket_batches: int = 64, chunks=None,
                 chunk_window: int | None = None):
        self.widths = np.asarray(widths)
        if self.widths.ndim != 1:
            raise InvalidArgumentError(f"widths must be 1-D (one per row), got shape {self.widths.shape}")
        if self.widths.size and self.widths.dtype.kind not in "iu":
            raise ArgumentTypeError(f"widths must be integers, got {self.widths.dtype}")
        super().__init__(len(self.widths), batch_size, seed=seed, rank=rank, world_size=world_size, drop_last=drop_last,
                         chunks=chunks, chunk_window=chunk_window)
        self.bucket_batches = as_int("bucket_batches", bucket_batches, minimum=1)
        self._width_rank = _bucket_ids(self.widths)  # sorting by it is sorting by width (ties kept in order)
        self._widths_count = _id_count(self._width_rank)

    def _per_item_arrays(self) -> list[np.ndarray]:
        return [self._width_rank, *super()._per_item_arrays()]

    def _plan(self, rng: np.random.Generator) -> Batches:
        if self.chunk_window is not None:
            return self._windowed_plan(rng)
        n, bs = self.n_items, self.batch_size
        items = np.arange(n, dtype=_index_dtype(n))
        _shuffle(rng, items)  # rng.permutation(n)'s draws and order
        part = bs * self.bucket_batches
        _sort_segments(items, np.append(np.arange(0, n, part), n), self._width_rank, self._widths_count)
        whole = n // bs * bs  # (only the very last batch can be short: the parts are whole batches)
        # shuffle the order of the whole batches, a short one kept last so drop_last-free shards stay full-sized
        starts = _permutation(rng, whole // bs) * bs
        if whole < n and not self.drop_last:
            starts = np.append(starts, whole)
        return Batches(items, starts, np.minimum(starts + bs, n))

    def _windowed_plan(self, rng: np.random.Generator) -> Batches:
        # the rows in window order; window w's pool is its rows plus the rows the windows before left
        # over from whole batches: stream positions up to the last whole batch its rows reach
        items, window_of_chunk = self._stream(rng)
        bs, n = self.batch_size, self.n_items
        rows_per_window = np.bincount(window_of_chunk, weights=_counts(self._chunk_of, self._n_chunks),
                                      minlength=int(window_of_chunk.max(initial=0)) + 1).astype(np.int64)
        pool_ends = np.cumsum(rows_per_window) // bs * bs
        pool_starts = np.concatenate([[0], pool_ends[:-1]])
        whole = int(pool_ends[-1])
        # each pool cut into parts of bs * bucket_batches rows, each part sorted by width
        part = bs * self.bucket_batches
        parts = -(-(pool_ends - pool_starts) // part)
        firsts = np.repeat(pool_starts, parts) + (np.arange(parts.sum()) - np.repeat(np.cumsum(parts) - parts, parts)) * part
        _sort_segments(items, np.append(firsts, whole), self._width_rank, self._widths_count)
        starts = self._in_window_order(np.searchsorted(pool_ends, np.arange(0, whole, bs), side="right"), rng) * bs
        if whole < n and not self.drop_last:  # the short batch, last, sorted by width
            tail = items[whole:]
            items[whole:] = tail[_stable_order(self._width_rank[tail], self._widths_count)]
            starts = np.append(starts, whole)
        return Batches(items, starts, np.minimum(starts + bs, n))

    def _total_batches(self) -> int:
        return self.n_items // self.batch_size if self.drop_last else -(-self.n_items // self.batch_size)


class _BucketedSampler(ShardedBatchSampler):
    """What the shape-bucket and in-order samplers share: one bucket id per item (``buckets``, the
    smallest unsigned dtype holding them) and the bucket sizes."""

    def __init__(self, buckets, batch_size: int, **kwargs):
        self.buckets = _bucket_ids(buckets)
        super().__init__(len(self.buckets), batch_size, **kwargs)
        self._sizes = _counts(self.buckets, _id_count(self.buckets))

    def _per_item_arrays(self) -> list[np.ndarray]:
        return [self.buckets, *super()._per_item_arrays()]

    def _grouped(self) -> np.ndarray:
        """Every item, bucket after bucket, ascending within each: ``np.argsort(buckets, kind="stable")``,
        in 4 bytes an item (below 2^31 items), a block at a time."""
        return _group(self.buckets, len(self._sizes))

    @property
    def _members(self) -> list[np.ndarray]:
        """Each bucket's items, ascending (made when asked: the sampler keeps only the bucket ids)."""
        return np.split(self._grouped(), np.cumsum(self._sizes)[:-1]) if len(self._sizes) else []

    def _bucket_bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """``(starts, ends)`` of each bucket's batches in the grouped order (bucket after bucket, each cut
        from its first item into batches of ``batch_size``, its last short, or dropped with ``drop_last``)."""
        sizes, bs = self._sizes, self.batch_size
        firsts = np.cumsum(sizes) - sizes
        per = -(-(sizes - sizes % bs if self.drop_last else sizes) // bs)
        starts = np.repeat(firsts, per) + (np.arange(per.sum()) - np.repeat(np.cumsum(per) - per, per)) * bs
        return starts, np.minimum(starts + bs, np.repeat(firsts + sizes, per))

    def _total_batches(self) -> int:
        if self.drop_last:
            return int((self._sizes // self.batch_size).sum())
        return int((-(-self._sizes // self.batch_size)).sum())


class ShapeBucketBatchSampler(_BucketedSampler):
    """Batches of item indices of one shape (see :class:`ShardedBatchSampler` for sharding, epochs,
    resuming and ``chunks``/``chunk_window``).

    ``shapes``: int ``[N, ndim]`` (e.g. ``LatentCache.shapes``, a mapped table: read a block of rows at
    a time, never copied whole), or one hashable bucket label per item. The sampler keeps one bucket
    id per item (``buckets``: the rank of its shape among the distinct shapes, lexicographic, in the
    smallest unsigned dtype). Each epoch, with a generator seeded by ``(seed, epoch)``: every bucket's items are
    shuffled and cut into batches of ``batch_size`` (a bucket's last batch may be smaller, or is
    dropped with ``drop_last``); then the batches of all buckets are shuffled together, so buckets
    are seen in proportion to their size. With ``chunks``, the same within each window of chunks: a
    bucket's items left over from whole batches open its first batch in the next window, and its
    last short batch comes in the last window.
    """

    def __init__(self, shapes, batch_size: int, *, seed: int = 0, rank: int = 0, world_size: int = 1,
                 drop_last: bool = False, chunks=None, chunk_window: int | None = None):
        super().__init__(shapes, batch_size, seed=seed, rank=rank, world_size=world_size, drop_last=drop_last,
                         chunks=chunks, chunk_window=chunk_window)

    def _plan(self, rng: np.random.Generator) -> Batches:
        if self.chunk_window is not None:
            return self._windowed_plan(rng)
        items = self._grouped()
        first = 0
        for size in self._sizes.tolist():  # (a loop per bucket, not per item)
            _shuffle(rng, items[first : first + size])  # in place: the draws and order of members[rng.permutation(size)]
            first += size
        starts, ends = self._bucket_bounds()
        order = _permutation(rng, len(starts))
        return Batches(items, starts[order], ends[order])

    def _windowed_plan(self, rng: np.random.Generator) -> Batches:
        # each bucket's items in window order, cut into batches in that order: a bucket's items left
        # over from one window open its next batch; a batch belongs to the window of its last item
        items, window_of_chunk = self._stream(rng, self.buckets)
        starts, ends = self._bucket_bounds()
        last_window = int(window_of_chunk.max(initial=0))
        ends_window = window_of_chunk[self._chunk_of[items[ends - 1]]]
        batch_windows = np.where(ends - starts == self.batch_size, ends_window, last_window)  # short ones: the last window
        order = self._in_window_order(batch_windows, rng)
        return Batches(items, starts[order], ends[order])


class InOrderBatchSampler(_BucketedSampler):
    """Batches in item order, unshuffled (see :class:`ShardedBatchSampler` for sharding, epochs and
    resuming): each bucket's items (``buckets``: one label per item, or int shapes ``[N, ndim]``)
    ascending, cut into batches of ``batch_size`` (a bucket's last may be short, or dropped with
    ``drop_last``), the batches ordered by their first item. The same every epoch."""

    def __init__(self, buckets, batch_size: int, *, rank: int = 0, world_size: int = 1, drop_last: bool = False):
        super().__init__(buckets, batch_size, seed=0, rank=rank, world_size=world_size, drop_last=drop_last)

    def _plan(self, rng: np.random.Generator) -> Batches:
        items = self._grouped()
        starts, ends = self._bucket_bounds()
        order = np.argsort(items[starts])  # (first items are distinct)
        return Batches(items, starts[order], ends[order])


# ---- planning a block at a time --------------------------------------------------------------
def _index_dtype(n: int) -> type:
    """The dtype of item numbers of a plan of ``n`` items: int32 (4 bytes an item) below 2^31, else int64."""
    return np.int32 if n < 2**31 else np.int64


def _shuffle(rng: np.random.Generator, items: np.ndarray) -> None:
    """``rng.shuffle(items)`` (int32/int64, contiguous), in place: the same draws and order from the native
    kernel, which prefetches the items it will swap (at 10^8 items numpy's waits for one miss per item)."""
    if NATIVE is None:
        rng.shuffle(items)
    else:
        NATIVE.shuffle_like_numpy(rng, torch.from_numpy(items))


def _as_signed(ids: np.ndarray) -> np.ndarray:
    """Unsigned ids as a tensor-able view (torch has no uint16-64 the kernels take; they read them back as unsigned)."""
    return ids if ids.dtype == np.uint8 else ids.view(f"i{ids.itemsize}")


def _permutation(rng: np.random.Generator, n: int) -> np.ndarray:
    """``rng.permutation(n)``: its draws and result (numpy's shuffles ``np.arange(n)``)."""
    items = np.arange(n)
    _shuffle(rng, items)
    return items


def _shuffled_groups(rng: np.random.Generator, n: int, keys_of, bound: int) -> np.ndarray:
    """``_group(keys, bound, rng.permutation(n))`` by the native passes (``keys_of(r0)``: the keys, below
    2^32, of items ``r0 .. r0 + PLAN_BLOCK``; n <= 2^32): each item packed with its key in one uint64,
    shuffled together (the same draws, so the same order), then placed by key, read in order: no gather
    of keys at random. 8 bytes an item while planning, as the 4-byte shuffle and 4-byte keys it replaces."""
    packed, counts = np.empty(n, dtype=np.int64), np.zeros(bound, dtype=np.int64)
    for r0 in range(0, n, PLAN_BLOCK):
        NATIVE.pack_keys(torch.from_numpy(keys_of(r0).astype(np.int64, copy=False)), r0,
                         torch.from_numpy(packed[r0 : r0 + PLAN_BLOCK]), torch.from_numpy(counts))
    _shuffle(rng, packed)
    out = np.empty(n, dtype=_index_dtype(n))
    NATIVE.group_packed(*(torch.from_numpy(a) for a in (packed, np.cumsum(counts) - counts, out)))
    return out


def _counts(values: np.ndarray, length: int) -> np.ndarray:
    """``np.bincount(values, minlength=length)`` a block at a time (bincount copies its input to int64 first,
    and makes ``length`` counts per block: the native pass counts in place)."""
    counts = np.zeros(length, dtype=np.int64)
    if NATIVE is not None:
        NATIVE.count_keys(torch.from_numpy(_as_signed(values)), torch.from_numpy(counts))
        return counts
    for r0 in range(0, len(values), PLAN_BLOCK):
        counts += np.bincount(values[r0 : r0 + PLAN_BLOCK], minlength=length)
    return counts


def _stable_order(keys: np.ndarray, bound: int) -> np.ndarray:
    """``np.argsort(keys, kind="stable")`` of ints in ``[0, bound)``, faster: numpy's radix sort for
    16-bit keys, else one plain sort of the distinct values ``key * n + position`` (numpy's stable
    sort of wider ints is a merge sort, several times slower than its default sort)."""
    n = len(keys)
    if bound <= 2**16:
        return np.argsort(keys.astype(np.uint16, copy=False), kind="stable")
    if n and bound * n >= 2**63:
        return np.argsort(keys, kind="stable")
    tagged = keys.astype(np.int64) * n + np.arange(n)
    tagged.sort()
    return tagged % max(n, 1)


def _group(keys: np.ndarray, bound: int, seq: np.ndarray | None = None) -> np.ndarray:
    """``seq`` (default: every item, ascending) reordered stably by its items' ``keys`` (one int in
    ``[0, bound)`` per item, indexed by item). A counting sort a block at a time: its temporaries are
    a block and ``bound`` counts, not ``[N]``; the result has seq's dtype (else :func:`_index_dtype`'s)."""
    n = len(keys)
    dtype = seq.dtype if seq is not None else _index_dtype(n)
    if bound <= 1:  # one key (one bucket, one window): nothing moves
        return seq.copy() if seq is not None else np.arange(n, dtype=dtype)
    cursor = _counts(keys, bound)
    cursor = np.cumsum(cursor) - cursor  # where each key's next item goes
    out = np.empty(n, dtype=dtype)
    if seq is not None and NATIVE is not None:  # seq's items at random: one pass, prefetching their keys and slots
        NATIVE.group_by_key(*(torch.from_numpy(a) for a in (seq, _as_signed(keys), cursor, out)))
        return out
    for r0 in range(0, n, PLAN_BLOCK):
        part = seq[r0 : r0 + PLAN_BLOCK] if seq is not None else None
        part_keys = keys[part] if seq is not None else keys[r0 : r0 + PLAN_BLOCK]
        order = _stable_order(part_keys, bound)
        moved = part[order] if seq is not None else (order + r0).astype(dtype)
        if bound <= GROUP_RUNS:  # few keys, long runs: each key's items of the block copied as one slice
            block_counts = np.bincount(part_keys, minlength=bound)
            present = np.flatnonzero(block_counts)
            ends = np.cumsum(block_counts[present])
            for key, start, end in zip(present.tolist(), (ends - block_counts[present]).tolist(), ends.tolist()):
                out[cursor[key] : cursor[key] + end - start] = moved[start:end]
            cursor += block_counts
            continue
        part_keys = part_keys[order]
        first = np.ones(len(part_keys), dtype=bool)  # the first of each run of one key
        first[1:] = part_keys[1:] != part_keys[:-1]
        run_starts = np.flatnonzero(first)
        run_lengths = np.diff(np.append(run_starts, len(part_keys)))
        out[cursor[part_keys] + np.arange(len(part_keys)) - np.repeat(run_starts, run_lengths)] = moved
        cursor[part_keys[run_starts]] += run_lengths
    return out


def _sort_segments(items: np.ndarray, bounds: np.ndarray, ranks: np.ndarray, count: int) -> None:
    """Sort each segment ``items[bounds[s]:bounds[s + 1]]`` stably by ``ranks`` of its items (ints in
    ``[0, count)``), in place, the segments of about :data:`PLAN_BLOCK` items at once (the native pass: one at a time)."""
    if NATIVE is not None:
        NATIVE.sort_segments(torch.from_numpy(items), torch.from_numpy(bounds.astype(np.int64, copy=False)),
                             torch.from_numpy(_as_signed(ranks)), count)
        return
    s = 0
    while s < len(bounds) - 1:
        t = max(s + 1, int(np.searchsorted(bounds, bounds[s] + PLAN_BLOCK, side="right")) - 1)
        r0, r1 = int(bounds[s]), int(bounds[t])
        part = items[r0:r1]
        segment = np.repeat(np.arange(t - s, dtype=np.int64), np.diff(bounds[s : t + 1]))
        items[r0:r1] = part[_stable_order(segment * count + ranks[part], (t - s) * count)]
        s = t


# ---- bucket ids ---------------------------------------------------------------------------------
def _id_dtype(count: int) -> np.dtype:
    """The smallest unsigned dtype holding ids ``0 .. count - 1``."""
    return np.min_scalar_type(max(count - 1, 0))


def _id_count(ids: np.ndarray) -> int:
    """How many ids ``0 .. max`` an array of ids numbers."""
    return int(ids.max()) + 1 if len(ids) else 0


def _bucket_ids(shapes) -> np.ndarray:
    """One small unsigned int per item: the index of its shape (or label) among the distinct ones
    (lexicographic), in the smallest dtype that holds them. Int shapes ``[N, ndim]`` and int labels are
    read :data:`PLAN_BLOCK` rows at a time (a mapped table is never copied whole)."""
    array = shapes if isinstance(shapes, np.ndarray) else np.asarray(shapes)
    if array.ndim in (1, 2) and array.dtype.kind in "iu":
        return _row_ids(array[:, None] if array.ndim == 1 else array)
    if array.ndim == 1:
        _, ids = np.unique(np.asarray([str(s) for s in shapes]) if array.dtype == object else array, return_inverse=True)
        return ids.reshape(-1).astype(_id_dtype(_id_count(ids)))
    raise InvalidArgumentError(f"shapes must be an int array [N, ndim] or one bucket label per item, got {array.dtype} {list(array.shape)}")


def _row_ids(rows: np.ndarray) -> np.ndarray:
    """Each row's index among the distinct rows in lexicographic order (what ``np.unique(rows,
    axis=0, return_inverse=True)`` gives, ~50x faster on many rows), a block of rows at a time: the
    rows' offsets from each column's minimum as one mixed-radix integer, then that integer's rank
    among those present (a table lookup when the key range is small, else a sorted list of the
    distinct keys). Rows whose ranges do not fit 63 bits take the slow way, still by blocks."""
    n, ndim = rows.shape
    if n == 0:
        return np.zeros(0, dtype=np.uint8)
    blocks = range(0, n, PLAN_BLOCK)
    lows, highs = [], []
    for r0 in blocks:  # each column's range, one pass
        block = rows[r0 : r0 + PLAN_BLOCK]
        low, high = block.min(axis=0).tolist(), block.max(axis=0).tolist()
        lows, highs = (low, high) if not lows else ([min(a, b) for a, b in zip(lows, low)], [max(a, b) for a, b in zip(highs, high)])
    spans = [high - low + 1 for low, high in zip(lows, highs)]
    if math.prod(spans) >= 2**63:
        return _wide_row_ids(rows)

    def keys_of(r0: int) -> np.ndarray:
        block, keys = rows[r0 : r0 + PLAN_BLOCK], np.zeros(min(n, r0 + PLAN_BLOCK) - r0, dtype=np.int64)
        for c, (low, span) in enumerate(zip(lows, spans)):
            if span > 1:  # constant columns add nothing
                column = block[:, c]  # offsets from the minimum: in the column's dtype if unsigned (exact), else int64
                keys *= span
                keys += (column - column.dtype.type(low)).astype(np.int64) if column.dtype.kind == "u" else column.astype(np.int64) - low
        return keys

    size = math.prod(spans)
    if size <= min(TABLE_KEYS, 4 * n + 1024):  # a table of the key range: no sort at all
        present = np.zeros(size, dtype=bool)
        for r0 in blocks:
            present[keys_of(r0)] = True
        rank = (np.cumsum(present, dtype=np.int64) - 1).astype(_id_dtype(int(np.count_nonzero(present))))
        ids = np.empty(n, dtype=rank.dtype)  # (absent keys' entries of rank are never read)
        for r0 in blocks:
            ids[r0 : r0 + PLAN_BLOCK] = rank[keys_of(r0)]
        return ids
    distinct, pending, held = np.zeros(0, dtype=np.int64), [], 0
    for r0 in blocks:  # the distinct keys, merged when the blocks' add up to as many (O(N log N) even if all differ)
        pending.append(np.unique(keys_of(r0)))
        held += len(pending[-1])
        if held > len(distinct):
            distinct, pending, held = np.unique(np.concatenate([distinct, *pending])), [], 0
    distinct = np.unique(np.concatenate([distinct, *pending]))
    ids = np.empty(n, dtype=_id_dtype(len(distinct)))
    for r0 in blocks:
        ids[r0 : r0 + PLAN_BLOCK] = np.searchsorted(distinct, keys_of(r0))
    return ids


def _wide_row_ids(rows: np.ndarray) -> np.ndarray:
    """:func:`_row_ids` for rows whose value ranges need more than 63 bits: ``np.unique(axis=0)`` a block at a time."""
    blocks = range(0, len(rows), PLAN_BLOCK)
    distinct = np.unique(np.concatenate([np.unique(rows[r0 : r0 + PLAN_BLOCK], axis=0) for r0 in blocks]), axis=0)
    ids = np.empty(len(rows), dtype=_id_dtype(len(distinct)))
    for r0 in blocks:  # a block's rows are among the distinct ones: its inverse after them is its rows' indices there
        inverse = np.unique(np.concatenate([distinct, rows[r0 : r0 + PLAN_BLOCK]]), axis=0, return_inverse=True)[1]
        ids[r0 : r0 + PLAN_BLOCK] = inverse.reshape(-1)[len(distinct) :]
    return ids


class LookaheadSampler:
    """``batch_sampler``'s batches, unchanged, while the rows of the next ``lookahead`` batches are
    read into the page cache in the background (:func:`prefetch`), so disk time hides behind the
    training step.

    A sampler with ``upcoming(k)`` (as :class:`WidthBucketBatchSampler`)
    is peeked, not advanced, so its ``state_dict()`` still counts the batches handed out. Any other
    iterable of batches is read ``lookahead`` batches ahead of the loop. Other attributes
    (``set_epoch``, ``state_dict``, ...) are the wrapped sampler's."""

    def __init__(self, batch_sampler: Iterable, cache, lookahead: int = DEFAULT_LOOKAHEAD):
        self.batch_sampler, self.cache = batch_sampler, cache
        self.lookahead = as_int("lookahead", lookahead, minimum=0)

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("batch_sampler", "cache", "lookahead"):
            raise AttributeError(name)
        return getattr(self.batch_sampler, name)

    def __iter__(self) -> Iterator:
        if self.lookahead == 0:
            return iter(self.batch_sampler)
        if hasattr(self.batch_sampler, "upcoming"):
            return self._peeking()
        return self._reading_ahead()

    def _prefetch(self, batch) -> None:
        """The cache's own prefetch where it has one (a cache in object storage fetches over the network)."""
        prefetch = getattr(self.cache, "prefetch", None)
        if prefetch is None:
            coldread.prefetch(self.cache, batch)
        else:
            prefetch(batch)

    def _peeking(self) -> Iterator:
        ahead = 0  # batches after the current one already prefetched
        for batch in self.batch_sampler:
            if ahead == 0:
                self._prefetch(batch)
            else:
                ahead -= 1
            upcoming = list(self.batch_sampler.upcoming(self.lookahead))
            for later in upcoming[ahead:]:
                self._prefetch(later)
            ahead = len(upcoming)
            yield batch

    def _reading_ahead(self) -> Iterator:
        window: collections.deque = collections.deque()
        source = iter(self.batch_sampler)
        for batch in source:
            self._prefetch(batch)
            window.append(batch)
            if len(window) > self.lookahead:
                yield window.popleft()
        yield from window
