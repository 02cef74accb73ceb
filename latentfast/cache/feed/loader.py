"""DataLoader integration: whole-batch reads in the workers (CacheBatchDataset, batch_loader) and per-item collate with white padding.

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

from collections.abc import Iterable, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from ...checks import as_int, as_row_indices
from ...errors import InvalidArgumentError
from .coldread import DEFAULT_LOOKAHEAD
from .gather import read_batch
from .readspec import ReadSpec
from .sampler import LookaheadSampler


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
