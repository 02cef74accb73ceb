"""Named fields beside the latent: each a value per item (a caption embedding ``[L_i, D]``, a pooled
vector, an attention mask), of its own dtype, stored as given, with equal values stored once.

On disk, field ``name`` of split ``split`` is:

- ``{split}.field.{name}.dat``        the distinct values back to back, each padded to an even byte
  count (the compiled gather copies 2-byte units) -- a value whose bytes equal one already stored is
  not written again;
- ``{split}.field.{name}.spans.npy``  int64 ``[N, 2 + ndim]``: per item the byte offset and byte
  length of its value in the data file, then its shape (items sharing a value share an offset);
- ``{split}.field.{name}.crc32.npy``  uint32 ``[N]``: CRC-32 of each item's value bytes;
- ``{split}.field.{name}.present.npy`` bool ``[N]``, optional fields only: whether each item has a value.

The meta lists the fields (``meta["fields"]``: name -> dtype, ndim, logical and stored bytes, and for
an optional field ``optional: true`` and its ``absent`` count). The ``latent`` field is the cache's
main data file, as in every cache before fields existed; it is never optional.

Optional fields: an item without a value of an optional field has the spans row ``[end of the data
file, 0, 0, ...]`` (no bytes, an all-zero shape: it shares no offset with a stored value) and CRC 0.
The presence file is an index file like the spans: its CRC-32 is in the meta's ``files`` and checked
on open. A cache written before optional fields existed has no presence file: every item has every
field.

:class:`FieldStore` is the writer's side (the same durable protocol as the latents: whole writes,
fdatasync before the log names a value, read back against the CRC, index, rename, meta last);
:class:`FieldItems` the reader's (one field as the batch gather sees it).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import struct
import warnings
import zlib

import numpy as np
import torch

from ...errors import AbsentValueError, CacheCorruptError, InvalidArgumentError, NonFiniteError
from . import format as fmt
from .building import Column, HashRuns
from .durable import NpyFile, Written, pwrite_all
from .layout import holding_items, map_units

LATENT = "latent"
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool)}
_KINDS = {"data": "dat", "spans": "spans.npy", "crc": "crc32.npy", "present": "present.npy"}


def field_path(cache_dir, split: str, name: str, kind: str) -> str:
    """Path of field ``name``'s ``data``, ``spans``, ``crc`` or ``present`` file."""
    return os.path.join(os.fspath(cache_dir), f"{split}.field.{name}.{_KINDS[kind]}")


def check_name(name) -> str:
    if not isinstance(name, str) or not _NAME.match(name) or name.endswith("_shape"):
        raise InvalidArgumentError(f"field names are identifiers of letters, digits and _ (not ending in _shape), got {name!r}")
    return name


def value_hash(payload) -> bytes:
    """The hash that finds candidate equal values (candidates are then compared byte for byte)."""
    return hashlib.blake2b(payload, digest_size=16).digest()


