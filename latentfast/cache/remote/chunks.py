"""A node-shared local cache of remote objects' chunks, bounded in bytes (LRU), safe for many processes.

Layout under ``directory``, per remote object version (``key`` = a hash of URL, name, size, ETag):

- ``key.data``    a sparse file the size of the object; chunk ``c`` sits at its own offset, so a warm
                  read is one copy per span out of its memory map straight into the caller's array
                  (as fast as reading a local cache file);
- ``key.present`` one byte per chunk, memory-mapped by every process: 1 once the chunk's bytes are
                  written (into the node's page cache, which every process reads), so a reader never
                  sees a torn or missing chunk; a folder from an earlier boot (where marks may have
                  reached the disk before the bytes) is emptied when opened;
- ``key.atime``   int64 per chunk, CLOCK_MONOTONIC ns of its last use (node-wide clock): the LRU order;
- ``key.crc32``   uint32 per chunk, the CRC-32 of its bytes as downloaded (written before its mark):
                  each process checks a chunk against it before its first read of it (a process forked
                  after it opened the object shares its checks both ways: DataLoader workers), and a
                  chunk that fails (the local copy damaged on disk) is dropped and fetched again;
- ``key.claims``  empty; a POSIX byte-range lock on ``[c0, c1)`` is the right to download chunks
                  ``c0..c1-1``: one download per chunk per node. The kernel drops it if the holder dies.

A set whose files do not have the sizes its object implies (a truncated file) is made again, empty.

The folder's ``used_bytes`` holds one int64, the bytes of chunks present over all objects: every
download adds to it, eviction sets it, under a ``lockf`` of the file; so a download checks the
budget by reading one number, and only eviction scans the chunk marks.

A reader holds ``flock(LOCK_SH)`` on ``key.present`` while it reads; the evictor takes ``LOCK_EX``,
clears bits and punches the chunks' holes (``fallocate(PUNCH_HOLE)``: the disk space really goes).
Eviction and object creation run under ``directory/.lock``.

Chunk size: 16 KiB by default. A range at a random alignment costs at most one chunk more than its
own bytes at each end (a 128 KiB item: <= 1.125x, 1.06x on average; aligned rows: exactly 1.0x),
while whole-object or MiB-shard caching costs what the batches never read. Runs of missing chunks
closer than the coalescing gap become one GET, so small chunks do not mean small requests.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import fcntl
import glob
import hashlib
import mmap
import os
import threading
import time
import zlib

import numpy as np

from ...errors import InvalidArgumentError
from ..store.format import CHUNK_BYTES

_PUNCH = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]


def punch_hole(fd: int, offset: int, length: int) -> None:
    """Free ``[offset, offset + length)`` of a file's disk space; reads there return zeros."""
    if _libc.fallocate(fd, _PUNCH, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"fallocate(PUNCH_HOLE) failed: {os.strerror(err)} (the local_cache folder's filesystem must support it: ext4, xfs, btrfs, tmpfs)")


def now_ns() -> int:
    return time.monotonic_ns()


def _shared_map(path: str) -> mmap.mmap:
    with open(path, "r+b") as fh:
        return mmap.mmap(fh.fileno(), 0)


