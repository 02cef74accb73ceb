"""Build a latent cache from line images: width-sorted batches, crash-safe and resumable.

Per line: convert to RGB; a line wider than ``max_line_width`` is resized to
``(max_line_width, line_height)`` (LANCZOS); normalize to [-1, 1]. Lines are encoded in batches
of similar width (sorted by pixel width), each batch padded with white (1.0) to its widest line
and then up to a multiple of the downscale factor. A line's latent width is
``min(round(w_px * zw / wmax), zw, w_max)`` (at least 1), ``wmax`` the batch's widest line and
``zw`` the batch's latent width. The white column is the encoder's latent of white paper.

Durability: the data file is written under a temporary name and fsynced after every batch,
then the batch number is appended to a progress log (fsynced). A rerun with the same inputs
skips the logged batches, so a crash loses at most the batch in flight, and the finished cache
is byte-identical to one built without interruption. The index files are written next and the
meta file last, with atomic renames, so a cache never opens as complete before it is.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..errors import ImageError
from . import format as fmt

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")


@dataclass(frozen=True)
class _Line:
    line: int  # 1-based manifest line (or position in the sorted folder listing)
    path: str
    width: int  # pixel width after the optional resize


def list_source(source: str | os.PathLike) -> list[tuple[int, str]]:
    """``(manifest line, image path)`` for a JSONL manifest or a folder of images (sorted by name)."""
    source = os.fspath(source)
    if os.path.isdir(source):
        names = sorted(n for n in os.listdir(source) if n.lower().endswith(IMAGE_EXTENSIONS))
        return [(i + 1, os.path.join(source, n)) for i, n in enumerate(names)]
    if not os.path.isfile(source):
        raise FileNotFoundError(f"source must be a JSONL manifest or a folder of images, and {source} is neither")
    root = os.path.dirname(os.path.abspath(source))
    entries = []
    with open(source, encoding="utf-8") as fh:
        for number, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            try:
                record = json.loads(text)
                image = record["image"]
            except (json.JSONDecodeError, TypeError, KeyError):
                raise ValueError(f"manifest {source} line {number}: expected a JSON object with an 'image' path, got {text.strip()[:200]!r}") from None
            entries.append((number, image if os.path.isabs(image) else os.path.join(root, image)))
    return entries


def _probe(entry: tuple[int, str], line_height: int, max_line_width: int, full_decode: bool) -> _Line:
    """Read an image's header (and, if asked, its pixels) to plan the batches."""
    from PIL import Image

    number, path = entry
    try:
        with Image.open(path) as im:
            width, height = im.size
            if full_decode:
                im.load()
    except Exception as exc:  # noqa: BLE001 - any decoder failure is reported with its line
        raise ImageError(f"manifest line {number} ({path}): cannot read image: {exc}") from None
    if width > max_line_width:
        width, height = max_line_width, line_height
    if height != line_height:
        raise ImageError(f"manifest line {number} ({path}): height must be line_height={line_height} (or the line wider than max_line_width={max_line_width}), got {width}x{height}")
    return _Line(number, path, width)


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
        raise TypeError(f"encoder.identity() must return a dict, got {type(identity).__name__}")
    identity = json.loads(json.dumps(identity, sort_keys=True))  # what the meta will hold
    factor = downscale_factor or identity.get("downscale_factor") or getattr(encoder, "spatial_downscale", None)
    if not isinstance(factor, int) or factor < 1:
        raise ValueError(f"downscale_factor must be a positive integer (argument, encoder identity or encoder.spatial_downscale), got {factor!r}")
    return identity, factor


def _check_geometry(line_height: int, max_line_width: int, factor: int) -> None:
    if line_height < factor or line_height % factor:
        raise ValueError(f"line_height must be a positive multiple of the downscale factor {factor}, got {line_height}")
    if max_line_width < factor:
        raise ValueError(f"max_line_width must be at least the downscale factor {factor}, got {max_line_width}")


