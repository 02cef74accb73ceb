"""Loading batches for training: :class:`LatentLoader` (the one object a training loop iterates), the
pieces it is made of for those who assemble their own (CacheBatchDataset, batch_loader), and the
per-item dataset for torch's own samplers (``cache.dataset(...)``, :func:`collate_records`).

Typical use (rank and world size from torch.distributed; each batch read whole by the compiled gather
into reused buffers; ``state_dict()`` resumes exactly)::

    loader = LatentLoader(cache, 64, fields=("latent", "text"), pad={"text": 0.0}, num_workers=4, device="cuda")
    for epoch in range(start_epoch, epochs):
        loader.set_epoch(epoch)
        for batch in loader:
            ...

Or by hand (the loop then counts consumed batches for the sampler's state)::

    sampler = WidthBucketBatchSampler(cache.widths, batch_size=64, seed=0, rank=rank, world_size=world)
    loader = batch_loader(cache, sampler, num_workers=4, pin_memory=True)
    for latents, widths, indices in DevicePrefetcher(loader, "cuda"):
        ...

Read-ahead, on by default at both ends: the loaders have the rows of the next ``lookahead`` batches
read into the page cache in the background (for caches bigger than RAM), and
:class:`DevicePrefetcher` pulls and moves the next ``lookahead`` batches in a background thread, so
neither the disk nor the copy waits on the training step.
"""
from __future__ import annotations

import uuid
import weakref
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from ...checks import as_int, as_row_indices
from ...devices import as_device
from ...errors import InvalidArgumentError
from . import coldread
from .buffers import BatchBuffers, take
from .coldread import DEFAULT_LOOKAHEAD
from .gather import read_batch
from .mix import MixedBatchSampler, cache_seed, check_fields, keys_to_fill, mix_options
from .readspec import ReadSpec
from .sampler import (InOrderBatchSampler, LookaheadSampler, ShapeBucketBatchSampler, WidthBucketBatchSampler,
                      item_chunks)


