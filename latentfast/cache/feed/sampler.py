"""Batch samplers over a latent cache: batches of rows of similar width (line caches) or of one shape
(aspect buckets, video sizes), seeded, sharded by rank with the same number of batches on every rank,
resumable mid-epoch, and able to show the next batches to a reader that reads ahead; and
:class:`LookaheadSampler`, which has the next batches' rows read into the page cache while the loop runs."""
from __future__ import annotations

import collections
import math
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

from ...checks import as_int
from ...errors import ArgumentTypeError, InvalidArgumentError
from . import coldread
from .coldread import DEFAULT_LOOKAHEAD


class ShardedBatchSampler(Sampler[list[int]]):
    """What both samplers share: a subclass says how an epoch's batches are made (``_all_batches``,
    seeded by ``(seed, epoch)``) and how many there are (``_total_batches``); this class shards them.

    Rank ``r`` of ``world_size`` takes batches ``r, r + world_size, ...``; every rank gets the same
    number of batches: with ``drop_last`` the batches that do not divide evenly are dropped, without
    it the first batches are repeated to fill the last round (so every item is seen at least once per
    epoch). Call :meth:`set_epoch` before each epoch (as with ``DistributedSampler``).
    ``state_dict()`` records the epoch and how many of this rank's batches were handed out (or pass
    ``consumed``, what the training loop really used); ``load_state_dict()`` continues from exactly
    there. :meth:`upcoming` lets a reader look ahead
    (:class:`LookaheadSampler`) without consuming anything.
    """

    def __init__(self, n_items: int, batch_size: int, *, seed: int, rank: int, world_size: int, drop_last: bool):
        values = {name: as_int(name, value, minimum=low) for name, value, low in (
            ("batch_size", batch_size, 1), ("world_size", world_size, 1), ("rank", rank, 0), ("seed", seed, 0))}
        if values["rank"] >= values["world_size"]:
            raise InvalidArgumentError(f"rank must be < world_size={values['world_size']}, got {values['rank']}")
        self.batch_size, self.seed = values["batch_size"], values["seed"]
        self.rank, self.world_size = values["rank"], values["world_size"]
        self.drop_last = bool(drop_last)
        self.n_items = int(n_items)
        self.epoch = 0
        self.consumed = 0  # batches of this rank's current epoch already handed out
        self._epoch_batches: list[list[int]] | None = None  # this rank's batches of the epoch being iterated

    def _all_batches(self) -> list[list[int]]:
        raise NotImplementedError

    def _total_batches(self) -> int:
        raise NotImplementedError

    def rank_batches(self) -> list[list[int]]:
        """This rank's batches of the current epoch, in order (ignoring what was consumed)."""
        batches = self._all_batches()
        if self.drop_last:
            batches = batches[: len(batches) - len(batches) % self.world_size]
        elif batches:
            fill = -len(batches) % self.world_size
            batches = batches + [batches[k % len(batches)] for k in range(fill)]
        return batches[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._epoch_batches = self.rank_batches()
        start = self.consumed
        for position in range(start, len(batches)):
            self.consumed = position + 1
            yield batches[position]
        self.consumed = 0  # a finished epoch: the next iteration starts the epoch over
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
        self.consumed = 0
        self._epoch_batches = None

    def state_dict(self, consumed: int | None = None) -> dict:
        """``consumed``: batches the training loop really used this epoch; pass it when a DataLoader
        prefetches (the sampler has then handed out more batches than were consumed)."""
        return {"seed": self.seed, "epoch": self.epoch, "consumed": self.consumed if consumed is None else int(consumed),
                "rank": self.rank, "world_size": self.world_size, "batch_size": self.batch_size,
                "drop_last": self.drop_last, "items": self.n_items}

    def load_state_dict(self, state: dict) -> None:
        mine = self.state_dict()
        for key in ("seed", "world_size", "batch_size", "drop_last", "items"):
            if key in state and state[key] != mine[key]:
                raise InvalidArgumentError(f"state_dict was saved with {key}={state[key]}, this sampler has {mine[key]}")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])
        self._epoch_batches = None


class WidthBucketBatchSampler(ShardedBatchSampler):
    """Batches of rows of similar width (line caches; see :class:`ShardedBatchSampler` for sharding,
    epochs and resuming).

    Each epoch: a seeded permutation of all rows is cut into chunks of ``batch_size *
    bucket_batches`` rows; each chunk is sorted by width (so its batches are narrow or wide
    together, cutting padding) and cut into batches; the batch order is then shuffled, a short last
    batch kept last (or dropped with ``drop_last``).
    """

    def __init__(self, widths: Sequence[int] | np.ndarray, batch_size: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, drop_last: bool = False, bucket_batches: int = 64):
        self.widths = np.asarray(widths)
        if self.widths.ndim != 1:
            raise InvalidArgumentError(f"widths must be 1-D (one per row), got shape {self.widths.shape}")
        if self.widths.size and self.widths.dtype.kind not in "iu":
            raise ArgumentTypeError(f"widths must be integers, got {self.widths.dtype}")
        super().__init__(len(self.widths), batch_size, seed=seed, rank=rank, world_size=world_size, drop_last=drop_last)
        self.bucket_batches = as_int("bucket_batches", bucket_batches, minimum=1)

    def _all_batches(self) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch])
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

    def _total_batches(self) -> int:
        return self.n_items // self.batch_size if self.drop_last else -(-self.n_items // self.batch_size)


class ShapeBucketBatchSampler(ShardedBatchSampler):
    """Batches of item indices of one shape (see :class:`ShardedBatchSampler` for sharding, epochs
    and resuming).

    ``shapes``: int ``[N, ndim]`` (e.g. ``LatentCache.shapes``), or one hashable bucket label per
    item. Each epoch, with a generator seeded by ``(seed, epoch)``: every bucket's items are
    shuffled and cut into batches of ``batch_size`` (a bucket's last batch may be smaller, or is
    dropped with ``drop_last``); then the batches of all buckets are shuffled together, so buckets
    are seen in proportion to their size.
    """

    def __init__(self, shapes, batch_size: int, *, seed: int = 0, rank: int = 0, world_size: int = 1,
                 drop_last: bool = False):
        self.buckets = _bucket_ids(shapes)
        super().__init__(len(self.buckets), batch_size, seed=seed, rank=rank, world_size=world_size, drop_last=drop_last)
        # every bucket's items in ascending order: one stable sort (a radix sort for 16-bit ids), cut at the bucket sizes
        count = int(self.buckets.max(initial=-1)) + 1
        ids = self.buckets.astype(np.uint16) if count <= 2**16 else self.buckets
        ends = np.cumsum(np.bincount(self.buckets, minlength=count))[:-1]
        self._members = np.split(np.argsort(ids, kind="stable"), ends) if count else []

    def _all_batches(self) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch])
        batches = []
        for members in self._members:
            order = members[rng.permutation(len(members))]
            stop = len(order) - len(order) % self.batch_size if self.drop_last else len(order)
            batches += [order[k : k + self.batch_size].tolist() for k in range(0, stop, self.batch_size)]
        return [batches[k] for k in rng.permutation(len(batches))]

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
