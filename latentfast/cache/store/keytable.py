"""Keys without a key list: a mapped string table and a sorted hash index, checked block by block.

The writer's finish step writes, beside the JSON key list that older readers read:

- ``{split}.latents.keys.bin``          every key's UTF-8 bytes, back to back, in item order;
- ``{split}.latents.keys.offsets.npy``  int64 ``[N + 1]``: byte offset of each key in ``keys.bin``, then the end;
- ``{split}.latents.keys.hash.npy``     uint64 ``[N]``: :func:`latentfast.sampling.key_hash` of every key, sorted
  (equal hashes by item);
- ``{split}.latents.keys.rows.npy``     int64 ``[N]``: the item of each entry of ``keys.hash.npy``;
- ``{split}.latents.keys.crc32.npy``    uint32: the CRC-32 of each :data:`BLOCK_BYTES` block of the four tables'
  payloads (``keys.bin`` whole, an ``.npy``'s array bytes), the tables in the order above.

and the meta entry ``key_table: {"block_bytes": ...}``. :func:`table_files` makes them from a list of
keys; :func:`write_table_files` from the tables the writer built as it went (the key bytes already
are ``keys.bin``), in bounded memory at any N, byte for byte the same files. A reader maps the four tables (opening costs
the same at any N: nothing is read until a key is asked for) and checks each block against its CRC
the first time it reads from it, in each process: a damaged table raises :class:`CacheCorruptError`
naming the file and block before any wrong key or item is returned. The CRC file is small (4 bytes
per 64 KiB) and is checked whole, against the meta's record, on first use. A lookup is a
step from the block where the key's hash would sit if the hashes were spread evenly (they are: one or two
blocks read at any N), then the candidates' key bytes compared.
A cache in object storage maps sparse local copies of the tables: each block is fetched (``storage.local``,
see :mod:`latentfast.cache.store.tables`) right before its first check, and fetched once more before a
block that fails is refused.
"""
from __future__ import annotations

import hashlib
import os
import zlib

import numpy as np

from ...errors import CacheCorruptError
from ...sampling import key_hash
from . import format as fmt
from .durable import NpyFile, Written

BLOCK_BYTES = 64 << 10  # a block checked on first touch: ~20 us of CRC-32
TABLES = ("key_bytes", "key_offsets", "key_hashes", "key_rows")  # format kinds, in the CRC file's order
CRC_KIND = "key_crc32"
_DTYPES = {"key_bytes": np.uint8, "key_offsets": np.int64, "key_hashes": np.uint64, "key_rows": np.int64}


def _blocks(nbytes: int, block_bytes: int) -> int:
    return -(-nbytes // block_bytes)


def _block_crcs(raw: np.ndarray, block_bytes: int) -> list[int]:
    return [zlib.crc32(raw[b: b + block_bytes]) for b in range(0, raw.size, block_bytes)]


def table_files(keys: list[str]) -> tuple[dict[str, bytes], dict]:
    """``({kind: file bytes}, meta entry)`` of the key table of ``keys`` (what the finish step publishes)."""
    encoded = [k.encode("utf-8") for k in keys]
    offsets = np.zeros(len(keys) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64, count=len(keys)), out=offsets[1:])
    hashes = np.fromiter(map(key_hash, keys), dtype=np.uint64, count=len(keys))
    order = np.argsort(hashes, kind="stable")  # (stable: equal hashes keep item order, the first item first)
    arrays = {"key_bytes": np.frombuffer(b"".join(encoded), dtype=np.uint8), "key_offsets": offsets,
              "key_hashes": hashes[order], "key_rows": order.astype(np.int64)}
    crcs = [c for kind in TABLES for c in _block_crcs(arrays[kind].view(np.uint8), BLOCK_BYTES)]
    files = {kind: (arrays[kind].tobytes() if kind == "key_bytes" else fmt.npy_bytes(arrays[kind])) for kind in TABLES}
    files[CRC_KIND] = fmt.npy_bytes(np.asarray(crcs, dtype=np.uint32))
    return files, {"block_bytes": BLOCK_BYTES}


