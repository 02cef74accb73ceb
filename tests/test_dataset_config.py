"""``cache build --from-config kohya|musubi-tuner FILE`` / ``build_from_config``: the splits a kohya or musubi-tuner
dataset TOML describes, each image in the bucket the trainer's own bucketing gives it (checked against kohya's
``BucketManager`` and ``make_bucket_resolutions`` as written in kohya-ss/sd-scripts library/train_util.py and
library/model_util.py, commit 0005867, and musubi-tuner's ``BucketSelector`` as written in
src/musubi_tuner/dataset/bucket.py, transcribed below), flip_aug and caption_extension per subset, num_repeats
in dataset.json."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from PIL import Image

from latentfast.cache import LatentCache
from latentfast.cache.dataset_config import KohyaBuckets, MusubiBuckets, build_from_config
from latentfast.cli import main
from latentfast.errors import InvalidArgumentError
from latentfast.toy import ToyVAE


def kohya_make_bucket_resolutions(max_reso, min_size=256, max_size=1024, divisible=64):
    """library/model_util.py ``make_bucket_resolutions``, as written."""
    max_width, max_height = max_reso
    max_area = max_width * max_height
    resos = set()
    width = int(math.sqrt(max_area) // divisible) * divisible
    resos.add((width, width))
    width = min_size
    while width <= max_size:
        height = min(max_size, int((max_area // width) // divisible) * divisible)
        if height >= min_size:
            resos.add((width, height))
            resos.add((height, width))
        width += divisible
    resos = list(resos)
    resos.sort()
    return resos


class KohyaBucketManager:
    """library/train_util.py ``BucketManager`` (the parts that pick a bucket), as written."""

    def __init__(self, no_upscale, max_reso, min_size, max_size, reso_steps):
        self.no_upscale = no_upscale
        self.max_reso = max_reso
        self.max_area = max_reso[0] * max_reso[1]
        self.min_size, self.max_size, self.reso_steps = min_size, max_size, reso_steps

    def make_buckets(self):
        self.set_predefined_resos(kohya_make_bucket_resolutions(self.max_reso, self.min_size, self.max_size, self.reso_steps))

    def set_predefined_resos(self, resos):
        self.predefined_resos = resos.copy()
        self.predefined_resos_set = set(resos)
        self.predefined_aspect_ratios = np.array([w / h for w, h in resos])

    def round_to_steps(self, x):
        x = int(x + 0.5)
        return x - x % self.reso_steps

    def select_bucket(self, image_width, image_height):
        aspect_ratio = image_width / image_height
        if not self.no_upscale:
            reso = (image_width, image_height)
            if reso in self.predefined_resos_set:
                pass
            else:
                ar_errors = self.predefined_aspect_ratios - aspect_ratio
                predefined_bucket_id = np.abs(ar_errors).argmin()
                reso = self.predefined_resos[predefined_bucket_id]
        else:
            if image_width * image_height > self.max_area:
                resized_width = math.sqrt(self.max_area * aspect_ratio)
                resized_height = self.max_area / resized_width
                b_width_rounded = self.round_to_steps(resized_width)
                b_height_in_wr = self.round_to_steps(b_width_rounded / aspect_ratio)
                ar_width_rounded = b_width_rounded / b_height_in_wr
                b_height_rounded = self.round_to_steps(resized_height)
                b_width_in_hr = self.round_to_steps(b_height_rounded * aspect_ratio)
                ar_height_rounded = b_width_in_hr / b_height_rounded
                if abs(ar_width_rounded - aspect_ratio) < abs(ar_height_rounded - aspect_ratio):
                    resized_size = (b_width_rounded, int(b_width_rounded / aspect_ratio + 0.5))
                else:
                    resized_size = (int(b_height_rounded * aspect_ratio + 0.5), b_height_rounded)
            else:
                resized_size = (image_width, image_height)
            bucket_width = resized_size[0] - resized_size[0] % self.reso_steps
            bucket_height = resized_size[1] - resized_size[1] % self.reso_steps
            reso = (bucket_width, bucket_height)
        return reso


def kohya_bucket(dataset, width, height):
    """The dataset's ``make_buckets`` (train_util.py BaseDataset) for one image: (width, height)."""
    if dataset["enable_bucket"]:
        manager = KohyaBucketManager(dataset["bucket_no_upscale"], dataset["resolution"], dataset["min_bucket_reso"],
                                     dataset["max_bucket_reso"], dataset["bucket_reso_steps"])
        if not dataset["bucket_no_upscale"]:
            manager.make_buckets()
    else:
        manager = KohyaBucketManager(False, dataset["resolution"], None, None, None)
        manager.set_predefined_resos([dataset["resolution"]])
    return manager.select_bucket(width, height)


SIZES = [(w, h) for w in (64, 100, 128, 150, 192, 256, 300, 333, 512, 700) for h in (64, 90, 128, 160, 255, 256, 400, 640)]


