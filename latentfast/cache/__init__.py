"""Offline VAE latent cache: format, builders, writer, importers, reader, the fast batch path and DataLoader pieces.

The names below are imported on first use (module ``__getattr__``): ``import latentfast.cache`` stays cheap,
and a reader never pays for the builders, the trainer importers, object storage or the vision modules.
"""
from __future__ import annotations

import importlib

# name -> the submodule (relative to this package) that defines it
_EXPORTS = {
    # format
    "FORMAT_VERSION": ".store.format",
    "LAYOUTS": ".store.format",
    "SEED_FIELDS": ".store.format",
    "block_checksums": ".store.format",
    "cache_path": ".store.format",
    "ragged_offsets": ".store.format",
    "read_meta": ".store.format",
    "stamp_differences": ".store.format",
    # builder
    "ImageError": ".builders.lines",
    "build_latent_cache": ".builders.lines",
    "cache_meta_for": ".builders.lines",
    "list_source": ".builders.lines",
    # reader
    "CacheCorruptError": ".store.reader",
    "IncompleteCacheError": ".store.reader",
    "LatentCache": ".store.opening",
    "inspect_cache": ".store.opening",
    "verify_cache": ".store.opening",
    # shaped caches: writer, image / video builders, importers
    "CacheLockedError": "..errors",
    "AbsentValueError": "..errors",
    "LatentCacheWriter": ".store.writer",
    "build_image_cache": ".builders.images",
    "build_video_cache": ".builders.images",
    "import_latents": ".builders.importers",
    # fast batch path and DataLoader integration
    "read_batch": ".feed.gather",
    "WidthBucketBatchSampler": ".feed.sampler",
    "ShapeBucketBatchSampler": ".feed.sampler",
    "item_chunks": ".feed.sampler",
    "CacheBatchDataset": ".feed.loader",
    "LatentLoader": ".feed.loader",
    "open_dataset": ".dataset_config",
    "ConfigDataset": ".dataset_config",
    "RecordDataset": ".feed.loader",
    "collate_records": ".feed.loader",
    "ReadSpec": ".feed.readspec",
    "BatchBuffers": ".feed.buffers",
    "InOrderBatchSampler": ".feed.sampler",
    "batch_loader": ".feed.loader",
    "collate": ".feed.loader",
    "DevicePrefetcher": ".feed.device",
    "LookaheadSampler": ".feed.sampler",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