def as_stored(key: str, name: str, value) -> tuple[str, tuple[int, ...], np.ndarray]:
    """``(dtype name, shape, flat uint8 bytes)`` of one field value, exactly as given (no cast); a float
    value holding NaN or inf raises :class:`~latentfast.errors.NonFiniteError` (as a latent does: no
    opt-in, so a cache's every float value is finite and :func:`~latentfast.cache.verify_cache` says so)."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu").contiguous()
    elif isinstance(value, np.ndarray):
        if value.dtype.kind not in "fiub":
            raise InvalidArgumentError(f"field {name!r} of key {key!r} has numpy dtype {value.dtype}; stored dtypes are {sorted(DTYPES)}")
        tensor = torch.from_numpy(np.ascontiguousarray(value))
    else:
        raise InvalidArgumentError(f"field {name!r} of key {key!r} must be a tensor or numpy array, got {type(value).__name__}")
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise InvalidArgumentError(f"field {name!r} of key {key!r} has dtype {dtype}; stored dtypes are {sorted(DTYPES)}")
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):  # the latent's rule, for every float field
        raise NonFiniteError(f"field {name!r} of key {key!r} holds values that are not finite ({dtype}: NaN or inf)")
    raw = tensor.reshape(-1).view(torch.uint8)
    return dtype, tuple(int(x) for x in tensor.shape), raw.numpy()


def check_declared(name: str, key: str, dtype: str, shape: tuple, declared: str, ndim: int, first_key: str | None) -> None:
    """Refuse key ``key``'s value of field ``name`` unless it has the field's ``declared`` dtype and ``ndim``."""
    if dtype != declared or len(shape) != ndim:
        raise InvalidArgumentError(
            f"field {name!r} of key {key!r} is {dtype} {len(shape)}-D (shape {list(shape)}), but this cache "
            f"declared it {declared} {ndim}-D (first item {first_key!r})")


class FieldStore:
    """The writer's side of one field: its partial data file, dtype and ndim (fixed by its first value,
    that of item ``start``: the items before it lack the field), and in the writer's build folder
    ``building`` (:mod:`~latentfast.cache.store.building`) its tables: per item from ``start`` on, the
    spans row (an absent item's offset is filled in by :meth:`index_files`), the CRC-32 and presence;
    per distinct value stored, its offset, byte count, CRC-32 and first item; and a mapped hash table
    of the values' hashes, which finds the stored values a new one is compared with byte for byte
    (equal values are stored once). Nothing per item or per value is kept in Python objects."""

    def __init__(self, out_dir: str, split: str, name: str, building: str, start: int, dtype: str, ndim: int):
        self.out_dir, self.split, self.name = out_dir, split, name
        self.path = field_path(out_dir, split, name, "data")
        self.partial = fmt.partial_path(self.path)
        self.fd = -1
        self.end = 0  # bytes of the data file the stored values take
        self.dtype, self.ndim, self.start = dtype, ndim, start
        self.absent = start  # items without a value
        base = os.path.join(building, f"field.{name}.")
        self.spans = Column(base + "spans", np.int64, 2 + ndim)
        self.crcs = Column(base + "crcs", np.uint32)
        self.present = Column(base + "present", np.uint8)
        self.values = Column(base + "values", np.int64, 4)  # offset, byte count, CRC-32, the item that stored it
        self.slots = HashRuns(base + "slots", memory_slots=1 << 16)  # a value's hash -> its row of ``values`` (1 MiB: one a field)

    @property
    def items(self) -> int:
        """Items the tables cover (those before ``start`` included)."""
        return self.start + self.spans.rows

    def create(self) -> None:
        """An empty data file (a field first seen now)."""
        self.fd = os.open(self.partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)

    def resume(self) -> bool:
        """Open the data file behind the logged values :meth:`load` read, cut after the last of them
        (False: the file cannot back them)."""
        if not os.path.exists(self.partial):
            with contextlib.suppress(FileNotFoundError):  # a crash inside finish(), after the rename
                os.replace(self.path, self.partial)
        if fmt_size(self.partial) < self.end:
            return False
        self.fd = os.open(self.partial, os.O_RDWR)
        os.ftruncate(self.fd, self.end)
        return True

    def check(self, key: str, dtype: str, shape: tuple, first_key: str | None) -> None:
        check_declared(self.name, key, dtype, shape, self.dtype, self.ndim, first_key)

    # -- storing values ---------------------------------------------------------------------------
    def _value(self, row: int) -> tuple[int, int]:
        """``(offset, byte count)`` of stored value ``row``."""
        offset, nbytes = self.values.read(row, row + 1)[0, :2].tolist()
        return offset, nbytes

    def _stored(self, h: int, raw) -> int | None:
        """The offset of the stored value whose bytes are ``raw`` (hash ``h``), or None."""
        for row in self.slots.find_one(h):
            offset, nbytes = self._value(row)
            if nbytes == len(raw) and os.pread(self.fd, nbytes, offset) == raw:
                return offset
        return None

    def _store(self, values: np.ndarray, hashes: np.ndarray, crcs: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Write new distinct ``values`` (uint8 ``[D, nbytes]``, first stored by ``items``) at the end, back
        to back, each padded to an even byte count (the compiled gather copies 2-byte units); their offsets."""
        count, nbytes = values.shape
        padded = np.zeros((count, nbytes + (nbytes & 1)), np.uint8)
        padded[:, :nbytes] = values
        offsets = self.end + padded.shape[1] * np.arange(count, dtype=np.int64)
        if padded.nbytes:  # (the bytes first: a value is found only once they are in the file)
            pwrite_all(self.fd, padded, self.end)
        self.end += padded.nbytes
        self.slots.add(hashes, self.values.rows + np.arange(count))
        self.values.append(np.stack([offsets, np.full(count, nbytes), crcs, items], axis=1).astype(np.int64), count)
        return offsets

    def put(self, item: int, dtype: str, shape: tuple, raw: np.ndarray) -> dict:
        """Store item ``item``'s value (or find an equal one stored); its log entry, which :meth:`add_entry`
        turns into the item's rows once the whole item is written."""
        digest, payload = value_hash(raw), raw.tobytes()
        h, crc = int.from_bytes(digest[:8], "little"), zlib.crc32(payload)
        offset = self._stored(h, payload)
        if offset is None:  # (:meth:`_store` of one value, without numpy's per-call costs)
            offset = self.end
            if payload:
                pwrite_all(self.fd, payload + bytes(len(payload) & 1), offset)
            self._remember(h, offset, len(payload), crc, item)
        return {"o": offset, "n": len(payload), "s": list(shape), "c": crc, "d": dtype, "x": digest.hex()}

    def _remember(self, h: int, offset: int, nbytes: int, crc: int, item: int) -> None:
        """A value just stored at the end (its bytes in the file) in the values table and the hash table."""
        self.slots.add_one(h, self.values.rows)
        self.values.append(struct.pack("<4q", offset, nbytes, crc, item), 1)
        self.end += nbytes + (nbytes & 1)

    def put_many(self, item: int, shape: tuple, values: np.ndarray) -> tuple[list[str], np.ndarray, tuple]:
        """Store the values of items ``item, item + 1, ...`` (uint8 ``[B, nbytes]``, each of ``shape``):
        each distinct one once, in the order they first appear (so at the offsets a :meth:`put` per item
        gives them). ``(each distinct value's log entry as text, each item's distinct value, the items'
        :meth:`add_rows` arguments)``."""
        count, nbytes = values.shape
        if nbytes and count > 1:
            _, first, inverse = np.unique(values.view(np.dtype((np.void, nbytes))).reshape(count), return_index=True,
                                          return_inverse=True)
            order = np.argsort(first)  # the distinct values by first appearance
            rank = np.empty_like(order)
            rank[order] = np.arange(len(order))
            first, inverse = first[order], rank[inverse.reshape(count)]
        else:  # one item, or empty values (all equal)
            first, inverse = np.zeros(min(count, 1), np.int64), np.zeros(count, np.int64)
        distinct = values[first]
        digests = [value_hash(v) for v in distinct]
        crcs = np.asarray([zlib.crc32(v) for v in distinct], np.int64)
        hashes = np.frombuffer(b"".join(digests), "<u8")[::2].astype(np.uint64)  # each digest's first 8 bytes
        offsets = np.full(len(distinct), -1, np.int64)
        which, rows = self.slots.find(hashes)
        for w, row in zip(which.tolist(), rows.tolist()):
            if offsets[w] < 0:
                offset, n = self._value(row)
                if n == nbytes and os.pread(self.fd, n, offset) == distinct[w].tobytes():
                    offsets[w] = offset
        new = np.flatnonzero(offsets < 0)
        if new.size:
            offsets[new] = self._store(distinct[new], hashes[new], crcs[new], item + first[new])
        dims = json.dumps(list(shape))
        texts = [entry_text(o, nbytes, dims, c, self.dtype, d.hex()) for o, c, d in zip(offsets.tolist(), crcs.tolist(), digests)]
        return texts, inverse, (offsets[inverse], nbytes, shape, crcs[inverse])

    # -- the per-item rows ------------------------------------------------------------------------
    def add_entry(self, entry: dict) -> None:
        """One item's rows, from its log entry (:meth:`put`'s), without numpy's per-call costs."""
        self.spans.append(struct.pack(f"<{2 + self.ndim}q", entry["o"], entry["n"], *entry["s"]), 1)
        self.crcs.append(struct.pack("<I", entry["c"]), 1)
        self.present.append(b"\1", 1)

    def add_rows(self, offsets: np.ndarray, nbytes, shapes, crcs: np.ndarray) -> None:
        """The rows of items that have a value (``nbytes``, ``shapes``: per item, or one for all)."""
        count = len(offsets)
        spans = np.empty((count, 2 + self.ndim), np.int64)
        spans[:, 0], spans[:, 1], spans[:, 2:] = offsets, nbytes, shapes
        self.spans.append(spans, count)
        self.crcs.append(np.asarray(crcs, np.uint32), count)
        self.present.append(np.ones(count, np.uint8), count)

    def add_absent(self, count: int) -> None:
        """The rows of ``count`` items without a value."""
        self.spans.append(bytes(8 * (2 + self.ndim) * count), count)
        self.crcs.append(bytes(4 * count), count)
        self.present.append(bytes(count), count)
        self.absent += count

    def load(self, entries: list[dict | None]) -> None:
        """The rows of the next logged items from their ``entries`` (None: no value); each value an entry
        stored (one at the end of those before it, not stored yet) found again, so that equal values are
        still stored once after a resume. Entries that contradict the field raise ``ValueError``."""
        item = self.items
        for k, e in enumerate(entries):
            if e is None:
                continue
            if e["d"] != self.dtype or len(e["s"]) != self.ndim:
                raise ValueError(f"a logged value of field {self.name!r} of another dtype or ndim")
            offset, nbytes, h = e["o"], e["n"], int.from_bytes(bytes.fromhex(e["x"])[:8], "little")
            if offset == self.end and all(self._value(row) != (offset, nbytes) for row in self.slots.find_one(h)):
                self._remember(h, offset, nbytes, e["c"], item + k)
            elif not 0 <= offset <= offset + nbytes <= self.end:
                raise ValueError(f"a logged value of field {self.name!r} lies past the values stored before it")
        have = [e for e in entries if e is not None]
        if len(have) < len(entries):
            spans = np.zeros((len(entries), 2 + self.ndim), np.int64)
            crcs = np.zeros(len(entries), np.uint32)
            present = np.asarray([e is not None for e in entries], np.uint8)
            if have:
                spans[present == 1] = [[e["o"], e["n"], *e["s"]] for e in have]
                crcs[present == 1] = [e["c"] for e in have]
            self.spans.append(spans, len(entries))
            self.crcs.append(crcs, len(entries))
            self.present.append(present, len(entries))
            self.absent += len(entries) - len(have)
        elif have:
            self.add_rows(np.asarray([e["o"] for e in have], np.int64), [e["n"] for e in have],
                          np.asarray([e["s"] for e in have], np.int64).reshape(len(have), self.ndim), [e["c"] for e in have])

    # -- a cut, checks and the finished files -------------------------------------------------------
    def truncate(self, keep: int) -> None:
        """Forget items ``keep`` on (``keep`` > :attr:`start`) and the values only they stored."""
        self.spans.truncate(keep - self.start)
        self.crcs.truncate(keep - self.start)
        self.present.truncate(keep - self.start)
        self.absent = self.start + sum(int(np.count_nonzero(rows == 0)) for _, rows in self.present.chunks(_CHUNK))
        kept = 0
        for lo, rows in self.values.chunks(_CHUNK):  # (values are stored in item order)
            kept = lo + int(np.searchsorted(rows[:, 3], keep))
            if kept < lo + len(rows):
                break
        self.values.truncate(kept)
        self.slots.retain(kept)
        offset, nbytes = self._value(kept - 1) if kept else (0, 0)
        self.end = offset + nbytes + (nbytes & 1)
        os.ftruncate(self.fd, self.end)

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def verify(self) -> int | None:
        """The first item whose value on disk fails its CRC, else None (each stored value read once, in
        the order they lie in the file)."""
        with open(self.partial, "rb", buffering=1 << 20) as fh:
            for _, rows in self.values.chunks(_CHUNK // 8):  # (its rows as Python ints: ~1 MiB at a time)
                for offset, nbytes, crc, item in zip(*(rows[:, k].tolist() for k in range(4))):
                    fh.seek(offset)  # (within the read buffer: no system call)
                    if zlib.crc32(fh.read(nbytes)) != crc:
                        return item  # (the first item of the first damaged value: every later item names a later value)
        return None

    def index_files(self, n: int, optional: bool = False) -> tuple[Written, Written, Written | None, dict]:
        """``(spans .npy, crc .npy, present .npy or None, meta entry)`` of this field for the finished
        cache of ``n`` items, streamed from the tables into files at temporary names; the field is optional
        (a presence file) when ``optional`` or some item has no value."""
        absent_row = np.zeros(2 + self.ndim, np.int64)
        absent_row[0] = self.end  # past every stored value: an absent item shares no offset with one
        paths = {kind: field_path(self.out_dir, self.split, self.name, kind) for kind in ("spans", "crc", "present")}
        with_present = optional or self.absent > 0
        logical = 0
        with NpyFile(paths["spans"], np.int64, (n, 2 + self.ndim)) as spans_out, NpyFile(paths["crc"], np.uint32, (n,)) as crc_out, \
                contextlib.ExitStack() as stack:
            present_out = stack.enter_context(NpyFile(paths["present"], np.bool_, (n,))) if with_present else None
            for lo in range(0, self.start, _CHUNK):  # the items before the first value
                count = min(self.start, lo + _CHUNK) - lo
                spans_out.rows(np.broadcast_to(absent_row, (count, 2 + self.ndim)))
                crc_out.rows(np.zeros(count, np.uint32))
                if present_out is not None:
                    present_out.rows(np.zeros(count, np.bool_))
            for lo, spans in self.spans.chunks(_CHUNK):
                present = self.present.read(lo, lo + len(spans)).astype(np.bool_)
                spans = spans.copy()
                spans[~present] = absent_row
                logical += int(spans[:, 1].sum())
                spans_out.rows(spans)
                crc_out.rows(self.crcs.read(lo, lo + len(spans)))
                if present_out is not None:
                    present_out.rows(present)
        meta = {"dtype": self.dtype, "ndim": self.ndim, "logical_bytes": logical, "stored_bytes": self.end}
        if not with_present:
            return spans_out.written, crc_out.written, None, meta
        meta.update(optional=True, absent=self.absent)
        return spans_out.written, crc_out.written, present_out.written, meta

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        for column in (self.spans, self.crcs, self.present, self.values):
            column.close()
        self.slots.close()


_CHUNK = 1 << 16  # rows of a table read at once


def entry_text(offset: int, nbytes: int, dims: str, crc: int, dtype: str, digest_hex: str) -> str:
    """A value's log entry as the progress log's JSON encoder writes it (keys sorted), made without the
    encoder; ``dims``: the JSON of its shape."""
    return f'{{"c": {crc}, "d": "{dtype}", "n": {nbytes}, "o": {offset}, "s": {dims}, "x": "{digest_hex}"}}'


def fmt_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


# ---- reading ------------------------------------------------------------------------------------
def load_field_index(cache_dir: str, split: str, name: str, meta: dict, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(spans [N, 2 + ndim], crc [N], present [N] bool or None)`` of field ``name`` of the cache whose
    meta is ``meta``, checked against it and the data file; ``present`` is None where every item has a
    value (a field not optional)."""
    entry = meta["fields"][name]
    meta_path = fmt.cache_path(cache_dir, split, "meta")
    if not isinstance(entry, dict) or entry.get("dtype") not in DTYPES or not isinstance(entry.get("ndim"), int) \
            or not 0 <= entry["ndim"] <= 8 or entry.get("optional", False) not in (True, False):
        raise CacheCorruptError(f"latent cache meta {meta_path}: field {name!r} needs a dtype of {sorted(DTYPES)}, an ndim in [0, 8] "
                                f"and optional true or false, got {entry!r}")
    spath, cpath, dpath = (field_path(cache_dir, split, name, k) for k in ("spans", "crc", "data"))
    spans, crc = fmt.load_npy(spath, f"field {name!r} spans"), fmt.load_npy(cpath, f"field {name!r} checksums")
    if spans.shape != (n, 2 + entry["ndim"]) or spans.dtype != np.int64 or crc.shape != (n,) or crc.dtype != np.uint32:
        raise CacheCorruptError(f"latent cache field {name!r}: {spath} must be int64 [{n}, {2 + entry['ndim']}] and {cpath} uint32 [{n}], "
                                f"got {spans.dtype} {list(spans.shape)} and {crc.dtype} {list(crc.shape)}")
    present = _load_present(cache_dir, split, name, entry, n, meta)
    itemsize = torch.empty(0, dtype=DTYPES[entry["dtype"]]).element_size()
    size = fmt_size(dpath)
    if size < 0:
        raise FileNotFoundError(f"latent cache field {name!r} data file {dpath} does not exist")
    have = spans if present is None else spans[present]
    if len(have) and (have[:, :2].min() < 0 or np.any(have[:, 2:] < 0) or np.any(have[:, 0] % 2)
                      or np.any(have[:, 1] != np.prod(have[:, 2:], axis=1) * itemsize) or int((have[:, 0] + have[:, 1]).max()) > size):
        raise CacheCorruptError(f"latent cache field {name!r}: {spath} names spans that do not match the shapes or lie past the end of {dpath} ({size} bytes)")
    if present is not None and (np.any(spans[~present, 1:] != 0) or np.any(spans[~present, 0] % 2)
                                or np.any((spans[~present, 0] < 0) | (spans[~present, 0] > size))):
        raise CacheCorruptError(f"latent cache field {name!r}: {spath} gives bytes, a shape or an offset past {dpath} to an item "
                                f"its presence file says has no value")
    return spans, crc, present


def _load_present(cache_dir: str, split: str, name: str, entry: dict, n: int, meta: dict) -> np.ndarray | None:
    """An optional field's presence bits (checked against the meta's CRC-32 and ``absent`` count), else None."""
    if not entry.get("optional"):
        return None
    path = field_path(cache_dir, split, name, "present")
    present = fmt.load_npy(path, f"field {name!r} presence")
    if present.shape != (n,) or present.dtype != np.bool_ or int((~present).sum()) != entry.get("absent"):
        raise CacheCorruptError(f"latent cache field {name!r}: {path} must be bool [{n}] with {entry.get('absent')!r} items absent "
                                f"(the meta's count), got {present.dtype} {list(present.shape)}")
    fmt.check_recorded(cache_dir, split, meta, (f"{name}.present",))
    return present


class FieldItems:
    """One field of an opened cache as the batch gather sees it: the data file as float16 units,
    each item's unit offset and unit count, its shape, whether it has a value (``present``: bool
    ``[N]`` of an optional field, None where every item has one), and (per process) the map and
    checks done."""

    def __init__(self, cache, name: str, spans: np.ndarray, crc: np.ndarray, present: np.ndarray | None, files):
        self.cache_dir, self.split, self.name = cache.cache_dir, cache.split, name
        self.path = field_path(cache.cache_dir, cache.split, name, "data")
        self.dtype = DTYPES[cache.meta["fields"][name]["dtype"]]
        self.n, self.verify_rows = len(spans), cache.verify_rows
        self.shapes = np.ascontiguousarray(spans[:, 2:])
        self.nbytes = spans[:, 1]
        self.row_starts = spans[:, 0] // 2  # unit offset of each item's value (shared values share it)
        self.row_ends = self.row_starts + (self.nbytes + 1) // 2
        self.crc, self.present = crc, present
        self.remote = getattr(cache, "remote", None)  # a cache in object storage (layout.holding)
        self.files = files  # the cache's data files as this process reads them (layout.CacheFiles)
        self._source = None
        self._verified: set[int] = set()

    def fd(self) -> int:
        """This process's descriptor of the field's data file: every read of the field goes through it."""
        return self.files.fd(self.path)

    def source(self):
        """``(data, unit offsets, unit counts, pitch 0)`` for the compiled gathers."""
        if self._source is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                data = torch.from_numpy(map_units(self.fd(), int(self.row_ends.max(initial=0))))
            units = self.row_ends - self.row_starts
            if units.size and units.max() > np.iinfo(np.int32).max:
                raise InvalidArgumentError(f"field {self.name!r}: a value of {int(units.max())} units is too large for the batch gather")
            self._source = (data, torch.from_numpy(np.ascontiguousarray(self.row_starts)), torch.from_numpy(units.astype(np.int32)), 0)
        return self._source

    def check(self, index_np: np.ndarray, finite: bool = False) -> None:
        """CRC-check each item of ``index_np`` not checked yet in this process (``verify_rows``); with
        ``finite`` (verify), also that a float field's values are finite (every item of ``index_np``)."""
        data = self.source()[0].numpy().view(np.uint8)
        finite = finite and self.dtype.is_floating_point
        todo = np.asarray([i for i in np.unique(index_np).tolist() if finite or i not in self._verified], dtype=np.int64)
        for group in np.array_split(todo, -(-len(todo) // 1024)) if len(todo) else ():  # a remote cache's held at once
            with holding_items(self, group):
                for i in group.tolist():
                    start = int(self.row_starts[i]) * 2
                    value = data[start: start + int(self.nbytes[i])]
                    if zlib.crc32(value) != int(self.crc[i]):
                        raise CacheCorruptError(f"latent cache field {self.name!r} ({self.path}): item {i}'s value fails its CRC-32 checksum")
                    if finite and value.size and not bool(torch.isfinite(torch.from_numpy(value.copy()).view(self.dtype)).all()):
                        raise CacheCorruptError(f"latent cache field {self.name!r} ({self.path}): item {i}'s value holds "
                                                f"values that are not finite (NaN or inf)")
                    self._verified.add(i)

    def has(self, i: int) -> bool:
        """Whether item ``i`` has a value of this field."""
        return self.present is None or bool(self.present[i])

    def value(self, i: int) -> torch.Tensor:
        """Item ``i``'s value, read with one pread (an item without one: :class:`AbsentValueError`)."""
        if not self.has(i):
            raise AbsentValueError(f"latent cache {self.cache_dir} (split {self.split!r}): item {i} has no value of the "
                                   f"optional field {self.name!r}")
        start, nbytes = int(self.row_starts[i]) * 2, int(self.nbytes[i])
        raw = os.pread(self.fd(), nbytes, start)
        if len(raw) != nbytes:
            raise CacheCorruptError(f"latent cache field {self.name!r} ({self.path}): item {i} reads short")
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if nbytes else torch.zeros(0, dtype=torch.uint8)
        return flat.view(self.dtype).reshape(self.shapes[i].tolist())

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state.update(_source=None, _verified=set())
        return state
