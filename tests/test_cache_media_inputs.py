"""What real photo folders hold, through the image and video builders: 16-bit PNGs, EXIF-rotated
photos, images smaller than their bucket, truncated files, and a change of encode precision."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image

from latentfast.cache import LatentCache
from latentfast.cache.builders.images import build_image_cache, build_video_cache
from latentfast.cache.builders.media import Item, load_image
from latentfast.errors import ImageError
from latentfast.toy import ToyVAE


def _load(path: str, bucket) -> torch.Tensor:
    """The builder's pixels of one image in [-1, 1] (it decodes to uint8 [h, w, 3])."""
    with Image.open(path) as im:
        width, height = im.size
    pixels = load_image(Item("x", path, width, height, bucket=bucket))[0]
    return torch.from_numpy(pixels.copy()).permute(2, 0, 1).float() / 127.5 - 1


def test_16_bit_grey_png_is_scaled_not_clipped(tmp_path):
    """Before: ``convert("RGB")`` clipped every 16-bit value above 255 to white (mean ~0.97)."""
    rng = np.random.default_rng(0)
    grey8 = rng.integers(0, 256, (32, 32), dtype=np.uint8)
    Image.fromarray(grey8.astype(np.uint16) * 257).save(tmp_path / "deep.png")  # full 16-bit range
    Image.fromarray(grey8).convert("RGB").save(tmp_path / "flat.png")
    assert Image.open(tmp_path / "deep.png").mode == "I;16"
    deep, flat = _load(str(tmp_path / "deep.png"), (32, 32)), _load(str(tmp_path / "flat.png"), (32, 32))
    assert torch.equal(deep, flat)
    assert float(deep.mean()) == pytest.approx(float(grey8.mean()) / 127.5 - 1, abs=1e-5)


def test_exif_orientation_is_applied(tmp_path):
    """Stored 80 wide x 48 tall with orientation 6 (rotate 90 degrees): it displays as a 48x80
    portrait, so it belongs in the portrait bucket, upright. Before: the landscape bucket."""
    rng = np.random.default_rng(1)
    stored = rng.integers(0, 256, (48, 80, 3), dtype=np.uint8)
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(stored).save(tmp_path / "photo.png", exif=exif)
    out = str(tmp_path / "out")
    build_image_cache(ToyVAE(), str(tmp_path), out, buckets=[(48, 80), (80, 48)], quiet=True)
    cache = LatentCache(out)
    assert cache.info(0)["bucket"] == [80, 48] and cache.info(0)["original_size"] == [80, 48]
    upright = np.rot90(stored, k=-1)  # orientation 6: the displayed image is the stored one turned clockwise
    expected = torch.from_numpy(upright.astype(np.float32).copy()).permute(2, 0, 1) / 127.5 - 1
    assert torch.equal(cache[0], ToyVAE().encode(expected[None])[0].half())


def test_small_images_upscaled_are_counted_and_no_upscale_keeps_their_size(tmp_path, capsys):
    """Before: a 40x30 image was enlarged 2.4x into its bucket without a word, and nothing kept it
    at its size (kohya's bucket_no_upscale)."""
    rng = np.random.default_rng(2)
    Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(tmp_path / "small.png")
    Image.fromarray(rng.integers(0, 256, (128, 128, 3), dtype=np.uint8)).save(tmp_path / "large.png")
    buckets = [(64, 64), (64, 96), (96, 64)]
    stats: dict = {}
    build_image_cache(ToyVAE(), str(tmp_path), str(tmp_path / "a"), buckets=buckets, stats=stats)
    line = capsys.readouterr().out
    assert stats["upscaled"] == 1 and stats["max_upscale"] == pytest.approx(96 / 40)  # the 64x96 bucket: nearest ratio
    assert "1 of 2 images upscaled to fit their bucket (at most 2.40x" in line and "--no-upscale" in line
    stats = {}
    build_image_cache(ToyVAE(), str(tmp_path), str(tmp_path / "b"), buckets=buckets, no_upscale=True, bucket_step=8,
                      stats=stats)
    assert "0 of 2 images upscaled" in capsys.readouterr().out and stats["upscaled"] == 0
    cache = LatentCache(str(tmp_path / "b"))
    bucket = {key: cache.info(i)["bucket"] for i, key in enumerate(cache.keys)}
    assert bucket == {"small": [24, 40], "large": [64, 64]}  # its own size, rounded down to the step; large as before
    assert cache.meta["no_upscale"] is True


