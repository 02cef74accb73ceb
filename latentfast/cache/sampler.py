"""``ShapeBucketBatchSampler``: batches whose items share one shape (aspect buckets, video sizes)."""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
from torch.utils.data import Sampler

from ..errors import ArgumentTypeError, InvalidArgumentError


class ShapeBucketBatchSampler(Sampler[list[int]]):
    """Batches of item indices of one shape, seeded, sharded by rank, resumable mid-epoch.

    ``shapes``: int ``[N, ndim]`` (e.g. ``LatentCache.shapes``), or one hashable bucket label per
    item. Each epoch, with a generator seeded by ``(seed, epoch)``: every bucket's items are
    shuffled and cut into batches of ``batch_size`` (a bucket's last batch may be smaller, or is
    dropped with ``drop_last``); then the batches of all buckets are shuffled together, so buckets
    are seen in proportion to their size. Rank ``r`` of ``world_size`` takes batches ``r, r +
    world_size, ...``; every rank gets the same number of batches: with ``drop_last`` the batches
    that do not divide evenly are dropped, without it the first batches are repeated to fill the
    last round (so every item is seen at least once per epoch).

    Call :meth:`set_epoch` before each epoch. ``state_dict()`` records the epoch and how many of
    this rank's batches were handed out (or pass ``consumed``, what the training loop really used);
    ``load_state_dict()`` continues from exactly there.
    """

    def __init__(self, shapes, batch_size: int, *, seed: int = 0, rank: int = 0, world_size: int = 1,
                 drop_last: bool = False):
        self.buckets = _bucket_ids(shapes)
        for name, value, low in (("batch_size", batch_size, 1), ("world_size", world_size, 1), ("rank", rank, 0),
                                 ("seed", seed, 0)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise ArgumentTypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < low:
                raise InvalidArgumentError(f"{name} must be >= {low}, got {value}")
        if rank >= world_size:
            raise InvalidArgumentError(f"rank must be < world_size={world_size}, got {rank}")
        self.batch_size, self.seed, self.rank, self.world_size = int(batch_size), int(seed), int(rank), int(world_size)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self.consumed = 0
        self._members = [np.flatnonzero(self.buckets == b) for b in range(int(self.buckets.max(initial=-1)) + 1)]

    def _all_batches(self) -> list[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch])
        batches = []
        for members in self._members:
            order = members[rng.permutation(len(members))]
            stop = len(order) - len(order) % self.batch_size if self.drop_last else len(order)
            batches += [order[k : k + self.batch_size].tolist() for k in range(0, stop, self.batch_size)]
        return [batches[k] for k in rng.permutation(len(batches))]

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
        batches = self.rank_batches()
        for position in range(self.consumed, len(batches)):
            self.consumed = position + 1
            yield batches[position]
        self.consumed = 0  # a finished epoch: the next iteration starts the epoch over

    def _total_batches(self) -> int:
        if self.drop_last:
            return sum(len(m) // self.batch_size for m in self._members)
        return sum(-(-len(m) // self.batch_size) for m in self._members)

    def __len__(self) -> int:
        total = self._total_batches()
        return total // self.world_size if self.drop_last else -(-total // self.world_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self.consumed = 0

    def state_dict(self, consumed: int | None = None) -> dict:
        """``consumed``: batches the training loop really used this epoch; pass it when a DataLoader
        prefetches (the sampler has then handed out more batches than were consumed)."""
        return {"seed": self.seed, "epoch": self.epoch, "consumed": self.consumed if consumed is None else int(consumed),
                "rank": self.rank, "world_size": self.world_size, "batch_size": self.batch_size,
                "drop_last": self.drop_last, "items": int(len(self.buckets))}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "world_size", "batch_size", "drop_last", "items"):
            if key in state and state[key] != self.state_dict()[key]:
                raise InvalidArgumentError(f"state_dict was saved with {key}={state[key]}, this sampler has {self.state_dict()[key]}")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])


def _bucket_ids(shapes) -> np.ndarray:
    """One small int per item: the index of its shape (or label) among the distinct ones."""
    array = np.asarray(shapes)
    if array.ndim == 2 and array.dtype.kind in "iu":
        _, ids = np.unique(array, axis=0, return_inverse=True)
    elif array.ndim == 1:
        _, ids = np.unique(np.asarray([str(s) for s in shapes]) if array.dtype == object else array, return_inverse=True)
    else:
        raise InvalidArgumentError(f"shapes must be an int array [N, ndim] or one bucket label per item, got {array.dtype} {list(array.shape)}")
    return np.asarray(ids, dtype=np.int64).reshape(-1)
