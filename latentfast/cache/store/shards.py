"""One cache over many shards: a manifest naming shard caches, read as one :class:`~latentfast.cache.LatentCache`.

A sharded cache folder holds, for split ``split``:

- ``{split}.shards.json``       the manifest: ``{"format": "latentfast-shards", "version": 1, "n": N,
  "shards": [{"path", "n", "meta_crc"}], "order_crc"}``; each ``path`` (relative to the folder) is
  a complete cache of its own, written by the usual crash-safe writer; ``meta_crc`` is the CRC-32 of
  its meta file's bytes when the manifest was written (a shard rebuilt since is refused, not misread);
- ``{split}.shards.order.npy``  int64 ``[N, 2]``: item ``i`` of the sharded cache is row
  ``order[i, 1]`` of shard ``order[i, 0]`` (a distributed build keeps the single-process order
  this way; a merge concatenates).

The manifest is written last (after every shard is complete), durably, through a rename: a folder
without it is no sharded cache, and a folder with it reads whole. Every shard must share the
stamp (encoder identity and geometry, layout, fields and their dtypes, the white column).

Reads: ``len``, ``keys``, ``shapes``, ``fields``, ``cache[i]``, ``record(i)``, ``read_batch``
(records, ``pad``/``pad_to``, ``out=``) behave as on one cache. A batch whose items lie in several
shards is one compiled gather per field (``latentfast::gather_rows_multi_into``: row ``i`` is read
from source ``row_sources[i]``), never one call per shard or per item. On a CUDA device the batch
is gathered on the host by that one call and copied over; cold-read advice is not given for
sharded caches (pages fault in as touched).

A :class:`ShardedCache` composes the shards' caches (:class:`~latentfast.cache.store.reader.LatentCache`
each): opening reads the manifest, the order and every shard's meta, and opens the first shard; the
others open on first use, and a shard's files are mapped on the first batch that reads from it.

Where the shards' bytes are is the storage :class:`ShardedCache` is handed, never this module's
business: local folders (None), or in object storage (``latentfast.cache.LatentCache("s3://...")`` of a
pushed distributed build or ``cache merge --copy``) :class:`latentfast.cache.remote.files.RemoteShards`:
the manifest and order come whole into the local cache folder and each shard opens as a remote cache
under the manifest's prefix, all sharing one chunk cache and budget; a batch's missing chunks in every
shard are fetched concurrently, then held while the one gather reads them, and a prefetch of a batch
is one submission to the fetch loop for every shard and field.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import io
import json
import os
import shutil
import threading
import tokenize
import weakref
import zlib

import numpy as np
import torch

from ...errors import CacheCorruptError, IncompleteCacheError, InvalidArgumentError
from . import fields as fieldstore
from . import format as fmt
from .manifest import FORMAT, VERSION, is_sharded_folder, load_manifest, manifest_path, order_path, remote_shard_url
from .reader import LatentCache, inspect_single, layout_summary, verify_single

# what every shard (and every cache `cache merge` joins) must share: not n, nor (in a shaped cache,
# where they are the largest item's) latent_h and w_max
STAMP_KEYS = tuple(k for k in fmt.STAMP_FIELDS if k != "n") + ("layout", "ndim", "dtype", "encode_dtype", "kind")
_SHAPED_SIZES = ("latent_h", "w_max")
_OPEN_THREADS = 16  # shards in object storage opened at once (each open is a dozen small GETs)


def stamp_of(meta: dict) -> dict:
    """The part of a cache's meta every shard must share: encoder, geometry, layout, field dtypes, and an
    import's latent convention (raw or scaled, by which factors; not what it was converted from)."""
    stamp = {k: meta.get(k) for k in STAMP_KEYS if not (meta.get("layout") == "shaped" and k in _SHAPED_SIZES)}
    stamp["fields"] = {name: (e.get("dtype"), e.get("ndim")) for name, e in sorted((meta.get("fields") or {}).items())}
    convention = meta.get("latent_convention")
    stamp["latent_convention"] = {k: v for k, v in convention.items() if k != "converted_from"} \
        if isinstance(convention, dict) else convention
    return stamp


def _shared_fields(a: dict, b: dict, first: dict, other: dict) -> tuple[dict, dict]:
    """Two stamps' fields less those one cache lacks where either may lack it (a shard whose items all lack
    an optional field has none of it: a distributed import's share of one subset)."""
    def keep(mine: dict, theirs: dict) -> dict:
        return {n: v for n, v in mine.items() if n in theirs or not (may_lack(first, n) or may_lack(other, n))}
    return keep(a, b), keep(b, a)


def may_lack(meta: dict, name: str) -> bool:
    """Whether the cache of ``meta`` lets items lack field ``name``: stored optional, or its writer's
    ``optional=`` (``meta["optional_fields"]``: true, or the names) allows it."""
    allowed = meta.get("optional_fields")
    return bool(((meta.get("fields") or {}).get(name) or {}).get("optional")) or allowed is True \
        or (isinstance(allowed, list) and name in allowed)


