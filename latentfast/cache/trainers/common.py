"""What every trainer reader shares: the record and source types, item keys, size limits, file reads.

A reader first *scans* a folder (file names, headers, zip directories, sqlite tables, the pickles of
diffusion-pipe's records, whose keys are inside them) into a :class:`Source`: the items it will yield, each
with the bytes it will read, and every file or entry it will not import, with the reason. Iterating
the source then reads one item at a time. Hidden files and folders (``.name``) are not looked at.
"""
from __future__ import annotations

import copy
import gzip
import io
import json
import os
import struct
import tokenize
import zipfile
import zlib
from collections import Counter
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import torch

from ...errors import CacheError
from ..store.writer import check_file_name

# An item whose tensors take more than this many bytes is refused before anything is read: reading
# one holds its tensors in memory -- twice, briefly, for a gzip'd .pt and a diffusion-pipe shard record
# (the bytes read, then the tensors torch.load makes of them); .npz, .safetensors and plain .pt hold them once.
DEFAULT_MAX_ITEM_BYTES = 2 << 30


class TrainerCacheError(CacheError, ValueError):
    """A trainer's cache file is missing, truncated, or holds something other than its trainer writes."""


class Record(NamedTuple):
    """One item: ``fields`` maps a field name to its tensor (own dtype, own shape); ``info`` is JSON-able."""

    key: str
    fields: dict[str, torch.Tensor]
    info: dict


class Skipped(NamedTuple):
    """A file (or an entry, ``path#entry``) that is not imported, and why."""

    path: str
    reason: str


class ItemPlan(NamedTuple):
    base: str  # the source image's stem, relative to the source folder
    variant: str  # tells items of one stem apart (latent size, frame window); "" if none
    nbytes: int  # tensor bytes the item will read
    load: Callable[[], tuple[dict, dict]]  # -> (fields, info)
    lacks: tuple = ()  # Lack entries: the outputs of the trainer this item has no file (or array) of


class Lack(NamedTuple):
    """An output of the trainer one item has none of: ``field`` (a field name, or ``text_*``: every
    text-encoder output) and ``where`` (the file, or ``file#array``, that would hold it)."""

    field: str
    where: str


def lack_matches(field: str, lack: Lack) -> bool:
    """Whether a required ``field`` (a field name; ``text`` for the text-encoder outputs) is what ``lack`` misses."""
    if lack.field.endswith("*"):
        return field == lack.field[:-2] or field.startswith(lack.field[:-1])
    return field == lack.field