def _encode(encoder: Any, images: torch.Tensor, device: torch.device, autocast_dtype: torch.dtype | None) -> np.ndarray:
    with torch.no_grad():
        ctx = torch.autocast(device_type=device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        with ctx:
            z = encoder.encode(images.to(device))
    return z.float().cpu().numpy().astype(np.float16)


def _white_column(encoder, line_height, factor, device, autocast_dtype) -> np.ndarray:
    """The latent of white paper, ``[C, h, 1]``: the middle column of an all-white strip
    (away from the strip's edges, which a wide receptive field would see)."""
    z = _encode(encoder, torch.ones(1, 3, line_height, 8 * factor), device, autocast_dtype)
    if z.ndim != 4 or z.shape[2] != line_height // factor:
        raise ValueError(f"encoder.encode([1, 3, {line_height}, {8 * factor}]) must return [1, C, {line_height // factor}, w], got {z.shape}")
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


class _Progress:
    """Append-only log of finished batches: a header line (the build's fingerprint), then one
    batch number per line. A torn last line (crash mid-append) is dropped on reopen."""

    def __init__(self, path: str, fingerprint: str):
        self.path = path
        self.header = (json.dumps({"fingerprint": fingerprint}) + "\n").encode()
        self.done: set[int] = set()
        self.resumed = False
        if os.path.exists(path):
            with open(path, "rb") as fh:
                text = fh.read()
            text = text[: text.rfind(b"\n") + 1]
            if text.startswith(self.header) and all(x.isdigit() for x in text[len(self.header):].split()):
                self.done = {int(x) for x in text[len(self.header):].split()}
                self.resumed = True
                os.truncate(path, len(text))  # drop a torn tail before appending
        if not self.resumed:
            self._write_header()
        self._fh = open(path, "ab")

    def _write_header(self) -> None:
        with open(self.path, "wb") as fh:
            fh.write(self.header)
            fh.flush()
            os.fsync(fh.fileno())
        fmt.fsync_dir(os.path.dirname(self.path) or ".")

    def restart(self) -> None:
        """Forget every batch (durably, before the data file is recreated)."""
        self._fh.close()
        self._write_header()
        self._fh = open(self.path, "ab")
        self.done.clear()
        self.resumed = False

    def mark(self, batch: int) -> None:
        self._fh.write(f"{batch}\n".encode())
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.done.add(batch)

    def close(self) -> None:
        self._fh.close()


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
    num_workers: int = 4,
    skip_bad_images: bool = False,
    quiet: bool = False,
    stats: dict | None = None,
) -> str:
    """Encode every line of ``source`` (a JSONL manifest of ``{"image": path}`` or a folder of
    images) into a latent cache in ``out_dir``; returns the data file's path.

    ``encoder``: ``encode(images [B, 3, H, W] in [-1, 1]) -> [B, C, H/f, W/f]`` and
    ``identity() -> dict`` (``latentfast.toy.ToyVAE`` is one). ``layout``: ``"padded"`` (the
    original fixed-width format) or ``"ragged"`` (no padding on disk). ``autocast_dtype``: encode
    under ``torch.autocast`` in that dtype on ``device``. ``skip_bad_images``: leave out (and
    list in the meta's ``skipped``) lines whose image is missing, corrupt or of the wrong height,
    instead of raising; every image is then fully decoded once while planning. Rerunning an
    interrupted build with the same arguments resumes it. ``stats`` (a dict) receives timings.
    """
    if layout not in fmt.LAYOUTS:
        raise ValueError(f"layout must be one of {fmt.LAYOUTS}, got {layout!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    wall_start = time.perf_counter()
    device = torch.device(device)
    if hasattr(encoder, "to"):
        encoder = encoder.to(device)
    stamp = cache_meta_for(encoder, line_height=line_height, max_line_width=max_line_width, downscale_factor=downscale_factor)
    factor, channels, latent_h, w_max = stamp["downscale_factor"], stamp["channels"], stamp["latent_h"], stamp["w_max"]
    os.makedirs(out_dir, exist_ok=True)
    paths = {kind: fmt.cache_path(out_dir, split, kind) for kind in ("data", "widths", "meta", "offsets", "white", "checksums", "progress")}

    entries = list_source(source)
    with ThreadPoolExecutor(max_workers=max(1, num_workers)) as pool:
        lines, skipped = _plan_lines(pool, entries, line_height, max_line_width, skip_bad_images)
        if not lines:
            raise ValueError(f"source {os.fspath(source)} has no usable images")
        batches = _plan_batches(lines, batch_size, factor, w_max)
        widths = np.zeros(len(lines), dtype=np.int32)
        for rows, _, latent_widths in batches:
            widths[rows] = latent_widths
        if layout == "ragged":
            row_starts = fmt.ragged_offsets(widths, channels, latent_h)
        else:
            row_starts = np.arange(len(lines) + 1, dtype=np.int64) * fmt.row_elements(stamp)
        white = _white_column(encoder, line_height, factor, device, autocast_dtype)
        if white.shape[0] != channels:
            raise ValueError(f"encoder identity says latent_channels={channels} but encode returned {white.shape[0]} channels")

        meta = {
            **stamp,
            "n": len(lines),
            "format_version": fmt.FORMAT_VERSION,
            "layout": layout,
            "dtype": "float16",
            "batch_size": batch_size,
            "encode_dtype": str(autocast_dtype).removeprefix("torch.") if autocast_dtype else "float32",
            "source": os.path.abspath(os.fspath(source)),
            "skipped": skipped,
            "checksum": {"algorithm": fmt.CHECKSUM_ALGORITHM, "block_rows": fmt.block_row_count(stamp)},
        }
        # What the bytes depend on: a rerun resumes only a build with the same fingerprint.
        digest = hashlib.sha256(json.dumps(meta, sort_keys=True).encode())
        digest.update(white.tobytes())
        for x in lines:
            digest.update(f"{x.line}\t{x.path}\t{x.width}\n".encode())
        fingerprint = digest.hexdigest()
        meta["build_fingerprint"] = fingerprint
        meta["complete"] = True

        if not os.path.exists(paths["progress"]) and _already_built(paths["meta"], fingerprint):
            return paths["data"]

        data_bytes = int(row_starts[-1]) * 2
        progress = _Progress(paths["progress"], fingerprint)
        partial = fmt.partial_path(paths["data"])
        finished = len(progress.done) == len(batches)
        renamed = finished and not os.path.exists(partial) and _size(paths["data"]) == data_bytes
        if not renamed and (not progress.resumed or _size(partial) != data_bytes):
            progress.restart()  # nothing to resume: the log forgets first, then the data starts over
            with open(partial, "wb") as fh:
                fh.truncate(data_bytes)
        resumed = progress.resumed
        timings = {"decode_s": 0.0, "encode_s": 0.0, "write_s": 0.0}
        try:
            if not renamed:
                todo = [b for b in range(len(batches)) if b not in progress.done]
                _encode_batches(
                    encoder, pool, lines, batches, todo, partial, row_starts, layout, meta, progress,
                    device, autocast_dtype, quiet, timings,
                )
        finally:
            progress.close()
        _finalize(paths, partial if not renamed else paths["data"], meta, widths, row_starts, white, layout)
    if stats is not None:
        stats.update(timings, wall_s=time.perf_counter() - wall_start, rows=len(lines), resumed=resumed)
    return paths["data"]


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return -1


def _already_built(meta_path: str, fingerprint: str) -> bool:
    try:
        meta = fmt.read_meta(meta_path)
    except (OSError, ValueError):
        return False
    return meta.get("complete") is True and meta.get("build_fingerprint") == fingerprint


def _plan_lines(pool, entries, line_height, max_line_width, skip_bad_images, chunk=4096):
    """Probe every image on the pool, a chunk at a time (bounded memory for huge manifests)."""
    lines, skipped = [], []
    for start in range(0, len(entries), chunk):
        part = entries[start : start + chunk]
        futures = [pool.submit(_probe, e, line_height, max_line_width, skip_bad_images) for e in part]
        for (number, path), fut in zip(part, futures):
            try:
                lines.append(fut.result())
            except ImageError as exc:
                if not skip_bad_images:
                    raise
                skipped.append({"line": number, "path": path, "error": str(exc)})
    return lines, skipped


def _encode_batches(encoder, pool, lines, batches, todo, partial, row_starts, layout, meta, progress,
                    device, autocast_dtype, quiet, timings) -> None:
    from tqdm import tqdm

    C, h, w_max = meta["channels"], meta["latent_h"], meta["w_max"]
    line_height, max_line_width = meta["line_height"], meta["max_line_width"]
    done_rows = len(lines) - sum(len(batches[b][0]) for b in todo)
    bar = tqdm(total=len(lines), initial=done_rows, unit="rows", desc="latent cache", disable=True if quiet else None)
    pending: deque = deque()
    lookahead = 2  # batches decoding ahead of the encoder

    def submit(b: int):
        pending.append([pool.submit(_load, lines[k], line_height, max_line_width) for k in batches[b][0]])

    for b in todo[:lookahead]:
        submit(b)
    fd = os.open(partial, os.O_RDWR)
    try:
        row = np.zeros((C, h, w_max), dtype=np.float16)
        for i, b in enumerate(todo):
            rows, padded_width, latent_widths = batches[b]
            loads = [f.result() for f in pending.popleft()]
            if i + lookahead < len(todo):
                submit(todo[i + lookahead])
            timings["decode_s"] += sum(s for _, s in loads)
            images = torch.ones(len(rows), 3, line_height, padded_width)
            for j, (img, _) in enumerate(loads):
                images[j, :, :, : img.shape[-1]] = img
            t0 = time.perf_counter()
            z = _encode(encoder, images, device, autocast_dtype)
            t1 = time.perf_counter()
            expected_shape = (len(rows), C, h, padded_width // meta["downscale_factor"])
            if z.shape != expected_shape:
                raise ValueError(f"encoder.encode({list(images.shape)}) returned {list(z.shape)}, expected {list(expected_shape)} (an f{meta['downscale_factor']} encoder)")
            for j, (k, lw) in enumerate(zip(rows, latent_widths)):
                if layout == "ragged":
                    payload = np.ascontiguousarray(z[j, :, :, :lw])
                else:
                    row[:, :, :lw] = z[j, :, :, :lw]
                    row[:, :, lw:] = 0
                    payload = row
                os.pwrite(fd, payload.tobytes(), int(row_starts[k]) * 2)
            os.fdatasync(fd)  # the rows are durable before the log says so
            progress.mark(b)
            timings["encode_s"] += t1 - t0
            timings["write_s"] += time.perf_counter() - t1
            bar.update(len(rows))
    finally:
        os.close(fd)
        bar.close()


def _finalize(paths, data_src, meta, widths, row_starts, white, layout) -> None:
    """Checksums, index files, data rename, then the meta (the completion mark), then drop the log."""
    mm = np.memmap(data_src, dtype=np.float16, mode="r", shape=(int(row_starts[-1]),))
    sums = fmt.block_checksums(mm, row_starts, meta["checksum"]["block_rows"])
    del mm
    with contextlib.suppress(FileNotFoundError):  # an older cache here no longer opens as complete
        os.remove(paths["meta"])
    fmt.fsync_dir(os.path.dirname(paths["meta"]) or ".")
    fmt.write_bytes_durably(paths["widths"], fmt.npy_bytes(widths))
    fmt.write_bytes_durably(paths["white"], fmt.npy_bytes(white))
    fmt.write_bytes_durably(paths["checksums"], fmt.npy_bytes(sums))
    if layout == "ragged":
        fmt.write_bytes_durably(paths["offsets"], fmt.npy_bytes(row_starts))
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(paths["offsets"])
    if data_src != paths["data"]:
        os.replace(data_src, paths["data"])
    fmt.fsync_dir(os.path.dirname(paths["data"]) or ".")
    fmt.write_meta(paths["meta"], meta)
    os.remove(paths["progress"])
    fmt.fsync_dir(os.path.dirname(paths["progress"]) or ".")

