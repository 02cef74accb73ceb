"""A latent cache whose files come from a folder of objects: what ``LatentCache("s3://...")`` opens.

The cache's small files (meta, index ``.npy``, keys, info) are fetched whole, once per node and
cache generation, into ``local_cache/index/<generation>/``; its data files (``*.dat``: the latents
and each record field) appear there as symbolic links to the local chunk cache's sparse copies of
the objects (:mod:`.chunks`: same size, chunks at their own offsets). So the reader opens, maps and
indexes a remote cache exactly as a local one, and one rule keeps its reads right: bytes are read
only while :meth:`RemoteFiles.holding` holds them -- their chunks fetched (one download per chunk
per node: coalesced, concurrent ranged GETs through :class:`.RemoteReader`) and kept from eviction
until the copy is done. A warm batch is then the local cache's own compiled gather over a memory map.

Checksums: an item with a CRC-32 of its own (every record field value; the latents of a shaped
cache, whose checksum blocks are single items) is checked right after this process fetched any of
its chunks, by a read or a prefetch; a mismatch drops the chunks and fetches them again, up to
``read_attempts`` times, then :class:`.RemoteCorruptError` names the object and byte range. A line
cache's latents have block checksums only: ``verify_rows=True`` checks them (once per block per
process), as on a local cache.

A generation is the remote meta's bytes: a push that replaces the cache publishes a new meta
(written last), and readers opened after it get a new folder. A reader open while the objects
under it are replaced is not protected (their CRCs catch it for items that have one).
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import shutil
import zlib

import numpy as np

from ...errors import InvalidArgumentError
from ..store import format as fmt
from .chunks import now_ns
from .errors import RemoteCorruptError, RemoteNotFoundError, RemoteReadError
from .reader import RemoteReader

_HOLD_ATTEMPTS = 8  # fetch-and-check rounds of one hold before giving up (eviction by others, bad CRCs)
_HEADS = "remote.json"  # the mirror's record of each data object's (size, version): the chunks it links


class RemoteFiles:
    """The objects of one split of a cache at ``url``, mirrored under ``local_cache`` (see the module)."""

    def __init__(self, url: str, split: str, storage_options: dict | None, local_cache, local_cache_bytes, **reader_options):
        if local_cache is None or local_cache_bytes is None:
            raise InvalidArgumentError(
                f"LatentCache({url!r}) needs local_cache= (a folder on this node's disk) and local_cache_bytes= "
                f"(its byte budget): the cache's index files and the fetched chunks of its data live there")
        self.url, self.split = str(url).rstrip("/"), split
        self.reader = RemoteReader(self.url, storage_options, local_cache=os.fspath(local_cache),
                                   local_cache_bytes=local_cache_bytes, **reader_options)
        self.mirror = self._mirror()
        with open(os.path.join(self.mirror, _HEADS)) as fh:
            self.reader.pinned_heads = {name: tuple(v) for name, v in json.load(fh).items()}
        self.reader._fresh()
        for name in self.reader.pinned_heads:  # (re)creates a sparse copy emptied since (another boot)
            self.reader._chunks(name)

    def __repr__(self) -> str:
        return f"RemoteFiles({self.url!r}, split={self.split!r})"

    # ---- the mirror folder --------------------------------------------------------------------
    def _mirror(self) -> str:
        meta_name = os.path.basename(fmt.cache_path("", self.split, "meta"))
        try:
            meta = self.reader.folder.get(meta_name)
        except RemoteNotFoundError:
            raise RemoteNotFoundError(
                f"no latent cache for split {self.split!r} at {self.url}: {self.reader.folder.where(meta_name)} does not "
                f"exist (nothing pushed there, or its push did not finish: push writes the meta last)") from None
        generation = hashlib.sha256(self.url.encode() + b"\0" + meta).hexdigest()[:24]
        root = os.path.join(self.reader.cache.directory, "index")
        final = os.path.join(root, generation)
        if os.path.exists(os.path.join(final, _HEADS)):
            return final
        tmp = os.path.join(root, f".{generation}.{os.getpid()}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
        heads = {}
        try:
            for name in self.reader.folder.list():
                if "/" in name or not name.startswith(self.split + ".") or name == meta_name:
                    continue
                if name.endswith(".dat"):  # data: a link to its sparse local copy, filled by holds
                    heads[name] = self.reader.folder.head(name)
                    self.reader.pinned_heads = heads
                    self.reader._fresh()
                    os.symlink(self.reader._chunks(name).base + ".data", os.path.join(tmp, name))
                else:  # index files are small: whole GETs (the reader checks them against the meta's CRCs)
                    with open(os.path.join(tmp, name), "wb") as fh:
                        fh.write(self.reader.folder.get(name))
            with open(os.path.join(tmp, meta_name), "wb") as fh:
                fh.write(meta)
            with open(os.path.join(tmp, _HEADS), "w") as fh:
                json.dump(heads, fh)
            os.rename(tmp, final)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not os.path.exists(os.path.join(final, _HEADS)):  # not another process's rename winning
                raise
        return final

    def object_name(self, path: str) -> str:
        """The object behind a mirror path (``.../train.latents.f16.dat`` -> ``train.latents.f16.dat``)."""
        name = os.path.basename(path)
        if name not in self.reader.pinned_heads:
            raise InvalidArgumentError(f"{path} is not a data file of {self.url}")
        return name

    def _object(self, path: str):
        """``(object name, its local chunks)`` of a mirror path, memoized per process (a batch's hold
        must cost microseconds: the warm path is as fast as a local cache's)."""
        memo = self.__dict__.setdefault("_objects", {})
        key = (path, os.getpid())
        if key not in memo:
            name = self.object_name(path)
            memo[key] = name, self.reader._chunks(name)
        return memo[key]

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_objects", None)
        return state

    # ---- holding bytes local --------------------------------------------------------------------
    @contextlib.contextmanager
    def holding(self, path: str, starts, ends, crcs=None):
        """Keep bytes ``[starts[i], ends[i])`` of the data file ``path`` local for the block: their
        chunks fetched (and each span with a ``crcs[i]`` checked if this call fetched any of its
        chunks) and safe from eviction until it ends."""
        name, obj = self._object(path)
        starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
        if not (ends > starts).all():  # (a warm batch of latents skips this: every item has bytes)
            keep = ends > starts
            starts, ends, crcs = starts[keep], ends[keep], None if crcs is None else np.asarray(crcs)[keep]
        if not len(starts):
            yield
            return
        first, last = starts // obj.chunk_bytes, (ends - 1) // obj.chunk_bytes
        chunks = np.minimum(first[:, None] + np.arange(int((last - first).max()) + 1), last[:, None])  # a row per span
        for _ in range(_HOLD_ATTEMPTS):
            if not obj.present[chunks].all():
                self.reader._run(self._fetch_checked(name, starts, ends, crcs)).result()
            with obj.reading():  # the evictor waits until the block ends
                if obj.present[chunks].all():
                    obj.atime[chunks] = now_ns()
                    yield
                    return
        raise RemoteReadError(
            f"{self.reader.folder.where(name, int(starts.min()), int(ends.max()))}: its chunks were evicted again before "
            f"they could be read, {_HOLD_ATTEMPTS} times: local_cache_bytes ({self.reader.cache.capacity}) is too small "
            f"for what is read at once")

    async def _fetch_checked(self, name: str, starts, ends, crcs) -> None:
        """Fetch the chunks under the spans; check the CRC of each span that had a chunk missing."""
        obj = self.reader._chunks(name)
        c0s, c1s = starts // obj.chunk_bytes, (ends - 1) // obj.chunk_bytes + 1
        if crcs is not None:
            fresh = np.fromiter((not obj.present[a:b].all() for a, b in zip(c0s.tolist(), c1s.tolist())), bool, len(starts))
        for attempt in range(self.reader.read_attempts):
            await self.reader._ensure_local(name, starts, ends)
            if crcs is None or not fresh.any():
                return
            bad = []
            with obj.reading():
                data = obj.data
                for i in np.flatnonzero(fresh).tolist():
                    if obj.present[c0s[i]:c1s[i]].all() and zlib.crc32(data[starts[i]:ends[i]]) != int(crcs[i]):
                        bad.append(i)
            if not bad:
                return
            for i in bad:
                obj.drop(int(c0s[i]), int(c1s[i]))
            fresh = np.zeros(len(starts), bool)
            fresh[bad] = True
            await asyncio.sleep(self.reader.retry_backoff * (2 ** attempt))
        i = bad[0]
        raise RemoteCorruptError(f"{self.reader.folder.where(name, int(starts[i]), int(ends[i]))}: fails its CRC-32 "
                                 f"({int(crcs[i]):#010x}) on {self.reader.read_attempts} fetches")

    def prefetch(self, path: str, starts, ends, crcs=None):
        """Start fetching (and checking) these spans into the local chunk cache; returns a future at once."""
        name = self._object(path)[0]
        starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
        keep = ends > starts
        return self.reader._run(self._fetch_checked(name, starts[keep], ends[keep], None if crcs is None else np.asarray(crcs)[keep]))
