"""Fast batch decode of a latent cache: ``read_batch(cache, indices)`` -> ``(latents [B, C, h, W], widths [B])``.

CPU target: one compiled gather (``latentfast::gather_rows_into``) copies each requested row's real
columns from the memmap straight into the output, pads with the white column and casts, on several
threads with the GIL released. A batch of small rows costs about as much in fixed per-call work as
in copying, so that path is kept short: the kernel, which checks every index before copying
anyway, is the one that validates them (Python reads their widths clipped into range to size the
output; if a width check then fails, the indices are validated first so a bad index is reported).

CUDA target: the same rows' real columns only are gathered back to back into a slot of a pinned
ring buffer (allocated once per process and device, grown, never shrunk), copied to the device on
a side stream (the copy engine; bytes over PCIe = useful bytes), and one device kernel
(``latentfast::expand_rows_into``) pads with the white column and casts. A slot is rewritten only
after the copy that read it has finished (a CUDA event per slot) and never by two threads at once
(a lock per slot). Every launch and copy runs under the target device (``cuda:1`` from a process
whose current device is ``cuda:0`` uses ``cuda:1``'s streams). If pinned memory cannot be had, the
ring falls back to pageable memory with a one-time warning.

Both targets take the cold-read path of :mod:`latentfast.cache.feed.coldread` before copying: rows of a
cache that is not in the page cache are read in with parallel I/O, not faulted in one page at a time.

``cache`` is anything with ``len()``, ``channels``, ``latent_h``, ``w_max``, ``widths``,
``white_column`` (float16 ``[C, h, 1]`` or None) and ``gather_source() -> (data, row_offsets, widths,
pitch)`` (see :class:`latentfast.cache.reader.LatentCache`); with ``row_starts``, ``cache_dir`` and
``split`` too, it gets the cold-read path.
"""
from __future__ import annotations

import os
import threading
import time
import warnings

import numpy as np
import torch

from ... import ops
from ...devices import as_device
from ...errors import ArgumentTypeError, DeviceUnavailableError, InvalidArgumentError
from . import coldread as prefetch, shaped

DEFAULT_RING_ROWS = 64  # rows per slot of a fresh ring (grows if a larger batch arrives)
RING_SLOTS = 3  # batches that may be in flight (gathering / copying / being expanded)
_INT32_MAX = np.iinfo(np.int32).max


def read_batch(cache, indices, *, device="cpu", dtype=None, width=None, out=None, backend: str = "auto",
               cold="auto"):
    """Rows ``indices`` of ``cache`` as one padded batch.

    Args:
        indices: ints (sequence, numpy array or tensor); duplicates and any order allowed; each must
            be in ``[0, len(cache))`` (else IndexError naming it).
        device: where the batch lands, read with :func:`latentfast.devices.as_device` ("cpu",
            "cuda" = the current CUDA device, "cuda:1", an int, a torch.device). Default "cpu": a
            host batch, which a DataLoader pins and :class:`~latentfast.cache.DevicePrefetcher`
            moves; pass a CUDA device to gather into pinned memory and expand on the device.
        dtype: float16 (default), bfloat16 or float32.
        width: W of the batch (an int), at least the widest requested row (default: exactly that).
        out: optional preallocated contiguous ``[B, C, h, W]`` output on ``device``.
        cold: ``"auto"`` (default) reads a batch whose pages are not in the page cache with parallel
            I/O before copying it, and stops checking once batches keep being found in memory
            (see :mod:`latentfast.cache.feed.coldread`); ``True`` always asks for the pages first (a
            cache known to be far larger than RAM); ``False`` never (pages fault in as touched).

    Returns:
        ``(latents [B, C, h, W] of dtype on device, widths [B] int32 on the CPU)``; columns from a
        row's width up to W hold the cache's white column.
    """
    if shaped.intercepts(cache):  # shaped caches (batches of one item shape) and verify_rows
        return shaped.read_batch(cache, indices, device=device, dtype=dtype, width=width, out=out, backend=backend,
                                 cold=cold)
    source = cache.gather_source()
    dtype = torch.float16 if dtype is None else dtype
    if dtype not in ops.GATHER_DTYPES:
        raise InvalidArgumentError(f"dtype must be one of {ops.GATHER_DTYPES}, got {dtype}")
    if not (cold == "auto" if cold.__class__ is str else cold is True or cold is False):
        raise InvalidArgumentError(f"cold must be 'auto', True or False, got {cold!r}")
    if not (device.__class__ is str and device == "cpu"):  # the default passes as is, cheaply
        device = as_device(device)
    if device.__class__ is str or device.type == "cpu":
        return _read_batch_cpu(cache, source, indices, dtype, width, out, backend, cold)
    if device.type != "cuda":
        raise InvalidArgumentError(f"device must be a CPU or CUDA device, got {device}")
    if not torch.cuda.is_available():
        raise DeviceUnavailableError(f"read_batch(device={str(device)!r}): CUDA is not available here; use device='cpu'")
    with torch.cuda.device(device):  # every allocation, launch and stream below belongs to `device`
        return _read_batch_cuda(cache, source, indices, device, dtype, width, out, backend, cold)


