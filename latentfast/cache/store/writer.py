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
"""
from __future__ import annotations

import contextlib
import json
import os
import warnings
import zlib
from typing import Any, Mapping

import numpy as np
import torch

from ...errors import ArgumentTypeError, CacheCorruptError, CacheError, InvalidArgumentError, NonFiniteError
from . import format as fmt
from . import keytable, tables
from .fields import LATENT, FieldStore, as_stored, check_name, field_path
from .durable import HASH_BYTES, BuildLock, append_log, file_size, publish, pwrite_all, read_log, rewrite_log

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
        self._records: list[dict] = []  # every item written, in order (logged ones first)
        self._index: dict[str, int] = {}
        self._logged = 0  # records already in the progress log
        self._end = 0  # bytes of data written
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
        records = None if restart else self._read_log()
        if records is not None and not os.path.exists(self._partial) and not os.path.exists(self._paths["meta"]):
            # a crash inside finish() after the data was renamed into place: take it back
            with contextlib.suppress(FileNotFoundError):
                os.replace(self._paths["data"], self._partial)
        needed = sum(_itemsize(r) * int(np.prod(r["s"])) for r in records or [])
        if records is None or file_size(self._partial) < needed or not self._open_fields(records):
            self._start_over()
            return False
        self._fd = os.open(self._partial, os.O_RDWR)
        os.ftruncate(self._fd, needed)  # drop a tail written after the last logged item
        self._log = open(self._paths["progress"], "ab")
        for r in records:
            self._remember(r)
        self._logged, self._end = len(records), needed
        return bool(records)

    def _open_fields(self, records: list[dict]) -> bool:
        """Resume the field stores the logged records name (False: one cannot back its records)."""
        names = dict.fromkeys(name for r in records or () for name in r.get("f", {}))  # (an optional one may come late)
        for name in names:
            store = self._fields[name] = FieldStore(self.out_dir, self.split, name)
            if not store.open(_entries(records, name), restart=False):
                return False
        return True

    def _read_log(self) -> list[dict] | None:
        """The logged records if the progress log exists with this writer's header, else None."""
        return read_log(self._paths["progress"], self._header())

    def _start_over(self) -> None:
        """A fresh log (durably first), then an empty data file."""
        rewrite_log(self._paths["progress"], self._header())
        for store in self._fields.values():
            store.close()
        self._fields = {}
        self._fd = os.open(self._partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        fmt.fsync_dir(self.out_dir)
        self._log = open(self._paths["progress"], "ab")

    def _remember(self, record: dict) -> None:
        self._index[record["k"]] = len(self._records)
        self._records.append(record)

    # -- appending --------------------------------------------------------------------------
    def __contains__(self, key: str) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._records)

    @property
    def keys(self) -> list[str]:
        return [r["k"] for r in self._records]

    def source_hash(self, key: str) -> str | None:
        """The source hash recorded with ``key`` (hex), or None."""
        return self._records[self._index[key]].get("h")

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
        if key in self._index:
            raise InvalidArgumentError(f"key {key!r} was already written (check `key in writer` to resume)")
        latent, extra = self._split_record(key, latent)
        dtype, half = latent if isinstance(latent, tuple) else ("float16", as_float16(key, latent))
        self._check_shape(key, half.shape, dtype)
        record = {"k": key, "s": list(half.shape), "c": zlib.crc32(half)}
        if dtype != "float16":
            record["d"] = dtype
        if extra:
            record["f"] = {name: self._fields[name].put(key, *value) for name, value in extra.items()}
        if source_hash is not None:
            record["h"] = checked_source_hash(key, source_hash)
        if info:
            record["i"] = json.loads(json.dumps(info, sort_keys=True))  # as a resumed log reads it back
        pwrite_all(self._fd, half, self._end)
        self._end += half.nbytes
        self._remember(record)
        if len(self._records) - self._logged >= self.flush_every:
            self.flush()

    def append_many(self, keys, latents: Any, *, source_hashes=None) -> None:
        """Write many items of one shape at once, as :meth:`append` of each would (float16, the same records,
        log and durability): ``latents`` a ``[B, *shape]`` tensor or array of any float dtype, ``keys`` its B
        new distinct keys, ``source_hashes`` None or B of what :meth:`append` takes. Everything is checked
        before anything is written, then one write: the bulk path of imports and builds of tiny items."""
        self._check_open()
        keys = list(keys)
        for key in keys:
            if not isinstance(key, str) or not key:
                raise InvalidArgumentError(f"key must be a non-empty str, got {key!r}")
            if key in self._index:
                raise InvalidArgumentError(f"key {key!r} was already written (check `key in writer` to resume)")
        if len(set(keys)) != len(keys):
            twice = next(k for k in keys if keys.count(k) > 1)
            raise InvalidArgumentError(f"key {twice!r} appears twice in keys")
        if self._records and "f" in self._records[0]:
            raise InvalidArgumentError(f"this cache's items are records of the fields {[LATENT, *self._fields]}; append them one by one")
        if len(getattr(latents, "shape", ())) < 2 or len(latents) != len(keys):
            raise InvalidArgumentError(f"latents must be a [B, *shape] tensor or array with B = len(keys) = {len(keys)}, "
                                       f"got shape {list(getattr(latents, 'shape', [])) or type(latents).__name__}")
        hashes = [None] * len(keys) if source_hashes is None else [
            None if h is None else checked_source_hash(k, h) for k, h in zip(keys, source_hashes, strict=True)]
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
        rows = half.reshape(len(keys), -1)
        records = [{"k": key, "s": shape, "c": zlib.crc32(row)} for key, row in zip(keys, rows)]  # (one shape list shared: records are never edited)
        for record, h in zip(records, hashes):
            if h is not None:
                record["h"] = h
        self._index.update(zip(keys, range(len(self._records), len(self._records) + len(keys))))  # as _remember, in bulk
        self._records.extend(records)
        if len(self._records) - self._logged >= self.flush_every:
            self.flush()

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
        if self._records:
            missing, new = set(self._fields) - set(names), set(names) - set(self._fields)
            refused = sorted(n for n in missing | new if not self._may_lack(n))
            if refused:
                raise InvalidArgumentError(
                    f"record of key {key!r} has the fields {sorted(names)}, but this cache's records have {sorted(self._fields)} "
                    f"(first item {self._records[0]['k']!r}); {refused} are not optional (LatentCacheWriter(optional=...) "
                    f"lets items lack a field)")
        extra = {}
        for name in names:
            stored = as_stored(key, name, value[name])
            if name not in self._fields:
                self._fields[name] = FieldStore(self.out_dir, self.split, name)
                self._fields[name].start_over()
            self._fields[name].check(key, stored[0], stored[1], self._records[0]["k"] if self._records else None)
            extra[name] = stored
        shapes = {LATENT: tuple(latent[1].shape), **{name: stored[1] for name, stored in extra.items()}}
        for name, partner in SAME_SHAPE.items():  # what a draw puts in the latent's place, or draws over it
            if name in shapes and partner in shapes and shapes[name] != shapes[partner]:
                raise InvalidArgumentError(f"field {name!r} of key {key!r} has shape {list(shapes[name])}, but its "
                                           f"{partner!r} has {list(shapes[partner])}: they must be of one shape")
        return latent, extra

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
        if not self._records:
            return
        first = self._records[0]["s"]
        if dtype != self._records[0].get("d", "float16"):
            raise InvalidArgumentError(f"latent of key {key!r} is {dtype}, but this cache's latents are "
                                       f"{self._records[0].get('d', 'float16')} (first item {self._records[0]['k']!r}); no silent cast")
        if len(shape) != len(first) or shape[0] != first[0]:
            raise InvalidArgumentError(
                f"latent of key {key!r} has shape {list(shape)}, but this cache's items are {len(first)}-D with "
                f"{first[0]} channels (first item {self._records[0]['k']!r}: {first})"
            )

    def flush(self) -> None:
        """Make every appended item durable: data first, then its records in the log."""
        self._check_open()
        if self._logged == len(self._records):
            return
        os.fdatasync(self._fd)
        for store in self._fields.values():
            store.sync()
        append_log(self._log, self._records[self._logged:])
        self._logged = len(self._records)

    # -- finishing ----------------------------------------------------------------------------
    def finish(self, *, verify: bool = True) -> str:
        """Complete the cache; returns the data file's path. ``verify`` reads the data back and checks
        every item against the CRC of the bytes that were meant to be written."""
        self._check_open()
        if not self._records:
            raise InvalidArgumentError(f"no items were appended to the cache {self.out_dir} (split {self.split!r})")
        self.flush()
        shapes = np.asarray([r["s"] for r in self._records], dtype=np.int64)
        offsets = fmt.shaped_offsets(shapes) * (_itemsize(self._records[0]) // 2)  # in 2-byte units
        sums = np.asarray([r["c"] for r in self._records], dtype=np.uint32)
        if verify:
            self._verify_written(offsets, sums)
        os.close(self._fd)
        self._fd = -1
        self._log.close()
        self._log = None
        self._write_index(shapes, fmt.shaped_offsets(shapes), sums)
        self.finished = True
        self._lock.release()
        return self._paths["data"]

    def _verify_written(self, offsets: np.ndarray, sums: np.ndarray) -> None:
        """Every item's bytes on disk against the CRC of what was meant; the first bad item and all
        after it are dropped from the log (a rerun writes them again) before raising."""
        with open(self._partial, "rb") as fh:
            for i in range(len(self._records)):
                start, end = int(offsets[i]) * 2, int(offsets[i + 1]) * 2
                fh.seek(start)
                if zlib.crc32(fh.read(end - start)) != int(sums[i]):
                    raise self._dropped(i, start, self._partial)
        for name, store in self._fields.items():
            bad = store.verify(_entries(self._records, name))
            if bad is not None:
                raise self._dropped(bad, int(offsets[bad]) * 2, store.partial)

    def _dropped(self, i: int, start: int, path: str) -> CacheCorruptError:
        """Drop item ``i`` (its latent starts at byte ``start``) and all after it; the error to raise."""
        error = CacheCorruptError(
            f"latent cache {path}: item {i} (key {self._records[i]['k']!r}) on disk differs from what was written; it "
            f"and the {len(self._records) - i - 1} items after it were dropped from the progress log: run the same build "
            f"again to rewrite them"
        )
        self._truncate_log(i, start)
        return error

    def _truncate_log(self, keep: int, end: int) -> None:
        """Forget every item from ``keep`` on (its data starts at byte ``end``), durably (log first,
        then data), so that appending resumes there."""
        self._log.close()
        rewrite_log(self._paths["progress"], self._header(), self._records[:keep])
        self._log = open(self._paths["progress"], "ab")
        for record in self._records[keep:]:
            del self._index[record["k"]]
        del self._records[keep:]
        for name, store in self._fields.items():
            store.rewind(_entries(self._records, name))
        self._logged = keep
        self._end = end
        os.ftruncate(self._fd, self._end)

    def _meta(self, shapes: np.ndarray) -> dict:
        identity = self.identity or {}
        stamp = {
            "n": len(shapes),
            "channels": int(shapes[0, 0]),
            "latent_h": int(shapes[:, -2].max()) if shapes.shape[1] > 1 else 1,
            "w_max": int(shapes[:, -1].max()),
            "pretrained": str(identity.get("pretrained", "")),
            "subfolder": str(identity.get("subfolder", "")),
            "line_height": None,
            "max_line_width": None,
            "downscale_factor": identity.get("downscale_factor"),
        }
        return {
            **self.extra_meta, **stamp,
            "format_version": fmt.FORMAT_VERSION, "layout": "shaped", "ndim": int(shapes.shape[1]),
            "dtype": self._records[0].get("d", "float16"),
            "encoder": self.identity, "checksum": {"algorithm": fmt.CHECKSUM_ALGORITHM, "block_rows": 1},
            "complete": True,
            # what items may lack (a cache that joins shards lets one lack a field all of whose items lack it)
            **({} if self.optional is None else {"optional_fields": True if self.optional is True else sorted(self.optional)}),
        }

    def _write_index(self, shapes: np.ndarray, offsets: np.ndarray, sums: np.ndarray) -> None:
        """The index files, then the data renamed and the meta last (:func:`~.durable.publish`)."""
        hashes = [r.get("h") for r in self._records]
        info = [r.get("i", {}) for r in self._records]
        files = {"shapes": fmt.npy_bytes(shapes), "offsets": fmt.npy_bytes(offsets), "checksums": fmt.npy_bytes(sums),
                 "keys": _json_bytes(self.keys),
                 "hashes": fmt.npy_bytes(_hash_array(hashes)) if any(hashes) else None,
                 "info": _json_bytes(info) if any(info) else None,
                 "widths": None, "white": None}  # a line cache's leftovers would contradict this one
        paths, meta, renames = dict(self._paths), self._meta(shapes), []
        key_files, meta["key_table"] = keytable.table_files(self.keys)  # what readers look keys up in, mapped
        files.update(key_files)
        files[tables.CRC_KIND], meta["index_blocks"] = tables.index_files(shapes, offsets)  # readers check shapes per block
        paths.update({kind: fmt.cache_path(self.out_dir, self.split, kind) for kind in (*key_files, tables.CRC_KIND)})
        for name, store in self._fields.items():
            spans, crc, present, meta.setdefault("fields", {})[name] = store.index_files(
                _entries(self._records, name), optional=self.optional is not True and self._may_lack(name))
            for kind, label, payload in (("spans", "spans", spans), ("crc", "crc32", crc), ("present", "present", present)):
                # label: as format.damaged_files finds it; a None payload removes an earlier build's file
                paths[f"{name}.{label}"] = field_path(self.out_dir, self.split, name, kind)
                files[f"{name}.{label}"] = payload
            store.close()
            renames.append((store.partial, store.path))
        publish(paths, self._partial, files, meta, renames=renames)

    # -- closing ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._log is None:
            raise CacheError(f"this writer of {self.out_dir} (split {self.split!r}) is closed")

    def close(self) -> None:
        """Stop without finishing: what was appended is flushed and a later writer resumes it."""
        if self._log is not None and self._fd >= 0:
            self.flush()
        self._close_files()
        self._lock.release()

    def _close_files(self) -> None:
        for store in self._fields.values():
            store.close()
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


def open_for_sources(out_dir, split: str, *, encoder: Any, meta: dict, lock: BuildLock,
                     digests: dict[str, bytes]) -> LatentCacheWriter:
    """A writer that resumes an interrupted run only if every item it already holds still has its
    source (``digests``: key -> content hash) unchanged; otherwise it starts over."""
    writer = LatentCacheWriter(out_dir, split, encoder=encoder, meta=meta, lock=lock)
    try:
        if any(writer.source_hash(k) != (digests[k].hex() if k in digests else None) for k in writer.keys):
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


def _entries(records: list[dict], name: str) -> list[dict | None]:
    """Field ``name``'s log entry of each record, None where the record lacks it."""
    return [r.get("f", {}).get(name) for r in records]


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


def _itemsize(record: dict) -> int:
    """Bytes per element of a logged item's latent."""
    return fmt.LATENT_DTYPES[record.get("d", "float16")]


def _json_bytes(value) -> bytes:
    return (json.dumps(value, separators=(",", ":")) + "\n").encode("utf-8")


def _hash_array(hashes: list) -> np.ndarray:
    """uint8 ``[N, 16]`` content hashes (zeros where an item has none)."""
    out = np.zeros((len(hashes), HASH_BYTES), dtype=np.uint8)
    for i, h in enumerate(hashes):
        if h:
            out[i] = np.frombuffer(bytes.fromhex(h)[:HASH_BYTES].ljust(HASH_BYTES, b"\0"), dtype=np.uint8)
    return out
