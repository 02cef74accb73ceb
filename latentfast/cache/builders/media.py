"""Source media for the shaped-cache builders: listing, probing, bucket choice, resize + centre crop.

An item is an image file, a folder of frame images (one clip, frames in file-name order) or a video
file (decoded with PyAV, ``pip install latentfast[video]``). Its key is its path relative to the
source folder (or as written in the manifest), without extension, with ``/`` separators.

Bucket choice follows the popular trainers (kohya, SimpleTuner, musubi-tuner): the bucket whose
aspect ratio is nearest in log space; the image is resized with LANCZOS so that it covers the
bucket, then centre-cropped to it. Each item records ``original_size`` ``[h, w]`` and
``crop_top_left`` ``[top, left]`` (in resized pixels), the SDXL conditioning a trainer may need.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from ...errors import ImageError, InvalidArgumentError
from ..store.durable import content_hash
from ..store.writer import check_file_name
from . import manifest

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp")
VIDEO_EXTENSIONS = (".mp4", ".webm", ".mkv", ".mov", ".avi", ".m4v")


@dataclass
class Item:
    key: str
    path: str
    width: int = 0
    height: int = 0
    frames: int = 1  # frame count of a clip (1 for an image)
    digest: bytes = b""  # the content hash of its source (see :func:`source_digest`); b"" until hashed
    frame_paths: list = field(default_factory=list)  # a folder clip's frames, in order
    bucket: tuple = ()  # (h, w) or (frames, h, w) once planned
    caption: str | None = None  # with a text encoder: the item's caption, once planned
    orientation: int = 1  # EXIF orientation (1: displayed as stored), read from the header while probing
    jpeg: bool = False  # a JPEG file: decodable at 1/2, 1/4 or 1/8 scale (DCT scaling, ``Image.draft``)
    draft: bool = False  # once planned: decoded at a reduced DCT scale, its bucket shrinks it >= 2x


def _key_of(rel: str, is_dir: bool) -> str:
    rel = rel.replace(os.sep, "/")
    return rel if is_dir else os.path.splitext(rel)[0]


def list_items(source, *, video: bool) -> list[tuple[str, str]]:
    """``(key, path)`` for a folder (walked recursively, sorted) or a JSONL manifest (one object per line
    with ``"image"`` / ``"video"`` / ``"frames"`` naming a path, relative to the manifest's folder, and an
    optional ``"key"``). Duplicate keys raise ``InvalidArgumentError`` naming both sources."""
    source = os.path.abspath(os.fspath(source))  # `imgs`, `./imgs` and `/abs/imgs` plan the same build
    if os.path.isdir(source):
        entries = _walk(source, video)
    elif os.path.isfile(source):
        entries = _read_manifest(source)
    else:
        raise FileNotFoundError(f"source must be a JSONL manifest or a folder, and {source} is neither")
    seen: dict[str, str] = {}
    for key, path in entries:
        if key in seen:
            raise InvalidArgumentError(f"source {source}: key {key!r} names two items, {seen[key]} and {path}; rename one")
        seen[key] = path
    return entries


def _walk(root: str, video: bool) -> list[tuple[str, str]]:
    entries = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        images = [f for f in files if f.lower().endswith(IMAGE_EXTENSIONS)]
        if video and images and folder != root:  # a folder of frames is one clip
            check_file_name(root, folder)
            entries.append((_key_of(os.path.relpath(folder, root), True), folder))
            dirs[:] = []
            continue
        wanted = VIDEO_EXTENSIONS if video else IMAGE_EXTENSIONS
        for name in sorted(f for f in files if f.lower().endswith(wanted) and not f.startswith(".")):
            path = os.path.join(folder, name)
            check_file_name(root, path)
            entries.append((_key_of(os.path.relpath(path, root), False), path))
    return sorted(entries)


def _read_manifest(path: str) -> list[tuple[str, str]]:
    root = os.path.dirname(os.path.abspath(path))
    entries = []
    for _, name, record in manifest.read_manifest(path, ("image", "video", "frames")):
        full, key = manifest.resolve(name, root), record.get("key")
        entries.append((str(key) if key is not None else _key_of(os.path.normpath(name), os.path.isdir(full)), full))
    return entries


def probe(key: str, path: str, decode: bool = False) -> Item:
    """Size (as displayed) and frame count of one item, from its header (a video's packets); its
    content hash is :func:`source_digest`'s. ``decode``: also decode every image / frame fully, so a
    truncated file fails here (the header alone reads fine) rather than in the middle of the build."""
    try:
        if os.path.isdir(path):
            return _probe_frames(key, path, decode)
        if path.lower().endswith(VIDEO_EXTENSIONS):
            return _probe_video(key, path, decode)
        from PIL import Image

        with Image.open(path) as im:
            turn = orientation(im)
            width, height = upright_size(im, turn)
            jpeg = im.format == "JPEG"
            if decode:
                im.load()
        return Item(key, path, width, height, 1, orientation=turn, jpeg=jpeg)
    except ImageError:
        raise
    except Exception as exc:  # noqa: BLE001 - any reader failure is reported with its key
        raise ImageError(f"item {key!r} ({path}): cannot read: {exc}") from None


def _probe_frames(key: str, folder: str, decode: bool) -> Item:
    from PIL import Image

    frames = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.lower().endswith(IMAGE_EXTENSIONS))
    if not frames:
        raise ImageError(f"item {key!r} ({folder}): the clip folder holds no frame images")
    with Image.open(frames[0]) as im:
        width, height = upright_size(im)
    for frame in frames if decode else ():
        with Image.open(frame) as im:
            try:
                im.load()
            except Exception as exc:  # noqa: BLE001 - name the frame, not just the clip
                raise ImageError(f"item {key!r} ({folder}): frame {os.path.basename(frame)}: cannot decode: {exc}") from None
    return Item(key, folder, width, height, len(frames), frame_paths=frames)


def _probe_video(key: str, path: str, decode: bool) -> Item:
    av = _import_av()
    with av.open(path) as container:
        stream = container.streams.video[0]
        width, height = stream.codec_context.width, stream.codec_context.height
        if decode:  # every frame decoded: a damaged stream fails here
            frames = sum(1 for _ in container.decode(stream))
        else:
            frames = sum(1 for packet in container.demux(stream) if packet.size)
    return Item(key, path, width, height, frames)


def source_digest(item: Item, algorithm: str, data: bytes | None = None) -> bytes:
    """The content hash (:func:`~latentfast.cache.store.durable.content_hash`, of ``algorithm``) of an
    item's source: its file, or a clip folder's frames in order. ``data``: an image file's bytes, read
    already (:func:`read_image`)."""
    try:
        return content_hash(item.frame_paths or item.path, algorithm=algorithm, data=data)
    except OSError as exc:
        raise ImageError(f"item {item.key!r} ({item.path}): cannot read: {exc}") from None


def read_image(item: Item) -> bytes:
    """An image item's file, whole: what :func:`source_digest` hashes and :func:`fitted_image` decodes, read once."""
    try:
        with open(item.path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise ImageError(f"item {item.key!r} ({item.path}): cannot read: {exc}") from None


def _import_av():
    try:
        import av
    except ImportError:
        raise ImageError("video files need PyAV: pip install 'latentfast[video]' (or use folders of frame images)") from None
    return av


def nearest_bucket(width: int, height: int, buckets: list[tuple[int, int]]) -> tuple[int, int]:
    """The ``(h, w)`` bucket whose aspect ratio is nearest to ``width / height`` in log space
    (ties: the first listed)."""
    ratio = math.log(width / height)
    return min(buckets, key=lambda b: abs(math.log(b[1] / b[0]) - ratio))


def upscale_factor(item: Item, bucket: tuple) -> float:
    """How much :func:`fit` enlarges the item to cover its bucket (at most 1: no upscaling)."""
    return max(bucket[-1] / item.width, bucket[-2] / item.height)


def no_upscale_bucket(item: Item, nearest: tuple[int, int], max_area: int, step: int) -> tuple[int, int]:
    """kohya's ``bucket_no_upscale``: an image that its nearest bucket would enlarge gets a bucket of
    its own size instead, shrunk (aspect kept) to at most the largest bucket's area and rounded down
    to multiples of ``step``, so it is only ever scaled down and cropped by less than ``step``."""
    if upscale_factor(item, nearest) <= 1.0:
        return nearest
    scale = min(1.0, math.sqrt(max_area / (item.width * item.height)))
    height, width = int(item.height * scale) // step * step, int(item.width * scale) // step * step
    if not height or not width:
        raise ImageError(f"item {item.key!r} ({item.path}): {item.width}x{item.height} pixels, smaller than one"
                         f" bucket step ({step}) in a side: no bucket fits without upscaling")
    return height, width


def resolution_buckets(resolution: int, min_side: int = 256, max_side: int = 2048, step: int = 64) -> list[tuple[int, int]]:
    """``(h, w)`` buckets generated from a target resolution as kohya's ``make_bucket_resolutions``
    does: the square of about ``resolution`` pixels a side, then for every width from ``min_side``
    to ``max_side`` in steps of ``step`` the tallest height (a multiple of ``step``, at most
    ``max_side``) whose area is at most ``resolution ** 2``, and its transpose."""
    for name, value in (("resolution", resolution), ("min_side", min_side), ("max_side", max_side), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
    if min_side > max_side or resolution < step:
        raise InvalidArgumentError(f"bucket sides must satisfy step {step} <= resolution {resolution} and min_side"
                                   f" {min_side} <= max_side {max_side}")
    area = resolution * resolution
    side = resolution // step * step
    out = {(side, side)}
    for width in range(min_side, max_side + 1, step):
        height = min(max_side, area // width // step * step)
        if height >= min_side:
            out.update({(height, width), (width, height)})
    return sorted(out)


def check_buckets(buckets, *, video: bool, factor: int | None) -> list[tuple[int, ...]]:
    """Buckets as tuples of ints: ``(h, w)`` pixel sizes, or ``(frames, h, w)`` for video; sides must be
    positive multiples of the encoder's spatial ``factor`` (when known)."""
    size = 3 if video else 2
    what = "(frames, height, width)" if video else "(height, width)"
    try:
        out = [tuple(int(x) for x in b) for b in buckets]
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"buckets must be a list of {what} pixel sizes, got {buckets!r}") from None
    if not out or any(len(b) != size or min(b) < 1 for b in out):
        raise InvalidArgumentError(f"buckets must be a non-empty list of {what} positive sizes, got {buckets!r}")
    if factor and any(b[-1] % factor or b[-2] % factor for b in out):
        bad = next(b for b in out if b[-1] % factor or b[-2] % factor)
        raise InvalidArgumentError(f"bucket {bad}: height and width must be multiples of the encoder's downscale factor {factor}")
    return sorted(set(out), key=out.index)


def fit(image, bucket_hw: tuple[int, int], size: tuple[int, int] | None = None):
    """``(image resized to cover the bucket and centre-cropped to it, info)``. ``size``: the
    ``(width, height)`` the resize is reckoned from when ``image`` was decoded smaller (a JPEG draft):
    the same output size and crop as from the full image."""
    from PIL import Image

    bh, bw = bucket_hw
    w, h = size or image.size
    rw, rh = cover_size(w, h, bucket_hw)
    if (rw, rh) != image.size:
        image = image.resize((rw, rh), Image.LANCZOS)
    top, left = (rh - bh) // 2, (rw - bw) // 2
    image = image.crop((left, top, left + bw, top + bh))
    return image, {"original_size": [h, w], "crop_top_left": [top, left]}


# ImageOps.exif_transpose's mapping: EXIF orientation -> the transpose that displays the image upright
_TRANSPOSE = {2: "FLIP_LEFT_RIGHT", 3: "ROTATE_180", 4: "FLIP_TOP_BOTTOM", 5: "TRANSPOSE", 6: "ROTATE_270",
              7: "TRANSVERSE", 8: "ROTATE_90"}
# PNG chunks that Pillow reads only when it decodes the pixels if they come after IDAT (as eXIf may):
# the ones that can hold the orientation
_PNG_EXIF_KEYS = ("Raw profile type exif", "XML:com.adobe.xmp")


def upright_rgb(image, turn: int | None = None):
    """An opened PIL image as 8-bit RGB the way it displays: EXIF orientation ``turn`` (read from the
    image when None) applied (as the trainers do), 16-bit grey (which Pillow opens as ``I;16`` or
    ``I``) scaled to 8 bits rather than clipped (``convert("RGB")`` clips 16-bit values to 255:
    nearly white). No copy is made that the result does not need (an RGB image shown as stored is
    returned decoded, as it is)."""
    from PIL import Image

    image.load()
    method = _TRANSPOSE.get(orientation(image) if turn is None else turn)
    if method is not None:
        image = image.transpose(getattr(Image.Transpose, method))
    if image.mode.startswith("I;16") or image.mode == "I":
        grey = np.asarray(image, dtype=np.float64)
        grey = np.clip(np.rint(grey * (255.0 / 65535.0)), 0, 255).astype(np.uint8)  # 16-bit range in both modes
        image = Image.fromarray(grey, "L")
    return image if image.mode == "RGB" else image.convert("RGB")


def orientation(image) -> int:
    """An opened image's EXIF orientation still to apply once Pillow has decoded it (1-8; 1 when it has
    none), read without decoding its pixels:
    Pillow decodes a whole PNG to find an eXIf or text chunk after IDAT, so a PNG's chunks are walked
    here (headers only; IDAT is skipped, never inflated)."""
    from PIL import Image

    if image.format == "TIFF" and hasattr(image, "_tile_size"):
        return 1  # this Pillow turns a TIFF upright itself as it decodes it (its size is the upright one already)
    if image.format == "PNG" and "exif" not in image.info and getattr(image, "fp", None) is not None:
        image.info.update(_png_exif_chunks(image.fp, image.info))
        return Image.Image.getexif(image).get(0x0112, 1)  # the base reading, not PNG's decoding one
    return image.getexif().get(0x0112, 1)


def _png_exif_chunks(fp, info: dict) -> dict:
    """``{"exif": ...}`` and the text chunks of ``_PNG_EXIF_KEYS`` of a PNG, as Pillow's ``info``
    holds them after decoding; read from chunk headers and those chunks alone. A chunk that runs past
    the end of the file, or no IEND, raises (a truncated file). ``fp``'s position is kept (Pillow reads
    IDAT from there)."""
    import struct

    here, found = fp.tell(), {}
    try:
        size = fp.seek(0, os.SEEK_END)
        position = fp.seek(8)  # past the signature
        while True:
            head = fp.read(8)
            if len(head) < 8:
                raise ValueError("truncated PNG (it ends before its IEND chunk)")
            length, kind = struct.unpack(">I4s", head)
            if kind == b"IEND":
                break
            position += 12 + length  # length, type, data, CRC
            if position > size:
                raise ValueError(f"truncated PNG ({kind.decode('latin-1')} runs past the end of the file)")
            if kind in (b"eXIf", b"tEXt", b"zTXt", b"iTXt"):
                _png_exif_chunk(kind, fp.read(length), found, info)
            fp.seek(position)
    finally:
        fp.seek(here)
    return found


def _png_exif_chunk(kind: bytes, data: bytes, found: dict, info: dict) -> None:
    import zlib

    if kind == b"eXIf":
        found["exif"] = b"Exif\x00\x00" + data  # what Pillow's info holds for it
        return
    keyword, _, rest = data.partition(b"\0")
    keyword = keyword.decode("latin-1")
    if keyword not in _PNG_EXIF_KEYS or keyword in info:  # one before IDAT: Pillow read it already
        return
    if kind == b"tEXt":
        found[keyword] = rest.decode("latin-1", "replace")
    elif kind == b"zTXt":
        found[keyword] = zlib.decompress(rest[1:]).decode("latin-1", "replace")
    else:  # iTXt: compression flag, method, language\0, translated keyword\0, text (UTF-8)
        text = rest[2:].split(b"\0", 2)[-1]
        found[keyword] = (zlib.decompress(text) if rest[:1] == b"\x01" else text).decode("utf-8", "replace")


def upright_size(image, turn: int | None = None) -> tuple[int, int]:
    """``(width, height)`` as displayed: sides swapped for EXIF orientations 5-8 (a quarter turn)."""
    width, height = image.size
    return (height, width) if (orientation(image) if turn is None else turn) in (5, 6, 7, 8) else (width, height)


def to_pixels(image) -> torch.Tensor:
    """A PIL image as float32 ``[3, h, w]`` in [-1, 1] (x / 127.5 - 1)."""
    array = np.asarray(image.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(array.copy()).permute(2, 0, 1).float().div_(127.5).sub_(1.0)


def to_uint8(image) -> np.ndarray:
    """An RGB PIL image as uint8 ``[h, w, 3]`` (the builders normalize on the encoder's device)."""
    return np.asarray(image if image.mode == "RGB" else image.convert("RGB"), dtype=np.uint8)


def cover_size(width: int, height: int, bucket_hw) -> tuple[int, int]:
    """``(w, h)`` an image of ``width x height`` is resized to so that it covers the bucket (aspect kept)."""
    bh, bw = bucket_hw
    scale = max(bw / width, bh / height)
    return max(bw, round(width * scale)), max(bh, round(height * scale))


def plan_draft(item: Item) -> bool:
    """Whether a JPEG decodes at a reduced DCT scale: when its bucket shrinks it at least 2x in both
    sides (Pillow's ``draft`` rule: the largest of 1/2, 1/4, 1/8 that stays >= the resized size)."""
    if not item.jpeg:
        return False
    rw, rh = cover_size(item.width, item.height, item.bucket[-2:])
    return min(item.width // rw, item.height // rh) >= 2


def fitted_image(item: Item, data: bytes | None = None) -> tuple:
    """``(the item as an RGB PIL image resized and cropped to its bucket, its info)``, decoded from
    ``data`` (the file's bytes, :func:`read_image`) when given. A planned draft asks the JPEG decoder
    for the resized size (in the file's orientation), so it decodes at the largest DCT scale that stays
    at least that big; the resize is reckoned from the full size."""
    import io

    from PIL import Image

    try:
        with Image.open(item.path if data is None else io.BytesIO(data)) as im:
            if item.draft:
                rw, rh = cover_size(item.width, item.height, item.bucket)
                im.draft("RGB", (rh, rw) if item.orientation in (5, 6, 7, 8) else (rw, rh))
            image = upright_rgb(im, item.orientation)
    except Exception as exc:  # noqa: BLE001
        raise ImageError(f"item {item.key!r} ({item.path}): cannot decode: {exc}") from None
    return fit(image, item.bucket, (item.width, item.height))


def load_image(item: Item) -> tuple[np.ndarray, dict]:
    """The item resized and cropped to its bucket (:func:`fitted_image`), uint8 ``[h, w, 3]``, and its info."""
    image, info = fitted_image(item)
    return to_uint8(image), info


def fitted_clip(item: Item, frame_stride: int = 1) -> tuple[list, dict]:
    """``(the clip's first bucket[0] frames (every frame_stride-th) as RGB PIL images, each decoded once,
    resized and cropped; the clip's info)``."""
    count, hw = item.bucket[0], item.bucket[1:]
    try:  # each frame resized as it comes: the clip is never held at its full size
        fitted = [fit(im, hw) for im in _frames(item, count, frame_stride)]
    except ImageError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ImageError(f"item {item.key!r} ({item.path}): cannot decode: {exc}") from None
    if len(fitted) < count:
        raise ImageError(f"item {item.key!r} ({item.path}): decoded {len(fitted)} frames, the bucket needs {count}")
    return [im for im, _ in fitted], {**fitted[0][1], "frames": item.frames, "frame_stride": frame_stride}


def write_rgb(image, out: np.ndarray, *, planar: bool) -> None:
    """An RGB PIL image's pixels written into ``out``: ``[3, h, w]`` planes (``planar``) or ``[h, w, 3]``.
    Pillow packs each plane itself (``tobytes("raw", band)``), about twice as fast as a transposing
    copy of the ``[h, w, 3]`` array; bit-equal to it."""
    if not planar:
        np.copyto(out, to_uint8(image))
        return
    for c, band in enumerate("RGB"):
        np.copyto(out[c], np.frombuffer(image.tobytes("raw", band), dtype=np.uint8).reshape(out.shape[1:]))


def _frames(item: Item, count: int, stride: int):
    from PIL import Image

    if item.frame_paths:
        for path in item.frame_paths[: count * stride : stride]:
            with Image.open(path) as im:
                yield upright_rgb(im)
        return
    av = _import_av()
    last = (count - 1) * stride  # the last frame needed: decoding stops there, not a frame later
    with av.open(item.path) as container:
        for k, frame in enumerate(container.decode(video=0)):
            if k % stride == 0:
                yield frame.to_image()
            if k == last:
                break


def clip_bucket(item: Item, buckets: list[tuple[int, int, int]], frame_stride: int) -> tuple[int, int, int]:
    """The ``(frames, h, w)`` bucket of a clip: the nearest aspect ratio, then the most frames it can fill."""
    hw = nearest_bucket(item.width, item.height, sorted({b[1:] for b in buckets}, key=[b[1:] for b in buckets].index))
    usable = -(-item.frames // frame_stride)
    fitting = [b for b in buckets if b[1:] == hw and b[0] <= usable]
    if not fitting:
        shortest = min(b[0] for b in buckets if b[1:] == hw)
        raise ImageError(f"item {item.key!r} ({item.path}): {usable} usable frames, fewer than the shortest {hw[0]}x{hw[1]} bucket's {shortest}")
    return max(fitting, key=lambda b: b[0])


def decode_workers(num_workers) -> int:
    """``num_workers``, or by default the cores this process may run on."""
    if num_workers is None:
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise InvalidArgumentError(f"num_workers must be a positive int (or None: the cores available), got {num_workers!r}")
    return num_workers