def _read_batch_cpu(cache, source, indices, dtype, width, out, backend, cold):
    """The CPU path, trimmed for small batches, where fixed per-call costs rival the copy: the indices
    go to the kernel unchecked (it checks every one before copying and raises IndexError naming it),
    so Python only reads their widths, clipped into range, to size the output."""
    index, index_np = _as_int64_vector(indices)
    if index is None:  # not a plain int64 vector: the full conversion (and its errors)
        index = ops.as_row_indices(indices, len(cache))
        index_np = index.numpy()
    white = cache.white_column
    channels, latent_h = int(cache.channels), int(cache.latent_h)
    try:  # (inline: a batch of small rows costs tens of microseconds, this part must stay a few)
        selected_np = _selected_widths(cache.widths, index_np, clip=True)
        W = int(selected_np.max()) if selected_np.size and width is None and white is not None else (
            _checked_width(white, selected_np, width))
        if out is not None:
            ops.check_out_tensor("out", out, (index.numel(), channels, latent_h, W), dtype, torch.device("cpu"))
    except (TypeError, ValueError, IndexError):  # from clipped indices: a bad index, if any, is the error to report
        ops.as_row_indices(index, len(cache))
        raise
    if out is None:
        out = torch.empty(index.numel(), channels, latent_h, W, dtype=dtype)
    if white is not None and (white.dtype != torch.float16 or not white.is_contiguous()):
        white = white.to(torch.float16).contiguous()
    state = _before_copy(cache, cold, source[0], index_np)
    start = time.perf_counter() if state is not None else 0.0
    torch.ops.latentfast.gather_rows_into.default(source[0], source[1], source[2], int(source[3]), index, white, out,
                                                  backend)
    if state is not None and state.hot:  # a hot batch pays this clock read and a compare
        seconds = time.perf_counter() - start
        if seconds > prefetch.SLOW_FLOOR_S:
            state.after_copy(seconds, lambda: int(selected_np.sum()) * channels * latent_h * 2)
    return out, torch.from_numpy(selected_np)


def _read_batch_cuda(cache, source, indices, device, dtype, width, out, backend, cold):
    index = ops.as_row_indices(indices, len(cache))
    selected_np = _selected_widths(cache.widths, index.numpy(), clip=False)
    W = _checked_width(cache.white_column, selected_np, width)
    lines = int(cache.channels) * int(cache.latent_h)
    B = index.numel()
    ring = _ring_for(device, lines * int(selected_np.sum()), B, lines * int(cache.w_max) * max(B, DEFAULT_RING_ROWS))
    state = _before_copy(cache, cold, source[0], index.numpy())
    packed, offsets, widths = ring.stage_and_copy(source, index, torch.from_numpy(selected_np), cache.channels,
                                                   cache.latent_h, backend, state)
    latents = ops.expand_rows(
        packed, offsets, widths, ring.device_white(cache.white_column), channels=int(cache.channels),
        latent_h=int(cache.latent_h), width=W, dtype=dtype, out=out,
        backend="auto" if backend in ("cpp", "torch") else backend,
    )
    return latents, torch.from_numpy(selected_np)


