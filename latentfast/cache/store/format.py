"""On-disk format of the latent cache: file names, the meta stamp, layouts, checksums.

A cache for ``split`` in ``cache_dir`` is these files:

- ``{split}.latents.f16.dat``      the latents, float16 (a shaped cache may hold bfloat16 or float32
  instead, under the same name: its meta's ``dtype``). ``padded`` layout: ``[N, C, h, w_max]``, the
  columns past a row's width are zero. ``ragged`` layout: rows ``[C, h, w_i]`` back to back.
- ``{split}.latents.widths.npy``   int32 ``[N]``, each row's real latent width in ``[1, w_max]``.
- ``{split}.latents.meta.json``    the stamp. The nine fields of the original format
  (:data:`SEED_FIELDS`) and, from our writer, ``format_version``, ``layout``, ``dtype``,
  ``encoder`` (identity dict), ``checksum`` and ``complete`` (the completion mark).
- ``{split}.latents.offsets.npy``  ragged only: int64 ``[N + 1]``, element offset of each row.
- ``{split}.latents.white.npy``    float16 ``[C, h, 1]``, the encoder's latent of white paper.
- ``{split}.latents.crc32.npy``    uint32, one CRC-32 per block of ``checksum.block_rows`` rows.
- ``{split}.latents.keys.json``    the source name of each row (a JSON list of strings).
- ``{split}.latents.hashes.npy``   uint8 ``[N, 16]``: BLAKE2b-128 of each row's source bytes.

A ``shaped`` cache (from :class:`~latentfast.cache.LatentCacheWriter`: image buckets,
video clips, imported per-item latents) holds items of any shape, ``[C, h, w]`` or ``[C, T, h, w]``,
back to back, C-contiguous, and instead of the widths file:

- ``{split}.latents.shapes.npy``   int64 ``[N, ndim]``, each item's shape (all share ``ndim`` and ``C``).
- ``{split}.latents.offsets.npy``  int64 ``[N + 1]``, element offset of each item, then the end.
- ``{split}.latents.info.json``    optional, a JSON list of one dict per item (e.g. crop and size).
- ``{split}.latents.index.crc32.npy``  a CRC-32 per block of items of the shapes and offsets (meta ``index_blocks``;
  see :mod:`~latentfast.cache.store.tables`): readers check a block when they first read its items.
- ``{split}.latents.keys.*``        the keys as a mapped table with a sorted hash index (meta ``key_table``;
  see :mod:`~latentfast.cache.store.keytable`): what readers look keys up in, the JSON list kept for older readers.

Its meta has ``layout: "shaped"``, ``ndim`` and ``dtype`` (float16, bfloat16 or float32: the
latents as they were given; offsets count elements of that dtype); its nine original fields hold ``channels``, the
largest ``h`` (``latent_h``) and ``w`` (``w_max``), and null where a field has no meaning
(``line_height``, ``max_line_width``). Its checksum blocks are single items (``block_rows`` 1).

A cache written by other code with only the first three files and the nine fields opens as a
padded cache. The meta file is written last, with an atomic rename: a cache without it is not
a cache (and if build leftovers are present, the error says to re-run the build to resume it).
"""
from __future__ import annotations

import json
import os
import tokenize
import zlib
from typing import Any, Mapping

import numpy as np

from ...errors import ArgumentTypeError, CacheCorruptError, InvalidArgumentError

FORMAT_VERSION = 2  # 2: the shaped layout, keys and content hashes (version-1 caches open unchanged)
LAYOUTS = ("padded", "ragged", "shaped")
LINE_LAYOUTS = ("padded", "ragged")
SEED_FIELDS = (
    "n",
    "channels",
    "latent_h",
    "w_max",
    "pretrained",
    "subfolder",
    "line_height",
    "max_line_width",
    "downscale_factor",
)
# Fields a stamp check compares by default: what determines the latents' values and geometry.
STAMP_FIELDS = SEED_FIELDS + ("encoder",)
CHECKSUM_ALGORITHM = "crc32"
# the latent file's dtypes (name -> bytes per element); line caches are float16, shaped caches any of these.
# Readers address the file in 2-byte units (what the compiled gathers copy): a float32 element is 2 units.
LATENT_DTYPES = {"float16": 2, "bfloat16": 2, "float32": 4}
UNIT_BYTES = 2
CHECKSUM_BLOCK_BYTES = 4 << 20  # a block small enough to stay in cache while verify checks it twice
# the node-local chunk cache's unit (latentfast.cache.remote.chunks): here, beside the format's other sizes,
# so that the samplers size their chunk windows without importing the object-storage side
CHUNK_BYTES = 16 << 10

