"""The device path: a batch's real columns packed into a pinned ring slot, copied on a side stream and
expanded (padded, cast) on the device; and :class:`DevicePrefetcher`, which moves any loader's batches
to the device ahead of the loop.

The ring is allocated once per process and device, grown, never shrunk. A slot is rewritten only
after the copy that read it has finished (a CUDA event per slot) and never by two threads at once
(a lock per slot). Every launch and copy runs under the target device (``cuda:1`` from a process
whose current device is ``cuda:0`` uses ``cuda:1``'s streams). If pinned memory cannot be had, the
ring falls back to pageable memory with a one-time warning.
"""
from __future__ import annotations

import collections
import os
import queue
import threading
import time
import warnings
from collections.abc import Iterable

import torch

from ...checks import as_int
from ...devices import as_device, map_tensors
from ...errors import DeviceUnavailableError
from .coldread import DEFAULT_LOOKAHEAD

DEFAULT_RING_ROWS = 64  # rows per slot of a fresh ring (grows if a larger batch arrives)
RING_SLOTS = 3  # batches that may be in flight (gathering / copying / being expanded)


def stage_and_expand(table, device: torch.device, dtype: torch.dtype, out, backend: str, cold_reads) -> torch.Tensor:
    """The batch of span table ``table`` on CUDA ``device`` (the current device): staged in a pinned
    slot, copied, expanded to ``[B, C, h, W]`` of ``dtype`` (into ``out`` if given)."""
    B, lines = table.index.numel(), table.lines
    ring = _ring_for(device, lines * int(table.widths.sum()), B, lines * table.w_max * max(B, DEFAULT_RING_ROWS))
    packed, offsets, widths = ring.stage_and_copy(table.source, table.rows, torch.from_numpy(table.widths),
                                                  table.channels, table.latent_h, backend, cold_reads)
    if out is None:  # (a given out was checked in resolve)
        out = torch.empty((B, table.channels, table.latent_h, table.width), dtype=dtype, device=device)
    torch.ops.latentfast.expand_rows_into.default(packed, offsets, widths, ring.device_white(table.white), out,
                                                  "auto" if backend in ("cpp", "torch") else backend)
    return out


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
    needed = int(channels) * int(latent_h) * int(selected.sum())  # the kernel checks the slot holds it
    torch.ops.latentfast.gather_rows_packed_into.default(
        data, row_offsets, widths, int(pitch), index, int(channels), int(latent_h), packed_out,
        "auto" if backend in ("cuda", "triton") else backend,
    )
    packed = packed_out[:needed]
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


