"""Build shaped latent caches from images (aspect-ratio buckets) and video clips, through the writer.

Steps: list the source and probe every item's header in threads (size, frame count); give each item its
bucket; plan batches of one bucket (buckets in the order given, keys sorted within a bucket); then per
batch either copy an item's latents from the cache already in the folder (same encoder and settings,
same content hash, checksum intact) or decode it (Pillow / PyAV on a thread pool, batches ahead, uint8
into recycled buffers) and encode it, the stages overlapped (see :class:`_Runner`). Each source is hashed
once (:data:`CONTENT_HASH` for a new cache; an existing one keeps the algorithm its meta names): while
planning when there is something to compare it with (a cache or an interrupted build in the folder),
else by the decode worker, from the bytes its decoder reads. Everything goes through
:class:`~latentfast.cache.LatentCacheWriter`, and each batch is made durable in order, so a build
is crash-safe (a crash loses at most the batches in flight) and resumable (rerun
the same call), and a rerun after editing images re-encodes only the edited ones. A rerun over a
complete, intact cache with unchanged sources writes nothing; one over a damaged cache re-encodes
the damaged items.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
import os
import queue
import time
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from ...errors import ArgumentTypeError, CacheError, ImageError, InvalidArgumentError, NonFiniteError
from ..store import format as fmt
from ..store import fields as fieldstore
from . import distributed, media
from .encode import BatchBuffers, Stages, Stopped, encode, owned, pixel_dtype, prepare, timed
from ..store.durable import LEGACY_CONTENT_HASH, BuildLock
from ..store.writer import encoder_identity, open_for_sources
from ..captions import Captions
from ..store.opening import LatentCache
from ..store.reader import bad_blocks
from ...progress import progress_bar


_QUEUE = 2  # batches waiting between two stages
# the content hash of a new cache's sources, stamped in its meta (``content_hash``): SHA-256 cut to 16 bytes
# runs at 2.0 GB/s here on the CPU's SHA extensions, BLAKE2b-128 (every cache before, unstamped) at 1.4
CONTENT_HASH = "sha256-128"
_DONE = object()  # the end of a stage's batches


def _offer(q: queue.Queue, item) -> bool:
    """Put ``item`` unless ``q`` stays full for a moment (its consumer may have died)."""
    try:
        q.put(item, timeout=0.05)
        return True
    except queue.Full:
        return False


@dataclass
class _Job:
    """What differs between the image and the video builder."""

    kind: str  # "image" | "video"
    bucket_of: Callable[[media.Item], tuple]
    # (item, its file's bytes or None) -> (its frames as RGB PIL images, resized and cropped; info)
    load: Callable[[media.Item, Any], tuple[list, dict]]
    encode: Callable  # encoder method: (batch, **kw) -> latents
    store_std: bool = False  # the encoder's sample="store": fields latent and latent_std
    flip: bool = False  # also encode each image's mirror: field latent_flipped (and latent_flipped_std)
    text_encoder: Any = None  # captions -> fields text [L_i, D] and text_pooled [P]
    captions: Any = None  # (key, path) -> caption, with text_encoder
    latent_dtype: torch.dtype = torch.float16  # latent_dtype=: the latent fields' stored dtype
    jpeg_draft: bool = False  # jpeg_draft=: JPEGs shrunk >= 2x decode at a reduced DCT scale
    content_hash: str = CONTENT_HASH  # the algorithm of the sources' content hashes (the cache's own, on a rebuild)

    def digest(self, item: media.Item, data: bytes | None = None) -> bytes:
        """The source hash stored for ``item``: its content hash and what else decides its latents (the
        JPEG draft convention, its caption), so that a rebuild re-encodes an item whose any of these changed."""
        digest = media.source_digest(item, self.content_hash, data)
        if item.draft:  # the resize convention is part of the source: a rebuild without it re-encodes the item
            digest = hashlib.blake2b(digest + b"\0jpeg-draft", digest_size=16).digest()
        if item.caption is not None:  # the caption is part of the source: an edited one re-encodes the item
            digest = hashlib.blake2b(digest + item.caption.encode(), digest_size=16).digest()
        return digest


# the dtypes a builder can store the latent in (and the fields beside it that share its meaning:
# latent_std, latent_flipped): float16 by default, as every cache before; bfloat16 where the latents
# overflow float16's range (e.g. Wan VAE latents, which the trainers keep in bf16), float32 to keep
# all of what the encoder computed
LATENT_DTYPES = {name: fieldstore.DTYPES[name] for name in fmt.LATENT_DTYPES}  # the store's own list


def _latent_dtype(value) -> torch.dtype:
    if isinstance(value, str) and value in LATENT_DTYPES:
        return LATENT_DTYPES[value]
    if isinstance(value, torch.dtype) and value in LATENT_DTYPES.values():
        return value
    raise InvalidArgumentError(f"latent_dtype must be one of {sorted(LATENT_DTYPES)} (or that torch dtype), got {value!r}")


def build_image_cache(encoder: Any, source, out_dir, split: str = "train", *, buckets, batch_size: int = 8,
                      device="cpu", autocast_dtype: torch.dtype | None = None, num_workers: int | None = None,
                      skip_bad_images: bool = False, no_upscale: bool = False, bucket_step: int = 64,
                      quiet: bool = False, lock_timeout: float = 0.0, stats: dict | None = None,
                      flip: bool = False, text_encoder: Any = None, captions: Any = None,
                      latent_dtype="float16", jpeg_draft: bool = True, group=None, bucket_rule=None) -> str:
    """Encode every image of ``source`` (a folder, walked recursively, or a JSONL manifest of
    ``{"image": path, "key": optional}``) into a shaped cache in ``out_dir``; returns the data path.

    ``buckets``: ``(height, width)`` pixel sizes, multiples of the encoder's downscale factor; each
    image goes to the bucket of nearest aspect ratio, resized (LANCZOS) to cover it and
    centre-cropped. ``encoder``: ``encode(images [B, 3, H, W] in [-1, 1]) -> [B, C, H/f, W/f]`` and
    ``identity() -> dict`` (e.g. :class:`latentfast.encoders.DiffusersVAE`). Items are keyed by their
    path relative to the folder without extension; ``cache.info(i)`` holds ``original_size`` and
    ``crop_top_left``. Images are taken as displayed (EXIF orientation applied; 16-bit grey scaled
    to 8 bits). ``no_upscale`` (kohya's ``bucket_no_upscale``): an image its bucket would enlarge gets
    a bucket of its own size instead (rounded down to multiples of ``bucket_step``, shrunk to at most
    the largest bucket's area); unless ``quiet`` a summary line says how many images were enlarged
    and by how much at most. ``skip_bad_images`` leaves out unreadable or truncated images (decoded
    fully while planning; listed in the meta's ``skipped`` and named in the summary) instead of
    raising :class:`~latentfast.errors.ImageError`. ``lock_timeout``: seconds to wait for another
    build of this split. ``num_workers``: decode threads (default: the cores this process may run
    on). ``jpeg_draft`` (the resize convention, on by default): a JPEG that its bucket shrinks at
    least 2x is decoded at the largest DCT scale (1/2, 1/4, 1/8) that stays at least the resized size
    (Pillow's ``Image.draft``), then resized with LANCZOS as any image: several times faster to
    decode, a few levels of 255 from decoding fully on average (the DCT scaling filters differently;
    tests/test_cache_build_pipeline.py states how far). The convention is part of such an item's
    source hash, so a rebuild with the other one re-encodes exactly the drafted items; the meta's
    ``jpeg_draft`` says it was on. The source hashes (what a rebuild compares to find the edited images)
    of a new cache are SHA-256 cut to 16 bytes, stamped as the meta's ``content_hash``; a cache made
    before the stamp (BLAKE2b-128) keeps being compared, rebuilt and resumed with BLAKE2b.
    ``stats`` (a dict) receives counts and timings: each stage's busy seconds (``decode_s``, summed
    over the decode workers, hashing the sources of a new build included; ``feed_s``, planning batches
    and issuing the copies to the device, and on
    a CPU build the normalize; ``h2d_s``, the copies on the device; ``encode_s``, encoding, and on CUDA
    the normalize before it; ``write_s``),
    ``encode_wait_s`` (the encoder waiting for pixels), ``bound``, the stage that bounds the build
    (the most busy seconds per thread), and ``plan_s`` (listing and probing, and hashing the sources where
    a cache or an interrupted build in the folder is compared with them, before them); where anything was
    decoded, ``head_s`` (from the call to the first decode's start: planning, the lock, opening the writer)
    and ``tail_s`` (from the last decode's end to the return: the last batch's normalize, encode and
    write, and publishing), the wall time the decoders stand idle. ``latent_dtype``
    (``"float16"``, ``"bfloat16"`` or ``"float32"``): the stored dtype of the latent and the fields
    beside it that share its meaning (``latent_std``, ``latent_flipped``); a rebuild with another one
    re-encodes. ``bucket_rule``: a callable ``(width, height) -> (height, width)`` that picks each image's
    bucket instead (a trainer's own bucketing, e.g. :class:`latentfast.cache.dataset_config.KohyaBuckets`;
    its ``name`` is stamped in the meta). ``group`` (a
    ``torch.distributed`` process group): a distributed build, see :mod:`latentfast.cache.builders.distributed`.

    Records beside the latent (each its own field, see ``cache.fields``):

    - an encoder with ``sample="store"`` (:class:`~latentfast.encoders.DiffusersVAE`) stores the
      normalized posterior's mean as ``latent`` and its std as ``latent_std``, for
      ``read_batch(..., sample=True)``;
    - ``flip=True`` also encodes each image's horizontal mirror (after the resize and crop) into
      ``latent_flipped`` (and ``latent_flipped_std``), as kohya's ``flip_aug`` does, for
      ``read_batch(..., flip=p)``;
    - ``text_encoder`` (a :class:`~latentfast.encoders.TextEncoder`, or a
      :class:`~latentfast.text_presets.TextEncoders` such as ``text_preset("sdxl", pipe)``, whose named
      fields are stored instead: ``text_clip_l``, ``text_t5``, ``text_pooled``, ...) encodes each image's caption
      (``captions``, a :class:`~latentfast.cache.captions.Captions`; default: the manifest's
      ``caption``, else ``<stem>.txt`` beside the image) into ``text`` ``[L_i, D]`` (cut to the mask,
      the model's dtype) and ``text_pooled`` ``[P]`` where the model has a pooled output. Equal
      captions are encoded once per batch and stored once. The meta's ``text_encoder`` stamps the
      encoder's identity; an edited caption re-encodes its item on a rerun.
    """
    if group is not None:  # each rank builds its share into a shard; rank 0 writes the manifest
        return distributed.build_sharded(build_image_cache, locals())
    factor = getattr(encoder, "spatial_downscale", None)
    bucket_list = media.check_buckets(buckets, video=False, factor=factor)
    bucket_of = _image_bucket_rule(bucket_list, no_upscale, bucket_step, factor)
    if bucket_rule is not None:  # the trainer's rule; each bucket it gives checked as the buckets= ones are
        bucket_of = lambda item: media.check_buckets([bucket_rule(item.width, item.height)], video=False, factor=factor)[0]  # noqa: E731
    if not isinstance(flip, bool):
        raise ArgumentTypeError(f"flip must be a bool, got {type(flip).__name__} ({flip!r})")
    if not isinstance(jpeg_draft, bool):
        raise ArgumentTypeError(f"jpeg_draft must be a bool, got {type(jpeg_draft).__name__} ({jpeg_draft!r})")
    job = _Job("image", bucket_of, lambda item, data: _one_frame(*media.fitted_image(item, data)), encoder.encode,
               flip=flip, latent_dtype=_latent_dtype(latent_dtype),
               jpeg_draft=jpeg_draft)
    settings = {"buckets": [list(b) for b in bucket_list], "resize": "lanczos-cover-center-crop",
                "encode_dtype": _encode_dtype(encoder, autocast_dtype)}
    if jpeg_draft:
        settings["jpeg_draft"] = True
    if no_upscale:
        settings.update(no_upscale=True, bucket_step=bucket_step)
    if bucket_rule is not None:
        settings["bucket_rule"] = str(getattr(bucket_rule, "name", getattr(bucket_rule, "__qualname__", "custom")))
    settings.update(_record_settings(job, encoder, source, text_encoder, captions))
    return _build(job, encoder, source, out_dir, split, settings, batch_size=batch_size, device=device,
                  autocast_dtype=autocast_dtype, num_workers=num_workers, skip_bad=skip_bad_images, quiet=quiet,
                  lock_timeout=lock_timeout, stats=stats)


def build_video_cache(encoder: Any, source, out_dir, split: str = "train", *, buckets, frame_stride: int = 1,
                      batch_size: int = 1, device="cpu", autocast_dtype: torch.dtype | None = None,
                      num_workers: int | None = None, skip_bad_clips: bool = False, quiet: bool = False,
                      lock_timeout: float = 0.0, stats: dict | None = None, latent_dtype="float16",
                      group=None) -> str:
    """Encode every clip of ``source`` into a shaped cache of ``[C, T', h, w]`` latents; returns the data path.

    A clip is a folder of frame images (file-name order) or a video file (PyAV). ``source`` is a
    folder of clips or a JSONL manifest of ``{"frames": dir}`` / ``{"video": path}``. ``buckets``:
    ``(frames, height, width)``; a clip goes to the nearest aspect ratio, then to the bucket with
    the most frames it can fill, and its first ``frames`` frames (every ``frame_stride``-th) are
    resized and centre-cropped. ``encoder.encode_video([B, 3, T, H, W])`` encodes them. Otherwise as
    :func:`build_image_cache`.
    """
    if group is not None:  # each rank builds its share into a shard; rank 0 writes the manifest
        return distributed.build_sharded(build_video_cache, locals())
    if isinstance(frame_stride, bool) or not isinstance(frame_stride, int) or frame_stride < 1:
        raise InvalidArgumentError(f"frame_stride must be a positive int, got {frame_stride!r}")
    bucket_list = media.check_buckets(buckets, video=True, factor=getattr(encoder, "spatial_downscale", None))
    job = _Job("video", lambda item: media.clip_bucket(item, bucket_list, frame_stride),
               lambda item, _: media.fitted_clip(item, frame_stride), encoder.encode_video,
               latent_dtype=_latent_dtype(latent_dtype))
    settings = {"buckets": [list(b) for b in bucket_list], "frame_stride": frame_stride,
                "resize": "lanczos-cover-center-crop", "encode_dtype": _encode_dtype(encoder, autocast_dtype)}
    settings.update(_record_settings(job, encoder, source, None, None))
    return _build(job, encoder, source, out_dir, split, settings, batch_size=batch_size, device=device,
                  autocast_dtype=autocast_dtype, num_workers=num_workers, skip_bad=skip_bad_clips, quiet=quiet,
                  lock_timeout=lock_timeout, stats=stats)


def _one_frame(image, info: dict) -> tuple[list, dict]:
    """An image as a clip of one frame (what :attr:`_Job.load` gives)."""
    return [image], info


def _as_latent_dtype(items, name: str, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``z`` cast to the stored dtype; a float16 cast that would turn finite values into inf raises,
    naming the item and the way out (the writer finds NaN/inf that came from the encoder itself)."""
    if dtype == torch.float16:
        peak = z.detach().abs().flatten(1).amax(1)
        over = (peak > 65504).nonzero()
        if len(over):
            b = int(over[0])
            raise NonFiniteError(f"{name} of key {items[b].key!r} holds values beyond float16's range (+-65504; largest "
                                 f"magnitude {float(peak[b]):.4g}): build with latent_dtype='bfloat16' or 'float32'")
    return z.to(dtype)


def _record_settings(job: _Job, encoder, source, text_encoder, captions) -> dict:
    """Set up the fields beside the latent on ``job``; the meta entries that stamp them."""
    job.store_std = getattr(encoder, "sample", None) == "store"
    settings = {}
    if job.latent_dtype != torch.float16:
        settings["latent_dtype"] = str(job.latent_dtype).removeprefix("torch.")
    if job.store_std:
        settings["latent_std"] = True
    if job.flip:
        settings["flip"] = True
    if text_encoder is not None:
        if not callable(getattr(text_encoder, "encode", None)) or not callable(getattr(text_encoder, "identity", None)):
            raise ArgumentTypeError(f"text_encoder must have encode(captions) and identity() (a latentfast.encoders.TextEncoder), "
                                    f"got {type(text_encoder).__qualname__}")
        if captions is None:
            captions = Captions(source if os.path.isfile(os.fspath(source)) else None)
        elif not callable(captions):
            raise ArgumentTypeError(f"captions must be a latentfast.cache.captions.Captions, got {type(captions).__qualname__}")
        job.text_encoder, job.captions = text_encoder, captions
        settings["text_encoder"] = encoder_identity(text_encoder)
    elif captions is not None:
        raise InvalidArgumentError("captions= needs text_encoder= (the captions are encoded into the text fields)")
    return settings


def _image_bucket_rule(buckets: list[tuple[int, int]], no_upscale: bool, step, factor) -> Callable:
    """The bucket of an image: the nearest aspect ratio, or with ``no_upscale`` (kohya's rule) its
    own size where that one would enlarge it."""
    if not no_upscale:
        return lambda item: media.nearest_bucket(item.width, item.height, buckets)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1 or (factor and step % factor):
        raise InvalidArgumentError(f"bucket_step must be a positive int, a multiple of the encoder's downscale factor"
                                   f" {factor}, got {step!r}")
    max_area = max(h * w for h, w in buckets)
    return lambda item: media.no_upscale_bucket(item, media.nearest_bucket(item.width, item.height, buckets),
                                                max_area, step)


def _encode_dtype(encoder, autocast_dtype) -> str:
    """The precision the latents are computed in: the autocast dtype, else the encoder's weights'
    (a float32 rebuild over a bf16-encoded cache must re-encode, not keep the bf16 latents)."""
    if autocast_dtype is not None:
        return str(autocast_dtype).removeprefix("torch.")
    parameters = getattr(encoder, "parameters", None)
    first = next(iter(parameters()), None) if callable(parameters) else None
    return str(first.dtype).removeprefix("torch.") if isinstance(first, torch.Tensor) else "float32"


def _summary(kind: str, counts: dict, items: int, skipped: list[dict]) -> str:
    """One line: what was encoded, copied and resumed, how many items were enlarged to fit their
    bucket (and at most by how much), and which were skipped."""
    text = (f"{kind} cache: {counts['encoded']} encoded, {counts['copied']} copied, {counts['resumed']} resumed;"
            f" {counts['upscaled']} of {items} {kind}s upscaled to fit their bucket")
    if counts["upscaled"]:
        hint = "; no_upscale / --no-upscale keeps images at their size" if kind == "image" else ""
        text += f" (at most {counts['max_upscale']:.2f}x{hint})"
    if skipped:
        names = ", ".join(f"{s['key']!r} ({s['error'].rsplit(': ', 1)[-1]})" for s in skipped[:5])
        text += f"; {len(skipped)} skipped: {names}{' ...' if len(skipped) > 5 else ''}"
    return text


def _build(job: _Job, encoder, source, out_dir, split, settings, *, batch_size, device, autocast_dtype,
           num_workers, skip_bad, quiet, lock_timeout, stats) -> str:
    """The shared steps: plan, then (under the build lock) skip, copy or encode each batch, finish."""
    encoder, device = prepare(encoder, device, batch_size)
    wall = time.perf_counter()
    out_dir = os.fspath(out_dir)
    counts = {**dict.fromkeys(_STAGE_SECONDS, 0.0), "encode_wait_s": 0.0, "plan_s": 0.0, "encoded": 0, "copied": 0,
              "resumed": 0}
    workers = media.decode_workers(num_workers)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        items, skipped = _plan(job, source, pool, skip_bad)
        counts["plan_s"] = time.perf_counter() - wall
        share = distributed.current_share()
        if share is not None:  # a distributed build: this rank's whole batches, costed pixels x frames
            batches = _batches(items, batch_size)
            items = share.keep([x for b in batches for x in b], batches, key=lambda x: x.key, cost=lambda x: math.prod(x.bucket))
        meta = {**settings, "kind": job.kind, "source": os.path.abspath(os.fspath(source)), "skipped": skipped}
        identity = encoder_identity(encoder)
        lock = BuildLock(out_dir, split, lock_timeout)
        try:
            previous = _previous_cache(out_dir, split, identity, meta)
            job.content_hash = _content_hash_of(out_dir, split, previous)
            if job.content_hash != LEGACY_CONTENT_HASH:
                meta["content_hash"] = job.content_hash
            if previous is not None or fmt.build_in_progress(out_dir, split):
                with timed(counts, "plan_s"):  # compared with what is there (copies, resume): hashed now
                    for item, digest in zip(items, pool.map(job.digest, items)):
                        item.digest = digest
            if previous is not None and _unchanged(previous, items):
                lock.release()
                if stats is not None:
                    stats.update(counts, items=len(items), skipped=len(skipped), unchanged=True,
                                 wall_s=time.perf_counter() - wall)
                return fmt.cache_path(out_dir, split, "data")
            writer = open_for_sources(out_dir, split, encoder=encoder, meta=meta, lock=lock,
                                      digests={item.key: item.digest for item in items})
        except BaseException:
            lock.release()
            raise
        with writer:
            runner = _Runner(job, encoder, writer, previous, pool, device, autocast_dtype, counts, workers)
            runner.run(_batches(items, batch_size), quiet=quiet)
    if runner.decoded:
        counts.update(head_s=runner.decoded[0] - wall, tail_s=time.perf_counter() - runner.decoded[1])
    factors = [media.upscale_factor(item, item.bucket) for item in items]
    counts.update(upscaled=sum(f > 1.0 for f in factors), max_upscale=max(factors), decode_workers=workers,
                  bound=max(_STAGE_SECONDS, key=lambda k: counts[k] / (workers if k == "decode_s" else 1)).removesuffix("_s"))
    if stats is not None:
        stats.update(counts, items=len(items), skipped=len(skipped), skipped_keys=[s["key"] for s in skipped],
                     unchanged=False, wall_s=time.perf_counter() - wall)
    if not quiet:
        print(_summary(job.kind, counts, len(items), skipped))
    return fmt.cache_path(out_dir, split, "data")


# each stage's busy seconds in stats (see build_image_cache)
_STAGE_SECONDS = ("decode_s", "feed_s", "h2d_s", "encode_s", "write_s")


def _plan(job: _Job, source, pool, skip_bad: bool) -> tuple[list[media.Item], list[dict]]:
    """Probe every item's header (threads), then give each its bucket; unreadable items raise or are skipped."""
    entries = media.list_items(source, video=job.kind == "video")
    if not entries:
        raise InvalidArgumentError(f"source {os.fspath(source)} holds no {job.kind}s")
    items, skipped = [], []
    # skip_bad: decode every item fully now, so a truncated file is skipped, not fatal mid-build
    share, probes = distributed.current_share(), [(key, path, skip_bad) for key, path in entries]
    futures = [pool.submit(media.probe, *a) for a in probes] if share is None else share.map(pool, media.probe, probes)
    for (key, path), future in zip(entries, futures):
        try:
            item = future.result()
            item.bucket = tuple(job.bucket_of(item))
            item.draft = job.jpeg_draft and media.plan_draft(item)
            if job.captions is not None:
                item.caption = job.captions(key, path)
        except ImageError as exc:
            if not skip_bad:
                raise
            skipped.append({"key": key, "path": path, "error": str(exc)})
            continue
        items.append(item)
    if not items:
        raise InvalidArgumentError(f"source {os.fspath(source)} has no usable {job.kind}s ({len(skipped)} skipped)")
    return items, skipped


def _batches(items: list[media.Item], batch_size: int) -> list[list[media.Item]]:
    """Batches of one bucket: buckets in first-use order of the sorted keys, keys sorted within."""
    by_bucket: dict[tuple, list[media.Item]] = {}
    for item in sorted(items, key=lambda x: x.key):
        by_bucket.setdefault(item.bucket, []).append(item)
    return [group[k : k + batch_size] for group in by_bucket.values() for k in range(0, len(group), batch_size)]


def _content_hash_of(out_dir, split, previous) -> str:
    """The content hash algorithm of this build: the one the complete cache it copies from, else the
    interrupted build it may resume, was made with (named in its meta; none named: BLAKE2b-128, every
    cache before the stamp), so their stored hashes are compared with like; else :data:`CONTENT_HASH`."""
    if previous is not None:
        return previous.meta.get("content_hash", LEGACY_CONTENT_HASH)
    logged = fmt.progress_meta(out_dir, split)
    return CONTENT_HASH if logged is None else logged.get("content_hash", LEGACY_CONTENT_HASH)


def _previous_cache(out_dir, split, identity, meta):
    """The complete shaped cache already in the folder, if built with this encoder and settings."""
    try:
        cache = LatentCache(out_dir, split)
    except (OSError, ValueError, CacheError):
        return None
    if fmt.damaged_files(cache.cache_dir, split, cache.meta):
        return None  # a damaged index file (keys, hashes, checksums, info): nothing of it is copied, all is encoded
    # other buckets are fine: an item is copied only if its own bucket is unchanged
    same = cache.shaped and cache.meta.get("encoder") == identity and all(
        cache.meta.get(k) == meta.get(k) for k in ("kind", "resize", "frame_stride", "encode_dtype", "latent_std", "flip",
                                                   "text_encoder", "latent_dtype"))
    return cache if same else None


def _unchanged(cache, items: list[media.Item]) -> bool:
    """Same keys, content hashes and shapes in the plan's order, and every checksum intact."""
    hashes = cache.content_hashes()
    order = [item for batch in _batches(items, len(items)) for item in batch]
    if hashes is None or cache.keys != [item.key for item in order]:
        return False
    if any(hashes[i].tobytes() != item.digest for i, item in enumerate(order)):
        return False
    try:
        for items in cache.field_items.values():  # every stored field value against its CRC (a shared one once)
            items.check(np.unique(items.row_starts, return_index=True)[1])
    except CacheError:
        return False
    return not bad_blocks(cache, first_only=True)[0]


class _Runner:
    """Runs the planned batches: skip what the writer has, copy what the old cache holds, encode the rest.

    Stages, overlapped (see :mod:`.encode`): a feed thread plans each batch (old latents read and
    checked for copying), has the decode pool write its images (every frame of a clip, each decoded
    once) into a recycled uint8 buffer, and copies the finished buffer to the device (a CPU build
    normalizes it there, into one of at most two recycled outputs); the caller's thread normalizes (CUDA) and
    encodes; a writer thread
    appends and makes each batch durable, in order. Queues of ``_QUEUE`` batches join them, and
    ``ahead`` batches decode in advance (enough to keep every decode worker busy).
    """

    lookahead = 2  # batches decoding ahead of the encoder, at least

    def __init__(self, job, encoder, writer, previous, pool, device, autocast_dtype, counts, workers):
        self.job, self.encoder, self.writer, self.pool = job, encoder, writer, pool
        self.device, self.autocast_dtype, self.counts, self.workers = device, autocast_dtype, counts, workers
        self.previous = previous
        self.old_rows = {} if previous is None else _old_rows(previous)
        self.seeded = getattr(encoder, "sample", "mode") == "sample" and _accepts_seeds(job.encode)
        self.decoded: tuple = ()  # (the first decode's start, the last one's end), once any ran
        self.dtype = pixel_dtype(encoder)

    def run(self, batches, *, quiet: bool) -> None:
        total = sum(len(b) for b in batches)
        work = [b for b in ([item for item in batch if item.key not in self.writer] for batch in batches) if b]
        self.counts["resumed"] = total - sum(len(w) for w in work)
        if not work:
            return
        bar = progress_bar(total=total, initial=self.counts["resumed"], unit=self.job.kind + "s", desc="latent cache",
                   disable=True if quiet else None)
        biggest = max(len(batch) for batch in work)
        ahead = max(self.lookahead, -(-2 * self.workers // biggest))
        stages = Stages()
        buffers = BatchBuffers(ahead + 2, max(len(b) * math.prod(b[0].bucket) * 3 for b in work), self.device, stages,
                               self.dtype)
        encoded, written = queue.Queue(_QUEUE), queue.Queue(_QUEUE)
        stages.start("feed", self._feed, work, ahead, buffers, stages, encoded)
        writer = stages.start("write", self._write, written, bar)
        try:
            while (batch := self._take(stages, encoded)) is not None:
                stages.put(written, self._encode_batch(buffers, *batch))
        except Stopped:
            pass
        except BaseException as exc:
            stages.fail(exc)
        finally:  # the batches encoded so far are written and durable, unless the writer itself failed
            with contextlib.suppress(Stopped):
                while writer.is_alive() and not _offer(written, _DONE):
                    pass
            writer.join()
            stages.stop.set()
            for thread in stages.threads:
                thread.join()
            buffers.close()
            bar.close()
            self.counts["h2d_s"] += buffers.h2d_s
        stages.raise_error()

    def _take(self, stages, encoded):
        """The next batch from the feed, None at its end; the time waited is the encoder starved."""
        t0 = time.perf_counter()
        batch = stages.get(encoded)
        self.counts["encode_wait_s"] += time.perf_counter() - t0
        return None if batch is _DONE else batch

    # -- the feed thread ---------------------------------------------------------------------------
    def _feed(self, work, ahead, buffers, stages, encoded) -> None:
        pending: deque = deque()
        try:
            for batch in work:
                pending.append(self._start(batch, buffers))
                if len(pending) > ahead:
                    stages.put(encoded, self._finish(pending.popleft(), buffers, stages))
            while pending:
                stages.put(encoded, self._finish(pending.popleft(), buffers, stages))
            stages.put(encoded, _DONE)
        finally:
            for _, _, _, _, futures in pending:
                for future in futures:
                    future.cancel()

    def _start(self, batch, buffers):
        """``(batch, copies, items to encode, buffer, decode futures)``: the old latents that can be
        copied (read and checked now; an item whose bytes fail their checksum is encoded instead), and
        the decodes of the rest started, each into its slot of a free buffer."""
        with timed(self.counts, "feed_s"):
            copies = {}
            for item in batch:
                if self._copyable(item) and (record := self._read_copy(item)) is not None:
                    copies[item.key] = record
            to_encode = [item for item in batch if item.key not in copies]
        if not to_encode:
            return batch, copies, to_encode, None, []
        buf = buffers.acquire()
        shape = buffers.shape(len(to_encode), to_encode[0].bucket)
        slots = buf.host[: math.prod(shape)].view(shape)
        return batch, copies, to_encode, buf, [self.pool.submit(self._load_into, item, buffers, slots[j])
                                               for j, item in enumerate(to_encode)]

    def _load_into(self, item, buffers, slot: torch.Tensor):
        """Decode one item (each frame once) straight into its slot of the batch buffer; ``(info, start, end)``.
        An item not hashed yet (nothing to compare it with) is hashed here: an image from the bytes its
        decoder reads (the file read once), a clip's files beside the other decodes."""
        t0 = time.perf_counter()
        data = None
        if not item.digest:
            data = media.read_image(item) if self.job.kind == "image" else None
            item.digest = self.job.digest(item, data)
        frames, info = self.job.load(item, data)
        buffers.place(slot, frames)
        return info, t0, time.perf_counter()

    def _finish(self, plan, buffers, stages):
        """The batch's decodes waited for, its buffer sent to the device (on the CPU: normalized)."""
        batch, copies, to_encode, buf, futures = plan
        loads = [stages.result(future) for future in futures]
        self.counts["decode_s"] += sum(end - start for _, start, end in loads)
        if loads:  # (perf_counter stamps: the build's head and tail, see build_image_cache's stats)
            first = min(start for _, start, _ in loads)
            self.decoded = (min(first, self.decoded[0]) if self.decoded else first, max(end for *_, end in loads))
        sent = None
        if to_encode:
            output = buffers.output()  # (CPU) waited for outside feed_s: a slow encoder holds the outputs
            with timed(self.counts, "feed_s"):
                sent = buffers.send(buf, buffers.shape(len(to_encode), to_encode[0].bucket), output)
        return batch, copies, to_encode, [info for info, *_ in loads], sent

    # -- the caller's thread: (on CUDA, normalize and) encode ----------------------------------------
    def _encode_batch(self, buffers, batch, copies, to_encode, infos, sent):
        records = None
        if to_encode:
            with timed(self.counts, "encode_s"):
                records = self._encode(to_encode, buffers.take(sent))
                buffers.done(sent)
        return batch, copies, to_encode, records, infos

    # -- the writer thread -------------------------------------------------------------------------
    def _write(self, written, bar) -> None:
        while (batch := written.get()) is not _DONE:
            with timed(self.counts, "write_s"):
                self._write_batch(*batch)
            bar.update(len(batch[0]))

    def _write_batch(self, batch, copies, to_encode, records, infos) -> None:
        position = {item.key: j for j, item in enumerate(to_encode)}
        for item in batch:
            if item.key in copies:
                self._append_copy(item, copies[item.key])
                continue
            j = position[item.key]
            self.writer.append(item.key, records[j], source_hash=item.digest, info={**infos[j], "bucket": list(item.bucket)})
            self.counts["encoded"] += 1
        self.writer.flush()  # durable per batch: a crash loses at most the batches in flight, as in the line builder

    def _copyable(self, item) -> bool:
        old = self.old_rows.get(item.key)
        return old is not None and old[1] == item.digest and tuple(self.previous.info(old[0]).get("bucket", ())) == item.bucket

    def _read_copy(self, item):
        """The old cache's record of ``item``, every stored value checked against its CRC: ``(record,
        info)`` (a cache with fields) or ``(shape, payload, crc, info)``; None if a check fails."""
        index = self.old_rows[item.key][0]
        info = self.previous.info(index)
        crc = int(self.previous_sums[index])
        with contextlib.suppress(CacheError):
            if self.previous.field_items:  # a record: every field value checked against its CRC
                for items in self.previous.field_items.values():
                    items.check(np.asarray([index]))
                record = self.previous.record(index)
                if zlib.crc32(record["latent"].reshape(-1).view(torch.uint8).numpy()) != crc:  # (bytes: any latent dtype)
                    raise CacheError(f"item {item.key!r}: its bytes fail their CRC-32 checksum")
                return record, info
            start, end = int(self.previous.row_starts[index]), int(self.previous.row_starts[index + 1])
            payload = self.previous._memmap()[start:end].tobytes()
            if zlib.crc32(payload) != crc:  # (the writer checks again before it writes)
                raise CacheError(f"item {item.key!r}: its bytes fail their CRC-32 checksum")
            return self.previous.shapes[index], payload, crc, info
        return None

    def _append_copy(self, item, copy) -> None:
        if len(copy) == 2:
            self.writer.append(item.key, copy[0], source_hash=item.digest, info=copy[1])
        else:
            shape, payload, crc, info = copy
            self.writer.append_bytes(item.key, shape, payload, crc, source_hash=item.digest, info=info)
        self.counts["copied"] += 1

    @property
    def previous_sums(self):
        if not hasattr(self, "_sums"):
            self._sums = _stored_checksums(self.previous)
        return self._sums

    def _encode(self, items, batch) -> list:
        """One record per item (``batch``: their pixels on the device, in [-1, 1]): the latent tensor
        alone, or a dict of the job's fields."""
        fields = self._latent_fields(items, batch, "latent")
        if self.job.flip:  # the mirror of the resized, cropped image, encoded on its own (kohya's latents_flipped)
            fields.update(self._latent_fields(items, torch.flip(batch, dims=[-1]), "latent_flipped"))
        if self.job.text_encoder is not None:
            fields.update(self._text_fields([item.caption for item in items]))
        if len(fields) == 1 and self.job.latent_dtype == torch.float16:
            return list(fields["latent"])  # plain float16 latents: the single-tensor append, as always
        return [{name: values[b] for name, values in fields.items()} for b in range(len(items))]

    def _latent_fields(self, items, batch, name) -> dict:
        kwargs = {"seeds": [_item_seed(item.key) for item in items]} if self.seeded else {}
        if self.job.store_std:
            kwargs["with_std"] = True
        z = encode(self.job.encode, batch, self.device, self.autocast_dtype, **kwargs)
        z, std = (owned(t, batch) for t in (z if self.job.store_std else (z, None)))
        if z.shape[0] != len(items):
            raise InvalidArgumentError(f"the encoder returned {z.shape[0]} latents for a batch of {len(items)}")
        plain = std is None and name == "latent" and not self.job.flip and self.job.text_encoder is None
        if plain and self.job.latent_dtype == torch.float16:
            return {name: z}  # a plain cache: the writer stores the latent as it always has
        fields = {name: _as_latent_dtype(items, name, z, self.job.latent_dtype)}
        if std is not None:
            fields[name + "_std"] = _as_latent_dtype(items, name + "_std", std, self.job.latent_dtype)
        return fields

    def _text_fields(self, captions: list[str]) -> dict:
        """``text`` (a list of ``[L_i, D]``) and ``text_pooled``: each distinct caption of the batch encoded once."""
        distinct = list(dict.fromkeys(captions))
        encoded = self.job.text_encoder.encode(distinct)
        where = {caption: k for k, caption in enumerate(distinct)}
        if isinstance(encoded, dict):  # several encoders (latentfast.text_presets.TextEncoders): its named fields
            return {name: [values[where[c]].detach().cpu() for c in captions] for name, values in encoded.items()}
        fields = {"text": [encoded.embeds[where[c]].detach().cpu() for c in captions]}
        if encoded.pooled is not None:
            fields["text_pooled"] = [encoded.pooled[where[c]].detach().cpu() for c in captions]
        return fields


def _old_rows(cache) -> dict[str, tuple[int, bytes]]:
    hashes = cache.content_hashes()
    if hashes is None:
        return {}
    return {key: (i, hashes[i].tobytes()) for i, key in enumerate(cache.keys)}


def _stored_checksums(cache):
    return fmt.load_checksums(cache.cache_dir, cache.split, len(cache), 1, cache.meta)


def _item_seed(key: str) -> int:
    """A stable per-item seed (the same in every run, process and resume)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little") >> 1


def _accepts_seeds(fn) -> bool:
    try:
        return "seeds" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
