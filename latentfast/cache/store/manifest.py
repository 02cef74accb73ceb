"""The files of a sharded cache: where its manifest and order file lie and what a manifest must hold.

What they mean (a manifest naming shard caches, an order mapping items to shard rows) is
:mod:`latentfast.cache.store.shards`'s; this module is the format alone, so the object-storage side
(:mod:`latentfast.cache.remote`: mirroring a manifest, pushing a sharded folder) reads it without the
reader.
"""
from __future__ import annotations

import json
import os
import posixpath

from ...errors import CacheCorruptError
from . import format as fmt

FORMAT = "latentfast-shards"
VERSION = 1


def manifest_path(cache_dir, split: str) -> str:
    return os.path.join(os.fspath(cache_dir), f"{split}.shards.json")


def order_path(cache_dir, split: str) -> str:
    return os.path.join(os.fspath(cache_dir), f"{split}.shards.order.npy")


def is_sharded_folder(cache_dir, split: str) -> bool:
    """Whether the local folder ``cache_dir`` holds a sharded cache of ``split`` (a manifest and no
    single-cache meta)."""
    return os.path.exists(manifest_path(cache_dir, split)) and not os.path.exists(fmt.cache_path(cache_dir, split, "meta"))


def shard_path_inside(path: str) -> bool:
    """Whether a manifest entry's ``path`` names a folder under the manifest's own (no ``..``, not absolute)."""
    return bool(path) and not posixpath.isabs(path) and ".." not in path.replace(os.sep, "/").split("/")


def remote_shard_url(url: str, path: str, manifest: str) -> str:
    """The URL of a shard of the sharded cache at ``url`` from its manifest entry's relative ``path``."""
    if not shard_path_inside(path):
        raise CacheCorruptError(f"sharded cache manifest {manifest}: shard path {path!r} leaves the cache's prefix {url}; "
                                f"in object storage every shard lies under it (push a `cache merge --copy` or a distributed build)")
    return url.rstrip("/") + "/" + posixpath.normpath(path.replace(os.sep, "/"))


def load_manifest(path: str) -> dict:
    """The manifest at ``path``, checked to be one (:class:`CacheCorruptError` names what is wrong)."""
    try:
        with open(path, encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CacheCorruptError(f"sharded cache manifest {path} is not valid JSON: {exc}") from None
    ok = (isinstance(manifest, dict) and manifest.get("format") == FORMAT and manifest.get("version") == VERSION
          and isinstance(manifest.get("shards"), list) and manifest["shards"]
          and all(isinstance(e, dict) and isinstance(e.get("path"), str) and isinstance(e.get("n"), int)
                  and isinstance(e.get("meta_crc"), int) for e in manifest["shards"]) and isinstance(manifest.get("order_crc"), int))
    if not ok:
        raise CacheCorruptError(f"sharded cache manifest {path} must be a {FORMAT} version {VERSION} object with a list "
                                f"of shards ({{path, n, meta_crc}}) and order_crc")
    return manifest
