"""Running a builder's encoder: its device and batch size checked once, no autograd, under autocast when asked,
the latents back as float32 on the CPU; and the parts of an overlapped build that feed it.

A build runs in stages beside each other (:class:`Stages`): decode workers write uint8 pixels straight into
their slots of a recycled host batch buffer (:class:`BatchBuffers`; pinned when the device is CUDA), one thread copies a
finished batch to the device on a CUDA stream of its own, the caller's thread normalizes it there to the
encoder's dtype with the fused :func:`latentfast.ops.normalize_uint8` and encodes it, and a writer thread
stores the latents. Only uint8 pixels cross to the device (a quarter of the bytes of float32 ones). On a
CPU build the feed thread normalizes (the host is the device), so the caller's thread only encodes.
"""
from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from typing import NamedTuple

import torch

from ... import ops
from ...devices import as_device
from ...errors import InvalidArgumentError
from ...encoders import DiffusersVAE
from . import media

_POLL_S = 0.05  # how often a blocked stage looks whether another one failed


def encode(fn, pixels: torch.Tensor, device: torch.device, autocast_dtype: torch.dtype | None, **kwargs) -> torch.Tensor:
    """``fn(pixels on device, **kwargs)`` without gradients (under ``torch.autocast`` of
    ``autocast_dtype`` when given), as a float32 CPU tensor (a tuple of them, e.g. ``(mean, std)``,
    when ``fn`` returns a tuple)."""
    autocast = torch.autocast(device_type=device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
    with torch.no_grad(), autocast:
        z = fn(pixels.to(device), **kwargs)
    if isinstance(z, tuple):
        return tuple(t.float().cpu() for t in z)
    return z.float().cpu()


def prepare(encoder, device, batch_size):
    """``(encoder on the device, the device)`` after checking ``batch_size`` is a positive int."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be a positive int, got {batch_size!r}")
    device = as_device(device)
    return (encoder.to(device) if hasattr(encoder, "to") else encoder), device


def pixel_dtype(encoder) -> torch.dtype:
    """The dtype the encoder is handed its [-1, 1] pixels in: a :class:`~latentfast.encoders.DiffusersVAE`'s
    weights' dtype (its first step casts the pixels to it, so rounding them there once is the same),
    float32 for any other encoder (what it has always been given)."""
    return encoder.dtype if isinstance(encoder, DiffusersVAE) else torch.float32


class Stopped(Exception):
    """A stage gave up waiting because another one failed (the failure is :attr:`Stages.error`)."""


class Stages:
    """Threads running a build's stages beside the caller's, joined by small bounded queues.

    The first exception of any stage is kept in :attr:`error` and sets :attr:`stop`; every blocking wait
    of the other stages (:meth:`get`, :meth:`put`, :meth:`result`) looks at it every ``_POLL_S`` and
    raises :class:`Stopped`, so a failure anywhere ends the build promptly instead of hanging it.
    """

    def __init__(self):
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def start(self, name: str, fn, *args) -> threading.Thread:
        def run():
            try:
                fn(*args)
            except Stopped:
                pass
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                self.fail(exc)

        thread = threading.Thread(target=run, name=f"latentfast-build-{name}", daemon=True)
        thread.start()
        self.threads.append(thread)
        return thread

    def fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.stop.set()

    def _wait(self, attempt):
        while True:
            if self.stop.is_set():
                raise Stopped
            with contextlib.suppress(queue.Empty, queue.Full, TimeoutError):
                return attempt()

    def get(self, q: queue.Queue):
        return self._wait(lambda: q.get(timeout=_POLL_S))

    def put(self, q: queue.Queue, item) -> None:
        self._wait(lambda: q.put(item, timeout=_POLL_S))

    def result(self, future):
        return self._wait(lambda: future.result(timeout=_POLL_S))

    def raise_error(self) -> None:
        if self.error is not None:
            raise self.error


class _Buffer:
    """One recycled batch buffer: host bytes (pinned on CUDA), their device twin, and the CUDA events
    that say when the copy from the host is done and when the device bytes were last read."""

    def __init__(self, nbytes: int, device: torch.device):
        cuda = device.type == "cuda"
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        self.device = torch.empty(nbytes, dtype=torch.uint8, device=device) if cuda else None
        self.copy_start = torch.cuda.Event(enable_timing=True) if cuda else None
        self.copied = torch.cuda.Event(enable_timing=True) if cuda else None
        self.consumed = torch.cuda.Event() if cuda else None
        self.timed = False  # copy_start/copied hold a copy whose time is not counted yet


class Sent(NamedTuple):
    """A batch on its way to the encoder (:meth:`BatchBuffers.send`)."""

    pixels: torch.Tensor  # CUDA: uint8 on the device, in the buffer's layout; CPU: normalized already
    buf: _Buffer | None  # CUDA: the buffer whose bytes are being copied
    output: torch.Tensor | None  # CPU: the recycled output holding the normalized batch


class BatchBuffers:
    """At most ``count`` uint8 batch buffers of ``nbytes`` each, each allocated once, when first needed
    (a CPU build, which frees a buffer as soon as it is normalized, makes fewer), and recycled (no
    per-batch allocation); and the host -> device step, in two halves: :meth:`send` (the feed thread) and
    :meth:`take` (the encoder's thread).

    On CUDA, :meth:`send` copies the uint8 bytes on a stream of its own and :meth:`take` runs the fused
    normalize on the encoder's stream. On the CPU the host is the device: :meth:`send` normalizes the
    batch at once, on the feed thread, into one of at most two recycled float outputs (a fresh 100 MB
    tensor costs ten times the normalize in page faults: the second is made only when the first is
    still being encoded), so the encoder's thread only encodes; :meth:`done` hands the output back once
    the batch is encoded."""

    outputs = 2  # CPU: one batch being encoded, the next one normalized beside it

    def __init__(self, count: int, nbytes: int, device: torch.device, stages: Stages, dtype: torch.dtype = torch.float32):
        self.device, self.stages, self.cuda, self.dtype = device, stages, device.type == "cuda", dtype
        # a GPU reads channels-last bytes through strides at full speed, so the decoders' [h, w, 3] go as
        # they are; the CPU kernel is ~4x faster on planar input, so there the decoders write [3, h, w]
        self.channels_last = self.cuda
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.h2d_s = 0.0  # seconds the copies took on the device
        self.count, self.made, self.free = count, 0, queue.Queue()
        self.nbytes, self.made_outputs, self.free_outputs = nbytes, 0, queue.Queue()

    def shape(self, batch: int, size: tuple) -> tuple:
        """The layout of a batch of ``batch`` items of ``size`` ((h, w) or (T, h, w)) in a buffer."""
        return (batch, *size, 3) if self.channels_last else (batch, 3, *size)

    def place(self, slot: torch.Tensor, frames: list) -> None:
        """Write one item's decoded RGB frames (PIL images: one for an image, T for a clip) into its
        ``slot`` of a buffer, each straight from Pillow's memory (:func:`~.media.write_rgb`)."""
        array = slot.numpy()
        for t, image in enumerate(frames):
            target = array if array.ndim == 3 else array[t] if self.channels_last else array[:, t]
            media.write_rgb(image, target, planar=not self.channels_last)

    def acquire(self) -> _Buffer:
        """A free buffer whose host bytes may be written (the last copy out of them is done)."""
        # (only the feed thread acquires) CUDA: all made, so a copy in flight out of one has the others' time
        # to finish; CPU: a new one only when none is free
        if self.made < self.count and (self.cuda or self.free.empty()):
            self.made += 1
            return _Buffer(self.nbytes, self.device)
        buf = self.stages.get(self.free)
        if self.cuda:
            buf.copied.synchronize()
            self._count_copy(buf)
        return buf

    def _count_copy(self, buf: _Buffer) -> None:
        if buf.timed:
            self.h2d_s += buf.copy_start.elapsed_time(buf.copied) / 1000
            buf.timed = False

    def send(self, buf: _Buffer, shape: tuple, output: torch.Tensor | None) -> Sent:
        """The feed thread's half: the buffer's first ``prod(shape)`` bytes, a batch of ``shape``, on
        their way to the device. CUDA: copied there asynchronously on the copy stream; CPU: normalized
        now into ``output`` (from :meth:`output`), and the buffer handed back."""
        nbytes = math.prod(shape)
        if not self.cuda:
            return Sent(self.normalize(buf, buf.host[:nbytes].view(shape), output), None, output)
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(buf.consumed)  # the last normalize out of these device bytes is done
            buf.copy_start.record(self.stream)
            buf.device[:nbytes].copy_(buf.host[:nbytes], non_blocking=True)
            buf.copied.record(self.stream)
            buf.timed = True
        return Sent(buf.device[:nbytes].view(shape), buf, None)

    def output(self) -> torch.Tensor | None:
        """For :meth:`send` on the CPU (None on CUDA): a free output, one handed back, else a new one
        while fewer than :attr:`outputs` exist, else the next one handed back (only the feed thread
        calls this; the wait is the encoder's, not the feed's work)."""
        if self.cuda:
            return None
        with contextlib.suppress(queue.Empty):
            return self.free_outputs.get_nowait()
        if self.made_outputs < self.outputs:
            self.made_outputs += 1
            return torch.empty(self.nbytes, dtype=self.dtype)
        return self.stages.get(self.free_outputs)

    def take(self, sent: Sent) -> torch.Tensor:
        """The encoder thread's half: the batch ``[B, 3, ...]`` in [-1, 1] of the encoder's dtype,
        contiguous, on the device (on the CPU, normalized by :meth:`send` already)."""
        if not self.cuda:
            return sent.pixels
        torch.cuda.current_stream(self.device).wait_event(sent.buf.copied)
        return self.normalize(sent.buf, sent.pixels)

    def normalize(self, buf: _Buffer, pixels: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """A batch of uint8 pixels in the buffer's layout -> ``[B, 3, ...]`` in [-1, 1] of the encoder's
        dtype by the fused op (which reads channels-last bytes through strides), into the first bytes
        of ``out`` when given; the buffer is handed back for reuse."""
        x = pixels.movedim(-1, 1) if self.channels_last else pixels
        if out is None:
            out = ops.normalize_uint8(x, dtype=self.dtype)
        else:
            out = ops.normalize_uint8(x, dtype=self.dtype, out=out[: x.numel()].view(x.shape))
        if self.cuda:
            buf.consumed.record(torch.cuda.current_stream(self.device))
        self.free.put(buf)
        return out

    def done(self, sent: Sent) -> None:
        """``sent``'s batch is encoded: on the CPU its output may be overwritten now (see :func:`owned`
        for latents that view it)."""
        if sent.output is not None:
            self.free_outputs.put(sent.output)

    def close(self) -> None:
        """Wait for the copies in flight and count their time."""
        if self.cuda:
            self.stream.synchronize()
            while not self.free.empty():
                self._count_copy(self.free.get())


def owned(t: torch.Tensor | None, pixels: torch.Tensor) -> torch.Tensor | None:
    """``t``, copied if it shares memory with ``pixels`` (an encoder may return a view of its input,
    which on the CPU a later batch's normalize overwrites)."""
    if t is not None and t.untyped_storage().data_ptr() == pixels.untyped_storage().data_ptr():
        return t.clone()
    return t


def timed(counts: dict, key: str):
    """A context manager adding the seconds its body takes to ``counts[key]``."""

    @contextlib.contextmanager
    def section():
        t0 = time.perf_counter()
        try:
            yield
        finally:
            counts[key] += time.perf_counter() - t0

    return section()
