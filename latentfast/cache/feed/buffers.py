"""Reused batch buffers: :class:`BatchBuffers`, what ``read_batch(out=...)`` fills instead of
allocating a fresh (padded) tensor per batch, and the ring of them a
:class:`~latentfast.cache.LatentLoader` cycles through.

Why: a freshly allocated padded batch costs a page fault per 4 KiB page the first time it is
written, which measured as much as the whole copy of a hot batch. A buffer written again costs
none. Each named entry is one flat byte buffer, grown when a batch needs more (to at least its
``reserve``: the worst case a loader computes from the cache, so it grows once), and handed out as
a contiguous view of the batch's shape and dtype.

Host buffers are page-aligned private anonymous maps advised for transparent huge pages
(``MADV_HUGEPAGE``: one fault per 2 MiB instead of per 4 KiB, where the kernel allows it; a shared
anonymous map is shmem, which the kernel's default ``shmem_enabled=never`` keeps on 4 KiB pages, and
a forked child would write into the parent's); ``pin=True`` buffers are pinned (a batch going to a
GPU: the copy is asynchronous); ``shared=True`` buffers live in shared memory (a DataLoader worker's:
each buffer's storage crosses to the main process once, then a batch is only its place in the ring).

A batch read without ``out=`` gets a fresh tensor; :func:`fresh_host` makes the large ones (4 MiB
and up) from the same maps, and takes back the map of one whose last view is gone, so the next
batch of that size is written into pages already faulted in. Measured on the CI VM (8 MiB): a fresh
map costs 2.5-4 ms of page faults on 4 KiB pages, 0.13 ms on huge pages, a recycled one nothing;
glibc's heap hands a freed chunk out again too, but not reliably: in ``bench_loader``'s shaped rows the
8 MiB batch read right after the safetensors reader faulted in all its 2,048 pages again, 7-37 ms a
batch instead of ~0.4 (``bench/RESULTS.md``).
"""
from __future__ import annotations

import collections
import math
import mmap
import os
import threading
import weakref

import numpy as np
import torch

from ...checks import check_out_tensor

HUGE_PAGE = 2 << 20  # large host buffers are rounded to (and advised for) 2 MiB pages
# fresh outputs from this size on come from recycled maps; smaller ones from torch.empty (glibc's heap gave a
# 2 MiB batch recycled pages every time, and its torch.empty costs 1.3 us to fresh_host's 3 us)
RECYCLE_BYTES = 4 << 20


class BatchBuffers:
    """Named reusable buffers, one per ``(name, device)``.

    :meth:`take` returns a contiguous ``[shape]`` view of ``dtype`` over the entry's buffer, which
    is reallocated only when too small. The views of one ``take`` are valid until the next
    ``take`` of the same name (which may write over them). ``allocations`` counts the buffers made.
    ``reserve``: ``{name: bytes}``, the least size an entry (or one named ``"<name>.<anything>"``)
    is allocated at."""

    def __init__(self, *, pin: bool = False, shared: bool = False, reserve: dict | None = None):
        self.pin, self.shared = bool(pin), bool(shared)
        self.reserve = dict(reserve or {})
        self.allocations = 0
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}
        self._maps: dict[tuple[str, str], mmap.mmap] = {}  # the anonymous maps host buffers view (kept alive)

    def take(self, name: str, shape, dtype: torch.dtype, device=None) -> torch.Tensor:
        device = torch.device("cpu") if device is None else torch.device(device)
        nbytes = math.prod(shape) * dtype.itemsize
        key = (name, str(device))
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < nbytes:
            size = max(nbytes, self.reserve.get(name.split(".")[0], 0), 1)
            if buffer is not None:
                size = max(size, buffer.numel() * 3 // 2)  # a growing batch: grow a few times, not every batch
            buffer = self._buffers[key] = self._allocate(key, size, device)
            self.allocations += 1
        return buffer[:nbytes].view(dtype).view(tuple(shape))

    def _allocate(self, key, size: int, device: torch.device) -> torch.Tensor:
        if device.type != "cpu":
            return torch.empty(size, dtype=torch.uint8, device=device)
        if self.pin:
            return torch.empty(size, dtype=torch.uint8, pin_memory=True)
        if self.shared:  # a new shared-memory file, its pages untouched until written (share_memory_ copies)
            return torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(size))
        if size < HUGE_PAGE:
            return torch.empty(size, dtype=torch.uint8)
        region = self._maps[key] = huge_page_map(size)
        return torch.frombuffer(region, dtype=torch.uint8)

    def viewed_by(self, tensor: torch.Tensor):
        """The ``(name, device)`` key and buffer of the entry ``tensor`` is a view of, or None."""
        storage = tensor.untyped_storage().data_ptr()
        for key, buffer in self._buffers.items():
            if buffer.untyped_storage().data_ptr() == storage:
                return key, buffer
        return None

    def data_ptrs(self) -> set[int]:
        """The addresses of the buffers held now (what a test of reuse compares)."""
        return {buffer.data_ptr() for buffer in self._buffers.values()}