def meta_mismatch(first: dict, first_dir: str, other: dict, other_dir: str) -> list[str]:
    """Lines naming each stamp field where the meta ``other`` (of ``other_dir``) differs from ``first``."""
    a, b = stamp_of(first), stamp_of(other)
    a["fields"], b["fields"] = _shared_fields(a["fields"], b["fields"], first, other)
    return [f"  {k}: {first_dir} has {a[k]!r}, {other_dir} has {b[k]!r}" for k in a if a[k] != b[k]]


def stamp_mismatch(first: LatentCache, other: LatentCache) -> list[str]:
    """Lines naming each stamp field where ``other`` differs from ``first`` (white column included)."""
    lines = meta_mismatch(first.meta, first.cache_dir, other.meta, other.cache_dir)
    wa, wb = first.white_column, other.white_column
    if (wa is None) != (wb is None) or (wa is not None and not torch.equal(wa, wb)):
        lines.append(f"  white column: {first.cache_dir} and {other.cache_dir} store different ones")
    return lines


def write_manifest(cache_dir, split: str, shard_dirs: list[str], order: np.ndarray | None = None) -> str:
    """Publish the manifest of the complete caches ``shard_dirs`` (each of ``split``) in ``cache_dir``:
    ``order`` (int64 ``[N, 2]`` of (shard, row); default: the shards concatenated) written first,
    the manifest last, both durably. Checks every shard opens and shares the stamp; returns the path."""
    cache_dir = os.fspath(cache_dir)
    shards = [LatentCache(d, split) for d in shard_dirs]
    check_joinable(shards, split)
    if order is None:
        order = np.concatenate([np.stack([np.full(len(s), k), np.arange(len(s))], axis=1) for k, s in enumerate(shards)]
                               ).astype(np.int64).reshape(-1, 2)
    _check_order(order, [len(s) for s in shards], order_path(cache_dir, split))
    payload = fmt.npy_bytes(np.ascontiguousarray(order, dtype=np.int64))
    os.makedirs(cache_dir, exist_ok=True)
    fmt.write_bytes_durably(order_path(cache_dir, split), payload)
    entries = [{"path": os.path.relpath(os.path.abspath(s.cache_dir), os.path.abspath(cache_dir)), "n": len(s),
                "meta_crc": _file_crc(fmt.cache_path(s.cache_dir, split, "meta"))} for s in shards]
    manifest = {"format": FORMAT, "version": VERSION, "split": split, "n": int(len(order)), "shards": entries,
                "order_crc": zlib.crc32(payload)}
    path = manifest_path(cache_dir, split)
    fmt.write_bytes_durably(path, (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode())
    return path


def check_joinable(parts: list[LatentCache], split: str) -> None:
    """Refuse caches that cannot be one: of different stamps (naming each field that differs and both
    caches), one folder twice, or a key held by two of them (naming it and both caches)."""
    if not parts:
        raise InvalidArgumentError("a sharded cache needs at least one shard")
    for other in parts[1:]:
        lines = stamp_mismatch(parts[0], other)
        if lines:
            raise InvalidArgumentError("caches of different encoders, geometry, fields or latent conventions cannot be one "
                                       "cache:\n" + "\n".join(lines))
    where: dict[str, tuple[str, int]] = {}
    for part in parts:  # (a cache without keys has row numbers for keys: nothing to tell its items apart by)
        if os.path.exists(fmt.cache_path(part.cache_dir, split, "keys")):
            for row, key in enumerate(part.keys):
                if key in where:
                    first, at = where[key]
                    raise InvalidArgumentError(f"key {key!r} appears twice, in {first} (row {at}) and in {part.cache_dir} "
                                               f"(row {row}): a cache holds each key once; leave one of them out")
                where[key] = (part.cache_dir, row)
    seen: dict[str, str] = {}
    for part in parts:
        folder = os.path.realpath(part.cache_dir)  # (a cache in object storage: its local mirror, one per URL)
        if folder in seen:
            raise InvalidArgumentError(f"cache {part.cache_dir} is given twice (as {seen[folder]} too): a cache holds each item once")
        seen[folder] = part.cache_dir


def references_path(shard_dir, split: str) -> str:
    """The file in a shard's folder listing the manifests outside it that refer to it (hidden: not one of
    the cache's files, so push and ``merge --copy`` leave it)."""
    return os.path.join(os.fspath(shard_dir), f".{split}.referenced-by")


def note_references(shard_dirs: list[str], split: str, manifest: str) -> None:
    """Record in each of ``shard_dirs`` that ``manifest`` (a ``cache merge`` without ``--copy``) refers to
    it, so that a distributed build cleaning up the folder it lies in keeps it (see
    :func:`latentfast.cache.builders.distributed.remove_other_worlds`)."""
    for folder in shard_dirs:
        with open(references_path(folder, split), "a", encoding="utf-8") as fh:
            fh.write(os.path.realpath(manifest) + "\n")


def referenced_by(shard_dir, split: str) -> list[str]:
    """The manifests recorded by :func:`note_references` that exist and still name ``shard_dir``."""
    try:
        with open(references_path(shard_dir, split), encoding="utf-8") as fh:
            paths = list(dict.fromkeys(fh.read().splitlines()))
    except FileNotFoundError:
        return []
    here, live = os.path.realpath(shard_dir), []
    for path in paths:
        try:
            entries = load_manifest(path)["shards"]
        except (OSError, CacheCorruptError):
            continue  # gone or damaged: it refers to nothing
        if any(os.path.realpath(os.path.join(os.path.dirname(path), e["path"])) == here for e in entries):
            live.append(path)
    return live


def _file_crc(path: str) -> int:
    with open(path, "rb") as fh:
        return zlib.crc32(fh.read())


def _check_order(order: np.ndarray, sizes: list[int], path: str) -> None:
    """Every row of every shard named exactly once, as (shard, row) pairs."""
    if order.ndim != 2 or order.shape[1] != 2 or not np.issubdtype(order.dtype, np.integer) or len(order) != sum(sizes):
        raise CacheCorruptError(f"sharded cache order {path} must be an int64 [N, 2] array of (shard, row) with N = {sum(sizes)}, "
                                f"got {order.dtype} {list(order.shape)}")
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    if len(order) and (order[:, 0].min() < 0 or order[:, 0].max() >= len(sizes)):
        raise CacheCorruptError(f"sharded cache order {path} names a shard outside [0, {len(sizes)})")
    flat = starts[order[:, 0]] + order[:, 1] if len(order) else np.zeros(0, np.int64)
    bad = (order[:, 1] < 0) | (order[:, 1] >= np.asarray(sizes, dtype=np.int64)[order[:, 0]]) if len(order) else flat < 0
    # (in range and as many as the rows: each named once is each counted once -- a count, not a sort)
    if bad.any() or (len(flat) and int(np.bincount(flat, minlength=len(flat)).max()) != 1):
        raise CacheCorruptError(f"sharded cache order {path} must name every row of every shard exactly once")


class ShardSources:
    """Several flat float16 sources and, per row of a gather source, which of them holds it: what
    :func:`latentfast.cache.feed.gather` hands ``gather_rows_multi_into`` in place of one ``data``.
    ``tensors[k]`` is an empty placeholder until a batch first reads from shard ``k`` (its file is
    mapped then, by :meth:`_ShardHolds.holding_items`: a cache of 1,000 shards holds no descriptor of a
    shard it has not read)."""

    __slots__ = ("tensors", "row_sources")

    def __init__(self, tensors: list[torch.Tensor], row_sources: torch.Tensor):
        self.tensors, self.row_sources = tensors, row_sources


_UNMAPPED = torch.zeros(0, dtype=torch.float16)  # a shard's place in ShardSources.tensors before it is read


def _joined_source(parts: list, order: np.ndarray, flat: np.ndarray):
    """One gather source over shards: ``(ShardSources, row_offsets, widths, pitch)`` in the global order,
    from each shard's geometry (nothing mapped: see :class:`ShardSources`)."""
    geometry = [_geometry(p) for p in parts]
    pitches = {g[2] for g in geometry}
    if len(pitches) != 1:
        raise CacheCorruptError(f"the shards of a sharded cache have different line pitches {sorted(pitches)}")
    all_offsets = np.concatenate([g[0] for g in geometry]).astype(np.int64, copy=False)
    all_widths = np.concatenate([g[1] for g in geometry])
    sources = ShardSources([_UNMAPPED] * len(parts), torch.from_numpy(order[:, 0].astype(np.int32)))
    return (sources, torch.from_numpy(np.ascontiguousarray(all_offsets[flat])),
            torch.from_numpy(np.ascontiguousarray(all_widths[flat].astype(np.int32))), pitches.pop())


def _geometry(part) -> tuple[np.ndarray, np.ndarray, int]:
    """``(unit offsets, units per line, pitch)`` of one shard's latents (:class:`~.layout.Items`) or
    field (:class:`~.fields.FieldItems`), as its gather source has them, without mapping its file."""
    if isinstance(part, _NoValues):
        return np.zeros(part.n, np.int64), np.zeros(part.n, np.int32), 0
    if part.row_ends is not None:  # a field: each value's units
        return part.row_starts, (part.row_ends - part.row_starts).astype(np.int32), 0
    if part.shaped and part.index_checks is not None and part.remote is not None:
        part.index_checks.check_all()  # (a shard in object storage: its whole index fetched and checked before it is joined)
    widths = np.diff(part.row_starts) if part.shaped else part.widths  # a shaped item is one line of all its units
    return part.row_starts[:-1], np.asarray(widths).astype(np.int32, copy=False), part.pitch


class _ShardChecks:
    """``verify_rows`` over shards: each item's checksum block checked in its own shard."""

    def __init__(self, items: "ShardedItems"):
        self.items = items

    def check(self, _items, _starts, index_np) -> None:
        for k, rows in self.items.by_shard(index_np):
            shard = self.items.cache.shard(k)
            shard.items.block_checks.check(shard.items, shard.row_starts, rows)


class ShardedItems:
    """What the read path needs of a sharded cache (see :class:`~latentfast.cache.store.layout.Items`):
    geometry in the global order, and a gather source over every shard's data file. The per-item
    tables (``widths``, ``shapes``, the source) are built on first use: opening a sharded cache opens
    none of its shards' indexes but the first's."""

    index_checks = None  # (each shard checks its own index blocks when it is opened)

    def __init__(self, cache: "ShardedCache"):
        self.cache, self.order = weakref.proxy(cache), cache.order  # (the cache owns its items: no reference cycle)
        self.cache_dir, self.split, self.meta = cache.cache_dir, cache.split, cache.meta
        self.path = manifest_path(cache.cache_dir, cache.split)
        self.n, self.shaped, self.verify_rows = len(cache), cache.shaped, cache.verify_rows
        self.channels, self.latent_h, self.w_max = cache.channels, cache.latent_h, cache.w_max
        self.white = cache.white_column
        self.dtype = cache.dtype  # the stored latents' dtype (one across shards: part of the stamp)
        self.row_starts = None  # no single file: the cold-read path (keyed on row_starts) stands aside
        self.remote = _ShardHolds(cache, lambda shard: shard.items)  # maps (and in object storage, holds) a batch's shards
        self.block_checks = _ShardChecks(weakref.proxy(self))
        self._source = None

    @functools.cached_property
    def widths(self) -> np.ndarray:
        return self.cache.widths

    @functools.cached_property
    def shapes(self) -> np.ndarray | None:
        return self.cache.shapes if self.shaped else None

    def source(self):
        if self._source is None:
            self._source = _joined_source([s.items for s in self.cache.shards], self.order, self.cache._flat)
        self.check_unchanged()
        return self._source

    def map_shards(self, shards) -> None:
        """Map the data file of each of ``shards`` not mapped yet into the gather source."""
        tensors = self.source()[0].tensors
        for k in shards:
            if tensors[k] is _UNMAPPED:
                tensors[k] = self.cache.shard(k).items.source()[0]

    def by_shard(self, index_np) -> list[tuple[int, np.ndarray]]:
        """``(shard, its rows)`` for the items ``index_np`` (in range) grouped by shard, in shard order (one
        stable sort of the batch, not a pass over it per shard: a lookahead asks this of every batch)."""
        picked = self.order[np.asarray(index_np, dtype=np.int64)]
        picked = picked[np.argsort(picked[:, 0], kind="stable")]
        cuts = [0, *(np.flatnonzero(picked[1:, 0] != picked[:-1, 0]) + 1).tolist(), len(picked)] if len(picked) else [0]
        return [(int(picked[a, 0]), picked[a:b, 1]) for a, b in zip(cuts[:-1], cuts[1:])]

    def check_unchanged(self) -> None:
        for shard in self.cache.opened_shards():
            shard.items.check_unchanged()


class ShardedFieldItems:
    """One record field over shards (see :class:`~latentfast.cache.store.fields.FieldItems`); its per-item
    tables built on first use, as :class:`ShardedItems`'s."""

    row_starts = row_ends = None

    def __init__(self, cache: "ShardedCache", name: str):
        self.cache, self.name, self.order, self.verify_rows = weakref.proxy(cache), name, cache.order, cache.verify_rows
        self.dtype = fieldstore.DTYPES[cache.meta["fields"][name]["dtype"]]
        self.ndim = int(cache.meta["fields"][name]["ndim"])
        self.n = len(self.order)
        self.remote = _ShardHolds(cache, lambda shard: shard.field_items.get(name))
        self._source = None

    def part(self, k: int):
        """Shard ``k``'s items of this field (a shard none of whose items has it stores none: :class:`_NoValues`)."""
        shard = self.cache.shard(k)
        return shard.field_items.get(self.name) or _NoValues(len(shard), self.name, self.dtype, self.ndim)

    @functools.cached_property
    def parts(self) -> list:
        self.cache.shards  # (opened at once)
        return [self.part(k) for k in range(len(self.cache.shard_dirs))]

    def _joined(self, attr: str) -> np.ndarray:
        return np.concatenate([getattr(p, attr) for p in self.parts])[self.cache._flat]

    @functools.cached_property
    def shapes(self) -> np.ndarray:
        return self._joined("shapes")

    @functools.cached_property
    def nbytes(self) -> np.ndarray:
        return self._joined("nbytes")

    @functools.cached_property
    def present(self) -> np.ndarray | None:
        if all(p.present is None for p in self.parts):
            return None
        return np.concatenate([np.ones(p.n, bool) if p.present is None else p.present for p in self.parts])[self.cache._flat]

    def source(self):
        if self._source is None:
            self._source = _joined_source(self.parts, self.order, self.cache._flat)
        return self._source

    def map_shards(self, shards) -> None:
        tensors = self.source()[0].tensors
        for k in shards:
            if tensors[k] is _UNMAPPED and not isinstance(self.parts[k], _NoValues):
                tensors[k] = self.parts[k].source()[0]

    def check(self, index_np) -> None:
        for k, rows in self.cache.items.by_shard(index_np):
            self.parts[k].check(rows)


class _NoValues:
    """An optional field of a shard none of whose items has it (so the shard stores no such field): its
    ``n`` items read as absent, in the field's dtype and ndim."""

    remote = None
    row_starts = row_ends = None

    def __init__(self, n: int, name: str, dtype: torch.dtype, ndim: int):
        self.n, self.name, self.dtype = n, name, dtype
        self.shapes = np.zeros((n, ndim), dtype=np.int64)
        self.nbytes = np.zeros(n, dtype=np.int64)
        self.present = np.zeros(n, dtype=bool)

    def check(self, index_np) -> None:
        pass  # (no values: nothing to check)


class _ShardHolds:
    """What a batch of a sharded cache holds while it is gathered: each of its shards' files mapped (on
    the first batch that reads from it) and, in object storage, each shard's rows of the batch fetched
    and held in that shard's own files (see :func:`latentfast.cache.store.layout.holding_items`).
    ``part(shard)``: a shard's items of what is read (its latents, or one field's; None: it has none)."""

    def __init__(self, cache: "ShardedCache", part):
        self.cache, self.part = weakref.proxy(cache), part  # (so a dropped cache closes its shards' files at once)

    def holding_items(self, items, index):
        groups = self.cache.items.by_shard(index)
        items.map_shards([k for k, _ in groups])
        if self.cache.storage is None:
            return contextlib.nullcontext()
        requests = [(part, rows) for k, rows in groups if (part := self.part(self.cache.shard(k))) is not None]
        return self.cache.storage.holding_many(requests)  # every shard's missing chunks fetched at once


def _flat_rows(order: np.ndarray, sizes: list[int]) -> np.ndarray:
    """Each global item's row in the shards' arrays concatenated."""
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return starts[order[:, 0]] + order[:, 1]


class ShardedCache(LatentCache):
    """A sharded cache opened as one (``latentfast.cache.LatentCache(dir)`` returns one when ``dir`` holds a
    manifest): it composes the shards' caches, each a :class:`~latentfast.cache.store.reader.LatentCache`.

    ``storage``: None for shards in local folders; a sharded cache in object storage is handed
    :class:`latentfast.cache.remote.files.RemoteShards` (``mirror``: the local folder of its manifest and
    order; ``shard(path)``: a shard's own storage; ``shard_metas(paths)``: the shards' meta bytes;
    ``holding_many``: one hold over several shards' files).

    Opening reads the manifest, the order and every shard's meta once (each against the manifest's CRC
    of it, and its stamp against the first's) and opens the first shard; every other shard opens on
    first use (a batch that reads from it, or the first ask for the per-item tables: ``shapes``,
    ``widths``, ``keys``), and then has its item count, meta and white column checked."""

    def __init__(self, cache_dir, split: str = "train", expected=None, white_column=None, *, verify_rows: bool = False,
                 storage=None):
        self.storage = storage
        self.url = None if storage is None else storage.url
        self.cache_dir = os.fspath(cache_dir) if storage is None else storage.mirror
        self.split, self.verify_rows = split, bool(verify_rows)
        self.remote = None  # (each shard's own storage holds its bytes)
        self._shard_args = (expected, white_column)
        path = manifest_path(self.cache_dir, split)
        manifest = load_manifest(path)
        self._entries = manifest["shards"]
        if self.url is not None:
            self.shard_dirs = [remote_shard_url(self.url, e["path"], path) for e in self._entries]
        else:
            self.shard_dirs = [os.path.normpath(os.path.join(self.cache_dir, e["path"])) for e in self._entries]
        metas = self._metas = self._shard_metas(path)
        self._opened: list[LatentCache | None] = [None] * len(self.shard_dirs)
        self._opening = [threading.Lock() for _ in self.shard_dirs]  # one per shard: several open at once, each once
        first = self.shard(0)
        self.meta = {k: v for k, v in first.meta.items() if k != "files"}  # (each shard's files are its own)
        self.meta.update(n=sum(e["n"] for e in self._entries), shards=len(self._entries))  # (the order names each row once)
        self._join_optional_fields(metas)
        if first.shaped:
            self.meta.update({k: max(int(m[k]) for m in metas) for k in _SHAPED_SIZES})
        self.white_column = first.white_column
        self._order_crc = manifest["order_crc"]
        self._load_order()
        self.row_starts = None
        self._reset_process_state()

    def _shard_metas(self, path: str) -> list[dict]:
        """Every shard's meta, read once: its bytes against the manifest's CRC, its item count against the
        manifest's, its stamp against the first shard's (:class:`CacheCorruptError` names the shard)."""
        if self.url is None:
            payloads = []
            for folder in self.shard_dirs:
                try:
                    with open(fmt.cache_path(folder, self.split, "meta"), "rb") as fh:
                        payloads.append(fh.read())
                except FileNotFoundError:
                    raise IncompleteCacheError(f"sharded cache {path}: shard {folder} is missing or incomplete; "
                                               f"re-run the build (or the merge) that wrote it") from None
        else:
            payloads = self.storage.shard_metas([e["path"] for e in self._entries])
        metas = []
        for entry, folder, payload in zip(self._entries, self.shard_dirs, payloads):
            try:
                meta = json.loads(payload)
            except (ValueError, UnicodeDecodeError):
                meta = None
            if zlib.crc32(payload) != entry["meta_crc"] or not isinstance(meta, dict) or meta.get("n") != entry["n"]:
                now = meta.get("n") if isinstance(meta, dict) else None
                raise CacheCorruptError(f"sharded cache {path}: shard {folder} changed after the manifest was written "
                                        f"(now {now} items, the manifest says {entry['n']}); re-run the build or merge")
            metas.append(meta)
        first = stamp_of(metas[0])
        for folder, meta in zip(self.shard_dirs[1:], metas[1:]):
            lines = [] if stamp_of(meta) == first else meta_mismatch(metas[0], self.shard_dirs[0], meta, folder)
            if lines:
                raise CacheCorruptError(f"sharded cache {path}: its shards disagree:\n" + "\n".join(lines))
        return metas

    # -- the shards, each opened on first use -----------------------------------------------------
    def shard(self, k: int) -> LatentCache:
        """Shard ``k``, opened (and checked against the manifest and the first shard) on first use."""
        shard = self._opened[k]
        if shard is None:
            with self._opening[k]:
                shard = self._opened[k]
                if shard is None:
                    shard = self._opened[k] = self._open_shard(k)
        return shard

    def _open_shard(self, k: int) -> LatentCache:
        expected, white_column = self._shard_args
        storage = None if self.storage is None else self.storage.shard(self._entries[k]["path"])
        shard = LatentCache(self.shard_dirs[k], self.split, expected, white_column, verify_rows=self.verify_rows, storage=storage)
        entry, path = self._entries[k], manifest_path(self.cache_dir, self.split)
        if len(shard) != entry["n"] or shard.meta != self._metas[k]:  # (the meta checked against the manifest at the open)
            raise CacheCorruptError(f"sharded cache {path}: shard {self.shard_dirs[k]} changed after the manifest was written "
                                    f"(now {len(shard)} items, the manifest says {entry['n']}); re-run the build or merge")
        if k:
            lines = stamp_mismatch(self.shard(0), shard)
            if lines:
                raise CacheCorruptError(f"sharded cache {path}: its shards disagree:\n" + "\n".join(lines))
        return shard

    @property
    def shards(self) -> list[LatentCache]:
        """Every shard, opened (those in object storage, several at once)."""
        return self.open_shards(range(len(self._opened)))

    def open_shards(self, ks) -> list[LatentCache]:
        """Shards ``ks``, opened: those in object storage not open yet several at once (each open is a
        dozen requests one after another: one by one, a batch over 8 new shards would wait 8 times as long)."""
        ks = list(ks)
        todo = [k for k in ks if self._opened[k] is None]
        if self.storage is not None and len(todo) > 1:
            with concurrent.futures.ThreadPoolExecutor(min(_OPEN_THREADS, len(todo))) as pool:
                list(pool.map(self.shard, todo))
        return [self.shard(k) for k in ks]

    def opened_shards(self) -> list[LatentCache]:
        """The shards opened so far in this process."""
        return [s for s in self._opened if s is not None]

    def _load_order(self) -> None:
        """The order file (checked against the manifest's CRC); the per-item tables joined in its order are
        built on first use (:attr:`widths`, :attr:`shapes`)."""
        opath = order_path(self.cache_dir, self.split)
        try:
            with open(opath, "rb") as fh:
                payload = fh.read()  # (write_manifest wrote the bytes its CRC is of: checked as they are, then parsed)
        except FileNotFoundError:
            raise FileNotFoundError(f"latent cache shard order file {opath} does not exist") from None
        if zlib.crc32(payload) != self._order_crc:
            raise CacheCorruptError(f"sharded cache order {opath} fails its CRC-32 recorded in {manifest_path(self.cache_dir, self.split)}")
        try:
            order = np.load(io.BytesIO(payload), allow_pickle=False)
        except (ValueError, EOFError, OSError, SyntaxError, tokenize.TokenError) as exc:  # (as format.load_npy names them)
            raise CacheCorruptError(f"sharded cache order {opath} is not a valid .npy array: {type(exc).__name__}: {exc}") from None
        sizes = [e["n"] for e in self._entries]
        _check_order(order, sizes, opath)
        self.order = order.astype(np.int64, copy=False)
        self._flat = _flat_rows(self.order, sizes)

    @functools.cached_property
    def widths(self) -> np.ndarray:
        return np.concatenate([s.widths for s in self.shards])[self._flat].astype(np.int32)

    @functools.cached_property
    def _shapes(self) -> np.ndarray:
        return np.concatenate([s.shapes for s in self.shards])[self._flat]

    def _join_optional_fields(self, metas: list[dict]) -> None:
        """The meta's fields over every shard: a field optional in one shard, or missing from one (all its
        items lack it), is optional in the whole, its ``absent`` the shards' total."""
        fields: dict = {}
        for meta in metas:
            for name, entry in (meta.get("fields") or {}).items():
                fields.setdefault(name, dict(entry))
        for name, entry in fields.items():
            held = [(m.get("fields") or {}).get(name) for m in metas]
            if any(e is None or e.get("optional") for e in held):
                entry.update(optional=True, absent=sum(m["n"] if e is None else e.get("absent", 0) for m, e in zip(metas, held)))
        if fields:
            self.meta["fields"] = fields

    def _reset_process_state(self) -> None:
        self.items = ShardedItems(self)
        self.field_items = {name: ShardedFieldItems(self, name) for name in self.meta.get("fields", {})}
        self._keys = None
        self._key_index = None

    # -- per item: the shard's own reads --------------------------------------------------------
    def _where(self, i) -> tuple[LatentCache, int]:
        i = self._checked_index(i)
        return self.shard(int(self.order[i, 0])), int(self.order[i, 1])

    def __getitem__(self, i: int) -> torch.Tensor:
        shard, row = self._where(i)
        return shard[row]

    def record(self, i: int) -> dict[str, torch.Tensor]:
        shard, row = self._where(i)
        return shard.record(row)

    def info(self, i: int) -> dict:
        shard, row = self._where(i)
        return shard.info(row)

    def _key_table(self):
        return None  # (the meta is the first shard's: each shard looks its own keys up)

    def stores_keys(self) -> bool:
        if self.__dict__.get("_stores_keys") is None:  # (asked per key: every shard opened once, then remembered)
            self._stores_keys = any(s.stores_keys() for s in self.shards)
        return self._stores_keys

    def key(self, i: int) -> str:
        shard, row = self._where(i)
        return shard.key(row) if self.stores_keys() else str(self._checked_index(i))

    def keys_of(self, index) -> list[str]:
        return [self.key(i) for i in np.asarray(index, dtype=np.int64).tolist()]

    @property
    def keys(self) -> list[str]:
        if self._keys is None:
            if not self.stores_keys():
                self._keys = [str(i) for i in range(len(self))]  # as a keyless cache: the row numbers (of the whole)
            else:
                keys = [k for s in self.shards for k in s.keys]
                self._keys = [keys[j] for j in self._flat.tolist()]
        return self._keys

    def content_hashes(self) -> np.ndarray | None:
        parts = [s.content_hashes() for s in self.shards]
        return None if any(p is None for p in parts) else np.concatenate(parts)[self._flat]

    def verify_items(self, indices) -> None:
        self.items.block_checks.check(None, None, np.asarray(indices, dtype=np.int64))

    def check_unchanged(self) -> None:
        self.items.check_unchanged()

    def gather_source(self):
        return self.items.source()

    def prefetch(self, indices) -> None:
        """Start reading items ``indices`` ahead: in object storage every shard's and field's spans of them in
        one submission to the fetching loop (:meth:`RemoteShards.prefetch_many
        <latentfast.cache.remote.files.RemoteShards.prefetch_many>`); local shards each get their cold-read advice."""
        groups = self.items.by_shard(indices)
        shards = self.open_shards(k for k, _rows in groups)
        if self.storage is None:
            for shard, (_k, rows) in zip(shards, groups):
                shard.prefetch(rows)
            return None
        return self.storage.prefetch_many([r for shard, (_k, rows) in zip(shards, groups) for r in shard.prefetch_requests(rows)])

    def shard_chunks(self, chunk_bytes: int) -> np.ndarray:
        """int64 ``[N]``: each item's chunk (:func:`latentfast.cache.feed.sampler.item_chunks`), the chunks
        of each shard's data file numbered after the previous shard's (no chunk spans two files)."""
        per_shard, base = [], 0
        for shard in self.shards:
            chunks = np.asarray(shard.row_starts[:-1], dtype=np.int64) * 2 // chunk_bytes + base  # float16 elements
            base = int(chunks.max(initial=base - 1)) + 1
            per_shard.append(chunks)
        return np.concatenate(per_shard)[self._flat]

    def _memmap(self):
        raise InvalidArgumentError(f"sharded cache {self.cache_dir} has no single data file; read its shards ({self.shard_dirs})")

    def __repr__(self) -> str:
        return f"ShardedCache({self.cache_dir!r}, split={self.split!r}, n={len(self)}, shards={len(self.shard_dirs)}, layout={self.layout!r})"

    def __getstate__(self) -> dict:  # the shards (each its paths and meta) and the manifest's order CRC: no per-item array
        state = self.__dict__.copy()
        for key in ("items", "field_items", "_keys", "_key_index", "_info", "_opening", "order", "_flat", "widths", "_shapes"):
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._opening = [threading.Lock() for _ in self.shard_dirs]
        self._load_order()
        self._reset_process_state()


def _copy_durably(src: str, dst: str) -> None:
    """Copy ``src`` to ``dst`` through a partial name, fsynced before the rename (a crash leaves no torn file)."""
    tmp = fmt.partial_path(dst)
    shutil.copyfile(src, tmp)
    with open(tmp, "rb+") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, dst)
    fmt.fsync_dir(os.path.dirname(dst) or ".")


