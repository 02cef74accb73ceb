"""Fast batch decode of a latent cache: ``read_batch(cache, indices)`` -> ``(latents [B, C, h, W], widths [B])``.

CPU target: one compiled gather (``latentfast::gather_rows_into``) copies each requested row's real
columns from the memmap straight into the output, pads with the white column and casts, on several
threads with the GIL released. A batch of small rows costs about as much in fixed per-call work as
in copying, so that path is kept short: the kernel, which checks every index before copying
anyway, is the one that validates them (Python reads their widths clipped into range to size the
output; if a width check then fails, the indices are validated first so a bad index is reported).

CUDA target: the same rows' real columns only are gathered back to back into a slot of a pinned
ring buffer (allocated once per process and device, reused), copied to the device on a side
stream (the copy engine; bytes over PCIe = useful bytes), and one device kernel
(``latentfast::expand_rows_into``) pads with the white column and casts. A slot is rewritten only
after the copy that read it has finished (a CUDA event per slot) and never by two threads at once
(a lock per slot). If pinned memory cannot be had, the ring falls back to pageable memory with a
one-time warning. The ring grows (once) only if a batch larger than any before arrives.

``cache`` is anything with ``len()``, ``channels``, ``latent_h``, ``w_max``, ``white_column``
(float16 ``[C, h, 1]`` or None) and ``gather_source() -> (data, row_offsets, widths, pitch)``
(see :class:`latentfast.cache.reader.LatentCache`).
"""
from __future__ import annotations

import os
import threading
import warnings

import numpy as np
import torch

from .. import ops
from . import shaped

DEFAULT_RING_ROWS = 64  # rows per slot of a fresh ring (grows if a larger batch arrives)
RING_SLOTS = 3  # batches that may be in flight (gathering / copying / being expanded)