_SUFFIXES = {
    "data": "latents.f16.dat",
    "widths": "latents.widths.npy",
    "meta": "latents.meta.json",
    "offsets": "latents.offsets.npy",
    "white": "latents.white.npy",
    "checksums": "latents.crc32.npy",
    "progress": "latents.progress",
    "shapes": "latents.shapes.npy",
    "keys": "latents.keys.json",
    "hashes": "latents.hashes.npy",
    "info": "latents.info.json",
    # the mapped key table (see latentfast.cache.store.keytable)
    "key_bytes": "latents.keys.bin",
    "key_offsets": "latents.keys.offsets.npy",
    "key_hashes": "latents.keys.hash.npy",
    "key_rows": "latents.keys.rows.npy",
    "key_crc32": "latents.keys.crc32.npy",
    "index_crc32": "latents.index.crc32.npy",  # block checksums of shapes and offsets (latentfast.cache.store.tables)
}
PARTIAL_SUFFIX = ".partial"


def cache_path(cache_dir: str | os.PathLike, split: str, kind: str) -> str:
    """Path of one of the cache's files; ``kind`` is data, widths, meta, offsets, white,
    checksums, progress, shapes, keys, hashes, info or one of the key table's (key_bytes, key_offsets,
    key_hashes, key_rows, key_crc32) or index_crc32."""
    if kind not in _SUFFIXES:
        raise InvalidArgumentError(f"kind must be one of {sorted(_SUFFIXES)}, got {kind!r}")
    return os.path.join(os.fspath(cache_dir), f"{split}.{_SUFFIXES[kind]}")


def partial_path(path: str) -> str:
    """The temporary name a file is built under before the final rename."""
    return path + PARTIAL_SUFFIX


def build_in_progress(cache_dir: str | os.PathLike, split: str) -> bool:
    """Whether a build of this split was started and has not finished (its leftovers exist)."""
    return os.path.exists(cache_path(cache_dir, split, "progress"))


def resume_command(cache_dir: str | os.PathLike, split: str) -> str:
    """The command whose rerun resumes an interrupted build of this split: ``latentfast cache import``
    when the writer's progress log says it is an import (its header's meta ``kind``), else ``cache build``."""
    meta = progress_meta(cache_dir, split)
    return "latentfast cache import" if meta is not None and meta.get("kind") == "import" else "latentfast cache build"


def progress_meta(cache_dir: str | os.PathLike, split: str) -> dict | None:
    """The meta in the header of this split's progress log (an interrupted build's); None without a readable one."""
    try:
        with open(cache_path(cache_dir, split, "progress"), "rb") as fh:
            head = json.loads(fh.readline(1 << 20) or b"{}")
    except (OSError, ValueError):
        return None
    meta = head.get("meta") if isinstance(head, dict) else None
    return meta if isinstance(meta, dict) else None


def row_elements(meta: Mapping[str, Any]) -> int:
    """Elements of one padded row, ``C * h * w_max``."""
    return int(meta["channels"]) * int(meta["latent_h"]) * int(meta["w_max"])


def ragged_offsets(widths: np.ndarray, channels: int, latent_h: int) -> np.ndarray:
    """int64 ``[N + 1]`` element offsets of rows stored back to back, ``[C, h, w_i]`` each."""
    offsets = np.zeros(len(widths) + 1, dtype=np.int64)
    np.cumsum(np.asarray(widths, dtype=np.int64) * (int(channels) * int(latent_h)), out=offsets[1:])
    return offsets


