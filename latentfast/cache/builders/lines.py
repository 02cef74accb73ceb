"""Build a latent cache from line images: width-sorted batches, crash-safe and resumable.

Per line: convert to RGB; a line wider than ``max_line_width`` is resized to
``(max_line_width, line_height)`` (LANCZOS); normalize to [-1, 1]. Lines are encoded in batches
of similar width (sorted by pixel width), each batch padded with white (1.0) to its widest line
and then up to a multiple of the downscale factor. A line's latent width is
``min(round(w_px * zw / wmax), zw, w_max)`` (at least 1), ``wmax`` the batch's widest line and
``zw`` the batch's latent width. The white column is the encoder's latent of white paper.

Durability: the data file is written under a temporary name with whole writes and fsynced after
every batch, then the batch's record (its number, the CRC-32 of each row's bytes as they were
meant to be written, and a digest of its images' contents) is appended to a progress log
(fsynced). A rerun with the same inputs skips the logged batches whose images are unchanged, so a
crash loses at most the batch in flight, and the finished cache is byte-identical to one built
without interruption. Before the cache is marked complete every row is read back and checked
against its logged CRC (a batch that fails is encoded again, once); the index files are written
next and the meta file last, with atomic renames, so a cache never opens as complete before it is.
An exclusive lock on the split (:class:`~latentfast.cache.store.durable.BuildLock`) keeps a second build out.

Reruns: a build is identified by its geometry, encoder, white column and the list of images (keys
relative to the source, so ``imgs``, ``./imgs`` and an absolute path are the same build) with
their widths; the content hash of each image (BLAKE2b of its bytes) decides which batches of a
finished cache are encoded again (a line's latents depend on its batch's padding, so its whole
batch is). A rerun over a finished cache whose blocks fail their checksums re-encodes the batches
of those blocks. Nothing changed and nothing damaged: nothing is written.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...errors import ArgumentTypeError, CacheCorruptError, CacheError, ImageError, InvalidArgumentError
from ..store import format as fmt
from ..store.durable import BuildLock, append_log, content_hash, file_size, publish, pwrite_all, read_log, rewrite_log
from . import distributed, manifest
from .encode import encode, prepare
from .media import decode_workers
from ..store.opening import LatentCache
from ..store.reader import bad_blocks
from ...progress import progress_bar

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


@dataclass(frozen=True)
class _Line:
    line: int  # 1-based manifest line (or position in the sorted folder listing)
    path: str
    width: int  # pixel width after the optional resize
    key: str = ""  # the image's name relative to the source, without extension
    digest: bytes = b""  # content hash of the image file


def list_source(source: str | os.PathLike) -> list[tuple[int, str]]:
    """``(manifest line, image path)`` for a JSONL manifest or a folder of images (sorted by name).
    Paths are absolute (a relative manifest entry is taken relative to the manifest's folder)."""
    source = os.path.abspath(os.fspath(source))
    if os.path.isdir(source):
        names = sorted(n for n in os.listdir(source) if n.lower().endswith(IMAGE_EXTENSIONS))
        return [(i + 1, os.path.join(source, n)) for i, n in enumerate(names)]
    if not os.path.isfile(source):
        raise FileNotFoundError(f"source must be a JSONL manifest or a folder of images, and {source} is neither")
    root = os.path.dirname(source)
    return [(number, os.path.normpath(manifest.resolve(image, root)))
            for number, image, _ in manifest.read_manifest(source, ("image",))]


def _key(path: str, root: str) -> str:
    """The image's name relative to the source's folder, without extension, with ``/``."""
    rel = os.path.relpath(path, root) if path.startswith(root + os.sep) else path
    return os.path.splitext(rel)[0].replace(os.sep, "/")


def _probe(entry: tuple[int, str], root: str, line_height: int, max_line_width: int, full_decode: bool) -> _Line:
    """Read an image's header (and, if asked, its pixels) to plan the batches, and hash its bytes."""
    from PIL import Image

    number, path = entry
    try:
        with Image.open(path) as im:
            width, height = im.size
            if full_decode:
                im.load()
        digest = content_hash(path)
    except Exception as exc:  # noqa: BLE001 - any decoder failure is reported with its line
        raise ImageError(f"manifest line {number} ({path}): cannot read image: {exc}") from None
    if width > max_line_width:
        width, height = max_line_width, line_height
    if height != line_height:
        raise ImageError(f"manifest line {number} ({path}): height must be line_height={line_height} (or the line wider than max_line_width={max_line_width}), got {width}x{height}")
    return _Line(number, path, width, _key(path, root), digest)


def _load(line: _Line, line_height: int, max_line_width: int) -> tuple[torch.Tensor, float]:
    """Decode one line to float32 ``[3, line_height, w]`` in [-1, 1]; also returns seconds spent."""
    from PIL import Image

    start = time.perf_counter()
    try:
        with Image.open(line.path) as im:
            img = im.convert("RGB")
        if img.width > max_line_width:
            img = img.resize((max_line_width, line_height), Image.LANCZOS)
    except Exception as exc:  # noqa: BLE001
        raise ImageError(f"manifest line {line.line} ({line.path}): cannot decode image: {exc}") from None
    if img.size != (line.width, line_height):
        raise ImageError(f"manifest line {line.line} ({line.path}): image changed during the build (planned width {line.width}, now {img.size})")
    pixels = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)
    # Same arithmetic as to_tensor + normalize(0.5, 0.5): x / 255, then (x - 0.5) / 0.5.
    tensor = pixels.float().div_(255.0).sub_(0.5).div_(0.5)
    return tensor, time.perf_counter() - start


