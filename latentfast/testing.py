"""Helpers for tests of code that uses latentfast -- this project's own tests and benchmarks, and yours.

- :func:`poisoned_like` -- an output buffer full of garbage, so a kernel that skips an element is caught;
- :func:`runnable_backends` -- every backend that can run an op on a device type in this process;
- :func:`assert_sampled_like_reference` -- a sampled latent batch against the sampling reference;
- :func:`random_rows` / :func:`write_cache` -- latent caches with arbitrary rows, written with plain
  numpy in the original (seed) layouts and opened by the real :class:`~latentfast.cache.LatentCache`;
  :func:`write_random_cache` -- the same for caches of any size (larger than RAM), written in chunks.
- :func:`spawn_gloo` -- run a function on every rank of a real spawned gloo process group.
- :func:`kill_and_resume` -- a writer script SIGKILLed mid-build, then run again to completion;
  :func:`hold_when` / :func:`run_until_held` -- a child process killed at a known point of its work.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os

import numpy as np
import torch

from . import backends


def runnable_backends(op: str, device_type: str = "cpu") -> list[str]:
    """Every concrete backend that can run ``op`` on ``device_type`` tensors in this process."""
    return [name for name, why in backends.availability(op, device_type).items() if not why]


def poisoned_like(shape, dtype, device="cpu") -> torch.Tensor:
    """An output buffer full of garbage (NaN for floats, 0x5A bytes otherwise)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(0x5A)
    return t


# output dtype -> relative tolerance of a sampled latent against the reference: one rounding of the output
# (the float32 math differs from the reference only in the transcendental functions' last bits and, on a
# GPU, a fused multiply-add: |d eps| <= 1e-5, latentfast.sampling's stated tolerance)
SAMPLE_ROUNDING = {torch.float32: 2**-21, torch.float16: 2**-10, torch.bfloat16: 2**-7}


def assert_sampled_like_reference(got, mean, std, seeds) -> None:
    """``got`` (a sampled batch of any float dtype) equals :func:`latentfast.sampling.sample_latents_reference`
    of the same arguments within that tolerance."""
    from .sampling import sample_latents_reference

    want = sample_latents_reference(mean, std, seeds, out=torch.empty(mean.shape, dtype=got.dtype, device=got.device))
    atol = 2e-5 * float(std.abs().max()) + 1e-30 if std.numel() else 0.0
    torch.testing.assert_close(got.double(), want.double(), rtol=SAMPLE_ROUNDING[got.dtype], atol=atol)


def random_rows(rng: np.random.Generator, n: int, channels: int, latent_h: int, w_max: int, min_width: int = 1):
    """``(rows, widths)``: ``n`` float16 ``[C, h, w_i]`` arrays with widths uniform in ``[min_width, w_max]``."""
    widths = rng.integers(min_width, w_max + 1, size=n).astype(np.int32)
    rows = [rng.standard_normal((channels, latent_h, int(w)), dtype=np.float32).astype(np.float16) for w in widths]
    return rows, widths