class CacheBatchDataset(Dataset):
    """Dataset whose item is a whole batch: ``dataset[indices]`` -> ``(latents, widths, indices)`` via the
    compiled gather. Use with ``DataLoader(batch_size=None, sampler=<batch sampler>)`` (see
    :func:`batch_loader`, which also reads ahead), so each worker reads a batch in one call instead of
    collating items. ``indices`` must be integers (floats are refused, never rounded); ``dtype``,
    ``width``, ``cold`` and (records) ``fields``, ``pad``, ``pad_to``, ``packed``, ``sample``, ``flip``, ``seed``,
    ``epoch`` go to :func:`~latentfast.cache.read_batch`; with ``fields`` an item is read_batch's dict
    plus ``"index"``. ``set_epoch(e)`` before an epoch's iterator is made gives its draws their epoch."""

    def __init__(self, cache, *, dtype: torch.dtype | None = None, width: int | None = None, cold="auto",
                 fields=None, pad=None, pad_to=None, sample: bool = False, flip=None, seed=None, epoch: int = 0,
                 packed=()):
        self.cache = cache
        draws = sample is not False or flip is not None
        self.spec = ReadSpec(fields=("latent",) if draws and fields is None else fields, pad=pad, pad_to=pad_to,
                             packed=packed, sample=sample, flip=flip, seed=seed, epoch=epoch, dtype=dtype, width=width,
                             cold=cold)

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the draws (``sample`` / ``flip``) of the batches read from now on: call it before
        the epoch's DataLoader iterator is made, which copies the dataset into its workers (persistent
        workers keep the epoch they started with)."""
        if self.spec.draws:
            self.spec = self.spec.at_epoch(epoch)

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, indices):
        index = as_row_indices(indices, len(self.cache))
        if self.spec.records:
            return {**read_batch(self.cache, index, self.spec), "index": index}
        latents, widths = read_batch(self.cache, index, self.spec)
        return latents, widths, index


def batch_loader(
    cache, batch_sampler: Iterable[list[int]], *, dtype=None, width=None, lookahead: int = DEFAULT_LOOKAHEAD,
    cold="auto", fields=None, pad=None, pad_to=None, sample: bool = False, flip=None, seed=None, epoch: int = 0,
    packed=(), **dataloader_kwargs
) -> DataLoader:
    """A DataLoader yielding ``(latents [B, C, h, W], widths [B], indices [B])`` for each batch of
    ``batch_sampler``; ``dataloader_kwargs`` (num_workers, pin_memory, multiprocessing_context, ...)
    go to the DataLoader. With ``fields`` (and ``pad``, ``pad_to``) each batch is a dict of records
    (see :func:`~latentfast.cache.read_batch`) plus ``"index"``; ``sample``, ``flip``, ``seed`` and
    ``epoch`` draw the ``latent`` entry (``loader.dataset.set_epoch(e)`` each epoch).

    ``lookahead``: while a batch is read, the rows of the next ``lookahead`` batches are read into the
    page cache in the background (:class:`~latentfast.cache.feed.sampler.LookaheadSampler`; 0 turns it
    off). It costs nothing measurable when the cache is in RAM and hides the disk when it is not.
    A sampler with ``upcoming()`` (as :class:`WidthBucketBatchSampler`) is peeked, not advanced."""
    sampler = LookaheadSampler(batch_sampler, cache, lookahead)
    dataset = CacheBatchDataset(cache, dtype=dtype, width=width, cold=cold, fields=fields, pad=pad, pad_to=pad_to,
                                sample=sample, flip=flip, seed=seed, epoch=epoch, packed=packed)
    return DataLoader(dataset, batch_size=None, sampler=sampler, **dataloader_kwargs)


def collate(items: Sequence[torch.Tensor], white_column: torch.Tensor, *, dtype: torch.dtype | None = None,
            width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Item mode: ``[C, h, w_i]`` latents -> ``(latents [B, C, h, W], widths [B] int32)`` padded with the
    white column (``[C, h, 1]``). Bind ``white_column`` with ``functools.partial`` for a DataLoader."""
    if not items:
        raise InvalidArgumentError("collate needs at least one item")
    first = items[0]
    if first.dim() != 3:
        raise InvalidArgumentError(f"items must be [C, h, w] latents, got shape {tuple(first.shape)} for item 0")
    channels, latent_h = first.shape[:2]
    for k, item in enumerate(items):
        if item.dim() != 3 or tuple(item.shape[:2]) != (channels, latent_h):
            raise InvalidArgumentError(f"item {k} has shape {tuple(item.shape)}, expected [{channels}, {latent_h}, w]")
    widths = torch.tensor([item.shape[-1] for item in items], dtype=torch.int32)
    widest = int(widths.max())
    W = widest if width is None else as_int("width", width, minimum=0)
    if W < widest:
        raise InvalidArgumentError(f"width must be >= the widest item ({widest}), got {width}")
    if tuple(white_column.shape) not in ((channels, latent_h, 1), (channels, latent_h)):
        raise InvalidArgumentError(f"white_column must be [{channels}, {latent_h}, 1], got {tuple(white_column.shape)}")
    dtype = first.dtype if dtype is None else dtype
    out = white_column.reshape(1, channels, latent_h, 1).to(dtype).expand(len(items), -1, -1, W).contiguous()
    for b, item in enumerate(items):
        out[b, :, :, : item.shape[-1]] = item
    return out, widths


# ---- one loader a training loop uses ------------------------------------------------------------
DEFAULT_HOLD = 2  # batches a caller may take after one before its buffers are reused (the ring: hold + 1)
REMOTE_CHUNK_WINDOW = 8  # an object-store cache's default chunk window (see ShardedBatchSampler)


