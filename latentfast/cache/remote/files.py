"""A latent cache whose files come from a folder of objects: what ``LatentCache("s3://...")`` opens.

Opening fetches the meta and the small fixed-size files (the white column, the index's block
checksums) whole into ``local_cache/index/<generation>/``; every other file of the cache is a sparse
local copy there, filled by range when a read first needs its bytes -- once per node, every process
of the node reading the same copy:

- the data files (``*.dat``: the latents and each record field) are symbolic links to the local chunk
  cache's sparse copies of the objects (:mod:`.chunks`: same size, chunks at their own offsets), read
  under :meth:`RemoteFiles.holding` (below);
- the per-item tables read by block (shapes and offsets, the per-item checksums, the key table) are
  symbolic links to sparse copies in the generation's own chunk folder (``<generation>/tables``: never
  evicted, so outside ``local_cache_bytes``; deleted with the generation). Their readers (:mod:`..store.tables`,
  :mod:`..store.keytable`) ask :meth:`RemoteFiles.local` for a block's byte ranges right before they
  check the block's CRC-32, the only way any of their bytes is read, so no byte that was not fetched is
  ever used (a block that fails is fetched again, :meth:`RemoteFiles.refetch`, then refused naming the
  object and byte range);
- the files read whole (widths, field spans, info, hashes, the key list, the key table's checksums)
  appear in the folder only once :meth:`RemoteFiles.local` has fetched all of their bytes and checked
  them against the CRC-32 the meta records: before that a reader that did not ask finds no file, never
  zeros.

So the reader opens, maps and indexes a remote cache as a local one, opening costs the same at any
item count (a GET of the meta, a LIST, a HEAD per object, the last index block), and one rule keeps its
data reads right: bytes are read only while :meth:`RemoteFiles.holding` holds them -- their chunks
fetched (one download per chunk per node: coalesced, concurrent ranged GETs through
:class:`.RemoteReader`) and kept from eviction until the copy is done. A warm batch is then the local
cache's own compiled gather over a memory map.

Checksums: a value with a CRC-32 of its own (every record field value; the latents of a shaped
cache, whose checksum blocks are single items) is checked by the process that fetched the last of
its chunks (for a read or a prefetch, whichever item asked for them), before any read of it; a
mismatch drops the chunks and fetches them again, up to ``read_attempts`` times, then
:class:`.RemoteCorruptError` names the object and byte range. A line
cache's latents have block checksums only: ``verify_rows=True`` checks them (once per block per
process), as on a local cache.

A generation is the remote meta's bytes: a push that replaces the cache publishes a new meta
(written last), and readers opened after it get a new folder. The mirror pins each data object's
version (its ETag, headed while the meta was unchanged: the meta is fetched again after the heads)
and every ranged GET asks for that version only (``If-Match``): a reader open while a push replaces
the objects under it reads what its node already holds of its generation, and
:class:`.RemoteReplacedError` ("replaced since this reader opened it") for the rest -- never the new
bytes, which are never stored under the old generation's chunks. Each open reader holds a shared
lock on its generation's folder; the folders of older generations of the same cache that no reader
holds are deleted when a new one is mirrored.

A sharded cache in object storage (a distributed build's folder, or a ``cache merge --copy``,
pushed) is its manifest and order file (:func:`mirror_manifest`, fetched whole into a folder of
their own) and a ``RemoteFiles`` per shard, all sharing the one local chunk cache and its budget.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import hashlib
import json
import os
import posixpath
import shutil
import threading
import zlib

import numpy as np

from ...errors import InvalidArgumentError
from ..store import format as fmt
from ..store import keytable, tables
from ..store.layout import item_spans
from ..store.manifest import manifest_path, order_path, remote_shard_url
from .chunks import now_ns
from .errors import RemoteCorruptError, RemoteNotFoundError, RemoteReadError, RemoteReplacedError
from .reader import MAX_CONCURRENCY, ConcurrencyLimit, RemoteReader, coalesce
from .storage import ObjectFolder

_HOLD_ATTEMPTS = 8  # fetch-and-check rounds of one hold before giving up (eviction by others, bad CRCs)
_HEADS = "remote.json"  # the mirror's record of each data object's (size, version): the chunks it links
_ORIGIN = "origin.json"  # which cache (url, split) a generation folder mirrors: how older ones are found
_META_THREADS = 16  # shards' metas fetched at once when a sharded cache opens
_TABLES = "tables"  # the generation folder's chunk folder: sparse copies of its index objects
_NO_BUDGET = 1 << 62  # (a generation's index copies are never evicted: they go with the generation)
_AT_OPEN = ("meta", "white", tables.CRC_KIND)  # fetched whole when the cache is mirrored: small, fixed size
_BY_RANGE = ("shapes", "offsets", "checksums", *keytable.TABLES)  # sparse copies, filled block by block
# part of a generation's name: a mirror made by a version that fetched the index whole is another folder
_MIRROR_FORMAT = b"\0index by range"


class RemoteFiles:
    """The objects of one split of a cache at ``url``, mirrored under ``local_cache`` (see the module)."""

    def __init__(self, url: str, split: str, storage_options: dict | None, local_cache, local_cache_bytes, **reader_options):
        local_cache, local_cache_bytes = local_cache_or_default(local_cache, local_cache_bytes)
        self.url, self.split = str(url).rstrip("/"), split
        self.reader = RemoteReader(self.url, storage_options, local_cache=os.fspath(local_cache),
                                   local_cache_bytes=local_cache_bytes, **reader_options)
        self._names = {kind: os.path.basename(fmt.cache_path("", split, kind)) for kind in (*_AT_OPEN, *_BY_RANGE)}
        for attempt in range(3):  # (a newer generation's cleanup may take an older one away as we open it)
            try:
                self.mirror = self._mirror()
            except RemoteReplacedError:  # a push replaced the cache while we mirrored it: mirror the new one
                if attempt == 2:
                    raise
                continue
            self._generation_lock = hold_generation(self.mirror)
            if self._generation_lock is not None:
                break
        else:
            raise RemoteReadError(f"{self.url}: its local mirror under {self.reader.cache.directory} kept being replaced "
                                  f"while it was opened (pushes replacing the cache?): open it again")
        with open(os.path.join(self.mirror, _HEADS)) as fh:
            heads = json.load(fh)
        with open(os.path.join(self.mirror, self._names["meta"]), "rb") as fh:
            try:
                record = json.load(fh).get("files")
            except (ValueError, AttributeError):  # (the reader names what is wrong with the meta)
                record = None
        self._recorded = record if isinstance(record, dict) else {}  # the CRC-32 of each whole file, by kind
        self.reader.pinned_heads = {name: tuple(v) for name, v in heads["data"].items()}
        self.reader._fresh()
        for name in self.reader.pinned_heads:  # (re)creates a sparse copy emptied since (another boot)
            self.reader._chunks(name)
        self.tables = self._tables_reader(self.mirror, {name: tuple(v) for name, v in heads["index"].items()})
        for name in self.tables.pinned_heads:
            self.tables._chunks(name)

    def __repr__(self) -> str:
        return f"RemoteFiles({self.url!r}, split={self.split!r})"

    def _tables_reader(self, folder: str, heads: dict) -> RemoteReader:
        """The reader of the index objects, through the chunk folder of the generation ``folder``."""
        reader = RemoteReader(self.url, self.reader.folder.storage_options, local_cache=os.path.join(folder, _TABLES),
                              local_cache_bytes=_NO_BUDGET, chunk_bytes=self.reader.cache.chunk_bytes,
                              read_attempts=self.reader.read_attempts, retry_backoff=self.reader.retry_backoff,
                              limit=self.reader.limit)  # (index GETs share the shards' one limit)
        reader.pinned_heads = heads
        reader._fresh()
        return reader

    # ---- the mirror folder --------------------------------------------------------------------
    def _mirror(self) -> str:
        meta_name = self._names["meta"]
        try:
            meta = self.reader.folder.get(meta_name)
        except RemoteNotFoundError:
            raise RemoteNotFoundError(
                f"no latent cache for split {self.split!r} at {self.url}: {self.reader.folder.where(meta_name)} does not "
                f"exist (nothing pushed there, or its push did not finish: push writes the meta last)") from None

        listing = {}

        def objects() -> tuple[list, dict]:
            """The cache's other objects and their ``(size, version)`` (listed once: the listing has both)."""
            if not listing:
                heads = {n: h for n, h in self.reader.folder.list_heads().items()
                         if "/" not in n and n.startswith(self.split + ".") and n != meta_name}
                listing["names"], listing["heads"] = sorted(heads), heads
            return listing["names"], listing["heads"]

        key = meta + _MIRROR_FORMAT
        if not _names_its_content(meta):  # (checksum-less, written by other code): the data's versions tell
            key += json.dumps({n: h for n, h in objects()[1].items() if n.endswith(".dat")}, sort_keys=True).encode()  # its generations apart

        def fill(tmp: str) -> None:
            names, heads = objects()
            data = {n: h for n, h in heads.items() if n.endswith(".dat")}
            at_open = {self._names[k] for k in _AT_OPEN}
            index = {n: h for n, h in heads.items() if n not in data and n not in at_open}
            self.reader.pinned_heads = data
            self.reader._fresh()
            ranged = self._tables_reader(tmp, index)
            for name in names:
                if name in data:  # data: a link to its sparse local copy, filled by holds
                    os.symlink(self.reader._chunks(name).base + ".data", os.path.join(tmp, name))
                elif name in at_open:  # small: whole GETs (the reader checks them against the meta's CRCs)
                    with open(os.path.join(tmp, name), "wb") as fh:
                        fh.write(self.reader.folder.get(name))
                elif name in self._ranged_names():  # a link to its sparse copy (relative: the folder is renamed)
                    os.symlink(os.path.join(_TABLES, os.path.basename(ranged._chunks(name).base) + ".data"), os.path.join(tmp, name))
                # (the rest appear when first read whole: local())
            try:
                again = self.reader.folder.get(meta_name)
            except RemoteNotFoundError:
                again = None
            if again != meta:  # (a push deletes the meta before it replaces an object, and writes it last)
                raise RemoteReplacedError(f"{self.reader.folder.where(meta_name)} changed while its cache was mirrored (a push replacing it)")
            with open(os.path.join(tmp, meta_name), "wb") as fh:
                fh.write(meta)
            with open(os.path.join(tmp, _HEADS), "w") as fh:
                json.dump({"data": data, "index": index}, fh)

        return generation_folder(self.reader.cache.directory, self.url, self.split, key, fill)

    def _ranged_names(self) -> set:
        return {self._names[k] for k in _BY_RANGE}

    # ---- index files: made local when first read --------------------------------------------------
    def local(self, requests) -> None:
        """Make these bytes of the mirror's index files local: ``requests`` are ``(path, byte starts, byte
        ends)``, starts None for the whole file. A table read by block gets the chunks under the ranges
        (its reader checks the blocks). A file asked for whole is fetched whole and checked against the
        CRC-32 its meta records (fetched again, then :class:`.RemoteCorruptError` naming the object); a
        file read only whole appears at ``path`` only then. Files that are not objects of the cache (a
        cache without an info file) are left as they are (the reader names what is missing). One
        round trip for every request."""
        spans, whole = {}, []
        for path, starts, ends in requests:
            name = os.path.basename(path)
            head = self.tables.pinned_heads.get(name)
            if head is None:
                continue
            if starts is None:
                if self._all_present(name) and (name in self._ranged_names() or os.path.exists(path)):
                    continue
                starts, ends = [0], [head[0]]
                whole.append((path, name))
            starts, ends = np.asarray(starts, dtype=np.int64), np.minimum(np.asarray(ends, dtype=np.int64), head[0])
            keep = ends > starts
            if keep.any() and not self._all_present(name, starts[keep], ends[keep]):
                spans[name] = (starts[keep], ends[keep])
        if spans:
            self.tables._run(self.tables._ensure_all(spans)).result()
        for path, name in whole:
            self._check_whole(name)
            if name not in self._ranged_names():  # (atomically: a reader sees all of it or nothing)
                tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                os.symlink(os.path.join(_TABLES, os.path.basename(self.tables._chunks(name).base) + ".data"), tmp)
                os.replace(tmp, path)

    def refetch(self, requests) -> None:
        """Drop the local chunks under these ranges (a block that failed its CRC-32) and fetch them again."""
        for path, starts, ends in requests:
            name = os.path.basename(path)
            if name in self.tables.pinned_heads:
                obj = self.tables._chunks(name)
                for s, e in zip(np.asarray(starts).tolist(), np.asarray(ends).tolist()):
                    obj.drop(s // obj.chunk_bytes, (e - 1) // obj.chunk_bytes + 1)
        self.local(requests)

    def local_all(self) -> None:
        """Every index file local, whole (what ``verify`` and ``inspect`` read)."""
        self.local([(os.path.join(self.mirror, name), None, None) for name in self.tables.pinned_heads])

    def where(self, path: str, start: int, end: int) -> str:
        """The object and byte range behind bytes of a mirror file (what errors name)."""
        return self.reader.folder.where(os.path.basename(path), start, end)

    def _all_present(self, name: str, starts=None, ends=None) -> bool:
        obj = self.tables._chunks(name)
        if starts is None:
            return bool(obj.present.all())
        cb = obj.chunk_bytes
        return bool(all(obj.present[s // cb: (e - 1) // cb + 1].all() for s, e in zip(starts.tolist(), ends.tolist())))

    def _check_whole(self, name: str) -> None:
        """Check an index object fetched whole against the meta's CRC-32 of it, fetching it again while it fails."""
        obj, size = self.tables._chunks(name), self.tables.pinned_heads[name][0]
        recorded = self._recorded.get(_kind_of(name, self.split))
        for _ in range(self.reader.read_attempts):
            if recorded is None or zlib.crc32(obj.data[:size]) == recorded:
                return
            obj.drop(0, obj.n_chunks)
            self.tables._run(self.tables._ensure_all({name: (np.zeros(1, np.int64), np.full(1, size, np.int64))})).result()
        if zlib.crc32(obj.data[:size]) != recorded:
            raise RemoteCorruptError(f"{self.reader.folder.where(name, 0, size)}: fails the CRC-32 its cache's meta records "
                                     f"({recorded}) on {self.reader.read_attempts + 1} fetches")

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
        for key in ("_objects", "_value_tables", "_crc_memo", "_generation_lock"):  # (a worker reads under its parent's lock)
            state.pop(key, None)
        return state

    # ---- holding bytes local --------------------------------------------------------------------
    def holding_items(self, items, index):
        """:meth:`holding` of whole items ``index`` (in range) of ``items``."""
        return _holding([self._hold_items(items, index)])

    def holding(self, items, starts, ends):
        """Keep bytes ``[starts[i], ends[i])`` of ``items``' data file (its ``path`` in the mirror) local
        for the block: their chunks fetched (and checked, see :meth:`_fetch_checked`) and safe from
        eviction until it ends."""
        name, obj = self._object(items.path)
        starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
        if not (ends > starts).all():
            keep = ends > starts
            starts, ends = starts[keep], ends[keep]
        return _holding([_Hold(self, items, name, obj, _span_chunks(obj, starts, ends), (starts, ends))] if len(starts) else [])

    def _hold_items(self, items, index) -> "_Hold | None":
        """The :class:`_Hold` of whole items ``index``: their byte spans (a shaped cache's index blocks of
        them checked first, fetched if need be) and the chunks under them (a few array operations)."""
        name, obj = self._object(items.path)
        index = np.asarray(index, dtype=np.int64)
        starts, ends = item_spans(items, index)
        keep = ends > starts
        if not keep.all():
            starts, ends = starts[keep], ends[keep]
        if not len(starts):
            return None
        return _Hold(self, items, name, obj, _span_chunks(obj, starts, ends), (starts, ends))

    def _prefetch(self, items, starts, ends):
        """The fetch (and check) of these spans of ``items``' data file into the local chunk cache, to run
        on the fetching loop (see :func:`prefetch_many`); None when their chunks are all local already
        (a warm batch: nothing to hand the loop, whose work would only compete with the reads). What it
        checks is looked up here, before (in the caller's thread: it may fetch index blocks)."""
        name, obj = self._object(items.path)
        starts, ends = np.asarray(starts, dtype=np.int64), np.asarray(ends, dtype=np.int64)
        keep = ends > starts
        starts, ends = starts[keep], ends[keep]
        if not len(starts) or obj.present[_span_chunks(obj, starts, ends)].all():
            return None
        return self._fetch_checked(name, obj, starts, ends, self._values(items, obj, starts, ends))

    @staticmethod
    def prefetch_many(requests):
        """See :func:`prefetch_many` (the storage strategy's interface)."""
        return prefetch_many(requests)

    @staticmethod
    def holding_many(requests):
        """See :func:`holding_many` (the storage strategy's interface)."""
        return holding_many(requests)

    def _values(self, items, obj, starts, ends):
        """``(byte starts, byte ends, CRC-32s)``, sorted, of the distinct values stored in ``items``' data file
        that lie on the chunks under spans ``[starts, ends)`` (what a fetch of them checks: their neighbours'
        on shared edge chunks too), or None where items have no CRC of their own (a line cache's latents).
        Looked up in the caller's thread: the index blocks and checksums it needs are fetched here."""
        if items.row_ends is not None:  # a field: its spans and CRCs are in memory (memoized, sorted)
            memo = self.__dict__.setdefault("_value_tables", {})
            if items.path not in memo:
                units, first = np.unique(items.row_starts, return_index=True)
                memo[items.path] = units * 2, units * 2 + items.nbytes[first], items.crc[first], None
            return memo[items.path]
        if fmt.checksum_block_rows(items.meta, items.path) != 1 or not len(starts):
            return None  # (the latents have a CRC per item in a shaped cache only)
        cb, total = obj.chunk_bytes, int(obj.size)
        lo, hi = starts // cb * cb, np.minimum((ends - 1) // cb * cb + cb, total)
        first = np.asarray([self._item_at(items, x // 2) for x in lo.tolist()], dtype=np.int64)
        last = np.asarray([self._item_at(items, (x - 1) // 2) for x in hi.tolist()], dtype=np.int64)
        index = np.unique(np.concatenate([np.arange(f, l + 1) for f, l in zip(first.tolist(), last.tolist())]))
        crcs = np.zeros(len(index), dtype=np.uint32)

        async def fetch_crcs(values=None) -> None:  # (on the fetching loop) the CRC-32s of values, all: None
            at = slice(None) if values is None else values
            table = await self._crc_table(items.n)
            await self._fetch_crcs(table, index[at], again=values is not None)
            crcs[at] = table[index[at]]

        return items.row_starts[index] * 2, items.row_starts[index + 1] * 2, crcs, fetch_crcs

    @staticmethod
    def _item_at(items, unit: int) -> int:
        """The latent item holding 2-byte unit ``unit`` of the data file (its index block checked)."""
        if items.index_checks is None:  # (an index checked whole when it opened)
            return int(np.searchsorted(items.row_starts, unit, side="right")) - 1
        return items.index_checks.item_at(unit // items.index_checks.units_per_element)

    async def _crc_table(self, n: int) -> np.ndarray:
        """The latents' per-item CRC-32s, the mapped checksums table (its entries fetched by :meth:`_fetch_crcs`).
        They have no block checksums of their own: each is checked by its use -- the value it names must
        match it, or both are fetched again, then refused naming the value's bytes."""
        memo = self.__dict__.get("_crc_memo")
        if memo is None or memo[0] != os.getpid():
            path = fmt.cache_path(self.mirror, self.split, "checksums")
            name = os.path.basename(path)
            if name in self.tables.pinned_heads:  # (the .npy header; no such object: the load names the file)
                await self.tables._ensure_local(name, np.zeros(1, np.int64), np.full(1, min(4096, self.tables.pinned_heads[name][0]), np.int64))
            crcs = fmt.load_npy(path, "checksums", mmap=True)
            if crcs.shape != (n,) or crcs.dtype != np.uint32:
                raise RemoteCorruptError(f"{self.where(path, 0, 4096)}: the checksums must be uint32 [{n}], got {crcs.dtype} {list(crcs.shape)}")
            memo = self._crc_memo = os.getpid(), crcs
        return memo[1]

    async def _fetch_crcs(self, table: np.ndarray, index: np.ndarray, again: bool = False) -> None:
        """Fetch the chunks of the latents ``index``'s CRC-32s (``again``: dropped first) on the fetching loop."""
        name = os.path.basename(fmt.cache_path("", self.split, "checksums"))
        obj = self.tables._chunks(name)
        starts = getattr(table, "offset", 0) + 4 * index
        if again:
            for c in np.unique(starts // obj.chunk_bytes).tolist():
                obj.drop(c, c + 1)
        if name in self.tables.pinned_heads:
            await self.tables._ensure_local(name, starts, starts + 4)

    async def _fetch_checked(self, name: str, obj, starts, ends, values) -> None:
        """Fetch the chunks under the spans, then check every stored value (``values``, see
        :meth:`_values`) that lies on a chunk this call fetched and is now all local -- the spans'
        own and their neighbours' on shared edge chunks, so no value is ever read unchecked. A value
        that fails has its chunks dropped and fetched again (``read_attempts`` rounds)."""
        cb = obj.chunk_bytes
        needed = np.unique(np.minimum((starts // cb)[:, None] + np.arange(int(((ends - 1) // cb - starts // cb).max(initial=0)) + 1),
                                      ((ends - 1) // cb)[:, None])) if len(starts) else np.zeros(0, np.int64)
        bad = []
        for attempt in range(self.reader.read_attempts):
            fresh = needed[obj.present[needed] == 0]
            await self.reader._ensure_local(name, starts, ends)
            if values is None or not len(fresh):
                return
            v_starts, v_ends, v_crcs, refresh = values
            if refresh is not None and not attempt:
                await refresh()
            run_c0, run_c1 = coalesce(fresh, fresh + 1, 0)
            lo = np.searchsorted(v_ends, run_c0 * cb, side="right")  # the values overlapping each run of fresh chunks
            hi = np.searchsorted(v_starts, run_c1 * cb, side="left")
            candidates = np.unique(np.concatenate([np.arange(a, b) for a, b in zip(lo.tolist(), hi.tolist())]))
            bad = []
            with obj.reading():
                data = obj.data
                for v in candidates.tolist():
                    s, e = int(v_starts[v]), int(v_ends[v])
                    c0, c1 = s // cb, (e - 1) // cb + 1
                    if e > s and obj.present[c0:c1].all() and zlib.crc32(data[s:e]) != int(v_crcs[v]):
                        bad.append((s, e, c0, c1, int(v_crcs[v]), v))
            if not bad:
                return
            for _s, _e, c0, c1, _crc, _v in bad:
                obj.drop(c0, c1)
            if refresh is not None:  # (the CRCs were fetched by range too: those fetched again as well)
                await refresh(np.asarray([v for *_, v in bad]))
            await asyncio.sleep(self.reader.retry_backoff * (2 ** attempt))
        s, e, _c0, _c1, crc, _v = bad[0]
        raise RemoteCorruptError(f"{self.reader.folder.where(name, s, e)}: fails its CRC-32 ({crc:#010x}) on "
                                 f"{self.reader.read_attempts} fetches")


def _kind_of(name: str, split: str) -> str:
    """The meta's ``files`` kind of an object of split ``split`` (``train.latents.widths.npy`` -> ``widths``,
    ``train.field.text.spans.npy`` -> ``text.spans``)."""
    suffix = name[len(split) + 1:]
    for kind, known in fmt._SUFFIXES.items():
        if suffix == known:
            return kind
    return suffix.removeprefix("field.").removesuffix(".npy")


def _names_its_content(meta: bytes) -> bool:
    """Whether a meta's bytes change with its cache's content: ours record their index files' CRC-32s
    (the checksums file among them covers the data); a meta of another writer may not."""
    try:
        return isinstance(json.loads(meta).get("files"), dict)
    except (ValueError, AttributeError):
        return False


LOCAL_CACHE_ENV, LOCAL_CACHE_BYTES_ENV = "LATENTFAST_LOCAL_CACHE", "LATENTFAST_LOCAL_CACHE_BYTES"
DEFAULT_LOCAL_CACHE_BYTES = 16 << 30


def local_cache_or_default(local_cache, local_cache_bytes) -> tuple[str, int]:
    """The node-local chunk cache's folder and byte budget: the arguments, else ``$LATENTFAST_LOCAL_CACHE``
    (default ``$XDG_CACHE_HOME/latentfast/chunks``, i.e. ``~/.cache/latentfast/chunks``) and
    ``$LATENTFAST_LOCAL_CACHE_BYTES`` (default 16 GiB). Every process of a node resolves the same
    folder, so they share its chunks (the index files and the fetched data of every cache opened)."""
    if local_cache is None:
        local_cache = os.environ.get(LOCAL_CACHE_ENV) or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "latentfast", "chunks")
    if local_cache_bytes is None:
        text = os.environ.get(LOCAL_CACHE_BYTES_ENV, "").strip()
        try:
            local_cache_bytes = int(text) if text else DEFAULT_LOCAL_CACHE_BYTES
        except ValueError:
            raise InvalidArgumentError(f"{LOCAL_CACHE_BYTES_ENV} must be a number of bytes, got {text!r}") from None
    return os.fspath(local_cache), local_cache_bytes


def _span_chunks(obj, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The chunks under non-empty byte spans: a row per span, padded with its last chunk."""
    first, last = starts // obj.chunk_bytes, (ends - 1) // obj.chunk_bytes
    return np.minimum(first[:, None] + np.arange(int((last - first).max()) + 1), last[:, None])


def hold_generation(folder: str):
    """A shared lock on a generation folder, for as long as the returned file stays open (it closes
    when its holder is collected; no newer generation's cleanup deletes a folder held so); None if
    the folder was taken away first."""
    path = os.path.join(folder, _HEADS)
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return None
    fcntl.flock(fh.fileno(), fcntl.LOCK_SH)
    try:
        if os.stat(path).st_ino == os.fstat(fh.fileno()).st_ino:
            return fh
    except FileNotFoundError:
        pass
    fh.close()
    return None


def generation_folder(root_dir: str, url: str, split: str, key: bytes, fill) -> str:
    """``root_dir/index/<generation>``: the local copy of one generation (``key``: the bytes that name it,
    a meta or a manifest) of the cache of ``split`` at ``url``, made once per node -- ``fill(tmp)``
    writes the files into a temporary folder renamed into place (a crash leaves no half folder) --
    after which the older generations of the same cache that no open reader holds are deleted."""
    generation = hashlib.sha256(url.encode() + b"\0" + split.encode() + b"\0" + key).hexdigest()[:24]
    root = os.path.join(root_dir, "index")
    final = os.path.join(root, generation)
    if os.path.exists(os.path.join(final, _HEADS)):
        return final
    tmp = os.path.join(root, f".{generation}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        fill(tmp)
        with open(os.path.join(tmp, _ORIGIN), "w") as fh:
            json.dump({"url": url, "split": split}, fh)
        if not os.path.exists(os.path.join(tmp, _HEADS)):
            with open(os.path.join(tmp, _HEADS), "w") as fh:
                json.dump({}, fh)
        os.rename(tmp, final)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if not isinstance(exc, OSError) or not os.path.exists(os.path.join(final, _HEADS)):  # not another process's rename winning
            raise
        return final
    _delete_older_generations(root, generation, url, split)
    return final


def _delete_older_generations(root: str, keep: str, url: str, split: str) -> None:
    """Delete the generation folders of (``url``, ``split``) other than ``keep`` that no reader holds
    (each open reader holds a shared ``flock`` on its folder's heads file)."""
    for name in os.listdir(root):
        folder = os.path.join(root, name)
        if name == keep or name.startswith("."):
            continue
        try:
            with open(os.path.join(folder, _ORIGIN)) as fh:
                if json.load(fh) != {"url": url, "split": split}:
                    continue
            fd = os.open(os.path.join(folder, _HEADS), os.O_RDONLY)
        except (OSError, ValueError):
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: a reader of that generation is open
            os.close(fd)
            continue
        trash = os.path.join(root, f".{name}.{os.getpid()}.old")
        try:
            os.rename(folder, trash)  # (under the lock: a reader opening it now finds it gone, never half gone)
        except OSError:
            os.close(fd)
            continue
        os.close(fd)
        shutil.rmtree(trash, ignore_errors=True)


def mirror_manifest(url: str, split: str, storage_options, local_cache, local_cache_bytes) -> str:
    """The folder holding local copies of the manifest and order file of the sharded cache of
    ``split`` at ``url`` (whole GETs, once per node and manifest), checked against each other: an
    order file that does not match its manifest's CRC (a push replacing the cache between the two
    GETs) is fetched again with the manifest, then refused."""
    local_cache, local_cache_bytes = local_cache_or_default(local_cache, local_cache_bytes)
    url = str(url).rstrip("/")
    folder = ObjectFolder(url, storage_options)
    names = os.path.basename(manifest_path("", split)), os.path.basename(order_path("", split))
    for _ in range(3):
        manifest = folder.get(names[0])
        order = folder.get(names[1])
        try:
            crc = json.loads(manifest).get("order_crc")
        except (ValueError, AttributeError):
            crc = None  # (the reader names what is wrong with it)
        if crc is None or zlib.crc32(order) == crc:
            break

    def fill(tmp: str) -> None:
        for name, payload in zip(names, (manifest, order)):
            with open(os.path.join(tmp, name), "wb") as fh:
                fh.write(payload)

    return generation_folder(os.fspath(local_cache), url, split + ".shards", manifest, fill)


class _Hold:
    """One data file's part of a hold: its chunks (a row per span) and what to fetch if some are
    missing -- byte spans, or item indices whose spans are worked out then."""

    __slots__ = ("files", "items", "name", "obj", "chunks", "_what")

    def __init__(self, files: "RemoteFiles", items, name: str, obj, chunks: np.ndarray, what):
        self.files, self.items, self.name, self.obj, self.chunks, self._what = files, items, name, obj, chunks, what

    def spans(self) -> tuple[np.ndarray, np.ndarray]:
        if not isinstance(self._what, tuple):
            starts, ends = item_spans(self.items, self._what)
            self._what = starts[ends > starts], ends[ends > starts]
        return self._what

    def fetching(self):
        """The fetch (and check) of this part's missing chunks: a coroutine for the fetching loop (what it
        checks is looked up here, in the caller's thread: it may fetch index blocks)."""
        starts, ends = self.spans()
        return self.files._fetch_checked(self.name, self.obj, starts, ends, self.files._values(self.items, self.obj, starts, ends))


class RemoteShards:
    """A sharded cache in object storage as :class:`~latentfast.cache.store.shards.ShardedCache` is handed
    it: the manifest and order mirrored into a local folder (``mirror``, held as a generation: see
    :func:`mirror_manifest`), and each shard's objects read through a :class:`RemoteFiles` of its own
    (``shard``), all under the one local chunk cache and its budget, and one limit of ``max_concurrency``
    GETs in flight (:class:`.ConcurrencyLimit`: a batch over the shards is fetched as one cache's is)."""

    def __init__(self, url: str, split: str, storage_options: dict | None, local_cache, local_cache_bytes,
                 max_concurrency: int = MAX_CONCURRENCY):
        self.url, self.split = str(url).rstrip("/"), split
        self.limit = ConcurrencyLimit(max_concurrency)
        self.options = {"storage_options": storage_options, "local_cache": local_cache, "local_cache_bytes": local_cache_bytes}
        self.mirror = mirror_manifest(self.url, split, **self.options)
        self._generation_lock = hold_generation(self.mirror)

    def shard_url(self, path: str) -> str:
        return remote_shard_url(self.url, path, manifest_path(self.mirror, self.split))

    def shard(self, path: str) -> RemoteFiles:
        """The storage of the shard at ``path`` (a manifest entry's, relative to the sharded cache's URL)."""
        return RemoteFiles(self.shard_url(path), self.split, self.options["storage_options"], self.options["local_cache"],
                           self.options["local_cache_bytes"], limit=self.limit)

    def shard_metas(self, paths: list[str]) -> list[bytes]:
        """The meta bytes of the shards at ``paths``, fetched at once (whole GETs on a few threads)."""
        folder = ObjectFolder(self.url, self.options["storage_options"])
        meta = os.path.basename(fmt.cache_path("", self.split, "meta"))
        names = [posixpath.relpath(self.shard_url(p), self.url) + "/" + meta for p in paths]
        with concurrent.futures.ThreadPoolExecutor(min(_META_THREADS, len(names))) as pool:
            return list(pool.map(folder.get, names))

    prefetch_many = staticmethod(RemoteFiles.prefetch_many)
    holding_many = staticmethod(RemoteFiles.holding_many)

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_generation_lock", None)  # (a worker reads under its parent's lock)
        return state


def prefetch_many(requests):
    """Start fetching (and checking) the spans of several files into the local chunk cache -- ``requests``:
    ``(items, byte starts, byte ends)``, each ``items.remote`` a :class:`RemoteFiles` (a cache's latents and
    fields, or a sharded batch's every shard's) -- as one submission to the fetching loop (one hand-off from
    the caller's thread, however many shards and fields), or none where every chunk is local already;
    returns a future at once."""
    remote = [(items.remote, items, starts, ends) for items, starts, ends in requests if items.remote is not None]
    fetches = [(files, fetch) for files, items, starts, ends in remote if (fetch := files._prefetch(items, starts, ends)) is not None]
    if not fetches:
        done = concurrent.futures.Future()
        done.set_result(None)
        return done
    return fetches[0][0].reader._run(_all([fetch for _files, fetch in fetches]))  # (every reader of the process shares its one loop)


async def _all(fetches) -> None:
    await asyncio.gather(*fetches)


def holding_many(requests):
    """One hold over several caches' items: ``requests`` are ``(items, index)`` pairs (a shard's
    :class:`~latentfast.cache.store.layout.Items` or field items, and rows of it), each held as
    :meth:`RemoteFiles.holding_items`; the missing chunks of all are fetched concurrently (one round
    trip for a batch over many shards, not one per shard)."""
    return _holding([items.remote._hold_items(items, index) for items, index in requests])


@contextlib.contextmanager
def _holding(holds):
    """Hold every :class:`_Hold`: under each object's reader lock (the evictor waits) check its chunks
    are all there and intact (see :meth:`.ObjectChunks.intact`); if some are not, let go, fetch them
    (all holds' fetches at once) and look again, up to ``_HOLD_ATTEMPTS`` rounds."""
    holds = [h for h in holds if h is not None]
    for attempt in range(_HOLD_ATTEMPTS + 1):  # (the first look is before any fetch)
        with contextlib.ExitStack() as stack:
            for h in holds:
                stack.enter_context(h.obj.reading())
            # (intact: a chunk damaged on the local disk is dropped here, and fetched again below)
            missing = [h for h in holds if not h.obj.present[h.chunks].all() or not h.obj.intact(h.chunks)]
            if not missing:
                now = now_ns()
                for h in holds:
                    h.obj.atime[h.chunks] = now
                yield
                return
        if attempt == _HOLD_ATTEMPTS:
            break
        # one submission to the fetching loop for every part (a sharded batch's every shard), not one
        # each: each hand-off wakes the loop (every reader of the process shares its one loop)
        missing[0].files.reader._run(_all([h.fetching() for h in missing])).result()
    starts, ends = missing[0].spans()
    raise RemoteReadError(
        f"{missing[0].files.reader.folder.where(missing[0].name, int(starts.min()), int(ends.max()))}: its chunks were "
        f"evicted again before they could be read, {_HOLD_ATTEMPTS} times: local_cache_bytes "
        f"({missing[0].files.reader.cache.capacity}) is too small for what is read at once")