class Source:
    """A trainer's cache folder as records; iterate it for :class:`Record` s.

    ``format`` and ``evidence`` say what was read and why it was taken for that trainer;
    ``convention`` describes the latents (``{"latent_convention": "scaled" | "raw" | "pixels" |
    "unknown", "scaling_factor": f | None, "shift_factor": f | None}``) and is stamped into every
    record's info too; ``skipped`` lists what is not imported; :attr:`lacking` the items imported
    without an output other items have (a record without that field); :meth:`summary` says it in
    one line.
    """

    def __init__(self, format: str, root: str, plans: list[ItemPlan], skipped: list[Skipped],
                 convention: dict, evidence: str = "", notes: list[str] | None = None,
                 max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES):
        self.format, self.root, self.evidence = format, root, evidence
        self.convention, self.skipped, self.notes = dict(convention), list(skipped), list(notes or [])
        self.max_item_bytes = int(max_item_bytes)
        self.keys = unique_keys([(p.base, p.variant) for p in plans])
        self._plans = plans

    def __len__(self) -> int:
        return len(self._plans)

    @property
    def lacking(self) -> list[tuple[str, str, str]]:
        """``(key, field, file)`` of each output an item lacks that another item of the folder has (a
        field the import keeps optional): its field (``text_*``: the text-encoder outputs) and the
        file (or ``file#array``) that would hold it."""
        lacked = {lack.field for p in self._plans for lack in p.lacks}
        everywhere = {f for f in lacked if all(any(lack.field == f for lack in p.lacks) for p in self._plans)}
        return [(key, lack.field, lack.where) for key, plan in zip(self.keys, self._plans) for lack in plan.lacks
                if lack.field not in everywhere]

    def lacks(self, field: str) -> list[tuple[str, str]]:
        """``(key, file)`` of every item that has no ``field`` (a field name, or ``text``: the text-encoder
        outputs), as the scan knows before anything is read."""
        return [(key, lack.where) for key, plan in zip(self.keys, self._plans) for lack in plan.lacks if lack_matches(field, lack)]

    @property
    def item_bytes(self) -> list[int]:
        """The tensor bytes each item will read, in the order of :attr:`keys`."""
        return [p.nbytes for p in self._plans]

    def only(self, keys) -> "Source":
        """This source restricted to the items named ``keys`` (in this source's order), each keyed as
        here -- keys are made over the whole folder (:func:`unique_keys`), so a part never renames an
        item -- with the same format, evidence, convention, notes and skipped files (a distributed
        import's share: :mod:`latentfast.cache.builders.distributed`)."""
        wanted = set(keys)
        unknown = wanted.difference(self.keys)
        if unknown:
            raise KeyError(f"{self.root}: the {self.format} source has no item {sorted(unknown)[0]!r}")
        part = copy.copy(self)
        kept = [(k, p) for k, p in zip(self.keys, self._plans) if k in wanted]
        part.keys, part._plans = [k for k, _ in kept], [p for _, p in kept]
        return part

    def __iter__(self) -> Iterator[Record]:
        for key, plan in zip(self.keys, self._plans):
            if plan.nbytes > self.max_item_bytes:
                raise TrainerCacheError(
                    f"item {key!r} of {self.root} holds {plan.nbytes} bytes of tensors, above the limit of "
                    f"{self.max_item_bytes} bytes (max_item_bytes=); raise the limit if the memory is there")
            fields, info = plan.load()
            info = {**info, **{k: v for k, v in self.convention.items() if k not in info}}
            if plan.variant:
                info.setdefault("variant", plan.variant)
            yield Record(key, fields, info)

    def summary(self) -> str:
        """``"kohya: 12 items; skipped 3 files: 2 text-encoder outputs without a latent, 1 ..."``."""
        text = f"{self.format}: {len(self)} items"
        lacking = Counter(field for _, field, _ in self.lacking)
        if lacking:
            text += "; " + ", ".join(f"{n} without {'text-encoder outputs' if f == 'text_*' else f}" for f, n in sorted(lacking.items())) \
                + " (kept as records without that field)"
        if self.skipped:
            reasons = Counter(s.reason for s in self.skipped)
            text += f"; skipped {len(self.skipped)} files: " + ", ".join(f"{n} {r}" for r, n in reasons.most_common())
        for note in self.notes:
            text += f"; {note}"
        return text


def unique_keys(bases_and_variants: list[tuple[str, str]]) -> list[str]:
    """Item keys: the stem alone when it names one item, else ``stem@variant`` for each of its items.

    A variant seen twice for one stem gets ``-2``, ``-3``, ... in order of appearance.
    """
    per_base = Counter(base for base, _ in bases_and_variants)
    keys, seen = [], Counter()
    for base, variant in bases_and_variants:
        key = base if per_base[base] == 1 else f"{base}@{variant or 'item'}"
        seen[key] += 1
        keys.append(key if seen[key] == 1 else f"{key}-{seen[key]}")
    return keys


def rel_key(root: str, folder: str, stem: str) -> str:
    """``stem`` prefixed with ``folder``'s path below ``root``, ``/``-separated."""
    rel = os.path.relpath(folder, root)
    return stem if rel == "." else f"{rel.replace(os.sep, '/')}/{stem}"


def walk_files(root: str) -> Iterator[tuple[str, str]]:
    """``(folder, name)`` of every file under ``root`` in sorted order, hidden entries left out; a name
    that is not valid UTF-8 raises, naming it (keys are made of names)."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            if not name.startswith("."):
                check_file_name(root, os.path.join(folder, name))
                yield folder, name


def check_root(folder) -> str:
    root = os.path.abspath(os.fspath(folder))
    if not os.path.isdir(root):
        raise FileNotFoundError(f"source folder {folder} is not a folder")
    return root


def fail(path: str, expected: str, found: str) -> TrainerCacheError:
    return TrainerCacheError(f"{path}: expected {expected}, found {found}")


# ---------------------------------------------------------------- numpy arrays

def array_to_tensor(array: np.ndarray, path: str, name: str) -> torch.Tensor:
    """A tensor of ``array``'s dtype; 2-byte void arrays (bfloat16 bits saved by numpy) become bfloat16."""
    if array.dtype.kind == "V" and array.dtype.itemsize == 2 and array.dtype.fields is None:
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    if array.dtype.kind not in "biuf":
        raise fail(f"{path}#{name}", "a numeric array", f"dtype {array.dtype.str}")
    return torch.from_numpy(np.ascontiguousarray(array))