def _encoder_geometry(encoder: Any, downscale_factor: int | None) -> tuple[dict, int]:
    identity = encoder.identity()
    if not isinstance(identity, dict):
        raise ArgumentTypeError(f"encoder.identity() must return a dict, got {type(identity).__name__}")
    identity = json.loads(json.dumps(identity, sort_keys=True))  # what the meta will hold
    factor = downscale_factor or identity.get("downscale_factor") or getattr(encoder, "spatial_downscale", None)
    if not isinstance(factor, int) or factor < 1:
        raise InvalidArgumentError(f"downscale_factor must be a positive integer (argument, encoder identity or encoder.spatial_downscale), got {factor!r}")
    return identity, factor


def _check_geometry(line_height: int, max_line_width: int, factor: int) -> None:
    if line_height < factor or line_height % factor:
        raise InvalidArgumentError(f"line_height must be a positive multiple of the downscale factor {factor}, got {line_height}")
    if max_line_width < factor:
        raise InvalidArgumentError(f"max_line_width must be at least the downscale factor {factor}, got {max_line_width}")


def _encode(encoder: Any, images: torch.Tensor, device: torch.device, autocast_dtype: torch.dtype | None) -> np.ndarray:
    return encode(encoder.encode, images, device, autocast_dtype).numpy().astype(np.float16)


