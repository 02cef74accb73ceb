"""Write a shaped latent cache one ``(key, latent)`` at a time: crash-safe and resumable by key.

This is the one write path of the image and video builders and of the importers, and what a user's
own encode job calls::

    with LatentCacheWriter(out_dir, "train", encoder=vae) as writer:
        for key, image in my_items():
            if key in writer:          # already written by an earlier, interrupted run
                continue
            writer.append(key, vae.encode(image[None])[0])
    # leaving the block without an exception finishes the cache; with one, it stays resumable

Durability (the same discipline as the line builder): latents are appended to
``{split}.latents.f16.dat.partial`` with whole writes; every ``flush_every`` items the data is
fdatasync'ed and only then the items' records (key, shape, CRC-32 of the bytes meant to be written,
source hash, info) are appended to the progress log ``{split}.latents.progress`` and fsynced. A
crash loses at most the items not yet flushed; reopening the writer with the same header (encoder
identity and ``meta``) resumes after the last logged item, truncating any unlogged tail. A
different header starts over. :meth:`finish` reads the data back and checks every item's CRC
(``verify=True``), writes the index files, renames the data into place and writes the meta (the
completion mark) last, each step durable. An exclusive lock on the split
(:class:`~latentfast.cache.store.durable.BuildLock`) keeps a second writer out for the whole time.

Bounded memory: the writer's per-item state lives in the progress log and in the tables of its build
folder ``.{split}.latents.building`` (:mod:`~latentfast.cache.store.building`: shapes, CRCs, source
hashes, info and keys appended to files, a bounded table of key hashes (memory, then sorted runs) for the
duplicate-key check; per record field its spans, CRCs and presence, its distinct values and such a table of
their hashes for storing equal values once), never in Python lists or dicts; resuming rebuilds the
tables from the log, and ``finish`` streams the index files from them.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import warnings
import zlib
from typing import Any, Mapping

import numpy as np
import torch

from ...errors import ArgumentTypeError, CacheCorruptError, CacheError, InvalidArgumentError, NonFiniteError
from . import format as fmt
from . import keytable, tables
from .building import Column, HashRuns
from .fields import LATENT, FieldStore, as_stored, check_declared, check_name, entry_text, field_path
from .durable import (HASH_BYTES, BuildLock, DurableFile, NpyFile, Written, append_lines, file_size, item_lines, iter_log, log_bytes,
                      publish, pwrite_all, rewrite_log, rewrite_log_prefix)

_LOG_VERSION = 1


def encoder_identity(encoder: Any) -> dict | None:
    """``encoder.identity()`` (or ``encoder`` itself when it is a dict) as plain JSON data; None stays None."""
    if encoder is None:
        return None
    identity = encoder if isinstance(encoder, dict) else encoder.identity()
    if not isinstance(identity, dict):
        raise ArgumentTypeError(f"encoder.identity() must return a dict, got {type(identity).__name__}")
    return json.loads(json.dumps(identity, sort_keys=True))


def as_float16(key: str, latent: Any) -> np.ndarray:
    """A latent (tensor or array, any float dtype) as a C-contiguous float16 array; values that are not
    finite in float16 (NaN, inf, or beyond +-65504) raise, naming the key."""
    if isinstance(latent, torch.Tensor):
        latent = latent.detach().to("cpu")
        if latent.dtype == torch.bfloat16:
            latent = latent.float()
        latent = latent.numpy()
    array = np.asarray(latent)
    if not np.issubdtype(array.dtype, np.floating):
        raise InvalidArgumentError(f"latent of key {key!r} must be floating point, got dtype {array.dtype}")
    if array.ndim < 1 or array.size == 0:
        raise InvalidArgumentError(f"latent of key {key!r} must be a non-empty array, got shape {list(array.shape)}")
    with np.errstate(over="ignore", invalid="ignore"):
        half = np.ascontiguousarray(array, dtype=np.float16)
    if fmt.first_nonfinite(half.reshape(-1)) >= 0:
        raise NonFiniteError(
            f"latent of key {key!r} holds values that are not finite in float16 (NaN, inf or beyond +-65504; "
            f"largest magnitude {float(np.nanmax(np.abs(array.astype(np.float64)))):.4g})"
        )
    return half


def latent_as_stored(key: str, latent: Any) -> tuple[str, np.ndarray]:
    """A record's latent exactly as given: ``(dtype name, C-contiguous array)``, float16 / bfloat16 /
    float32 (a bfloat16 tensor comes back as its uint16 bits); non-finite values raise, naming the key."""
    if not isinstance(latent, (torch.Tensor, np.ndarray)):
        raise InvalidArgumentError(f"field {LATENT!r} of key {key!r} must be a tensor or numpy array, got {type(latent).__name__}")
    tensor = (latent.detach().to("cpu") if isinstance(latent, torch.Tensor) else torch.from_numpy(np.asarray(latent))).contiguous()
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in fmt.LATENT_DTYPES:
        raise InvalidArgumentError(f"field {LATENT!r} of key {key!r} must be one of {sorted(fmt.LATENT_DTYPES)} (stored as given, "
                                   f"no silent cast), got {dtype}")
    if tensor.dim() < 1 or tensor.numel() == 0:
        raise InvalidArgumentError(f"latent of key {key!r} must be a non-empty array, got shape {list(tensor.shape)}")
    if not bool(torch.isfinite(tensor).all()):
        raise NonFiniteError(f"latent of key {key!r} holds values that are not finite ({dtype}: NaN or inf)")
    return dtype, (tensor.view(torch.uint16) if dtype == "bfloat16" else tensor).numpy()


# fields that must have another's shape: read_batch(flip=) puts a flipped latent in its latent's place,
# sample=True draws around a latent with its std
SAME_SHAPE = {"latent_flipped": LATENT, "latent_std": LATENT, "latent_flipped_std": "latent_flipped"}


def check_same_shapes(key: str, shapes: dict) -> None:
    """:data:`SAME_SHAPE` for one record's ``shapes`` (field name -> shape)."""
    for name, partner in SAME_SHAPE.items():  # what a draw puts in the latent's place, or draws over it
        if name in shapes and partner in shapes and shapes[name] != shapes[partner]:
            raise InvalidArgumentError(f"field {name!r} of key {key!r} has shape {list(shapes[name])}, but its "
                                       f"{partner!r} has {list(shapes[partner])}: they must be of one shape")


def check_text_key(key: str) -> None:
    """Refuse a key that is not valid text: one holding a lone surrogate (what ``os.fsdecode`` makes of a
    file name in another encoding than UTF-8) cannot be written as UTF-8, so nothing could hash or print it."""
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgumentError(f"key {key.encode('utf-8', 'backslashreplace').decode()!r} is not valid UTF-8 text "
                                   f"(a lone surrogate: a file name in another encoding?); keys are text") from None


