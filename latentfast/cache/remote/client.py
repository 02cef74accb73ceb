"""The object-store calls themselves (obstore; stdlib only besides), and the helper process that makes
them for a process forked after it used the client.

Why a helper: obstore runs every request on one process-wide tokio runtime (pyo3-async-runtimes'
``get_runtime()``: a multi-threaded runtime in a static ``OnceCell``, made on first use, never
re-made). ``fork()`` copies the runtime's state but not its worker threads (tokio-rs/tokio#4301):
in the child, an async call's task is queued to workers that do not exist and a sync call's
``block_on`` waits on an I/O driver that no thread drives -- both hang for ever, and a *new* store
does not help, because it runs on the same dead runtime (obstore says "not fork safe",
developmentseed/obstore#441). The parent's pooled connections are also the child's sockets. Nothing
in Python can reset that runtime, so such a child sends its calls over a pipe to a helper it starts
with ``subprocess`` (a fresh interpreter running this file: its own runtime and connections), which
runs them concurrently and sends back the bytes or the error. The helper exits when the pipe
closes, i.e. with the process it serves. Its cost: one interpreter start (~0.1 s, obstore only) per
forked process, and one more copy of each GET's bytes, through a pipe.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import os
import subprocess
import sys
import threading
from multiprocessing.connection import Connection


def open_store(spec: tuple):
    """``("local", path)`` or ``("url", url, config, client_options, retry_config)`` -> an obstore store."""
    import obstore.store

    if spec[0] == "local":
        return obstore.store.LocalStore(spec[1])
    _, url, config, client, retry = spec
    return obstore.store.from_url(url, config=config or None, client_options=client or None, retry_config=retry or None)


UNVERSIONED = "modified:"  # a version that is an mtime, not an ETag: no request can be conditioned on it


async def get_range(store, name: str, start: int, end: int, version: str | None = None):
    """Bytes ``[start, end)`` of ``name``; with an ETag ``version``, only of that version (``If-Match``:
    a replaced object raises ``PreconditionError`` instead of answering with the new bytes)."""
    import obstore

    if version is None or version.startswith(UNVERSIONED):
        return await obstore.get_range_async(store, name, start=int(start), end=int(end))
    result = await obstore.get_async(store, name, options={"range": (int(start), int(end)), "if_match": version})
    return await result.bytes_async()


def get(store, name: str) -> bytes:
    import obstore

    return obstore.get(store, name).bytes().to_bytes()


def head(store, name: str) -> tuple[int, str]:
    """``(size, version)``: the version is the ETag, else the mtime (marked :data:`UNVERSIONED`)."""
    import obstore

    return _size_and_version(obstore.head(store, name))


def _size_and_version(meta) -> tuple[int, str]:
    return int(meta["size"]), str(meta.get("e_tag") or f"{UNVERSIONED}{meta.get('last_modified')}")


def list_names(store) -> list[str]:
    import obstore

    return sorted(m["path"] for batch in obstore.list(store) for m in batch)


def list_heads(store) -> dict[str, tuple[int, str]]:
    """Every object's :func:`head`, from one listing (S3's LIST answers each object's size and ETag)."""
    import obstore

    return {m["path"]: _size_and_version(m) for batch in obstore.list(store) for m in batch}


def put_file(store, name: str, path: str, multipart: bool) -> None:
    import obstore

    with open(path, "rb") as fh:
        obstore.put(store, name, fh, use_multipart=multipart)


def download(store, name: str, path: str) -> tuple[int, str, str]:
    """Stream the object ``name`` into the new file ``path`` and fsync it; returns the bytes written,
    their MD5 (hex) and the ETag the answer came with."""
    import hashlib

    import obstore

    written, md5 = 0, hashlib.md5(usedforsecurity=False)
    result = obstore.get(store, name)
    with open(path, "wb") as fh:
        for part in result.stream(min_chunk_size=8 << 20):
            fh.write(part)
            md5.update(part)
            written += len(part)
        fh.flush()
        os.fsync(fh.fileno())
    return written, md5.hexdigest(), str(result.meta.get("e_tag") or "")


def delete(store, name: str) -> None:
    import obstore

    obstore.delete(store, name)


SYNC_CALLS = {"get": get, "head": head, "list": list_names, "list_heads": list_heads, "put_file": put_file, "download": download, "delete": delete}


def is_not_found(exc: BaseException) -> bool:
    import obstore.exceptions

    return isinstance(exc, (obstore.exceptions.NotFoundError, FileNotFoundError))


