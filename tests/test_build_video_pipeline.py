"""The video builder's data side (issue 36): every frame decoded once and no frame more, the uint8 frames
written straight into a few recycled batch buffers, normalized by the fused op, and the cache bit-equal to
the float32 convention it had before (each frame resized, x / 127.5 - 1, stacked [3, T, h, w]); the same
on the spawned gloo ranks of a distributed build."""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile, ImageOps

from latentfast import ops
from latentfast.cache import LatentCache
from latentfast.cache.builders import encode as encode_module
from latentfast.cache.builders import media
from latentfast.cache.builders.images import build_video_cache
from latentfast.testing import spawn_gloo
from latentfast.toy import ToyVAE

av = pytest.importorskip("av")

BUCKETS = [(4, 32, 48), (8, 32, 48), (4, 32, 32), (4, 48, 32)]  # (frames, height, width)
# (width, height, frames) of each folder clip: odd sizes, both orientations, a square one
FOLDER_CLIPS = [(64, 48, 6), (50, 37, 9), (41, 60, 5), (39, 39, 12), (70, 45, 8), (45, 70, 4), (66, 49, 10)]


def make_clips(root: str, seed: int = 0) -> str:
    """Folder clips of PNG frames (one frame of clip 2 a JPEG turned by EXIF orientation 6) and two mp4s."""
    rng = np.random.default_rng(seed)
    for c, (w, h, frames) in enumerate(FOLDER_CLIPS):
        folder = os.path.join(root, f"clip{c}")
        os.makedirs(folder)
        for t in range(frames):
            pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
            if c == 2 and t == 1:  # stored on its side, displayed upright: [w, h] before the turn
                exif = Image.Exif()
                exif[0x0112] = 6
                Image.fromarray(np.ascontiguousarray(pixels.transpose(1, 0, 2)[::-1])).save(
                    os.path.join(folder, f"{t:04d}.jpg"), quality=95, exif=exif.tobytes())
            else:
                Image.fromarray(pixels).save(os.path.join(folder, f"{t:04d}.png"))
    for name, (w, h, frames) in {"movie": (64, 64, 10), "wide": (96, 64, 13)}.items():
        with av.open(os.path.join(root, name + ".mp4"), "w") as container:
            stream = container.add_stream("mpeg4", rate=8)
            stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
            for _ in range(frames):
                frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), format="rgb24")
                for packet in stream.encode(frame):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
    return root


def _frame_by_hand(image: Image.Image, bucket_hw) -> torch.Tensor:
    """The convention before the pipeline, written out independently: upright, RGB, LANCZOS resize to
    cover the bucket, centre crop, float32 x / 127.5 - 1, [3, h, w]."""
    image = ImageOps.exif_transpose(image).convert("RGB")
    bh, bw = bucket_hw
    scale = max(bw / image.width, bh / image.height)
    size = (max(bw, round(image.width * scale)), max(bh, round(image.height * scale)))
    image = image.resize(size, Image.LANCZOS) if size != image.size else image
    left, top = (size[0] - bw) // 2, (size[1] - bh) // 2
    array = np.asarray(image.crop((left, top, left + bw, top + bh)), dtype=np.float32)
    return torch.from_numpy(array).permute(2, 0, 1) / 127.5 - 1


def clip_by_hand(path: str, bucket, stride: int) -> torch.Tensor:
    """``[3, T, h, w]`` in [-1, 1]: the clip's first T frames (every ``stride``-th), each as above."""
    count, hw = bucket[0], bucket[1:]
    if os.path.isdir(path):
        names = sorted(os.listdir(path))[: count * stride : stride]
        images = [Image.open(os.path.join(path, n)) for n in names]
    else:
        with av.open(path) as container:
            decoded = [Image.fromarray(f.to_ndarray(format="rgb24")) for f in container.decode(video=0)]
        images = decoded[: count * stride : stride]
    assert len(images) == count
    return torch.stack([_frame_by_hand(im, hw) for im in images], dim=1)