_KEY_HASH = hashlib.blake2b(digest_size=8, person=b"latentfast.key")  # (copied per key: 3x faster than a new one)


def key_hash_of(encoded: bytes) -> int:
    """:func:`latentfast.sampling.key_hash` of one key given as its UTF-8 bytes."""
    h = _KEY_HASH.copy()
    h.update(encoded)
    return int.from_bytes(h.digest(), "little")


def key_hashes(encoded: list[bytes]) -> np.ndarray:
    """uint64 :func:`latentfast.sampling.key_hash` of each key given as its UTF-8 bytes, at once (the
    writer's bulk path; the same BLAKE2b-64, read little-endian)."""
    digests = []
    for key in encoded:
        h = _KEY_HASH.copy()
        h.update(key)
        digests.append(h.digest())
    return np.frombuffer(b"".join(digests), dtype="<u8").astype(np.uint64)


SORT_CHUNK = 1 << 18  # hashes sorted at once by sort_hashes: ~10 MiB of temporaries
CHECK_CHUNK = 1 << 16  # keys checked at once by KeyTable.check_cuts and check_all: a few MiB of temporaries


def sort_hashes(read, n: int, out_hashes: np.ndarray, out_rows: np.ndarray, chunk: int = SORT_CHUNK) -> None:
    """Fill ``out_hashes`` with the ``n`` hashes that ``read(lo, hi)`` gives (uint64, item order), sorted,
    and ``out_rows`` with each one's item: ``np.argsort(hashes, kind="stable")`` (equal hashes by item) in
    bounded memory. The items are spread into buckets by their hashes' top bits, a chunk at a time in
    item order (so each bucket holds its items in order), then each bucket (about ``chunk`` items:
    the hashes are uniform) is sorted alone; the output arrays may be mapped files."""
    bits = max(0, int(np.ceil(np.log2(max(1.0, n / chunk)))))
    if bits == 0:
        hashes = read(0, n)
        order = np.argsort(hashes, kind="stable")
        out_hashes[:], out_rows[:] = hashes[order], order
        return
    shift, buckets = np.uint64(64 - bits), 1 << bits
    counts = np.zeros(buckets, dtype=np.int64)
    for lo in range(0, n, chunk):
        counts += np.bincount((read(lo, min(n, lo + chunk)) >> shift).astype(np.intp), minlength=buckets)
    starts = np.concatenate([[0], np.cumsum(counts)])
    cursor = starts[:-1].copy()
    for lo in range(0, n, chunk):
        hashes = read(lo, min(n, lo + chunk))
        bucket = (hashes >> shift).astype(np.intp)
        order = np.argsort(bucket, kind="stable")
        ranked = bucket[order]
        at = cursor[ranked] + np.arange(len(ranked)) - np.searchsorted(ranked, ranked, side="left")
        out_hashes[at], out_rows[at] = hashes[order], lo + order
        cursor += np.bincount(bucket, minlength=buckets)
    for b in range(buckets):
        lo, hi = int(starts[b]), int(starts[b + 1])
        hashes = np.asarray(out_hashes[lo:hi])
        order = np.argsort(hashes, kind="stable")
        out_hashes[lo:hi], out_rows[lo:hi] = hashes[order], np.asarray(out_rows[lo:hi])[order]


