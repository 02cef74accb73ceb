"""Batch samplers over a latent cache: batches of rows of similar width (line caches) or of one shape
(aspect buckets, video sizes), seeded, sharded by rank with the same number of batches on every rank,
resumable mid-epoch (also at another world size), optionally drawn from a window of a few chunks of
the data file at a time (remote storage: each chunk fetched about once per epoch), and able to show
the next batches to a reader that reads ahead; and :class:`LookaheadSampler`, which has the next
batches' rows read into the page cache while the loop runs."""
from __future__ import annotations

import collections
import math
import zlib
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

from ...checks import as_int
from ...errors import ArgumentTypeError, InvalidArgumentError
from ..store.format import CHUNK_BYTES
from ..store.layout import ELEMENT_BYTES
from . import coldread
from .coldread import DEFAULT_LOOKAHEAD


SAMPLER_CHUNK_BYTES = 64 * CHUNK_BYTES  # 1 MiB: 64 of the local chunk cache's chunks, several items of any usual size


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
        starts = np.asarray(cache.row_starts[:-1], dtype=np.int64) * ELEMENT_BYTES
    else:
        starts = np.asarray(cache)
        if starts.ndim != 1 or (starts.size and starts.dtype.kind not in "iu"):
            raise InvalidArgumentError(f"item_chunks takes a LatentCache or int byte offsets [N], got {starts.dtype} {list(starts.shape)}")
        if starts.size and starts.min() < 0:
            raise InvalidArgumentError(f"item byte offsets must be >= 0, got {int(starts.min())}")
    return starts.astype(np.int64) // chunk_bytes


class ShardedBatchSampler(Sampler[list[int]]):
    """What both samplers share: a subclass says how an epoch's batches are made (``_all_batches``,
    seeded by ``(seed, epoch)``) and how many there are (``_total_batches``); this class shards them.

    The epoch's batches are one global list, the same at any world size. From the global position
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
        self._epoch_batches: list[list[int]] | None = None  # this rank's batches of the epoch being iterated
        self._set_chunks(chunks, chunk_window)

    def _set_chunks(self, chunks, chunk_window) -> None:
        self.chunk_window = self._chunk_fingerprint = None
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
        ids = ids.astype(np.int64)
        self._chunk_fingerprint = zlib.crc32(ids.tobytes())  # a resumed run must window the same chunks
        _, self._chunk_of = np.unique(ids, return_inverse=True)  # dense 0..n_chunks-1
        self._n_chunks = int(self._chunk_of.max(initial=-1)) + 1

    def _stream(self, rng: np.random.Generator, buckets: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(items, windows)``: every item, grouped by window of ``chunk_window`` chunks (windows in
        the epoch's random chunk order), in random order within a window; with ``buckets``, grouped by
        bucket first. ``windows``: each listed item's window."""
        rank_of_chunk = np.empty(self._n_chunks, dtype=np.int64)
        rank_of_chunk[rng.permutation(self._n_chunks)] = np.arange(self._n_chunks)
        window = rank_of_chunk[self._chunk_of] // self.chunk_window
        shuffled = rng.permutation(self.n_items)
        key = window if buckets is None else buckets * (int(window.max(initial=0)) + 1) + window  # < n**2: fits int64
        items = shuffled[np.argsort(key[shuffled], kind="stable")]  # stable: random order within a group
        return items, window[items]

    @staticmethod
    def _in_window_order(batch_windows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """The order of batches: by window, shuffled within each."""
        return np.lexsort((rng.permutation(len(batch_windows)), batch_windows))

    def _all_batches(self) -> list[list[int]]:
        raise NotImplementedError

    def _total_batches(self) -> int:
        raise NotImplementedError

    def rank_batches(self) -> list[list[int]]:
        """This rank's batches of the current epoch from the position the pass began at, in order
        (ignoring what was consumed since)."""
        batches = self._all_batches()
        rest = batches[self.start :]
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % self.world_size]
        elif rest:
            fill = -len(rest) % self.world_size
            rest = rest + [batches[k % len(batches)] for k in range(fill)]
        return rest[self.rank :: self.world_size]

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

    def _all_batches(self) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch])
        if self.chunk_window is not None:
            return self._windowed_batches(rng)
        order = rng.permutation(len(self.widths))
        chunk = self.batch_size * self.bucket_batches
        batches = []
        for start in range(0, len(order), chunk):
            part = order[start : start + chunk]
            part = part[np.argsort(self.widths[part], kind="stable")]
            batches += [part[k : k + self.batch_size].tolist() for k in range(0, len(part), self.batch_size)]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()  # only the very last batch can be short (chunks are whole batches)
        # shuffle the batch order, but keep a short batch last so drop_last-free shards stay full-sized
        short = batches.pop() if batches and len(batches[-1]) < self.batch_size else None
        batches = [batches[k] for k in rng.permutation(len(batches))]
        if short is not None:
            batches.append(short)
        return batches

    def _windowed_batches(self, rng: np.random.Generator) -> list[list[int]]:
        # the rows in window order; window w's pool is its rows plus the rows the windows before left
        # over from whole batches: stream positions up to the last whole batch its rows reach
        stream, windows = self._stream(rng)
        bs = self.batch_size
        pool_ends = np.cumsum(np.bincount(windows, minlength=int(windows.max(initial=0)) + 1)) // bs * bs
        whole = int(pool_ends[-1]) if len(pool_ends) else 0
        position = np.arange(whole)
        pool = np.searchsorted(pool_ends, position, side="right")
        part = (position - np.concatenate([[0], pool_ends[:-1]])[pool]) // (bs * self.bucket_batches)
        segment = np.cumsum((np.diff(part, prepend=-1) != 0) | (np.diff(pool, prepend=-1) != 0))  # parts numbered along the stream
        rows = stream[:whole][np.lexsort((self.widths[stream[:whole]], segment))]  # each part of a pool by width
        order = self._in_window_order(pool[::bs], rng)
        batches = [rows[k * bs : (k + 1) * bs].tolist() for k in order.tolist()]
        short = stream[whole:]
        if len(short) and not self.drop_last:
            batches.append(short[np.argsort(self.widths[short], kind="stable")].tolist())  # the short batch, last
        return batches

    def _total_batches(self) -> int:
        return self.n_items // self.batch_size if self.drop_last else -(-self.n_items // self.batch_size)