def is_replaced(exc: BaseException) -> bool:
    """A conditional request whose version is gone (``If-Match`` failed: the object was replaced)."""
    import obstore.exceptions

    return isinstance(exc, obstore.exceptions.PreconditionError)


class HelperError(Exception):
    """A call the helper made failed (``kind``: the client's exception type), or the helper died."""

    def __init__(self, kind: str, not_found: bool, message: str, replaced: bool = False):
        super().__init__(f"{kind}: {message}")
        self.kind, self.not_found, self.replaced = kind, not_found, replaced


# this file as a script, without its folder on sys.path (an `import errors` would find ours) and without
# importing latentfast (torch: seconds); `python -P` would do both, but only from Python 3.11 on
_START = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='__main__')"


class Helper:
    """The helper process of this (forked) process, and the pipe to it: calls may overlap."""

    def __init__(self):
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        self.proc = subprocess.Popen([sys.executable, "-c", _START, os.path.abspath(__file__), str(req_r), str(rep_w)],
                                     pass_fds=(req_r, rep_w), stdin=subprocess.DEVNULL)
        os.close(req_r)
        os.close(rep_w)
        self._requests, self._replies = Connection(req_w, readable=False), Connection(rep_r, writable=False)
        self._pending: dict[int, concurrent.futures.Future] = {}
        self._ids, self._lock = itertools.count(), threading.Lock()
        threading.Thread(target=self._read_replies, name="latentfast-remote-helper", daemon=True).start()

    def submit(self, spec: tuple, op: str, *args) -> concurrent.futures.Future:
        future = concurrent.futures.Future()
        with self._lock:
            if self._pending is None:
                raise HelperError("HelperExited", False, f"the object-store helper process {self.proc.pid} exited")
            msg_id = next(self._ids)
            self._pending[msg_id] = future
            self._requests.send((msg_id, spec, op, args))
        return future

    def call(self, spec: tuple, op: str, *args):
        return self.submit(spec, op, *args).result()

    def _read_replies(self) -> None:
        try:
            while True:
                msg_id, ok, value = self._replies.recv()
                with self._lock:
                    future = self._pending.pop(msg_id)
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(HelperError(*value))
        except (EOFError, OSError):
            with self._lock:
                pending, self._pending = self._pending, None
            for future in pending.values():
                future.set_exception(HelperError("HelperExited", False, f"the object-store helper process {self.proc.pid} exited"))


_helper_state = {"pid": None, "helper": None}
_helper_guard = threading.Lock()


def _after_fork_in_child() -> None:
    global _helper_guard
    _helper_guard = threading.Lock()  # may have been held by another thread at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


def helper() -> Helper:
    """This process's helper, started on first use (a fork of a fork starts its own; one that died is
    replaced: the calls it had in flight failed, and the reader's retries go to the new one)."""
    with _helper_guard:
        if _helper_state["pid"] != os.getpid() or _helper_state["helper"].proc.poll() is not None:
            _helper_state.update(pid=os.getpid(), helper=Helper())
        return _helper_state["helper"]


def serve(request_fd: int, reply_fd: int) -> None:
    """The helper's main loop: each request runs as its own task (GETs overlap), replies in any order."""
    requests, replies = Connection(request_fd, writable=False), Connection(reply_fd, readable=False)
    loop, stores = asyncio.new_event_loop(), {}

    async def handle(msg_id, spec, op, args):
        try:
            key = repr(spec)
            if key not in stores:
                stores[key] = open_store(spec)
            if op == "get_range":
                value = bytes(await get_range(stores[key], *args))
            else:
                value = await asyncio.to_thread(SYNC_CALLS[op], stores[key], *args)
            replies.send((msg_id, True, value))
        except Exception as exc:  # every failure goes back to the caller, who names the object
            replies.send((msg_id, False, (type(exc).__name__, is_not_found(exc), str(exc), is_replaced(exc))))

    def read_requests():
        try:
            while True:
                msg = requests.recv()
                loop.call_soon_threadsafe(lambda m=msg: loop.create_task(handle(*m)))
        except (EOFError, OSError):  # the process we serve is gone
            loop.call_soon_threadsafe(loop.stop)

    threading.Thread(target=read_requests, daemon=True).start()
    loop.run_forever()


if __name__ == "__main__":
    serve(int(sys.argv[-2]), int(sys.argv[-1]))