def boot_id() -> str:
    """This boot of the machine: page-cache contents never outlive it."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return "unknown"


def chunk_indices(c0s: np.ndarray, c1s: np.ndarray) -> np.ndarray:
    """The chunk indices of the half-open chunk ranges ``[c0s[i], c1s[i])``, concatenated (repeats kept)."""
    counts = c1s - c0s
    firsts = np.repeat(c0s - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    return firsts + np.arange(int(counts.sum()))


_THREAD_LOCKS: dict[str, threading.Lock] = {}
_THREAD_LOCKS_GUARD = threading.Lock()


def _fresh_thread_locks() -> None:  # a fork taken while another thread held one would deadlock the child
    global _THREAD_LOCKS_GUARD
    _THREAD_LOCKS.clear()
    _THREAD_LOCKS_GUARD = threading.Lock()


os.register_at_fork(after_in_child=_fresh_thread_locks)


class UsedBytes:
    """The shared ``used_bytes`` counter of a cache folder. Downloads mark chunks present before they
    count them, so a concurrent recount can only make it too high (evicting a little early), never too
    low; :meth:`ChunkCache.evict` recounts exactly whenever it is over the budget."""

    def __init__(self, path: str):
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self.created = os.fstat(self.fd).st_size < 8
        if self.created:
            os.ftruncate(self.fd, 8)
        self._map = mmap.mmap(self.fd, 8)
        self.value = np.frombuffer(self._map, dtype=np.int64)
        # lockf excludes processes, not the threads of one: they take this lock first, one per counter
        # file in this process (the shards of a sharded cache each open the folder's counter)
        with _THREAD_LOCKS_GUARD:
            self._thread_lock = _THREAD_LOCKS.setdefault(os.path.realpath(path), threading.Lock())

    @contextlib.contextmanager
    def locked(self):
        with self._thread_lock:
            fcntl.lockf(self.fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.lockf(self.fd, fcntl.LOCK_UN)

    def add(self, n_bytes: int) -> None:
        with self.locked():
            self.value[0] += n_bytes

    def get(self) -> int:
        return int(self.value[0])


class ObjectChunks:
    """One object's local copy: the four files above, opened by this process."""

    def __init__(self, base: str, size: int, chunk_bytes: int, used: UsedBytes, checked: np.ndarray | None = None):
        self.base, self.size, self.chunk_bytes, self.used = base, int(size), int(chunk_bytes), used
        self.n_chunks = max(1, -(-self.size // self.chunk_bytes))
        self.data_fd = os.open(base + ".data", os.O_RDWR)
        self._reader_fds: dict[int, int] = {}  # flock: readers SH (one fd per thread), evictor EX
        self.claims_fd = os.open(base + ".claims", os.O_RDWR)
        self._maps = [_shared_map(base + ".present"), _shared_map(base + ".atime"), _shared_map(base + ".crc32")]
        self.present = np.frombuffer(self._maps[0], dtype=np.uint8, count=self.n_chunks)  # plain views:
        self.atime = np.frombuffer(self._maps[1], dtype=np.int64, count=self.n_chunks)  # np.memmap slices slowly
        self.crc = np.frombuffer(self._maps[2], dtype=np.uint32, count=self.n_chunks)
        # chunks this process found intact, in memory it shares with the processes it forks (MAP_SHARED): a
        # DataLoader worker then trusts what its parent and siblings checked instead of checking every chunk again
        self.checked = np.frombuffer(mmap.mmap(-1, self.n_chunks), dtype=bool) if checked is None else checked
        self._data = None

    @property
    def data(self) -> np.ndarray:
        """The local copy, memory-mapped read-only (uint8): read only chunks marked present, under
        :meth:`reading` (a punched hole reads as zeros, never faults: the file keeps its size)."""
        if self._data is None:
            self._data = np.zeros(0, np.uint8) if self.size == 0 else np.frombuffer(mmap.mmap(self.data_fd, self.size, prot=mmap.PROT_READ), dtype=np.uint8)
        return self._data

    @contextlib.contextmanager
    def reading(self):
        """Hold the shared lock that keeps the evictor out. Each thread locks through its own file
        descriptor: an unlock through a shared one would drop another thread's lock too."""
        fd = self._reader_fds.get(threading.get_ident())
        if fd is None:
            fd = self._reader_fds[threading.get_ident()] = os.open(self.base + ".present", os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)

    def chunk_span(self, c0: int, c1: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of chunks ``c0..c1-1``."""
        return c0 * self.chunk_bytes, min(self.size, c1 * self.chunk_bytes)

    def try_claim(self, c0: int, c1: int) -> bool:
        """Take the download right of chunks ``c0..c1-1`` without waiting; False if another process has it."""
        try:
            fcntl.lockf(self.claims_fd, fcntl.LOCK_EX | fcntl.LOCK_NB, c1 - c0, c0)
            return True
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            raise

    def release(self, c0: int, c1: int) -> None:
        fcntl.lockf(self.claims_fd, fcntl.LOCK_UN, c1 - c0, c0)

    def store(self, c0: int, c1: int, data) -> None:
        """Write chunks ``c0..c1-1`` (``data`` = their bytes), then mark them present. Every process
        of the node sees the written bytes through the page cache at once; no fsync, because a
        folder written in an earlier boot is emptied on open (:meth:`ChunkCache.__init__`)."""
        start, _ = self.chunk_span(c0, c1)
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            done += os.pwrite(self.data_fd, view[done:], start + done)
        for c in range(c0, c1):
            lo, hi = self.chunk_span(c, c + 1)
            self.crc[c] = zlib.crc32(view[lo - start: hi - start])
        self.atime[c0:c1] = now_ns()
        self.present[c0:c1] = 1
        self.used.add(self._span_bytes(c0, c1))

    def intact(self, chunks: np.ndarray) -> bool:
        """Whether the present chunks of ``chunks`` (any shape) pass their CRC-32, checking those this
        process has not checked yet (under :meth:`reading`); each that fails -- damaged on the local
        disk -- is dropped, for the caller to fetch again."""
        todo = chunks[~self.checked[chunks]]
        if not todo.size:
            return True
        todo = np.unique(todo)
        todo = todo[self.present[todo] == 1]
        data = self.data
        bad = []
        for c in todo.tolist():
            start, end = self.chunk_span(c, c + 1)
            if zlib.crc32(data[start:end]) == int(self.crc[c]):
                self.checked[c] = True
            else:
                bad.append(c)
        for c in bad:
            self.drop(c, c + 1)
        return not bad

    def drop(self, c0: int, c1: int) -> None:
        """Mark chunks ``c0..c1-1`` missing (a corrupt copy: the next read fetches them again)."""
        with self.used.locked():
            present = np.flatnonzero(self.present[c0:c1]) + c0
            self.present[present] = 0
            self.checked[c0:c1] = False
            self.used.value[0] -= sum(self._span_bytes(int(c), int(c) + 1) for c in present)

    def _span_bytes(self, c0: int, c1: int) -> int:
        start, end = self.chunk_span(c0, c1)
        return end - start

    def used_bytes(self) -> int:
        n = int(np.count_nonzero(self.present))
        if n and self.present[-1]:
            n_bytes = (n - 1) * self.chunk_bytes + (self.size - (self.n_chunks - 1) * self.chunk_bytes)
        else:
            n_bytes = n * self.chunk_bytes
        return n_bytes

    def missing(self, chunks: np.ndarray) -> np.ndarray:
        """The chunks of ``chunks`` not present locally, sorted, each once."""
        return np.unique(chunks[self.present[chunks] == 0])


class ChunkCache:
    """``capacity_bytes`` of remote chunks under ``directory``, shared by every process of a node."""

    def __init__(self, directory: str, capacity_bytes: int, chunk_bytes: int = CHUNK_BYTES):
        if int(capacity_bytes) <= 0:
            raise InvalidArgumentError(f"local_cache_bytes must be positive, got {capacity_bytes!r}")
        if int(chunk_bytes) <= 0 or int(chunk_bytes) % 4096:
            raise InvalidArgumentError(f"chunk_bytes must be a positive multiple of 4096, got {chunk_bytes!r}")
        self.directory, self.capacity, self.chunk_bytes = str(directory), int(capacity_bytes), int(chunk_bytes)
        os.makedirs(self.directory, exist_ok=True)
        self._objects: dict[str, ObjectChunks] = {}
        self._inherited_checks: dict[str, np.ndarray] = {}  # (a forked process's: its parent's, see _fresh_process)
        self._pid = os.getpid()
        self.used = UsedBytes(os.path.join(self.directory, "used_bytes"))
        self._forget_other_boots()
        if self.used.created:  # a folder from before the counter existed: count it once
            fd = self._global_lock(fcntl.LOCK_EX)
            try:
                with self.used.locked():
                    self.used.value[0] = self.used_bytes()
            finally:
                os.close(fd)

    def _forget_other_boots(self) -> None:
        """Chunks are marked present after their bytes are written, not synced: after a crash the
        marks may have reached the disk without the bytes. So a folder last used in another boot
        starts empty."""
        stamp = os.path.join(self.directory, "boot_id")
        with open(stamp, "a+") as fh:
            fh.seek(0)
            if fh.read().strip() == boot_id():
                return
        fd = self._global_lock(fcntl.LOCK_EX)
        try:
            with open(stamp) as fh:
                if fh.read().strip() == boot_id():
                    return
            for path in glob.glob(os.path.join(self.directory, "*.present")):
                os.unlink(path)  # the marker first: the rest of the set is then unreachable
                for suffix in (".data", ".atime", ".claims", ".crc32"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path[: -len(".present")] + suffix)
            with open(stamp + ".tmp", "w") as fh:
                fh.write(boot_id())
            os.replace(stamp + ".tmp", stamp)
            with self.used.locked():
                self.used.value[0] = 0
        finally:
            os.close(fd)

    def __getstate__(self):
        return {"directory": self.directory, "capacity_bytes": self.capacity, "chunk_bytes": self.chunk_bytes}

    def __setstate__(self, state):
        self.__init__(**state)

    def _global_lock(self, mode: int) -> int:
        fd = os.open(os.path.join(self.directory, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, mode)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _fresh_process(self) -> None:
        """After a fork the parent's handles are not ours to lock with: open our own."""
        if self._pid != os.getpid():
            # (the parent's checks hold here too: same boot, same page cache; see ObjectChunks.checked)
            self._inherited_checks = {key: obj.checked for key, obj in self._objects.items()}
            self._objects, self._pid = {}, os.getpid()
            self.used = UsedBytes(os.path.join(self.directory, "used_bytes"))  # lockf locks are per process

    def object(self, identity: str, size: int) -> ObjectChunks:
        """The local copy of one remote object version (``identity`` names it), created on first use."""
        self._fresh_process()
        key = hashlib.sha256(f"{identity}\0{size}\0{self.chunk_bytes}".encode()).hexdigest()[:32]
        if key not in self._objects:
            base = os.path.join(self.directory, key)
            checked = self._inherited_checks.pop(key, None)
            if not self._whole(base, size):
                self._create(base, size)
                checked = None  # (a set made again: nothing in it was checked)
            self._objects[key] = ObjectChunks(base, size, self.chunk_bytes, self.used, checked)
        return self._objects[key]

    def _sizes(self, size: int) -> dict[str, int]:
        """The size each file of an object's set has (``.present``, the mark of a whole set, last)."""
        n_chunks = max(1, -(-int(size) // self.chunk_bytes))
        return {".data": int(size), ".atime": 8 * n_chunks, ".crc32": 4 * n_chunks, ".claims": 0, ".present": n_chunks}

    def _whole(self, base: str, size: int) -> bool:
        """Whether the object's set exists with every file of its size (not truncated, not of an older layout)."""
        try:
            return all(os.path.getsize(base + suffix) == n for suffix, n in self._sizes(size).items())
        except OSError:
            return False

    def _create(self, base: str, size: int) -> None:
        """Make the object's set, empty; a damaged one (see :meth:`_whole`) is made again."""
        fd = self._global_lock(fcntl.LOCK_EX)
        try:
            if self._whole(base, size):
                return
            with contextlib.suppress(FileNotFoundError):
                os.unlink(base + ".present")  # unmarked first: no process takes the rest for a whole set
            for suffix, n_bytes in self._sizes(size).items():
                with open(base + suffix + ".tmp", "wb") as fh:
                    fh.truncate(n_bytes)
                os.replace(base + suffix + ".tmp", base + suffix)  # .present last: it marks the set complete
        finally:
            os.close(fd)

    def used_bytes(self) -> int:
        """Bytes of chunks present, over every object of the folder (every process's downloads)."""
        return sum(obj.used_bytes() for obj in self._all_objects())

    def _all_objects(self) -> list[ObjectChunks]:
        self._fresh_process()
        found = []
        for path in glob.glob(os.path.join(self.directory, "*.present")):
            key = os.path.basename(path)[: -len(".present")]
            if key not in self._objects:
                base = path[: -len(".present")]
                try:
                    size = os.path.getsize(base + ".data")
                except OSError:
                    continue
                if not self._whole(base, size):  # damaged: the next reader of that object makes it again
                    continue
                self._objects[key] = ObjectChunks(base, size, self.chunk_bytes, self.used, self._inherited_checks.pop(key, None))
            found.append(self._objects[key])
        return found

    def evict(self) -> int:
        """Drop least recently used chunks until at most ``capacity`` bytes remain; returns bytes freed.
        Under the budget by the shared counter: returns at once, no scan. Skips if another process
        is evicting (it will get us under the budget)."""
        self._fresh_process()
        if self.used.get() <= self.capacity:
            return 0
        try:
            lock = self._global_lock(fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return 0
        try:
            with self.used.locked():  # the exact count, and the counter set to it
                objects = self._all_objects()
                used = sum(obj.used_bytes() for obj in objects)
                freed = self._evict_oldest(objects, used - self.capacity) if used > self.capacity else 0
                self.used.value[0] = used - freed
            return freed
        finally:
            os.close(lock)

    def _evict_oldest(self, objects: list[ObjectChunks], excess: int) -> int:
        owners, chunks, times = [], [], []
        for i, obj in enumerate(objects):
            idx = np.flatnonzero(obj.present)
            owners.append(np.full(len(idx), i))
            chunks.append(idx)
            times.append(np.asarray(obj.atime[idx]))
        owners, chunks, times = (np.concatenate(a) for a in (owners, chunks, times))
        order = np.argsort(times, kind="stable")
        sizes = np.array([objects[o].chunk_span(int(c), int(c) + 1) for o, c in zip(owners[order], chunks[order])]).reshape(-1, 2)
        n_victims = int(np.searchsorted(np.cumsum(sizes[:, 1] - sizes[:, 0]), excess)) + 1
        victims = order[:n_victims]
        for i in np.unique(owners[victims]):
            obj = objects[i]
            mine = np.sort(chunks[victims][owners[victims] == i])
            fd = os.open(obj.base + ".present", os.O_RDWR)  # its own fd: conflicts with this process's readers too
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                obj.present[mine] = 0
                for c in mine:
                    start, end = obj.chunk_span(int(c), int(c) + 1)
                    punch_hole(obj.data_fd, start, end - start)
            finally:
                os.close(fd)
        return int(sum(sizes[:n_victims, 1] - sizes[:n_victims, 0]))
