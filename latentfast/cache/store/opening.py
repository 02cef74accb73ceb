"""Opening a cache by where it is: the one module that knows every kind.

- a local folder of one cache: :class:`~latentfast.cache.store.reader.LatentCache`, its files read
  through memory maps;
- a folder of shards (a manifest): :class:`~latentfast.cache.store.shards.ShardedCache`, which composes
  the shards' caches;
- an object-store URL (``s3://...``): either of those handed an object-storage strategy
  (:class:`~latentfast.cache.remote.files.RemoteFiles` / :class:`~latentfast.cache.remote.files.RemoteShards`:
  the files as sparse local copies, the index fetched by block and the data through the node-local chunk cache).

The reader and the shards know nothing of object storage, and the reader nothing of shards: this
module, at the top of the store, chooses for them (``latentfast.cache.LatentCache`` is its class).
"""
from __future__ import annotations

import abc
import concurrent.futures
import os
from typing import Any

from ...errors import InvalidArgumentError
from ..remote.errors import RemoteNotFoundError
from ..remote.files import RemoteFiles, RemoteShards
from ..remote.storage import ObjectFolder, is_remote
from . import format as fmt
from . import reader, shards
from .manifest import is_sharded_folder, manifest_path


def is_sharded(cache_dir, split: str, storage_options: dict | None = None) -> bool:
    """Whether ``cache_dir`` (a folder, or an object-store URL) holds a sharded cache of ``split`` (a
    manifest and no single-cache meta)."""
    if not is_remote(cache_dir):
        return is_sharded_folder(cache_dir, split)
    folder = ObjectFolder(str(cache_dir).rstrip("/"), storage_options)

    def exists(name: str) -> bool:
        try:
            folder.head(name)
            return True
        except RemoteNotFoundError:
            return False

    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # (both HEADs at once: one round trip)
        manifest, meta = pool.map(exists, (os.path.basename(manifest_path("", split)), os.path.basename(fmt.cache_path("", split, "meta"))))
    return manifest and not meta


def check_local_options(cache_dir: str, storage_options, local_cache, local_cache_bytes) -> None:
    """A local folder takes none of the object-storage arguments."""
    if storage_options is not None or local_cache is not None or local_cache_bytes is not None:
        raise InvalidArgumentError(f"storage_options, local_cache and local_cache_bytes are for caches in object "
                                   f"storage (s3://...), not the local folder {cache_dir!r}")


def open_sharded(cache_dir, split: str = "train", expected: Any = None, white_column: Any = None, *, verify_rows: bool = False,
                 storage_options: dict | None = None, local_cache=None, local_cache_bytes: int | None = None) -> shards.ShardedCache:
    """The sharded cache at ``cache_dir`` (a folder or an object-store URL; the arguments are :class:`LatentCache`'s)."""
    storage = None
    if is_remote(os.fspath(cache_dir)):
        storage = RemoteShards(os.fspath(cache_dir), split, storage_options, local_cache, local_cache_bytes)
    else:
        check_local_options(os.fspath(cache_dir), storage_options, local_cache, local_cache_bytes)
    return shards.ShardedCache(cache_dir, split, expected, white_column, verify_rows=verify_rows, storage=storage)


class LatentCache(reader.LatentCache, metaclass=abc.ABCMeta):
    __doc__ = reader.LatentCache.__doc__ + """
    Opened through this class (``latentfast.cache.LatentCache``), ``cache_dir`` may also be a folder of
    shards (a :class:`~latentfast.cache.store.shards.ShardedCache` is returned: it reads as one cache) or
    an object-store URL (``s3://bucket/prefix``, a folder that ``latentfast cache push`` filled):
    ``storage_options`` (endpoint, keys, retries; the AWS environment variables otherwise),
    ``local_cache`` (a folder on this node's disk) and ``local_cache_bytes`` (its budget; both default to
    the node's, see :func:`latentfast.cache.remote.files.local_cache_or_default`) then say how to reach it
    and where its fetched chunks live (see :mod:`latentfast.cache.remote.files`).
    """

    def __new__(cls, cache_dir=None, split: str = "train", *args, **kwargs):
        if cls is LatentCache and cache_dir is not None and is_sharded(cache_dir, split, kwargs.get("storage_options")):
            return open_sharded(cache_dir, split, *args, **kwargs)  # (not an instance of cls: __init__ is not called again)
        return super().__new__(cls)

    def __init__(self, cache_dir: str | os.PathLike, split: str = "train", expected: Any = None, white_column: Any = None, *,
                 verify_rows: bool = False, storage_options: dict | None = None, local_cache: str | os.PathLike | None = None,
                 local_cache_bytes: int | None = None):
        storage = None
        if is_remote(os.fspath(cache_dir)):
            storage = RemoteFiles(os.fspath(cache_dir), split, storage_options, local_cache, local_cache_bytes)
        else:
            check_local_options(os.fspath(cache_dir), storage_options, local_cache, local_cache_bytes)
        super().__init__(cache_dir, split, expected, white_column, verify_rows=verify_rows, storage=storage)

    @classmethod
    def __subclasshook__(cls, other):
        # every reader of a cache is one: what LatentCache(folder of shards) returns (a ShardedCache), and
        # a cache the reader module opened itself (a shard, a cache a builder just wrote)
        return True if issubclass(other, reader.LatentCache) else NotImplemented


def verify_cache(cache_dir: str | os.PathLike, split: str = "train", **remote) -> dict:
    """Recompute every block checksum, check every value is finite (the latents' and every float field's)
    and every index valid -- of one cache, or of every shard of a sharded one.

    Raises :class:`~latentfast.errors.CacheCorruptError` naming the first bad block or row (also for
    malformed meta or index files); returns ``{"rows", "bytes", "blocks", "checksummed", "seconds",
    "gb_per_s"}`` (and ``"shards"`` for a sharded cache). ``seconds`` counts the checks, not the open.
    ``gb_per_s`` is the rate of this pass, from whatever page cache state the file was in (a second run
    over a cache that fits in RAM measures a hot page cache, not the disk). ``remote``:
    ``storage_options``, ``local_cache``, ``local_cache_bytes`` of a cache in object storage."""
    return shards.verify_opened(LatentCache(cache_dir, split, **remote))  # (opening validates sizes, widths, shapes, offsets)


def inspect_cache(cache_dir: str | os.PathLike, split: str = "train", bins: int = 10, **remote) -> dict:
    """Meta, row count, bytes on disk, padding waste and a latent-width histogram (line caches), or the
    count of items per shape (shaped caches); a sharded cache's summed over its shards, plus ``shards``.
    ``remote``: as :func:`verify_cache`'s."""
    return shards.inspect_opened(LatentCache(cache_dir, split, **remote), bins)


__all__ = ["LatentCache", "inspect_cache", "is_sharded", "open_sharded", "verify_cache"]
