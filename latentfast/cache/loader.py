"""DataLoader integration: width-bucketed batch sampling, whole-batch reads, white padding, device prefetch.

Typical use (every worker reads whole batches with the compiled gather; no per-item collate)::

    sampler = WidthBucketBatchSampler(cache.widths, batch_size=64, seed=0, rank=rank, world_size=world)
    loader = batch_loader(cache, sampler, num_workers=4, pin_memory=True)
    for latents, widths, indices in DevicePrefetcher(loader, "cuda"):
        ...
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .decode import read_batch


class WidthBucketBatchSampler(Sampler[list[int]]):
    """Batches of rows of similar width, seeded, sharded by rank, resumable mid-epoch.

    Each epoch: a seeded permutation of all rows is cut into chunks of ``batch_size *
    bucket_batches`` rows; each chunk is sorted by width (so its batches are narrow or wide
    together, cutting padding) and cut into batches; the batch order is then shuffled. Rank ``r``
    of ``world_size`` takes batches ``r, r + world_size, ...``; every rank gets the same number of
    batches: with ``drop_last`` the incomplete last batch and the batches that do not divide
    evenly are dropped, without it the first batches are repeated to fill the last round.

    Call :meth:`set_epoch` before each epoch (as with ``DistributedSampler``). ``state_dict()``
    records the epoch and how many of this rank's batches were consumed; ``load_state_dict()``
    makes the next iteration continue from exactly there.
    """

    def __init__(
        self,
        widths: Sequence[int] | np.ndarray,
        batch_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        bucket_batches: int = 64,
    ):
        self.widths = np.asarray(widths)
        if self.widths.ndim != 1:
            raise ValueError(f"widths must be 1-D (one per row), got shape {self.widths.shape}")
        for name, value, low in (("batch_size", batch_size, 1), ("world_size", world_size, 1),
                                 ("bucket_batches", bucket_batches, 1), ("rank", rank, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if rank >= world_size:
            raise ValueError(f"rank must be < world_size={world_size}, got {rank}")
        self.batch_size, self.seed, self.rank, self.world_size = batch_size, seed, rank, world_size
        self.drop_last, self.bucket_batches = drop_last, bucket_batches
        self.epoch = 0
        self.consumed = 0  # batches of this rank's current epoch already handed out

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
        start = self.consumed
        for position in range(start, len(batches)):
            self.consumed = position + 1
            yield batches[position]
        self.consumed = 0  # a finished epoch: the next iteration starts the epoch over

    def __len__(self) -> int:
        n_batches = len(self.widths) // self.batch_size if self.drop_last else -(-len(self.widths) // self.batch_size)
        per_rank = n_batches // self.world_size if self.drop_last else -(-n_batches // self.world_size)
        return per_rank

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self.consumed = 0

    def state_dict(self, consumed: int | None = None) -> dict:
        """``consumed``: batches the training loop really used this epoch; pass it when a DataLoader
        prefetches (the sampler has then handed out more batches than were consumed)."""
        return {"seed": self.seed, "epoch": self.epoch, "consumed": self.consumed if consumed is None else consumed,
                "rank": self.rank, "world_size": self.world_size, "batch_size": self.batch_size}

    def load_state_dict(self, state: dict) -> None:
        for key in ("seed", "world_size", "batch_size"):
            if state[key] != getattr(self, key):
                raise ValueError(f"state_dict was saved with {key}={state[key]}, this sampler has {getattr(self, key)}")
        self.epoch, self.consumed = int(state["epoch"]), int(state["consumed"])


class CacheBatchDataset(Dataset):
    """Dataset whose item is a whole batch: ``dataset[indices]`` -> ``(latents, widths, indices)`` via the
    compiled gather. Use with ``DataLoader(batch_size=None, sampler=<batch sampler>)`` (see
    :func:`batch_loader`), so each worker reads a batch in one call instead of collating items."""

    def __init__(self, cache, *, dtype: torch.dtype | None = None, width: int | None = None):
        self.cache, self.dtype, self.width = cache, dtype, width

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, indices):
        index = torch.as_tensor(indices, dtype=torch.int64)
        latents, widths = read_batch(self.cache, index, dtype=self.dtype, width=self.width)
        return latents, widths, index


def batch_loader(
    cache, batch_sampler: Iterable[list[int]], *, dtype=None, width=None, **dataloader_kwargs
) -> DataLoader:
    """A DataLoader yielding ``(latents [B, C, h, W], widths [B], indices [B])`` for each batch of
    ``batch_sampler``; ``dataloader_kwargs`` (num_workers, pin_memory, multiprocessing_context, ...)
    go to the DataLoader."""
    return DataLoader(
        CacheBatchDataset(cache, dtype=dtype, width=width), batch_size=None, sampler=batch_sampler, **dataloader_kwargs
    )


def collate(items: Sequence[torch.Tensor], white_column: torch.Tensor, *, dtype: torch.dtype | None = None,
            width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Item mode: ``[C, h, w_i]`` latents -> ``(latents [B, C, h, W], widths [B] int32)`` padded with the
    white column (``[C, h, 1]``). Bind ``white_column`` with ``functools.partial`` for a DataLoader."""
    if not items:
        raise ValueError("collate needs at least one item")
    first = items[0]
    if first.dim() != 3:
        raise ValueError(f"items must be [C, h, w] latents, got shape {tuple(first.shape)} for item 0")
    channels, latent_h = first.shape[:2]
    for k, item in enumerate(items):
        if item.dim() != 3 or tuple(item.shape[:2]) != (channels, latent_h):
            raise ValueError(f"item {k} has shape {tuple(item.shape)}, expected [{channels}, {latent_h}, w]")
    widths = torch.tensor([item.shape[-1] for item in items], dtype=torch.int32)
    widest = int(widths.max())
    W = widest if width is None else width
    if W < widest:
        raise ValueError(f"width must be >= the widest item ({widest}), got {width}")
    if tuple(white_column.shape) not in ((channels, latent_h, 1), (channels, latent_h)):
        raise ValueError(f"white_column must be [{channels}, {latent_h}, 1], got {tuple(white_column.shape)}")
    dtype = first.dtype if dtype is None else dtype
    out = white_column.reshape(1, channels, latent_h, 1).to(dtype).expand(len(items), -1, -1, W).contiguous()
    for b, item in enumerate(items):
        out[b, :, :, : item.shape[-1]] = item
    return out, widths


