"""Where every item's bytes live: row starts of each layout, and the span table of one batch that the read path consumes.

A cache's data file is its latents back to back, addressed in 2-byte units (a float16 or bfloat16
element is one unit, a float32 element two: the compiled gathers copy units and the read path views
them in the cache's dtype); ``row_starts[i]`` (unit offsets, one entry per item plus the end) says
where item ``i`` begins. The layouts differ only in how an item
is cut into "lines" for the compiled gather (``lines`` lines of ``widths[i]`` real elements,
``pitch`` elements apart) and in what a batch must share:

- ``padded`` (the specification's seed-compatible layout): every row ``[C, h, w_max]``, lines
  ``w_max`` apart, the real ``widths[i]`` columns first;
- ``ragged``: row ``i`` is ``[C, h, widths[i]]``, no padding stored (``pitch`` 0: a line is as long
  as its row is wide);
- ``shaped`` (image buckets, video): item ``i`` has its own shape, stored C-contiguous; for the
  gather it is one line of ``prod(shape)`` elements, and a batch must hold items of one shape.

:func:`resolve` turns "these items" into a :class:`SpanTable` once per batch (indices converted
once); every later step (checksum checks, cold-read advice, the CPU gather, pinned staging) reads
that table and none goes back to the cache object for geometry.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import warnings
import zlib

import numpy as np
import torch

from ...checks import as_row_indices, batch_width, check_out_tensor
from ...errors import ArgumentTypeError, CacheCorruptError, InvalidArgumentError
from . import format as fmt

ELEMENT_BYTES = fmt.UNIT_BYTES  # what the gathers copy: a float16 element, half a float32 one
_CPU = torch.device("cpu")
_INT32_MAX = np.iinfo(np.int32).max


# ---- row starts: the one place item offsets are computed -------------------------------------------
def row_starts(layout: str, n: int, *, channels: int = 0, latent_h: int = 0, w_max: int = 0, widths=None,
               shapes=None, dtype: str = "float16") -> np.ndarray:
    """int64 ``[n + 1]`` unit offsets of every item of a cache of this layout (the last: the end)."""
    if layout == "shaped":
        return fmt.shaped_offsets(shapes) * (fmt.LATENT_DTYPES[dtype] // fmt.UNIT_BYTES)
    if layout == "ragged":
        return fmt.ragged_offsets(widths, channels, latent_h)
    return np.arange(n + 1, dtype=np.int64) * (int(channels) * int(latent_h) * int(w_max))


# ---- one opened cache's items, as the read path sees them ----------------------------------------
class Items:
    """What the read path needs of an opened cache, as plain attributes (so reading a batch never
    goes back into the reader): geometry, widths and shapes, row starts, the white column, whether
    rows are verified, and the data file, opened and mapped on first use in each process.

    Built by :class:`~latentfast.cache.LatentCache` when it opens a cache (and again in each process
    that unpickles it); the cache's own reads (``cache[i]``, verify) share its map and descriptor."""

    def __init__(self, cache, source=None, files: CacheFiles | None = None):
        self._source = source  # a wrapper's own gather_source(), else None: this object maps the file
        self.cache_dir, self.split, self.meta = cache.cache_dir, cache.split, cache.meta
        self.path = fmt.cache_path(cache.cache_dir, cache.split, "data")
        self.files = files or CacheFiles(self.cache_dir, self.split, self.meta, [self.path], getattr(cache, "_data_identity", None))
        self.n, self.shaped, self.verify_rows = len(cache), cache.shaped, cache.verify_rows
        self.channels, self.latent_h, self.w_max = cache.channels, cache.latent_h, cache.w_max
        # (a reader's own tables, not its whole-table views: the read path checks the blocks it reads, index_checks)
        own = getattr(cache, "__dict__", {})
        self.widths, self.row_starts = (own["_" + k] if "_" + k in own else getattr(cache, k) for k in ("widths", "row_starts"))
        self.white = cache.white_column
        # a cache's own mapped shapes (their blocks checked as items are read: index_checks), else a cache-like object's
        self.shapes = (cache._shapes if hasattr(cache, "_index_blocks") else cache.shapes) if cache.shaped else None
        self.index_checks = getattr(cache, "_index_blocks", None)
        self.dtype = getattr(cache, "dtype", torch.float16)  # the stored latents' dtype: the gathered units are viewed as it
        self.pitch = self.w_max if cache.layout == "padded" else 0
        self.remote = getattr(cache, "remote", None)  # a cache in object storage: see holding()
        self.row_ends = None
        self._fd: int | None = None
        self._mm: np.ndarray | None = None
        self._data: torch.Tensor | None = None
        self._whole: tuple | None = None  # source(): every item's offsets and widths
        self._block_checks: BlockChecks | None = None
        self._stamp = (-1, -1)  # (size, mtime_ns) of the data file when this process opened it

    def fd(self) -> int:
        """This process's descriptor of the data file: what every read of it goes through (``cache[i]``'s
        preads and the batch gathers' map alike). Opened lazily, in each process, with the cache's
        other data files (see :class:`CacheFiles`)."""
        if self._fd is None:
            fd = self.files.fd(self.path)
            st = os.fstat(fd)
            self._fd, self._stamp = fd, (st.st_size, st.st_mtime_ns)
        return self._fd

    def memmap(self) -> np.ndarray:
        """The whole data file as a flat read-only array of 2-byte units (numpy float16), opened once per process."""
        if self._mm is None:
            self._mm = map_units(self.fd(), int(self.row_starts[-1]))
        return self._mm

    def check_unchanged(self) -> None:
        """Raise :class:`CacheCorruptError` if the mapped data file no longer has its size (one fstat):
        reading a page past a truncated file's end would kill the process with SIGBUS."""
        if self._fd is None:
            return
        st = os.fstat(self._fd)
        size, expected = st.st_size, int(self.row_starts[-1]) * 2
        if size != expected:
            raise CacheCorruptError(
                f"latent cache data file {self.path} changed size under this reader ({expected} bytes when opened, "
                f"{size} now): it was truncated or rewritten in place; rebuild the cache or reopen it"
            )
        if st.st_mtime_ns != self._stamp[1] and self.remote is None:  # written in place (a repair rebuild): not the bytes the index describes
            raise CacheCorruptError(
                f"latent cache data file {self.path} was modified under this reader (a rebuild repairing it in "
                f"place?): open the cache again once the rebuild has finished"
            )

    def source(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``(data, row_offsets, widths, pitch)`` over every item, for the compiled gathers (see
        :meth:`latentfast.cache.LatentCache.gather_source`); checks the file size first. A shaped cache's
        ``widths`` (each item's units) is a table of 4 bytes an item made on the first call: a batch
        reads through :meth:`batch_source` instead."""
        if self._source is not None:
            return self._source()
        if self._whole is None:
            with warnings.catch_warnings():  # torch warns that a shaped cache's mapped offsets are not writable
                warnings.simplefilter("ignore", UserWarning)
                row_offsets = torch.from_numpy(np.ascontiguousarray(self.row_starts[:-1]))
            if self.shaped and self.index_checks is not None:  # filled block by block as the blocks are checked
                widths = self.index_checks.unit_counts()
            elif self.shaped:
                widths = self._unit_counts(self.row_starts[:-1], self.row_starts[1:])
            else:
                widths = np.ascontiguousarray(self.widths)
            self._whole = (self._data_tensor(), row_offsets, torch.from_numpy(widths), self.pitch)
        self.check_unchanged()
        return self._whole

    def batch_source(self, index: torch.Tensor, index_np: np.ndarray) -> tuple[tuple, torch.Tensor]:
        """``(source, rows)`` for a batch of the items ``index``: what the gathers copy from and the rows of
        it they copy. A shaped cache's (the items in range, their index blocks checked) is a source of just
        these items -- their unit offsets and sizes, ``B`` entries read from the mapped offsets -- and rows
        ``0 .. B-1``, so a batch costs the same at any N; a line cache's and a wrapper's (``_source``) is
        :meth:`source` and ``index``."""
        if self._source is not None or not self.shaped:
            return self.source(), index
        starts = np.asarray(self.row_starts[index_np], dtype=np.int64)
        sizes = self._unit_counts(starts, self.row_starts[index_np + 1])
        data = self._data_tensor()
        self.check_unchanged()
        return (data, torch.from_numpy(starts), torch.from_numpy(sizes), self.pitch), torch.arange(len(index_np))

    def _data_tensor(self) -> torch.Tensor:
        """The whole data file as a flat float16 tensor over this process's map (made once)."""
        if self._data is None:
            with warnings.catch_warnings():  # torch warns that the map is not writable
                warnings.simplefilter("ignore", UserWarning)
                self._data = torch.from_numpy(self.memmap())
        return self._data

    def _unit_counts(self, starts, ends) -> np.ndarray:
        """int32 units from ``starts`` to ``ends`` (items' offsets): what the gathers take as a shaped item's width."""
        numel = np.asarray(ends, dtype=np.int64) - starts
        if numel.size and numel.max() > _INT32_MAX:
            raise InvalidArgumentError(f"latent cache {self.cache_dir}: an item of {int(numel.max()) * 2} bytes is too large for the batch gather (int32 widths of 2-byte units)")
        return numel.astype(np.int32)

    @property
    def block_checks(self) -> BlockChecks:
        """This process's record of the checksum blocks (``InvalidArgumentError`` if the cache stores none)."""
        if self._block_checks is None:
            if self.remote is not None:  # (a cache in object storage: the checksums, all of them)
                self.remote.local([(fmt.cache_path(self.cache_dir, self.split, "checksums"), None, None)])
            self._block_checks = BlockChecks(self.cache_dir, self.split, self.meta, self.n)
        return self._block_checks

    def __getstate__(self) -> dict:  # a process maps the file for itself
        state = self.__dict__.copy()
        state.update(_fd=None, _mm=None, _data=None, _whole=None, _block_checks=None)
        return state


class CacheFiles:
    """One opened cache's data files (the latents' and each field's) as this process reads them: opened
    together on the first read of any, under one check that the cache is still the generation it was
    opened as -- its meta unchanged and (``identity``: ``(st_dev, st_ino)`` of the latents' file when
    the index was checked) the same file -- and read through these descriptors only. So every read
    path of a reader reads the one generation, even after the folder is deleted or rebuilt, or (a
    process that opens them after that) every one raises."""

    def __init__(self, cache_dir: str, split: str, meta: dict, paths: list[str], identity=None):
        self.cache_dir, self.split, self.meta, self.paths, self.identity = cache_dir, split, meta, list(paths), identity
        self._fds: dict[str, int] | None = None

    def fd(self, path: str) -> int:
        if self._fds is None:
            self._fds = self._open()
        return self._fds[path]

    def _open(self) -> dict[str, int]:
        meta_path = fmt.cache_path(self.cache_dir, self.split, "meta")
        fds: dict[str, int] = {}
        try:
            for path in self.paths:
                with contextlib.suppress(FileNotFoundError):
                    fds[path] = os.open(path, os.O_RDONLY)
            try:
                current = fmt.read_meta(meta_path)
            except (OSError, CacheCorruptError):
                current = None
            first = os.fstat(fds[self.paths[0]]) if self.paths[0] in fds else None
            if current != self.meta or len(fds) != len(self.paths) or (
                    self.identity is not None and (first.st_dev, first.st_ino) != tuple(self.identity)):
                raise CacheCorruptError(
                    f"latent cache {self.cache_dir} (split {self.split!r}) was rebuilt after this reader opened it (its "
                    f"meta {meta_path} or a data file was replaced or is gone): its index does not describe the files "
                    f"now; open the cache again")
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        return fds

    def __getstate__(self) -> dict:  # each process opens the files for itself
        return {**self.__dict__, "_fds": None}

    def __del__(self) -> None:
        for fd in (getattr(self, "_fds", None) or {}).values():
            os.close(fd)
        self._fds = None


def map_units(fd: int, units: int) -> np.ndarray:
    """The first ``units`` 2-byte units of the open file ``fd``, memory-mapped read-only (numpy float16):
    mapped through the descriptor, never the path, which may name another file by now."""
    if units == 0:
        return np.zeros(0, dtype=np.float16)
    return np.frombuffer(mmap.mmap(fd, 2 * units, prot=mmap.PROT_READ), dtype=np.float16, count=units)


# ---- the span table ---------------------------------------------------------------------------------
class SpanTable:
    """One batch's items as the read path sees them: which elements of which file to copy.

    ``index`` (int64 CPU tensor) and ``index_np`` (its numpy view) name the items; ``widths`` (int32
    ``[B]``) each item's real elements per line; ``lines`` the lines per item; ``pitch`` the elements
    between lines (0: an item's own width); ``width`` the batch's W (a shaped batch: elements per
    item); ``w_max`` the widest line any item of the cache may have (what a staging buffer is sized
    for); ``white`` the float16 ``[C, h, 1]`` padding column or None; ``shape``/``shapes`` a shaped
    batch's item shape and ``[B, ndim]`` shapes (None for line caches); ``checked`` whether the
    indices were range-checked here (if not, the kernel checks each before copying). ``source`` is
    the ``(data, row_offsets, widths, pitch)`` the gathers copy from and ``rows`` (int64 tensor ``[B]``) the
    rows of it they copy: the cache's whole tables and ``index``, or (a shaped cache: see
    :meth:`Items.batch_source`) the batch's items' own and ``0 .. B-1``. ``row_starts`` is the cache's item offsets (item
    ``i``'s bytes in ``cache.path`` are ``[2 * row_starts[i], 2 * row_starts[i + 1])``, its checksum
    block ``i // block_rows``). ``row_ends`` is None, or (a field's table, where items sharing a
    value share its bytes) each item's end, in the same units as ``row_starts``."""

    __slots__ = ("cache", "source", "rows", "row_starts", "row_ends", "index", "index_np", "widths", "lines", "channels", "latent_h",
                 "pitch", "width", "w_max", "white", "shape", "shapes", "checked")


def resolve(cache: Items, indices, *, width=None, clip: bool = False, out=None, dtype=torch.float16,
            device=_CPU) -> SpanTable:
    """The :class:`SpanTable` of rows ``indices`` of an opened cache's :class:`Items`.

    ``clip``: a plain int64 vector of a line cache is not range-checked here (its widths are read
    clipped into range; the kernel checks every index before copying, and :func:`recheck` names a
    bad one if sizing fails first) -- a batch of small rows costs tens of microseconds, so the hot
    CPU path is kept to one conversion. Any other input, a shaped cache and ``clip=False`` get the
    full check (:func:`latentfast.checks.as_row_indices`: IndexError naming the first bad index).
    A cache opened with ``verify_rows`` has the batch's checksum blocks checked first. ``out`` (if
    given) must be the batch's exact output: ``[B, C, h, W]`` (a shaped cache: ``[B, *shape]``) of
    ``dtype`` on ``device``."""
    table = SpanTable()
    table.cache = cache
    table.row_starts, table.white, table.row_ends = cache.row_starts, cache.white, None
    index, index_np = _as_int64_vector(indices) if clip and not cache.shaped else (None, None)
    table.checked = index is None
    if index is None:
        index = as_row_indices(indices, cache.n)
        index_np = index.numpy()
    table.index, table.index_np = index, index_np
    if getattr(cache, "index_checks", None) is not None:  # the blocks of the batch's shapes and offsets, before they are read
        cache.index_checks.check(index_np)
    if cache.verify_rows:  # before any other check of the batch: a damaged block is the news
        cache.block_checks.check(cache, table.row_starts, index_np)
    table.source, table.rows = cache.batch_source(index, index_np) if isinstance(cache, Items) else (cache.source(), index)
    table.pitch = int(table.source[3])
    if cache.shaped:
        _resolve_shaped(table, cache, width)
    else:
        _resolve_lines(table, cache, width)
    if out is not None:
        shape = (index.numel(), *table.shape) if cache.shaped else (index.numel(), table.channels, table.latent_h, table.width)
        try:
            check_out_tensor("out", out, shape, dtype, device)
        except (TypeError, ValueError):  # a bad index, if any, is the error to report
            recheck(table)
            raise
    return table


def recheck(table: SpanTable) -> None:
    """Raise IndexError naming the first bad index of an unchecked table (else return)."""
    if not table.checked:
        as_row_indices(table.index, table.cache.n)


def _resolve_lines(table: SpanTable, cache, width) -> None:
    table.channels, table.latent_h = cache.channels, cache.latent_h
    table.lines, table.w_max = table.channels * table.latent_h, cache.w_max
    table.shape = table.shapes = None
    try:
        table.widths = selected_widths(cache.widths, table.index_np, clip=not table.checked)
        widest = int(table.widths.max()) if table.widths.size else 0
        table.width = widest if width is None and table.white is not None else checked_width(table.white, table.widths, width)
    except (TypeError, ValueError, IndexError):  # from clipped indices: a bad index, if any, is the error to report
        recheck(table)
        raise


def _resolve_shaped(table: SpanTable, cache, width) -> None:
    if width is not None:
        raise InvalidArgumentError(f"width applies to line caches only; a shaped cache's batch has its items' shape, got width={width!r}")
    table.shape, table.shapes = batch_shape(cache.shapes, table.index_np)
    table.channels = table.latent_h = table.lines = 1  # each item one line of all its units
    units = fmt.LATENT_DTYPES[str(cache.dtype).removeprefix("torch.")] // fmt.UNIT_BYTES
    table.width = table.w_max = int(np.prod(table.shape)) * units if table.shape else 0
    table.widths = table.source[2].numpy()[table.rows.numpy()]
    table.white = None


def _as_int64_vector(indices):
    """``(tensor, array)``: ``indices`` as a contiguous 1-D int64 CPU tensor and a numpy view of it,
    when that is cheap (a list of ints, an int64 numpy array or CPU tensor), else ``(None, None)``
    (anything else takes the full conversion)."""
    if isinstance(indices, torch.Tensor):
        if indices.dtype == torch.int64 and indices.dim() == 1 and indices.device.type == "cpu":
            index = indices.detach().contiguous()
            return index, index.numpy()
        return None, None
    array = np.asarray(indices)
    if array.dtype == np.int64 and array.ndim == 1:
        array = np.ascontiguousarray(array)
        return torch.from_numpy(array), array
    return None, None


def selected_widths(widths, index_np: np.ndarray, clip: bool) -> np.ndarray:
    """int32 widths of rows ``index_np`` (indices clipped into range when ``clip``: the kernel reports
    bad ones). Widths that do not fit int32 are refused, never truncated."""
    if widths.__class__ is not np.ndarray:
        widths = np.asarray(widths)
    if widths.size == 0 and index_np.size:
        raise IndexError("indices given for a cache of 0 rows")
    selected = widths.take(index_np, mode="clip") if clip else widths[index_np]
    if selected.dtype != np.int32:
        if selected.dtype.kind not in "iu":
            raise ArgumentTypeError(f"cache.widths must hold integers, got {widths.dtype}")
        if selected.size and (int(selected.min()) < 0 or int(selected.max()) > _INT32_MAX):
            bad = int(np.flatnonzero((selected < 0) | (selected > _INT32_MAX))[0])
            raise InvalidArgumentError(
                f"cache.widths[{int(index_np[bad])}] = {int(selected[bad])} is outside [0, 2**31 - 1]: not a latent width"
            )
        selected = selected.astype(np.int32)
    return selected


def checked_width(white, selected_np, width) -> int:
    """W of the batch: ``width`` (an int >= the widest selected row) or that widest row; the white
    column must exist if any row is narrower than W."""
    W = batch_width(selected_np, width)
    if white is None and bool((selected_np < W).any()):
        raise InvalidArgumentError(
            "this batch needs padding but the cache has no white column; pass white_column= when opening the cache"
        )
    return W


def batch_shape(all_shapes: np.ndarray, index: np.ndarray) -> tuple[tuple[int, ...], np.ndarray]:
    """``(shape, shapes [B, ndim])`` of the items ``index``; raises naming the shapes if they differ."""
    shapes = np.ascontiguousarray(all_shapes[index])
    if len(shapes) == 0:
        return (), shapes
    differs = np.any(shapes != shapes[0], axis=1)
    if differs.any():
        kinds, first = np.unique(shapes, axis=0, return_index=True)
        listed = ", ".join(f"{kinds[k].tolist()} (e.g. indices[{int(first[k])}] = {int(index[first[k]])})"
                           for k in np.argsort(first)[:6])
        raise InvalidArgumentError(
            f"a batch of a shaped cache must hold items of one shape; indices name {len(kinds)} shapes: {listed}. "
            f"Batch with ShapeBucketBatchSampler(cache.shapes, ...)"
        )
    return tuple(int(x) for x in shapes[0]), shapes


# ---- checksum blocks --------------------------------------------------------------------------------
class BlockChecks:
    """One opened cache's checksum blocks (``block_rows`` items each, CRC-32) and which of them this
    process has verified; what ``verify_rows`` consults before a read."""

    def __init__(self, cache_dir: str, split: str, meta: dict, n: int):
        self.data_path = fmt.cache_path(cache_dir, split, "data")
        self.block_rows = fmt.checksum_block_rows(meta, fmt.cache_path(cache_dir, split, "meta"))
        if self.block_rows is None:
            raise InvalidArgumentError(f"verify_rows: latent cache {cache_dir} (split {split!r}) stores no checksums")
        self.sums = fmt.load_checksums(cache_dir, split, n, self.block_rows, meta)
        self.n = n
        self.verified: set[int] = set()

    def check(self, items: Items, starts: np.ndarray, index_np: np.ndarray) -> None:
        """Check every block holding items ``index_np`` (in range) of ``items``' data file once;
        :class:`CacheCorruptError` names the first failing block. The file's size is checked before
        the map is read (a block past a truncated end would be SIGBUS)."""
        blocks = np.unique(np.asarray(index_np, dtype=np.int64) // self.block_rows).tolist()
        todo = [b for b in blocks if b not in self.verified]
        if not todo:
            return
        data = items.memmap()
        items.check_unchanged()
        for block in todo:
            r0, r1 = block * self.block_rows, min(self.n, (block + 1) * self.block_rows)
            with holding(items, [2 * int(starts[r0])], [2 * int(starts[r1])]):
                if zlib.crc32(data[int(starts[r0]) : int(starts[r1])]) != int(self.sums[block]):
                    raise CacheCorruptError(f"latent cache {self.data_path}: block {block} (rows {r0}..{r1 - 1}) fails its CRC-32 checksum")
            self.verified.add(block)


# ---- caches in object storage: bytes read only while held ------------------------------------------
def item_spans(items, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(byte starts, byte ends)`` of items ``index`` (in range) of an :class:`Items` or a field's
    :class:`~latentfast.cache.store.fields.FieldItems`."""
    index = np.asarray(index, dtype=np.int64)
    if getattr(items, "index_checks", None) is not None:
        items.index_checks.check(index)
    starts = items.row_starts[index] * ELEMENT_BYTES
    if items.row_ends is None:
        return starts, items.row_starts[index + 1] * ELEMENT_BYTES
    return starts, starts + items.nbytes[index]  # a field's value (its spare byte unread)


def holding(items, starts, ends):
    """A context in which bytes ``[starts[i], ends[i])`` of ``items``' data file may be read: for a cache
    in object storage they are fetched, checked and kept from eviction (:meth:`RemoteFiles.holding
    <latentfast.cache.remote.files.RemoteFiles.holding>`); a local cache's are always there."""
    if items.remote is None:
        return contextlib.nullcontext()
    return items.remote.holding(items, starts, ends)


def holding_items(items, index: np.ndarray):
    """:func:`holding` for whole items ``index`` (in range) -- of one data file, or (a sharded cache in
    object storage) each shard's rows in that shard's own."""
    if items.remote is None:
        return contextlib.nullcontext()
    return items.remote.holding_items(items, index)


# ---- records: one span table per field -------------------------------------------------------------
class FieldBatch:
    """One field of a batch of records: its :class:`SpanTable` (the item values as lines of 2-byte
    units; ``None`` for the latent, which has its own table) and how to view the gathered units:
    ``dtype``, the per-item output ``shape``, the true ``shapes`` ``[B, ndim]`` and the ``pad`` value;
    ``packed``: the items' values back to back, ``shape`` then the whole batch's ``[sum L_i, *rest]``;
    ``present``: bool ``[B]``, which items have a value (an optional field; None: not optional). An item
    without one has all-zero ``shapes`` and reads as zeros (the pad value where padded), no rows packed."""

    __slots__ = ("table", "dtype", "shape", "shapes", "pad", "packed", "present")


# read_batch(pad_to=) pads a field's first dimension to at most this: a sequence longer than a million
# tokens is a mistake (a 60 TB batch), not a caption
MAX_PAD_TO = 1 << 20


def resolve_fields(cache: Items, field_items: dict, indices, fields, pad, pad_to, *, width=None, dtype=torch.float16,
                   device=_CPU, packed=()) -> dict:
    """``{name: SpanTable (the latent) or FieldBatch}`` of a batch of records: the indices converted and
    range-checked once, then every requested field's spans resolved for the whole batch."""
    names = _field_names(fields, field_items)
    pad, pad_to = _pad_arguments(pad, pad_to, names, field_items)
    packed = (packed,) if isinstance(packed, str) else tuple(packed)
    if any(n not in names or n == "latent" or n in pad for n in packed):
        raise InvalidArgumentError(f"packed must name requested fields other than 'latent', not also in pad {sorted(pad)}, got {packed!r}")
    index = as_row_indices(indices, cache.n)
    index_np = index.numpy()
    batches = {}
    for name in names:
        if name == "latent":
            batches[name] = resolve(cache, index, width=width, dtype=dtype, device=device)
        else:
            batches[name] = _resolve_field(field_items[name], index, index_np, name in pad, pad.get(name), pad_to.get(name),
                                           name in packed)
    return batches


def _field_names(fields, field_items: dict) -> list[str]:
    names = [fields] if isinstance(fields, str) else list(fields)
    known = ["latent", *field_items]
    unknown = [n for n in names if n not in known]
    if unknown or not names or len(set(names)) != len(names):
        raise InvalidArgumentError(f"fields must name distinct fields of this cache {known}, got {list(names)!r}")
    return names


def _pad_arguments(pad, pad_to, names: list[str], field_items: dict) -> tuple[dict, dict]:
    pad = {} if pad is None else pad
    if not isinstance(pad, dict) or any(n not in names or n == "latent" for n in pad):
        raise InvalidArgumentError(f"pad must map requested fields other than 'latent' (padded by width=) to a pad value, got {pad!r}")
    for name, value in pad.items():
        if not isinstance(value, (bool, int, float)) or torch.tensor(value).to(field_items[name].dtype).item() != value:
            raise InvalidArgumentError(f"pad[{name!r}] = {value!r} is not a value of the field's dtype {field_items[name].dtype}")
    if pad_to is None:
        return pad, {}
    targets = dict.fromkeys(pad, pad_to) if not isinstance(pad_to, dict) else pad_to
    for name, size in targets.items():
        if name not in pad or isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, np.integer)) or size < 0:
            raise InvalidArgumentError(f"pad_to must be a size >= 0 (or a dict of them) for fields named in pad {sorted(pad)}, got {pad_to!r}")
        if size > MAX_PAD_TO:
            raise InvalidArgumentError(f"pad_to[{name!r}] = {size} is past the limit of {MAX_PAD_TO} (the longest a padded "
                                       f"field's first dimension may be made)")
    return pad, {name: int(size) for name, size in targets.items()}


def _resolve_field(items, index: torch.Tensor, index_np: np.ndarray, padded: bool, value, pad_to, packed=False) -> FieldBatch:
    if items.verify_rows:
        items.check(index_np)
    batch = FieldBatch()
    batch.dtype, batch.pad, batch.packed = items.dtype, value if padded else None, packed
    batch.shapes = np.ascontiguousarray(items.shapes[index_np])
    batch.present = None if items.present is None else items.present[index_np]
    # the batch's shape is its present items' (an absent item's zeros would be taken for a shape of its own)
    at = None if batch.present is None else np.flatnonzero(batch.present)  # their places in the batch (None: 0, 1, ...)
    shapes, index_at = (batch.shapes, index_np) if at is None else (batch.shapes[at], index_np[at])
    if packed:
        batch.shape = _packed_shape(items, shapes, index_at, at)
    elif padded:
        batch.shape = _padded_shape(items.name, shapes, index_at, pad_to, at)
    else:
        batch.shape = _common_shape(items.name, shapes, index_at, at)
    table = batch.table = SpanTable()
    table.cache, table.source = items, items.source()
    table.row_starts, table.row_ends, table.index, table.index_np = items.row_starts, items.row_ends, index, index_np
    table.rows = index
    table.widths = table.source[2].numpy()[index_np]
    table.channels = table.latent_h = table.lines = 1
    nbytes = int(np.prod(batch.shape, dtype=np.int64)) * torch.empty(0, dtype=items.dtype).element_size()
    table.width = table.w_max = -(-nbytes // ELEMENT_BYTES)
    table.pitch, table.checked, table.shapes = 0, True, batch.shapes
    table.shape = (table.width,)
    lacking = batch.present is not None and not batch.present.all()  # (absent items: zeros, as padding)
    table.white = torch.zeros((1, 1, 1), dtype=torch.float16) if padded or lacking else None
    return batch


def _packed_shape(items, shapes: np.ndarray, index_np: np.ndarray, at=None) -> tuple[int, ...]:
    """``[sum L_i, *rest]`` of a packed field: the items must agree past their first dimension and
    hold whole 2-byte units (the gather copies units back to back). ``at``: the items' places in the batch."""
    if shapes.shape[1] == 0:
        raise InvalidArgumentError(f"field {items.name!r} holds scalars: there is nothing to pack")
    _common_shape(items.name + " (past its first dimension)", shapes[:, 1:], index_np, at)
    odd = np.flatnonzero(items.nbytes[index_np] % 2)
    if len(odd):
        raise InvalidArgumentError(f"field {items.name!r}: indices[{_place(at, odd[0])}] = {int(index_np[odd[0]])} has an odd byte count "
                                   f"({int(items.nbytes[index_np[odd[0]]])}) and cannot be packed in 2-byte units; read it with pad= instead")
    return (int(shapes[:, 0].sum()), *(int(x) for x in shapes[0, 1:])) if len(shapes) else (0,) * shapes.shape[1]


def _place(at, k) -> int:
    """The place in the batch of the ``k``-th item checked (``at``: their places, None: every item in order)."""
    return int(k) if at is None else int(at[k])


def _common_shape(name: str, shapes: np.ndarray, index_np: np.ndarray, at=None) -> tuple[int, ...]:
    """The one shape of ``shapes`` (items ``index_np``, at places ``at`` of the batch: default 0, 1, ...)."""
    if len(shapes) and np.any(shapes != shapes[0]):
        kinds, first = np.unique(shapes, axis=0, return_index=True)
        listed = ", ".join(f"{kinds[k].tolist()} (indices[{_place(at, first[k])}] = {int(index_np[first[k]])})" for k in np.argsort(first)[:6])
        raise InvalidArgumentError(f"field {name!r}: the batch's items have {len(kinds)} shapes: {listed}; "
                                   f"name the field in pad= to pad it to the largest")
    return tuple(int(x) for x in shapes[0]) if len(shapes) else (0,) * shapes.shape[1]  # (an empty batch: zeros)


def _padded_shape(name: str, shapes: np.ndarray, index_np: np.ndarray, pad_to, at=None) -> tuple[int, ...]:
    """The batch's shape of a padded field: the largest first dimension (or ``pad_to``), the rest shared."""
    if shapes.shape[1] == 0:
        raise InvalidArgumentError(f"field {name!r} holds scalars: there is nothing to pad")
    _common_shape(name + " (past its first dimension)", shapes[:, 1:], index_np, at)
    longest = int(shapes[:, 0].max(initial=0))
    if pad_to is not None and pad_to < longest:
        k = int(np.argmax(shapes[:, 0]))
        raise InvalidArgumentError(f"pad_to[{name!r}] = {pad_to} is shorter than indices[{_place(at, k)}] = {int(index_np[k])}, "
                                   f"of shape {shapes[k].tolist()}")
    lead = longest if pad_to is None else pad_to
    return (lead, *(int(x) for x in shapes[0, 1:])) if len(shapes) else (lead,) + (0,) * (shapes.shape[1] - 1)
