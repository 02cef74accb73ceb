"""Ranged reads of a folder of objects into a caller's buffer: coalesced, concurrent, verified, retried,
through an optional node-shared chunk cache (:mod:`.chunks`).

A read is a span table: per span an object name, a byte offset and length in it, a destination
offset in ``out`` and optionally the span's expected CRC-32. Spans close in one object (gap <=
``coalesce_bytes``) become one ranged GET; all GETs of a call run concurrently (at most
``max_concurrency`` in flight) on one background asyncio loop per process. With ``local_cache`` the
unit fetched is a run of adjacent missing chunks instead (its claim must not cover chunks another
download of this process holds), and a warm read is one copy per span out of a memory map of
the node's local copy.

Failures: the client retries 5xx / 503 SlowDown / 429 / dropped connections / timeouts (see
:mod:`.storage`); on top, a run that comes back short, fails mid-body, or fails its CRC-32 is
fetched again, up to ``read_attempts`` times with exponential backoff and full jitter. What is still
wrong raises :class:`RemoteReadError` / :class:`RemoteCorruptError` naming the object and byte range;
``out`` is then not to be used (a failed call never returns).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
import random
import threading
import zlib

import numpy as np

from ...errors import InvalidArgumentError
from .chunks import CHUNK_BYTES, ChunkCache, ObjectChunks, chunk_indices, now_ns
from .errors import RemoteCorruptError, RemoteNotFoundError, RemoteReadError, RemoteReplacedError
from .storage import ObjectFolder

COALESCE_BYTES = 64 << 10  # a GET costs a round trip; 64 KiB more bytes cost less than one more request
MAX_CONCURRENCY = 64  # GETs in flight at once per reader (or per ConcurrencyLimit shared by several)
_loop_state = {"pid": None, "loop": None}
_loop_guard = threading.Lock()


def _after_fork_in_child() -> None:
    global _loop_guard
    _loop_guard = threading.Lock()  # a fork taken while another thread held it would deadlock here


os.register_at_fork(after_in_child=_after_fork_in_child)


def _loop() -> asyncio.AbstractEventLoop:
    """This process's background event loop (a fork gets its own)."""
    with _loop_guard:
        if _loop_state["pid"] != os.getpid():
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="latentfast-remote", daemon=True).start()
            _loop_state.update(pid=os.getpid(), loop=loop)
        return _loop_state["loop"]


def coalesce(starts: np.ndarray, ends: np.ndarray, gap: int) -> tuple[np.ndarray, np.ndarray]:
    """Merge ``[starts, ends)`` ranges whose gap is at most ``gap`` bytes: sorted run starts and ends."""
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], np.maximum.accumulate(ends[order])
    new_run = np.ones(len(s), dtype=bool)
    new_run[1:] = s[1:] > e[:-1] + gap
    first = np.flatnonzero(new_run)
    last = np.append(first[1:], len(s)) - 1
    return s[first], e[last]


def _as_int64(name: str, values, n: int | None = None) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidArgumentError(f"{name} must be a 1-D sequence of integers, got {arr.dtype} of shape {arr.shape}")
    if n is not None and len(arr) != n:
        raise InvalidArgumentError(f"{name} must have one entry per span ({n}), got {len(arr)}")
    if arr.size and arr.min() < 0:
        raise InvalidArgumentError(f"{name} must be >= 0, got {int(arr.min())}")
    return arr.astype(np.int64)


def _byte_view(out) -> memoryview:
    try:
        view = memoryview(out).cast("B")
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"out must be a writable C-contiguous buffer (numpy uint8 array, bytearray, memoryview), got {type(out).__name__}: {exc}") from exc
    if view.readonly:
        raise InvalidArgumentError("out must be writable, got a read-only buffer")
    return view


def _group(names, n: int) -> dict[str, np.ndarray]:
    """Span indices per object name (``names``: one per span, or one name for all ``n``)."""
    if isinstance(names, str):
        return {names: np.arange(n)}
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(name, []).append(i)
    return {name: np.asarray(idx, dtype=np.int64) for name, idx in groups.items()}


class ConcurrencyLimit:
    """At most ``n`` GETs in flight over every :class:`RemoteReader` handed it (``limit=``). The shards
    of a sharded cache share one: as in one cache, a batch's GETs (queued first) are then served before
    the next batch's prefetch, instead of beside it, the server's bandwidth split between the two and the
    batch kept waiting until both are done. Its semaphore is made per process, on the fetching loop."""

    def __init__(self, n: int = MAX_CONCURRENCY):
        if int(n) < 1:
            raise InvalidArgumentError(f"max_concurrency must be >= 1, got {n}")
        self.n = int(n)
        self._pid = self._semaphore = None

    def semaphore(self) -> asyncio.Semaphore:
        if self._pid != os.getpid():
            self._pid, self._semaphore = os.getpid(), asyncio.Semaphore(self.n)
        return self._semaphore

    def __getstate__(self):
        return {"n": self.n}

    def __setstate__(self, state):
        self.__init__(state["n"])