class DevicePrefetcher:
    """Iterate ``batches`` on ``device``, copying batch k+1 on a side stream while batch k is used.

    A batch may be a tensor or a (nested) tuple / list / dict of them; other values pass through.
    The copies are asynchronous when the host tensors are pinned (``DataLoader(pin_memory=True)``).
    On a CPU device this is a pass-through.
    """

    def __init__(self, batches: Iterable, device="cuda"):
        self.batches = batches
        self.device = torch.device(device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"DevicePrefetcher(device={str(self.device)!r}): CUDA is not available here")

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        if self.device.type != "cuda":
            yield from self.batches
            return
        stream = torch.cuda.Stream(self.device)
        pending = None
        for batch in self.batches:
            with torch.cuda.stream(stream):
                moved = _to_device(batch, self.device)
                ready = torch.cuda.Event()
                ready.record(stream)
            if pending is not None:
                yield self._hand_over(*pending)
            pending = (moved, ready)
        if pending is not None:
            yield self._hand_over(*pending)

    def _hand_over(self, batch, ready):
        current = torch.cuda.current_stream(self.device)
        current.wait_event(ready)
        _record_stream(batch, current)  # the memory was allocated on the side stream
        return batch


def _to_device(value, device):
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, dict):
        return {key: _to_device(item, device) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        moved = [_to_device(item, device) for item in value]
        return type(value)(*moved) if hasattr(value, "_fields") else type(value)(moved)
    return value


def _record_stream(value, stream) -> None:
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            value.record_stream(stream)
    elif isinstance(value, dict):
        for item in value.values():
            _record_stream(item, stream)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _record_stream(item, stream)