def read_batch(cache, indices, *, device="cpu", dtype=None, width=None, out=None, backend: str = "auto"):
    """Rows ``indices`` of ``cache`` as one padded batch.

    Args:
        indices: ints (sequence, numpy array or tensor); duplicates and any order allowed; each must
            be in ``[0, len(cache))`` (else IndexError naming it).
        device: where the batch should land ("cpu", "cuda", "cuda:1", a torch.device).
        dtype: float16 (default), bfloat16 or float32.
        width: W of the batch, at least the widest requested row (default: exactly that).
        out: optional preallocated contiguous ``[B, C, h, W]`` output on ``device``.

    Returns:
        ``(latents [B, C, h, W] of dtype on device, widths [B] int32 on the CPU)``; columns from a
        row's width up to W hold the cache's white column.
    """
    if shaped.intercepts(cache):  # shaped caches (batches of one item shape) and verify_rows
        return shaped.read_batch(cache, indices, device=device, dtype=dtype, width=width, out=out, backend=backend)
    data, row_offsets, widths, pitch = cache.gather_source()
    dtype = torch.float16 if dtype is None else dtype
    if dtype not in ops.GATHER_DTYPES:
        raise ValueError(f"dtype must be one of {ops.GATHER_DTYPES}, got {dtype}")
    device = device if device == "cpu" else torch.device(device)
    if device == "cpu" or device.type == "cpu":
        return _read_batch_cpu(cache, data, row_offsets, widths, int(pitch), indices, dtype, width, out, backend)
    if device.type != "cuda":
        raise ValueError(f"device must be a CPU or CUDA device, got {device}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"read_batch(device={str(device)!r}): CUDA is not available here; use device='cpu'")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    index = ops.as_row_indices(indices, len(cache))
    selected_np = np.asarray(cache.widths)[index.numpy()].astype(np.int32, copy=False)
    selected = torch.from_numpy(selected_np)
    W = _checked_width(cache.white_column, selected_np, int(selected_np.max()) if selected_np.size else 0, width)
    channels, latent_h = int(cache.channels), int(cache.latent_h)
    ring = _ring_for(device, channels * latent_h * int(cache.w_max), index.numel())
    latents = ring.to_device(
        data, row_offsets, widths, int(pitch), index, selected, cache.white_column, channels, latent_h, W, dtype,
        out, backend,
    )
    return latents, selected


def _read_batch_cpu(cache, data, row_offsets, widths, pitch, indices, dtype, width, out, backend):
    """The CPU path, trimmed for small batches, where fixed per-call costs rival the copy: the indices
    go to the kernel unchecked (it checks every one before copying and raises IndexError naming it),
    so Python only reads their widths, clipped into range, to size the output."""
    index, index_np = _as_int64_vector(indices)
    if index is None:  # not a plain int64 vector: the full conversion (and its errors)
        index = ops.as_row_indices(indices, len(cache))
        index_np = index.numpy()
    try:
        selected_np = np.asarray(cache.widths).take(index_np, mode="clip").astype(np.int32, copy=False)
    except IndexError:  # an empty cache: nothing to clip to
        ops.as_row_indices(index, len(cache))  # raises naming the index
        raise
    widest = int(selected_np.max()) if selected_np.size else 0
    white = cache.white_column
    channels, latent_h = int(cache.channels), int(cache.latent_h)
    try:
        W = _checked_width(white, selected_np, widest, width)
        if out is not None:
            ops.check_out_tensor("out", out, (index.numel(), channels, latent_h, W), dtype, torch.device("cpu"))
    except (TypeError, ValueError):  # W came from clipped indices: a bad index, if any, is the error to report
        ops.as_row_indices(index, len(cache))
        raise
    if out is None:
        out = torch.empty(index.numel(), channels, latent_h, W, dtype=dtype)
    if white is not None and (white.dtype != torch.float16 or not white.is_contiguous()):
        white = white.to(torch.float16).contiguous()
    torch.ops.latentfast.gather_rows_into.default(data, row_offsets, widths, pitch, index, white, out, backend)
    return out, torch.from_numpy(selected_np)


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


def _checked_width(white, selected_np, widest: int, width) -> int:
    """W of the batch: ``width`` (checked against the widest selected row) or that row's width; and
    the white column must exist if any row is narrower."""
    if width is None:
        W = widest
    elif isinstance(width, bool) or not isinstance(width, int) or width < widest:
        raise ValueError(f"width must be an int >= the batch's widest row ({widest}), got {width!r}")
    else:
        W = width
    if white is None and bool((selected_np < W).any()):
        raise ValueError(
            "this batch needs padding but the cache has no white column; pass white_column= when opening the cache"
        )
    return W


class PinnedRing:
    """``slots`` pinned staging slots for packed batches, reused round robin, and the side stream that
    copies them to one CUDA device."""

    _warned = False

    def __init__(self, device: torch.device, row_elems: int, rows: int, slots: int = RING_SLOTS):
        self.device = device
        self.row_elems, self.rows, self.slots = row_elems, rows, slots
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
        self.data = torch.empty((self.slots, self.rows * self.row_elems), dtype=torch.float16, pin_memory=pin)
        self.offsets = torch.empty((self.slots, self.rows), dtype=torch.int64, pin_memory=pin)
        self.widths = torch.empty((self.slots, self.rows), dtype=torch.int32, pin_memory=pin)

    def fits(self, row_elems: int, rows: int) -> bool:
        return row_elems <= self.row_elems and rows <= self.rows

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

    def _device_white(self, white):
        if white is None:
            return None
        key = id(white)  # the host tensor is kept alive in the entry, so its id stays unique
        if key not in self.white:
            self.white[key] = (white, white.reshape(-1).to(torch.float16).to(self.device))
        return self.white[key][1]

    def to_device(self, data, row_offsets, widths, pitch, index, selected, white, channels, latent_h, W, dtype,
                  out, backend):
        slot = self._acquire()
        try:
            packed, offsets_dev, widths_dev = self._stage_and_copy(
                slot, data, row_offsets, widths, pitch, index, selected, channels, latent_h, backend
            )
        finally:
            self.slot_locks[slot].release()
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)
        for tensor in (packed, offsets_dev, widths_dev):  # allocated on the side stream, used on current
            tensor.record_stream(current)
        return ops.expand_rows(
            packed, offsets_dev, widths_dev, self._device_white(white), channels=channels, latent_h=latent_h,
            width=W, dtype=dtype, out=out, backend="auto" if backend in ("cpp", "torch") else backend,
        )

    def _stage_and_copy(self, slot, data, row_offsets, widths, pitch, index, selected, channels, latent_h, backend):
        """Gather the real columns into pinned ``slot`` and start their copy to the device on the side stream."""
        B = index.numel()
        staged = ops.gather_rows_packed(
            data, row_offsets, widths, pitch, index, channels=channels, latent_h=latent_h, out=self.data[slot],
            backend="auto" if backend in ("cuda", "triton") else backend,
        )
        offsets = self.offsets[slot, :B]
        row_sizes = selected.to(torch.int64) * (channels * latent_h)
        torch.cumsum(row_sizes, 0, out=offsets)
        offsets -= row_sizes
        self.widths[slot, :B] = selected
        with torch.cuda.stream(self.stream):
            packed = staged.to(self.device, non_blocking=True)
            offsets_dev = offsets.to(self.device, non_blocking=True)
            widths_dev = self.widths[slot, :B].to(self.device, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.events[slot] = done
        return packed, offsets_dev, widths_dev


_RINGS: dict[tuple[int, str], PinnedRing] = {}
_RINGS_LOCK = threading.Lock()


def _ring_for(device: torch.device, row_elems: int, rows: int) -> PinnedRing:
    """This process's ring for ``device``; replaced by a larger one only when a batch outgrows it."""
    key = (os.getpid(), str(device))
    with _RINGS_LOCK:
        ring = _RINGS.get(key)
        if ring is None or not ring.fits(row_elems, rows):
            if ring is not None:
                ring.stream.synchronize()  # nothing may still read the old slots
            ring = PinnedRing(device, row_elems, max(rows, DEFAULT_RING_ROWS, ring.rows if ring else 0))
            _RINGS[key] = ring
        return ring
