"""The image builder's data side: orientation and size read without decoding pixels (PNG chunks walked,
IDAT never inflated), JPEG draft decoding as a stamped resize convention (how close it stays to a full
decode), uint8 batches in recycled buffers normalized by the fused op (bit-equal to x / 127.5 - 1),
the stages' busy times in ``stats``, and a failure in any stage raised promptly with what came before
it durable."""
from __future__ import annotations

import os
import struct
import threading
import time
import zlib

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile, ImageOps

from latentfast import ops
from latentfast.cache import LatentCache
from latentfast.cache.builders import encode as encode_module
from latentfast.cache.builders import media
from latentfast.cache.builders.images import build_image_cache
from latentfast.errors import ImageError, NonFiniteError
from latentfast.toy import ToyVAE
from latentfast.testing import photo_like

from test_cache_images import CountingVAE, by_hand, make_images

BUCKETS = [(32, 32), (32, 48), (48, 32)]


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _chunks(blob: bytes) -> list[tuple[bytes, bytes]]:
    out, at = [], 8
    while at < len(blob):
        length, kind = struct.unpack(">I4s", blob[at:at + 8])
        out.append((kind, blob[at + 8:at + 8 + length]))
        at += 12 + length
    return out


def write_png(path, pixels: np.ndarray, *, after_idat=(), corrupt_idat=False) -> None:
    """A PNG of ``pixels`` with the chunks ``after_idat`` (``(type, data)``) put between IDAT and IEND
    (where Pillow reads them only when it decodes the pixels); ``corrupt_idat``: IDAT's zlib stream
    garbled (CRCs kept right), so decoding the pixels fails and reading the header does not."""
    Image.fromarray(pixels).save(path)
    chunks = _chunks(open(path, "rb").read())
    if corrupt_idat:
        chunks = [(k, bytes(255 - b for b in d)) if k == b"IDAT" else (k, d) for k, d in chunks]
    body = [_chunk(k, d) for k, d in chunks[:-1]] + [_chunk(k, d) for k, d in after_idat] + [_chunk(*chunks[-1])]
    with open(path, "wb") as fh:
        fh.write(b"\x89PNG\r\n\x1a\n" + b"".join(body))


def exif_bytes(turn: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = turn
    return exif.tobytes()


def _xmp(turn: int) -> bytes:
    return (f'<x:xmpmeta xmlns:x="adobe:ns:meta/"><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#">'
            f'<rdf:Description xmlns:tiff="http://ns.adobe.com/tiff/1.0/" tiff:Orientation="{turn}"/></rdf:RDF></x:xmpmeta>').encode()


@pytest.fixture()
def count_decodes(monkeypatch):
    """Counts every pixel decode Pillow starts (``ImageFile.load``)."""
    calls = []
    load = ImageFile.ImageFile.load

    def counting(self):
        calls.append(self.format)
        return load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", counting)
    return calls


def _stored(rng, w=40, h=24):
    return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)


def test_planning_reads_orientation_without_decoding_pixels(tmp_path, count_decodes):
    """Before: the probe called getexif(), which decodes a whole PNG (and so failed on this corrupt
    IDAT); every format's orientation now comes from its header, and no pixel decode starts."""
    rng = np.random.default_rng(0)
    files = {}
    write_png(tmp_path / "after.png", _stored(rng), after_idat=[(b"eXIf", exif_bytes(6)[6:])], corrupt_idat=True)
    files["after.png"] = 6
    write_png(tmp_path / "xmp.png", _stored(rng), after_idat=[(b"iTXt", b"XML:com.adobe.xmp\0\0\0\0\0" + _xmp(8))])
    files["xmp.png"] = 8
    raw = "\nexif\n%d\n%s\n" % (len(exif_bytes(5)), exif_bytes(5).hex())
    write_png(tmp_path / "raw.png", _stored(rng), after_idat=[(b"zTXt", b"Raw profile type exif\0\0" + zlib.compress(raw.encode()))])
    files["raw.png"] = 5
    write_png(tmp_path / "plain.png", _stored(rng))
    files["plain.png"] = 1
    for name, fmt in (("photo.jpg", "JPEG"), ("photo.webp", "WEBP"), ("photo.tif", "TIFF")):
        Image.fromarray(_stored(rng)).save(tmp_path / name, fmt, exif=exif_bytes(6))
        files[name] = 6
    Image.fromarray(_stored(rng)).save(tmp_path / "photo.bmp")
    files["photo.bmp"] = 1
    items = {name: media.probe(name, str(tmp_path / name)) for name in files}
    assert count_decodes == []
    for name, turn in files.items():
        item = items[name]
        assert (item.width, item.height) == ((24, 40) if turn >= 5 else (40, 24)), name
        if name.endswith(".png"):
            assert item.orientation == turn, name
        if name != "after.png":  # built upright, as Pillow's own exif_transpose shows it after decoding
            item.bucket = (item.height, item.width)
            with Image.open(tmp_path / name) as im:
                want = np.asarray(ImageOps.exif_transpose(im).convert("RGB"))
            assert np.array_equal(media.load_image(item)[0], want), name
    with pytest.raises(ImageError, match="after.png.*cannot decode"):  # its pixels fail where they are decoded
        media.load_image(media.Item("after.png", str(tmp_path / "after.png"), 24, 40, orientation=6, bucket=(32, 32)))


