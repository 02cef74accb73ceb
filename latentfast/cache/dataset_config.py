"""Build the caches a kohya-ss sd-scripts or musubi-tuner dataset config (TOML) describes, with the trainer's bucket shapes.

``build_from_config(encoder, "kohya", toml_path, out_dir)`` reads a kohya config as ``library/config_util.py``
does (an option of a subset, else of its dataset, else of ``[general]``, else kohya's default) and builds
one split per subset (``subset_0``, ``subset_1``, ... in config order over all datasets) of the images in
its ``image_dir`` (not recursive, kohya's ``IMAGE_EXTENSIONS``, as ``glob_images`` lists them), with the
subset's ``flip_aug`` and ``caption_extension``, each image in the bucket ``BucketManager.select_bucket``
(``library/train_util.py``) gives it: buckets from ``make_bucket_resolutions`` (``library/model_util.py``)
of ``resolution``, ``min_bucket_reso``, ``max_bucket_reso``, ``bucket_reso_steps``, the nearest aspect
ratio (linear, the first such bucket in sorted order; an image of a bucket's exact size gets that one),
its own size rounded down to the steps with ``bucket_no_upscale``, one fixed ``resolution`` without
``enable_bucket``. ``dataset.json`` in ``out_dir`` lists every split with its ``num_repeats``, image
folder and options; :func:`open_dataset` opens the splits with their repeats for a
:class:`~latentfast.cache.LatentLoader`. Captions (with a text encoder): the subset's
``caption_extension`` file, else its ``class_tokens``, else empty. Not reproduced: an image with an EXIF
rotation is bucketed by its upright size (kohya's ``imagesize`` reads the stored one).

``build_from_config(encoder, "musubi-tuner", toml_path, out_dir)`` reads a musubi-tuner config
(``src/musubi_tuner/dataset/config_utils.py``: a dataset's option, else ``[general]``'s, else the default)
and builds one split per image dataset (``dataset_0``, ...) of its ``image_directory`` as
``ImageDirectoryDatasource`` lists it (not recursive; with a ``caption_extension``, only the images that
have a caption file), each image in the bucket ``BucketSelector.get_bucket_resolution`` gives it
(``src/musubi_tuner/dataset/bucket.py``, at the 16-pixel steps of every architecture but HiDream-O1's).
Video datasets and ``image_jsonl_file`` are refused, naming them.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import tomllib

from ..checks import as_int
from ..errors import InvalidArgumentError
from .builders.images import build_image_cache
from .captions import Captions, caption_path
from .feed.loader import LatentLoader
from .store.opening import LatentCache

CONFIG_KINDS = ("kohya", "musubi-tuner")

# library/train_util.py IMAGE_EXTENSIONS (without the optional avif / jxl plug-ins)
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".PNG", ".JPG", ".JPEG", ".WEBP", ".BMP")
# library/config_util.py BaseDatasetParams / BaseSubsetParams / DreamBoothSubsetParams defaults
DATASET_DEFAULTS = {"resolution": None, "enable_bucket": False, "min_bucket_reso": 256, "max_bucket_reso": 1024,
                    "bucket_reso_steps": 64, "bucket_no_upscale": False}
SUBSET_DEFAULTS = {"image_dir": None, "num_repeats": 1, "flip_aug": False, "caption_extension": ".caption",
                   "is_reg": False, "class_tokens": None}


def make_bucket_resolutions(max_reso, min_size=256, max_size=1024, divisible=64) -> list[tuple[int, int]]:
    """kohya's ``model_util.make_bucket_resolutions``: sorted ``(width, height)`` buckets."""
    max_width, max_height = max_reso
    max_area = max_width * max_height
    side = int(math.sqrt(max_area) // divisible) * divisible
    resos = {(side, side)}
    for width in range(min_size, max_size + 1, divisible):
        height = min(max_size, int((max_area // width) // divisible) * divisible)
        if height >= min_size:
            resos.update({(width, height), (height, width)})
    return sorted(resos)


class KohyaBuckets:
    """``rule(width, height) -> (height, width)``: the bucket kohya's ``BucketManager.select_bucket`` gives an image."""

    def __init__(self, resolution, *, enable_bucket=False, no_upscale=False, min_size=256, max_size=1024, steps=64):
        self.max_reso = tuple(resolution)
        self.no_upscale = bool(enable_bucket and no_upscale)
        self.steps = steps
        if not enable_bucket:  # one fixed-size bucket
            self.resos = [self.max_reso]
        elif not self.no_upscale:
            self.resos = make_bucket_resolutions(self.max_reso, min_size, max_size, steps)
        self.name = (f"kohya(resolution={list(self.max_reso)}, enable_bucket={bool(enable_bucket)}, no_upscale={self.no_upscale}, "
                     f"min={min_size}, max={max_size}, steps={steps})")

    def __call__(self, width: int, height: int) -> tuple[int, int]:
        w, h = self._select(width, height)
        return h, w

    def _round(self, x: float) -> int:
        x = int(x + 0.5)
        return x - x % self.steps

    def _select(self, width: int, height: int) -> tuple[int, int]:
        aspect = width / height
        if not self.no_upscale:
            if (width, height) in self.resos:
                return width, height
            errors = [abs(w / h - aspect) for w, h in self.resos]
            return self.resos[errors.index(min(errors))]  # numpy argmin: the first of equal errors
        max_area = self.max_reso[0] * self.max_reso[1]
        if width * height > max_area:  # shrunk, aspect kept, one side rounded to the steps: the nearer aspect wins
            rw = math.sqrt(max_area * aspect)
            rh = max_area / rw
            bw = self._round(rw)
            ar_w = bw / self._round(bw / aspect)
            bh = self._round(rh)
            ar_h = self._round(bh * aspect) / bh
            size = (bw, int(bw / aspect + 0.5)) if abs(ar_w - aspect) < abs(ar_h - aspect) else (int(bh * aspect + 0.5), bh)
        else:
            size = (width, height)
        return size[0] - size[0] % self.steps, size[1] - size[1] % self.steps


def _read_datasets(path, kind: str) -> tuple[dict, list]:
    """A dataset config's ``[general]`` table and its ``[[datasets]]`` tables (``kind`` names the trainer in errors)."""
    path = os.fspath(path)
    try:
        with open(path, "rb") as fh:
            config = tomllib.load(fh)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise InvalidArgumentError(f"{kind} dataset config {path}: {exc}") from None
    datasets = config.get("datasets")
    if not isinstance(datasets, list) or not datasets:
        raise InvalidArgumentError(f"{kind} dataset config {path}: expected [[datasets]] tables, found {sorted(config)}")
    return config.get("general", {}), datasets


def read_kohya_config(path) -> list[dict]:
    """Every subset of a kohya dataset config, its options resolved (subset, dataset, general, default)."""
    path = os.fspath(path)
    general, datasets = _read_datasets(path, "kohya")
    subsets = []
    for d, dataset in enumerate(datasets):
        def option(name, table, defaults):
            return table.get(name, dataset.get(name, general.get(name, defaults[name])))
        base = {name: option(name, {}, DATASET_DEFAULTS) for name in DATASET_DEFAULTS}
        if base["resolution"] is None:
            raise InvalidArgumentError(f"kohya dataset config {path}: datasets[{d}] has no resolution")
        res = base["resolution"]
        base["resolution"] = (res, res) if isinstance(res, int) else tuple(res)
        for s, subset in enumerate(dataset.get("subsets", [])):
            entry = {**base, **{name: option(name, subset, SUBSET_DEFAULTS) for name in SUBSET_DEFAULTS}}
            if entry["image_dir"] is None:
                raise InvalidArgumentError(f"kohya dataset config {path}: datasets[{d}].subsets[{s}] has no image_dir "
                                           "(metadata_file subsets are not read)")
            folder = os.path.join(os.path.dirname(os.path.abspath(path)), os.path.expanduser(entry["image_dir"]))
            entry.update(image_dir=folder, dataset=d, subset=s)
            subsets.append(entry)
    if not subsets:
        raise InvalidArgumentError(f"kohya dataset config {path}: no [[datasets.subsets]]")
    return subsets


def build_from_config(encoder, kind: str, config_path, out_dir, **options) -> list[dict]:
    """Build the splits of a ``kind`` (``"kohya"`` or ``"musubi-tuner"``) dataset config (see the module's
    note); ``options`` go to :func:`~latentfast.cache.builders.images.build_image_cache` (``batch_size``,
    ``device``, ``text_encoder``, ``latent_dtype``, ...). Returns the splits as written to ``dataset.json``."""
    from PIL import Image

    if kind not in CONFIG_KINDS:
        raise InvalidArgumentError(f"kind must be one of {CONFIG_KINDS}, got {kind!r}")
    plans = _kohya_plans(config_path) if kind == "kohya" else _musubi_plans(config_path)
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    splits = []
    for plan in plans:
        folder, names, rule = plan.pop("folder"), plan.pop("names"), plan.pop("rule")
        captions, flip = plan.pop("captions"), plan.pop("flip")
        if not names:
            raise InvalidArgumentError(f"{kind} dataset config {config_path}: {folder} holds no images the trainer would use")
        sizes = []
        for name in names:
            with Image.open(os.path.join(folder, name)) as im:
                sizes.append(im.size)
        split = plan["split"]
        manifest = os.path.join(out_dir, f"{split}.images.jsonl")
        with open(manifest, "w", encoding="utf-8") as fh:
            for name in names:
                fh.write(json.dumps({"image": os.path.join(folder, name), "key": os.path.splitext(name)[0]}) + "\n")
        kwargs = dict(options)
        if kwargs.get("text_encoder") is not None:
            kwargs["captions"] = captions
        build_image_cache(encoder, manifest, out_dir, split, buckets=sorted({rule(*size) for size in sizes}),
                          flip=flip, bucket_rule=rule, **kwargs)
        splits.append({**plan, "image_dir": folder, "flip_aug": flip, "buckets": rule.name})
    with open(os.path.join(out_dir, "dataset.json"), "w", encoding="utf-8") as fh:
        json.dump({"format": kind, "config": os.path.abspath(os.fspath(config_path)), "splits": splits}, fh, indent=1)
    return splits


@dataclasses.dataclass(frozen=True)
class ConfigDataset:
    """The splits a ``cache build --from-config`` wrote, opened (see :func:`open_dataset`): one cache per
    subset (kohya) or image dataset (musubi-tuner), in config order, with what the trainer does with each."""

    path: str  #: the dataset.json read
    caches: list  #: one LatentCache per split
    repeats: list  #: each split's num_repeats
    flip_aug: list  #: each split's flip_aug (it holds latent_flipped)
    splits: list  #: each split's entry of dataset.json (split name, image_dir, caption_extension, is_reg, ...)

    def loader(self, batch_size: int, *, flip=None, weights=None, **options) -> LatentLoader:
        """A :class:`~latentfast.cache.LatentLoader` over the splits with their ``num_repeats`` (or
        ``weights``, instead): ``flip`` (a probability) flips the splits built with ``flip_aug`` and reads
        the others unflipped, as the trainer does; ``options`` are the loader's. A kohya regularization
        subset (``is_reg``) is refused: kohya repeats its images to the train images' count and weights
        their loss, which the caller decides (open the caches here and pass ``repeats=``; a batch's
        ``"source"`` names its cache)."""
        regs = [s["split"] for s in self.splits if s.get("is_reg")]
        if regs:
            raise InvalidArgumentError(f"{self.path}: split(s) {regs} are kohya regularization subsets (is_reg), which kohya "
                                       f"repeats to the train images' count and weights by prior_loss_weight; build "
                                       f"LatentLoader(dataset.caches, ..., repeats=[...]) yourself and weight batch['source']")
        if flip is not None and not any(self.flip_aug):
            raise InvalidArgumentError(f"flip={flip!r}: no split of {self.path} was built with flip_aug (no latent_flipped to read)")
        flips = None if flip is None else [flip if aug else None for aug in self.flip_aug]
        return LatentLoader(self.caches, batch_size, repeats=None if weights is not None else self.repeats, weights=weights,
                            flip=flips, **options)


def open_dataset(path, **cache_options) -> ConfigDataset:
    """The splits :func:`build_from_config` (``latentfast cache build --from-config``) wrote: ``path`` is
    its ``out_dir`` (or the ``dataset.json`` in it); ``cache_options`` go to each
    :class:`~latentfast.cache.LatentCache` (``verify_rows``, ...). ``open_dataset(path).loader(64, ...)``
    is the loader with the config's ``num_repeats`` and ``flip_aug``."""
    path = os.fspath(path)
    listing = path if path.endswith(".json") else os.path.join(path, "dataset.json")
    try:
        with open(listing, encoding="utf-8") as fh:
            written = json.load(fh)
    except FileNotFoundError:
        raise InvalidArgumentError(f"{listing} does not exist: open_dataset reads the folder `latentfast cache build "
                                   f"--from-config` wrote (its dataset.json lists the splits)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidArgumentError(f"{listing}: {exc}") from None
    splits = written.get("splits") if isinstance(written, dict) else None
    if not isinstance(splits, list) or not splits or not all(isinstance(s, dict) and "split" in s for s in splits):
        raise InvalidArgumentError(f"{listing}: expected {{'splits': [{{'split': ..., 'num_repeats': ...}}, ...]}} as "
                                   f"build_from_config writes it, got {written!r:.200}")
    folder = os.path.dirname(os.path.abspath(listing))
    caches = [LatentCache(folder, s["split"], **cache_options) for s in splits]
    repeats = [as_int(f"{listing}: splits[{i}].num_repeats", s.get("num_repeats", 1), minimum=1) for i, s in enumerate(splits)]
    return ConfigDataset(listing, caches, repeats, [bool(s.get("flip_aug", False)) for s in splits], splits)


def _kohya_plans(config_path) -> list[dict]:
    plans = []
    for n, subset in enumerate(read_kohya_config(config_path)):
        folder = subset["image_dir"]
        if not os.path.isdir(folder):
            raise InvalidArgumentError(f"kohya dataset config {config_path}: image_dir {folder} is not a folder")
        names = sorted(f for f in os.listdir(folder) if f.endswith(IMAGE_EXTENSIONS) and os.path.isfile(os.path.join(folder, f)))
        rule = KohyaBuckets(subset["resolution"], enable_bucket=subset["enable_bucket"], no_upscale=subset["bucket_no_upscale"],
                            min_size=subset["min_bucket_reso"], max_size=subset["max_bucket_reso"], steps=subset["bucket_reso_steps"])
        plans.append({"split": f"subset_{n}", "folder": folder, "names": names, "rule": rule, "flip": bool(subset["flip_aug"]),
                      "captions": _kohya_captions(subset), "num_repeats": subset["num_repeats"], "is_reg": bool(subset["is_reg"]),
                      "caption_extension": subset["caption_extension"], "dataset": subset["dataset"], "subset": subset["subset"]})
    return plans


def _kohya_captions(subset: dict):
    """kohya's caption of an image: its caption file, else the subset's ``class_tokens`` (else empty)."""
    files = Captions(caption_extension=subset["caption_extension"], missing="empty")

    def caption(key, path):
        if os.path.isfile(caption_path(path, subset["caption_extension"])):
            return files(key, path)
        return subset["class_tokens"] or ""
    return caption


# -- musubi-tuner ----------------------------------------------------------------------------------------
# src/musubi_tuner/dataset/media_utils.py IMAGE_EXTENSIONS (without the optional jxl plug-ins)
MUSUBI_IMAGE_EXTENSIONS = IMAGE_EXTENSIONS + (".avif", ".AVIF")
# src/musubi_tuner/dataset/config_utils.py BaseDatasetParams defaults
MUSUBI_DEFAULTS = {"resolution": (960, 544), "enable_bucket": False, "bucket_no_upscale": False, "caption_extension": None,
                   "num_repeats": 1}
MUSUBI_RESOLUTION_STEPS = 16  # bucket.py BucketSelector: 16 for every architecture but HiDream-O1's 32


class MusubiBuckets:
    """``rule(width, height) -> (height, width)``: the bucket musubi-tuner's ``BucketSelector.get_bucket_resolution``
    gives an image (src/musubi_tuner/dataset/bucket.py)."""

    def __init__(self, resolution, *, enable_bucket=False, no_upscale=False, steps=MUSUBI_RESOLUTION_STEPS):
        self.area, self.steps = resolution[0] * resolution[1], steps
        self.no_upscale = bool(enable_bucket and no_upscale)
        if not enable_bucket:
            self.resos = [tuple(resolution)]
        else:  # every width from half the square's side to the side, the height that keeps the area, both ways
            side = int(math.sqrt(self.area))
            low = side // 2 - side // 2 % steps
            self.resos = sorted({r for w in range(low, side + steps, steps)
                                 for r in ((w, self.area // w - self.area // w % steps), (self.area // w - self.area // w % steps, w))})
        self.name = (f"musubi-tuner(resolution={list(resolution)}, enable_bucket={bool(enable_bucket)}, "
                     f"no_upscale={self.no_upscale}, steps={steps})")

    def __call__(self, width: int, height: int) -> tuple[int, int]:
        if self.no_upscale and width * height <= self.area:  # its own size, rounded down to the steps
            return height - height % self.steps, width - width % self.steps
        errors = [abs(w / h - width / height) for w, h in self.resos]
        w, h = self.resos[errors.index(min(errors))]  # numpy argmin: the first of equal errors
        return h, w


def _musubi_plans(config_path) -> list[dict]:
    """One plan per image dataset of a musubi-tuner config (options: the dataset's, else ``[general]``'s)."""
    path = os.fspath(config_path)
    general, datasets = _read_datasets(path, "musubi-tuner")
    plans = []
    for n, dataset in enumerate(datasets):
        if "image_directory" not in dataset:
            found = sorted(k for k in ("image_jsonl_file", "video_directory", "video_jsonl_file") if k in dataset)
            raise InvalidArgumentError(f"musubi-tuner dataset config {path}: datasets[{n}] has no image_directory "
                                       f"(only image folders are built from a config; it has {found})")
        option = {name: dataset.get(name, general.get(name, default)) for name, default in MUSUBI_DEFAULTS.items()}
        res = option["resolution"]
        folder = os.path.join(os.path.dirname(os.path.abspath(path)), os.path.expanduser(dataset["image_directory"]))
        if not os.path.isdir(folder):
            raise InvalidArgumentError(f"musubi-tuner dataset config {path}: image_directory {folder} is not a folder")
        ext = option["caption_extension"]
        # media_utils.glob_images(directory, caption_extension=...): with an extension, captioned images only
        names = sorted(f for f in os.listdir(folder) if f.endswith(MUSUBI_IMAGE_EXTENSIONS) and os.path.isfile(os.path.join(folder, f))
                       and (ext is None or os.path.isfile(os.path.join(folder, os.path.splitext(f)[0] + ext))))
        rule = MusubiBuckets((res, res) if isinstance(res, int) else tuple(res), enable_bucket=option["enable_bucket"],
                             no_upscale=option["bucket_no_upscale"])
        plans.append({"split": f"dataset_{n}", "folder": folder, "names": names, "rule": rule, "flip": False,
                      "captions": _musubi_captions(ext, path), "num_repeats": option["num_repeats"], "caption_extension": ext,
                      "dataset": n})
    return plans


def _musubi_captions(ext, config_path):
    """``ImageDirectoryDatasource.get_caption``: the caption file's text, stripped (an extension is required)."""
    def caption(key, image_path):
        if ext is None:
            raise InvalidArgumentError(f"musubi-tuner dataset config {config_path}: caption_extension is needed to encode captions")
        with open(os.path.splitext(image_path)[0] + ext, encoding="utf-8") as fh:
            return fh.read().strip()
    return caption