def _before_copy(cache, cold, data, index_np):
    """The cold-read path before a batch's copy: the cache's
    :class:`~latentfast.cache.prefetch.ColdReads` (None when ``cold`` is False or the cache cannot have
    one), which asks for the batch's missing pages unless batches have been found hot; a map seen
    for the first time is marked MADV_RANDOM."""
    if cold is False:
        return None
    state = prefetch.cold_reads(cache)
    if state is None or (state.hot and cold is not True):
        return state
    state.advise_map(data)
    state.before_copy(cache.row_starts, index_np, always=cold is True)
    return state


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


def _selected_widths(widths, index_np: np.ndarray, clip: bool) -> np.ndarray:
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


def _checked_width(white, selected_np, width) -> int:
    """W of the batch (:func:`latentfast.ops.batch_width`); the white column must exist if any row is
    narrower than W."""
    W = ops.batch_width(selected_np, width)
    if white is None and bool((selected_np < W).any()):
        raise InvalidArgumentError(
            "this batch needs padding but the cache has no white column; pass white_column= when opening the cache"
        )
    return W


# ---- pinned staging for the CUDA target ------------------------------------------------------------
def packed_row_offsets(selected: torch.Tensor, lines: int, out: torch.Tensor) -> torch.Tensor:
    """Where each of the rows (int32 widths ``selected``) starts in the packed staging: the exclusive
    prefix sum of ``lines * width``, written into ``out[:B]`` (int64) and returned."""
    B = selected.numel()
    offsets = out[:B]
    row_sizes = selected.to(torch.int64) * lines
    torch.cumsum(row_sizes, 0, out=offsets)
    offsets -= row_sizes
    return offsets


def stage_rows(source, index, selected, channels, latent_h, packed_out, offsets_out, widths_out, backend="auto"):
    """Pack the real columns of rows ``index`` back to back into ``packed_out`` and write their starts
    and widths into ``offsets_out``/``widths_out`` (host buffers, e.g. a pinned ring slot). Returns
    ``(packed, offsets, widths)`` views: what :func:`latentfast.ops.expand_rows` turns into the padded
    batch. ``source`` is ``cache.gather_source()``."""
    data, row_offsets, widths, pitch = source
    packed = ops.gather_rows_packed(
        data, row_offsets, widths, int(pitch), index, channels=int(channels), latent_h=int(latent_h),
        out=packed_out, backend="auto" if backend in ("cuda", "triton") else backend,
    )
    offsets = packed_row_offsets(selected, int(channels) * int(latent_h), offsets_out)
    widths_out[: selected.numel()] = selected
    return packed, offsets, widths_out[: selected.numel()]


def ring_size(current: tuple[int, int] | None, elements: int, rows: int, worst_elements: int) -> tuple[int, int] | None:
    """``(elements, rows)`` per slot of the ring to allocate for a batch of ``rows`` rows needing
    ``elements`` staging elements, or None when the ``current`` ring serves it. A new ring is at least
    as large as the current one in both (so caches of different row sizes that alternate stop
    reallocating after one growth) and sized for ``worst_elements`` (full-width rows) when it grows."""
    if current is not None and elements <= current[0] and rows <= current[1]:
        return None
    have_elements, have_rows = current if current is not None else (0, 0)
    return max(have_elements, elements, worst_elements), max(have_rows, rows, DEFAULT_RING_ROWS)


