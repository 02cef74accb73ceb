"""What every trainer reader shares: detection, item keys, the size limit, one-line summaries, error wording."""
import os

import pytest

from latentfast.cache.trainers import FORMATS, TrainerCacheError, detect, open_source
from latentfast.cache.trainers.common import unique_keys
from latentfast.cache.trainers import fixtures as fx
from latentfast.errors import LatentfastError

WRITERS = {
    "kohya": lambda p: fx.write_kohya(p, arch="flux", n=2),
    "musubi-tuner": lambda p: fx.write_musubi(p, kind="framepack", n=2),
    "ai-toolkit": lambda p: fx.write_ai_toolkit(p, n=2, resolutions=(64,)),
    "simpletuner": lambda p: fx.write_simpletuner(p, os.path.join(p, "..", "images"), n=2),
    "diffusion-pipe": lambda p: fx.write_diffusion_pipe(p, n=2, buckets=((256, 256),), captions=1),
}


@pytest.mark.parametrize("fmt", FORMATS)
def test_detect_names_the_trainer_and_its_evidence(tmp_path, fmt):
    folder = tmp_path / "cache"
    WRITERS[fmt](str(folder))
    found, evidence = detect(folder)
    assert found == fmt and fmt in evidence
    source = open_source(folder)  # format="auto"
    assert source.format == fmt and source.evidence.startswith(f"detected {fmt}")
    assert len(list(source)) == len(source) > 0


def test_detect_refuses_a_mix_and_an_empty_folder(tmp_path):
    WRITERS["kohya"](str(tmp_path))
    WRITERS["musubi-tuner"](str(tmp_path))
    with pytest.raises(TrainerCacheError, match=r"expected one trainer's cache to detect, found kohya: 4 files such as .*; musubi-tuner: 4 files such as .*; pass format="):
        detect(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TrainerCacheError, match="found no trainer's cache files; pass format="):
        detect(tmp_path / "empty")


def test_errors_are_library_errors_and_value_errors(tmp_path):
    with pytest.raises(LatentfastError):
        open_source(tmp_path, "kohya")
    with pytest.raises(ValueError, match=r"format must be one of \['kohya', 'musubi-tuner'"):
        open_source(tmp_path, "npz")
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        open_source(tmp_path / "nope", "kohya")


@pytest.mark.parametrize("fmt", FORMATS)
def test_items_above_the_size_limit_are_refused_before_reading(tmp_path, fmt):
    folder = tmp_path / "cache"
    WRITERS[fmt](str(folder))
    opts = {"images": str(tmp_path / "images")} if fmt == "simpletuner" else {}
    source = open_source(folder, fmt, max_item_bytes=100, **opts)
    with pytest.raises(TrainerCacheError, match=r"item '.+' of .* holds \d+ bytes of tensors, above the limit of 100 bytes"):
        next(iter(source))
    assert len(list(open_source(folder, fmt, **opts))) == len(source)


def test_unique_keys():
    assert unique_keys([("a", "8x8"), ("b", "8x8"), ("a", "16x16")]) == ["a@8x8", "b", "a@16x16"]
    assert unique_keys([("a", "8x8"), ("a", "8x8"), ("a", "")]) == ["a@8x8", "a@8x8-2", "a@item"]
    assert unique_keys([("a", "")]) == ["a"]


def test_summary_counts_each_reason(tmp_path):
    fx.write_kohya(tmp_path, arch="sdxl", n=1)
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("x")
    assert open_source(tmp_path, "kohya").summary() == "kohya: 1 items; skipped 2 files: 2 files that are not kohya .npz caches"


@pytest.mark.parametrize("fmt", FORMATS)
def test_info_is_json_and_fields_are_tensors_with_the_convention_stamped(tmp_path, fmt):
    import json

    import torch

    folder = tmp_path / "cache"
    WRITERS[fmt](str(folder))
    opts = {"images": str(tmp_path / "images")} if fmt == "simpletuner" else {}
    source = open_source(folder, fmt, **opts)
    for record in source:
        json.dumps(record.info)
        assert record.fields and all(isinstance(v, torch.Tensor) for v in record.fields.values())
        assert "latent" in record.fields
        assert record.info["latent_convention"] == source.convention["latent_convention"]