def npz_member_bytes(path: str) -> dict[str, int]:
    """Uncompressed size of each array of an ``.npz`` (from the zip directory), each array's ``.npy`` header
    checked against it: a header whose shape and dtype need other than the bytes stored (a damaged array, or
    one claiming a huge shape, which numpy would allocate before finding the data short) raises naming
    ``path#array``. Only the headers are read."""
    try:
        with zipfile.ZipFile(path) as archive:
            sizes = {}
            for info in archive.infolist():
                if info.filename.endswith(".npy"):
                    sizes[info.filename[:-4]] = info.file_size
                    _check_npy_header(archive, info, f"{path}#{info.filename[:-4]}")
            return sizes
    except zipfile.BadZipFile:
        raise fail(path, "an .npz (zip) archive", truncated_or(path, "not a zip archive")) from None


def _check_npy_header(archive: zipfile.ZipFile, info: zipfile.ZipInfo, where: str) -> None:
    """The array bytes an ``.npy`` member's header declares equal the bytes stored after it."""
    try:
        with archive.open(info) as fh:
            version = np.lib.format.read_magic(fh)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(fh)
            header = fh.tell()
    except (ValueError, OSError, EOFError, SyntaxError, tokenize.TokenError, zipfile.BadZipFile) as exc:  # (numpy's parser)
        raise fail(where, "an .npy array (magic and header)", f"{type(exc).__name__}: {exc}") from None
    if dtype.hasobject:
        return  # (object arrays are refused when read: allow_pickle=False)
    declared = int(np.prod(shape, dtype=object)) * dtype.itemsize
    if declared != info.file_size - header:
        raise fail(where, f"{declared} bytes of array data (its header's shape {list(shape)}, dtype {dtype.str})",
                   f"{info.file_size - header} bytes: a damaged array")


