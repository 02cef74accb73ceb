"""Open, read, inspect and verify a latent cache (see :mod:`latentfast.cache.store.format`)."""
from __future__ import annotations

import json
import operator
import os
import time
import zlib
from typing import Any

import numpy as np
import torch

from ...errors import (CacheCorruptError, CacheError, IncompleteCacheError, IndexOutOfRangeError, InvalidArgumentError,
                       UnknownKeyError)
from ...checks import as_row_indices
from ..feed import coldread, gather
from ..feed import loader as feed_loader
from ..feed.readspec import ReadSpec
from . import fields as fieldstore
from . import format as fmt
from . import keytable, layout, tables


_CHECK_CHUNK = 1 << 16  # items whose shapes and offsets are checked at once when a cache opens
# index files smaller than this are read whole rather than mapped: a map holds a file descriptor for as
# long as it lives (Python's mmap keeps a copy of it), and a sharded cache of 1,000 small shards would
# hold two per shard; a read of under a MiB costs less than the map
_MAP_INDEX_BYTES = 1 << 20
# in object storage what costs is the fetch: a table is mapped (its blocks fetched as they are read) above this
_MAP_REMOTE_INDEX_BYTES = 64 << 10


def _mapped(path: str, remote: bool = False) -> bool:
    """Whether the index file at ``path`` is mapped (large) or read whole (small, or gone: the load names it)."""
    try:
        return os.path.getsize(path) >= (_MAP_REMOTE_INDEX_BYTES if remote else _MAP_INDEX_BYTES)
    except OSError:
        return False