class RemoteReader:
    """Reads byte spans of the objects under ``url`` (see the module docstring).

    ``local_cache`` / ``local_cache_bytes``: a folder and byte budget for the node-shared chunk cache
    (both or neither); ``chunk_bytes``: its granularity. ``coalesce_bytes``: the largest gap merged
    into one GET. ``read_attempts``: fetches of one run before giving up (each with the client's own
    retries inside). ``limit``: a :class:`ConcurrencyLimit` shared with other readers, in place of
    ``max_concurrency``. Picklable for DataLoader workers.
    """

    def __init__(self, url: str, storage_options: dict | None = None, *, local_cache: str | None = None,
                 local_cache_bytes: int | None = None, chunk_bytes: int = CHUNK_BYTES,
                 coalesce_bytes: int = COALESCE_BYTES, max_concurrency: int = MAX_CONCURRENCY, read_attempts: int = 3,
                 retry_backoff: float = 0.05, limit: ConcurrencyLimit | None = None):
        if (local_cache is None) != (local_cache_bytes is None):
            raise InvalidArgumentError(f"local_cache and local_cache_bytes go together, got local_cache={local_cache!r}, local_cache_bytes={local_cache_bytes!r}")
        if int(read_attempts) < 1 or int(max_concurrency) < 1 or int(coalesce_bytes) < 0:
            raise InvalidArgumentError(f"read_attempts and max_concurrency must be >= 1 and coalesce_bytes >= 0, got {read_attempts}, {max_concurrency}, {coalesce_bytes}")
        self.folder = ObjectFolder(url, storage_options)
        self.cache = None if local_cache is None else ChunkCache(local_cache, local_cache_bytes, chunk_bytes)
        self.limit = ConcurrencyLimit(max_concurrency) if limit is None else limit
        self.coalesce_bytes, self.max_concurrency = int(coalesce_bytes), self.limit.n
        self.read_attempts, self.retry_backoff = int(read_attempts), float(retry_backoff)
        self.pinned_heads: dict[str, tuple[int, str]] = {}  # (size, version) of objects read as these versions only
        self._fresh()

    def _fresh(self) -> None:
        self._heads: dict[str, tuple[int, str]] = dict(self.pinned_heads)
        self._inflight: dict[tuple[str, int], asyncio.Future] = {}
        self._pid = os.getpid()
        self.stats = {"requests": 0, "bytes_fetched": 0, "bytes_local": 0}

    def __getstate__(self):
        state = self.__dict__.copy()
        state["pinned_heads"] = {**self._heads, **self.pinned_heads}  # a worker reads the versions this reader read
        for k in ("_heads", "_inflight", "_pid", "stats"):
            state.pop(k)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._fresh()

    def _run(self, coro):
        if self._pid != os.getpid():
            self._fresh()
        return asyncio.run_coroutine_threadsafe(coro, _loop())

    # ---- public API -------------------------------------------------------------------------

    def size(self, name: str) -> int:
        """Bytes of object ``name``."""
        return self._head(name)[0]

    def read_ranges(self, name: str, offsets, lengths, out, dest_offsets=None, crc32=None, blocks=None) -> None:
        """Copy ``[offsets[i], offsets[i] + lengths[i])`` of object ``name`` into ``out`` at
        ``dest_offsets[i]`` (default: packed back to back). ``crc32[i]`` (int or None) is span i's
        expected CRC-32. ``blocks=(block_offsets, block_lengths, block_crc32)`` names checksum blocks
        instead: every span must lie in one, and each needed block is fetched whole and verified."""
        lengths = _as_int64("lengths", lengths)
        if blocks is not None:
            return self._read_in_blocks(name, offsets, lengths, out, dest_offsets, blocks)
        self.read_spans(name, offsets, lengths, out, dest_offsets, crc32)

    def read_spans(self, names, offsets, lengths, out, dest_offsets=None, crc32=None) -> None:
        """The batch form over several objects (``names``: one per span, or one name for all): span
        i is ``names[i]``'s bytes ``[offsets[i], offsets[i] + lengths[i])``, copied to
        ``out[dest_offsets[i]:]`` and checked against ``crc32[i]`` when it is not None. Spans whose
        chunks are all in the local cache are read in the calling thread; the rest in one concurrent
        gather on the background loop."""
        by_name, view = self._spans(names, offsets, lengths, out, dest_offsets, crc32), _byte_view(out)
        if self.cache is not None:  # what is local is read here, without a trip through the event loop
            by_name = {name: rest for name, spans in by_name.items() if len((rest := self._read_warm(name, *spans, view))[0])}
        if by_name:
            self._run(self._read_all(by_name, view)).result()

    def _read_warm(self, name, offsets, lengths, dests, crcs, out) -> tuple:
        """Read the spans whose chunks are all local and pass their CRC-32; returns the others."""
        if self._pid != os.getpid():
            self._fresh()
        ends = offsets + lengths
        missed = self._read_local(self._chunks(name), offsets, ends, dests, out)
        for i in np.flatnonzero(~missed) if crcs is not None else ():
            if crcs[i] is not None and zlib.crc32(out[dests[i]: dests[i] + lengths[i]]) != int(crcs[i]):
                missed[i] = True  # the event loop's path drops these chunks and fetches the span again
        return offsets[missed], lengths[missed], dests[missed], None if crcs is None else [c for c, m in zip(crcs, missed) if m]

    def prefetch(self, name: str, offsets, lengths) -> concurrent.futures.Future:
        """Start fetching these spans of ``name`` into the local chunk cache; returns at once with a
        future (done when the chunks are local). Without ``local_cache`` there is nowhere to keep
        them: the future is already done and nothing is fetched."""
        return self.prefetch_spans(name, offsets, lengths)

    def prefetch_spans(self, names, offsets, lengths) -> concurrent.futures.Future:
        """:meth:`prefetch` for a span table over several objects (``names`` as in :meth:`read_spans`)."""
        n = len(np.atleast_1d(lengths)) if isinstance(names, str) else len(names)
        offsets, lengths = _as_int64("offsets", offsets, n), _as_int64("lengths", lengths, n)
        if self.cache is None:
            done = concurrent.futures.Future()
            done.set_result(None)
            return done
        groups = {name: idx[lengths[idx] > 0] for name, idx in _group(names, n).items()}
        for name, idx in groups.items():
            self._check_bounds(name, offsets[idx], lengths[idx])
        return self._run(self._ensure_all({name: (offsets[idx], offsets[idx] + lengths[idx]) for name, idx in groups.items() if len(idx)}))

    async def _ensure_all(self, spans: dict) -> None:
        await asyncio.gather(*(self._ensure_local(name, starts, ends) for name, (starts, ends) in spans.items()))

    # ---- validation ---------------------------------------------------------------------------

    def _head(self, name: str) -> tuple[int, str]:
        if self._pid != os.getpid():
            self._fresh()
        if name not in self._heads:
            self._heads[name] = self.folder.head(name)
        return self._heads[name]

    def _check_bounds(self, name: str, offsets: np.ndarray, lengths: np.ndarray) -> None:
        size = self.size(name)
        ends = offsets + lengths
        if len(ends) and ends.max() > size:
            i = int(np.argmax(ends))
            raise InvalidArgumentError(f"span {i} of {self.folder.where(name, int(offsets[i]), int(ends[i]))} ends past the object's {size} bytes")

    def _spans(self, names, offsets, lengths, out, dest_offsets, crc32) -> dict:
        n = len(np.atleast_1d(lengths)) if isinstance(names, str) else len(names)
        offsets, lengths = _as_int64("offsets", offsets, n), _as_int64("lengths", lengths, n)
        dests = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if dest_offsets is None else _as_int64("dest_offsets", dest_offsets, n)
        crcs = None if crc32 is None else list(crc32)  # None: no span has one (the common case, no per-span work)
        if crcs is not None and len(crcs) != n:
            raise InvalidArgumentError(f"crc32 must have one entry per span ({n}), got {len(crcs)}")
        capacity = _byte_view(out).nbytes
        if n and (dests + lengths).max() > capacity:
            i = int(np.argmax(dests + lengths))
            raise InvalidArgumentError(f"out holds {capacity} bytes, span {i} needs [{dests[i]}, {dests[i] + lengths[i]})")
        by_name = {}
        for name, idx in _group(names, n).items():
            idx = idx[lengths[idx] > 0]
            self._check_bounds(name, offsets[idx], lengths[idx])
            by_name[name] = (offsets[idx], lengths[idx], dests[idx], None if crcs is None else [crcs[i] for i in idx])
        return by_name

    # ---- fetching -----------------------------------------------------------------------------

    async def _fetch(self, name: str, start: int, end: int):
        """Bytes ``[start, end)`` of ``name`` from the network: complete, of the version this reader
        first saw (``If-Match`` on its ETag: :class:`RemoteReplacedError` once a push replaced it), or
        an error naming them."""
        version = self._head(name)[1]
        last = None
        for attempt in range(self.read_attempts):
            if attempt:  # exponential backoff with full jitter
                await asyncio.sleep(self.retry_backoff * (2 ** attempt) * random.random())
            try:
                async with self.limit.semaphore():
                    data = await self.folder.get_range(name, start, end, version)
            except (RemoteNotFoundError, RemoteReplacedError):
                raise
            except RemoteReadError as exc:
                last = exc
                continue
            self.stats["requests"] += 1
            self.stats["bytes_fetched"] += len(data)
            if len(data) == end - start:
                return data
            last = RemoteReadError(f"{self.folder.where(name, start, end)}: short read, {len(data)} of {end - start} bytes")
        raise RemoteReadError(f"{self.folder.where(name, start, end)}: failed after {self.read_attempts} attempts: {last}")

    async def _read_all(self, by_name: dict, out: memoryview) -> None:
        await asyncio.gather(*(self._read_object(name, *spans, out) for name, spans in by_name.items()))

    async def _read_object(self, name, offsets, lengths, dests, crcs, out) -> None:
        if not len(offsets):
            return
        ends = offsets + lengths
        if self.cache is None:
            await self._read_direct(name, offsets, ends, dests, out)
        else:
            await self._ensure_local(name, offsets, ends)
            missed = self._read_local(self._chunks(name), offsets, ends, dests, out)
            if missed.any():  # evicted by another process in between: straight from the network
                await self._read_direct(name, offsets[missed], ends[missed], dests[missed], out)
        await self._verify(name, offsets, ends, dests, crcs, out)

    async def _read_direct(self, name, starts, ends, dests, out) -> None:
        run_starts, run_ends = coalesce(starts, ends, self.coalesce_bytes)
        datas = await asyncio.gather(*(self._fetch(name, int(s), int(e)) for s, e in zip(run_starts, run_ends)))
        run_of = np.searchsorted(run_starts, starts, side="right") - 1
        for s, e, d, r in zip(starts, ends, dests, run_of):
            lo = int(s - run_starts[r])
            out[int(d): int(d + e - s)] = memoryview(datas[r])[lo: lo + int(e - s)]

    async def _verify(self, name, starts, ends, dests, crcs, out) -> None:
        """Check each span with an expected CRC-32; a failing one is fetched again (never from the
        local cache, whose chunks of it are dropped) until it passes or the attempts run out."""
        if crcs is None:
            return
        for s, e, d, crc in zip(starts, ends, dests, crcs):
            if crc is None or zlib.crc32(out[int(d): int(d + e - s)]) == int(crc):
                continue
            if self.cache is not None:
                obj = self._chunks(name)
                obj.drop(int(s) // obj.chunk_bytes, (int(e) - 1) // obj.chunk_bytes + 1)
            for _ in range(self.read_attempts):
                data = await self._fetch(name, int(s), int(e))
                if zlib.crc32(data) == int(crc):
                    out[int(d): int(d + e - s)] = memoryview(data)
                    break
            else:
                got = zlib.crc32(out[int(d): int(d + e - s)])
                raise RemoteCorruptError(f"{self.folder.where(name, int(s), int(e))}: CRC-32 {got:#010x} != expected {int(crc):#010x} on {self.read_attempts + 1} fetches")

    # ---- the local chunk cache ----------------------------------------------------------------

    def _chunks(self, name: str) -> ObjectChunks:
        size, version = self._head(name)
        return self.cache.object(f"{self.folder.url}/{name}\0{version}", size)

    def _read_local(self, obj: ObjectChunks, starts, ends, dests, out) -> np.ndarray:
        """Copy each span out of the local copy's memory map; returns which spans had a chunk missing.
        (A map, not a ``preadv`` per span: once its pages are mapped a copy is a plain memcpy, no
        page-cache lookup per 4 KiB page; bench_remote measured preadv at 0.7x a local file. The
        compiled ``ops.read_spans`` with one thread measured 0.49x a local preadv loop under load: its
        work waits on another thread.)"""
        c0s, c1s = starts // obj.chunk_bytes, (ends - 1) // obj.chunk_bytes + 1
        grid = np.minimum(c0s[:, None] + np.arange(int((c1s - c0s).max())), c1s[:, None] - 1)  # a row of chunks per span
        dst = np.frombuffer(out, dtype=np.uint8)
        with obj.reading():  # the evictor waits until we are done
            have = obj.present[grid].all(axis=1)
            if have.any() and not obj.intact(grid[have]):  # damaged local chunks were dropped: fetched again
                have = obj.present[grid].all(axis=1)
            data = obj.data
            for s, e, d in zip(starts[have].tolist(), ends[have].tolist(), dests[have].tolist()):
                dst[d: d + e - s] = data[s: e]
            obj.atime[grid[have]] = now_ns()
        self.stats["bytes_local"] += int((ends - starts)[have].sum())
        return ~have

    async def _ensure_local(self, name: str, starts, ends) -> None:
        """Every chunk under these spans present locally: each downloaded once per node."""
        obj = self._chunks(name)
        missing = obj.missing(chunk_indices(starts // obj.chunk_bytes, (ends - 1) // obj.chunk_bytes + 1))
        if not len(missing):
            return
        waits = {self._inflight[(obj.base, c)] for c in missing.tolist() if (obj.base, c) in self._inflight}
        missing = np.array([c for c in missing.tolist() if (obj.base, c) not in self._inflight], dtype=np.int64)
        tasks = []
        if len(missing):  # runs of adjacent chunks only: a run's claim never covers another task's chunk
            run_c0, run_c1 = coalesce(missing, missing + 1, 0)
            for c0, c1 in zip(run_c0.tolist(), run_c1.tolist()):
                task = asyncio.ensure_future(self._download_run(name, obj, c0, c1))
                keys = [(obj.base, c) for c in range(c0, c1)]
                self._inflight.update(dict.fromkeys(keys, task))
                task.add_done_callback(lambda _t, keys=keys: [self._inflight.pop(k, None) for k in keys])
                tasks.append(task)
        await asyncio.gather(*tasks, *waits)
        if tasks:
            self.cache.evict()

    async def _download_run(self, name: str, obj: ObjectChunks, c0: int, c1: int) -> None:
        """Hold the node-wide claim on chunks ``c0..c1-1`` (waiting while another process downloads
        them), then fetch whichever of them are still missing."""
        delay = 0.002
        while not obj.try_claim(c0, c1):
            await asyncio.sleep(delay)
            delay = min(0.05, delay * 2)
        try:
            missing = np.flatnonzero(obj.present[c0:c1] == 0) + c0
            if not len(missing):
                return
            run_c0, run_c1 = coalesce(missing, missing + 1, 0)
            async def one(a: int, b: int) -> None:
                start, end = obj.chunk_span(a, b)
                obj.store(a, b, await self._fetch(name, start, end))
            await asyncio.gather(*(one(int(a), int(b)) for a, b in zip(run_c0, run_c1)))
        finally:
            obj.release(c0, c1)

    def _read_in_blocks(self, name, offsets, lengths, out, dest_offsets, blocks) -> None:
        """Spans checked by the checksum blocks that hold them: fetch each needed block whole (through
        the chunk cache when there is one), verify it, copy the spans out of it."""
        offsets = _as_int64("offsets", offsets, len(lengths))
        b_off, b_len = _as_int64("block_offsets", blocks[0]), _as_int64("block_lengths", blocks[1])
        b_crc = list(blocks[2])
        if not (len(b_off) == len(b_len) == len(b_crc)) or (len(b_off) > 1 and (np.diff(b_off) <= 0).any()):
            raise InvalidArgumentError("blocks must be (offsets, lengths, crc32) of equal length with increasing offsets")
        owner = np.searchsorted(b_off, offsets, side="right") - 1
        bad = (owner < 0) | (offsets + lengths > b_off[np.maximum(owner, 0)] + b_len[np.maximum(owner, 0)])
        if bad.any():
            i = int(np.argmax(bad))
            raise InvalidArgumentError(f"span {i} ({self.folder.where(name, int(offsets[i]), int(offsets[i] + lengths[i]))}) lies in no single checksum block")
        used = np.unique(owner)
        scratch = np.empty(int(b_len[used].sum()), dtype=np.uint8)
        self.read_ranges(name, b_off[used], b_len[used], scratch, crc32=[b_crc[b] for b in used])
        at = dict(zip(used.tolist(), np.concatenate([[0], np.cumsum(b_len[used])[:-1]]).tolist()))
        dests = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if dest_offsets is None else _as_int64("dest_offsets", dest_offsets, len(lengths))
        view = _byte_view(out)
        for o, n, d, b in zip(offsets.tolist(), lengths.tolist(), dests.tolist(), owner.tolist()):
            lo = at[b] + o - int(b_off[b])
            view[d: d + n] = scratch[lo: lo + n].data
