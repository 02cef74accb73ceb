"""DataLoader integration: width-bucketed batch sampling, whole-batch reads, white padding, device prefetch.

Typical use (every worker reads whole batches with the compiled gather; no per-item collate)::

    sampler = WidthBucketBatchSampler(cache.widths, batch_size=64, seed=0, rank=rank, world_size=world)
    loader = batch_loader(cache, sampler, num_workers=4, pin_memory=True)
    for latents, widths, indices in DevicePrefetcher(loader, "cuda"):
        ...

Read-ahead, on by default at both ends: :func:`batch_loader` has the rows of the next
``lookahead`` batches read into the page cache in the background (for caches bigger than RAM), and
:class:`DevicePrefetcher` pulls and moves the next ``lookahead`` batches in a background thread, so
neither the disk nor the copy waits on the training step.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from ... import ops
from ...devices import as_device, map_tensors
from ...errors import DeviceUnavailableError, InvalidArgumentError
from .gather import read_batch
from .coldread import DEFAULT_LOOKAHEAD, LookaheadSampler, _check_lookahead
from .sampler import WidthBucketBatchSampler  # noqa: F401  (its historical home)


class CacheBatchDataset(Dataset):
    """Dataset whose item is a whole batch: ``dataset[indices]`` -> ``(latents, widths, indices)`` via the
    compiled gather. Use with ``DataLoader(batch_size=None, sampler=<batch sampler>)`` (see
    :func:`batch_loader`, which also reads ahead), so each worker reads a batch in one call instead of
    collating items. ``indices`` must be integers (floats are refused, never rounded); ``dtype``,
    ``width`` and ``cold`` go to :func:`~latentfast.cache.read_batch`."""

    def __init__(self, cache, *, dtype: torch.dtype | None = None, width: int | None = None, cold="auto"):
        self.cache, self.dtype, self.width, self.cold = cache, dtype, width, cold

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, indices):
        index = ops.as_row_indices(indices, len(self.cache))
        latents, widths = read_batch(self.cache, index, dtype=self.dtype, width=self.width, cold=self.cold)
        return latents, widths, index


def batch_loader(
    cache, batch_sampler: Iterable[list[int]], *, dtype=None, width=None, lookahead: int = DEFAULT_LOOKAHEAD,
    cold="auto", **dataloader_kwargs
) -> DataLoader:
    """A DataLoader yielding ``(latents [B, C, h, W], widths [B], indices [B])`` for each batch of
    ``batch_sampler``; ``dataloader_kwargs`` (num_workers, pin_memory, multiprocessing_context, ...)
    go to the DataLoader.

    ``lookahead``: while a batch is read, the rows of the next ``lookahead`` batches are read into the
    page cache in the background (:class:`~latentfast.cache.prefetch.LookaheadSampler`; 0 turns it
    off). It costs nothing measurable when the cache is in RAM and hides the disk when it is not.
    A sampler with ``upcoming()`` (as :class:`WidthBucketBatchSampler`) is peeked, not advanced."""
    sampler = LookaheadSampler(batch_sampler, cache, lookahead)
    dataset = CacheBatchDataset(cache, dtype=dtype, width=width, cold=cold)
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
    W = widest if width is None else ops.as_int("width", width, minimum=0)
    if W < widest:
        raise InvalidArgumentError(f"width must be >= the widest item ({widest}), got {width}")
    if tuple(white_column.shape) not in ((channels, latent_h, 1), (channels, latent_h)):
        raise InvalidArgumentError(f"white_column must be [{channels}, {latent_h}, 1], got {tuple(white_column.shape)}")
    dtype = first.dtype if dtype is None else dtype
    out = white_column.reshape(1, channels, latent_h, 1).to(dtype).expand(len(items), -1, -1, W).contiguous()
    for b, item in enumerate(items):
        out[b, :, :, : item.shape[-1]] = item
    return out, widths


class DevicePrefetcher:
    """Iterate ``batches`` on ``device``, with the next ``lookahead`` batches pulled from ``batches``
    and copied to the device ahead of the loop.

    A batch may be a tensor or a (nested) tuple / list / dict of them; other values pass through.

    Args:
        batches: any iterable of batches (a DataLoader, a generator of ``cache.read_batch`` calls).
        device: where batches land, read with :func:`latentfast.devices.as_device`. Default ``"cuda"``
            (the current CUDA device): moving batches there is this class's job. A CPU device only
            reads ahead.
        lookahead: batches prepared ahead of the one in use by a background thread (default 2), so
            reading them (disk, gather, host-to-device copy on a side stream) overlaps the training
            step; ``0``: no thread, only batch k+1's copy overlaps step k. The thread runs
            ``batches`` with the loop's current CUDA device; errors it meets are raised in the loop.

    The copies are asynchronous when the host tensors are pinned (``DataLoader(pin_memory=True)``). A
    batch already on a CUDA device is ordered after the work that produced it: the side stream waits
    on the producing thread's current stream of every device the batch is on. Pulling ahead advances
    a sampler behind ``batches`` ahead of the loop: pass ``consumed=`` to its ``state_dict``.
    """

    def __init__(self, batches: Iterable, device="cuda", *, lookahead: int = DEFAULT_LOOKAHEAD):
        self.batches = batches
        self.device = as_device(device)
        self.lookahead = _check_lookahead(lookahead)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise DeviceUnavailableError(f"DevicePrefetcher(device={str(self.device)!r}): CUDA is not available here")

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        if self.lookahead:
            return self._threaded()
        if self.device.type != "cuda":
            return iter(self.batches)
        return self._inline()

    def _inline(self):
        stream = torch.cuda.Stream(self.device)
        pending = None
        for batch in self.batches:
            moved = self._move(batch, stream)
            if pending is not None:
                yield self._hand_over(*pending)
            pending = moved
        if pending is not None:
            yield self._hand_over(*pending)

    def _threaded(self):
        """Batches from a producer thread, at most ``lookahead`` ahead; its errors are raised here."""
        ready: queue.Queue = queue.Queue(maxsize=self.lookahead)
        stop = threading.Event()
        source = iter(self.batches)  # made in the loop's thread (DataLoader iterators set up signals)
        # the producer runs `batches` as the loop's thread would: with its current CUDA device ("cuda" in
        # a read_batch call means that one), never initialising CUDA for a loop that does not use it
        current = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        producer = threading.Thread(target=self._produce, args=(source, ready, stop, current), daemon=True,
                                    name="latentfast-device-prefetch")
        producer.start()
        try:
            while True:
                kind, item = ready.get()
                if kind == "end":
                    return
                if kind == "error":
                    raise item
                yield self._hand_over(*item)
        finally:
            # a loop that stops early: the producer finishes the batch it is making and exits, and with
            # it go its references (to the source, to its batches), before this returns
            stop.set()
            producer.join()

    def _produce(self, source, ready: queue.Queue, stop: threading.Event, cuda_device: int | None) -> None:
        def put(entry) -> bool:
            while not stop.is_set():
                try:
                    ready.put(entry, timeout=0.05)
                    return True
                except queue.Full:
                    continue
            return False

        try:
            if cuda_device is not None:
                torch.cuda.set_device(cuda_device)
            stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            for batch in source:
                if not put(("batch", self._move(batch, stream))):
                    return
            put(("end", None))
        except BaseException as exc:  # handed to the loop's thread, which raises it
            put(("error", exc))

    def _move(self, batch, stream):
        """``(batch on the device, event after its copy)``, copied on ``stream`` (None: the CPU)."""
        if stream is None:
            return batch, None
        producers = {t.device for t in _tensors(batch) if t.is_cuda}
        for device in producers:  # the batch's tensors are complete once these streams' work is
            stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            moved = map_tensors(lambda t: t.to(self.device, non_blocking=True), batch)
            ready = torch.cuda.Event()
            ready.record(stream)
        return moved, ready

    def _hand_over(self, batch, ready):
        if ready is None:
            return batch
        current = torch.cuda.current_stream(self.device)
        current.wait_event(ready)
        for tensor in _tensors(batch):  # made on another stream, used on this one from now on
            if tensor.is_cuda:
                tensor.record_stream(current)
        return batch


def _tensors(value) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(found.append, value)
    return found
