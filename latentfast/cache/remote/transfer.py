"""Move a whole cache folder to and from object storage.

``push`` uploads every file, the meta files (``*meta.json``, ``*manifest.json``) last and a sharded
cache's manifest (``*.shards.json``) after its shards' metas -- and first deletes the remote copies
of those, so a reader that sees a meta sees every data file it names complete, whether the push is
new, resumed or replaces an older cache. Large files upload in parts. A sharded cache whose
manifest names shards outside the folder (a ``cache merge`` without ``--copy``) is refused.
``pull`` refuses a folder without a meta (a push that did not finish) and writes each file to a
temporary name, fsyncs it and renames it into place, the meta files last.
"""
from __future__ import annotations

import os

from ...errors import InvalidArgumentError
from ...progress import progress_bar
from .errors import RemoteNotFoundError, RemoteReadError
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
    from ..store.shards import load_manifest, shard_path_inside

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


def pull(url: str, local_dir: str, storage_options: dict | None = None) -> list[str]:
    """Download the cache folder at ``url`` into ``local_dir``; returns the file names (meta last)."""
    folder = ObjectFolder(url, storage_options)
    names = _publish_order(folder.list())
    if not any(is_meta(n) for n in names):
        raise RemoteNotFoundError(f"pull: {folder.url} holds no meta file (*meta.json): no cache there, or its push did not finish")
    for name in progress_bar(names, desc="pull", unit="files"):
        _download(folder, name, os.path.join(local_dir, *name.split("/")))
    return names


def _download(folder: ObjectFolder, name: str, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    size, _ = folder.head(name)
    tmp = path + _TEMP_SUFFIX
    try:
        written = folder.download(name, tmp)
    except Exception as exc:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, RemoteReadError):
            raise
        raise RemoteReadError(f"pull: {folder.where(name)}: {type(exc).__name__}: {exc}") from exc
    if written != size:
        os.unlink(tmp)
        raise RemoteReadError(f"pull: {folder.where(name, 0, size)}: got {written} of {size} bytes")
    os.replace(tmp, path)