class LatentLoader:
    """The batches of records of a latent cache, one epoch per iteration: bucketed, sharded over
    ranks, resumable mid-epoch, read into reused buffers.

    ``for batch in loader`` yields dicts as :func:`~latentfast.cache.read_batch` returns them for
    ``fields`` (default ``("latent",)``), plus ``"index"``: int64 ``[B]``, the batch's cache indices.
    ``fields``, ``pad``, ``pad_to``, ``packed``, ``sample``, ``flip``, ``dtype``, ``cold`` are
    read_batch's; ``seed`` seeds both the order and the draws (with the epoch).

    Batches: shuffled by ``(seed, epoch)`` (``shuffle=False``: in item order), of one latent shape
    (``buckets=True`` on a shaped cache, or with ``sample``) or of similar widths (a line cache, padded
    with its white column); ``buckets=False``: plain batches. ``drop_last`` drops what does not fill
    whole batches on every rank, else the epoch's first batches are repeated to fill the last round.
    On object storage the order is drawn a window of ``chunk_window`` chunks at a time (``"auto"``:
    :data:`REMOTE_CHUNK_WINDOW` for a remote cache, off for a local one; see
    :class:`~latentfast.cache.feed.sampler.ShardedBatchSampler`).

    Ranks: ``rank`` / ``world_size`` default to ``torch.distributed``'s when it is initialized (else
    0 / 1); the ranks' batches of an epoch are disjoint and together cover it. ``len(loader)`` is this
    rank's batches per epoch. ``set_epoch(e)`` is the one call per epoch (as with DistributedSampler;
    each pass, ``iter(loader)``, begins the epoch from its start, or from a loaded state's position).

    Resuming: ``state_dict()`` records the epoch and the batches *yielded* so far (workers reading
    ahead do not count), as the global position in the epoch's batch list; ``load_state_dict(s)``
    continues from exactly there: the batches that follow equal an uninterrupted run's, bit for bit,
    whatever ``num_workers``. At another world size, the remaining batches of the epoch (those after
    the position, none twice, none lost) are split over the new ranks as a fresh pass would split
    them. A loaded state survives ``set_epoch`` of its own epoch (the usual loop
    ``for e in range(start, E): loader.set_epoch(e)`` resumes in place). A state saved at the end of
    an epoch resumes to an empty rest of that epoch.

    Workers: ``num_workers`` processes read whole batches (each into a ring of its own shared-memory
    buffers, mapped here once: a batch reaches this process as its place in the ring, not a copy nor
    a handle per tensor), started on the first pass and
    kept for the next ones (persistent: the rings are made once); ``prefetch_factor`` batches each
    ahead; ``multiprocessing_context`` as the DataLoader's. A batch of a pass left before its end is
    valid until the next pass begins. ``lookahead``: the rows of the next
    batches are read into the page cache (or fetched from object storage) ahead of the reads.

    Buffers (``recycle=True``): batches are views of a small ring of reused buffers: a batch stays valid
    while the next ``hold`` batches are taken, and the one after may write over it (clone what you keep
    longer; ``recycle=False`` allocates every batch). Host buffers are pinned when the batch goes to a
    GPU (``pin_memory``: default, when ``device`` is CUDA; set it when a
    :class:`~latentfast.cache.DevicePrefetcher` moves the batches, which waits for its copies to end
    before the loader may reuse their buffers), and large ones advised for huge pages. ``device``:
    where the batch lands (a CUDA device: gathered and expanded there; with workers, moved there).

    Several caches (``cache`` a list: kohya's subsets, the splits of ``cache build --from-config``, which
    :func:`~latentfast.cache.open_dataset` opens with their ``num_repeats``): each batch comes from one
    cache and one of its buckets, and has ``"source"``, the cache's position in the list (an int).
    ``repeats=[r0, r1, ...]``: cache ``i``'s items ``r_i`` times an epoch, batched as kohya batches a
    subset with ``num_repeats`` (``ceil(r_i * bucket size / batch_size)`` batches a bucket; a batch may
    hold an item twice, as kohya's may; default: 1 each); ``weights=[w0, w1, ...]``: an epoch of as many
    batches as one pass over every cache, each batch's cache drawn with probability ``w_i / sum(w)``, a
    cache's batches pass after pass, each pass a fresh shuffle (see
    :class:`~latentfast.cache.feed.mix.MixedBatchSampler`). ``flip``: one probability, or one per
    cache (None: that cache read unflipped, its ``flipped`` all False: kohya's ``flip_aug`` per subset).
    Cache ``i``'s order and draws are seeded by :func:`~latentfast.cache.feed.mix.cache_seed` ``(seed,
    i)``; draws are keyed by ``(that seed, the pass, the item's key)``, so with ``repeats`` an item's
    copies in one epoch draw alike (kohya draws its flip at each read). The caches must hold the fields
    read, each of one dtype and rank (an error names the cache and field); a field optional in one
    cache gets ``<field>_present`` in every batch. Everything else (ranks, workers, exact resume at any
    world size, buffers, every read option) is as for one cache.
    """

    def __init__(self, cache, batch_size: int, *, shuffle: bool = True, seed: int = 0, fields=None, pad=None,
                 pad_to=None, packed=(), sample: bool = False, flip=None, buckets: bool = True, drop_last: bool = False,
                 num_workers: int = 0, device="cpu", dtype=None, rank: int | None = None, world_size: int | None = None,
                 cold="auto", recycle: bool = True, hold: int = DEFAULT_HOLD, pin_memory: bool | None = None,
                 lookahead: int = DEFAULT_LOOKAHEAD, prefetch_factor: int = 2, multiprocessing_context=None,
                 chunk_window="auto", repeats=None, weights=None):
        self.mixed = isinstance(cache, (list, tuple))
        self.caches = list(cache) if self.mixed else [cache]
        self.cache = None if self.mixed else cache  # (one cache: the one read)
        if not self.mixed and (repeats is not None or weights is not None or isinstance(flip, (list, tuple))):
            raise InvalidArgumentError("repeats=, weights= and a flip= per cache take a list of caches: "
                                       "LatentLoader([cache_a, cache_b], batch_size, repeats=[2, 1])")
        if self.mixed and not self.caches:
            raise InvalidArgumentError("LatentLoader takes a cache or a non-empty list of caches, got an empty list")
        flips = _flips(flip, len(self.caches)) if self.mixed else [flip]
        seed = as_int("seed", seed, minimum=0)
        self.spec = ReadSpec(fields=("latent",) if fields is None else fields, pad=pad, pad_to=pad_to, packed=packed,
                             sample=sample, flip=None if self.mixed else flip, seed=seed, dtype=dtype, device=device,
                             cold=cold)
        if self.mixed:
            check_fields(self.caches, self.spec.names, dtype, sample is not False, flips)
        # each cache's read: one cache reads with the loader's spec; a mix, with each cache's seed and flip
        self._specs = [self.spec] if not self.mixed else [
            self.spec.replace(seed=cache_seed(seed, i), flip=f) for i, f in enumerate(flips)]
        self._fills = keys_to_fill(self.caches, self.spec.names, flips) if self.mixed else [{}]
        self.device = as_device(device)
        self.num_workers = as_int("num_workers", num_workers, minimum=0)
        self.prefetch_factor = as_int("prefetch_factor", prefetch_factor, minimum=1)
        self.lookahead = as_int("lookahead", lookahead, minimum=0)
        self.hold = as_int("hold", hold, minimum=0)
        self.recycle = bool(recycle)
        self.pin_memory = self.device.type == "cuda" if pin_memory is None else bool(pin_memory)
        self.multiprocessing_context = multiprocessing_context
        rank, world_size = _rank_and_world(rank, world_size)
        order = dict(shuffle=shuffle, buckets=buckets, drop_last=drop_last, sample=sample, chunk_window=chunk_window)
        if not self.mixed:
            self.sampler = _sampler_for(cache, batch_size, seed=seed, rank=rank, world_size=world_size, **order)
        else:
            self.sampler = _mixed_sampler(self.caches, batch_size, seed=seed, rank=rank, world_size=world_size,
                                          repeats=repeats, weights=weights, **order)
        self._reserve = _worst_case_bytes(self.caches, self.spec, self.sampler.batch_size)
        self._prefetch = _SourcesPrefetch(self.caches)
        self._ring: list[BatchBuffers] = []  # this process's slots (made on first use)
        self._next_slot = 0
        self._workers: DataLoader | None = None  # with num_workers: the persistent workers' DataLoader
        self._tasks: _Tasks | None = None
        self._taken = 0  # batches yielded since the pass began (at the sampler's start position)
        self._loaded = False  # a state was loaded and no pass has begun since

    # -- the epoch and its position -----------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.sampler.rank

    @property
    def world_size(self) -> int:
        return self.sampler.world_size

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Make the next pass epoch ``epoch`` from its start (a state just loaded for this epoch is kept)."""
        epoch = as_int("epoch", epoch, minimum=0)
        if self._loaded and epoch == self.sampler.epoch:
            return
        self.sampler.set_epoch(epoch)
        self._taken, self._loaded = 0, False

    def state_dict(self, consumed: int | None = None) -> dict:
        """Where the loop stands: the epoch and the global position after the batches yielded so far in
        this pass, or after the first ``consumed`` of them (a prefetcher that pulls ahead of the loop:
        :meth:`DevicePrefetcher.state_dict <latentfast.cache.DevicePrefetcher.state_dict>` passes it),
        plus what :meth:`load_state_dict` checks the loader against. Plain ints and strings."""
        if consumed is not None and not 0 <= as_int("consumed", consumed, minimum=0) <= self._taken:
            raise InvalidArgumentError(f"consumed must be <= the {self._taken} batches yielded in this pass, got {consumed}")
        return {"sampler": self.sampler.state_dict(consumed=self._taken if consumed is None else consumed)}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or "sampler" not in state:
            raise InvalidArgumentError(f"state must be a LatentLoader.state_dict(), got {type(state).__name__} "
                                       f"{sorted(state) if isinstance(state, dict) else ''}")
        self.sampler.load_state_dict(state["sampler"])
        self._taken, self._loaded = 0, True

    # -- reading -----------------------------------------------------------------------------
    def __iter__(self):
        # a pass begins where a loaded state left off, else at the epoch's start (as a DataLoader's does)
        if not self._loaded:
            self.sampler.set_epoch(self.sampler.epoch)
        self._taken, self._loaded = 0, False
        todo = self.sampler.rank_batches()  # a mix's: (source, epoch of its draws, indices); one cache's: indices
        if not self.mixed:
            todo = _OneCacheTasks(todo, self.sampler.epoch)
        batches = self._in_process(todo) if self.num_workers == 0 else self._from_workers(todo)
        for batch in batches:
            self._taken += 1  # counted as handed over: a state saved while the loop holds it resumes after it
            yield batch

    def _slot(self) -> BatchBuffers | None:
        """The next buffers of this process's ring (``hold + 1`` slots), or None without recycling."""
        if not self.recycle:
            return None
        if not self._ring:
            self._ring = [BatchBuffers(pin=self.pin_memory, reserve=self._reserve) for _ in range(self.hold + 1)]
        slot = self._ring[self._next_slot]
        self._next_slot = (self._next_slot + 1) % len(self._ring)
        return slot

    def _in_process(self, todo: list):
        for task in LookaheadSampler(todo, self._prefetch, self.lookahead):
            yield _read_task(self.caches, self._specs, self._fills, self.mixed, task, self._slot())

    def _from_workers(self, todo: list):
        # a worker's batch k is in flight until this process has taken about prefetch_factor * workers
        # more; its ring holds that many plus the caller's hold before a slot comes round again
        slots = self.prefetch_factor + -(-self.hold // self.num_workers) + 1 if self.recycle else 0
        if self._workers is None:  # persistent: each epoch's pass reuses the workers and their rings
            self._tasks = _Tasks(self._prefetch, self.lookahead)
            token = uuid.uuid4().hex  # names this loader's ring storages in this process (see _RingBatch)
            weakref.finalize(self, _RING_STORAGES.pop, token, None)
            reader = _BatchReader(self.caches, [spec.replace(device="cpu") for spec in self._specs], self._fills,
                                  self.mixed, slots, self._reserve, token)
            self._workers = DataLoader(reader, batch_size=None, sampler=self._tasks, collate_fn=_as_is,
                                       num_workers=self.num_workers, prefetch_factor=self.prefetch_factor,
                                       persistent_workers=True, multiprocessing_context=self.multiprocessing_context)
        self._tasks.todo = todo
        on_device = self.device.type != "cpu"
        for batch in self._workers:
            for key, value in batch.items():
                if isinstance(value, np.ndarray):
                    batch[key] = torch.from_numpy(value)
            if on_device:
                slot = self._slot()
                for name in self.spec.names:
                    host = batch[name]
                    batch[name] = take(slot, name, host.shape, host.dtype, self.device).copy_(host)
            yield batch


def _as_is(batch):
    return batch


def _read_task(caches, specs, fills, mixed: bool, task, out) -> dict:
    """The batch of one task ``(source, epoch, indices)``: read_batch's dict of cache ``source`` with
    the draws of ``epoch`` (into ``out``), plus ``"index"``; in a mix also the entries other caches'
    batches have (:func:`~latentfast.cache.feed.mix.keys_to_fill`) and ``"source"``."""
    source, epoch, indices = task
    index = torch.tensor(indices, dtype=torch.int64)
    batch = read_batch(caches[source], index, specs[source].at_epoch(epoch), out=out)
    for key, value in fills[source].items():
        batch[key] = torch.full((len(index),), value, dtype=torch.bool)
    batch["index"] = index
    if mixed:
        batch["source"] = source
    return batch


class _SourcesPrefetch:
    """What :class:`LookaheadSampler` prefetches a task ``(source, epoch, indices)`` with: the rows of
    cache ``source`` (through the cache's own prefetch where it has one, as for one cache)."""

    def __init__(self, caches: list):
        self.caches = caches

    def prefetch(self, task) -> None:
        source, _, indices = task
        cache = self.caches[source]
        own = getattr(cache, "prefetch", None)
        if own is None:
            coldread.prefetch(cache, indices)
        else:
            own(indices)


class _OneCacheTasks(Sequence):
    """One cache's batches as the tasks ``(0, epoch, indices)`` a mix's are, each made when it is taken:
    the epoch's plan stays the sampler's arrays (a list of every task would hold a Python int per item)."""

    def __init__(self, batches: Sequence, epoch: int):
        self.batches, self.epoch = batches, epoch

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        return (0, self.epoch, self.batches[k])


class _Tasks:
    """What the workers' DataLoader hands its workers in a pass: the tasks ``(source, epoch, indices)``
    of ``todo`` (set before each pass), with the rows of the next ``lookahead`` batches read ahead."""

    def __init__(self, prefetch: _SourcesPrefetch, lookahead: int):
        self.prefetch, self.lookahead = prefetch, lookahead
        self.todo: list = []

    def __len__(self) -> int:
        return len(self.todo)

    def __iter__(self):
        return iter(LookaheadSampler(self.todo, self.prefetch, self.lookahead))


class _BatchReader(Dataset):
    """A worker's reader: ``reader[(source, epoch, indices)]`` is :func:`_read_task`'s batch, in the next
    slot of its ring of shared-memory buffers (made in the worker, on first use), sent as a
    :class:`_RingBatch`; its small entries travel as numpy arrays (pickled by value) instead of a
    shared-memory segment each."""

    def __init__(self, caches: list, specs: list, fills: list, mixed: bool, slots: int, reserve: dict, token: str):
        self.caches, self.specs, self.fills, self.mixed = caches, specs, fills, mixed
        self.slots, self.reserve, self.token = slots, reserve, token
        self._ring: list[BatchBuffers] = []
        self._count = 0
        self._sent: dict = {}  # (slot, buffer key) -> the buffer whose storage the loader's process holds

    def __len__(self) -> int:
        return sum(len(cache) for cache in self.caches)

    def __getitem__(self, task):
        if self.slots and not self._ring:
            self._ring = [BatchBuffers(shared=True, reserve=self.reserve) for _ in range(self.slots)]
        slot = self._count % self.slots if self.slots else None
        self._count += 1
        batch = _read_task(self.caches, self.specs, self.fills, self.mixed, task, None if slot is None else self._ring[slot])
        for key in [k for k in batch if k.endswith(("_shape", "_present")) or k in ("flipped", "index")]:
            batch[key] = batch[key].numpy()
        return batch if slot is None else self._in_ring(batch, slot)

    def _in_ring(self, batch: dict, slot: int) -> "_RingBatch":
        """``batch`` with its tensors in ring slot ``slot`` as :class:`_RingView` s, each buffer's storage
        attached only when the loader's process has not been sent that buffer yet."""
        entries = {}
        for key, value in batch.items():
            found = self._ring[slot].viewed_by(value) if isinstance(value, torch.Tensor) else None
            if found is None:
                entries[key] = value
                continue
            buffer_key, buffer = found
            new = self._sent.get((slot, buffer_key)) is not buffer
            self._sent[(slot, buffer_key)] = buffer
            entries[key] = _RingView((slot, buffer_key), buffer.untyped_storage() if new else None, value.dtype,
                                     tuple(value.shape), value.stride(), value.storage_offset())
        return _RingBatch(self.token, get_worker_info().id, entries)


# this process's map of the workers' ring buffers: {loader token: {(worker, slot, buffer key): storage}}
_RING_STORAGES: dict[str, dict] = {}


class _RingView(NamedTuple):
    """Where a worker's batch tensor lies: ring slot and buffer, its storage (the first time that
    buffer is sent, else None), and the view's dtype, shape, stride and offset (in elements)."""
    buffer: tuple
    storage: torch.UntypedStorage | None
    dtype: torch.dtype
    shape: tuple
    stride: tuple
    offset: int


class _RingBatch:
    """A worker's batch on its way to the loader's process, which rebuilds it as views of the ring
    buffers it holds (:func:`_received`). Why not let torch send the tensors: torch sends a
    shared-memory handle per tensor per batch, a file descriptor passed over a fresh socket
    connection each time (measured: 0.2-0.5 ms per tensor in the loader's process, which then
    lags the workers); here each buffer's handle is sent once, then only its place in the ring."""

    def __init__(self, token: str, worker: int, entries: dict):
        self.token, self.worker, self.entries = token, worker, entries

    def __reduce__(self):
        return _received, (self.token, self.worker, self.entries)


def _received(token: str, worker: int, entries: dict) -> dict:
    """A :class:`_RingBatch` unpickled in the loader's process: the batch dict, its ring entries views
    of the storages kept in :data:`_RING_STORAGES` (a storage sent along replaces that buffer's: a
    worker sends a buffer's storage the first time and after it grew). A worker's batches arrive in
    the order it sent them, so a buffer's storage always comes before the batches that only name it."""
    storages = _RING_STORAGES.setdefault(token, {})
    batch = {}
    for key, entry in entries.items():
        if not isinstance(entry, _RingView):
            batch[key] = entry
            continue
        if entry.storage is not None:
            storages[(worker, *entry.buffer)] = entry.storage
        storage = storages[(worker, *entry.buffer)]
        batch[key] = torch.empty(0, dtype=entry.dtype).set_(storage, entry.offset, entry.shape, entry.stride)
    return batch


def _rank_and_world(rank, world_size) -> tuple[int, int]:
    """Explicit values, else torch.distributed's when a group is initialized, else 0 of 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return (dist.get_rank() if rank is None else rank), (dist.get_world_size() if world_size is None else world_size)
    return (0 if rank is None else rank), (1 if world_size is None else world_size)


def _flips(flip, count: int) -> list:
    """A mix's ``flip=``: one probability (or None) for every cache, or a list of one per cache."""
    if not isinstance(flip, (list, tuple)):
        return [flip] * count
    if len(flip) != count:
        raise InvalidArgumentError(f"flip= as a list must have one probability (or None) per cache ({count}), got {list(flip)!r}")
    return list(flip)


def _sampler_for(cache, batch_size, *, shuffle, seed, buckets, drop_last, sample, rank, world_size, chunk_window,
                 repeats: int = 1):
    """The batch sampler of a LatentLoader: of one shape (a shaped cache, or drawn samples), of similar
    widths (a line cache), or unbucketed; shuffled or in order; chunk windows on object storage.
    ``repeats``: over the cache's items listed that many times (index ``v`` is item ``v % len(cache)``)."""
    def listed(values):  # each item's label (shape, width, chunk) for each time it is listed
        values = np.asarray(values)
        return values if repeats == 1 else np.concatenate([values] * repeats)

    # (a line cache's rows differ only in width: its widths bucket them as its [N, 3] shapes would, without making those)
    labels = listed(cache.shapes if cache.shaped else cache.widths) if buckets and (cache.shaped or sample) else None
    plain = np.zeros(len(cache) * repeats, np.uint8)
    common = dict(rank=rank, world_size=world_size, drop_last=drop_last)
    if not shuffle:
        return InOrderBatchSampler(plain if labels is None else labels, batch_size, **common)
    remote = getattr(cache, "remote", None) is not None or getattr(cache, "url", None) is not None
    if chunk_window == "auto":
        chunk_window = REMOTE_CHUNK_WINDOW if remote else None
    if chunk_window is not None:
        common.update(chunks=listed(item_chunks(cache)), chunk_window=chunk_window)
    if buckets and labels is None:
        return WidthBucketBatchSampler(listed(cache.widths), batch_size, seed=seed, **common)
    return ShapeBucketBatchSampler(plain if labels is None else labels, batch_size, seed=seed, **common)


def _mixed_sampler(caches, batch_size, *, shuffle, seed, buckets, drop_last, sample, rank, world_size, chunk_window,
                   repeats, weights) -> MixedBatchSampler:
    """A mix's sampler: each cache's own (as for one cache, seeded by its cache seed, rank 0 of 1, over
    its items listed ``repeats[i]`` times), ordered into one epoch and sharded by MixedBatchSampler."""
    repeats, weights = mix_options(len(caches), repeats, weights)
    samplers = [_sampler_for(cache, batch_size, shuffle=shuffle, seed=cache_seed(seed, i), buckets=buckets,
                             drop_last=drop_last, sample=sample, rank=0, world_size=1, chunk_window=chunk_window, repeats=r)
                for i, (cache, r) in enumerate(zip(caches, repeats or [1] * len(caches)))]
    return MixedBatchSampler(samplers, [len(cache) for cache in caches], repeats=repeats, weights=weights, shuffle=shuffle,
                             seed=seed, rank=rank, world_size=world_size, drop_last=drop_last)


def _worst_case_bytes(caches, spec: ReadSpec, batch_size: int) -> dict:
    """``{field: bytes}`` of the largest batch of ``batch_size`` items of each field in any of
    ``caches`` (its largest item size times the batch, in the wider of its stored and read dtypes):
    what the ring's buffers are made at, so they are allocated once, not grown batch after batch."""
    reserve = {}
    for cache in caches:
        for name, size in _cache_worst_case(cache, spec, batch_size).items():
            reserve[name] = max(size, reserve.get(name, 0))
    return reserve


def _cache_worst_case(cache, spec: ReadSpec, batch_size: int) -> dict:
    reserve = {}
    for name, field in cache.fields.items():
        shapes = np.asarray(field["shapes"], dtype=np.int64)
        if not len(shapes):
            continue
        if name == "latent" and not cache.shaped:
            largest = int(np.prod(shapes[0, :2])) * int(cache.w_max)
        elif shapes.shape[1]:
            largest = int(shapes[:, 0].max()) * int(np.prod(shapes[:, 1:], axis=1).max(initial=1))
        else:
            largest = 1
        size = max(field["dtype"].itemsize, spec.dtype.itemsize if name == "latent" and spec.dtype is not None else 0)
        reserve[name] = batch_size * (largest * size + 1)  # (+1: a value padded to whole 2-byte units)
    return reserve


# ---- a per-item dataset for torch's own pieces ----------------------------------------------------
class Record(dict):
    """One item's record from :class:`RecordDataset`: ``{field: value of its own shape, ["flipped"],
    "index": int}``, carrying the padding rules (``rules``) :func:`collate_records` applies."""

    __slots__ = ("rules",)

    def __reduce__(self):  # (a worker's records, pickled with their rules)
        return _record, (dict(self), self.rules)


def _record(values: dict, rules) -> Record:
    record = Record(values)
    record.rules = rules
    return record


class RecordDataset(Dataset):
    """``dataset[i]``: item ``i`` of ``cache`` as a :class:`Record`, each field read alone (its own
    shape, bit for bit what :func:`~latentfast.cache.read_batch` gives for it) with the read options of
    ``spec`` (the draws keyed by the item's key, ``seed`` and the epoch of :meth:`set_epoch`). Made by
    ``cache.dataset(...)``; pair it with ``collate_fn=collate_records``, which pads a batch of them as
    read_batch pads (the latent of a line cache with the white column, ``pad`` fields with their
    value, to ``pad_to`` if given; ``packed`` fields back to back). What torch's pieces need
    (``DistributedSampler``, accelerate's ``prepare``); it reads item by item, so it is slower than
    :class:`LatentLoader` (17x on the text records of ``latentfast/bench/bench_loader.py``)."""

    def __init__(self, cache, spec: ReadSpec):
        if spec.width is not None:
            raise InvalidArgumentError("cache.dataset reads items one by one: pass width= to no per-item read")
        self.cache = cache
        self.spec = spec
        # one item has one shape: read it unpadded, unpacked; the rules are the collate's
        self._item_spec = spec.replace(fields=spec.names, pad=None, pad_to=None, packed=())
        white = getattr(cache, "white_column", None)
        self.rules = (None if cache.shaped else white, dict(spec.pad or {}), spec.pad_to, tuple(spec.packed))

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the draws (``sample`` / ``flip``) of the items read from now on."""
        self._item_spec = self._item_spec.at_epoch(epoch)

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, i) -> Record:
        i = as_row_indices([i], len(self.cache))
        batch = read_batch(self.cache, i, self._item_spec)
        record = Record({name: batch[name][0] for name in self._item_spec.fields})
        if "flipped" in batch:
            record["flipped"] = batch["flipped"][0]
        record["index"] = int(i[0])
        record.rules = self.rules
        return record


def collate_records(records: Sequence[Record]) -> dict:
    """A batch of :class:`Record` s (from ``cache.dataset(...)``) as :func:`~latentfast.cache.read_batch`
    returns it: ``{field: [B, ...], "<field>_shape": int64 [B, ndim], ["flipped": bool [B]], "index":
    int64 [B]}``, padded by the dataset's rules. A field of several shapes that is neither padded nor
    packed raises naming it."""
    if not records or not all(isinstance(r, Record) for r in records):
        raise InvalidArgumentError("collate_records takes a non-empty list of the records of cache.dataset(...)")
    white, pad, pad_to, packed = records[0].rules
    batch = {}
    for name in [k for k in records[0] if k not in ("index", "flipped")]:
        values = [r[name] for r in records]
        shapes = torch.tensor([list(v.shape) for v in values], dtype=torch.int64)
        if name in packed:
            batch[name] = torch.cat(values)
        elif name == "latent" and white is not None:
            batch[name] = collate(values, white)[0]
        elif name in pad:
            lead = pad_to.get(name) if isinstance(pad_to, dict) else pad_to
            lead = int(shapes[:, 0].max()) if lead is None else lead
            out = torch.full((len(values), lead, *values[0].shape[1:]), pad[name], dtype=values[0].dtype)
            for b, value in enumerate(values):
                out[b, : value.shape[0]] = value
            batch[name] = out
        else:
            if bool((shapes != shapes[0]).any()):
                raise InvalidArgumentError(f"field {name!r}: the batch's items have shapes {shapes.unique(dim=0).tolist()}; "
                                           f"name it in pad= (or packed=) of cache.dataset to pad it to the largest")
            batch[name] = torch.stack(values)
        batch[name + "_shape"] = shapes
    if "flipped" in records[0]:
        batch["flipped"] = torch.stack([r["flipped"] for r in records])
    batch["index"] = torch.tensor([r["index"] for r in records], dtype=torch.int64)
    return batch