def write_table_files(out_dir: str, split: str, key_bytes: str, ends, hashes, n: int) -> tuple[dict[str, Written], dict]:
    """``({kind: Written}, meta entry)``: the files of :func:`table_files`, from the writer's tables --
    ``key_bytes`` the path of every key's UTF-8 bytes back to back (fsynced: it becomes ``keys.bin``),
    ``ends`` and ``hashes`` columns (``chunks(rows)``, ``read(lo, hi)``) of each key's end offset and
    key hash -- written at their temporary names (``publish`` renames them into place)."""
    files = {"key_bytes": Written(key_bytes, 0)}
    with NpyFile(fmt.cache_path(out_dir, split, "key_offsets"), np.int64, (n + 1,)) as out:
        out.rows(np.zeros(1, np.int64))
        for _, chunk in ends.chunks(SORT_CHUNK):
            out.rows(chunk)
    files["key_offsets"] = out.written
    mapped = {kind: np.lib.format.open_memmap(fmt.partial_path(fmt.cache_path(out_dir, split, kind)), mode="w+",
                                              dtype=_DTYPES[kind], shape=(n,)) for kind in ("key_hashes", "key_rows")}
    sort_hashes(hashes.read, n, mapped["key_hashes"], mapped["key_rows"])
    for kind, array in mapped.items():
        array.flush()
        files[kind] = Written(array.filename, 0)
    del mapped, array
    crcs = []
    for kind in TABLES:  # each file read back: its CRC-32 (the meta's) and its payload's block CRCs
        start = 0 if kind == "key_bytes" else _npy_header_bytes(files[kind].path)
        whole, blocks = _read_back(files[kind].path, start, BLOCK_BYTES)
        files[kind] = Written(files[kind].path, whole)
        crcs += blocks
    with NpyFile(fmt.cache_path(out_dir, split, CRC_KIND), np.uint32, (len(crcs),)) as out:
        out.rows(np.asarray(crcs, dtype=np.uint32))
    files[CRC_KIND] = out.written
    return files, {"block_bytes": BLOCK_BYTES}


def _npy_header_bytes(path: str) -> int:
    with open(path, "rb") as fh:
        np.lib.format.read_magic(fh)
        np.lib.format.read_array_header_1_0(fh)
        return fh.tell()


def _read_back(path: str, start: int, block_bytes: int) -> tuple[int, list[int]]:
    """``(CRC-32 of the whole file, CRC-32 of each block_bytes block from byte start on)``; the file fsynced."""
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
        head = fh.read(start)
        whole, blocks = zlib.crc32(head), []
        while block := fh.read(block_bytes):
            whole = zlib.crc32(block, whole)
            blocks.append(zlib.crc32(block))
    return whole, blocks