def open_folder(cache_dir, split: str = "train", *args, **kwargs) -> LatentCache:
    """The cache in the local folder ``cache_dir``: a :class:`ShardedCache` where it holds a manifest, else
    one :class:`~latentfast.cache.store.reader.LatentCache` (``args``, ``kwargs``: theirs). Object storage
    is :class:`latentfast.cache.LatentCache`'s to open."""
    opener = ShardedCache if is_sharded_folder(cache_dir, split) else LatentCache
    return opener(cache_dir, split, *args, **kwargs)


def verify_opened(cache: LatentCache) -> dict:
    """:func:`~latentfast.cache.verify_cache` of an opened cache: one cache, or every shard of a sharded one."""
    return verify_sharded(cache) if isinstance(cache, ShardedCache) else verify_single(cache)


def inspect_opened(cache: LatentCache, bins: int = 10) -> dict:
    """:func:`~latentfast.cache.inspect_cache` of an opened cache: one cache, or a sharded one's shards."""
    return inspect_sharded(cache, bins) if isinstance(cache, ShardedCache) else inspect_single(cache, bins)


def verify_sharded(cache: ShardedCache) -> dict:
    """:func:`~latentfast.cache.verify_cache` of every shard (the manifest and order were checked when the
    cache opened); the summed figures."""
    results = [verify_single(shard) for shard in cache.shards]
    seconds = sum(r["seconds"] for r in results)
    nbytes = sum(r["bytes"] for r in results)
    return {"rows": len(cache), "bytes": nbytes, "blocks": sum(r["blocks"] for r in results),
            "checksummed": all(r["checksummed"] for r in results), "seconds": seconds,
            "gb_per_s": nbytes / seconds / 1e9 if seconds > 0 else float("inf"), "shards": len(results)}