def assert_the_float32_convention(cache: LatentCache, clips: str, vae, stride: int) -> None:
    assert len(cache) == len(FOLDER_CLIPS) + 2
    for i, key in enumerate(cache.keys):
        path = os.path.join(clips, key + (".mp4" if key in ("movie", "wide") else ""))
        clip = clip_by_hand(path, tuple(cache.info(i)["bucket"]), stride)
        assert torch.equal(cache[i], vae.encode_video(clip[None])[0].half()), key


@pytest.fixture()
def clips(tmp_path):
    return make_clips(str(tmp_path / "clips"))


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("stride", [1, 2])
def test_video_cache_is_bit_equal_to_the_float32_convention(tmp_path, clips, monkeypatch, channels_last, stride):
    """Planar slots (a CPU build) and channels-last ones (what a CUDA build sends), batches of 3 clips of
    one bucket: the latents equal encoding the float32 [3, T, h, w] clips built by hand."""
    init = encode_module.BatchBuffers.__init__

    def layout(self, *args):
        init(self, *args)
        self.channels_last = channels_last

    monkeypatch.setattr(encode_module.BatchBuffers, "__init__", layout)
    vae, out = ToyVAE(seed=2), str(tmp_path / "out")
    build_video_cache(vae, clips, out, buckets=BUCKETS if stride == 1 else [(3, 32, 48), (2, 32, 32), (2, 48, 32)],
                      frame_stride=stride, batch_size=3, num_workers=2, quiet=True)
    cache = LatentCache(out)
    assert {tuple(cache.info(i)["bucket"]) for i in range(len(cache))} >= ({(8, 32, 48), (4, 32, 32), (4, 48, 32)}
                                                                          if stride == 1 else {(3, 32, 48), (2, 32, 32)})
    assert_the_float32_convention(cache, clips, vae, stride)


@pytest.fixture()
def decodes(monkeypatch):
    """Every frame decoded: ``(path, kind)``, Pillow's pixel decodes (an ``ImageFile.load`` with tiles
    still to decode) and PyAV's frames, while planning and building."""
    seen = []
    load = ImageFile.ImageFile.load

    def pillow(self):
        if self.tile:
            seen.append((self.filename, "pillow"))
        return load(self)

    class Container:
        """PyAV's container, its decoded frames counted."""

        def __init__(self, path):
            self.path, self.inner = path, av.open(path)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.inner.close()

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def decode(self, *args, **kwargs):
            for frame in self.inner.decode(*args, **kwargs):
                seen.append((self.path, "av"))
                yield frame

    monkeypatch.setattr(ImageFile.ImageFile, "load", pillow)
    monkeypatch.setattr(media, "_import_av", lambda: SimpleNamespace(open=Container))
    return seen


def test_every_frame_a_clip_uses_is_decoded_once_and_no_other(tmp_path, clips, decodes):
    """Planning reads headers and packets only; the build decodes each frame it keeps exactly once
    (a folder clip: only those files; a video file: its frames up to the last one kept, no further)."""
    vae, stride = ToyVAE(seed=2), 2
    build_video_cache(vae, clips, str(tmp_path / "out"), buckets=[(3, 32, 48), (2, 32, 32), (2, 48, 32)],
                      frame_stride=stride, batch_size=2, num_workers=2, quiet=True)
    cache = LatentCache(str(tmp_path / "out"))
    want = []
    for i, key in enumerate(cache.keys):
        count = cache.info(i)["bucket"][0]
        if key in ("movie", "wide"):
            want += [(os.path.join(clips, key + ".mp4"), "av")] * ((count - 1) * stride + 1)
        else:
            names = sorted(os.listdir(os.path.join(clips, key)))[: count * stride : stride]
            want += [(os.path.join(clips, key, n), "pillow") for n in names]
    assert sorted(decodes) == sorted(want)
    assert_the_float32_convention(cache, clips, vae, stride)