def shaped_offsets(shapes: np.ndarray) -> np.ndarray:
    """int64 ``[N + 1]`` element offsets of items of ``shapes`` (``[N, ndim]``) stored back to back."""
    shapes = np.asarray(shapes, dtype=np.int64)
    offsets = np.zeros(len(shapes) + 1, dtype=np.int64)
    np.cumsum(np.prod(shapes, axis=1, dtype=np.int64), out=offsets[1:])
    return offsets


def block_row_count(meta: Mapping[str, Any]) -> int:
    """Rows per checksum block: about :data:`CHECKSUM_BLOCK_BYTES` of padded rows."""
    return max(1, CHECKSUM_BLOCK_BYTES // (2 * row_elements(meta)))


def block_bounds(row_starts: np.ndarray, n: int, block_rows: int):
    """Yield ``(block, first_row, end_row, first_element, end_element)`` over the data file.

    ``row_starts`` is int64 ``[N + 1]`` (element offset of each row, then the end)."""
    for b, r0 in enumerate(range(0, n, block_rows)):
        r1 = min(n, r0 + block_rows)
        yield b, r0, r1, int(row_starts[r0]), int(row_starts[r1])


def block_checksums(data: np.ndarray, row_starts: np.ndarray, block_rows: int) -> np.ndarray:
    """CRC-32 of each block of ``block_rows`` rows of the flat float16 ``data``; uint32 ``[blocks]``."""
    n = len(row_starts) - 1
    sums = [zlib.crc32(data[e0:e1]) for _, _, _, e0, e1 in block_bounds(row_starts, n, block_rows)]
    return np.asarray(sums, dtype=np.uint32)


def first_nonfinite(block: np.ndarray, scratch: np.ndarray | None = None, dtype: str = "float16") -> int:
    """Index (in 2-byte units) where the first non-finite value of a flat array of 2-byte units starts,
    or -1; the values are of ``dtype`` (a name of :data:`LATENT_DTYPES`).

    A float is inf/NaN exactly when its exponent bits are all ones; testing the bit pattern is
    several times faster than ``np.isfinite`` (which numpy cannot do for bfloat16 at all)."""
    if dtype == "float32":
        bits, mask, scratch = block.view(np.uint32), 0x7F800000, None
    else:
        bits, mask = block.view(np.uint16), 0x7F80 if dtype == "bfloat16" else 0x7C00
    masked = np.bitwise_and(bits, mask, out=None if scratch is None else scratch[: bits.size])
    if masked.max(initial=0) != mask:
        return -1
    return int(np.argmax(masked == mask)) * (LATENT_DTYPES[dtype] // UNIT_BYTES)


MAX_ROW_ELEMENTS = 1 << 40  # a row (or item) larger than this is a corrupt meta, not a latent


def read_meta(path: str) -> dict:
    """The meta stamp at ``path``, checked: :class:`CacheCorruptError` (a ``ValueError``) names the bad field."""
    with open(path, encoding="utf-8") as fh:
        try:
            meta = json.load(fh)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CacheCorruptError(f"latent cache meta {path} is not valid JSON: {exc}") from None
    if not isinstance(meta, dict):
        raise CacheCorruptError(f"latent cache meta {path} must hold a JSON object, got {type(meta).__name__}")
    missing = [f for f in SEED_FIELDS if f not in meta]
    if missing:
        raise CacheCorruptError(f"latent cache meta {path} lacks the fields {missing}")
    for f in ("n", "channels", "latent_h", "w_max"):
        if not isinstance(meta[f], int) or isinstance(meta[f], bool) or meta[f] < (0 if f == "n" else 1):
            raise CacheCorruptError(f"latent cache meta {path}: {f} must be a {'non-negative' if f == 'n' else 'positive'} integer, got {meta[f]!r}")
    if meta["channels"] * meta["latent_h"] * meta["w_max"] > MAX_ROW_ELEMENTS:
        raise CacheCorruptError(f"latent cache meta {path}: channels * latent_h * w_max = "
                                f"{meta['channels'] * meta['latent_h'] * meta['w_max']} elements per row is not a plausible geometry")
    layout = meta.get("layout", "padded")
    if layout not in LAYOUTS:
        raise CacheCorruptError(f"latent cache meta {path}: layout must be one of {LAYOUTS}, got {layout!r}")
    ndim = meta.get("ndim", 3)
    if layout == "shaped" and (not isinstance(ndim, int) or isinstance(ndim, bool) or not 1 <= ndim <= 8):
        raise CacheCorruptError(f"latent cache meta {path}: ndim must be an integer in [1, 8], got {ndim!r}")
    dtype = meta.get("dtype", "float16")
    if layout != "shaped" and dtype != "float16":
        raise CacheCorruptError(f"latent cache meta {path}: dtype must be 'float16' in a {layout} cache, got {dtype!r}")
    if dtype not in LATENT_DTYPES:
        raise CacheCorruptError(f"latent cache meta {path}: dtype must be one of {sorted(LATENT_DTYPES)}, got {dtype!r}")
    return meta


def checksum_block_rows(meta: Mapping[str, Any], path: str) -> int | None:
    """Rows per checksum block from the meta's ``checksum`` entry (None when the cache has no
    checksums); a malformed entry raises :class:`CacheCorruptError` naming it."""
    checksum = meta.get("checksum")
    if checksum is None:
        return None
    if not isinstance(checksum, Mapping):
        raise CacheCorruptError(f"latent cache meta {path}: checksum must be an object, got {checksum!r}")
    if checksum.get("algorithm") != CHECKSUM_ALGORITHM:
        raise CacheCorruptError(f"latent cache meta {path}: unknown checksum algorithm {checksum.get('algorithm')!r} (expected {CHECKSUM_ALGORITHM!r})")
    block_rows = checksum.get("block_rows")
    if not isinstance(block_rows, int) or isinstance(block_rows, bool) or block_rows < 1:
        raise CacheCorruptError(f"latent cache meta {path}: checksum.block_rows must be a positive integer, got {block_rows!r}")
    return block_rows


def write_bytes_durably(path: str, payload: bytes) -> None:
    """Write ``payload`` to ``path`` through a temporary name, fsync, atomic rename, fsync the folder."""
    tmp = partial_path(path)
    with open(tmp, "wb") as fh:
        fh.write(payload)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path) or ".")


