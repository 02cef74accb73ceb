"""Several caches in one training loop: :class:`MixedBatchSampler`, the epoch's order of a
:class:`~latentfast.cache.LatentLoader` over a list of caches (kohya's subsets with their
``num_repeats``, or caches drawn by weight), and what the loader checks and seeds per cache.

Every batch comes from one cache and one of its buckets: each cache keeps its own batch sampler
(the one the loader makes for a single cache, over its items listed ``repeats[i]`` times), and this
module only orders the caches' batches into the epoch's one global list, then shards that list over
the ranks as :class:`~latentfast.cache.feed.sampler.ShardedBatchSampler` shards a single cache's (the
same list at any world size, so a state resumes at another one). It uses the samplers' public
``set_epoch``, ``rank_batches`` and ``len`` only.

- ``repeats``: cache ``i``'s items are listed ``repeats[i]`` times in its buckets and batched as
  kohya's ``BucketManager`` batches a subset with ``num_repeats`` (every item exactly that many times
  an epoch, ``ceil(repeats * bucket size / batch_size)`` batches a bucket; a batch may hold an item
  twice, as kohya's may); the caches' batches are then shuffled together.
- ``weights``: an epoch has as many batches as one pass over every cache (the sum of their batches);
  each batch's cache is drawn with probability ``weights[i] / sum(weights)``; a cache hands out its
  batches pass after pass, each pass a fresh shuffle of all its items (so within an epoch an item is
  seen ``k`` or ``k + 1`` times).
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ...checks import as_int
from ...errors import ArgumentTypeError, InvalidArgumentError

MIX_STREAM = 0x6D6978  # ("mix") a seed word of the mix's own draws, apart from any single cache's seeds


def cache_seed(seed: int, source: int) -> int:
    """The seed of cache ``source``'s batch order and read-time draws (``sample``, ``flip``) in a
    loader over several caches seeded by ``seed``: caches holding the same keys (two resolutions of
    one image folder) shuffle and draw independently."""
    return int(np.random.SeedSequence([seed, MIX_STREAM, source]).generate_state(1, np.uint64)[0]) >> 1


def mix_options(count: int, repeats, weights) -> tuple[list[int] | None, list[float] | None]:
    """``repeats`` / ``weights`` checked for ``count`` caches: at most one of them; repeats ints >= 1
    (default: 1 each), weights finite, >= 0, not all 0."""
    if repeats is not None and weights is not None:
        raise InvalidArgumentError("pass repeats= or weights=, not both: repeats lists each cache's items that many times "
                                   "an epoch, weights draws each batch's cache")
    for name, values in (("repeats", repeats), ("weights", weights)):
        if values is not None and (isinstance(values, (str, bytes)) or not isinstance(values, Sequence)):
            raise ArgumentTypeError(f"{name} must be a list with one value per cache, got {type(values).__name__} {values!r}")
        if values is not None and len(values) != count:
            raise InvalidArgumentError(f"{name} must have one value per cache ({count}), got {len(values)}: {list(values)!r}")
    if weights is None:
        return [as_int(f"repeats[{i}]", r, minimum=1) for i, r in enumerate(repeats or [1] * count)], None
    checked = []
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float, np.integer, np.floating)):
            raise ArgumentTypeError(f"weights[{i}] must be a number, got {type(w).__name__} {w!r}")
        if not math.isfinite(w) or w < 0:
            raise InvalidArgumentError(f"weights[{i}] must be finite and >= 0, got {w!r}")
        checked.append(float(w))
    if sum(checked) <= 0:
        raise InvalidArgumentError(f"weights must not all be 0, got {checked}")
    return None, checked


def describe(cache) -> str:
    """How an error names a cache: its folder (or URL) and split."""
    where = getattr(cache, "url", None) or getattr(cache, "cache_dir", type(cache).__name__)
    return f"{where} split {getattr(cache, 'split', '?')!r}"


def check_fields(caches: Sequence, names: Sequence[str], dtype, sample: bool, flips: Sequence) -> None:
    """Every cache holds the fields the batch returns (and those its draws read), each of one dtype
    and rank across the caches (the latent's dtype may differ when the read casts it, ``dtype``)."""
    for i, cache in enumerate(caches):
        if not hasattr(cache, "fields") or not hasattr(cache, "shapes"):
            raise ArgumentTypeError(f"caches[{i}] must be a LatentCache, got {type(cache).__name__} {cache!r:.80}")
    described = [cache.fields for cache in caches]
    for i, (cache, fields) in enumerate(zip(caches, described)):
        need = list(names) + (["latent_std"] if sample else [])
        need += (["latent_flipped"] + (["latent_flipped_std"] if sample else [])) if flips[i] is not None else []
        for name in need:
            if name not in fields:
                raise InvalidArgumentError(f"caches[{i}] ({describe(cache)}) has no field {name!r} (its fields: {sorted(fields)}); "
                                           f"every cache of the loader must hold the fields it reads")
        for name in names:
            ref, got = described[0][name], fields[name]
            if got["ndim"] != ref["ndim"] or (got["dtype"] != ref["dtype"] and not (name == "latent" and dtype is not None)):
                raise InvalidArgumentError(
                    f"field {name!r} is {got['dtype']} of {got['ndim']} dims in caches[{i}] ({describe(cache)}) but "
                    f"{ref['dtype']} of {ref['ndim']} dims in caches[0] ({describe(caches[0])}): the caches' batches must agree")


def keys_to_fill(caches: Sequence, names: Sequence[str], flips: Sequence) -> list[dict]:
    """Per cache, the entries its batches lack but other caches' batches have, with the value that
    fills them (so every batch of the loader has the same keys): ``flipped`` (False) for a cache read
    unflipped beside flipped ones, ``<field>_present`` (True) where a field some cache lacks for some
    items is complete in this one."""
    optional = {name for name in names for cache in caches if "present" in cache.fields.get(name, {})}
    any_flip = any(flip is not None for flip in flips)
    fills = []
    for cache, flip in zip(caches, flips):
        fill = {name + "_present": True for name in sorted(optional) if "present" not in cache.fields[name]}
        if any_flip and flip is None:
            fill["flipped"] = False
        fills.append(fill)
    return fills


class MixedBatches(Sequence):
    """A rank's batches of a mix as ``(source, epoch, indices)``, the indices made from the cache's plan
    when a batch is taken (a list of them all would hold a Python int per item). ``sizes``: with repeats,
    each cache's item count (its listed index ``v`` is item ``v % sizes[source]``)."""

    def __init__(self, refs: list, sizes: list | None):
        self.refs, self.sizes = refs, sizes

    def __len__(self) -> int:
        return len(self.refs)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        source, epoch, plan, j = self.refs[k]
        batch = plan[j]
        if self.sizes is not None:
            batch = [v % self.sizes[source] for v in batch]
        return source, epoch, batch


class MixedBatchSampler:
    """The batches of an epoch over several caches, each batch ``(source, epoch, indices)``: cache
    ``source``'s item ``indices``, read with the draws of ``epoch`` (the pass over that cache: the
    loader's epoch with ``repeats``; with ``weights``, each pass of an epoch has its own).

    ``samplers``: one batch sampler per cache, rank 0 of 1, seeded by :func:`cache_seed`, over that
    cache's ``sizes[i]`` items listed ``repeats[i]`` times (index ``v`` is item ``v % sizes[i]``);
    see the module for ``repeats`` and ``weights``. ``shuffle``: the caches' batches shuffled together
    by ``(seed, epoch)`` (else cache after cache; with weights the draws stay seeded). Ranks,
    ``drop_last``, ``state_dict`` / ``load_state_dict`` (the global position, at any world size) as
    :class:`~latentfast.cache.feed.sampler.ShardedBatchSampler`."""

    def __init__(self, samplers: Sequence, sizes: Sequence[int], *, repeats=None, weights=None, shuffle: bool = True,
                 seed: int = 0, rank: int = 0, world_size: int = 1, drop_last: bool = False):
        self.samplers, self.sizes = list(samplers), [int(n) for n in sizes]
        self.repeats, self.weights = mix_options(len(self.samplers), repeats, weights)
        self.seed = as_int("seed", seed, minimum=0)
        self.rank, self.world_size = as_int("rank", rank, minimum=0), as_int("world_size", world_size, minimum=1)
        if self.rank >= self.world_size:
            raise InvalidArgumentError(f"rank must be < world_size={self.world_size}, got {self.rank}")
        self.batch_size = self.samplers[0].batch_size
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        self.epoch = 0
        self.start = 0  # the global position (batches of the epoch, all ranks) where this pass begins
        self._per_pass = [len(s) for s in self.samplers]  # each cache's batches per pass (with its repeats)
        if self.weights is not None:
            for i, (count, weight) in enumerate(zip(self._per_pass, self.weights)):
                if weight > 0 and count == 0:
                    raise InvalidArgumentError(f"caches[{i}] makes no batch of {self.batch_size} (its {self.sizes[i]} items, "
                                               f"drop_last={self.drop_last}), but weights[{i}] = {weight} draws from it")

    def _total_batches(self) -> int:
        return sum(self._per_pass)

    def __len__(self) -> int:
        total = self._total_batches()
        return total // self.world_size if self.drop_last else -(-total // self.world_size)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = as_int("epoch", epoch, minimum=0)
        self.start = 0

    def _pass(self, source: int, epoch: int) -> list[tuple]:
        """Cache ``source``'s batches of its sampler's ``epoch``, each ``(source, epoch, plan, k)``: batch
        ``k`` of the sampler's plan (its arrays; the indices are made when the batch is taken)."""
        sampler = self.samplers[source]
        sampler.set_epoch(epoch)
        plan = sampler.rank_batches()
        return [(source, epoch, plan, k) for k in range(len(plan))]

    def _all_batches(self) -> list[tuple]:
        rng = np.random.default_rng([self.seed, MIX_STREAM, self.epoch])
        if self.weights is None:
            batches = [batch for source in range(len(self.samplers)) for batch in self._pass(source, self.epoch)]
            return [batches[k] for k in rng.permutation(len(batches))] if self.shuffle else batches
        total = self._total_batches()
        p = np.asarray(self.weights) / sum(self.weights)
        choice = rng.choice(len(self.samplers), size=total, p=p)
        streams = []
        for source, wanted in enumerate(np.bincount(choice, minlength=len(self.samplers)).tolist()):
            # pass j of this epoch is the sampler's epoch epoch * passes + j: every pass of every epoch its own
            passes = -(-total // self._per_pass[source]) if self._per_pass[source] else 0
            stream, j = [], 0
            while len(stream) < wanted:
                stream += self._pass(source, self.epoch * passes + j)
                j += 1
            streams.append(iter(stream))
        return [next(streams[source]) for source in choice.tolist()]

    def rank_batches(self) -> "MixedBatches":
        """This rank's batches ``(source, epoch, indices)`` of the current epoch from the position the pass
        begins at, in order (each made when it is taken)."""
        batches = self._all_batches()
        rest = batches[self.start :]
        if self.drop_last:
            rest = rest[: len(rest) - len(rest) % self.world_size]
        elif rest:
            rest = rest + [batches[k % len(batches)] for k in range(-len(rest) % self.world_size)]
        return MixedBatches(rest[self.rank :: self.world_size], self.sizes if self.repeats and max(self.repeats) > 1 else None)

    def _fingerprint(self) -> dict:
        inner = [s.state_dict() for s in self.samplers]
        return {"seed": self.seed, "batch_size": self.batch_size, "drop_last": self.drop_last, "shuffle": self.shuffle,
                "items": list(self.sizes), "repeats": self.repeats, "weights": self.weights,
                "chunk_windows": [s.get("chunk_window") for s in inner], "chunks_crc32": [s.get("chunks_crc32") for s in inner]}

    def state_dict(self, consumed: int = 0) -> dict:
        """The epoch and the global position after this rank's first ``consumed`` batches of the pass,
        with what :meth:`load_state_dict` checks a loader against. Plain ints, floats, strings, lists."""
        consumed = as_int("consumed", consumed, minimum=0)
        return {**self._fingerprint(), "epoch": self.epoch, "position": self.start + consumed * self.world_size,
                "consumed": consumed, "rank": self.rank, "world_size": self.world_size}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state.get("items"), list):
            raise InvalidArgumentError(f"state_dict was saved by a loader of one cache (items={state.get('items')!r}); "
                                       f"this loader mixes {len(self.samplers)} caches")
        mine = self._fingerprint()
        for key, value in mine.items():
            if key in state and state[key] != value:
                raise InvalidArgumentError(f"state_dict was saved with {key}={state[key]!r}, this loader has {value!r}")
        for key in ("epoch", "position"):
            if key not in state:
                raise InvalidArgumentError(f"state_dict has no {key!r}: not a mixed loader's state_dict (keys {sorted(state)})")
        self.epoch = as_int("epoch", state["epoch"], minimum=0)
        self.start = as_int("position", state["position"], minimum=0)