def truncated_or(path: str, what: str) -> str:
    """``"a truncated file (N bytes)"`` if ``path`` starts as a zip but has no zip end record, else ``what``."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(4)
        fh.seek(max(0, size - 65557))
        tail = fh.read()
    if head == b"PK\x03\x04" and b"PK\x05\x06" not in tail:
        return f"a truncated file ({size} bytes: the zip directory at its end is missing)"
    return what


# ---------------------------------------------------------------- safetensors

def safetensors_header(path: str) -> tuple[dict[str, tuple[str, list[int], int]], dict]:
    """``({name: (dtype, shape, nbytes)}, metadata)`` from a ``.safetensors`` header, no tensor read."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise fail(path, "a safetensors file", f"a truncated file ({size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise fail(path, f"a safetensors header of {n} bytes", f"a truncated file ({size} bytes)")
        try:
            header = json.loads(fh.read(n))
        except ValueError:
            raise fail(path, "a safetensors file (JSON header)", "bytes that are not JSON") from None
    metadata = header.pop("__metadata__", None) or {}
    entries, end = {}, 0
    try:
        for name, spec in header.items():
            start, stop = spec["data_offsets"]
            entries[name] = (spec["dtype"], list(spec["shape"]), stop - start)
            end = max(end, stop)
    except (KeyError, TypeError, ValueError):
        raise fail(path, "a safetensors header (dtype, shape, data_offsets per tensor)", f"entry {name!r}: {spec!r}") from None
    if 8 + n + end > size:
        raise fail(path, f"{8 + n + end} bytes (header and tensors)", f"a truncated file ({size} bytes)")
    return entries, metadata


def load_safetensors(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(path, device="cpu")
    except Exception as exc:  # noqa: BLE001 - named by file
        safetensors_header(path)  # a truncated file is named as such, not as a parse error
        raise fail(path, "a safetensors file", f"{type(exc).__name__}: {exc}") from None


# ---------------------------------------------------------------- torch.save files

GZIP_MAGIC = b"\x1f\x8b"


def pt_nbytes(path: str) -> int:
    """The bytes a ``.pt`` takes once read: its size, or if gzip'd the size its last gzip member says it
    inflates to (mod 4 GiB; a file of several members inflates to more). A planning figure only: what a
    gzip'd file really inflates to is judged while it inflates (:func:`load_pt`'s ``max_bytes``)."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        if fh.read(2) != GZIP_MAGIC or size < 18:
            return size
        fh.seek(size - 4)
        (isize,) = struct.unpack("<I", fh.read(4))
    return max(isize, size)


def load_pt_bytes(data: bytes | memoryview, where: str) -> Any:
    """``torch.load`` of a whole ``torch.save`` payload with ``weights_only=True`` (no code runs)."""
    _check_zip_whole(data, where)
    return _torch_load(io.BytesIO(data), where)


def _check_zip_whole(data: bytes | memoryview, where: str) -> None:
    if bytes(data[:4]) == b"PK\x03\x04" and b"PK\x05\x06" not in bytes(data[-65557:]):
        raise fail(where, "a torch.save file", f"a truncated one ({len(data)} bytes: the zip directory at its end is missing)")


def _torch_load(file, where: str, mmap: bool = False) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as exc:  # noqa: BLE001 - named by file
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "Weights only load failed" in str(exc):
            first = "objects other than tensors, dicts, lists and plain values (refused: loading them would run code)"
        raise fail(where, "a torch.save file of tensors", first) from None


INFLATE_CHUNK = 1 << 20


def load_pt(path: str, max_bytes: int | None = None, item_limit: int | None = None) -> Any:
    """A ``.pt`` written by ``torch.save``, gzip'd or not (SimpleTuner's ``compress_disk_cache`` keeps ``.pt``).

    A plain (zip) file is memory-mapped, so reading it holds its tensors once; a gzip'd one is
    inflated in memory first (its bytes, then its tensors), every gzip member of it, a chunk at a time:
    one that inflates to more than ``max_bytes`` is refused once it has, whatever its size fields say
    (``item_limit``: the item's ``max_item_bytes``, named in the error; default ``max_bytes``)."""
    with open(path, "rb") as fh:
        head = fh.read(4)
    if not head:
        raise fail(path, "a torch.save file", "an empty file")
    if head[:2] != GZIP_MAGIC:
        truncated = truncated_or(path, "")
        if truncated:
            raise fail(path, "a torch.save file", truncated.replace("a truncated file", "a truncated one"))
        return _torch_load(path, path, mmap=head == b"PK\x03\x04")
    inflated = io.BytesIO()
    try:
        with gzip.open(path, "rb") as fh:
            while chunk := fh.read(INFLATE_CHUNK):
                inflated.write(chunk)
                if max_bytes is not None and inflated.tell() > max_bytes:
                    raise TrainerCacheError(
                        f"{path}: a gzip'd .pt that inflates to more than {max_bytes} bytes (stopped there), more than its "
                        f"item may take (max_item_bytes={max_bytes if item_limit is None else item_limit}); raise the "
                        f"limit if the memory is there")
    except EOFError:
        raise fail(path, "a gzip'd torch.save file", f"a truncated one ({os.path.getsize(path)} bytes: the gzip stream ends early)") from None
    except (OSError, gzip.BadGzipFile, zlib.error) as exc:
        raise fail(path, "a gzip'd torch.save file", f"a corrupt gzip stream ({exc})") from None
    with inflated.getbuffer() as view:
        _check_zip_whole(view, path)
    inflated.seek(0)
    return _torch_load(inflated, path)


def split_tensors(obj: dict, where: str) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors, plain values)`` of a loaded dict; 0-d tensors count as plain values (their Python scalar)."""
    tensors, plain = {}, {}
    for name, value in obj.items():
        if not isinstance(name, str):
            raise fail(where, "a dict with string keys", f"key {name!r}")
        if isinstance(value, torch.Tensor):
            if value.dim() == 0:
                plain[name] = value.item()
            else:
                tensors[name] = value
        else:
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                raise fail(f"{where}#{name}", "a tensor or a JSON-able value", f"a {type(value).__name__}") from None
            plain[name] = value
    return tensors, plain
