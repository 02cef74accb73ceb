"""Offline VAE latent cache: format, builders, writer, importers, reader, the fast batch path and DataLoader pieces."""
from __future__ import annotations

from .builder import ImageError, build_latent_cache, cache_meta_for, list_source
from .format import (
    FORMAT_VERSION,
    LAYOUTS,
    SEED_FIELDS,
    block_checksums,
    cache_path,
    ragged_offsets,
    read_meta,
    stamp_differences,
)
from .decode import read_batch
from .loader import CacheBatchDataset, DevicePrefetcher, WidthBucketBatchSampler, batch_loader, collate
from .prefetch import LookaheadSampler
from .reader import CacheCorruptError, IncompleteCacheError, LatentCache, inspect_cache, verify_cache
from .images import build_image_cache, build_video_cache
from .importers import import_latents
from .sampler import ShapeBucketBatchSampler
from .writer import LatentCacheWriter
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
    "CacheBatchDataset",
    "batch_loader",
    "collate",
    "DevicePrefetcher",
    "LookaheadSampler",
]