class PinnedRing:
    """``slots`` pinned staging slots of ``capacity`` elements and ``rows`` rows each, reused round
    robin, and the side stream that copies them to one CUDA device."""

    _warned = False

    def __init__(self, device: torch.device, capacity: int, rows: int, slots: int = RING_SLOTS):
        self.device = device
        self.capacity, self.rows, self.slots = capacity, rows, slots
        self.pinned = True
        try:
            self._allocate(pin=True)
        except RuntimeError as exc:  # pinning refused (limits, no driver): pageable still works
            self.pinned = False
            if not PinnedRing._warned:
                PinnedRing._warned = True
                warnings.warn(
                    f"could not allocate pinned memory ({exc}); read_batch stages in pageable memory "
                    "(host-to-device copies will not overlap)",
                    RuntimeWarning,
                    stacklevel=3,
                )
            self._allocate(pin=False)
        self.stream = torch.cuda.Stream(device)
        self.events: list[torch.cuda.Event | None] = [None] * slots
        self.next_slot = 0
        self.lock = threading.Lock()
        self.slot_locks = [threading.Lock() for _ in range(slots)]  # held while a slot is filled
        self.white: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (host white, its device copy)

    def _allocate(self, pin: bool) -> None:
        self.data = torch.empty((self.slots, self.capacity), dtype=torch.float16, pin_memory=pin)
        self.offsets = torch.empty((self.slots, self.rows), dtype=torch.int64, pin_memory=pin)
        self.widths = torch.empty((self.slots, self.rows), dtype=torch.int32, pin_memory=pin)

    def _acquire(self) -> int:
        """A slot this thread may fill: no other thread is filling it and no copy still reads it.
        The caller releases ``slot_locks[slot]`` once the copy's event is recorded."""
        with self.lock:
            slot = self.next_slot
            self.next_slot = (slot + 1) % self.slots
        self.slot_locks[slot].acquire()
        if self.events[slot] is not None:
            self.events[slot].synchronize()  # the copy that last read this slot is done
        return slot

    def device_white(self, white):
        if white is None:
            return None
        key = id(white)  # the host tensor is kept alive in the entry, so its id stays unique
        if key not in self.white:
            self.white[key] = (white, white.reshape(-1).to(torch.float16).to(self.device))
        return self.white[key][1]

    def stage_and_copy(self, source, index, selected, channels, latent_h, backend, cold_reads=None):
        """Stage the rows in a slot, start their copy on the side stream, and return the device
        ``(packed, offsets, widths)``, ready for use on the current stream."""
        slot = self._acquire()
        try:
            start = time.perf_counter()
            staged = stage_rows(source, index, selected, channels, latent_h, self.data[slot], self.offsets[slot],
                                self.widths[slot], backend)
            if cold_reads is not None and cold_reads.hot:
                cold_reads.after_copy(time.perf_counter() - start, lambda: staged[0].numel() * 2)
            with torch.cuda.stream(self.stream):
                moved = tuple(tensor.to(self.device, non_blocking=True) for tensor in staged)
                done = torch.cuda.Event()
                done.record(self.stream)
            self.events[slot] = done
        finally:
            self.slot_locks[slot].release()
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)
        for tensor in moved:  # allocated on the side stream, used on the current one
            tensor.record_stream(current)
        return moved


_RINGS: dict[tuple[int, str], PinnedRing] = {}
_RINGS_LOCK = threading.Lock()


def _ring_for(device: torch.device, elements: int, rows: int, worst_elements: int) -> PinnedRing:
    """This process's ring for ``device``; replaced by a larger one only when a batch outgrows it."""
    key = (os.getpid(), str(device))
    with _RINGS_LOCK:
        ring = _RINGS.get(key)
        size = ring_size((ring.capacity, ring.rows) if ring else None, elements, rows, worst_elements)
        if size is not None:
            if ring is not None:
                ring.stream.synchronize()  # nothing may still read the old slots
            ring = _RINGS[key] = PinnedRing(device, *size)
        return ring
