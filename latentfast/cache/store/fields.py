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
import os
import re
import warnings
import zlib

import numpy as np
import torch

from ...errors import AbsentValueError, CacheCorruptError, InvalidArgumentError, NonFiniteError
from . import format as fmt
from .durable import pwrite_all
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


class FieldStore:
    """The writer's side of one field: its partial data file, declared dtype/ndim, and the index of
    stored values by hash (for storing equal values once). ``entries`` lists, in item order, each
    item's log entry, None where the item has no value (an optional field)."""

    def __init__(self, out_dir: str, split: str, name: str):
        self.name = name
        self.path = field_path(out_dir, split, name, "data")
        self.partial = fmt.partial_path(self.path)
        self.fd = -1
        self.end = 0
        self.dtype: str | None = None
        self.ndim: int | None = None
        self.by_hash: dict[bytes, list[tuple[int, int]]] = {}

    def open(self, entries: list[dict], restart: bool) -> bool:
        """Resume from the logged ``entries`` of this field (False: the file cannot back them)."""
        if not restart and entries and not os.path.exists(self.partial):
            with contextlib.suppress(FileNotFoundError):  # a crash inside finish(), after the rename
                os.replace(self.path, self.partial)
        if restart or fmt_size(self.partial) < _needed(entries):
            return False
        self.fd = os.open(self.partial, os.O_RDWR)
        self.rewind(entries)
        return True

    def rewind(self, entries: list[dict]) -> None:
        """Keep exactly the values ``entries`` name: the file cut after the last, the hash index rebuilt."""
        self.end = _needed(entries)
        os.ftruncate(self.fd, self.end)
        self.by_hash, self.dtype, self.ndim = {}, None, None
        for e in _present(entries):
            self._declare(e["d"], len(e["s"]))
            self._remember(bytes.fromhex(e["x"]), e["o"], e["n"])

    def start_over(self) -> None:
        self.close()
        self.fd = os.open(self.partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self.end, self.by_hash, self.dtype, self.ndim = 0, {}, None, None

    def _declare(self, dtype: str, ndim: int) -> None:
        if self.dtype is None:
            self.dtype, self.ndim = dtype, ndim

    def _remember(self, digest: bytes, offset: int, nbytes: int) -> None:
        spots = self.by_hash.setdefault(digest, [])
        if (offset, nbytes) not in spots:
            spots.append((offset, nbytes))

    def check(self, key: str, dtype: str, shape: tuple, first_key: str | None) -> None:
        if self.dtype is not None and (dtype != self.dtype or len(shape) != self.ndim):
            raise InvalidArgumentError(
                f"field {self.name!r} of key {key!r} is {dtype} {len(shape)}-D (shape {list(shape)}), but this cache "
                f"declared it {self.dtype} {self.ndim}-D (first item {first_key!r})")

    def put(self, key: str, dtype: str, shape: tuple, raw: np.ndarray) -> dict:
        """Store one value (or find an equal one already stored); its log entry."""
        self._declare(dtype, len(shape))
        digest = value_hash(raw)
        nbytes = int(raw.nbytes)
        for offset, n in self.by_hash.get(digest, ()):
            if n == nbytes and os.pread(self.fd, n, offset) == raw.tobytes():
                break
        else:
            offset = self.end
            payload = raw if nbytes % 2 == 0 else np.concatenate([raw, np.zeros(1, np.uint8)])
            pwrite_all(self.fd, payload, offset)
            self.end += payload.nbytes
            self._remember(digest, offset, nbytes)
        return {"o": offset, "n": nbytes, "s": list(shape), "c": zlib.crc32(raw), "d": dtype, "x": digest.hex()}

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def verify(self, entries: list[dict]) -> int | None:
        """Index of the first entry whose bytes on disk fail its CRC, else None (each stored value read once)."""
        good: set[tuple[int, int]] = set()
        for i, e in enumerate(entries):
            if e is None:
                continue
            spot = (e["o"], e["n"])
            if spot in good:
                continue
            if zlib.crc32(os.pread(self.fd, e["n"], e["o"])) != e["c"]:
                return i
            good.add(spot)
        return None

    def index_files(self, entries: list[dict | None], optional: bool = False) -> tuple[bytes, bytes, bytes | None, dict]:
        """``(spans .npy, crc .npy, present .npy or None, meta entry)`` of this field for the finished
        cache; the field is optional (a presence file) when ``optional`` or some item has no value."""
        absent = [0] * (2 + self.ndim)
        absent[0] = self.end  # past every stored value: an absent item shares no offset with one
        spans = np.asarray([absent if e is None else [e["o"], e["n"], *e["s"]] for e in entries],
                           dtype=np.int64).reshape(len(entries), 2 + self.ndim)
        crc = np.asarray([0 if e is None else e["c"] for e in entries], dtype=np.uint32)
        meta = {"dtype": self.dtype, "ndim": self.ndim, "logical_bytes": int(spans[:, 1].sum()), "stored_bytes": self.end}
        present = np.asarray([e is not None for e in entries], dtype=bool)
        if not (optional or not present.all()):
            return fmt.npy_bytes(spans), fmt.npy_bytes(crc), None, meta
        meta.update(optional=True, absent=int((~present).sum()))
        return fmt.npy_bytes(spans), fmt.npy_bytes(crc), fmt.npy_bytes(present), meta

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def fmt_size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def _needed(entries: list[dict | None]) -> int:
    """Bytes of the data file that ``entries`` reach (values are padded to even byte counts)."""
    return max((e["o"] + e["n"] + (e["n"] & 1) for e in _present(entries)), default=0)


def _present(entries: list[dict | None]) -> list[dict]:
    """The entries of items that have a value."""
    return [e for e in entries if e is not None]


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
