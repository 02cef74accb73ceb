"""Reused batch buffers: :class:`BatchBuffers`, what ``read_batch(out=...)`` fills instead of
allocating a fresh (padded) tensor per batch, and the ring of them a
:class:`~latentfast.cache.LatentLoader` cycles through.

Why: a freshly allocated padded batch costs a page fault per 4 KiB page the first time it is
written, which measured as much as the whole copy of a hot batch. A buffer written again costs
none. Each named entry is one flat byte buffer, grown when a batch needs more (to at least its
``reserve``: the worst case a loader computes from the cache, so it grows once), and handed out as
a contiguous view of the batch's shape and dtype.

Host buffers are page-aligned anonymous maps advised for transparent huge pages (``MADV_HUGEPAGE``:
one fault per 2 MiB instead of per 4 KiB, where the kernel allows it); ``pin=True`` buffers are
pinned (a batch going to a GPU: the copy is asynchronous); ``shared=True`` buffers live in shared
memory (a DataLoader worker's: the batch reaches the main process as a handle, not a copy).
"""
from __future__ import annotations

import math
import mmap

import torch

from ...checks import check_out_tensor

HUGE_PAGE = 2 << 20  # large host buffers are rounded to (and advised for) 2 MiB pages


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
        size = -(-size // HUGE_PAGE) * HUGE_PAGE
        region = mmap.mmap(-1, size)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # (Linux; a kernel with THP off ignores it)
            region.madvise(mmap.MADV_HUGEPAGE)
        self._maps[key] = region
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


def take(out, name: str, shape, dtype: torch.dtype, device, *, pin: bool = False) -> torch.Tensor:
    """A batch output ``[shape]`` of ``dtype`` on ``device``: from ``out`` (a :class:`BatchBuffers`,
    or a dict of exact tensors by name, checked) or, where it holds none, a fresh tensor."""
    if isinstance(out, BatchBuffers):
        return out.take(name, shape, dtype, device)
    given = out.get(name) if isinstance(out, dict) else None
    if given is None:
        return torch.empty(tuple(shape), dtype=dtype, device=device, pin_memory=pin)
    check_out_tensor(f"out[{name!r}]", given, tuple(shape), dtype, torch.device(device))
    return given