def inspect_sharded(cache: ShardedCache, bins: int = 10) -> dict:
    """:func:`~latentfast.cache.inspect_cache` over the shards: the same keys, summed, plus ``shards``
    (each shard's folder or URL, items and bytes on disk). Histograms and counts are of the whole cache."""
    split = cache.split
    parts = [inspect_single(shard, bins) for shard in cache.shards]
    files = {os.path.basename(p): os.path.getsize(p) for p in (manifest_path(cache.cache_dir, split), order_path(cache.cache_dir, split))}
    info = {"meta": cache.meta, "n": len(cache), "layout": cache.layout, "files": files,
            "bytes_on_disk": sum(p["bytes_on_disk"] for p in parts) + sum(files.values()),
            "data_bytes": sum(p["data_bytes"] for p in parts),
            "resident_bytes": None if any(p["resident_bytes"] is None for p in parts) else sum(p["resident_bytes"] for p in parts),
            "shards": [{"path": d, "n": p["n"], "bytes_on_disk": p["bytes_on_disk"]} for d, p in zip(cache.shard_dirs, parts)]}
    entries = {name: entry for p in reversed(parts) for name, entry in p["fields"].items()}  # (the first shard's, where it has one)
    info["fields"] = {name: {**entry, **{k: sum(p["fields"][name][k] for p in parts if name in p["fields"])
                                         for k in ("logical_bytes", "stored_bytes")}}
                      for name, entry in entries.items()}
    info.update(layout_summary(cache, info["data_bytes"], bins))
    return info