def write_meta(path: str, meta: Mapping[str, Any]) -> None:
    write_bytes_durably(path, (json.dumps(meta, indent=1, sort_keys=True) + "\n").encode("utf-8"))


def npy_bytes(array: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _as_dict(expected: Any) -> dict:
    if isinstance(expected, Mapping):
        return dict(expected)
    for method in ("model_dump", "dict", "_asdict"):  # pydantic v2 / v1 models, namedtuples
        if hasattr(expected, method):
            return dict(getattr(expected, method)())
    raise ArgumentTypeError(f"expected must be a mapping of meta fields (or a model with model_dump), got {type(expected).__name__}")


_MISSING = "<missing>"


def stamp_differences(meta: Mapping[str, Any], expected: Any) -> list[tuple[str, Any, Any]]:
    """``(field, in cache, expected)`` for every field of ``expected`` the cache disagrees with."""
    diffs = []
    for key, want in sorted(_as_dict(expected).items()):
        have = meta.get(key, _MISSING)
        if have != want:
            diffs.append((key, have, want))
    return diffs


def rebuild_command(cache_dir: str, split: str, meta: Mapping[str, Any], expected: Mapping[str, Any]) -> str:
    """The CLI line that rebuilds this cache for the ``expected`` geometry and encoder."""
    want = {**meta, **_as_dict(expected)}
    source = meta.get("source")
    if meta.get("kind") == "import":
        return (f"latentfast cache import {source or '<source dir>'} --out {cache_dir} --split {split} "
                f"--format {meta.get('import_format')}")
    src = f"--manifest {source}" if source and not os.path.isdir(source) else f"--images {source or '<images dir>'}"
    if meta.get("layout") == "shaped":
        video = meta.get("kind") == "video"
        buckets = ",".join("x".join(str(x) for x in b) for b in meta.get("buckets") or []) or "<buckets>"
        return (f"latentfast cache build {src} --out {cache_dir} --split {split} {'--video ' if video else ''}"
                f"--buckets {buckets} --encoder <the expected encoder>")
    return (
        f"latentfast cache build {src} --out {cache_dir} --split {split} --lines "
        f"--line-height {want.get('line_height')} --max-line-width {want.get('max_line_width')} "
        f"--layout {meta.get('layout', 'padded')} --encoder <the expected encoder>"
    )


def load_npy(path: str, what: str, mmap: bool = False) -> np.ndarray:
    """The array at ``path`` (``mmap``: mapped read-only, only its header read); errors name the file."""
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except FileNotFoundError:
        raise FileNotFoundError(f"latent cache {what} file {path} does not exist") from None
    except (ValueError, EOFError, OSError, MemoryError, SyntaxError, tokenize.TokenError) as exc:
        # a damaged header makes numpy's header parser raise tokenize/syntax errors, not ValueError
        raise CacheCorruptError(f"latent cache {what} file {path} is not a valid .npy array: {type(exc).__name__}: {exc}") from None


def load_checksums(cache_dir: str, split: str, n: int, block_rows: int, meta: Mapping[str, Any] | None = None) -> np.ndarray:
    spath = cache_path(cache_dir, split, "checksums")
    sums = load_npy(spath, "checksums")
    blocks = -(-n // block_rows)
    if sums.shape != (blocks,):
        raise CacheCorruptError(f"latent cache checksums {spath} must hold {blocks} entries, got shape {list(sums.shape)}")
    if meta is not None:
        check_recorded(cache_dir, split, meta, ("checksums",))
    return sums


# ---- checksums of the index files: every file of a cache is covered ---------------------------------
def file_crcs(payloads: Mapping[str, bytes | None]) -> dict:
    """``{kind: CRC-32}`` of the index files a publish writes (what the meta's ``files`` records)."""
    return {kind: zlib.crc32(payload) for kind, payload in sorted(payloads.items()) if payload is not None}


def damaged_files(cache_dir: str, split: str, meta: Mapping[str, Any], kinds=None) -> list[str]:
    """One line per index file (of ``kinds``, default all) the meta's ``files`` record names that is
    missing or fails its CRC-32 (empty for caches written before the record existed)."""
    record = meta.get("files") or {}
    if not isinstance(record, Mapping) or not all(isinstance(c, int) and not isinstance(c, bool) for c in record.values()):
        return [f"latent cache meta of {cache_dir} (split {split!r}): files must map file kinds to CRC-32 integers, got {record!r:.200}"]
    problems = []
    for kind, crc in sorted(record.items()):
        if kinds is not None and kind not in kinds:
            continue
        # a record field's index ("text.spans", "text.crc32") is {split}.field.<kind>.npy
        path = cache_path(cache_dir, split, kind) if kind in _SUFFIXES else os.path.join(os.fspath(cache_dir), f"{split}.field.{kind}.npy")
        try:
            with open(path, "rb") as fh:
                actual = 0
                while block := fh.read(CHECKSUM_BLOCK_BYTES):  # (in blocks: a large index file is never read whole)
                    actual = zlib.crc32(block, actual)
        except FileNotFoundError:
            problems.append(f"latent cache {kind} file {path} is missing")
            continue
        if actual != crc:
            problems.append(f"latent cache {kind} file {path} fails its CRC-32 checksum (the meta records {crc}, the file has {actual})")
    return problems


def check_recorded(cache_dir: str, split: str, meta: Mapping[str, Any], kinds) -> None:
    """Raise :class:`CacheCorruptError` naming the first file of ``kinds`` that fails the meta's record:
    damaged, or written by a rebuild after the meta was read."""
    problems = damaged_files(cache_dir, split, meta, kinds)
    if problems:
        raise CacheCorruptError(f"{problems[0]}: damaged, or rewritten by a rebuild after this reader opened the cache "
                                f"(open it again; if it persists, rerun the build to repair it)")