def test_video_batches_use_a_few_buffers_allocated_once(tmp_path, clips, monkeypatch):
    """9 batches, one clip each, 1 decode worker: at most 4 uint8 buffers allocated (lookahead 2 + 2; a
    CPU build frees each once normalized, so 3 do) and reused, every batch normalized from one of them
    by the fused op into one of at most 2 float outputs, each allocated once."""
    made, calls, normalize = [], [], ops.normalize_uint8
    buffer = encode_module._Buffer.__init__

    def counting(self, *args):
        buffer(self, *args)
        made.append(self.host.data_ptr())

    def spy(x, **kw):
        calls.append((x.dtype, tuple(x.shape), x.untyped_storage().data_ptr(), kw["out"].untyped_storage().data_ptr()))
        return normalize(x, **kw)

    monkeypatch.setattr(encode_module._Buffer, "__init__", counting)
    monkeypatch.setattr(encode_module.ops, "normalize_uint8", spy)
    vae, out = ToyVAE(seed=2), str(tmp_path / "out")
    build_video_cache(vae, clips, out, buckets=BUCKETS, batch_size=1, num_workers=1, quiet=True)
    assert len(calls) == 9 and 2 <= len(made) <= 4
    assert all(dtype == torch.uint8 and shape[1] == 3 and len(shape) == 5 for dtype, shape, _, _ in calls)
    assert {ptr for _, _, ptr, _ in calls} <= set(made)
    assert len({out_ptr for *_, out_ptr in calls}) <= encode_module.BatchBuffers.outputs == 2
    assert_the_float32_convention(LatentCache(out), clips, vae, 1)


def _rank_builds_video(rank: int, world: int, clips: str, out: str):
    """One rank's share of the video build; what its pipeline did: (clips encoded, buffers allocated,
    batches normalized, the distinct buffers they were normalized from)."""
    import torch.distributed as dist

    made, normalized = [], []
    buffer, normalize = encode_module._Buffer.__init__, ops.normalize_uint8

    def counting(self, *args):
        buffer(self, *args)
        made.append(self.host.data_ptr())

    def spy(x, **kw):
        assert x.dtype == torch.uint8
        normalized.append(x.untyped_storage().data_ptr())
        return normalize(x, **kw)

    encode_module._Buffer.__init__, encode_module.ops.normalize_uint8 = counting, spy
    stats = {}
    build_video_cache(ToyVAE(seed=2), clips, out, buckets=BUCKETS, batch_size=1, num_workers=1, quiet=True,
                      stats=stats, group=dist.group.WORLD)
    return stats.get("encoded", 0), len(made), len(normalized), len(set(normalized) - set(made))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_distributed_video_build_on_spawned_gloo_ranks_equals_the_single_process_one(tmp_path, clips):
    """2 spawned gloo ranks: each encodes its share through the same pipeline (uint8 from a few recycled
    buffers into the fused normalize); the sharded cache reads exactly as the single-process one, which
    is the float32 convention's."""
    vae = ToyVAE(seed=2)
    build_video_cache(vae, clips, str(tmp_path / "single"), buckets=BUCKETS, batch_size=1, quiet=True)
    ranks = spawn_gloo(_rank_builds_video, 2, clips, str(tmp_path / "dist"), timeout_s=120)
    assert all(isinstance(r, tuple) for r in ranks), ranks
    assert sum(encoded for encoded, *_ in ranks) == len(FOLDER_CLIPS) + 2
    for encoded, buffers, normalized, foreign in ranks:
        assert encoded > 0 and normalized == encoded and 0 < buffers <= 4 and foreign == 0
    single, sharded = LatentCache(str(tmp_path / "single")), LatentCache(str(tmp_path / "dist"))
    assert len(sharded.shard_dirs) == 2 and sharded.keys == single.keys
    assert np.array_equal(sharded.shapes, single.shapes)
    for i in range(len(single)):
        assert torch.equal(sharded[i].view(torch.int16), single[i].view(torch.int16)), single.keys[i]
        assert sharded.info(i) == single.info(i)
    assert_the_float32_convention(sharded, clips, vae, 1)
