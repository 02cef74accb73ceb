"""Image-bucket and video caches: bucket choice, resize + centre crop, latents equal to encoding each
item by hand, content-hashed rebuilds (only edited images are encoded again; the folder's spelling
does not matter), repair of a damaged cache, skipped images, SIGKILL + resume; real PNGs, real clips."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from latentfast.cache import IncompleteCacheError, LatentCache, ShapeBucketBatchSampler, cache_path, read_batch, verify_cache
from latentfast.cache.builders.images import build_image_cache, build_video_cache
from latentfast.errors import ImageError, InvalidArgumentError
from latentfast.testing import progress_lines, run_until_held
from latentfast.toy import ToyVAE

BUCKETS = [(32, 32), (32, 48), (48, 32)]  # (height, width)
SIZES = [(64, 48), (48, 64), (50, 50), (100, 40), (30, 70), (41, 39)]  # (width, height) of the test images
EXPECTED_BUCKET = {(64, 48): (32, 48), (48, 64): (48, 32), (50, 50): (32, 32), (100, 40): (32, 48),
                   (30, 70): (48, 32), (41, 39): (32, 32)}


class CountingVAE(ToyVAE):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.encoded = 0

    def encode(self, images):
        self.encoded += images.shape[0]
        return super().encode(images)

    def encode_video(self, clip):
        self.encoded += clip.shape[0]
        return super().encode_video(clip)


def make_images(folder, n=12, seed=0):
    rng = np.random.default_rng(seed)
    os.makedirs(os.path.join(folder, "sub"), exist_ok=True)
    names = []
    for i in range(n):
        w, h = SIZES[i % len(SIZES)]
        name = f"{'sub/' if i % 4 == 3 else ''}im{i:02d}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(os.path.join(folder, name))
        names.append(name)
    return names


def build(source, out, encoder=None, **kw):
    kw.setdefault("buckets", BUCKETS)
    kw.setdefault("batch_size", 3)
    kw.setdefault("quiet", True)
    stats = kw.setdefault("stats", {})
    build_image_cache(encoder or ToyVAE(), source, out, **kw)
    return stats


def by_hand(path, bucket_hw):
    """Resize (LANCZOS) to cover the bucket, centre-crop, x / 127.5 - 1 -- written out independently."""
    image = Image.open(path).convert("RGB")
    bh, bw = bucket_hw
    scale = max(bw / image.width, bh / image.height)
    size = (max(bw, round(image.width * scale)), max(bh, round(image.height * scale)))
    image = image.resize(size, Image.LANCZOS) if size != image.size else image
    left, top = (size[0] - bw) // 2, (size[1] - bh) // 2
    array = np.asarray(image.crop((left, top, left + bw, top + bh)), dtype=np.float32)
    return torch.from_numpy(array).permute(2, 0, 1) / 127.5 - 1, [top, left]


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("imgs"))
    make_images(folder)
    return folder


def test_every_item_is_its_image_resized_cropped_and_encoded(images, tmp_path):
    vae = ToyVAE(seed=2)
    build(images, str(tmp_path), vae)
    cache = LatentCache(str(tmp_path), expected={"encoder": vae.identity()})
    assert sorted(cache.keys) == sorted(f"{'sub/' if i % 4 == 3 else ''}im{i:02d}" for i in range(12))
    for i, key in enumerate(cache.keys):
        path = os.path.join(images, key + ".png")
        size = Image.open(path).size
        bucket = EXPECTED_BUCKET[size]
        pixels, crop = by_hand(path, bucket)
        assert cache.shapes[i].tolist() == [4, bucket[0] // 8, bucket[1] // 8]
        assert torch.equal(cache[i], vae.encode(pixels[None])[0].half()), key
        assert cache.info(i) == {"original_size": [size[1], size[0]], "crop_top_left": crop, "bucket": list(bucket)}
    # items of one bucket are stored together, keys sorted within
    runs = [tuple(s) for s in cache.shapes.tolist()]
    assert len({s for s in runs}) == 3 and sum(a != b for a, b in zip(runs, runs[1:])) == 2


def test_batches_of_one_bucket_and_read_back(images, tmp_path):
    calls = []

    class Recording(ToyVAE):
        def encode(self, x):
            calls.append(tuple(x.shape))
            return super().encode(x)

    build(images, str(tmp_path), Recording(), batch_size=3)
    assert all(c[0] <= 3 for c in calls) and {c[2:] for c in calls} == set(BUCKETS)
    cache = LatentCache(str(tmp_path))
    for batch in ShapeBucketBatchSampler(cache.shapes, 4, seed=0):
        latents, shapes = read_batch(cache, batch)
        assert torch.equal(latents, torch.stack([cache[i] for i in batch]))


def test_rebuild_reencodes_only_edited_images_and_ignores_how_the_folder_is_spelled(images, tmp_path, monkeypatch):
    src = str(tmp_path / "imgs")
    shutil.copytree(images, src)
    out = str(tmp_path / "out")
    vae = CountingVAE()
    build(src, out, vae)
    assert vae.encoded == 12
    before = open(cache_path(out, "train", "data"), "rb").read()
    monkeypatch.chdir(tmp_path)
    for spelling in ("imgs", "./imgs", src, "imgs/"):
        stats = build(spelling, out, vae)
        assert stats["unchanged"] and vae.encoded == 12, spelling  # nothing encoded, nothing written
    rng = np.random.default_rng(9)  # edit one image, same size: only it is encoded again
    Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(os.path.join(src, "im00.png"))
    stats = build("./imgs", out, vae)
    assert vae.encoded == 13 and stats["encoded"] == 1 and stats["copied"] == 11
    cache = LatentCache(out)
    k = cache.keys.index("im00")
    assert torch.equal(cache[k], ToyVAE().encode(by_hand(os.path.join(src, "im00.png"), (32, 48))[0][None])[0].half())
    fresh = str(tmp_path / "fresh")
    build(src, fresh)
    assert open(cache_path(out, "train", "data"), "rb").read() == open(cache_path(fresh, "train", "data"), "rb").read() != before
    os.remove(os.path.join(src, "im05.png"))  # a removed image leaves the cache
    stats = build(src, out, vae)
    assert "im05" not in LatentCache(out).keys and vae.encoded == 13, stats


def test_rerun_over_a_damaged_cache_repairs_it(images, tmp_path):
    out = str(tmp_path)
    vae = CountingVAE()
    build(images, out, vae)
    good = open(cache_path(out, "train", "data"), "rb").read()
    with open(cache_path(out, "train", "data"), "r+b") as fh:
        fh.seek(40)
        fh.write(b"\xff\xff\xff\xff")
    with pytest.raises(ValueError, match="fails its CRC-32"):
        verify_cache(out)
    stats = build(images, out, vae)
    assert not stats["unchanged"] and stats["encoded"] == 1 and vae.encoded == 13  # the damaged item only
    assert open(cache_path(out, "train", "data"), "rb").read() == good
    assert verify_cache(out)["rows"] == 12


def test_bad_images_raise_or_are_skipped(images, tmp_path):
    src = str(tmp_path / "imgs")
    shutil.copytree(images, src)
    with open(os.path.join(src, "broken.png"), "wb") as fh:
        fh.write(b"not a png")
    with pytest.raises(ImageError, match="'broken'"):
        build(src, str(tmp_path / "a"))
    stats = build(src, str(tmp_path / "b"), skip_bad_images=True)
    cache = LatentCache(str(tmp_path / "b"))
    assert len(cache) == 12 and stats["skipped"] == 1 and cache.meta["skipped"][0]["key"] == "broken"
    with pytest.raises(InvalidArgumentError, match="multiples of the encoder's downscale factor 8"):
        build(src, str(tmp_path / "c"), buckets=[(30, 32)])
    with pytest.raises(InvalidArgumentError, match=r"\(height, width\)"):
        build(src, str(tmp_path / "c"), buckets=[(32,)])
    os.makedirs(tmp_path / "empty")
    with pytest.raises(InvalidArgumentError, match="holds no images"):
        build(str(tmp_path / "empty"), str(tmp_path / "d"))


def test_manifest_source_with_keys(images, tmp_path):
    manifest = tmp_path / "items.jsonl"
    manifest.write_text("".join(json.dumps({"image": os.path.join(images, f"im{i:02d}.png"), "key": f"id{i}"}) + "\n"
                                for i in (0, 1, 2)))
    build(str(manifest), str(tmp_path / "out"))
    assert sorted(LatentCache(str(tmp_path / "out")).keys) == ["id0", "id1", "id2"]


def test_tiny_diffusers_vae_image_cache(images, tmp_path):
    pytest.importorskip("diffusers")
    from test_encoders import tiny_kl

    from latentfast.encoders import DiffusersVAE

    encoder = DiffusersVAE(tiny_kl())
    build(images, str(tmp_path), encoder, buckets=[(16, 16), (16, 24), (24, 16)])
    cache = LatentCache(str(tmp_path), expected={"encoder": encoder.identity()})
    i = cache.keys.index("im02")  # 50x50 -> the 16x16 bucket -> an 8x8 latent (f2)
    assert cache.shapes[i].tolist() == [4, 8, 8]
    want = encoder.encode(by_hand(os.path.join(images, "im02.png"), (16, 16))[0][None])[0].half()
    torch.testing.assert_close(cache[i], want, rtol=0, atol=2e-3)  # batch-dependent conv rounding only
    other = DiffusersVAE(tiny_kl(seed=1))
    with pytest.raises(ValueError, match=r"weights_blake2b(.|\n)*Rebuild it with: latentfast cache build --images .* --buckets 16x16,16x24,24x16"):
        LatentCache(str(tmp_path), expected={"encoder": other.identity()})


BUILD_SCRIPT = """
import sys
from latentfast.cache.builders.images import build_image_cache
from latentfast.testing import hold_when
from latentfast.toy import ToyVAE