def test_a_truncated_png_still_fails_the_plan(tmp_path):
    """The chunk walk finds a chunk that runs past the end (what decoding found before), naming the file."""
    write_png(tmp_path / "cut.png", _stored(np.random.default_rng(1)))
    with open(tmp_path / "cut.png", "r+b") as fh:
        fh.truncate(60)
    with pytest.raises(ImageError, match="cut.png.*truncated PNG"):
        media.probe("cut", str(tmp_path / "cut.png"))


def test_png_orientation_after_idat_is_applied_in_the_build(tmp_path):
    """An eXIf chunk after IDAT (legal, and what some tools write): the image is built upright."""
    stored = _stored(np.random.default_rng(2), 48, 32)
    write_png(tmp_path / "turned.png", stored, after_idat=[(b"eXIf", exif_bytes(6)[6:])])
    out = str(tmp_path / "out")
    vae = ToyVAE()
    build_image_cache(vae, str(tmp_path), out, buckets=BUCKETS, quiet=True)
    cache = LatentCache(out)
    assert cache.info(0)["bucket"] == [48, 32]
    upright = torch.from_numpy(np.rot90(stored, k=-1).astype(np.float32).copy()).permute(2, 0, 1) / 127.5 - 1
    assert torch.equal(cache[0], vae.encode(upright[None])[0].half())


def photo(rng, w: int, h: int) -> Image.Image:
    return Image.fromarray(photo_like(rng, w, h))


@pytest.mark.parametrize("size, bucket, scale", [((640, 480), (192, 256), 2), ((1024, 768), (128, 160), 4),
                                                 ((1200, 900), (96, 128), 8)])