def huge_page_map(size: int) -> mmap.mmap:
    """A private anonymous map of ``size`` bytes rounded up to 2 MiB, advised for huge pages."""
    region = mmap.mmap(-1, -(-size // HUGE_PAGE) * HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # (Linux; a kernel with THP off ignores it)
        region.madvise(mmap.MADV_HUGEPAGE)
    return region


class _Recycler:
    """The maps of fresh host outputs whose last view is gone, for the next fresh output of their size
    (at most ``KEEP_BYTES`` of them idle: the longest idle are unmapped first)."""

    KEEP_BYTES = 64 << 20

    def __init__(self):
        self._idle: list[mmap.mmap] = []  # oldest first
        self._returned: collections.deque[mmap.mmap] = collections.deque()  # given back since the last call
        self._lent: dict[int, tuple[weakref.ref, mmap.mmap]] = {}  # id(weak reference to an array) -> it, its map
        self._lock = threading.Lock()  # (fresh outputs made in several threads)

    def array(self, shape, np_dtype) -> np.ndarray:
        """A numpy array ``[shape]`` over a recycled (or new) map; its map comes back when it is gone."""
        count = math.prod(shape)
        size = -(-count * np.dtype(np_dtype).itemsize // HUGE_PAGE) * HUGE_PAGE
        with self._lock:
            self._take_returned()
            found = [k for k, region in enumerate(self._idle) if len(region) == size]
            region = self._idle.pop(found[-1]) if found else None
        if region is None:
            region = huge_page_map(size)
        array = np.frombuffer(region, dtype=np_dtype, count=count).reshape(shape)
        # a tensor made from `array` holds it; when its last view is gone the weak reference calls back
        # (a weak reference costs 0.1 us, weakref.finalize 5 us)
        ref = weakref.ref(array, self._give_back)
        self._lent[id(ref)] = (ref, region)
        return array

    def _give_back(self, ref: weakref.ref) -> None:
        # (runs wherever the last view dies, maybe inside array() of this very thread: it never waits
        # for the lock; what it cannot file now, the next call files)
        region = self._lent.pop(id(ref))[1]
        if len(region) > self.KEEP_BYTES:
            return
        self._returned.append(region)
        if self._lock.acquire(blocking=False):
            try:
                self._take_returned()
            finally:
                self._lock.release()

    def _take_returned(self) -> None:
        while self._returned:
            self._idle.append(self._returned.popleft())
        while sum(len(region) for region in self._idle) > self.KEEP_BYTES:
            self._idle.pop(0)  # (unmapped when the last reference goes)

    def idle_bytes(self) -> int:
        with self._lock:
            self._take_returned()
            return sum(len(region) for region in self._idle)


_RECYCLER = _Recycler()
if hasattr(os, "register_at_fork"):  # a child forked while another thread held the lock gets a free one
    os.register_at_fork(after_in_child=lambda: setattr(_RECYCLER, "_lock", threading.Lock()))


# a 2-byte dtype's array is float16 in numpy (the same bytes), viewed as the dtype in torch
_NUMPY_TWIN = {torch.float16: np.float16, torch.bfloat16: np.float16, torch.float32: np.float32, torch.uint8: np.uint8,
               torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32, torch.int64: np.int64}


def fresh_host(shape, dtype: torch.dtype) -> torch.Tensor:
    """A new contiguous CPU tensor ``[shape]`` of ``dtype`` (contents undefined), as ``torch.empty`` makes;
    from ``RECYCLE_BYTES`` on, over a recycled huge-page map (see the module's docstring)."""
    shape = tuple(shape)
    twin = _NUMPY_TWIN.get(dtype)
    if twin is None or math.prod(shape) * dtype.itemsize < RECYCLE_BYTES:
        return torch.empty(shape, dtype=dtype)
    tensor = torch.from_numpy(_RECYCLER.array(shape, twin))
    return tensor if tensor.dtype == dtype else tensor.view(dtype)


def take(out, name: str, shape, dtype: torch.dtype, device, *, pin: bool = False) -> torch.Tensor:
    """A batch output ``[shape]`` of ``dtype`` on ``device``: from ``out`` (a :class:`BatchBuffers`,
    or a dict of exact tensors by name, checked) or, where it holds none, a fresh tensor."""
    if isinstance(out, BatchBuffers):
        return out.take(name, shape, dtype, device)
    given = out.get(name) if isinstance(out, dict) else None
    if given is None:
        if not pin and torch.device(device).type == "cpu":
            return fresh_host(shape, dtype)
        return torch.empty(tuple(shape), dtype=dtype, device=device, pin_memory=pin)
    check_out_tensor(f"out[{name!r}]", given, tuple(shape), dtype, torch.device(device))
    return given
