"""Build shaped latent caches from images (aspect-ratio buckets) and video clips, through the writer.

Steps: list the source and probe every item in threads (size, frame count, content hash of the
bytes); give each item its bucket; plan batches of one bucket (buckets in the order given, keys
sorted within a bucket); then per batch either copy an item's latents from the cache already in
the folder (same encoder and settings, same content hash, checksum intact) or decode it (Pillow /
PyAV on a thread pool, two batches ahead) and encode it. Everything goes through
:class:`~latentfast.cache.LatentCacheWriter`, and each batch is made durable before the
next, so a build is crash-safe (a crash loses at most the batch in flight) and resumable (rerun
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
from .encode import encode, prepare
from ..store.durable import BuildLock
from ..store.writer import encoder_identity, open_for_sources


@dataclass
class _Job:
    """What differs between the image and the video builder."""

    kind: str  # "image" | "video"
    bucket_of: Callable[[media.Item], tuple]
    load: Callable[[media.Item], tuple[torch.Tensor, dict]]
    encode: Callable  # encoder method: (batch, **kw) -> latents
    store_std: bool = False  # the encoder's sample="store": fields latent and latent_std
    flip: bool = False  # also encode each image's mirror: field latent_flipped (and latent_flipped_std)
    text_encoder: Any = None  # captions -> fields text [L_i, D] and text_pooled [P]
    captions: Any = None  # (key, path) -> caption, with text_encoder
    latent_dtype: torch.dtype = torch.float16  # latent_dtype=: the latent fields' stored dtype


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
                      device="cpu", autocast_dtype: torch.dtype | None = None, num_workers: int = 4,
                      skip_bad_images: bool = False, no_upscale: bool = False, bucket_step: int = 64,
                      quiet: bool = False, lock_timeout: float = 0.0, stats: dict | None = None,
                      flip: bool = False, text_encoder: Any = None, captions: Any = None,
                      latent_dtype="float16", group=None, bucket_rule=None) -> str:
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
    build of this split. ``stats`` (a dict) receives counts and timings. ``latent_dtype``
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
    job = _Job("image", bucket_of, media.load_image, encoder.encode, flip=flip, latent_dtype=_latent_dtype(latent_dtype))
    settings = {"buckets": [list(b) for b in bucket_list], "resize": "lanczos-cover-center-crop",
                "encode_dtype": _encode_dtype(encoder, autocast_dtype)}
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
                      num_workers: int = 4, skip_bad_clips: bool = False, quiet: bool = False,
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
               lambda item: media.load_clip(item, frame_stride), encoder.encode_video,
               latent_dtype=_latent_dtype(latent_dtype))
    settings = {"buckets": [list(b) for b in bucket_list], "frame_stride": frame_stride,
                "resize": "lanczos-cover-center-crop", "encode_dtype": _encode_dtype(encoder, autocast_dtype)}
    settings.update(_record_settings(job, encoder, source, None, None))
    return _build(job, encoder, source, out_dir, split, settings, batch_size=batch_size, device=device,
                  autocast_dtype=autocast_dtype, num_workers=num_workers, skip_bad=skip_bad_clips, quiet=quiet,
                  lock_timeout=lock_timeout, stats=stats)


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
    from ..captions import Captions

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
    counts = {"decode_s": 0.0, "encode_s": 0.0, "write_s": 0.0, "encoded": 0, "copied": 0, "resumed": 0}
    with ThreadPoolExecutor(max_workers=max(1, num_workers)) as pool:
        items, skipped = _plan(job, source, pool, skip_bad)
        share = distributed.current_share()
        if share is not None:  # a distributed build: this rank's whole batches, costed pixels x frames
            batches = _batches(items, batch_size)
            items = share.keep([x for b in batches for x in b], batches, key=lambda x: x.key, cost=lambda x: math.prod(x.bucket))
        meta = {**settings, "kind": job.kind, "source": os.path.abspath(os.fspath(source)), "skipped": skipped}
        identity = encoder_identity(encoder)
        lock = BuildLock(out_dir, split, lock_timeout)
        try:
            previous = _previous_cache(out_dir, split, identity, meta)
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
            runner = _Runner(job, encoder, writer, previous, pool, device, autocast_dtype, counts)
            runner.run(_batches(items, batch_size), quiet=quiet)
    factors = [media.upscale_factor(item, item.bucket) for item in items]
    counts.update(upscaled=sum(f > 1.0 for f in factors), max_upscale=max(factors))
    if stats is not None:
        stats.update(counts, items=len(items), skipped=len(skipped), skipped_keys=[s["key"] for s in skipped],
                     unchanged=False, wall_s=time.perf_counter() - wall)
    if not quiet:
        print(_summary(job.kind, counts, len(items), skipped))
    return fmt.cache_path(out_dir, split, "data")


def _plan(job: _Job, source, pool, skip_bad: bool) -> tuple[list[media.Item], list[dict]]:
    """Probe every item (threads), then give each its bucket; unreadable items raise or are skipped."""
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
            if job.captions is not None:  # the caption is part of the source: an edited one re-encodes the item
                item.caption = job.captions(key, path)
                item.digest = hashlib.blake2b(item.digest + item.caption.encode(), digest_size=16).digest()
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


def _previous_cache(out_dir, split, identity, meta):
    """The complete shaped cache already in the folder, if built with this encoder and settings."""
    from ..store.reader import LatentCache

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
    from ..store.reader import bad_blocks

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
    """Runs the planned batches: skip what the writer has, copy what the old cache holds, encode the rest."""

    lookahead = 2  # batches decoding ahead of the encoder

    def __init__(self, job, encoder, writer, previous, pool, device, autocast_dtype, counts):
        self.job, self.encoder, self.writer, self.pool = job, encoder, writer, pool
        self.device, self.autocast_dtype, self.counts = device, autocast_dtype, counts
        self.previous = previous
        self.old_rows = {} if previous is None else _old_rows(previous)
        self.seeded = getattr(encoder, "sample", "mode") == "sample" and _accepts_seeds(job.encode)

    def run(self, batches, *, quiet: bool) -> None:
        from tqdm import tqdm

        total = sum(len(b) for b in batches)
        work = [[item for item in batch if item.key not in self.writer] for batch in batches]
        self.counts["resumed"] = total - sum(len(w) for w in work)
        bar = tqdm(total=total, initial=self.counts["resumed"], unit=self.job.kind + "s", desc="latent cache",
                   disable=True if quiet else None)
        try:
            plans = [self._split(batch) for batch in work if batch]
            pending = deque(self._submit(to_encode) for _, to_encode in plans[: self.lookahead])
            for k, (batch, to_encode) in enumerate(plans):
                loads = [f.result() for f in pending.popleft()]
                if k + self.lookahead < len(plans):
                    pending.append(self._submit(plans[k + self.lookahead][1]))
                self._write_batch(batch, to_encode, loads)
                bar.update(len(batch))
        finally:
            bar.close()

    def _split(self, batch):
        """``(batch, items to encode)``: items whose old latents can be copied are not encoded."""
        return batch, [item for item in batch if not self._copyable(item)]

    def _copyable(self, item) -> bool:
        old = self.old_rows.get(item.key)
        return old is not None and old[1] == item.digest and tuple(self.previous.info(old[0]).get("bucket", ())) == item.bucket

    def _submit(self, items):
        return [self.pool.submit(self._timed_load, item) for item in items]

    def _timed_load(self, item):
        t0 = time.perf_counter()
        pixels, info = self.job.load(item)
        return pixels, info, time.perf_counter() - t0

    def _write_batch(self, batch, to_encode, loads) -> None:
        self.counts["decode_s"] += sum(seconds for _, _, seconds in loads)
        records = self._encode(to_encode, [pixels for pixels, _, _ in loads]) if to_encode else None
        t0 = time.perf_counter()
        position = {item.key: j for j, item in enumerate(to_encode)}
        for item in batch:
            j = position.get(item.key)
            if j is None and self._copy(item):
                continue
            if j is None:  # the old bytes failed their checksum: encode this one now
                pixels, info = self.job.load(item)
                record = self._encode([item], [pixels])[0]
            else:
                record, info = records[j], loads[j][1]
            self.writer.append(item.key, record, source_hash=item.digest, info={**info, "bucket": list(item.bucket)})
            self.counts["encoded"] += 1
        self.writer.flush()  # durable per batch: a crash loses at most the batch in flight, as in the line builder
        self.counts["write_s"] += time.perf_counter() - t0

    def _copy(self, item) -> bool:
        index = self.old_rows[item.key][0]
        start, end = int(self.previous.row_starts[index]), int(self.previous.row_starts[index + 1])
        payload = self.previous._memmap()[start:end].tobytes()
        crc = int(self.previous_sums[index])
        with contextlib.suppress(CacheError):
            if self.previous.field_items:  # a record: every field value checked against its CRC, then copied
                for items in self.previous.field_items.values():
                    items.check(np.asarray([index]))
                record = self.previous.record(index)
                if zlib.crc32(record["latent"].reshape(-1).view(torch.uint8).numpy()) != crc:  # (bytes: any latent dtype)
                    raise CacheError(f"item {item.key!r}: its bytes fail their CRC-32 checksum")
                self.writer.append(item.key, record, source_hash=item.digest, info=self.previous.info(index))
            else:
                self.writer.append_bytes(item.key, self.previous.shapes[index], payload, crc, source_hash=item.digest,
                                         info=self.previous.info(index))
            self.counts["copied"] += 1
            return True
        return False

    @property
    def previous_sums(self):
        if not hasattr(self, "_sums"):
            self._sums = _stored_checksums(self.previous)
        return self._sums

    def _encode(self, items, pixels) -> list:
        """One record per item: the latent tensor alone, or a dict of the job's fields."""
        t0 = time.perf_counter()
        batch = torch.stack(pixels).to(self.device)
        fields = self._latent_fields(items, batch, "latent")
        if self.job.flip:  # the mirror of the resized, cropped image, encoded on its own (kohya's latents_flipped)
            fields.update(self._latent_fields(items, torch.flip(batch, dims=[-1]), "latent_flipped"))
        if self.job.text_encoder is not None:
            fields.update(self._text_fields([item.caption for item in items]))
        self.counts["encode_s"] += time.perf_counter() - t0
        if len(fields) == 1 and self.job.latent_dtype == torch.float16:
            return list(fields["latent"])  # plain float16 latents: the single-tensor append, as always
        return [{name: values[b] for name, values in fields.items()} for b in range(len(items))]

    def _latent_fields(self, items, batch, name) -> dict:
        kwargs = {"seeds": [_item_seed(item.key) for item in items]} if self.seeded else {}
        if self.job.store_std:
            kwargs["with_std"] = True
        z = encode(self.job.encode, batch, self.device, self.autocast_dtype, **kwargs)
        z, std = z if self.job.store_std else (z, None)
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