# ---- moving any loader's batches ahead of the loop ------------------------------------------------
class DevicePrefetcher:
    """Iterate ``batches`` on ``device``, with the next ``lookahead`` batches pulled from ``batches``
    and copied to the device ahead of the loop.

    A batch may be a tensor or a (nested) tuple / list / dict of them; other values pass through.

    Args:
        batches: any iterable of batches (a DataLoader, a generator of ``cache.read_batch`` calls).
        device: where batches land, read with :func:`latentfast.devices.as_device`. Default ``"cuda"``
            (the current CUDA device): moving batches there is this class's job. A CPU device only
            reads ahead.
        lookahead: batches prepared ahead of the one in use by a background thread (default 2), so
            reading them (disk, gather, host-to-device copy on a side stream) overlaps the training
            step; ``0``: no thread, only batch k+1's copy overlaps step k. The thread runs
            ``batches`` with the loop's current CUDA device; errors it meets are raised in the loop.

    The copies are asynchronous when the host tensors are pinned (``DataLoader(pin_memory=True)``). A
    batch already on a CUDA device is ordered after the work that produced it: the side stream waits
    on the producing thread's current stream of every device the batch is on. Pulling ahead advances
    a sampler behind ``batches`` ahead of the loop: pass ``consumed=`` to its ``state_dict``, or
    save the prefetcher's own :meth:`state_dict` (a :class:`~latentfast.cache.LatentLoader`'s state
    after the batches this prefetcher handed to the loop, not those it pulled ahead). From a
    LatentLoader that reuses its buffers, a batch is pulled only once the copy of the one ``hold + 1``
    before it has finished (the loader writes over that one next); on the CPU, where nothing is copied,
    it reads at most ``hold - 1`` batches ahead of the loop.
    """

    def __init__(self, batches: Iterable, device="cuda", *, lookahead: int = DEFAULT_LOOKAHEAD):
        self.batches = batches
        self.device = as_device(device)
        self.lookahead = as_int("lookahead", lookahead, minimum=0)
        self._handed = 0
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise DeviceUnavailableError(f"DevicePrefetcher(device={str(self.device)!r}): CUDA is not available here")

    def __len__(self) -> int:
        return len(self.batches)

    def state_dict(self) -> dict:
        """``batches.state_dict(consumed=...)`` after the batches handed to the loop in this pass (a
        :class:`~latentfast.cache.LatentLoader`, or a sampler-backed source taking ``consumed``)."""
        return self.batches.state_dict(consumed=self._handed)

    def load_state_dict(self, state: dict) -> None:
        self.batches.load_state_dict(state)

    def __iter__(self):
        self._handed = 0  # batches handed to the loop in this pass
        lookahead = self.lookahead
        if self.device.type != "cuda" and getattr(self.batches, "recycle", False):
            # nothing is copied on the CPU: the batch handed over is the loader's own buffer, written over once
            # `hold` later batches are pulled; the queue plus the one the producer holds must fit in that
            lookahead = min(lookahead, self.batches.hold - 1)
        if lookahead > 0:
            return self._threaded(lookahead)
        if self.device.type != "cuda":
            return self._counted()
        return self._inline()

    def _counted(self):
        for batch in self.batches:
            self._handed += 1
            yield batch

    def _inline(self):
        stream = torch.cuda.Stream(self.device)
        pending = None
        copies: collections.deque = collections.deque()
        for batch in self._pulled(iter(self.batches), copies):
            moved = self._move(batch, stream)
            copies.append(moved[1])
            if pending is not None:
                self._handed += 1
                yield self._hand_over(*pending)
            pending = moved
        if pending is not None:
            self._handed += 1
            yield self._hand_over(*pending)

    def _threaded(self, lookahead: int):
        """Batches from a producer thread, at most ``lookahead`` ahead; its errors are raised here."""
        ready: queue.Queue = queue.Queue(maxsize=lookahead)
        stop = threading.Event()
        source = iter(self.batches)  # made in the loop's thread (DataLoader iterators set up signals)
        # the producer runs `batches` as the loop's thread would: with its current CUDA device ("cuda" in
        # a read_batch call means that one), never initialising CUDA for a loop that does not use it
        current = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        producer = threading.Thread(target=self._produce, args=(source, ready, stop, current), daemon=True,
                                    name="latentfast-device-prefetch")
        producer.start()
        try:
            while True:
                kind, item = ready.get()
                if kind == "end":
                    return
                if kind == "error":
                    raise item
                self._handed += 1
                yield self._hand_over(*item)
        finally:
            # a loop that stops early: the producer finishes the batch it is making and exits, and with
            # it go its references (to the source, to its batches), before this returns
            stop.set()
            producer.join()

    def _produce(self, source, ready: queue.Queue, stop: threading.Event, cuda_device: int | None) -> None:
        def put(entry) -> bool:
            while not stop.is_set():
                try:
                    ready.put(entry, timeout=0.05)
                    return True
                except queue.Full:
                    continue
            return False

        try:
            if cuda_device is not None:
                torch.cuda.set_device(cuda_device)
            stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
            copies: collections.deque = collections.deque()
            for batch in self._pulled(source, copies):
                moved = self._move(batch, stream)
                copies.append(moved[1])
                if not put(("batch", moved)):
                    return
            put(("end", None))
        except BaseException as exc:  # handed to the loop's thread, which raises it
            put(("error", exc))

    def _pulled(self, source, copies: collections.deque):
        """``source``'s batches; from a loader that reuses its buffers (a
        :class:`~latentfast.cache.LatentLoader`: it may write over a batch once ``hold`` later ones
        were taken), each is pulled only after the copy of the batch ``hold + 1`` before it has
        finished (``copies``: the events of the copies made, oldest first)."""
        hold = self.batches.hold if getattr(self.batches, "recycle", False) else None
        while True:
            while copies and (hold is None or len(copies) > hold):
                done = copies.popleft()
                if hold is not None and done is not None:
                    done.synchronize()
            try:
                batch = next(source)
            except StopIteration:
                return
            yield batch

    def _move(self, batch, stream):
        """``(batch on the device, event after its copy)``, copied on ``stream`` (None: the CPU)."""
        if stream is None:
            return batch, None
        producers = {t.device for t in _tensors(batch) if t.is_cuda}
        for device in producers:  # the batch's tensors are complete once these streams' work is
            stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            moved = map_tensors(lambda t: t.to(self.device, non_blocking=True), batch)
            ready = torch.cuda.Event()
            ready.record(stream)
        return moved, ready

    def _hand_over(self, batch, ready):
        if ready is None:
            return batch
        current = torch.cuda.current_stream(self.device)
        current.wait_event(ready)
        for tensor in _tensors(batch):  # made on another stream, used on this one from now on
            if tensor.is_cuda:
                tensor.record_stream(current)
        return batch


def _tensors(value) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_tensors(found.append, value)
    return found