def write_cache(directory: str, rows, widths, *, w_max: int, layout: str = "padded", white=None, split: str = "train"):
    """Write ``rows`` under ``directory`` in ``layout`` ("padded" or "ragged") and open them as a LatentCache.

    Padded: ``{split}.latents.f16.dat`` float16 ``[N, C, h, w_max]`` + ``widths.npy`` + the nine-field
    ``meta.json``. Ragged: rows ``[C, h, w_i]`` back to back + ``offsets.npy`` int64 ``[N + 1]``.
    Plus ``white.npy`` (``[C, h, 1]``) when ``white`` is given.
    """
    from .cache import LatentCache

    os.makedirs(directory, exist_ok=True)
    channels, latent_h = rows[0].shape[:2]
    n = len(rows)

    def path(suffix):
        return os.path.join(directory, f"{split}.latents.{suffix}")

    if layout == "padded":
        mm = np.memmap(path("f16.dat"), dtype=np.float16, mode="w+", shape=(n, channels, latent_h, w_max))
        for i, row in enumerate(rows):
            mm[i, :, :, : row.shape[-1]] = row
        mm.flush()
        del mm
    else:
        sizes = np.array([row.size for row in rows], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        np.concatenate([row.reshape(-1) for row in rows]).astype(np.float16).tofile(path("f16.dat"))
        np.save(path("offsets.npy"), offsets)
    _write_index(directory, split, widths, channels, latent_h, w_max, layout, white)
    return LatentCache(directory, split)


def _write_index(directory: str, split: str, widths, channels: int, latent_h: int, w_max: int, layout: str, white):
    """The small files beside the data: widths, white column (if any), and the nine-field meta."""

    def path(suffix):
        return os.path.join(directory, f"{split}.latents.{suffix}")

    np.save(path("widths.npy"), np.asarray(widths, dtype=np.int32))
    if white is not None:
        np.save(path("white.npy"), np.asarray(white, dtype=np.float16).reshape(channels, latent_h, 1))
    meta = {"n": len(widths), "channels": int(channels), "latent_h": int(latent_h), "w_max": int(w_max),
            "layout": layout, "pretrained": "test-rows", "subfolder": "", "line_height": 8 * int(latent_h),
            "max_line_width": 8 * int(w_max), "downscale_factor": 8}
    with open(path("meta.json"), "w") as fh:
        json.dump(meta, fh)


def write_random_cache(directory: str, n: int, channels: int, latent_h: int, w_max: int, *, seed: int = 0,
                       min_width: int = 1, layouts=("padded", "ragged"), split: str = "train",
                       chunk_rows: int = 4096) -> dict[str, str]:
    """Caches of ``n`` random rows (widths uniform in ``[min_width, w_max]``, values in [0, 1)), one per
    layout in ``directory/<layout>``, written in chunks of rows: any size, in little memory (for caches
    larger than RAM). The layouts hold the same rows. Returns layout -> folder (nothing is opened)."""
    rng = np.random.default_rng(seed)
    widths = rng.integers(min_width, w_max + 1, size=n).astype(np.int32)
    white = rng.random((channels, latent_h, 1)).astype(np.float16)
    folders = {layout: os.path.join(directory, layout) for layout in layouts}
    files = {}
    for layout, folder in folders.items():
        os.makedirs(folder, exist_ok=True)
        files[layout] = open(os.path.join(folder, f"{split}.latents.f16.dat"), "wb")
    try:
        for start in range(0, n, chunk_rows):
            part = widths[start : start + chunk_rows]
            rows = rng.integers(0, 0x3C00, size=(len(part), channels, latent_h, w_max), dtype=np.uint16).view(np.float16)
            real = np.arange(w_max)[None, None, None, :] < part[:, None, None, None]
            rows = np.where(real, rows, np.float16(0))
            if "padded" in files:
                rows.tofile(files["padded"])
            if "ragged" in files:  # boolean selection keeps C order: row by row, [C, h, w_i] each
                rows[np.broadcast_to(real, rows.shape)].tofile(files["ragged"])
    finally:
        for fh in files.values():
            fh.close()
    for layout, folder in folders.items():
        if layout == "ragged":
            sizes = widths.astype(np.int64) * channels * latent_h
            np.save(os.path.join(folder, f"{split}.latents.offsets.npy"), np.concatenate([[0], np.cumsum(sizes)]))
        _write_index(folder, split, widths, channels, latent_h, w_max, layout, white)
    return folders


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the block with ``torch.set_num_threads(n)``, restoring the previous count after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def teardown_process_group() -> None:
    """End a spawned rank's process group safely: free what still holds it (a DDP/FSDP module, a
    reference cycle), wait for every rank, then destroy it. Tearing gloo down while a peer still
    talks to it, or freeing a module that holds the group after ``destroy_process_group``, aborts
    the process ("terminate called without an active exception"). Call it once the objects that
    used the group are out of scope (return them from a function, don't keep them in locals)."""
    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _spawned_rank(rank: int, world_size: int, folder: str, timeout_s: float, fn, args: tuple) -> None:
    import datetime
    import pickle

    import torch.distributed as dist

    torch.set_num_threads(1)  # one core per rank: the ranks stand for separate machines
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(folder, 'store')}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world_size, *args)
    except BaseException as exc:  # returned to the caller, not raised in the child
        result = exc
    finally:
        gc.collect()  # a cycle still holding the group, freed after destroy_process_group, aborts the process
        dist.destroy_process_group()
    with open(os.path.join(folder, f"result{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def spawn_gloo(fn, world_size: int, *args, timeout_s: float = 60.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on every rank of a new gloo group of spawned processes
    (rendezvous through a FileStore in a temporary folder, one thread per rank) and return the
    results in rank order. An exception raised on a rank is returned (not raised) as that rank's
    result. ``fn`` must be importable by name (module level); ``timeout_s`` is the group's timeout."""
    import pickle
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="latentfast_gloo_") as folder:
        mp.start_processes(_spawned_rank, args=(world_size, folder, timeout_s, fn, args), nprocs=world_size, start_method="spawn")
        results = []
        for rank in range(world_size):
            with open(os.path.join(folder, f"result{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def s3_options(endpoint: str) -> dict:
    """``storage_options`` for a loopback test server: its endpoint and dummy keys (no credentials)."""
    return {"endpoint_url": endpoint, "access_key_id": "testing", "secret_access_key": "testing", "region": "us-east-1"}


def create_bucket(endpoint: str, bucket: str) -> None:
    """Create ``bucket`` on the S3-compatible server at ``endpoint`` (boto3, which moto brings along)."""
    import boto3

    opts = s3_options(endpoint)
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=opts["access_key_id"],
                 aws_secret_access_key=opts["secret_access_key"], region_name=opts["region"]).create_bucket(Bucket=bucket)


@contextlib.contextmanager
def s3_server():
    """Start moto's S3 server on 127.0.0.1 (a free port) in this process; yields its endpoint URL.
    Needs ``moto[server]`` (in the ``test`` extra). Nothing leaves the loopback interface."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of an S3 endpoint that injects faults into ranged GETs.

    ``faults``: a list consumed one per ranged GET, each ``None`` (pass), ``"500"``, ``"503"``
    (SlowDown), ``"drop"`` (half the body, then the connection is cut), ``"short"`` (half the body,
    sent as a complete answer: its Content-Length says so, the connection stays up), ``"slow:SECONDS"``
    (wait before answering) or ``"flip"`` (one bit of the body flipped); ``fault_all`` (same values)
    applies to every ranged GET once the list is empty. ``gets`` records ``(path, range)`` of every
    ranged GET. ``whole_gets``: whole-object GETs (a download; not listings) get faults too. A context
    manager; it also stops by itself after ``lifetime_s``.
    """

    def __init__(self, upstream: str, faults=(), fault_all=None, lifetime_s: float = 300.0, whole_gets: bool = False):
        import threading
        import urllib.parse

        self.upstream = urllib.parse.urlsplit(upstream)
        self.faults, self.fault_all, self.whole_gets = list(faults), fault_all, whole_gets
        self.gets: list[tuple[str, str]] = []
        self._guard = threading.Lock()
        self._server = self._make_server()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._timer = threading.Timer(lifetime_s, self.stop)
        self._timer.daemon = True

    def __enter__(self):
        self._thread.start()
        self._timer.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self) -> None:
        self._timer.cancel()
        self._server.shutdown()
        self._server.server_close()

    def _next_fault(self, path: str, byte_range: str):
        with self._guard:
            self.gets.append((path, byte_range))
            return self.faults.pop(0) if self.faults else self.fault_all

    def _make_server(self):
        import http.client
        import http.server
        import time

        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def _forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=dict(self.headers))
                    resp = conn.getresponse()
                    return resp.status, resp.getheaders(), resp.read()
                finally:
                    conn.close()

            def _reply(self, status, headers, data):
                self.send_response(status)
                for k, v in headers:
                    if k.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                        self.send_header(k, v)
                if self.command == "HEAD":  # no body: the upstream's length is the object's size
                    self.send_header("Content-Length", dict((k.lower(), v) for k, v in headers).get("content-length", "0"))
                    self.end_headers()
                    return
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _error(self, status, code):
                xml = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._reply(status, [("Content-Type", "application/xml")], xml)

            def _handle(self):
                byte_range = self.headers.get("Range")
                faulted = byte_range or (proxy.whole_gets and "?" not in self.path)
                fault = proxy._next_fault(self.path, byte_range) if self.command == "GET" and faulted else None
                if fault == "500":
                    return self._error(500, "InternalError")
                if fault == "503":
                    return self._error(503, "SlowDown")
                if fault and fault.startswith("slow:"):
                    time.sleep(float(fault.split(":", 1)[1]))
                try:
                    status, headers, data = self._forward()
                except OSError:  # the upstream went away (a test ended while we slept): drop the client
                    self.close_connection = True
                    return
                if fault == "flip" and data:
                    data = bytearray(data)
                    data[len(data) // 2] ^= 0x10
                    data = bytes(data)
                if fault == "short":
                    data = data[: len(data) // 2]
                if fault == "drop":
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data[: len(data) // 2])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self._reply(status, headers, data)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _handle

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        server.daemon_threads = True
        return server


def peak_gets_in_flight(monkeypatch) -> list[int]:
    """Patch :meth:`ObjectFolder.get_range` (through ``monkeypatch``) to count the ranged GETs in flight at
    once; returns ``[peak]``, updated as they run (they all run on the one fetching loop: no lock needed)."""
    from .cache.remote.storage import ObjectFolder

    in_flight, peak = [0], [0]
    get_range = ObjectFolder.get_range

    async def counted(self, *args):
        in_flight[0] += 1
        peak[0] = max(peak[0], in_flight[0])
        try:
            return await get_range(self, *args)
        finally:
            in_flight[0] -= 1

    monkeypatch.setattr(ObjectFolder, "get_range", counted)
    return peak


@contextlib.contextmanager
def s3_with_objects(folder: str, url: str, files: dict):
    """:func:`s3_server` holding ``files`` (name -> bytes) under ``url`` (``s3://bucket/prefix``),
    written to ``folder`` and pushed there; yields the endpoint."""
    from .cache.remote import push

    for name, data in files.items():
        with open(os.path.join(folder, name), "wb") as fh:
            fh.write(data)
    with s3_server() as endpoint:
        create_bucket(endpoint, url[len("s3://"):].split("/")[0])
        push(folder, url, s3_options(endpoint))
        yield endpoint


HOLD_ENV = "LATENTFAST_TEST_HOLD"


def hold_when(reached: bool) -> None:
    """In a test's child process: once ``reached``, create the file named by ``$LATENTFAST_TEST_HOLD`` (if
    set) and block until killed. A kill then lands at a known point of the work, however loaded the
    machine is (no sleep to slow the child down, no race between its progress and the test's poll)."""
    marker = os.environ.get(HOLD_ENV)
    if reached and marker:
        with open(marker, "w"):
            pass
        import threading

        threading.Event().wait()


def run_until_held(cmd: list[str], marker: str, *, progress: str | None = None, min_lines: int = 0,
                   timeout_s: float = 600.0) -> None:
    """Run ``cmd`` with ``$LATENTFAST_TEST_HOLD=marker`` until it holds (see :func:`hold_when`) and, if
    ``progress`` is given, its progress log has ``min_lines`` complete lines; then SIGKILL it. Fails if the
    child ends first (``timeout_s`` only guards against a hang)."""
    import signal
    import subprocess
    import time

    if os.path.exists(marker):
        os.unlink(marker)
    env = dict(os.environ, **{HOLD_ENV: marker})
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        deadline = time.monotonic() + timeout_s
        while not (os.path.exists(marker) and (progress is None or progress_lines(progress) >= min_lines)):
            if proc.poll() is not None:
                raise AssertionError(f"{cmd[2] if len(cmd) > 2 and cmd[1] == '-c' else cmd} ended (rc {proc.returncode}) "
                                     f"before it held: {proc.stderr.read().decode()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"the child did not hold within {timeout_s} s")
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    if proc.returncode != -signal.SIGKILL:
        raise AssertionError(f"the child was not killed (rc {proc.returncode})")


def progress_lines(path: str) -> int:
    """Complete lines of a progress log (0 while it does not exist)."""
    try:
        with open(path, "rb") as fh:
            text = fh.read()
    except FileNotFoundError:
        return 0
    return text[: text.rfind(b"\n") + 1].count(b"\n")


def kill_and_resume(script: str, folder: str, reference: str, *, hold_after: int = 12, between=None) -> tuple[int, int]:
    """Run the writer ``script`` (``python -c script FOLDER HOLD_AFTER``, which calls :func:`hold_when` once it
    has written ``HOLD_AFTER`` items and prints how many it wrote at the end) into ``folder``, SIGKILL it
    while it holds, call ``between()``, run it again to completion, and once more into ``reference`` (a
    build never interrupted). Returns ``(items logged before the kill, items the rerun wrote)``."""
    import subprocess
    import sys

    progress = os.path.join(folder, "train.latents.progress")
    run_until_held([sys.executable, "-c", script, folder, str(hold_after)], os.path.join(os.path.dirname(folder), "held"))
    logged = progress_lines(progress) - 1
    if between is not None:
        between()
    written = None
    for out in (folder, reference):
        done = subprocess.run([sys.executable, "-c", script, out, str(hold_after)], capture_output=True, text=True,
                              timeout=600)
        if done.returncode != 0:
            raise AssertionError(f"the writer failed on {out}: {done.stderr}")
        if out == folder:
            written = int(done.stdout.split()[-1])
    return logged, written


def photo_like(rng: np.random.Generator, w: int, h: int) -> np.ndarray:
    """uint8 ``[h, w, 3]``: 1/f noise per channel (a natural image's spectrum, high contrast), so JPEG
    and PNG sizes and decode costs are those of photos, not of flat or white-noise images."""
    fy, fx = np.fft.fftfreq(h)[:, None], np.fft.rfftfreq(w)[None, :]
    f = np.hypot(fx, fy)
    f[0, 0] = 1
    channels = []
    for _ in range(3):
        x = np.fft.irfft2((rng.standard_normal(f.shape) + 1j * rng.standard_normal(f.shape)) / f, s=(h, w))
        channels.append(np.clip(128 + 40 * (x - x.mean()) / x.std(), 0, 255).astype(np.uint8))
    return np.stack(channels, -1)


def write_captioned_images(folder, captions, *, ext: str = ".txt", width_step: int = 7, suffix: str = "") -> str:
    """Random PNGs ``im{i}.png`` (36 px high, ``40 + width_step * i`` wide) in ``folder``, each with its
    caption ``captions[i] + suffix`` in ``im{i}{ext}`` beside it (as kohya and the others read captions)."""
    from PIL import Image

    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    for i, caption in enumerate(captions):
        Image.fromarray(rng.integers(0, 256, (36, 40 + width_step * i, 3), dtype=np.uint8)).save(os.path.join(folder, f"im{i}.png"))
        with open(os.path.join(folder, f"im{i}{ext}"), "w", encoding="utf-8") as fh:
            fh.write(caption + suffix)
    return os.fspath(folder)