class Counting(ToyVAE):
    encoded = 0
    def encode(self, images):
        hold_when(Counting.encoded == 6)  # the first run is killed here: 6 images encoded (batches of 1)
        Counting.encoded += images.shape[0]
        return super().encode(images)

build_image_cache(Counting(), sys.argv[1], sys.argv[2], buckets=[(32, 32), (32, 48), (48, 32)], batch_size=1, quiet=True)
print("encoded", Counting.encoded)
"""


@pytest.mark.slow
@pytest.mark.timeout(900)  # a hang guard only
def test_sigkill_and_resume(images, tmp_path):
    out = str(tmp_path / "out")
    progress = cache_path(out, "train", "progress")
    cmd = [sys.executable, "-c", BUILD_SCRIPT, images, out]
    # killed while the 7th image waits to be encoded, once the writer has logged at least 5 items
    run_until_held(cmd, str(tmp_path / "held"), progress=progress, min_lines=6)
    logged = progress_lines(progress) - 1
    assert 5 <= logged <= 6
    with pytest.raises(IncompleteCacheError):
        LatentCache(out)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == str(12 - logged)  # only the items not yet logged
    reference = str(tmp_path / "ref")
    build(images, reference, batch_size=1)
    for kind in ("data", "shapes", "offsets", "keys", "hashes", "info", "checksums"):
        assert open(cache_path(out, "train", kind), "rb").read() == open(cache_path(reference, "train", kind), "rb").read(), kind


# -- video -------------------------------------------------------------------------------------

def make_clips(folder, seed=0):
    """Two clips as folders of PNG frames (6 and 9 frames, 64x48) and, with PyAV, one mp4 (10 frames, 64x64)."""
    rng = np.random.default_rng(seed)
    for c, frames in enumerate((6, 9)):
        os.makedirs(os.path.join(folder, f"clip{c}"))
        for t in range(frames):
            Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(os.path.join(folder, f"clip{c}", f"{t:04d}.png"))
    try:
        import av
    except ImportError:
        return False
    with av.open(os.path.join(folder, "movie.mp4"), "w") as container:
        stream = container.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        for _ in range(10):
            frame = av.VideoFrame.from_ndarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return True


def test_video_cache_from_frame_folders_and_files(tmp_path):
    has_mp4 = make_clips(str(tmp_path / "clips"))
    vae = ToyVAE(seed=1)
    buckets = [(4, 32, 48), (8, 32, 48), (8, 32, 32)]  # (frames, height, width)
    build_video_cache(vae, str(tmp_path / "clips"), str(tmp_path / "out"), buckets=buckets, quiet=True)
    cache = LatentCache(str(tmp_path / "out"))
    assert cache.meta["ndim"] == 4
    shapes = dict(zip(cache.keys, cache.shapes.tolist()))
    assert shapes["clip0"] == [4, 1, 4, 6] and shapes["clip1"] == [4, 2, 4, 6]  # 6 frames -> 4; 9 -> 8 (t4 VAE)
    frames = sorted(os.listdir(tmp_path / "clips" / "clip1"))[:8]
    clip = torch.stack([by_hand(os.path.join(tmp_path, "clips", "clip1", f), (32, 48))[0] for f in frames], dim=1)
    assert torch.equal(cache[cache.keys.index("clip1")], vae.encode_video(clip[None])[0].half())
    assert cache.info(cache.keys.index("clip0"))["frames"] == 6
    if has_mp4:
        assert shapes["movie"] == [4, 2, 4, 4]  # square: the 32x32 bucket, 8 of its 10 frames
    with pytest.raises(ImageError, match="fewer than the shortest"):
        build_video_cache(vae, str(tmp_path / "clips"), str(tmp_path / "x"), buckets=[(12, 32, 48), (12, 32, 32)], quiet=True)
    build_video_cache(vae, str(tmp_path / "clips"), str(tmp_path / "y"), buckets=[(3, 32, 48)], frame_stride=2, quiet=True)
    strided = LatentCache(str(tmp_path / "y"))
    assert strided.info(strided.keys.index("clip1"))["frame_stride"] == 2


def test_video_cache_with_a_tiny_wan_vae(tmp_path):
    pytest.importorskip("diffusers")
    from test_encoders import tiny_wan

    from latentfast.encoders import DiffusersVAE

    make_clips(str(tmp_path / "clips"))
    encoder = DiffusersVAE(tiny_wan())
    build_video_cache(encoder, str(tmp_path / "clips"), str(tmp_path / "out"), buckets=[(5, 16, 24), (5, 16, 16)], quiet=True)
    cache = LatentCache(str(tmp_path / "out"))
    assert cache.shapes[cache.keys.index("clip0")].tolist() == [4, 3, 4, 6]  # t2 / f4 tiny Wan