@pytest.mark.parametrize("dataset", [
    dict(resolution=(256, 256), enable_bucket=True, bucket_no_upscale=False, min_bucket_reso=64, max_bucket_reso=512, bucket_reso_steps=64),
    dict(resolution=(192, 128), enable_bucket=True, bucket_no_upscale=False, min_bucket_reso=64, max_bucket_reso=320, bucket_reso_steps=32),
    dict(resolution=(256, 256), enable_bucket=True, bucket_no_upscale=True, min_bucket_reso=64, max_bucket_reso=512, bucket_reso_steps=64),
    dict(resolution=(160, 160), enable_bucket=True, bucket_no_upscale=True, min_bucket_reso=64, max_bucket_reso=512, bucket_reso_steps=16),
    dict(resolution=(128, 96), enable_bucket=False, bucket_no_upscale=False, min_bucket_reso=64, max_bucket_reso=512, bucket_reso_steps=64),
])
def test_bucket_rule_is_kohyas_for_every_size(dataset):
    rule = KohyaBuckets(dataset["resolution"], enable_bucket=dataset["enable_bucket"], no_upscale=dataset["bucket_no_upscale"],
                        min_size=dataset["min_bucket_reso"], max_size=dataset["max_bucket_reso"], steps=dataset["bucket_reso_steps"])
    for w, h in SIZES + [r for r in kohya_make_bucket_resolutions(dataset["resolution"], 64, 512, 64)]:
        kw, kh = kohya_bucket(dataset, w, h)
        assert rule(w, h) == (kh, kw), (w, h)


CONFIG = """
[general]
enable_bucket = true
bucket_reso_steps = 32
min_bucket_reso = 64
max_bucket_reso = 256
caption_extension = ".txt"

[[datasets]]
resolution = 128

  [[datasets.subsets]]
  image_dir = "a"
  num_repeats = 3
  flip_aug = true

  [[datasets.subsets]]
  image_dir = "b"
  caption_extension = ".caption"

[[datasets]]
resolution = [128, 96]
bucket_no_upscale = true

  [[datasets.subsets]]
  image_dir = "b"
  num_repeats = 2
"""


@pytest.fixture()
def config(tmp_path):
    rng = np.random.default_rng(0)
    for folder, sizes in (("a", [(100, 60), (64, 64), (150, 90)]), ("b", [(90, 200), (128, 128), (300, 140), (64, 64)])):
        (tmp_path / folder).mkdir()
        for i, (w, h) in enumerate(sizes):
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / folder / f"im{i}.png")
        (tmp_path / folder / "notes.md").write_text("not an image")
    (tmp_path / "config.toml").write_text(CONFIG)
    return tmp_path / "config.toml"


