"""Move a whole cache folder to and from object storage.

``push`` uploads every file, the meta files (``*meta.json``, ``*manifest.json``) last and a sharded
cache's manifest (``*.shards.json``) after its shards' metas -- and first deletes the remote copies
of those, so a reader that sees a meta sees every data file it names complete, whether the push is
new, resumed or replaces an older cache. Large files upload in parts. A sharded cache whose
manifest names shards outside the folder (a ``cache merge`` without ``--copy``) is refused.
``pull`` refuses a folder without a meta (a push that did not finish) and downloads every file into
a hidden staging folder inside the destination (each fsynced), checks it there, and only then
renames the files into place, the meta files last -- so a pull that fails its checks leaves the
folder as it was (an earlier pull's cache included), never a meta over corrupt data. The checks:
every file's size against the object's; its MD5 against the ETag where the ETag is one (a single-part
upload: S3 and its look-alikes set it to the MD5 of the bytes; a multipart upload's is not, and is
not checked); and, unless ``verify=False``, :func:`~latentfast.cache.verify_cache` of every split
(each block's CRC-32, each index file's CRC-32 recorded in the meta, finiteness, the index). A cache
without checksums that was pushed in parts is therefore checked by sizes, finiteness and index only.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil

from ...errors import InvalidArgumentError
from ...progress import progress_bar
from ..store.format import fsync_dir
from ..store.manifest import load_manifest, shard_path_inside
from ..store.shards import open_folder, verify_opened
from .errors import RemoteCorruptError, RemoteNotFoundError, RemoteReadError
from .storage import ObjectFolder

_TEMP_SUFFIX = ".pulling"


def is_meta(name: str) -> bool:
    """Files that declare a cache complete: written last, read first."""
    return name.endswith(("meta.json", "manifest.json", ".shards.json"))


def _publish_order(names: list[str]) -> list[str]:
    """Data first, then the metas, a sharded cache's manifest (over its shards' metas) last."""
    return sorted(names, key=lambda n: (is_meta(n), n.endswith(".shards.json"), n))


def _local_files(local_dir: str) -> list[str]:
    names = []
    for root, _dirs, files in os.walk(local_dir):
        for f in files:
            rel = os.path.relpath(os.path.join(root, f), local_dir).replace(os.sep, "/")
            if not f.startswith(".") and not f.endswith((".tmp", _TEMP_SUFFIX)):  # locks, temporaries
                names.append(rel)
    return _publish_order(names)


def _check_shards_inside(local_dir: str, names: list[str]) -> None:
    """Every shard a manifest in the folder names lies in the folder (what is pushed is all there is)."""
    for name in names:
        if name.endswith(".shards.json") and "/" not in name:
            path = os.path.join(local_dir, name)
            for entry in load_manifest(path)["shards"]:
                if not shard_path_inside(entry["path"]):
                    raise InvalidArgumentError(
                        f"push: {path} names the shard {entry['path']!r} outside {local_dir!r} (a `cache merge` without "
                        f"--copy): merge with --copy first, so the pushed folder holds every shard")


def push(local_dir: str, url: str, storage_options: dict | None = None) -> list[str]:
    """Upload the cache folder ``local_dir`` to ``url``; returns the object names written (meta last)."""
    if not os.path.isdir(local_dir):
        raise InvalidArgumentError(f"push: local_dir {local_dir!r} is not a folder")
    names = _local_files(local_dir)
    if not any(is_meta(n) for n in names):
        raise InvalidArgumentError(f"push: {local_dir!r} holds no meta file (*meta.json): not a finished cache")
    _check_shards_inside(local_dir, names)
    folder = ObjectFolder(url, storage_options)
    for name in names:
        if is_meta(name):
            try:
                folder.delete(name)
            except RemoteNotFoundError:
                pass
    for name in progress_bar(names, desc="push", unit="files"):
        folder.put_file(name, os.path.join(local_dir, name))
    return names


def pull(url: str, local_dir: str, storage_options: dict | None = None, *, verify: bool = True,
         stats: dict | None = None) -> list[str]:
    """Download the cache folder at ``url`` into ``local_dir``, checked before it is published (see
    the module); returns the file names (meta last). ``stats``, a dict, gets ``verified``: split ->
    :func:`~latentfast.cache.verify_cache`'s result."""
    folder = ObjectFolder(url, storage_options)
    names = _publish_order(folder.list())
    if not any(is_meta(n) for n in names):
        raise RemoteNotFoundError(f"pull: {folder.url} holds no meta file (*meta.json): no cache there, or its push did not finish")
    os.makedirs(local_dir, exist_ok=True)
    staging = os.path.join(local_dir, f".pulling-{os.getpid()}")  # (hidden: push and merge --copy skip it)
    shutil.rmtree(staging, ignore_errors=True)
    try:
        for name in progress_bar(names, desc="pull", unit="files"):
            _download(folder, name, os.path.join(staging, *name.split("/")))
        verified = _verify_splits(staging, names) if verify else {}
        for name in names:  # the checked files into place, the metas (the completion marks) last
            if is_meta(name):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(local_dir, *name.split("/")))
        for name in names:
            path = os.path.join(local_dir, *name.split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            os.replace(os.path.join(staging, *name.split("/")), path)
            if is_meta(name):
                fsync_dir(os.path.dirname(path) or ".")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    if stats is not None:
        stats["verified"] = verified
    return names


def _verify_splits(folder: str, names: list[str]) -> dict:
    """:func:`~latentfast.cache.verify_cache` of every split whose meta (or manifest) lies at the top of ``folder``."""
    splits = sorted({n[: -len(".latents.meta.json")] if n.endswith(".latents.meta.json") else n[: -len(".shards.json")]
                     for n in names if n.endswith((".latents.meta.json", ".shards.json")) and "/" not in n})
    return {split: verify_opened(open_folder(folder, split)) for split in splits}


_MD5_ETAG = re.compile(r'^"?([0-9a-f]{32})"?$')  # a single-part upload's ETag: the MD5 of its bytes


def _download(folder: ObjectFolder, name: str, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    size, version = folder.head(name)
    tmp = path + _TEMP_SUFFIX
    try:
        written, md5, etag = folder.download(name, tmp)
    except Exception as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, RemoteReadError):
            raise
        raise RemoteReadError(f"pull: {folder.where(name)}: {type(exc).__name__}: {exc}") from exc
    if written != size:
        os.unlink(tmp)
        raise RemoteReadError(f"pull: {folder.where(name, 0, size)}: got {written} of {size} bytes")
    expected = _MD5_ETAG.match(etag or version)
    if expected and expected.group(1) != md5:
        os.unlink(tmp)
        raise RemoteCorruptError(f"pull: {folder.where(name)}: the downloaded bytes have MD5 {md5}, the object's ETag "
                                 f"says {expected.group(1)}: corrupted in transit (pull again)")
    os.replace(tmp, path)