class ShapeBucketBatchSampler(ShardedBatchSampler):
    """Batches of item indices of one shape (see :class:`ShardedBatchSampler` for sharding, epochs,
    resuming and ``chunks``/``chunk_window``).

    ``shapes``: int ``[N, ndim]`` (e.g. ``LatentCache.shapes``), or one hashable bucket label per
    item. Each epoch, with a generator seeded by ``(seed, epoch)``: every bucket's items are
    shuffled and cut into batches of ``batch_size`` (a bucket's last batch may be smaller, or is
    dropped with ``drop_last``); then the batches of all buckets are shuffled together, so buckets
    are seen in proportion to their size. With ``chunks``, the same within each window of chunks: a
    bucket's items left over from whole batches open its first batch in the next window, and its
    last short batch comes in the last window.
    """

    def __init__(self, shapes, batch_size: int, *, seed: int = 0, rank: int = 0, world_size: int = 1,
                 drop_last: bool = False, chunks=None, chunk_window: int | None = None):
        self.buckets = _bucket_ids(shapes)
        super().__init__(len(self.buckets), batch_size, seed=seed, rank=rank, world_size=world_size, drop_last=drop_last,
                         chunks=chunks, chunk_window=chunk_window)
        # every bucket's items in ascending order: one stable sort (a radix sort for 16-bit ids), cut at the bucket sizes
        count = int(self.buckets.max(initial=-1)) + 1
        ids = self.buckets.astype(np.uint16) if count <= 2**16 else self.buckets
        ends = np.cumsum(np.bincount(self.buckets, minlength=count))[:-1]
        self._members = np.split(np.argsort(ids, kind="stable"), ends) if count else []

    def _all_batches(self) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch])
        if self.chunk_window is not None:
            return self._windowed_batches(rng)
        batches = []
        for members in self._members:
            order = members[rng.permutation(len(members))]
            stop = len(order) - len(order) % self.batch_size if self.drop_last else len(order)
            batches += [order[k : k + self.batch_size].tolist() for k in range(0, stop, self.batch_size)]
        return [batches[k] for k in rng.permutation(len(batches))]

    def _windowed_batches(self, rng: np.random.Generator) -> list[list[int]]:
        # each bucket's items in window order, cut into batches in that order: a bucket's items left
        # over from one window open its next batch; a batch belongs to the window of its last item
        stream, windows = self._stream(rng, self.buckets)
        sizes = np.array([len(m) for m in self._members], dtype=np.int64)
        firsts = np.cumsum(sizes) - sizes
        stops = sizes - sizes % self.batch_size if self.drop_last else sizes
        starts = np.concatenate([first + np.arange(0, stop, self.batch_size) for first, stop in zip(firsts, stops)] or [np.zeros(0, np.int64)])
        ends = np.minimum(starts + self.batch_size, np.repeat(firsts + sizes, (stops + self.batch_size - 1) // self.batch_size))
        last_window = int(windows.max(initial=0))
        batch_windows = np.where(ends - starts == self.batch_size, windows[ends - 1], last_window)  # short ones: the last window
        return [stream[starts[k] : ends[k]].tolist() for k in self._in_window_order(batch_windows, rng).tolist()]

    def _total_batches(self) -> int:
        if self.drop_last:
            return sum(len(m) // self.batch_size for m in self._members)
        return sum(-(-len(m) // self.batch_size) for m in self._members)


class InOrderBatchSampler(ShardedBatchSampler):
    """Batches in item order, unshuffled (see :class:`ShardedBatchSampler` for sharding, epochs and
    resuming): each bucket's items (``buckets``: one label per item, or int shapes ``[N, ndim]``)
    ascending, cut into batches of ``batch_size`` (a bucket's last may be short, or dropped with
    ``drop_last``), the batches ordered by their first item. The same every epoch."""

    def __init__(self, buckets, batch_size: int, *, rank: int = 0, world_size: int = 1, drop_last: bool = False):
        self.buckets = _bucket_ids(buckets)
        super().__init__(len(self.buckets), batch_size, seed=0, rank=rank, world_size=world_size, drop_last=drop_last)
        order = np.argsort(self.buckets, kind="stable")
        ends = np.cumsum(np.bincount(self.buckets, minlength=int(self.buckets.max(initial=-1)) + 1))[:-1]
        self._members = np.split(order, ends) if len(order) else []

    def _all_batches(self) -> list[list[int]]:
        batches = []
        for members in self._members:
            stop = len(members) - len(members) % self.batch_size if self.drop_last else len(members)
            batches += [members[k : k + self.batch_size].tolist() for k in range(0, stop, self.batch_size)]
        return sorted(batches, key=lambda batch: batch[0])

    def _total_batches(self) -> int:
        if self.drop_last:
            return sum(len(m) // self.batch_size for m in self._members)
        return sum(-(-len(m) // self.batch_size) for m in self._members)


def _bucket_ids(shapes) -> np.ndarray:
    """One small int per item: the index of its shape (or label) among the distinct ones."""
    array = np.asarray(shapes)
    if array.ndim == 2 and array.dtype.kind in "iu":
        ids = _row_ids(array)
    elif array.ndim == 1:
        _, ids = np.unique(np.asarray([str(s) for s in shapes]) if array.dtype == object else array, return_inverse=True)
    else:
        raise InvalidArgumentError(f"shapes must be an int array [N, ndim] or one bucket label per item, got {array.dtype} {list(array.shape)}")
    return np.asarray(ids, dtype=np.int64).reshape(-1)


def _row_ids(rows: np.ndarray) -> np.ndarray:
    """Each row's index among the distinct rows in lexicographic order (what ``np.unique(rows,
    axis=0, return_inverse=True)`` gives, ~50x faster on many rows): the rows' offsets from each
    column's minimum as one mixed-radix integer, then that integer's rank among those present
    (a table lookup when the key range is small, else a 1-D unique). Rows whose ranges do not fit
    63 bits take the slow way."""
    columns = [rows[:, c] for c in range(rows.shape[1])]
    lows = [int(c.min()) for c in columns] if len(rows) else [0] * len(columns)
    spans = [int(c.max()) - low + 1 for c, low in zip(columns, lows)] if len(rows) else [1] * len(columns)
    if math.prod(spans) >= 2**63:
        return np.unique(rows, axis=0, return_inverse=True)[1].reshape(-1)
    keys = np.zeros(len(rows), dtype=np.int64)
    for column, low, span in zip(columns, lows, spans):
        if span > 1:  # constant columns add nothing
            keys *= span
            keys += column.astype(np.int64) - low  # fits int64: span < 2**63
    if math.prod(spans) <= 4 * len(rows) + 1024:  # a table as long as the data at most: O(n), no sort
        present = np.zeros(math.prod(spans), dtype=bool)
        present[keys] = True
        return (np.cumsum(present) - 1)[keys]
    return np.unique(keys, return_inverse=True)[1]


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