def check_file_name(root: str, path: str) -> None:
    """Refuse a file under ``root`` whose name there (what an item's key is made of) is not valid UTF-8,
    naming it by its bytes: keys are text, so such a name is refused, not escaped (rename the file)."""
    rel = os.path.relpath(path, root)
    try:
        rel.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgumentError(f"{root}: the file name {os.fsencode(rel)!r} is not valid UTF-8 (another encoding?); item keys "
                                   f"are text: rename it (e.g. convmv -f latin1 -t utf8)") from None


class LatentCacheWriter:
    """Append ``(key, latent)`` items to a shaped cache in ``out_dir``; see the module docstring.

    Args:
        encoder: an object with ``identity() -> dict`` or the identity dict itself; stamped in the
            meta's ``encoder`` (so ``LatentCache(..., expected=...)`` refuses another encoder) and
            part of the resume header. None records no encoder.
        meta: extra JSON-able meta fields (e.g. buckets, source); part of the resume header.
        flush_every: items between durability points (a crash loses at most these).
        lock_timeout: seconds to wait for another writer of this split before
            :class:`~latentfast.errors.CacheLockedError`.
        lock: a :class:`~latentfast.cache.store.durable.BuildLock` the caller already holds on this split
            (the writer releases it when done) instead of taking one.
        restart: discard an interrupted run's progress instead of resuming it.
        optional: which record fields an item may lack: None (default: every record has the first
            record's fields, no more, no fewer), field names, or True (any field but ``latent``). An
            optional field may also first appear in a later record (the items before it lack it). A
            field some item lacks, or one named here, is stored optional: a presence bit per item
            (see :mod:`~latentfast.cache.store.fields`; ``read_batch`` returns ``<field>_present``).
            Part of the resume header.

    Every latent must share the first one's ``ndim``, channel count (``shape[0]``) and dtype; keys are
    unique non-empty strings of valid text (no lone surrogates). A record's ``latent_flipped`` and
    ``latent_std`` have its latent's shape, ``latent_flipped_std`` its ``latent_flipped``'s; every float
    field's values are finite, as the latent's (NaN or inf raise :class:`~latentfast.errors.NonFiniteError`). ``key in writer`` tells whether a key is already written (durably or
    pending); :attr:`resumed` whether an interrupted run was picked up.

    Memory: the writer holds no per-item Python objects. Each item's shape, CRC-32, source hash,
    info and key go to tables in files of its build folder ``.{split}.latents.building`` (see
    :mod:`~latentfast.cache.store.building`), the duplicate-key check looks the key's 64-bit hash up
    in a bounded table of hashes (:class:`~latentfast.cache.store.building.HashRuns`) and compares the key bytes of a hit, a record field's values go to the
    field's tables there (:class:`~latentfast.cache.store.fields.FieldStore`), and the log lines of
    items not yet flushed are held until :meth:`flush` (at most ``flush_every`` items, or one
    ``append_many`` batch). So the writer's own memory is the same at 10^3 and 10^9 items, with
    fields or without; the tables' pages are the page cache's.
    """

    def __init__(self, out_dir, split: str = "train", *, encoder: Any = None, meta: dict | None = None,
                 flush_every: int = 64, lock_timeout: float = 0.0, lock: BuildLock | None = None,
                 restart: bool = False, optional=None):
        if isinstance(flush_every, bool) or not isinstance(flush_every, int) or flush_every < 1:
            raise InvalidArgumentError(f"flush_every must be a positive int, got {flush_every!r}")
        if meta is not None and not isinstance(meta, dict):
            raise ArgumentTypeError(f"meta must be a dict of extra fields, got {type(meta).__name__}")
        self.out_dir, self.split, self.flush_every = os.fspath(out_dir), split, flush_every
        self.identity = encoder_identity(encoder)
        self.optional = _optional_names(optional)
        self.extra_meta = json.loads(json.dumps(meta or {}, sort_keys=True))
        self._lock = lock if lock is not None else BuildLock(self.out_dir, split, lock_timeout)
        self._paths = {k: fmt.cache_path(self.out_dir, split, k) for k in
                       ("data", "meta", "offsets", "shapes", "keys", "hashes", "info", "checksums", "progress", "widths", "white")}
        self._partial = fmt.partial_path(self._paths["data"])
        self._building = os.path.join(self.out_dir, f".{split}.latents.building")  # the per-item tables (building.py)
        self._tables: dict[str, Column] = {}
        self._slots: HashRuns | None = None
        self._first: dict | None = None  # the first item's key, shape, dtype and whether it is a record of fields
        self._n = 0  # items written (logged ones first)
        self._logged = 0  # items already in the progress log
        self._pending: list[bytes] = []  # the log lines of the items not logged yet
        self._end = 0  # bytes of data written
        self._key_end = self._info_end = 0  # bytes in the key and info tables
        self._hashed = self._with_info = 0  # items with a source hash, with info
        self._fields: dict[str, FieldStore] = {}  # the named fields beside the latent, by name
        self._fd = -1
        self._log = None
        self.finished = False
        try:
            self.resumed = self._open(restart)
        except BaseException:
            self._close_files()
            self._lock.release()
            raise

    # -- opening: resume a matching log or start over ---------------------------------------
    def _header(self) -> bytes:
        head = {"latentfast_writer": _LOG_VERSION, "encoder": self.identity, "meta": self.extra_meta}
        if self.optional is not None:  # (absent: the header of every log written before optional fields)
            head["optional"] = self.optional if self.optional is True else sorted(self.optional)
        return (json.dumps(head, sort_keys=True) + "\n").encode()

    def reopen(self, *, restart: bool = False) -> "LatentCacheWriter":
        """A new writer for the same cache, header and lock (this one is closed, its lock handed over)."""
        self.flush()
        self._close_files()
        return LatentCacheWriter(self.out_dir, self.split, encoder=self.identity, meta=self.extra_meta,
                                 flush_every=self.flush_every, lock=self._lock, restart=restart, optional=self.optional)

    def _open(self, restart: bool) -> bool:
        records = None if restart else iter_log(self._paths["progress"], self._header())
        if records is not None and not os.path.exists(self._partial) and not os.path.exists(self._paths["meta"]):
            # a crash inside finish() after the data was renamed into place: take it back
            with contextlib.suppress(FileNotFoundError):
                os.replace(self._paths["data"], self._partial)
        self._new_tables()
        try:
            loaded = records is not None and self._load(records)
        except (ValueError, KeyError, TypeError, AttributeError):  # an unreadable log: nothing of it can be trusted
            loaded = False
        if not loaded or file_size(self._partial) < self._end or not self._open_fields():
            self._start_over()
            return False
        self._fd = os.open(self._partial, os.O_RDWR)
        os.ftruncate(self._fd, self._end)  # drop a tail written after the last logged item
        self._log = open(self._paths["progress"], "ab")
        self._logged = self._n
        return self._n > 0

    def _load(self, records) -> bool:
        """Rebuild the tables from the logged ``records`` (streamed, a chunk at a time); the data they need in ``_end``."""
        chunk: list[dict] = []
        for record in records:
            chunk.append(record)
            if len(chunk) == _CHUNK:
                self._load_chunk(chunk)
                chunk = []
        self._load_chunk(chunk)
        return True

    def _load_chunk(self, records: list[dict]) -> None:
        if not records:
            return
        if self._first is None:
            self._remember_first(records[0])
        encoded = [r["k"].encode("utf-8") for r in records]
        shapes = np.asarray([r["s"] for r in records], dtype=np.int64).reshape(len(records), -1)
        dtypes = {r.get("d", "float16") for r in records}
        if dtypes != {self._first["d"]}:
            raise ValueError("a logged item of another dtype")
        self._end += int(np.prod(shapes, axis=1).sum()) * fmt.LATENT_DTYPES[self._first["d"]]
        infos = [_info_text(r["i"]) if "i" in r else b"" for r in records]
        self._load_fields(self._n, records)
        self._add_items(encoded, keytable.key_hashes(encoded), shapes, [r["c"] for r in records],
                        [r.get("h") for r in records], infos)

    def _load_fields(self, item: int, records: list[dict]) -> None:
        """The field tables of the logged ``records`` of items ``item`` on (a field first named here starts
        at the item of its first value)."""
        logged = [r.get("f") or {} for r in records]
        for k, entries in enumerate(logged):
            for name in entries.keys() - self._fields.keys():  # (a field's first value)
                first = entries[check_name(name)]
                self._fields[name] = FieldStore(self.out_dir, self.split, name, self._building, item + k, first["d"], len(first["s"]))
        for name, store in self._fields.items():
            store.load([entries.get(name) for entries in logged[store.items - item:]])

    def _remember_first(self, record: dict) -> None:
        self._first = {"k": record["k"], "s": list(record["s"]), "d": record.get("d", "float16"), "f": "f" in record}
        self._tables["shapes"] = Column(os.path.join(self._building, "shapes"), np.int64, len(record["s"]))

    def _open_fields(self) -> bool:
        """Open the data files of the fields the logged records name (False: one cannot back its records)."""
        return all(store.resume() for store in self._fields.values())

    def _new_field(self, name: str, dtype: str, ndim: int, start: int) -> FieldStore:
        """A field first seen at item ``start`` (the items before it lack it), its data file empty."""
        store = self._fields[name] = FieldStore(self.out_dir, self.split, name, self._building, start, dtype, ndim)
        store.create()
        return store

    def _new_tables(self) -> None:
        """Empty per-item tables in a fresh build folder (the log is the truth: they are rebuilt from it)."""
        self._close_tables()
        shutil.rmtree(self._building, ignore_errors=True)
        os.makedirs(self._building)
        self._tables = {name: Column(os.path.join(self._building, name), dtype, width) for name, dtype, width in _TABLES}
        self._slots = HashRuns(os.path.join(self._building, "key_slots"))
        self._first, self._n, self._end, self._key_end, self._info_end, self._hashed, self._with_info = None, 0, 0, 0, 0, 0, 0
        self._pending = []

    def _start_over(self) -> None:
        """A fresh log (durably first), then an empty data file."""
        rewrite_log(self._paths["progress"], self._header())
        for store in self._fields.values():
            store.close()
        self._fields = {}
        self._new_tables()
        self._fd = os.open(self._partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        fmt.fsync_dir(self.out_dir)
        self._log = open(self._paths["progress"], "ab")
        self._logged = 0

    def _add_items(self, encoded: list[bytes], key_hashes: np.ndarray, shapes: np.ndarray, crcs: list[int], hashes: list,
                   infos: list[bytes]) -> None:
        """Put written items in the tables: their keys' UTF-8 bytes and hashes, ``shapes`` int64 ``[B, ndim]``,
        ``hashes`` hex or None, ``infos`` each item's info JSON (b"": none). (Their fields' rows are the
        field stores'.)"""
        count, t = len(encoded), self._tables
        t["shapes"].append(np.ascontiguousarray(shapes, dtype=np.int64), count)
        t["crcs"].append(np.asarray(crcs, dtype=np.uint32), count)
        sources = np.zeros((count, 1 + HASH_BYTES), dtype=np.uint8)
        for i, h in enumerate(hashes):
            if h is not None:
                sources[i, 0] = 1
                sources[i, 1:] = np.frombuffer(bytes.fromhex(h)[:HASH_BYTES].ljust(HASH_BYTES, b"\0"), dtype=np.uint8)
        self._hashed += int(sources[:, 0].sum())
        t["sources"].append(sources, count)
        ends = self._key_end + np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=count))
        t["key_bytes"].append(b"".join(encoded), int(ends[-1]) - self._key_end)
        t["key_ends"].append(ends, count)
        t["key_hashes"].append(key_hashes, count)
        self._key_end = int(ends[-1])
        ends = self._info_end + np.cumsum(np.fromiter(map(len, infos), dtype=np.int64, count=count))
        t["info_bytes"].append(b"".join(infos), int(ends[-1]) - self._info_end)
        t["info_ends"].append(ends, count)
        self._with_info += sum(1 for x in infos if x)
        self._info_end = int(ends[-1])
        self._slots.add(key_hashes, np.arange(self._n, self._n + count))
        self._n += count

    def _add_batch(self, encoded: list[bytes], key_hashes: np.ndarray, shape: list, crcs: list[int], hashes: list) -> None:
        """:meth:`_add_items` of an ``append_many`` batch: items of one ``shape``, no info."""
        shapes = np.empty((len(encoded), len(shape)), dtype=np.int64)
        shapes[:] = shape
        self._add_items(encoded, key_hashes, shapes, crcs, hashes, [b""] * len(encoded))

    def _add_one(self, encoded: bytes, h: int, record: dict) -> None:
        """:meth:`_add_items` of one item (its key's bytes and hash, its ``record``), without numpy's
        per-call costs: the rows packed as bytes."""
        t, source = self._tables, record.get("h")
        t["shapes"].append(struct.pack(f"<{len(record['s'])}q", *record["s"]), 1)
        t["crcs"].append(struct.pack("<I", record["c"]), 1)
        t["sources"].append(b"\1" + bytes.fromhex(source)[:HASH_BYTES].ljust(HASH_BYTES, b"\0") if source else bytes(1 + HASH_BYTES), 1)
        self._hashed += source is not None
        self._key_end += len(encoded)
        t["key_bytes"].append(encoded, len(encoded))
        t["key_ends"].append(struct.pack("<q", self._key_end), 1)
        t["key_hashes"].append(struct.pack("<Q", h), 1)
        info = _info_text(record["i"]) if "i" in record else b""
        self._info_end += len(info)
        self._with_info += bool(info)
        t["info_bytes"].append(info, len(info))
        t["info_ends"].append(struct.pack("<q", self._info_end), 1)
        self._slots.add_one(h, self._n)
        fields = record.get("f", {})
        for name, store in self._fields.items():
            if name in fields:
                store.add_entry(fields[name])
            else:
                store.add_absent(1)
        self._n += 1

    # -- looking items up in the tables ---------------------------------------------------------
    def _find(self, key: str, h: int | None = None) -> int | None:
        """The item whose key is ``key`` (``h``: its key hash, if known), or None."""
        self._check_tables()
        for item in self._slots.find_one(keytable.key_hash_of(key.encode("utf-8", "surrogatepass")) if h is None else h):
            if self._key(item) == key:
                return item
        return None

    def _key(self, i: int) -> str:
        ends = self._tables["key_ends"].read(max(0, i - 1), i + 1)
        start = int(ends[0]) if i else 0
        return self._tables["key_bytes"].read(start, int(ends[-1])).tobytes().decode("utf-8")

    def _key_chunks(self):
        """``(keys, their source hashes as hex or None)`` of every item, a chunk at a time, in order."""
        self._check_tables()
        start = 0
        for lo, ends in self._tables["key_ends"].chunks(_CHUNK):
            raw = self._tables["key_bytes"].read(start, int(ends[-1])).tobytes()
            cuts = (ends - start).tolist()
            keys = [raw[a:b].decode("utf-8") for a, b in zip([0, *cuts[:-1]], cuts)]
            sources = self._tables["sources"].read(lo, lo + len(ends))
            yield keys, [row[1:].tobytes().hex() if row[0] else None for row in sources]
            start = int(ends[-1])

    def __contains__(self, key: str) -> bool:
        return isinstance(key, str) and self._find(key) is not None

    def __len__(self) -> int:
        return self._n

    @property
    def keys(self) -> list[str]:
        """Every key written, in order. This reads the whole key table into a list (~70 bytes per key):
        ``key in writer`` and :meth:`source_hash` look one key up without it."""
        return [k for keys, _ in self._key_chunks() for k in keys]

    def source_hash(self, key: str) -> str | None:
        """The source hash recorded with ``key`` (hex), or None; ``KeyError`` for a key not written."""
        item = self._find(key) if isinstance(key, str) else None
        if item is None:
            raise KeyError(key)
        row = self._tables["sources"].read(item, item + 1)[0]
        return row[1:].tobytes().hex() if row[0] else None

    # -- appending --------------------------------------------------------------------------
    def append(self, key: str, latent: Any, *, source_hash: bytes | str | None = None, info: dict | None = None) -> None:
        """Write one item. ``latent``: a tensor or array of any float dtype (stored as float16), or a
        record ``{"latent": z, "text": e, ...}`` of named fields: ``latent`` float16, bfloat16 or float32,
        stored as given (the first record fixes the cache's dtype, ``cache.dtype``), every other field
        stored as given in its own dtype and shape (see
        :mod:`~latentfast.cache.store.fields`); the first record fixes the set of fields (less or
        more only by the writer's ``optional`` fields) and each one's dtype and ndim. ``source_hash``:
        bytes or hex of the source's content hash (what a rebuild compares); ``info``: a small JSON-able
        dict kept with the item (e.g. original size, crop)."""
        self._check_open()
        if not isinstance(key, str) or not key:
            raise InvalidArgumentError(f"key must be a non-empty str, got {key!r}")
        check_text_key(key)
        encoded = key.encode("utf-8")
        h = keytable.key_hash_of(encoded)
        if self._find(key, h) is not None:
            raise InvalidArgumentError(f"key {key!r} was already written (check `key in writer` to resume)")
        latent, extra = self._split_record(key, latent)
        dtype, half = latent if isinstance(latent, tuple) else ("float16", as_float16(key, latent))
        self._check_shape(key, half.shape, dtype)
        record = {"k": key, "s": list(half.shape), "c": zlib.crc32(half)}
        if dtype != "float16":
            record["d"] = dtype
        if extra:
            record["f"] = {name: (self._fields.get(name) or self._new_field(name, dtype_, len(shape), self._n)).put(
                self._n, dtype_, shape, raw) for name, (dtype_, shape, raw) in extra.items()}
        if source_hash is not None:
            record["h"] = checked_source_hash(key, source_hash)
        if info:
            record["i"] = json.loads(json.dumps(info, sort_keys=True))  # as a resumed log reads it back
        pwrite_all(self._fd, half, self._end)
        self._end += half.nbytes
        if self._first is None:
            self._remember_first(record)
        self._add_one(encoded, h, record)
        self._pending.append(log_bytes(b"", [record]))
        if self._n - self._logged >= self.flush_every:
            self.flush()

    def append_many(self, keys, latents: Any, *, source_hashes=None) -> None:
        """Write many items at once, as :meth:`append` of each would (the same records, log and durability):
        ``keys`` B new distinct keys; ``latents`` a ``[B, *shape]`` tensor or array of any float dtype
        (stored as float16), or a batch of records ``{"latent": [B, *shape], name: values, ...}`` (the
        latents stored as given, as :meth:`append` stores a record's), each field's ``values`` a
        ``[B, *shape]`` tensor or array (every item's value of one shape) or a sequence of B values
        (tensors or arrays; None where an item lacks an optional field); ``source_hashes`` None or B of
        what :meth:`append` takes. Everything is checked before anything is written, then one write per
        file: the bulk path of imports and builds of tiny items (keys hashed, looked up and logged, and a
        field's equal values found, for the whole batch at once)."""
        self._check_open()
        keys = list(keys)
        for key in keys:
            if not isinstance(key, str) or not key:
                raise InvalidArgumentError(f"key must be a non-empty str, got {key!r}")
        try:
            encoded = [k.encode("utf-8") for k in keys]
        except UnicodeEncodeError:
            for key in keys:
                check_text_key(key)
            raise
        key_hashes = keytable.key_hashes(encoded)
        which, items = self._slots.find(key_hashes)
        written = sorted(w for w, item in zip(which.tolist(), items.tolist()) if self._key(item) == keys[w])
        if written:
            raise InvalidArgumentError(f"key {keys[written[0]]!r} was already written (check `key in writer` to resume)")
        if len(set(keys)) != len(keys):
            seen = set()
            twice = next(k for k in keys if k in seen or seen.add(k))
            raise InvalidArgumentError(f"key {twice!r} appears twice in keys")
        hashes = [None] * len(keys) if source_hashes is None else [
            None if h is None else checked_source_hash(k, h) for k, h in zip(keys, source_hashes, strict=True)]
        if isinstance(latents, Mapping):
            self._append_records(keys, encoded, key_hashes, latents, hashes)
            return
        if self._fields or (self._first is not None and self._first["f"]):
            raise InvalidArgumentError(f"this cache's items are records of the fields {[LATENT, *self._fields]}; append_many "
                                       f"a dict of their batches")
        _check_batch(LATENT, latents, len(keys))
        try:
            half = as_float16(keys[0], latents) if keys else None
        except NonFiniteError:  # name the item that holds the value
            for key, latent in zip(keys, latents):
                as_float16(key, latent)
            raise
        if not keys:
            return
        shape = list(half.shape[1:])
        self._check_shape(keys[0], tuple(shape), "float16")
        pwrite_all(self._fd, half, self._end)
        self._end += half.nbytes
        crcs = [zlib.crc32(row) for row in half.reshape(len(keys), -1)]
        if self._first is None:
            self._remember_first({"k": keys[0], "s": shape})
        self._add_batch(encoded, key_hashes, shape, crcs, hashes)
        self._pending.append(item_lines(keys, shape, crcs, hashes).encode())
        if self._n - self._logged >= self.flush_every:
            self.flush()

    def _append_records(self, keys: list[str], encoded: list[bytes], key_hashes: np.ndarray, batch: Mapping, hashes: list) -> None:
        """:meth:`append_many` of a batch of records (its keys checked)."""
        count = len(keys)
        if LATENT not in batch:
            raise InvalidArgumentError(f"the batch of records from key {keys[0] if keys else None!r} has no {LATENT!r} field "
                                       f"(fields given: {sorted(batch)})")
        _check_batch(LATENT, batch[LATENT], count)
        if not count:
            return
        try:
            dtype, latents = latent_as_stored(keys[0], batch[LATENT])
        except NonFiniteError:  # name the item that holds the value
            for key, latent in zip(keys, batch[LATENT]):
                latent_as_stored(key, latent)
            raise
        shape = list(latents.shape[1:])
        self._check_shape(keys[0], tuple(shape), dtype)
        first_key = self._first["k"] if self._first is not None else keys[0]
        values = {check_name(name): self._field_batch(keys, name, value, first_key) for name, value in batch.items() if name != LATENT}
        lacking = set(self._fields) - set(values)
        if self._first is not None:
            lacking |= set(values) - set(self._fields)
        self._refuse_lacking(keys[0], sorted(values), lacking, first_key)
        for name, v in values.items():  # an item without a value: named
            if isinstance(v, list) and None in v:
                self._refuse_lacking(keys[v.index(None)], sorted(n for n, w in values.items() if not isinstance(w, list)
                                                                 or w[v.index(None)] is not None), {name}, first_key)
        self._check_same_shapes(keys, shape, values)
        pwrite_all(self._fd, latents, self._end)
        self._end += latents.nbytes
        crcs = [zlib.crc32(row) for row in latents.reshape(count, -1)]
        texts, rows = {}, []  # each field's "name": entry of each item (None: it lacks the field); the rows to add
        for name, v in values.items():
            store = self._fields.get(name)
            if isinstance(v, tuple):  # one array of values of one shape
                store = store or self._new_field(name, v[0], len(v[1]), self._n)
                distinct, inverse, added = store.put_many(self._n, v[1], v[2])
                named = [f'"{name}": {text}' for text in distinct]
                texts[name] = [named[j] for j in inverse.tolist()]
                rows.append((store.add_rows, added))
                continue
            have = [k for k, stored in enumerate(v) if stored is not None]
            if store is None and not have:
                continue  # (a field no item has yet)
            store = store or self._new_field(name, v[have[0]][0], len(v[have[0]][1]), self._n + have[0])
            entries = [None if stored is None else store.put(self._n + k, *stored) for k, stored in enumerate(v)]
            texts[name] = [None if e is None else f'"{name}": {entry_text(e["o"], e["n"], json.dumps(e["s"]), e["c"], e["d"], e["x"])}'
                           for e in entries]
            rows.append((_add_each, (store, entries[store.items - self._n:])))
        if self._first is None:
            self._remember_first({"k": keys[0], "s": shape, "d": dtype, "f": {}})
        for name, store in self._fields.items():
            if name not in texts:
                store.add_absent(count)
        for add, args in rows:
            add(*args)
        self._add_batch(encoded, key_hashes, shape, crcs, hashes)
        self._pending.append(record_lines(keys, shape, dtype, crcs, hashes, texts).encode())
        if self._n - self._logged >= self.flush_every:
            self.flush()

    def _field_batch(self, keys: list[str], name: str, values: Any, first_key: str):
        """A batch's values of field ``name``, checked: ``(dtype, item shape, uint8 [B, nbytes])`` for one array
        of them, else a list of ``(dtype, shape, bytes)`` or None per item."""
        store = self._fields.get(name)
        if isinstance(values, (torch.Tensor, np.ndarray)):
            _check_batch(name, values, len(keys), least=1)
            try:
                dtype, shape, raw = as_stored(keys[0], name, values)
            except NonFiniteError:  # name the item that holds the value
                for key, value in zip(keys, values):
                    as_stored(key, name, value)
                raise
            shape = shape[1:] or ((1,) if isinstance(values, np.ndarray) else ())  # (a numpy 0-D value is stored 1-D, as append stores it)
            if store is not None:
                store.check(keys[0], dtype, shape, first_key)
            return dtype, shape, raw.reshape(len(keys), raw.size // len(keys))
        if isinstance(values, (str, bytes, Mapping)) or len(values) != len(keys):
            raise InvalidArgumentError(f"field {name!r} of a batch of {len(keys)} records must be a [B, *shape] tensor or array or "
                                       f"a sequence of B values (None: an item lacks it), got {type(values).__name__} of "
                                       f"{len(values)}")
        out = [None if value is None else as_stored(key, name, value) for key, value in zip(keys, values)]
        declared = (store.dtype, store.ndim) if store is not None else next(((s[0], len(s[1])) for s in out if s is not None), None)
        for key, stored in zip(keys, out):
            if stored is not None:
                check_declared(name, key, stored[0], stored[1], *declared, first_key)
        return out

    def _check_same_shapes(self, keys: list[str], shape: list, values: dict) -> None:
        """:data:`SAME_SHAPE` for a batch of records (``values`` as :meth:`_field_batch` gives them): per item
        where some field's values come one by one."""
        if not values.keys() & SAME_SHAPE.keys():
            return
        per_item = any(isinstance(v, list) for v in values.values())
        for k in range(len(keys) if per_item else 1):
            check_same_shapes(keys[k], {LATENT: tuple(shape), **{
                name: v[1] if isinstance(v, tuple) else v[k][1] for name, v in values.items() if isinstance(v, tuple) or v[k] is not None}})

    def _split_record(self, key: str, value: Any) -> tuple[Any, dict]:
        """``(latent, {name: (dtype, shape, bytes)})`` of an item, every field checked before anything is written."""
        if not isinstance(value, Mapping):
            if self._fields:
                raise InvalidArgumentError(f"key {key!r}: this cache's items are records of the fields "
                                           f"{[LATENT, *self._fields]}; append a dict of them")
            return value, {}
        if LATENT not in value:
            raise InvalidArgumentError(f"record of key {key!r} has no {LATENT!r} field (fields given: {sorted(value)})")
        latent = latent_as_stored(key, value[LATENT])
        names = [check_name(n) for n in value if n != LATENT]
        first_key = self._first["k"] if self._first is not None else None
        if self._first is not None:
            self._refuse_lacking(key, sorted(names), set(self._fields) ^ set(names), first_key)
        extra = {}
        for name in names:
            stored = as_stored(key, name, value[name])
            if name in self._fields:
                self._fields[name].check(key, stored[0], stored[1], first_key)
            extra[name] = stored
        check_same_shapes(key, {LATENT: tuple(latent[1].shape), **{name: stored[1] for name, stored in extra.items()}})
        return latent, extra

    def _refuse_lacking(self, key: str, names: list[str], lacking: set, first_key: str | None) -> None:
        """Refuse records of ``names`` (from key ``key``) that lack or add the fields ``lacking`` unless they are optional."""
        refused = sorted(n for n in lacking if not self._may_lack(n))
        if refused:
            raise InvalidArgumentError(
                f"record of key {key!r} has the fields {names}, but this cache's records have {sorted(self._fields)} "
                f"(first item {first_key!r}); {refused} are not optional (LatentCacheWriter(optional=...) "
                f"lets items lack a field)")

    def _may_lack(self, name: str) -> bool:
        """Whether an item may lack field ``name`` (see ``optional``)."""
        return self.optional is True or (self.optional is not None and name in self.optional)

    def append_bytes(self, key: str, shape, payload: bytes, crc: int, *, source_hash=None, info=None) -> None:
        """Copy an item already stored as float16 bytes (e.g. from an older cache) after checking its
        CRC-32; a mismatch raises :class:`CacheCorruptError` and writes nothing."""
        if zlib.crc32(payload) != crc:
            raise CacheCorruptError(f"item {key!r}: its bytes fail their CRC-32 checksum")
        latent = np.frombuffer(payload, dtype=np.float16).reshape([int(x) for x in shape])
        self.append(key, latent, source_hash=source_hash, info=info)

    def _check_shape(self, key: str, shape: tuple, dtype: str) -> None:
        if self._first is None:
            return
        first = self._first["s"]
        if dtype != self._first["d"]:
            raise InvalidArgumentError(f"latent of key {key!r} is {dtype}, but this cache's latents are "
                                       f"{self._first['d']} (first item {self._first['k']!r}); no silent cast")
        if len(shape) != len(first) or shape[0] != first[0]:
            raise InvalidArgumentError(
                f"latent of key {key!r} has shape {list(shape)}, but this cache's items are {len(first)}-D with "
                f"{first[0]} channels (first item {self._first['k']!r}: {first})"
            )

    def flush(self) -> None:
        """Make every appended item durable: data first, then its records in the log."""
        self._check_open()
        if self._logged == self._n:
            return
        os.fdatasync(self._fd)
        for store in self._fields.values():
            store.sync()
        append_lines(self._log, b"".join(self._pending))
        self._pending = []
        self._logged = self._n

    # -- finishing ----------------------------------------------------------------------------
    def finish(self, *, verify: bool = True) -> str:
        """Complete the cache; returns the data file's path. ``verify`` reads the data back and checks
        every item against the CRC of the bytes that were meant to be written."""
        self._check_open()
        if not self._n:
            raise InvalidArgumentError(f"no items were appended to the cache {self.out_dir} (split {self.split!r})")
        self.flush()
        if verify:
            self._verify_written()
        os.close(self._fd)
        self._fd = -1
        self._log.close()
        self._log = None
        self._write_index()
        self._close_tables()
        shutil.rmtree(self._building, ignore_errors=True)
        self.finished = True
        self._lock.release()
        return self._paths["data"]

    def _item_bytes(self):
        """``(first item, its items' byte sizes (list), their CRC-32s (list))`` a chunk at a time, in order."""
        itemsize = fmt.LATENT_DTYPES[self._first["d"]]
        for lo, shapes in self._tables["shapes"].chunks(_CHUNK):
            crcs = self._tables["crcs"].read(lo, lo + len(shapes))
            yield lo, (np.prod(shapes, axis=1) * itemsize).tolist(), crcs.tolist()

    def _verify_written(self) -> None:
        """Every item's bytes on disk against the CRC of what was meant; the first bad item and all
        after it are dropped from the log (a rerun writes them again) before raising."""
        start = 0
        with open(self._partial, "rb", buffering=1 << 20) as fh:  # (items back to back: read in order)
            for lo, sizes, crcs in self._item_bytes():
                for k, (size, crc) in enumerate(zip(sizes, crcs)):
                    if zlib.crc32(fh.read(size)) != crc:
                        raise self._dropped(lo + k, start, self._partial)
                    start += size
        for store in self._fields.values():
            bad = store.verify()
            if bad is not None:
                raise self._dropped(bad, self._data_start(bad), store.partial)

    def _data_start(self, i: int) -> int:
        """Byte offset of item ``i``'s latent in the data file."""
        start = 0
        for lo, sizes, _ in self._item_bytes():
            if i < lo + len(sizes):
                return start + sum(sizes[: i - lo])
            start += sum(sizes)
        return start

    def _dropped(self, i: int, start: int, path: str) -> CacheCorruptError:
        """Drop item ``i`` (its latent starts at byte ``start``) and all after it; the error to raise."""
        error = CacheCorruptError(
            f"latent cache {path}: item {i} (key {self._key(i)!r}) on disk differs from what was written; it "
            f"and the {self._n - i - 1} items after it were dropped from the progress log: run the same build "
            f"again to rewrite them"
        )
        self._truncate_log(i, start)
        return error

    def _truncate_log(self, keep: int, end: int) -> None:
        """Forget every item from ``keep`` on (its data starts at byte ``end``), durably (log first,
        then data), so that appending resumes there."""
        self._log.close()
        rewrite_log_prefix(self._paths["progress"], self._header(), keep)
        self._log = open(self._paths["progress"], "ab")
        t = self._tables
        self._key_end = int(t["key_ends"].read(keep - 1, keep)[0]) if keep else 0
        self._info_end = int(t["info_ends"].read(keep - 1, keep)[0]) if keep else 0
        for name in ("shapes", "crcs", "sources", "key_ends", "key_hashes", "info_ends"):
            t[name].truncate(keep)
        t["key_bytes"].truncate(self._key_end)
        t["info_bytes"].truncate(self._info_end)
        self._hashed = sum(int(rows[:, 0].sum()) for _, rows in t["sources"].chunks(_CHUNK))
        self._slots.clear()
        for lo, hashes in t["key_hashes"].chunks(_CHUNK):
            self._slots.add(hashes, np.arange(lo, lo + len(hashes)))
        previous = 0
        self._with_info = 0
        for _, ends in t["info_ends"].chunks(_CHUNK):
            self._with_info += int(np.count_nonzero(np.diff(ends, prepend=previous)))
            previous = int(ends[-1])
        for name, store in list(self._fields.items()):
            if keep > store.start:
                store.truncate(keep)
            else:  # none of its values is left: the field is gone, as from the log
                store.close()
                os.remove(store.partial)
                del self._fields[name]
        self._n = self._logged = keep
        if not keep:
            t.pop("shapes").close()
            self._first = None
        self._end = end
        os.ftruncate(self._fd, self._end)

    def _meta(self, n: int, ndim: int, channels: int, latent_h: int, w_max: int) -> dict:
        identity = self.identity or {}
        stamp = {
            "n": n,
            "channels": channels,
            "latent_h": latent_h,
            "w_max": w_max,
            "pretrained": str(identity.get("pretrained", "")),
            "subfolder": str(identity.get("subfolder", "")),
            "line_height": None,
            "max_line_width": None,
            "downscale_factor": identity.get("downscale_factor"),
        }
        return {
            **self.extra_meta, **stamp,
            "format_version": fmt.FORMAT_VERSION, "layout": "shaped", "ndim": ndim,
            "dtype": self._first["d"],
            "encoder": self.identity, "checksum": {"algorithm": fmt.CHECKSUM_ALGORITHM, "block_rows": 1},
            "complete": True,
            # what items may lack (a cache that joins shards lets one lack a field all of whose items lack it)
            **({} if self.optional is None else {"optional_fields": True if self.optional is True else sorted(self.optional)}),
        }

    def _write_index(self) -> None:
        """The index files, streamed from the tables into files at temporary names, then the data
        renamed and the meta last (:func:`~.durable.publish`)."""
        n, t = self._n, self._tables
        ndim = t["shapes"].width
        files, index_crcs, latent_h, w_max = {}, [], 1, 0
        with NpyFile(self._paths["shapes"], np.int64, (n, ndim)) as shapes_out, \
                NpyFile(self._paths["offsets"], np.int64, (n + 1,)) as offsets_out, \
                NpyFile(self._paths["checksums"], np.uint32, (n,)) as crcs_out:
            offsets_out.rows(np.zeros(1, np.int64))
            last = 0
            for lo, shapes in t["shapes"].chunks(_CHUNK):  # (_CHUNK: whole index blocks)
                offsets = np.concatenate([[last], last + np.cumsum(np.prod(shapes, axis=1))])
                shapes_out.rows(shapes)
                offsets_out.rows(offsets[1:])
                crcs_out.rows(t["crcs"].read(lo, lo + len(shapes)))
                index_crcs += [tables._block_crc(shapes, offsets, r0, min(len(shapes), r0 + tables.BLOCK_ITEMS))
                               for r0 in range(0, len(shapes), tables.BLOCK_ITEMS)]
                if ndim > 1:
                    latent_h = max(latent_h, int(shapes[:, -2].max()))
                w_max, last = max(w_max, int(shapes[:, -1].max())), int(offsets[-1])
        files.update(shapes=shapes_out.written, offsets=offsets_out.written, checksums=crcs_out.written)
        with DurableFile(self._paths["keys"]) as out:  # the JSON key list older readers read
            out.write(b"[")
            for k, (keys, _) in enumerate(self._key_chunks()):
                out.write((b"," if k else b"") + json.dumps(keys, separators=(",", ":"))[1:-1].encode())
            out.write(b"]\n")
        files["keys"] = out.written
        files["hashes"] = None
        if self._hashed:
            with NpyFile(self._paths["hashes"], np.uint8, (n, HASH_BYTES)) as out:
                for _, rows in t["sources"].chunks(_CHUNK):
                    out.rows(rows[:, 1:])
            files["hashes"] = out.written
        files["info"] = self._info_file() if self._with_info else None
        files.update(widths=None, white=None)  # a line cache's leftovers would contradict this one
        paths, renames = dict(self._paths), []
        meta = self._meta(n, ndim, int(self._first["s"][0]), latent_h, w_max)
        t["key_bytes"].sync()
        key_files, meta["key_table"] = keytable.write_table_files(self.out_dir, self.split, t["key_bytes"].path, t["key_ends"],
                                                                   t["key_hashes"], n)
        files.update(key_files)
        with NpyFile(fmt.cache_path(self.out_dir, self.split, tables.CRC_KIND), np.uint32, (len(index_crcs),)) as out:
            out.rows(np.asarray(index_crcs, dtype=np.uint32))
        files[tables.CRC_KIND], meta["index_blocks"] = out.written, {"block_items": tables.BLOCK_ITEMS}  # readers check shapes per block
        paths.update({kind: fmt.cache_path(self.out_dir, self.split, kind) for kind in (*key_files, tables.CRC_KIND)})
        for name, store in self._fields.items():
            spans, crc, present, meta.setdefault("fields", {})[name] = store.index_files(
                n, optional=self.optional is not True and self._may_lack(name))
            for kind, label, payload in (("spans", "spans", spans), ("crc", "crc32", crc), ("present", "present", present)):
                # label: as format.damaged_files finds it; a None payload removes an earlier build's file
                paths[f"{name}.{label}"] = field_path(self.out_dir, self.split, name, kind)
                files[f"{name}.{label}"] = payload
            store.close()
            renames.append((store.partial, store.path))
        publish(paths, self._partial, files, meta, renames=renames)

    def _info_file(self) -> Written:
        """The JSON info list (``{}`` for an item without info), streamed from the info table."""
        with DurableFile(self._paths["info"]) as out:
            out.write(b"[")
            start = 0
            for lo, ends in self._tables["info_ends"].chunks(_CHUNK):
                raw = self._tables["info_bytes"].read(start, int(ends[-1])).tobytes()
                cuts = (ends - start).tolist()
                out.write((b"," if lo else b"") + b",".join(raw[a:b] or b"{}" for a, b in zip([0, *cuts[:-1]], cuts)))
                start = int(ends[-1])
            out.write(b"]\n")
        return out.written

    # -- closing ------------------------------------------------------------------------------
    def _check_tables(self) -> None:
        if self._slots is None:
            raise CacheError(f"this writer of {self.out_dir} (split {self.split!r}) is {'finished' if self.finished else 'closed'}: "
                             f"its tables of keys are gone; look keys up in the cache (LatentCache) or a new writer")

    def _check_open(self) -> None:
        if self._log is None:
            raise CacheError(f"this writer of {self.out_dir} (split {self.split!r}) is closed")

    def close(self) -> None:
        """Stop without finishing: what was appended is flushed and a later writer resumes it."""
        if self._log is not None and self._fd >= 0:
            self.flush()
        self._close_files()
        self._lock.release()

    def _close_tables(self) -> None:
        for column in self._tables.values():
            column.close()
        self._tables = {}
        if self._slots is not None:
            self._slots.close()
            self._slots = None

    def _close_files(self) -> None:
        for store in self._fields.values():
            store.close()
        self._close_tables()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "LatentCacheWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and not self.finished:
            try:
                self.finish()
            except BaseException:  # a failed finish leaves the job resumable and the lock free for the retry
                self._close_quietly()
                raise
        else:
            self._close_quietly()

    def _close_quietly(self) -> None:
        try:
            self.close()
        except OSError as err:  # the original error matters more than a failed last flush
            warnings.warn(f"could not flush the latent cache writer: {err}", RuntimeWarning, stacklevel=3)
            self._close_files()
            self._lock.release()


_CHUNK = 8 * tables.BLOCK_ITEMS  # items read from the tables at once (whole index blocks)
# the per-item tables of the build folder: name, dtype, values per row (0: a flat run); "shapes" is
# made with the first item (its ndim)
_TABLES = (("crcs", np.uint32, 0), ("sources", np.uint8, 1 + HASH_BYTES), ("key_bytes", np.uint8, 0), ("key_ends", np.int64, 0),
           ("key_hashes", np.uint64, 0), ("info_bytes", np.uint8, 0), ("info_ends", np.int64, 0))


def open_for_sources(out_dir, split: str, *, encoder: Any, meta: dict, lock: BuildLock,
                     digests: dict[str, bytes]) -> LatentCacheWriter:
    """A writer that resumes an interrupted run only if every item it already holds still has its
    source (``digests``: key -> content hash) unchanged; otherwise it starts over."""
    writer = LatentCacheWriter(out_dir, split, encoder=encoder, meta=meta, lock=lock)
    try:
        if any(h != (digests[k].hex() if k in digests else None) for keys, hashes in writer._key_chunks()
               for k, h in zip(keys, hashes)):
            writer = writer.reopen(restart=True)
    except BaseException:
        writer.close()
        raise
    return writer


def checked_source_hash(key: str, source_hash) -> str:
    """``source_hash`` (bytes of :data:`HASH_BYTES` or their hex) as hex; anything else raises naming the key."""
    if isinstance(source_hash, (bytes, bytearray)) and len(source_hash) == HASH_BYTES:
        return bytes(source_hash).hex()
    if isinstance(source_hash, str) and len(source_hash) == 2 * HASH_BYTES:
        with contextlib.suppress(ValueError):
            return bytes.fromhex(source_hash).hex()
    raise InvalidArgumentError(
        f"source_hash of key {key!r} must be {HASH_BYTES} bytes or their {2 * HASH_BYTES} hex digits "
        f"(e.g. durable.content_hash(path)), got {source_hash!r:.80}")


def _check_batch(name: str, values, count: int, least: int = 2) -> None:
    """Refuse a batch of ``name`` values that is not a ``[B, *shape]`` tensor or array (``least`` dimensions or more)."""
    if len(getattr(values, "shape", ())) < least or len(values) != count:
        raise InvalidArgumentError(f"{'latents' if name == LATENT else f'field {name!r}'} must be a [B, *shape] tensor or array "
                                   f"with B = len(keys) = {count}, got shape {list(getattr(values, 'shape', [])) or type(values).__name__}")


def _add_each(store: FieldStore, entries: list) -> None:
    """A field's rows of items given one by one, from their log entries (None: the item lacks the field)."""
    for entry in entries:
        if entry is None:
            store.add_absent(1)
        else:
            store.add_entry(entry)


def record_lines(keys, shape: list, dtype: str, crcs, hashes, fields: dict) -> str:
    """The log lines of a batch of records: exactly ``log_bytes`` of their records, as
    :func:`~.durable.item_lines` makes those of plain items (no JSON encoder per record); ``fields``: per
    field each item's ``"name": entry`` text, None where the item lacks the field."""
    quote, dims = json.encoder.encode_basestring_ascii, json.dumps(shape)
    latent = "" if dtype == "float16" else f'"d": "{dtype}", '
    lines = []
    for k, c, h, *named in zip(keys, crcs, hashes, *(fields[name] for name in sorted(fields))):
        values = ", ".join([text for text in named if text is not None])
        lines.append(f'{{"c": {c}, {latent}' + (f'"f": {{{values}}}, ' if values else "") + (f'"h": "{h}", ' if h is not None else "")
                     + f'"k": {quote(k)}, "s": {dims}}}\n')
    return "".join(lines)


def _optional_names(optional):
    """``optional=`` as True, a frozenset of field names, or None."""
    if optional is None or optional is True:
        return optional
    names = [optional] if isinstance(optional, str) else optional
    try:
        names = frozenset(check_name(n) for n in names)
    except TypeError:
        raise ArgumentTypeError(f"optional must be None, True or field names, got {optional!r}") from None
    if LATENT in names:
        raise InvalidArgumentError(f"optional: every record has its {LATENT!r}; name the other fields an item may lack, got {optional!r}")
    return names


def _info_text(info: dict) -> bytes:
    """An item's info as it stands in the info file's JSON list."""
    return json.dumps(info, separators=(",", ":")).encode()