class KeyTable:
    """One opened cache's key table: mapped in each process on first use, checked block by block."""

    def __init__(self, cache_dir: str, split: str, meta: dict, n: int, storage=None):
        self.cache_dir, self.split, self.meta, self.n, self.storage = cache_dir, split, meta, n, storage
        entry = meta["key_table"]
        self.block_bytes = entry.get("block_bytes") if isinstance(entry, dict) else None
        if not isinstance(self.block_bytes, int) or isinstance(self.block_bytes, bool) or self.block_bytes < 8 or self.block_bytes % 8:
            raise CacheCorruptError(f"latent cache meta {fmt.cache_path(cache_dir, split, 'meta')}: key_table must be "
                                    f"{{'block_bytes': a positive multiple of 8}}, got {entry!r}")
        self._maps: dict | None = None

    def __getstate__(self) -> dict:  # a process maps the files for itself
        return {**self.__dict__, "_maps": None}

    # -- mapping ------------------------------------------------------------------------------
    def _map(self) -> dict:
        """``{kind: (array, its bytes, first CRC)}``, mapped once per process; the shapes and the CRC
        file checked (a table of the wrong size, or a CRC file the meta does not record, is refused)."""
        if self._maps is None:
            maps, first = {}, 0
            expected = {"key_offsets": (self.n + 1,), "key_hashes": (self.n,), "key_rows": (self.n,)}
            for kind in TABLES:
                path = fmt.cache_path(self.cache_dir, self.split, kind)
                if self.storage is not None:  # (the .npy header: within the first 4 KiB)
                    self.storage.local([(path, [0], [min(_size(path), 4096)])])
                if kind == "key_bytes":
                    size = _size(path)
                    array = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
                else:
                    array = fmt.load_npy(path, kind, mmap=True)
                    if array.shape != expected[kind] or array.dtype != _DTYPES[kind]:
                        raise CacheCorruptError(f"latent cache {kind} file {path} must be {np.dtype(_DTYPES[kind])} "
                                                f"{list(expected[kind])}, got {array.dtype} {list(array.shape)}")
                raw = array.reshape(-1).view(np.uint8)
                maps[kind] = (array, raw, first)
                first += _blocks(raw.size, self.block_bytes)
            cpath = fmt.cache_path(self.cache_dir, self.split, CRC_KIND)
            if self.storage is not None:
                self.storage.local([(cpath, None, None)])
            crcs = fmt.load_npy(cpath, "key table checksums")
            if crcs.shape != (first,) or crcs.dtype != np.uint32:
                raise CacheCorruptError(f"latent cache key table checksums {cpath} must be uint32 [{first}], got "
                                        f"{crcs.dtype} {list(crcs.shape)}")
            fmt.check_recorded(self.cache_dir, self.split, self.meta, (CRC_KIND,))
            self._crcs, self._verified = crcs, np.zeros(first, dtype=bool)  # (a byte a block: no object per block checked)
            self._maps = maps
        return self._maps

    def _checked(self, kind: str, lo: int, hi: int) -> np.ndarray:
        """Table ``kind``'s elements ``[lo, hi)``, every block under them checked (once per process)."""
        array, raw, first = self._map()[kind]
        bb, size = self.block_bytes, array.itemsize
        todo = [b for b in (range(lo * size // bb, (hi * size - 1) // bb + 1) if hi > lo else ()) if not self._verified[first + b]]
        if self.storage is not None and todo:
            self.storage.local([self._byte_ranges(kind, todo)])
        for b in todo:
            if not self._block_good(kind, b):
                path, (start,), (end,) = self._byte_ranges(kind, [b])
                where = path if self.storage is None else self.storage.where(path, start, end)
                raise CacheCorruptError(f"latent cache {kind} file {where}: block {b} (bytes {b * bb}..{min(raw.size, (b + 1) * bb) - 1}) "
                                        f"fails its CRC-32 checksum; rerun the build to repair it")
            self._verified[first + b] = True
        return array[lo:hi]

    def _byte_ranges(self, kind: str, blocks: list[int]) -> tuple[str, list[int], list[int]]:
        """``(path, byte starts, byte ends)`` in its file of table ``kind``'s ``blocks`` (an .npy's after its header)."""
        array, raw, _first = self._map()[kind]
        at, bb = getattr(array, "offset", 0), self.block_bytes
        return (fmt.cache_path(self.cache_dir, self.split, kind), [at + b * bb for b in blocks],
                [at + min(raw.size, (b + 1) * bb) for b in blocks])

    def _block_good(self, kind: str, b: int) -> bool:
        """Whether block ``b`` of table ``kind`` passes its CRC-32 (in object storage: fetched again, twice, before it fails)."""
        _array, raw, first = self._map()[kind]
        bb = self.block_bytes
        for attempt in range(3 if self.storage is not None else 1):
            if attempt:
                self.storage.refetch([self._byte_ranges(kind, [b])])
            if zlib.crc32(raw[b * bb: (b + 1) * bb]) == int(self._crcs[first + b]):
                return True
        return False

    # -- reading ------------------------------------------------------------------------------
    def key(self, i: int) -> str:
        """Item ``i``'s key (``i`` in range)."""
        lo, hi = (int(x) for x in self._checked("key_offsets", i, i + 2))
        if not 0 <= lo <= hi <= self._map()["key_bytes"][1].size:
            raise CacheCorruptError(f"latent cache key_offsets file {fmt.cache_path(self.cache_dir, self.split, 'key_offsets')}: "
                                    f"item {i}'s key spans bytes {lo}..{hi}, outside the key table")
        raw = self._checked("key_bytes", lo, hi)
        try:
            return raw.tobytes().decode("utf-8")
        except UnicodeDecodeError:
            raise CacheCorruptError(f"latent cache key_bytes file {fmt.cache_path(self.cache_dir, self.split, 'key_bytes')}: "
                                    f"item {i}'s key is not UTF-8") from None

    def keys_of(self, index) -> list[str]:
        """The keys of items ``index`` (in range), in that order."""
        return [self.key(i) for i in np.asarray(index, dtype=np.int64).tolist()]

    def index(self, key: str) -> int | None:
        """The first item whose key is ``key``, or None."""
        if self.n == 0:
            return None
        h = key_hash(key)
        per = self.block_bytes // 8
        last = _blocks(self.n, per) - 1
        # the hashes are uniform: the block where h would sit in a sorted table is about h / 2^64 of the way
        # along (off by ~sqrt(N) entries: under a block of 8,192 up to 10^8 items), then a step at a time to the
        # block holding the first entry >= h -- one or two blocks read and checked at any N, not a binary search's log N
        b = min(last, (h * self.n >> 64) // per)
        block = self._hash_block(b, per)
        while b > 0 and block[0] >= h:  # back, until the block starts below h
            b -= 1
            block = self._hash_block(b, per)
        while b < last and block[-1] < h:  # on, until the block ends at or past h
            b += 1
            block = self._hash_block(b, per)
        j = b * per + int(np.searchsorted(block, np.uint64(h), side="left"))
        while j < self.n and self._checked("key_hashes", j, j + 1)[0] == h:
            row = int(self._checked("key_rows", j, j + 1)[0])
            if not 0 <= row < self.n:
                raise CacheCorruptError(f"latent cache key_rows file {fmt.cache_path(self.cache_dir, self.split, 'key_rows')}: "
                                        f"entry {j} names item {row}, outside [0, {self.n})")
            if self.key(row) == key:
                return row
            j += 1
        return None

    def _hash_block(self, b: int, per: int) -> np.ndarray:
        return self._checked("key_hashes", b * per, min(self.n, (b + 1) * per))

    def all(self) -> list[str]:
        """Every key, in item order (the whole table checked and decoded)."""
        self.check_cuts()
        offsets = self._checked("key_offsets", 0, self.n + 1)
        text = self._checked("key_bytes", 0, self._map()["key_bytes"][1].size).tobytes()
        return [text[a:b].decode("utf-8") for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]

    def check_cuts(self, chunk: int = CHECK_CHUNK) -> None:
        """Check that the offsets cut the key bytes into ``n`` keys and that every key is UTF-8, ``chunk``
        keys at a time (no list of keys, no temporary that grows with N): the offsets start at 0, never
        go back and end at the table's end; each chunk's bytes decode, and no key starts inside a
        character (a continuation byte), so each key decodes alone."""
        raw = self._map()["key_bytes"][1]
        for lo in range(0, self.n, chunk):
            hi = min(self.n, lo + chunk)
            offsets = self._checked("key_offsets", lo, hi + 1)
            if (lo == 0 and offsets[0] != 0) or np.any(offsets[1:] < offsets[:-1]) or (hi == self.n and offsets[-1] != raw.size):
                raise CacheCorruptError(f"latent cache key_offsets file {fmt.cache_path(self.cache_dir, self.split, 'key_offsets')} "
                                        f"does not cut the key table into {self.n} keys")
            text = self._checked("key_bytes", int(offsets[0]), int(offsets[-1]))
            starts = offsets[:-1][offsets[1:] > offsets[:-1]]  # (of the non-empty keys)
            try:
                text.tobytes().decode("utf-8")
                inside = np.flatnonzero(raw[starts] & 0xC0 == 0x80)
            except UnicodeDecodeError:
                inside = [0]
            if len(inside):
                raise CacheCorruptError(f"latent cache key_bytes file {fmt.cache_path(self.cache_dir, self.split, 'key_bytes')} "
                                        f"holds a key that is not UTF-8 (among items {lo}..{hi - 1})")

    def check_all(self) -> None:
        """Check every block of every table (what ``verify`` does), that the hash index is sorted and that
        the offsets cut the key bytes into UTF-8 keys (:meth:`check_cuts`), a chunk at a time."""
        for kind in TABLES:
            array = self._map()[kind][0]
            self._checked(kind, 0, array.size)
        hashes = self._map()["key_hashes"][0]
        for lo in range(0, self.n - 1, CHECK_CHUNK):  # (chunks overlap by one: every neighbouring pair compared)
            pairs = hashes[lo: lo + CHECK_CHUNK + 1]
            if np.any(pairs[1:] < pairs[:-1]):
                raise CacheCorruptError(f"latent cache key_hashes file {fmt.cache_path(self.cache_dir, self.split, 'key_hashes')} is not sorted")
        self.check_cuts()


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        raise FileNotFoundError(f"latent cache key table file {path} does not exist; rerun the build to repair it") from None
