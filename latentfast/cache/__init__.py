"""Offline VAE latent cache: format, builders, writer, importers, reader, the fast batch path and DataLoader pieces."""
from __future__ import annotations

from .build.lines import ImageError, build_latent_cache, cache_meta_for, list_source
from .store.format import (
    FORMAT_VERSION,
    LAYOUTS,
    SEED_FIELDS,
    block_checksums,
    cache_path,
    ragged_offsets,
    read_meta,
    stamp_differences,
)
from .feed.gather import read_batch
from .feed.device import DevicePrefetcher
from .feed.loader import CacheBatchDataset, batch_loader, collate
from .store.reader import CacheCorruptError, IncompleteCacheError, LatentCache, inspect_cache, verify_cache
from .build.images import build_image_cache, build_video_cache
from .build.importers import import_latents
from .feed.sampler import LookaheadSampler, ShapeBucketBatchSampler, WidthBucketBatchSampler, item_chunks
from .store.writer import LatentCacheWriter
from ..errors import CacheLockedError

__all__ = [
    # format
    "FORMAT_VERSION",
    "LAYOUTS",
    "SEED_FIELDS",
    "block_checksums",
    "cache_path",
    "ragged_offsets",
    "read_meta",
    "stamp_differences",
    # builder
    "ImageError",
    "build_latent_cache",
    "cache_meta_for",
    "list_source",
    # reader
    "CacheCorruptError",
    "IncompleteCacheError",
    "LatentCache",
    "inspect_cache",
    "verify_cache",
    # shaped caches: writer, image / video builders, importers
    "CacheLockedError",
    "LatentCacheWriter",
    "build_image_cache",
    "build_video_cache",
    "import_latents",
    # fast batch path and DataLoader integration
    "read_batch",
    "WidthBucketBatchSampler",
    "ShapeBucketBatchSampler",
    "item_chunks",
    "CacheBatchDataset",
    "batch_loader",
    "collate",
    "DevicePrefetcher",
    "LookaheadSampler",
]