def _white_column(encoder, line_height, factor, device, autocast_dtype) -> np.ndarray:
    """The latent of white paper, ``[C, h, 1]``: the middle column of an all-white strip
    (away from the strip's edges, which a wide receptive field would see)."""
    z = _encode(encoder, torch.ones(1, 3, line_height, 8 * factor), device, autocast_dtype)
    if z.ndim != 4 or z.shape[2] != line_height // factor:
        raise InvalidArgumentError(f"encoder.encode([1, 3, {line_height}, {8 * factor}]) must return [1, C, {line_height // factor}, w], got {z.shape}")
    return np.ascontiguousarray(z[0, :, :, z.shape[3] // 2 : z.shape[3] // 2 + 1])


def cache_meta_for(
    encoder: Any,
    *,
    line_height: int,
    max_line_width: int,
    n: int | None = None,
    downscale_factor: int | None = None,
) -> dict:
    """The stamp a cache built with this encoder and geometry carries; pass it as
    ``LatentCache(..., expected=...)`` to refuse a cache built any other way."""
    identity, factor = _encoder_geometry(encoder, downscale_factor)
    _check_geometry(line_height, max_line_width, factor)
    channels = identity.get("latent_channels")
    if channels is None:
        channels = _white_column(encoder, line_height, factor, torch.device("cpu"), None).shape[0]
    stamp = {
        "channels": int(channels),
        "latent_h": line_height // factor,
        "w_max": max_line_width // factor,
        "pretrained": str(identity.get("pretrained", type(encoder).__qualname__)),
        "subfolder": str(identity.get("subfolder", "")),
        "line_height": int(line_height),
        "max_line_width": int(max_line_width),
        "downscale_factor": factor,
        "encoder": identity,
    }
    if n is not None:
        stamp["n"] = int(n)
    return stamp


def _plan_batches(lines: list[_Line], batch_size: int, factor: int, w_max: int) -> list[tuple[list[int], int, list[int]]]:
    """Width-sorted batches: ``(row indices, padded pixel width, latent width per row)``."""
    order = sorted(range(len(lines)), key=lambda k: (lines[k].width, k))
    batches = []
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        wmax = max(lines[k].width for k in rows)
        zw = math.ceil(wmax / factor)
        latent_widths = [max(1, min(round(lines[k].width * zw / wmax), zw, w_max)) for k in rows]
        batches.append((rows, zw * factor, latent_widths))
    return batches


def header_for(fingerprint: str) -> bytes:
    """The progress log's first line: the build's fingerprint (a log of another build is not resumed)."""
    return (json.dumps({"fingerprint": fingerprint}) + "\n").encode()


class _Progress:
    """Append-only log of finished batches: a header line (the build's fingerprint), then one JSON
    record per batch: ``{"b": batch, "crc": [CRC-32 of each row as meant to be written, or null for a
    row verified in place], "src": digest of its images}``. A torn last line (crash mid-append) is
    dropped on reopen; any other unreadable line makes the log untrusted (the build starts over)."""

    def __init__(self, path: str, fingerprint: str):
        self.path = path
        self.header = header_for(fingerprint)
        self.records: dict[int, dict] = {}
        self.resumed = False
        records = read_log(path, self.header)
        try:
            self.records = {int(r["b"]): r for r in records} if records is not None else {}
            self.resumed = records is not None
        except (ValueError, KeyError, TypeError):  # not a batch record: the log is untrusted
            self.records = {}
        if not self.resumed:
            self._rewrite()
        self._fh = open(path, "ab")

    @property
    def done(self) -> set[int]:
        return set(self.records)

    def _rewrite(self) -> None:
        """The log as it stands, durably: in place when empty (a torn header just fails to match, and
        the log exists from the first step, so an interrupted build is always seen as one), else
        through an atomic rename (a torn rewrite must not lose the kept records)."""
        if self.records:
            rewrite_log(self.path, self.header, self.records.values())
            return
        with open(self.path, "wb") as fh:
            fh.write(self.header)
            fh.flush()
            os.fsync(fh.fileno())
        fmt.fsync_dir(os.path.dirname(self.path) or ".")

    def _reopen(self) -> None:
        self._fh.close()
        self._rewrite()
        self._fh = open(self.path, "ab")

    def restart(self) -> None:
        """Forget every batch (durably, before the data file is recreated)."""
        self.records.clear()
        self.resumed = False
        self._reopen()

    def forget(self, batches) -> None:
        """Forget these batches (durably): they are encoded again."""
        for b in batches:
            self.records.pop(b, None)
        self._reopen()

    def mark(self, batch: int, crcs: list[int], src: str) -> None:
        record = {"b": batch, "crc": crcs, "src": src}
        append_log(self._fh, [record])
        self.records[batch] = record

    def close(self) -> None:
        self._fh.close()


@dataclass
class _Plan:
    """Everything the build writes, decided before the first encode."""

    lines: list[_Line]
    batches: list[tuple[list[int], int, list[int]]]
    widths: np.ndarray
    row_starts: np.ndarray
    white: np.ndarray
    meta: dict

    @property
    def fingerprint(self) -> str:
        return self.meta["build_fingerprint"]

    def batch_digest(self, b: int) -> str:
        """Digest of the contents of batch ``b``'s images."""
        digest = hashlib.blake2b(digest_size=16)
        for k in self.batches[b][0]:
            digest.update(self.lines[k].digest)
        return digest.hexdigest()

    def batch_of_rows(self) -> np.ndarray:
        owner = np.empty(len(self.lines), dtype=np.int64)
        for b, (rows, _, _) in enumerate(self.batches):
            owner[rows] = b
        return owner


_FILES = ("data", "widths", "meta", "offsets", "white", "checksums", "progress", "keys", "hashes", "shapes", "info")


def build_latent_cache(
    encoder: Any,
    source: str | os.PathLike,
    out_dir: str | os.PathLike,
    split: str = "train",
    *,
    line_height: int,
    max_line_width: int,
    batch_size: int = 16,
    layout: str = "padded",
    device: str | torch.device = "cpu",
    autocast_dtype: torch.dtype | None = None,
    downscale_factor: int | None = None,
    num_workers: int | None = None,
    skip_bad_images: bool = False,
    quiet: bool = False,
    lock_timeout: float = 0.0,
    stats: dict | None = None,
    group=None,
) -> str:
    """Encode every line of ``source`` (a JSONL manifest of ``{"image": path}`` or a folder of
    images) into a latent cache in ``out_dir``; returns the data file's path.

    ``encoder``: ``encode(images [B, 3, H, W] in [-1, 1]) -> [B, C, H/f, W/f]`` and
    ``identity() -> dict`` (``latentfast.toy.ToyVAE`` is one). ``layout``: ``"padded"`` (the
    original fixed-width format) or ``"ragged"`` (no padding on disk). ``autocast_dtype``: encode
    under ``torch.autocast`` in that dtype on ``device``. ``skip_bad_images``: leave out (and
    list in the meta's ``skipped``) lines whose image is missing, corrupt or of the wrong height,
    instead of raising; every image is then fully decoded once while planning. Rerunning an
    interrupted build with the same arguments resumes it; rerunning a finished one re-encodes only
    the batches of edited images or damaged blocks. ``lock_timeout``: seconds to wait for another
    build of this split (then :class:`~latentfast.errors.CacheLockedError`). ``stats`` (a dict)
    receives timings and counts. ``group`` (a ``torch.distributed`` process group): a distributed
    build, see :mod:`latentfast.cache.builders.distributed`.
    """
    if group is not None:  # each rank builds its share into a shard; rank 0 writes the manifest
        return distributed.build_sharded(build_latent_cache, locals())
    if layout not in fmt.LINE_LAYOUTS:
        raise InvalidArgumentError(f"layout must be one of {fmt.LINE_LAYOUTS}, got {layout!r}")
    encoder, device = prepare(encoder, device, batch_size)
    wall_start = time.perf_counter()
    stamp = cache_meta_for(encoder, line_height=line_height, max_line_width=max_line_width, downscale_factor=downscale_factor)
    out_dir = os.fspath(out_dir)
    paths = {kind: fmt.cache_path(out_dir, split, kind) for kind in _FILES}
    timings = {"decode_s": 0.0, "encode_s": 0.0, "write_s": 0.0, "encoded_batches": 0}
    with BuildLock(out_dir, split, lock_timeout), ThreadPoolExecutor(max_workers=decode_workers(num_workers)) as pool:
        plan = _plan(encoder, source, pool, stamp, layout, batch_size, device, autocast_dtype, skip_bad_images)
        progress = _open_progress(paths, plan)  # None: finished, unchanged and intact
        resumed = progress is not None and progress.resumed
        if progress is not None:
            try:
                _write_cache(encoder, pool, plan, paths, progress, device, autocast_dtype, quiet, timings)
            finally:
                progress.close()
    if stats is not None:
        stats.update(timings, wall_s=time.perf_counter() - wall_start, rows=len(plan.lines), resumed=resumed,
                     up_to_date=progress is None)
    return paths["data"]


def _plan(encoder, source, pool, stamp, layout, batch_size, device, autocast_dtype, skip_bad_images) -> _Plan:
    """Probe the images, cut width-sorted batches, lay out the rows and stamp the meta."""
    factor, channels, latent_h, w_max = stamp["downscale_factor"], stamp["channels"], stamp["latent_h"], stamp["w_max"]
    entries = list_source(source)
    absolute = os.path.abspath(os.fspath(source))
    root = absolute if os.path.isdir(absolute) else os.path.dirname(absolute)
    lines, skipped = _plan_lines(pool, entries, root, stamp["line_height"], stamp["max_line_width"], skip_bad_images)
    if not lines:
        raise InvalidArgumentError(f"source {os.fspath(source)} has no usable images")
    share = distributed.current_share()
    if share is not None:  # a distributed build: this rank's whole width-sorted batches (cut again the same)
        units = [[lines[k] for k in rows] for rows, _, _ in _plan_batches(lines, batch_size, factor, w_max)]
        lines = share.keep(lines, units, key=lambda x: x.key, cost=lambda x: x.width)
    batches = _plan_batches(lines, batch_size, factor, w_max)
    widths = np.zeros(len(lines), dtype=np.int32)
    for rows, _, latent_widths in batches:
        widths[rows] = latent_widths
    if layout == "ragged":
        row_starts = fmt.ragged_offsets(widths, channels, latent_h)
    else:
        row_starts = np.arange(len(lines) + 1, dtype=np.int64) * fmt.row_elements(stamp)
    white = _white_column(encoder, stamp["line_height"], factor, device, autocast_dtype)
    if white.shape[0] != channels:
        raise InvalidArgumentError(f"encoder identity says latent_channels={channels} but encode returned {white.shape[0]} channels")
    meta = {
        **stamp,
        "n": len(lines),
        "format_version": fmt.FORMAT_VERSION,
        "layout": layout,
        "dtype": "float16",
        "batch_size": batch_size,
        "encode_dtype": str(autocast_dtype).removeprefix("torch.") if autocast_dtype else "float32",
        "skipped": skipped,
        "checksum": {"algorithm": fmt.CHECKSUM_ALGORITHM, "block_rows": fmt.block_row_count(stamp)},
    }
    # What the bytes depend on (not how the source folder was spelled, not the pixels: those are
    # compared per batch): a rerun resumes or repairs only a build with the same fingerprint.
    digest = hashlib.sha256(json.dumps({k: v for k, v in meta.items() if k != "skipped"}, sort_keys=True).encode())
    digest.update(white.tobytes())
    for x in lines:
        digest.update(f"{x.key}\t{x.width}\n".encode())
    meta.update(source=absolute, build_fingerprint=digest.hexdigest(), complete=True)
    return _Plan(lines, batches, widths, row_starts, white, meta)


def _plan_lines(pool, entries, root, line_height, max_line_width, skip_bad_images, chunk=4096):
    """Probe every image on the pool, a chunk at a time (bounded memory for huge manifests)."""
    lines, skipped = [], []
    for start in range(0, len(entries), chunk):
        part = entries[start : start + chunk]
        probes, share = [(e, root, line_height, max_line_width, skip_bad_images) for e in part], distributed.current_share()
        futures = [pool.submit(_probe, *a) for a in probes] if share is None else share.map(pool, _probe, probes)
        for (number, path), fut in zip(part, futures):
            try:
                lines.append(fut.result())
            except ImageError as exc:
                if not skip_bad_images:
                    raise
                skipped.append({"line": number, "path": path, "error": str(exc)})
    return lines, skipped


def _open_progress(paths, plan: _Plan) -> _Progress | None:
    """The progress log to continue from, with the partial data file ready; None when the finished
    cache already holds exactly this build. A finished cache with edited images or damaged blocks is
    turned back into an interrupted build that lacks only those batches."""
    partial = fmt.partial_path(paths["data"])
    data_bytes = int(plan.row_starts[-1]) * 2
    if not os.path.exists(paths["progress"]):
        finished = _finished_cache(paths, plan)
        if finished is not None:
            redo = _batches_to_redo(finished, plan)
            if not redo:
                if fmt.damaged_files(os.path.dirname(paths["meta"]) or ".", finished.split, finished.meta):
                    _finalize(paths, paths["data"], plan)  # the data is intact: its index files are rewritten from the plan
                return None
            keep = [{"b": b, "crc": None, "src": plan.batch_digest(b)} for b in range(len(plan.batches)) if b not in redo]
            rewrite_log(paths["progress"], header_for(plan.fingerprint), keep)
    if os.path.exists(paths["progress"]) and not os.path.exists(partial) and file_size(paths["data"]) == data_bytes:
        # finished data not yet stamped (a crash inside _finalize) or a finished cache being repaired
        with contextlib.suppress(FileNotFoundError):
            os.remove(paths["meta"])
        fmt.fsync_dir(os.path.dirname(partial) or ".")
        os.replace(paths["data"], partial)
    progress = _Progress(paths["progress"], plan.fingerprint)
    stale = [b for b, r in progress.records.items() if b >= len(plan.batches) or r.get("src") != plan.batch_digest(b)]
    if stale:
        progress.forget(stale)  # their images changed since they were encoded
    if not progress.resumed or file_size(partial) != data_bytes:
        progress.restart()  # nothing to resume: the log forgets first, then the data starts over
        with open(partial, "wb") as fh:
            fh.truncate(data_bytes)
    return progress


def _finished_cache(paths, plan: _Plan):
    """The complete cache in the folder if it was built with this fingerprint, else None."""
    try:
        meta = fmt.read_meta(paths["meta"])
        if meta.get("complete") is not True or meta.get("build_fingerprint") != plan.fingerprint:
            return None
        return LatentCache(os.path.dirname(paths["meta"]) or ".", os.path.basename(paths["meta"]).split(".latents.")[0])
    except (OSError, ValueError, CacheError):
        return None


def _batches_to_redo(cache, plan: _Plan) -> set[int]:
    """Batches holding an image whose content hash changed, or a row of a block that fails verify."""
    owner = plan.batch_of_rows()
    try:
        hashes = cache.content_hashes()
        found, _ = bad_blocks(cache) if hashes is not None else ([], None)
    except (OSError, CacheError):  # content hashes or checksums lost or damaged: nothing can be vouched for
        hashes = None
    if hashes is None:
        return set(range(len(plan.batches)))
    wanted = np.frombuffer(b"".join(x.digest for x in plan.lines), dtype=np.uint8).reshape(-1, hashes.shape[1])
    redo = set(owner[np.flatnonzero(np.any(hashes != wanted, axis=1))].tolist())
    for _, r0, r1, _ in found:
        redo.update(owner[r0:r1].tolist())
    return redo


def _write_cache(encoder, pool, plan: _Plan, paths, progress: _Progress, device, autocast_dtype, quiet, timings) -> None:
    """Encode the batches the log lacks, check every row read back, then finalize. A batch whose rows
    read back different from what was written is encoded once more; twice is an error."""
    partial = fmt.partial_path(paths["data"])
    for _ in range(2):
        todo = [b for b in range(len(plan.batches)) if b not in progress.done]
        if todo:
            _encode_batches(encoder, pool, plan, todo, partial, progress, device, autocast_dtype, quiet, timings)
        bad = _batches_read_back_wrong(partial, plan, progress)
        if not bad:
            break
        progress.forget(bad)
    else:
        raise CacheCorruptError(
            f"latent cache {partial}: rows of batches {sorted(bad)[:10]} read back different from what was written, "
            f"twice (is the disk failing?); the build stays resumable"
        )
    _finalize(paths, partial, plan)


def _batches_read_back_wrong(partial: str, plan: _Plan, progress: _Progress) -> list[int]:
    """Logged batches with a row whose bytes on disk fail the CRC logged when it was written."""
    mm = np.memmap(partial, dtype=np.float16, mode="r", shape=(int(plan.row_starts[-1]),))
    bad = []
    for b, record in progress.records.items():
        for k, crc in zip(plan.batches[b][0], record["crc"] or []):
            if crc is not None and zlib.crc32(mm[int(plan.row_starts[k]) : int(plan.row_starts[k + 1])]) != crc:
                bad.append(b)
                break
    del mm
    return bad


def _encode_batches(encoder, pool, plan: _Plan, todo, partial, progress, device, autocast_dtype, quiet, timings) -> None:
    """Decode (on the pool, ``lookahead`` batches ahead), encode and write each batch of ``todo``;
    each batch is durable (fdatasync) before the log records it."""
    meta, lines, batches = plan.meta, plan.lines, plan.batches
    done_rows = len(lines) - sum(len(batches[b][0]) for b in todo)
    bar = progress_bar(total=len(lines), initial=done_rows, unit="rows", desc="latent cache", disable=True if quiet else None)
    pending: deque = deque()
    lookahead = 2  # batches decoding ahead of the encoder

    def submit(b: int):
        pending.append([pool.submit(_load, lines[k], meta["line_height"], meta["max_line_width"]) for k in batches[b][0]])

    for b in todo[:lookahead]:
        submit(b)
    fd = os.open(partial, os.O_RDWR)
    try:
        for i, b in enumerate(todo):
            loads = [f.result() for f in pending.popleft()]
            if i + lookahead < len(todo):
                submit(todo[i + lookahead])
            timings["decode_s"] += sum(s for _, s in loads)
            t0 = time.perf_counter()
            z = _encode_batch(encoder, [img for img, _ in loads], batches[b][1], meta, device, autocast_dtype)
            t1 = time.perf_counter()
            crcs = _write_rows(fd, z, batches[b], plan)
            os.fdatasync(fd)  # the rows are durable before the log says so
            progress.mark(b, crcs, plan.batch_digest(b))
            timings["encode_s"] += t1 - t0
            timings["write_s"] += time.perf_counter() - t1
            timings["encoded_batches"] += 1
            bar.update(len(batches[b][0]))
    finally:
        os.close(fd)
        bar.close()


def _encode_batch(encoder, images: list[torch.Tensor], padded_width: int, meta, device, autocast_dtype) -> np.ndarray:
    """One width-sorted batch, padded with white (1.0) to ``padded_width``, encoded; float16 numpy."""
    batch = torch.ones(len(images), 3, meta["line_height"], padded_width)
    for j, img in enumerate(images):
        batch[j, :, :, : img.shape[-1]] = img
    z = _encode(encoder, batch, device, autocast_dtype)
    expected_shape = (len(images), meta["channels"], meta["latent_h"], padded_width // meta["downscale_factor"])
    if z.shape != expected_shape:
        raise InvalidArgumentError(f"encoder.encode({list(batch.shape)}) returned {list(z.shape)}, expected {list(expected_shape)} (an f{meta['downscale_factor']} encoder)")
    return z


def _write_rows(fd: int, z: np.ndarray, batch, plan: _Plan) -> list[int]:
    """Write each row of the batch at its place (whole writes); returns the CRC-32 of each row's bytes
    as meant to be written (so a short or lost write is caught when the file is read back)."""
    rows, _, latent_widths = batch
    meta = plan.meta
    padded = np.zeros((meta["channels"], meta["latent_h"], meta["w_max"]), dtype=np.float16)
    crcs = []
    for j, (k, lw) in enumerate(zip(rows, latent_widths)):
        if meta["layout"] == "ragged":
            payload = np.ascontiguousarray(z[j, :, :, :lw])
        else:
            padded[:, :, :lw] = z[j, :, :, :lw]
            padded[:, :, lw:] = 0
            payload = padded
        pwrite_all(fd, payload, int(plan.row_starts[k]) * 2)
        crcs.append(zlib.crc32(payload))
    return crcs


def _finalize(paths, data_src: str, plan: _Plan) -> None:
    """Checksums, then the finish step (:func:`~latentfast.cache.store.durable.publish`): index files,
    data rename, the meta (the completion mark), the log dropped."""
    meta = plan.meta
    mm = np.memmap(data_src, dtype=np.float16, mode="r", shape=(int(plan.row_starts[-1]),))
    sums = fmt.block_checksums(mm, plan.row_starts, meta["checksum"]["block_rows"])
    del mm
    hashes = np.frombuffer(b"".join(x.digest for x in plan.lines), dtype=np.uint8).reshape(len(plan.lines), -1)
    keys = (json.dumps([x.key for x in plan.lines], separators=(",", ":")) + "\n").encode()
    files = {"widths": fmt.npy_bytes(plan.widths), "white": fmt.npy_bytes(plan.white), "checksums": fmt.npy_bytes(sums),
             "keys": keys, "hashes": fmt.npy_bytes(hashes),
             "offsets": fmt.npy_bytes(plan.row_starts) if meta["layout"] == "ragged" else None,
             "shapes": None, "info": None}  # None: a different cache's leftovers go
    publish(paths, data_src, files, meta)