def test_jpeg_draft_is_a_convention_a_few_levels_from_a_full_decode(tmp_path, size, bucket, scale):
    """The draft decodes at the DCT scale Pillow picks for the resized size, and what it gives is a
    resize convention of its own, not a full decode: on this texture the mean absolute difference
    from decoding fully and resizing is at most 6 levels of 255 (measured: 3.4, 1.7 and 5.0 at 1/2,
    1/4 and 1/8) and 99 % of values are within 24 levels. Hence the stamp (next test)."""
    path = str(tmp_path / "photo.jpg")
    photo(np.random.default_rng(3), *size).save(path, quality=90)
    item = media.probe("photo", path)
    item.bucket = bucket
    full = media.load_image(item)[0].astype(np.int16)
    item.draft = media.plan_draft(item)
    assert item.draft
    with Image.open(path) as im:  # the DCT scale Pillow picks for the requested size
        im.draft("RGB", media.cover_size(item.width, item.height, bucket))
        assert im.size == tuple(-(-s // scale) for s in size)
    drafted = media.load_image(item)[0].astype(np.int16)
    assert drafted.shape == full.shape == (*bucket, 3)
    diff = np.abs(full - drafted)
    assert 0 < diff.mean() <= 6 and np.percentile(diff, 99) <= 24


def test_no_draft_when_the_bucket_shrinks_less_than_2x(tmp_path):
    photo(np.random.default_rng(4), 100, 80).save(tmp_path / "a.jpg")
    item = media.probe("a", str(tmp_path / "a.jpg"))
    item.bucket = (48, 64)  # 100x80 -> 64x51: 1.56x
    assert not media.plan_draft(item)
    Image.fromarray(_stored(np.random.default_rng(5), 400, 300)).save(tmp_path / "b.png")
    item = media.probe("b", str(tmp_path / "b.png"))
    item.bucket = (32, 32)
    assert not media.plan_draft(item)  # only JPEG decoders scale


def test_draft_is_stamped_and_a_rebuild_without_it_reencodes_the_drafted_items_only(tmp_path):
    rng = np.random.default_rng(6)
    src = tmp_path / "src"
    src.mkdir()
    photo(rng, 192, 128).save(src / "big.jpg", quality=90)  # 192x128 -> 48x32: drafted at 1/4
    photo(rng, 64, 48).save(src / "small.jpg", quality=90)  # 64x48 -> 48x36: not drafted
    Image.fromarray(_stored(rng, 100, 80)).save(src / "png.png")
    out = str(tmp_path / "out")
    vae = CountingVAE()
    build_image_cache(vae, str(src), out, buckets=BUCKETS, quiet=True)
    drafted = LatentCache(out)
    assert drafted.meta["jpeg_draft"] is True and vae.encoded == 3
    drafted_big = drafted[drafted.keys.index("big")].clone()
    stats = {}
    build_image_cache(vae, str(src), out, buckets=BUCKETS, quiet=True, jpeg_draft=False, stats=stats)
    assert stats["encoded"] == 1 and stats["copied"] == 2 and vae.encoded == 4
    full = LatentCache(out)
    assert "jpeg_draft" not in full.meta
    pixels, _ = by_hand(str(src / "big.jpg"), (32, 48))
    assert torch.equal(full[full.keys.index("big")], vae.encode(pixels[None])[0].half())  # decoded fully now
    assert not torch.equal(full[full.keys.index("big")], drafted_big)
    stats = {}
    build_image_cache(vae, str(src), out, buckets=BUCKETS, quiet=True, jpeg_draft=False, stats=stats)
    assert stats["unchanged"]


@pytest.mark.parametrize("channels_last", [False, True])
def test_batches_go_to_the_device_as_uint8_in_recycled_buffers(tmp_path, monkeypatch, channels_last):
    """Every batch reaches the fused normalize as uint8 [B, 3, h, w] (planar as the CPU build writes
    it, or channels last as a CUDA build sends it, read through strides), from one of a few buffers
    allocated once, and the cache is bit-equal to encoding x / 127.5 - 1 by hand."""
    images = str(tmp_path / "imgs")
    make_images(images, n=24)
    calls, normalize = [], ops.normalize_uint8

    def spy(x, **kw):
        calls.append((x.dtype, x.shape[1], x.untyped_storage().data_ptr(), kw["dtype"]))
        assert x.is_contiguous() != channels_last
        return normalize(x, **kw)

    init = encode_module.BatchBuffers.__init__

    def layout(self, *args):
        init(self, *args)
        self.channels_last = channels_last

    monkeypatch.setattr(encode_module.BatchBuffers, "__init__", layout)
    monkeypatch.setattr(encode_module.ops, "normalize_uint8", spy)
    monkeypatch.setattr("latentfast.cache.builders.images._Runner.lookahead", 1)
    vae = ToyVAE(seed=1)
    stats = {}
    build_image_cache(vae, images, str(tmp_path / "out"), buckets=BUCKETS, batch_size=2, num_workers=1, quiet=True,
                      stats=stats)
    assert len(calls) == 12 and all(dtype == torch.uint8 and channels == 3 and out == torch.float32
                                    for dtype, channels, _, out in calls)
    assert len({ptr for *_, ptr, _ in calls}) <= 4  # lookahead 2 (two workers' worth) + 2 buffers, reused
    cache = LatentCache(str(tmp_path / "out"))
    for i, key in enumerate(cache.keys):
        pixels, _ = by_hand(os.path.join(images, key + ".png"), tuple(cache.info(i)["bucket"]))
        assert torch.equal(cache[i], vae.encode(pixels[None])[0].half()), key


def test_a_diffusers_vae_gets_its_pixels_in_its_own_dtype_bit_equal(tmp_path):
    """A bfloat16 DiffusersVAE: normalized to bfloat16 on the device, the latents equal those of the
    float32 pixels it cast itself before."""
    diffusers = pytest.importorskip("diffusers")
    from latentfast.encoders import DiffusersVAE

    torch.manual_seed(0)
    kl = diffusers.AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                                 up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4,
                                 layers_per_block=1).to(torch.bfloat16)
    vae = DiffusersVAE(kl)
    images = str(tmp_path / "imgs")
    make_images(images, n=4)
    out = str(tmp_path / "out")
    build_image_cache(vae, images, out, buckets=[(16, 16), (16, 24), (24, 16)], batch_size=2, quiet=True)
    cache = LatentCache(out)
    assert encode_module.pixel_dtype(vae) == torch.bfloat16
    for i, key in enumerate(cache.keys):
        pixels, _ = by_hand(os.path.join(images, key + ".png"), tuple(cache.info(i)["bucket"]))
        assert torch.equal(cache[i], vae.encode(pixels[None])[0].half()), key


def test_stats_hold_every_stages_busy_time_and_the_bound(tmp_path, monkeypatch):
    images = str(tmp_path / "imgs")
    make_images(images)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    stats = {}
    build_image_cache(ToyVAE(), images, str(tmp_path / "out"), buckets=BUCKETS, quiet=True, stats=stats)
    assert stats["decode_workers"] == 3  # the cores this process may use, by default
    for key in ("decode_s", "feed_s", "encode_s", "write_s"):
        assert stats[key] > 0, key
    assert stats["h2d_s"] == 0  # no copy: the device is the host
    assert stats["bound"] in {"decode", "feed", "h2d", "encode", "write"} and stats["encode_wait_s"] >= 0


def test_stats_hold_the_head_and_tail_where_the_decoders_stand_idle(tmp_path):
    """``head_s`` ends as the first decode starts, before the first encode; ``tail_s`` starts at the last
    decode's end, before the last batch is encoded; a rebuild that decodes nothing has neither."""

    class StampingVAE(ToyVAE):
        starts: list = []

        def encode(self, images):
            self.starts.append(time.perf_counter())
            return super().encode(images)

    images = str(tmp_path / "imgs")
    make_images(images)
    vae, stats = StampingVAE(), {}
    called = time.perf_counter()
    build_image_cache(vae, images, str(tmp_path / "out"), buckets=BUCKETS, batch_size=3, quiet=True, stats=stats)
    returned = time.perf_counter()
    assert 0 < stats["head_s"] and 0 < stats["tail_s"] and stats["head_s"] + stats["tail_s"] < stats["wall_s"]
    assert called + stats["head_s"] < vae.starts[0]
    assert returned - stats["tail_s"] < vae.starts[-1]
    stats = {}
    build_image_cache(vae, images, str(tmp_path / "out"), buckets=BUCKETS, batch_size=3, quiet=True, stats=stats)
    assert stats["unchanged"] and "head_s" not in stats and "tail_s" not in stats


class FailingVAE(ToyVAE):
    """Raises on its ``fail_at``-th batch (counted from 1)."""

    def __init__(self, fail_at: int, error=RuntimeError("the encoder broke"), **kw):
        super().__init__(**kw)
        self.fail_at, self.error, self.batches = fail_at, error, 0

    def encode(self, images):
        self.batches += 1
        if self.batches == self.fail_at:
            raise self.error
        return super().encode(images)


def test_an_encoder_failure_is_raised_and_the_batches_before_it_are_durable(tmp_path):
    images = str(tmp_path / "imgs")
    make_images(images)
    out = str(tmp_path / "out")
    with pytest.raises(RuntimeError, match="the encoder broke"):
        build_image_cache(FailingVAE(3), images, out, buckets=BUCKETS, batch_size=3, quiet=True)
    stats = {}
    build_image_cache(ToyVAE(), images, out, buckets=BUCKETS, batch_size=3, quiet=True, stats=stats)
    assert stats["resumed"] == 4 and stats["encoded"] == 8  # the two batches before the failure (3 + 1: one bucket) were kept


def test_a_writer_failure_is_raised(tmp_path):
    """NaN latents: the writer refuses them; the build raises that, it does not hang."""

    class NanVAE(ToyVAE):
        def encode(self, images):
            return super().encode(images) * float("nan")

    images = str(tmp_path / "imgs")
    make_images(images)
    with pytest.raises(NonFiniteError):
        build_image_cache(NanVAE(), images, str(tmp_path / "out"), buckets=BUCKETS, batch_size=3, quiet=True)


def test_a_decode_failure_is_raised_naming_the_item(tmp_path):
    images = str(tmp_path / "imgs")
    make_images(images)
    write_png(os.path.join(images, "im99.png"), _stored(np.random.default_rng(7)), corrupt_idat=True)
    with pytest.raises(ImageError, match="im99"):
        build_image_cache(ToyVAE(), images, str(tmp_path / "out"), buckets=BUCKETS, batch_size=3, quiet=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_build_sends_uint8_over_its_copy_stream_bit_equal(tmp_path, monkeypatch):
    """On CUDA: pinned buffers, channels-last uint8 copied on the copy stream, normalized on the device
    by the Triton kernel; the latents equal encoding x / 127.5 - 1 on the device by hand."""
    images = str(tmp_path / "imgs")
    make_images(images, n=12)
    seen, normalize = [], ops.normalize_uint8

    def spy(x, **kw):
        seen.append((x.device.type, x.dtype, x.is_contiguous()))
        return normalize(x, **kw)

    monkeypatch.setattr(encode_module.ops, "normalize_uint8", spy)
    vae, stats = ToyVAE(seed=1), {}
    build_image_cache(vae, images, str(tmp_path / "out"), buckets=BUCKETS, batch_size=3, device="cuda", quiet=True,
                      stats=stats)
    assert seen and all(s == ("cuda", torch.uint8, False) for s in seen) and stats["h2d_s"] > 0
    cache = LatentCache(str(tmp_path / "out"))
    for i, key in enumerate(cache.keys):
        pixels, _ = by_hand(os.path.join(images, key + ".png"), tuple(cache.info(i)["bucket"]))
        assert torch.equal(cache[i], vae.encode(pixels[None].cuda())[0].half().cpu()), key


def test_latents_that_are_views_of_the_reused_pixels_are_kept_as_they_were(tmp_path, monkeypatch):
    """A CPU build normalizes every batch into one of (at most) two reused outputs; an encoder returning a view
    of its input must not see its latents overwritten by a later batch before they are written (the
    writer here waits for the normalize of the batch after next, which reuses this batch's output)."""
    class ViewEncoder(ToyVAE):
        def encode(self, images):
            return images[:, :, ::8, ::8]  # a view of the pixels: [B, 3, h, w]

    images = str(tmp_path / "imgs")
    make_images(images, n=8)
    normalized, changed = [0], threading.Condition()
    normalize = encode_module.BatchBuffers.normalize

    def counting(self, *args):
        out = normalize(self, *args)
        with changed:
            normalized[0] += 1
            changed.notify_all()
        return out

    from latentfast.cache.builders.images import _Runner

    write = _Runner._write_batch

    def late(self, batch, *args):
        with changed:  # batch k (of 2 items) waits until batch k + 2 is normalized (or there is none)
            changed.wait_for(lambda: normalized[0] > self.counts["encoded"] // 2 + 2 or normalized[0] == 4)
        return write(self, batch, *args)

    monkeypatch.setattr(encode_module.BatchBuffers, "normalize", counting)
    monkeypatch.setattr(_Runner, "_write_batch", late)
    out = str(tmp_path / "out")
    build_image_cache(ViewEncoder(), images, out, buckets=[(32, 32)], batch_size=2, quiet=True)
    cache = LatentCache(out)
    for i, key in enumerate(cache.keys):
        pixels, _ = by_hand(os.path.join(images, key + ".png"), (32, 32))
        assert torch.equal(cache[i], pixels[:, ::8, ::8].half()), key