def merge_caches(sources: list, out_dir, split: str = "train", *, copy: bool = False) -> str:
    """Join complete caches of one stamp into the sharded cache ``out_dir`` (the sources' items in
    order); the data stays where it is (the manifest refers to the sources, and each source's folder
    records that it does: a distributed build that would delete it as another world size's shard keeps
    it), or with ``copy`` each source's files are copied into ``out_dir/shards/`` first. Returns the manifest's path. Sources of
    different encoders, geometry or fields are refused, naming what differs. A sharded source
    contributes its shards (in its order). Sources of other latent conventions (a raw and a scaled
    import), one source twice, or a key in two sources are refused too (:func:`check_joinable`)."""
    out_dir = os.fspath(out_dir)
    if len(sources) < 1:
        raise InvalidArgumentError("cache merge needs at least one source cache")
    if os.path.exists(fmt.cache_path(out_dir, split, "meta")):
        raise InvalidArgumentError(f"--out {out_dir} already holds a single cache of split {split!r}; choose another folder")
    os.makedirs(out_dir, exist_ok=True)
    dirs, orders, base, opened_parts = [], [], 0, []
    for source in sources:
        opened = open_folder(source, split)
        parts = opened.shard_dirs if isinstance(opened, ShardedCache) else [opened.cache_dir]
        opened_parts += opened.shards if isinstance(opened, ShardedCache) else [opened]
        order = opened.order.copy() if isinstance(opened, ShardedCache) else np.stack(
            [np.zeros(len(opened), np.int64), np.arange(len(opened), dtype=np.int64)], axis=1)
        order[:, 0] += base
        dirs += parts
        orders.append(order)
        base += len(parts)
    check_joinable(opened_parts, split)  # before anything is copied
    if copy:
        copied = []
        for k, folder in enumerate(dirs):
            target = os.path.join(out_dir, "shards", f"{split}-{k:05d}")
            os.makedirs(target, exist_ok=True)
            for name in sorted(os.listdir(folder)):
                if name.startswith(f"{split}.") and ".shards." not in name and os.path.isfile(os.path.join(folder, name)):
                    if name != os.path.basename(fmt.cache_path(folder, split, "meta")):
                        _copy_durably(os.path.join(folder, name), os.path.join(target, name))
            _copy_durably(fmt.cache_path(folder, split, "meta"), fmt.cache_path(target, split, "meta"))  # the meta last
            copied.append(target)
        dirs = copied
    path = write_manifest(out_dir, split, dirs, np.concatenate(orders))
    if not copy:  # the sources' folders are the data now: a build cleaning up where they lie must keep them
        note_references(dirs, split, path)
    return path


__all__ = ["ShardedCache", "is_sharded_folder", "merge_caches", "open_folder", "write_manifest", "verify_opened", "inspect_opened"]