class LatentCache:
    """Read-only, worker-safe view of a built latent cache (any layout, see :mod:`~latentfast.cache.store.format`).

    ``cache[i]`` is a float16 copy of item i, of shape ``shapes[i]``: ``[C, h, w_i]`` in a line
    cache, any shape in a ``shaped`` one. ``shapes`` (int64 ``[N, ndim]``) and ``keys`` (each
    item's source name; the row number as a string where the cache stores none) exist on every
    cache. ``expected`` (a dict of meta fields, e.g. from :func:`latentfast.cache.cache_meta_for`
    or ``{"encoder": vae.identity()}``) that disagrees with the cache raises ``ValueError`` naming
    every differing field. ``white_column`` (``[C, h, 1]``) serves line caches that store none.
    ``verify_rows=True`` checks each row's checksum block (once per process) before it is read and
    raises :class:`CacheCorruptError` if it fails.

    The data file is memory-mapped lazily in each process; pickling carries paths, meta and the
    small index arrays only. Each read (``cache[i]``, and each batch through :meth:`gather_source`)
    first checks that the data file still has the size it had when mapped: a file truncated under
    a reader raises :class:`CacheCorruptError` instead of killing the process with SIGBUS.

    The bytes are read through a storage strategy, ``storage``: None (the default) reads the local folder
    ``cache_dir`` through memory maps; an object-storage strategy
    (:class:`latentfast.cache.remote.files.RemoteFiles`: the cache's files as sparse local copies in a
    local folder, its index fetched by block as reads first need it, its data fetched into the node-local
    chunk cache and held while it is read) is what :class:`latentfast.cache.LatentCache` hands a cache at
    an ``s3://`` URL. A strategy has ``mirror`` (the local folder of the cache's files), ``local(requests)``
    (make ``(path, byte starts, byte ends)`` of index files local, starts None for a whole file: called
    before a file, or a block of a table, is first read), ``refetch(requests)`` and ``where(path, start,
    end)`` (a block that failed its CRC, and how errors name it), ``local_all()``, ``holding(items,
    starts, ends)`` and ``holding_items(items, index)`` (contexts in which those bytes may be read: see
    :func:`latentfast.cache.store.layout.holding`), ``prefetch_many(requests)`` (start fetching ``(items,
    starts, ends)`` spans of several files at once) and ``holding_many(requests)`` (one hold over several
    caches' items: a sharded cache's). This class
    knows nothing of where a strategy gets its bytes, nor of shards: a folder of shards is
    :class:`latentfast.cache.store.shards.ShardedCache`, which composes caches, and
    :class:`latentfast.cache.LatentCache` (:mod:`latentfast.cache.store.opening`) opens each kind by its
    location.
    """

    def __init__(self, cache_dir: str | os.PathLike, split: str = "train", expected: Any = None,
                 white_column: Any = None, *, verify_rows: bool = False, storage=None):
        self.cache_dir = os.fspath(cache_dir) if storage is None else storage.mirror
        self.split = split
        self.verify_rows = bool(verify_rows)
        self.remote = storage  # (None: the local folder; the read path asks it to hold bytes otherwise)
        meta_path = fmt.cache_path(self.cache_dir, split, "meta")
        if not os.path.exists(meta_path):
            if fmt.build_in_progress(self.cache_dir, split):
                raise IncompleteCacheError(
                    f"latent cache {self.cache_dir} (split {split!r}) is incomplete: its build was interrupted "
                    f"before writing {meta_path}. Re-run the same `{fmt.resume_command(self.cache_dir, split)}` command to resume it (or the same LatentCacheWriter job)."
                )
            if os.path.isdir(os.path.join(self.cache_dir, "shards")):  # the folder of a distributed build (build.distributed)
                raise IncompleteCacheError(
                    f"latent cache {self.cache_dir} (split {split!r}) is incomplete: a distributed build wrote shards but not "
                    f"yet its manifest (a rank failed or is still running). Re-run the same build to resume every shard.")
            if "://" in self.cache_dir:
                raise InvalidArgumentError(f"{self.cache_dir} is an object-store URL: open it with latentfast.cache.LatentCache, "
                                           f"which reads it through the node-local chunk cache")
            raise FileNotFoundError(f"latent cache meta {meta_path} does not exist (no cache for split {split!r} in {self.cache_dir})")
        for _ in range(3):  # a rebuild that publishes while we read the index: read the new generation
            self._open_generation(meta_path, expected, white_column)
            if self.meta is not None and _meta_now(meta_path) == self.meta:
                break
        else:
            raise CacheCorruptError(f"latent cache {meta_path} kept changing while it was opened (a rebuild "
                                    f"publishing?): open it again when the rebuild has finished")
        self._reset_process_state()

    def _open_generation(self, meta_path: str, expected: Any, white_column: Any) -> None:
        """Read the meta, check it, load the index and the white column (one try of :meth:`__init__`)."""
        split = self.split
        meta = fmt.read_meta(meta_path)
        if "format_version" in meta and meta.get("complete") is not True:
            raise IncompleteCacheError(
                f"latent cache {meta_path} has no completion mark: the build did not finish. "
                f"Re-run the same `{fmt.resume_command(self.cache_dir, split)}` command to resume it (or the same LatentCacheWriter job)."
            )
        if expected is not None:
            diffs = fmt.stamp_differences(meta, expected)
            if diffs:
                lines = "\n".join(f"  {k}: cache has {have!r}, expected {want!r}" for k, have, want in diffs)
                raise InvalidArgumentError(
                    f"latent cache {meta_path} was built for a different encoder/geometry:\n{lines}\n"
                    f"Rebuild it with: {fmt.rebuild_command(self.cache_dir, split, meta, expected)}"
                )
        self.meta = meta
        self._data_path = fmt.cache_path(self.cache_dir, split, "data")
        try:
            self._load_tables()
            self.white_column = self._resolve_white(white_column) if not self.shaped else None
            fmt.check_recorded(self.cache_dir, split, meta, ("white",))
        except (OSError, CacheError):
            if _meta_now(meta_path) == meta:
                raise  # the cache is as it was: the error is the news
            self.meta = None  # a rebuild published meanwhile: the caller tries again

    def _load_tables(self) -> None:
        """The per-item tables (the index, each field's spans), checked against the meta's record of them."""
        self._load_index()
        self._local([fieldstore.field_path(self.cache_dir, self.split, name, kind)
                     for name in self._declared_fields() for kind in ("spans", "crc", "present")])
        self._field_index = {name: fieldstore.load_field_index(self.cache_dir, self.split, name, self.meta, len(self))
                             for name in self._declared_fields()}
        blocks = self.__dict__.get("_index_blocks") is not None  # (its shapes and offsets: checked per block, see tables)
        fmt.check_recorded(self.cache_dir, self.split, self.meta, ("widths",) if blocks else ("widths", "offsets", "shapes"))

    def _reset_process_state(self) -> None:
        """What each process opens for itself: the map, its file descriptor, the tensor views."""
        paths = [fmt.cache_path(self.cache_dir, self.split, "data")]
        paths += [fieldstore.field_path(self.cache_dir, self.split, name, "data") for name in self._field_index]
        files = layout.CacheFiles(self.cache_dir, self.split, self.meta, paths, self._data_identity)  # opened together
        self.items = layout.Items(self, files=files)  # what the read path reads: geometry and this process's map
        self.field_items = {name: fieldstore.FieldItems(self, name, *index, files) for name, index in self._field_index.items()}
        self._keys: list[str] | None = None
        self._key_index: dict[str, int] | None = None
        self._row_shape = (self.channels, self.latent_h, self.w_max)
        self._line_elements = self.channels * self.latent_h
        self._row_elements = self._line_elements * self.w_max

    # -- opening and validation -------------------------------------------------------------
    def _declared_fields(self) -> dict:
        fields = self.meta.get("fields", {})
        if not isinstance(fields, dict) or fieldstore.LATENT in fields:
            raise CacheCorruptError(f"latent cache meta {fmt.cache_path(self.cache_dir, self.split, 'meta')}: fields must be an object "
                                    f"of the fields beside {fieldstore.LATENT!r}, got {fields!r}")
        return fields

    def _load_index(self) -> None:
        if self.shaped:
            self._load_shapes()
        else:
            self._load_widths()
        expected_bytes = int(self._row_starts[-1]) * 2
        try:
            st = os.stat(self._data_path)
        except OSError:
            raise FileNotFoundError(f"latent cache data file {self._data_path} does not exist") from None
        actual, self._data_identity = st.st_size, (st.st_dev, st.st_ino)  # the file this index describes
        if actual != expected_bytes:
            what = "shorter" if actual < expected_bytes else "longer"
            m = self.meta
            raise CacheCorruptError(
                f"latent cache data file {self._data_path} is {what} than the meta implies: "
                f"expected {expected_bytes} bytes ({self.layout} layout, n={m['n']}, C={m['channels']}, "
                f"h={m['latent_h']}, w_max={m['w_max']}), found {actual}"
            )

    def _load_widths(self) -> None:
        n, w_max = self.meta["n"], self.meta["w_max"]
        wpath, opath = (fmt.cache_path(self.cache_dir, self.split, kind) for kind in ("widths", "offsets"))
        self._local((wpath, opath) if self.layout == "ragged" else (wpath,))
        widths = fmt.load_npy(wpath, "widths")
        if widths.ndim != 1 or not np.issubdtype(widths.dtype, np.integer):
            raise CacheCorruptError(f"latent cache widths {wpath} must be a 1-D integer array, got {widths.dtype} {widths.shape}")
        if len(widths) != n:
            raise CacheCorruptError(f"latent cache widths {wpath} has {len(widths)} rows but the meta says n={n}")
        if n and (widths.min() < 1 or widths.max() > w_max):
            bad = int(np.flatnonzero((widths < 1) | (widths > w_max))[0])
            raise CacheCorruptError(f"latent cache widths {wpath}: row {bad} has width {int(widths[bad])}, outside [1, w_max={w_max}]")
        self.widths = widths.astype(np.int32, copy=False)
        self.row_starts = self._line_row_starts()
        if self.layout == "ragged":
            offsets = fmt.load_npy(opath, "offsets")
            if offsets.shape != (n + 1,):
                raise CacheCorruptError(f"latent cache offsets {opath} must have n + 1 = {n + 1} entries, got shape {offsets.shape}")
            if not np.array_equal(offsets, self.row_starts):
                raise CacheCorruptError(f"latent cache offsets {opath} disagree with the widths (row i must span C*h*w_i elements, back to back)")

    def _load_shapes(self) -> None:
        """The shapes and offsets, mapped when large (their pages are the page cache's, shared by every process;
        under a MiB they are read whole: see ``_MAP_INDEX_BYTES``). A cache with ``index_blocks`` has each block
        checked when its items are first read (:mod:`.tables`: opening checks only the last one); an older one
        is checked whole now, a chunk at a time (no temporary grows with N)."""
        m = self.meta
        n, ndim = m["n"], m["ndim"]
        spath, opath = (fmt.cache_path(self.cache_dir, self.split, kind) for kind in ("shapes", "offsets"))
        mapped = {p: _mapped(p, self.remote is not None and "index_blocks" in m) for p in (spath, opath)}
        if self.remote is not None:  # mapped: their headers (blocks are fetched as they are checked); read whole: all
            self.remote.local([(p, [0] if mapped[p] and "index_blocks" in m else None, [4096]) for p in (spath, opath)])
        shapes = fmt.load_npy(spath, "shapes", mmap=mapped[spath])
        if shapes.shape != (n, ndim) or not np.issubdtype(shapes.dtype, np.integer):
            raise CacheCorruptError(f"latent cache shapes {spath} must be an integer array of shape [n, ndim] = [{n}, {ndim}], got {shapes.dtype} {list(shapes.shape)}")
        shapes = shapes.astype(np.int64, copy=False)
        offsets = fmt.load_npy(opath, "offsets", mmap=mapped[opath])
        if offsets.shape != (n + 1,) or not np.issubdtype(offsets.dtype, np.integer) or int(offsets[0]) != 0:
            raise CacheCorruptError(f"latent cache offsets {opath} disagree with the shapes (item i must span prod(shapes[i]) elements, back to back)")
        offsets = offsets.astype(np.int64, copy=False)
        # a cache with block checksums of its index: each block checked when its items are first read
        self._index_blocks = tables.ItemBlocks(self.cache_dir, self.split, m, shapes, offsets, self.remote) if "index_blocks" in m else None
        if self._index_blocks is not None and n:
            self._index_blocks.check([n - 1])  # the last block: its end offset sizes the data file (checked next)
        for r0 in range(0, n, _CHECK_CHUNK) if self._index_blocks is None else ():
            tables.check_rows(shapes[r0: r0 + _CHECK_CHUNK], offsets[r0: r0 + _CHECK_CHUNK + 1], r0, m["channels"], spath, opath)
        self._shapes = shapes
        self.widths = shapes[:, -1]  # (a view of the mapped shapes)
        units = fmt.LATENT_DTYPES[m.get("dtype", "float16")] // fmt.UNIT_BYTES
        if units != 1 and self._index_blocks is not None and self.remote is not None:
            self._index_blocks.check_all()  # (scaled below, all of it: fetched and checked first)
        self.row_starts = offsets if units == 1 else offsets * units  # offsets count elements; reads address 2-byte units

    def _resolve_white(self, given: Any) -> torch.Tensor | None:
        shape = (self.channels, self.latent_h, 1)
        path = fmt.cache_path(self.cache_dir, self.split, "white")
        stored = None
        if os.path.exists(path):
            stored = fmt.load_npy(path, "white column")
            if stored.shape != shape:
                raise CacheCorruptError(f"latent cache white column {path} must have shape {list(shape)}, got {list(stored.shape)}")
            stored = torch.from_numpy(stored.astype(np.float16))
        if given is None:
            return stored
        given = torch.as_tensor(given).detach().to("cpu", torch.float16)
        if tuple(given.shape) != shape:
            raise InvalidArgumentError(f"white_column must have shape [C, h, 1] = {list(shape)}, got {list(given.shape)}")
        if stored is not None and not torch.equal(stored, given):
            raise InvalidArgumentError(f"white_column disagrees with the one stored in {path}; omit the argument to use the stored one")
        return given.contiguous()

    def _local(self, paths) -> None:
        """Make these index files local, whole, before they are read (a cache in object storage fetches them
        when first needed; a local cache's are there)."""
        if self.remote is not None:
            self.remote.local([(path, None, None) for path in paths])

    # -- geometry ---------------------------------------------------------------------------
    def _whole_table(self, name: str) -> np.ndarray:
        """A per-item table as a whole array: of a cache in object storage whose index is read by block,
        every block fetched and checked first (the read path reads them block by block, through
        ``items``: never a byte that was not fetched)."""
        blocks = self.__dict__.get("_index_blocks")
        if blocks is not None and blocks.storage is not None:
            blocks.check_all()
        return self.__dict__[name]

    row_starts = property(lambda self: self._whole_table("_row_starts"), lambda self, value: self.__dict__.__setitem__("_row_starts", value),
                          doc="int64 ``[N + 1]``: each item's offset in 2-byte units of the data file, then the end.")
    widths = property(lambda self: self._whole_table("_widths"), lambda self, value: self.__dict__.__setitem__("_widths", value),
                      doc="int ``[N]``: each item's latent width (a shaped item's last dimension).")

    @property
    def layout(self) -> str:
        return self.meta.get("layout", "padded")

    @property
    def shaped(self) -> bool:
        """Whether items have shapes of their own (image buckets, video): ``read_batch`` then returns
        ``(latents [B, *shape], shapes [B, ndim])`` for a batch of one shape."""
        return self.layout == "shaped"

    @property
    def dtype(self) -> torch.dtype:
        """The stored latents' dtype: float16, or what a shaped cache's records were given (bfloat16, float32)."""
        return fieldstore.DTYPES[self.meta.get("dtype", "float16")]

    @property
    def channels(self) -> int:
        return int(self.meta["channels"])

    @property
    def latent_h(self) -> int:
        return int(self.meta["latent_h"])

    @property
    def w_max(self) -> int:
        return int(self.meta["w_max"])

    @property
    def shapes(self) -> np.ndarray:
        """int64 ``[N, ndim]``: each item's shape (``[C, h, w_i]`` rows in a line cache). Every block of a
        shaped cache's index is checked the first time this is asked for (reads of items check only theirs)."""
        if self.shaped:
            if self.__dict__.get("_index_blocks") is not None:
                self._index_blocks.check_all()
            return self._shapes
        shapes = np.empty((len(self), 3), dtype=np.int64)
        shapes[:, 0], shapes[:, 1], shapes[:, 2] = self.channels, self.latent_h, self.widths
        return shapes

    @property
    def keys(self) -> list[str]:
        """Each item's source name (file name without extension for imports, the image's path for
        builds); the row number as a string for caches that store no keys (the original format).

        This loads every key into a list of N strings (tens of bytes each, in every process that
        asks): :meth:`index`, ``key in cache``, :meth:`key` and :meth:`keys_of` look keys up in the
        mapped key table instead, without the list."""
        if self._keys is None:
            path = fmt.cache_path(self.cache_dir, self.split, "keys")
            if self._key_table() is None:
                self._local([path])
            if self._key_table() is not None:
                keys = self._key_table().all()
            elif os.path.exists(path):
                keys = _load_json(path, "keys")
                if not isinstance(keys, list) or len(keys) != len(self) or not all(isinstance(k, str) for k in keys):
                    raise CacheCorruptError(f"latent cache keys {path} must be a JSON list of {len(self)} strings")
                fmt.check_recorded(self.cache_dir, self.split, self.meta, ("keys",))
            else:
                self._check_not_lost("keys", path)
                keys = [str(i) for i in range(len(self))]
            self._keys = keys
        return self._keys

    @property
    def fields(self) -> dict[str, dict]:
        """Each field of the cache's records: name -> ``{"dtype", "ndim", "shapes" (int64 [N, ndim])}``,
        and for an optional field ``"present"`` (bool [N]: which items have a value; the others' shapes
        are zeros). ``latent`` (the data file) is always one; a cache written with records has the others."""
        described = {fieldstore.LATENT: {"dtype": self.dtype, "ndim": int(self.shapes.shape[1]), "shapes": self.shapes}}
        for name, items in self.field_items.items():
            described[name] = {"dtype": items.dtype, "ndim": int(items.shapes.shape[1]), "shapes": items.shapes}
            if items.present is not None:
                described[name]["present"] = items.present
        return described

    def record(self, i: int) -> dict[str, torch.Tensor]:
        """Item ``i`` as a record: ``{"latent": cache[i], <field>: value, ...}`` (each field in its stored
        dtype; an optional field the item lacks is not in it)."""
        i = self._checked_index(i)
        record = {fieldstore.LATENT: self[i]}
        for name, items in self.field_items.items():
            if not items.has(i):
                continue
            if self.verify_rows:
                items.check(np.asarray([i]))
            with layout.holding_items(items, [i]):
                record[name] = items.value(i)
        return record

    def _key_table(self) -> keytable.KeyTable | None:
        """The mapped key table (caches written before it existed have none: their keys file is parsed)."""
        if "key_table" not in self.meta:
            return None
        if self.__dict__.get("_keytab") is None:
            self._keytab = keytable.KeyTable(self.cache_dir, self.split, self.meta, len(self), self.remote)
        return self._keytab

    def stores_keys(self) -> bool:
        """Whether the cache stores its items' keys (else they are the row numbers as strings)."""
        if self._key_table() is None:
            self._local([fmt.cache_path(self.cache_dir, self.split, "keys")])
        return self._key_table() is not None or os.path.exists(fmt.cache_path(self.cache_dir, self.split, "keys"))

    def key(self, i: int) -> str:
        """Item ``i``'s key (from the mapped key table where the cache has one: no key list is loaded)."""
        i = self._checked_index(i)
        if self._key_table() is not None:
            return self._key_table().key(i)
        return str(i) if not self.stores_keys() else self.keys[i]

    def keys_of(self, index) -> list[str]:
        """The keys of items ``index`` (ints in range), in that order; see :meth:`key`."""
        index = np.asarray(index, dtype=np.int64)
        if self._key_table() is not None:
            return self._key_table().keys_of(index)
        keys = self.keys
        return [keys[i] for i in index.tolist()]

    def __contains__(self, key) -> bool:
        """Whether the cache holds an item with this key (see :meth:`index`)."""
        try:
            self.index(key)
        except UnknownKeyError:
            return False
        return True

    def index(self, key: str) -> int:
        """The item whose key is ``key`` (see :attr:`keys`); :class:`~latentfast.errors.UnknownKeyError`
        (a ``KeyError``) names a key the cache does not hold. A cache with a key table looks it up there
        (a binary search over its mapped hash index); an older one builds a dict of every key once."""
        if self._key_table() is not None:
            row = self._key_table().index(key) if isinstance(key, str) else None
            if row is None:
                raise UnknownKeyError(f"latent cache {self.cache_dir} (split {self.split!r}) holds no item with key {key!r}")
            return row
        if self._key_index is None:
            keys = self.keys
            self._key_index = {k: i for i, k in reversed(list(enumerate(keys)))}  # the first of duplicates
        try:
            return self._key_index[key]
        except (KeyError, TypeError):
            raise UnknownKeyError(f"latent cache {self.cache_dir} (split {self.split!r}) holds no item with key {key!r}") from None

    def _check_not_lost(self, kind: str, path: str) -> None:
        """Raise if the meta records a file ``kind`` that is gone (a cache without one returns None)."""
        if kind in (self.meta.get("files") or {}):
            raise CacheCorruptError(f"latent cache {kind} file {path} is missing; rerun the build to repair it")

    def info(self, i: int) -> dict:
        """The small dict stored with item ``i`` (e.g. ``original_size``, ``crop_top_left``), or ``{}``."""
        i = self._checked_index(i)
        if not hasattr(self, "_info"):
            path = fmt.cache_path(self.cache_dir, self.split, "info")
            self._local([path])
            self._info = _load_json(path, "info") if os.path.exists(path) else self._check_not_lost("info", path)
            if self._info is not None and (not isinstance(self._info, list) or len(self._info) != len(self)):
                raise CacheCorruptError(f"latent cache info {path} must be a JSON list of {len(self)} objects")
            if self._info is not None:
                fmt.check_recorded(self.cache_dir, self.split, self.meta, ("info",))
        return dict(self._info[i]) if self._info else {}

    def content_hashes(self) -> np.ndarray | None:
        """uint8 ``[N, 16]`` content hash of each item's source bytes (of the algorithm the meta's
        ``content_hash`` names; BLAKE2b-128 where it names none), or None when the cache stores none."""
        path = fmt.cache_path(self.cache_dir, self.split, "hashes")
        self._local([path])
        if not os.path.exists(path):
            return None
        hashes = fmt.load_npy(path, "hashes")
        if hashes.shape != (len(self), 16) or hashes.dtype != np.uint8:
            raise CacheCorruptError(f"latent cache hashes {path} must be uint8 [{len(self)}, 16], got {hashes.dtype} {list(hashes.shape)}")
        fmt.check_recorded(self.cache_dir, self.split, self.meta, ("hashes",))
        return hashes

    def __len__(self) -> int:
        return int(self.meta["n"])

    def __repr__(self) -> str:
        if self.shaped:
            return f"LatentCache({self.cache_dir!r}, split={self.split!r}, n={len(self)}, layout='shaped', ndim={self.meta['ndim']}, C={self.channels})"
        return f"LatentCache({self.cache_dir!r}, split={self.split!r}, n={len(self)}, layout={self.layout!r}, C={self.channels}, h={self.latent_h}, w_max={self.w_max})"

    # -- data access ------------------------------------------------------------------------
    def _memmap(self) -> np.ndarray:
        """The whole data file as a flat read-only float16 array, opened once per process."""
        return self.items.memmap()

    def check_unchanged(self) -> None:
        """Raise :class:`CacheCorruptError` if the mapped data file no longer has its size (one fstat):
        reading a page past a truncated file's end would kill the process with SIGBUS."""
        self.items.check_unchanged()

    def _checked_index(self, i) -> int:
        n = self.meta["n"]
        i = operator.index(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexOutOfRangeError(f"latent cache index {i} out of range for {n} rows")
        return i

    def __getitem__(self, i: int) -> torch.Tensor:
        """Item ``i`` as a copy in the cache's :attr:`dtype`, read with one ``preadv`` (a file truncated under the reader
        reads short and raises :class:`CacheCorruptError`; a map would die of SIGBUS instead)."""
        i = self._checked_index(i)
        if self.items.index_checks is not None:
            self.items.index_checks.check([i])
        if self.verify_rows:
            self.verify_items([i])
        fd = self.items.fd()
        self.check_unchanged()
        start = int(self._row_starts[i])
        if self.shaped:  # the item's 2-byte units, viewed in the cache's dtype below
            row = np.empty(int(self._row_starts[i + 1]) - start, dtype=np.float16)
        elif self.layout == "ragged":
            row = np.empty((self._row_shape[0], self._row_shape[1], int(self.widths[i])), dtype=np.float16)
        else:
            row = np.empty(self._row_shape, dtype=np.float16)
        with layout.holding_items(self.items, [i]):
            short = os.preadv(fd, [row], 2 * start) != row.nbytes
        if short:
            self.check_unchanged()
            raise CacheCorruptError(f"latent cache data file {self._data_path}: row {i} reads short")
        if self.layout == "padded":
            row = np.ascontiguousarray(row[:, :, : int(self.widths[i])])
        if self.shaped:
            return torch.from_numpy(row).view(self.dtype).reshape(self._shapes[i].tolist())
        return torch.from_numpy(row)

    def verify_items(self, indices) -> None:
        """Check the checksum block of every row in ``indices`` (each block once per process);
        :class:`CacheCorruptError` names the first failing block. A cache without checksums
        (the original format) has nothing to check against: ``InvalidArgumentError``."""
        self.items.block_checks.check(self.items, self._row_starts, np.asarray(indices, dtype=np.int64))

    def gather_source(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``(data, row_offsets, widths, pitch)`` for batch gathers; checks the file size first (one fstat).

        ``data`` is a 1-D float16 tensor over the whole (read-only) data file; row i's line
        ``(c, y)`` starts at element ``row_offsets[i] + (c * h + y) * pitch_i``, where
        ``pitch_i`` is ``pitch`` (w_max) for the padded layout and the row's own width when
        ``pitch`` is 0 (ragged). In a shaped cache each item is one line (C = h = 1 in gather
        terms) whose width is its element count, with pitch 0. Never write through ``data``."""
        return self.items.source()

    def read_batch(self, indices, spec=None, **kwargs):
        """See :func:`latentfast.cache.read_batch`."""
        return gather.read_batch(self, indices, spec, **kwargs)

    def dataset(self, fields=None, **options) -> feed_loader.RecordDataset:
        """A map-style Dataset of this cache's records, item by item, for torch's own pieces:
        ``DataLoader(cache.dataset(fields=..., pad=...), batch_size=..., sampler=DistributedSampler(...),
        collate_fn=latentfast.cache.collate_records)``. ``fields`` (default ``("latent",)``) and
        ``options`` (pad, pad_to, packed, sample, flip, seed, dtype, cold) are read_batch's; see
        :class:`~latentfast.cache.feed.loader.RecordDataset`. :class:`~latentfast.cache.LatentLoader`
        reads whole batches and is faster."""
        return feed_loader.RecordDataset(self, ReadSpec(fields=("latent",) if fields is None else fields, **options))

    def __getitems__(self, indices):
        """What a DataLoader with a ``batch_size`` asks of its dataset: refused before torch's collate would
        stack items of different widths or shapes (or, worse, stack equal ones unpadded)."""
        raise InvalidArgumentError(
            f"DataLoader(cache, batch_size={len(indices)}) cannot batch a LatentCache's items (they differ in shape "
            f"and pad with the white column): use latentfast.cache.LatentLoader(cache, batch_size) (whole-batch reads, "
            f"buckets, ranks, resume), or DataLoader(cache.dataset(fields=...), batch_size=..., "
            f"collate_fn=latentfast.cache.collate_records) for torch's own samplers")

    def prefetch(self, indices) -> None:
        """Start reading rows ``indices`` into the page cache and return at once (see :mod:`latentfast.cache.feed.coldread`);
        a cache in object storage starts fetching their chunks (and their fields') into the local chunk cache."""
        if self.remote is None:
            return coldread.prefetch(self, indices)
        return self.remote.prefetch_many(self.prefetch_requests(as_row_indices(indices, len(self)).numpy()))

    def prefetch_requests(self, index: np.ndarray) -> list[tuple]:
        """``(items, byte starts, byte ends)`` of items ``index`` (in range) in the latents' file and each
        field's: what a storage strategy's ``prefetch_many`` fetches ahead (a sharded cache joins its shards')."""
        return [(items, *layout.item_spans(items, index)) for items in (self.items, *self.field_items.values())]

    # -- pickling: paths and meta only (a few KiB at any N) ---------------------------------
    _PER_ITEM = ("items", "field_items", "_row_starts", "_keys", "_info", "_key_index", "_keytab",
                 "_widths", "_shapes", "_field_index", "_index_blocks")

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for key in self._PER_ITEM:  # each process loads the tables from the files (which the meta's CRCs pin)
            state.pop(key, None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        try:
            self._load_tables()
        except (OSError, CacheError):
            meta_path = fmt.cache_path(self.cache_dir, self.split, "meta")
            if _meta_now(meta_path) == self.meta:
                raise  # the cache is as it was: the error is the news
            raise CacheCorruptError(f"latent cache {self.cache_dir} (split {self.split!r}) was rebuilt after this reader opened it "
                                    f"(its meta {meta_path} changed or is gone): its index files are another generation's; "
                                    f"open the cache again") from None
        self._reset_process_state()

    def _line_row_starts(self) -> np.ndarray:
        return layout.row_starts(self.layout, len(self), channels=self.channels, latent_h=self.latent_h,
                                 w_max=self.w_max, widths=self.widths)


def _meta_now(meta_path: str) -> dict | None:
    """The meta at ``meta_path`` now, or None if it is missing or unreadable (a publish under way)."""
    try:
        return fmt.read_meta(meta_path)
    except (OSError, CacheCorruptError):
        return None


def _load_json(path: str, what: str):
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except (ValueError, UnicodeDecodeError) as exc:
        raise CacheCorruptError(f"latent cache {what} file {path} is not valid JSON: {exc}") from None


# what bad_blocks checks in one pass: up to 8 MiB (2-byte units) and 65,536 blocks, so blocks of small items are
# checked many at a time and a pass's temporaries stay a few MiB
_CHECK_UNITS = 1 << 22
_CHECK_BLOCKS = 1 << 16


def bad_blocks(cache: LatentCache, *, first_only: bool = False) -> tuple[list[tuple[int, int, int, int | None]], int]:
    """``([(block, first_row, end_row, nonfinite_row)], block_rows)`` for every checksum block that
    fails its CRC-32 (``nonfinite_row`` None) or holds a non-finite value (the first such row);
    only the first bad block when ``first_only``.

    The blocks are checked a group of up to :data:`_CHECK_UNITS` and :data:`_CHECK_BLOCKS` at a time (every block's CRC, then
    one finiteness pass over the group); only a group with a bad block is looked at block by block.
    So a cache of tiny items (one block per item) costs a CRC per item, not a pass of numpy calls."""
    meta_path = fmt.cache_path(cache.cache_dir, cache.split, "meta")
    block_rows = fmt.checksum_block_rows(cache.meta, meta_path)
    n = len(cache)
    sums = None if block_rows is None else fmt.load_checksums(cache.cache_dir, cache.split, n, block_rows, cache.meta)
    if block_rows is None:
        block_rows = max(1, fmt.CHECKSUM_BLOCK_BYTES // (2 * max(1, int(cache.row_starts[-1]) // max(1, n))))
    data = cache._memmap()
    cache.check_unchanged()
    starts, dtype = cache.row_starts, cache.meta.get("dtype", "float16")
    scratch = np.empty(max(1, min(int(starts[-1]), _CHECK_UNITS)), dtype=np.uint16)
    found, blocks, b0 = [], -(-n // block_rows), 0
    while b0 < blocks and not (first_only and found):
        e0 = int(starts[b0 * block_rows])
        last_row = int(np.searchsorted(starts, e0 + _CHECK_UNITS, side="right")) - 1  # (rows before it end in reach)
        b1 = min(b0 + _CHECK_BLOCKS, blocks if last_row >= n else max(b0 + 1, last_row // block_rows))
        bounds = np.asarray(starts[np.minimum(np.arange(b0, b1 + 1) * block_rows, n)], dtype=np.int64)
        with layout.holding(cache.items, [2 * e0], [2 * int(bounds[-1])]):  # (a cache in object storage: fetched a group at a time)
            if not _clean(data, bounds, None if sums is None else sums[b0:b1], scratch, dtype):
                for b in range(b0, b1):
                    bad = _bad_block(data, starts, b, block_rows, n, sums, scratch, dtype)
                    if bad is not None:
                        found.append(bad)
                        if first_only:
                            break
        b0 = b1
    return found, block_rows


def _clean(data: np.ndarray, bounds: np.ndarray, sums, scratch: np.ndarray, dtype: str) -> bool:
    """Whether the blocks between the unit offsets ``bounds`` all match their ``sums`` (None: no checksums)
    and hold finite values only."""
    group = data[int(bounds[0]): int(bounds[-1])]
    if sums is not None:
        view, cuts = memoryview(group).cast("B"), (2 * (bounds - bounds[0])).tolist()
        crcs = np.fromiter((zlib.crc32(view[a:b]) for a, b in zip(cuts[:-1], cuts[1:])), dtype=np.uint32, count=len(cuts) - 1)
        if not np.array_equal(crcs, sums):
            return False
    return fmt.first_nonfinite(group, scratch if group.size <= scratch.size else None, dtype) < 0


def _bad_block(data, starts, b: int, block_rows: int, n: int, sums, scratch, dtype: str):
    """``(block, first_row, end_row, nonfinite_row)`` if block ``b`` fails its CRC (``nonfinite_row``
    None) or holds a non-finite value (its first such row), else None."""
    r0, r1 = b * block_rows, min(n, (b + 1) * block_rows)
    e0, e1 = int(starts[r0]), int(starts[r1])
    block = data[e0:e1]
    if sums is not None and zlib.crc32(block) != int(sums[b]):
        return b, r0, r1, None
    bad = fmt.first_nonfinite(block, scratch if block.size <= scratch.size else None, dtype)
    if bad < 0:
        return None
    return b, r0, r1, int(np.searchsorted(starts, e0 + bad, side="right")) - 1


def verify_single(cache: LatentCache) -> dict:
    """:func:`latentfast.cache.verify_cache` of one opened cache (opening it validated its sizes, widths,
    shapes and offsets): every block checksum recomputed, every value checked finite (the latents' and
    every float field's), every index file against its recorded CRC-32.

    Raises :class:`CacheCorruptError` naming the first bad block or row; returns ``{"rows", "bytes",
    "blocks", "checksummed", "seconds", "gb_per_s"}``. ``gb_per_s`` is the rate of this pass, from
    whatever page cache state the file was in (a second run over a cache that fits in RAM measures a hot
    page cache, not the disk)."""
    start = time.perf_counter()
    cache_dir, split = cache.cache_dir, cache.split
    if cache.remote is not None:  # (a cache in object storage: every index file, all of it)
        cache.remote.local_all()
    damaged = fmt.damaged_files(cache.cache_dir, split, cache.meta)
    if damaged:
        raise CacheCorruptError(damaged[0] + "; rerun the build to repair it")
    if cache.__dict__.get("_index_blocks") is not None:
        cache._index_blocks.check_all()
    found, block_rows = bad_blocks(cache, first_only=True)
    if found:
        b, r0, r1, row = found[0]
        if row is not None:
            raise CacheCorruptError(f"latent cache {cache._data_path}: row {row} (block {b}) holds a non-finite value")
        raise CacheCorruptError(f"latent cache {cache._data_path}: block {b} (rows {r0}..{r1 - 1}) fails its CRC-32 checksum")
    if cache.white_column is not None and not torch.isfinite(cache.white_column.float()).all():
        raise CacheCorruptError(f"latent cache {cache_dir}: the white column holds a non-finite value")
    for items in cache.field_items.values():  # every present field value against its CRC, and finite (a shared value once)
        have = np.arange(items.n) if items.present is None else np.flatnonzero(items.present)
        _, first = np.unique(items.row_starts[have], return_index=True)
        items.check(have[first], finite=True)
    if cache._key_table() is not None:  # every block of the key table against its CRC, its keys cut and decoded
        cache._key_table().check_all()
    else:
        cache.keys  # noqa: B018 - a malformed keys file fails verify (a key table is checked without the list)
    seconds = time.perf_counter() - start
    nbytes = int(cache.row_starts[-1]) * 2
    n = len(cache)
    return {
        "rows": n,
        "bytes": nbytes,
        "blocks": -(-n // block_rows),
        "checksummed": "checksum" in cache.meta,
        "seconds": seconds,
        "gb_per_s": nbytes / seconds / 1e9 if seconds > 0 else float("inf"),
    }


def inspect_single(cache: LatentCache, bins: int = 10) -> dict:
    """:func:`latentfast.cache.inspect_cache` of one opened cache: meta, row count, bytes on disk, padding
    waste and a latent-width histogram (line caches), or the count of items per shape (shaped caches)."""
    cache_dir, split = cache.cache_dir, cache.split  # (a cache in object storage: the local folder of its files)
    if cache.remote is not None:  # (every index file, all of it: the sizes and summaries are of the whole)
        cache.remote.local_all()
    files = {}
    for kind in ("data", "widths", "meta", "offsets", "white", "checksums", "shapes", "keys", "hashes", "info",
                 *keytable.TABLES, keytable.CRC_KIND, tables.CRC_KIND):
        path = fmt.cache_path(cache_dir, split, kind)
        if os.path.exists(path):
            files[os.path.basename(path)] = os.path.getsize(path)
    data_bytes = int(cache.row_starts[-1]) * 2
    fields = {fieldstore.LATENT: {"dtype": cache.meta.get("dtype", "float16"), "ndim": int(cache.shapes.shape[1]), "logical_bytes": data_bytes, "stored_bytes": data_bytes}}
    for name, entry in cache.meta.get("fields", {}).items():
        fields[name] = {k: entry[k] for k in ("dtype", "ndim", "logical_bytes", "stored_bytes")}
        if entry.get("optional"):  # (items without a value)
            fields[name]["absent"] = entry["absent"]
        for kind in ("data", "spans", "crc", "present"):
            path = fieldstore.field_path(cache_dir, split, name, kind)
            if kind != "present" or entry.get("optional"):
                files[os.path.basename(path)] = os.path.getsize(path)
    info = {"meta": cache.meta, "n": len(cache), "layout": cache.layout, "files": files, "fields": fields,
            "bytes_on_disk": sum(files.values()), "data_bytes": data_bytes,
            "resident_bytes": coldread.resident_bytes(cache._data_path)}  # in the page cache now (None: the OS cannot say)
    info.update(layout_summary(cache, data_bytes, bins))
    return info


def layout_summary(cache: LatentCache, data_bytes: int, bins: int = 10) -> dict:
    """What :func:`inspect_cache` says of the items: per shape counts and buckets (shaped caches), or
    padding waste and a latent-width histogram (line caches)."""
    if cache.shaped:
        shapes, counts = np.unique(cache.shapes, axis=0, return_counts=True)
        order = np.argsort(-counts, kind="stable")
        return {"shape_counts": [(shapes[k].tolist(), int(counts[k])) for k in order], "padding_waste_pct": 0.0,
                **_bucket_summary(cache)}
    real = int(cache.widths.sum(dtype=np.int64)) * cache.channels * cache.latent_h * 2
    edges = np.unique(np.linspace(1, cache.w_max + 1, min(bins, cache.w_max) + 1).astype(np.int64))
    counts, _ = np.histogram(cache.widths, bins=edges)
    return dict(
        padding_waste_pct=100.0 * (data_bytes - real) / data_bytes if data_bytes else 0.0,
        padded_layout_bytes=len(cache) * fmt.row_elements(cache.meta) * 2,
        histogram=[(int(lo), int(hi) - 1, int(c)) for lo, hi, c in zip(edges[:-1], edges[1:], counts)],  # inclusive bounds
    )


def _bucket_summary(cache: LatentCache) -> dict:
    """A shaped cache's items per bucket (the pixel size each was resized to, from its info) with the
    latent shape of each, and the info fields its items carry."""
    per_bucket: dict[tuple, list] = {}
    fields: set[str] = set()
    for i in range(len(cache)):
        item = cache.info(i)
        fields.update(item)
        entry = per_bucket.setdefault(tuple(item.get("bucket") or ()), [0, cache.shapes[i].tolist()])
        entry[0] += 1
    buckets = [{"bucket": list(b), "items": c, "latent_shape": shape}
               for b, (c, shape) in sorted(per_bucket.items(), key=lambda kv: -kv[1][0]) if b]
    return {"bucket_counts": buckets, "item_fields": sorted(fields)}