def test_a_config_build_has_kohyas_buckets_flip_and_repeats_per_subset(config, tmp_path):
    splits = build_from_config(ToyVAE(), "kohya", config, tmp_path / "out", quiet=True)
    assert [s["split"] for s in splits] == ["subset_0", "subset_1", "subset_2"]
    datasets = [dict(resolution=(128, 128), enable_bucket=True, bucket_no_upscale=False, min_bucket_reso=64, max_bucket_reso=256,
                     bucket_reso_steps=32)] * 2 + [dict(resolution=(128, 96), enable_bucket=True, bucket_no_upscale=True,
                                                        min_bucket_reso=64, max_bucket_reso=256, bucket_reso_steps=32)]
    for split, folder, dataset, flip in zip(splits, "abb", datasets, (True, False, False)):
        cache = LatentCache(tmp_path / "out", split["split"])
        # (b: im1 and im3 are both square; without upscaling kohya gives each a bucket of its own size)
        assert sorted(cache.keys) == ["im0", "im1", "im2"] + (["im3"] if folder == "b" else []) and ("latent_flipped" in cache.fields) == flip
        for i, key in enumerate(cache.keys):
            with Image.open(tmp_path / folder / f"{key}.png") as im:
                kw, kh = kohya_bucket(dataset, *im.size)
            assert cache.info(i)["bucket"] == [kh, kw] and list(cache.record(i)["latent"].shape[-2:]) == [kh // 8, kw // 8]
    listed = json.loads((tmp_path / "out" / "dataset.json").read_text())["splits"]
    assert [(s["num_repeats"], s["flip_aug"], s["caption_extension"]) for s in listed] == [(3, True, ".txt"), (1, False, ".caption"),
                                                                                        (2, False, ".txt")]


def test_cli_from_config(config, tmp_path, capsys):
    assert main(["cache", "build", "--from-config", "kohya", str(config), "--out", str(tmp_path / "cli"), "--encoder", "toy",
                 "--quiet"]) == 0
    build_from_config(ToyVAE(), "kohya", config, tmp_path / "py", quiet=True)
    for split in ("subset_0", "subset_1", "subset_2"):
        a, b = LatentCache(tmp_path / "cli", split), LatentCache(tmp_path / "py", split)
        assert a.keys == b.keys and all(a.info(i)["bucket"] == b.info(i)["bucket"] for i in range(len(a)))
    assert main(["cache", "build", "--from-config", "onetrainer", str(config), "--out", str(tmp_path / "m"),
                 "--encoder", "toy"]) != 0
    assert "FORMAT must be one of kohya, musubi-tuner, got 'onetrainer'" in capsys.readouterr().err
    (tmp_path / "bad.toml").write_text("[general]\nresolution = 64\n")
    with pytest.raises(InvalidArgumentError, match=r"expected \[\[datasets\]\] tables"):
        build_from_config(ToyVAE(), "kohya", tmp_path / "bad.toml", tmp_path / "o")


def divisible_by(num: int, divisor: int) -> int:
    """src/musubi_tuner/dataset/media_utils.py ``divisible_by``."""
    return num - num % divisor


class MusubiBucketSelector:
    """src/musubi_tuner/dataset/bucket.py ``BucketSelector`` (its reso_steps: 16), as written."""

    def __init__(self, resolution, enable_bucket=True, no_upscale=False, reso_steps=16):
        self.resolution = resolution
        self.bucket_area = resolution[0] * resolution[1]
        self.reso_steps = reso_steps
        if not enable_bucket:
            self.bucket_resolutions = [resolution]
            self.no_upscale = False
        else:
            self.no_upscale = no_upscale
            sqrt_size = int(math.sqrt(self.bucket_area))
            min_size = divisible_by(sqrt_size // 2, self.reso_steps)
            self.bucket_resolutions = []
            for w in range(min_size, sqrt_size + self.reso_steps, self.reso_steps):
                h = divisible_by(self.bucket_area // w, self.reso_steps)
                self.bucket_resolutions.append((w, h))
                self.bucket_resolutions.append((h, w))
            self.bucket_resolutions = list(set(self.bucket_resolutions))
            self.bucket_resolutions.sort()
        self.aspect_ratios = np.array([w / h for w, h in self.bucket_resolutions])

    def get_bucket_resolution(self, image_size):
        area = image_size[0] * image_size[1]
        if self.no_upscale and area <= self.bucket_area:
            w, h = image_size
            w = divisible_by(w, self.reso_steps)
            h = divisible_by(h, self.reso_steps)
            return w, h
        aspect_ratio = image_size[0] / image_size[1]
        ar_errors = self.aspect_ratios - aspect_ratio
        bucket_id = np.abs(ar_errors).argmin()
        return self.bucket_resolutions[bucket_id]


@pytest.mark.parametrize("resolution, enable, no_upscale", [((256, 256), True, False), ((320, 192), True, False),
                                                              ((256, 256), True, True), ((160, 96), False, False)])
def test_musubi_bucket_rule_is_musubis_for_every_size(resolution, enable, no_upscale):
    rule, theirs = MusubiBuckets(resolution, enable_bucket=enable, no_upscale=no_upscale), MusubiBucketSelector(resolution, enable, no_upscale)
    for w, h in SIZES + [tuple(r) for r in theirs.bucket_resolutions]:
        bw, bh = theirs.get_bucket_resolution((w, h))
        assert rule(w, h) == (bh, bw), (w, h)


MUSUBI_CONFIG = """
[general]
resolution = [128, 96]
caption_extension = ".txt"
enable_bucket = true

[[datasets]]
image_directory = "a"
cache_directory = "cache_a"
num_repeats = 2

[[datasets]]
image_directory = "b"
resolution = 96
bucket_no_upscale = true
"""


def test_a_musubi_config_build_has_musubis_buckets_and_only_captioned_images(tmp_path):
    rng = np.random.default_rng(1)
    sizes = {"a": [(100, 60), (64, 64), (150, 90), (90, 200)], "b": [(90, 200), (64, 64), (128, 128), (300, 140)]}
    for folder, shapes in sizes.items():
        (tmp_path / folder).mkdir()
        for i, (w, h) in enumerate(shapes):
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(tmp_path / folder / f"im{i}.png")
            if i != 3:  # im3 has no caption: musubi-tuner leaves it out
                (tmp_path / folder / f"im{i}.txt").write_text(f"caption {i}")
    (tmp_path / "musubi.toml").write_text(MUSUBI_CONFIG)
    splits = build_from_config(ToyVAE(), "musubi-tuner", tmp_path / "musubi.toml", tmp_path / "out", quiet=True)
    assert [(s["split"], s["num_repeats"]) for s in splits] == [("dataset_0", 2), ("dataset_1", 1)]
    for split, folder, selector in zip(splits, "ab", (MusubiBucketSelector((128, 96), True, False),
                                                      MusubiBucketSelector((96, 96), True, True))):
        cache = LatentCache(tmp_path / "out", split["split"])
        assert sorted(cache.keys) == ["im0", "im1", "im2"] and "latent_flipped" not in cache.fields
        for i, key in enumerate(cache.keys):
            bw, bh = selector.get_bucket_resolution(sizes[folder][int(key[2:])])
            assert cache.info(i)["bucket"] == [bh, bw]
    (tmp_path / "video.toml").write_text('[[datasets]]\nvideo_directory = "a"\n')
    with pytest.raises(InvalidArgumentError, match=r"datasets\[0\] has no image_directory .*\['video_directory'\]"):
        build_from_config(ToyVAE(), "musubi-tuner", tmp_path / "video.toml", tmp_path / "o")
