"""The one durable-write protocol of every cache writer: whole writes, the progress log, the finish step, content hashes, the build lock.

Every writer (the line builder, :class:`~latentfast.cache.LatentCacheWriter` and so the image, video
and import builds) follows the same steps: write whole rows (:func:`pwrite_all`), ``fdatasync`` the
data, then append their records to the progress log (:func:`append_log`: a record is never ahead of
its data); on reopen, :func:`read_log` keeps a log only if its header matches this build (a torn
last line is cut off; :func:`iter_log` streams it, for a log too long to hold), which is the one
resume rule; reading the data back against the logged CRCs is the writer's, then :func:`publish` finishes: old meta out, index files in, data renamed into
place, the meta (the completion mark) last, the log removed.

- :func:`pwrite_all` writes every byte or raises: ``os.pwrite`` may write fewer bytes than asked
  (a disk filling up), and a loop that ignores the count leaves zeros where a latent should be.
- :func:`content_hash` hashes a source file's bytes (16 bytes: BLAKE2b, or SHA-256 cut to 16 bytes for
  the images and clips of caches stamped so): what decides whether an edited image must be encoded again.
- :class:`BuildLock` is an exclusive ``fcntl.flock`` on ``.{split}.latents.lock`` in the cache
  folder, held for a whole build: a second build of the same split into the same folder waits up to
  ``timeout`` seconds, then raises :class:`~latentfast.errors.CacheLockedError` naming the holder.
  The holder deletes the lock file on release, still holding the lock; a locker that took the lock
  on a file already deleted (its inode no longer the one at the path) lets go and tries again.
- :func:`publish` stamps the meta with the CRC-32 of each index file (``files``; the checksums file
  among them covers the data): the meta names one generation of the cache's content, so a reader
  that finds the meta unchanged reads one generation whole (or raises), and verify and the rebuild
  find a damaged index file. Publishing the same content twice gives the same bytes.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import io
import json
import os
import socket
import sys
import time
import zlib
from typing import NamedTuple

import numpy as np

from ...errors import CacheLockedError, InvalidArgumentError
from . import format as fmt

HASH_BYTES = 16


def pwrite_all(fd: int, payload, offset: int) -> None:
    """Write all of ``payload`` at ``offset``; a write that makes no progress raises ``OSError(ENOSPC)``."""
    view = memoryview(payload).cast("B")
    done = 0
    while done < len(view):
        written = os.pwrite(fd, view[done:], offset + done)
        if written <= 0:
            raise OSError(errno.ENOSPC, f"write made no progress at byte {offset + done} (disk full?)")
        done += written


def read_log(path: str, header: bytes) -> list[dict] | None:
    """The records (one JSON object a line) of the progress log at ``path`` after its ``header``.
    A torn last line (a crash mid-append) is cut off the file; a missing log, another header or an
    unreadable line gives None (nothing of it can be trusted: the build starts over)."""
    records = iter_log(path, header)
    if records is None:
        return None
    try:
        return list(records)
    except ValueError:
        return None


def iter_log(path: str, header: bytes):
    """:func:`read_log` one record at a time (the log is never held whole): None for a missing log or
    another header, else an iterator of the records that raises ``ValueError`` at an unreadable line.
    The torn last line, if any, is cut off the file first."""
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return None
    with fh:
        if fh.read(len(header)) != header:
            return None
        end = fh.seek(0, os.SEEK_END)
        while end > len(header):  # the end of the last whole line (reading back from the end)
            start = max(len(header), end - (1 << 16))
            fh.seek(start)
            tail = fh.read(end - start)
            cut = tail.rfind(b"\n")
            if cut >= 0:
                end = start + cut + 1
                break
            end = start
    os.truncate(path, end)  # appending resumes after the last whole record
    return _records(path, len(header))


def _records(path: str, start: int):
    with open(path, "rb") as fh:
        fh.seek(start)
        for line in iter(fh.readline, b""):
            yield json.loads(line)


_LOG_ENCODER = json.JSONEncoder(sort_keys=True)  # json.dumps(r, sort_keys=True) without building an encoder per record


def log_bytes(header: bytes, records) -> bytes:
    return header + b"".join(_LOG_ENCODER.encode(r).encode() + b"\n" for r in records)


def rewrite_log(path: str, header: bytes, records=()) -> None:
    """The log as ``header`` + ``records``, durably, through an atomic rename (a torn rewrite must not
    lose the records kept)."""
    fmt.write_bytes_durably(path, log_bytes(header, records))


def item_lines(keys, shape: list, crcs, hashes) -> str:
    """The log lines of plain float16 items (no fields, no info): exactly ``log_bytes`` of their
    records ``{"c": crc, "h": hash (if any), "k": key, "s": shape}``, made without a JSON encoder per
    record (the bulk path of tiny items: the encoder alone would cost ~2 us an item)."""
    quote, dims = json.encoder.encode_basestring_ascii, json.dumps(shape)
    return "".join([f'{{"c": {c}, "k": {quote(k)}, "s": {dims}}}\n' if h is None else
                    f'{{"c": {c}, "h": "{h}", "k": {quote(k)}, "s": {dims}}}\n' for k, c, h in zip(keys, crcs, hashes)])


def append_log(fh, records) -> None:
    """Append ``records`` to the open log ``fh`` and make them durable (their data must already be)."""
    append_lines(fh, log_bytes(b"", records))


def append_lines(fh, lines: bytes) -> None:
    """Append whole log ``lines`` to the open log ``fh`` and make them durable (their data must already be)."""
    fh.write(lines)
    fh.flush()
    os.fsync(fh.fileno())


def rewrite_log_prefix(path: str, header: bytes, keep: int) -> None:
    """The log at ``path`` cut to its header and first ``keep`` records, durably, through an atomic
    rename (copied a line at a time: the log is never held whole)."""
    with open(path, "rb") as src, DurableFile(path) as dst:
        dst.write(src.read(len(header)))
        for _ in range(keep):
            dst.write(src.readline())
    dst.written.publish(path)
    fmt.fsync_dir(os.path.dirname(path) or ".")


class Written(NamedTuple):
    """A file written and fsynced at ``path`` (a temporary name) whose bytes have CRC-32 ``crc``: what
    :func:`publish` renames into place, for an index file too large to hand over as bytes."""
    path: str
    crc: int

    def publish(self, final: str) -> None:
        os.replace(self.path, final)


class DurableFile:
    """A file written in order at ``partial_path(path)``, its CRC-32 kept as it goes; leaving the
    ``with`` block without an error fsyncs it and sets :attr:`written` (a :class:`Written`)."""

    def __init__(self, path: str):
        self.tmp = fmt.partial_path(path)
        self.fh = open(self.tmp, "wb")
        self.crc, self.size, self.written = 0, 0, None

    def write(self, payload) -> None:
        self.crc = zlib.crc32(payload, self.crc)
        self.size += len(memoryview(payload).cast("B"))
        self.fh.write(payload)

    def __enter__(self) -> "DurableFile":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if exc_type is None:
                self.fh.flush()
                os.fsync(self.fh.fileno())
                self.written = Written(self.tmp, self.crc)
        finally:
            self.fh.close()


class NpyFile(DurableFile):
    """An ``.npy`` file of ``dtype`` ``shape`` written in chunks of rows: the bytes ``np.save`` writes
    for the whole array (its version 1.0 header, then the C-order data). :attr:`header_bytes` is where
    the data starts."""

    def __init__(self, path: str, dtype, shape: tuple):
        super().__init__(path)
        self.dtype, self.shape = np.dtype(dtype), tuple(int(x) for x in shape)
        head = io.BytesIO()
        np.lib.format.write_array_header_1_0(head, {"descr": np.lib.format.dtype_to_descr(self.dtype),
                                                     "fortran_order": False, "shape": self.shape})
        self.header_bytes = len(head.getvalue())
        self.write(head.getvalue())

    def rows(self, array) -> None:
        """Append rows (of the file's dtype and trailing shape)."""
        self.write(np.ascontiguousarray(array, dtype=self.dtype).view(np.uint8))

    def __exit__(self, exc_type, exc, tb) -> None:
        expected = self.header_bytes + self.dtype.itemsize * int(np.prod(self.shape, dtype=np.int64))
        if exc_type is None and self.size != expected:
            self.fh.close()
            raise RuntimeError(f"{self.tmp}: {self.size} bytes written, its header says {expected}")  # a writer bug, never data
        super().__exit__(exc_type, exc, tb)


def publish(paths: dict, data_src: str, files: dict, meta: dict, renames=()) -> None:
    """The finish step: the old meta out (an older cache here no longer opens as complete), each
    index file of ``files`` (kind -> bytes, or None: remove a leftover of another cache) written
    durably, the data at ``data_src`` renamed to ``paths["data"]``, the meta (the completion mark)
    last, then the progress log removed. ``renames``: more ``(partial, final)`` data files (a
    cache's fields) renamed with the data. The meta records the index files' CRC-32s (``files``).
    A :class:`Written` payload is a file already written durably under a temporary name: renamed
    into place (and covered by the same directory fsync before the meta)."""
    crcs = {kind: p.crc for kind, p in files.items() if isinstance(p, Written)}
    meta = {**meta, "files": dict(sorted({**fmt.file_crcs({k: p for k, p in files.items() if not isinstance(p, Written)}),
                                          **crcs}.items()))}
    folder = os.path.dirname(paths["meta"]) or "."
    with contextlib.suppress(FileNotFoundError):
        os.remove(paths["meta"])
    fmt.fsync_dir(folder)
    for kind, payload in files.items():
        if payload is None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(paths[kind])
        elif isinstance(payload, Written):
            payload.publish(paths[kind])
        else:
            fmt.write_bytes_durably(paths[kind], payload)
    if data_src != paths["data"]:
        os.replace(data_src, paths["data"])
    for src, dst in renames:
        os.replace(src, dst)
    fmt.fsync_dir(folder)
    fmt.write_meta(paths["meta"], meta)
    with contextlib.suppress(FileNotFoundError):
        os.remove(paths["progress"])
    fmt.fsync_dir(folder)


def file_size(path: str) -> int:
    """Bytes of the file at ``path``, or -1 when there is none (a partial file not yet created)."""
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


# the algorithms a source's content hash may be computed with (16 bytes each), and the one of every cache whose
# meta names none (``content_hash``): the builders compare an existing cache's stored hashes with its own algorithm
CONTENT_HASHES = ("blake2b-128", "sha256-128")
LEGACY_CONTENT_HASH = "blake2b-128"


def content_hash(paths, chunk: int = 1 << 20, *, algorithm: str = LEGACY_CONTENT_HASH, data: bytes | None = None) -> bytes:
    """The 16-byte hash of the bytes of one file, or of several files in order (names included):
    ``algorithm`` ``"blake2b-128"`` (BLAKE2b, digest size 16) or ``"sha256-128"`` (SHA-256's first 16
    bytes; hashlib runs it on the CPU's SHA extensions where it has them). Both keep 128 bits, so finding
    two sources with one hash takes ~2^64 work for either. ``data``: the bytes of the one file, already
    read (hashed instead of reading the file again)."""
    if algorithm == "blake2b-128":
        digest = hashlib.blake2b(digest_size=HASH_BYTES)
    elif algorithm == "sha256-128":
        digest = hashlib.sha256()
    else:
        raise InvalidArgumentError(f"algorithm must be one of {CONTENT_HASHES} (the content hashes this version computes), "
                                   f"got {algorithm!r}")
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if data is not None and len(paths) != 1:
        raise InvalidArgumentError(f"data= holds the bytes of one file; {len(paths)} paths were given")
    for path in paths:
        digest.update(os.path.basename(os.fspath(path)).encode() + b"\0")
        if data is not None:
            digest.update(data)
            continue
        with open(path, "rb") as fh:
            while block := fh.read(chunk):
                digest.update(block)
    return digest.digest()[:HASH_BYTES]


def lock_path(cache_dir: str | os.PathLike, split: str) -> str:
    return os.path.join(os.fspath(cache_dir), f".{split}.latents.lock")  # hidden: not one of the cache's files


class BuildLock:
    """Exclusive build lock on one split of a cache folder (a context manager; also ``release()``)."""

    def __init__(self, cache_dir: str | os.PathLike, split: str, timeout: float = 0.0):
        self._fd = -1
        os.makedirs(cache_dir, exist_ok=True)
        self.path = lock_path(cache_dir, split)
        deadline = time.monotonic() + max(0.0, float(timeout))
        while not self._try_lock():
            if time.monotonic() >= deadline:
                raise CacheLockedError(
                    f"another build holds the lock {self.path} ({self._holder()}); wait for it to finish "
                    f"(or pass a lock timeout to wait for it)"
                ) from None
            time.sleep(0.05)
        os.ftruncate(self._fd, 0)
        note = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                "command": " ".join(sys.argv)[:300]}
        os.pwrite(self._fd, (json.dumps(note) + "\n").encode(), 0)  # informative only: a short write is harmless

    def _try_lock(self) -> bool:
        """Take the lock on the file now at the path; False if another holds it. A file its holder
        deleted while we waited is not the lock any more: try again on the path's new file."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:
            current = os.stat(self.path).st_ino
        except FileNotFoundError:
            current = None
        if current != os.fstat(fd).st_ino:
            os.close(fd)  # deleted by its last holder after we opened it
            return self._try_lock()
        self._fd, self._pid = fd, os.getpid()
        return True

    def _holder(self) -> str:
        try:
            with open(self.path, encoding="utf-8") as fh:
                note = json.loads(fh.read() or "{}")
            return f"pid {note.get('pid')} on {note.get('host')} since {note.get('since')}: {note.get('command')}"
        except (OSError, ValueError):
            return "holder unknown"

    def release(self) -> None:
        if self._fd < 0:
            return
        if self._pid == os.getpid():  # a forked child's copy closes its descriptor only: the lock is its parent's
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)  # while still holding it: a waiter sees the inode change and retries
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = -1

    def __enter__(self) -> "BuildLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __del__(self) -> None:
        self.release()