def test_resolution_buckets_follow_kohyas_scheme():
    from latentfast.cache.builders.media import resolution_buckets

    buckets = resolution_buckets(1024, 256, 2048, 64)
    assert (1024, 1024) in buckets and (256, 2048) in buckets and (2048, 256) in buckets
    assert all(h % 64 == 0 and w % 64 == 0 and 256 <= min(h, w) and max(h, w) <= 2048 for h, w in buckets)
    assert all(h * w <= 1024 * 1024 for h, w in buckets)
    assert buckets == sorted({(w, h) for h, w in buckets})  # symmetric
    # kohya: the tallest height for each width (1024 * 1024 // 576 = 1820 -> 1792)
    assert (1792, 576) in buckets and (1856, 576) not in buckets


def _truncated_png(path, rng) -> None:
    Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(path)
    os.truncate(path, os.path.getsize(path) // 2)  # the header still reads; the pixels do not


def test_truncated_images_are_skipped_counted_and_named(tmp_path, capsys):
    """Before: skip_bad_images checked only the header, then the build aborted with 'image file is
    truncated'."""
    rng = np.random.default_rng(3)
    src = tmp_path / "img"
    src.mkdir()
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(src / f"ok{i}.png")
    _truncated_png(src / "cut.png", rng)
    with pytest.raises(ImageError, match="'cut'"):
        build_image_cache(ToyVAE(), str(src), str(tmp_path / "a"), buckets=[(32, 32)], quiet=True)
    stats: dict = {}
    build_image_cache(ToyVAE(), str(src), str(tmp_path / "b"), buckets=[(32, 32)], skip_bad_images=True, stats=stats)
    line = capsys.readouterr().out
    cache = LatentCache(str(tmp_path / "b"))
    assert len(cache) == 3 and stats["skipped"] == 1 and stats["skipped_keys"] == ["cut"]
    assert "1 skipped: 'cut'" in line and "truncated" in line
    assert cache.meta["skipped"][0]["key"] == "cut"


def test_truncated_frames_skip_their_clip(tmp_path):
    rng = np.random.default_rng(4)
    for clip in ("good", "bad"):
        os.makedirs(tmp_path / "clips" / clip)
        for f in range(4):
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(tmp_path / "clips" / clip / f"{f}.png")
    _truncated_png(tmp_path / "clips" / "bad" / "2.png", rng)
    stats: dict = {}
    build_video_cache(ToyVAE(), str(tmp_path / "clips"), str(tmp_path / "out"), buckets=[(4, 32, 32)],
                      skip_bad_clips=True, quiet=True, stats=stats)
    assert LatentCache(str(tmp_path / "out")).keys == ["good"] and stats["skipped_keys"] == ["bad"]


@pytest.mark.parametrize("kind", ["image", "video"])
def test_a_change_of_encode_precision_reencodes(tmp_path, kind):
    """Before: a float32 rebuild over a bf16-encoded cache said 'unchanged' and kept the bf16 latents."""
    rng = np.random.default_rng(5)
    folder = tmp_path / "src" / ("clip" if kind == "video" else "")
    folder.mkdir(parents=True)
    for i in range(4 if kind == "video" else 3):
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    build = build_video_cache if kind == "video" else build_image_cache
    buckets = [(4, 32, 32)] if kind == "video" else [(32, 32)]
    out, runs = str(tmp_path / "out"), []
    for autocast in (torch.bfloat16, None, None):
        stats: dict = {}
        build(ToyVAE(hidden=64), str(tmp_path / "src"), out, buckets=buckets, autocast_dtype=autocast, quiet=True, stats=stats)
        runs.append((stats["unchanged"], LatentCache(out).meta["encode_dtype"], LatentCache(out)[0].clone()))
    assert [r[:2] for r in runs] == [(False, "bfloat16"), (False, "float32"), (True, "float32")]
    assert not torch.equal(runs[0][2], runs[1][2])  # bf16 and float32 latents differ: the second run re-encoded
