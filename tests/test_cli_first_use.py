"""The command line as a new user meets it, in real processes: `cache build` names its encoder and
builds an image cache from an image folder, a failed build leaves no lock behind, the help says
each default once and marks what is required, `python -m latentfast` works."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from latentfast.cache import LatentCache


def latentfast(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "latentfast", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    folder = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for i, (w, h) in enumerate([(80, 60), (60, 80), (70, 70), (96, 48)]):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(folder / f"img{i:03d}.png")
    return str(folder)


@pytest.mark.slow
def test_build_without_encoder_refuses_and_says_how_to_name_one(photos, tmp_path):
    """Before: the toy VAE was used silently."""
    out = str(tmp_path / "out")
    proc = latentfast("cache", "build", "--images", photos, "--out", out)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--encoder is required" in proc.stderr and "--encoder diffusers:PATH" in proc.stderr
    assert "--encoder toy" in proc.stderr and proc.stderr.count("\n") == 1
    assert not os.path.exists(out)


@pytest.mark.slow
def test_an_image_folder_builds_an_image_cache_with_generated_buckets(photos, tmp_path):
    """Before: without --buckets an image folder became a text-line cache, which failed ('height
    must be line_height=32') and left a .train.latents.lock behind."""
    out = str(tmp_path / "out")
    proc = latentfast("cache", "build", "--images", photos, "--out", out, "--encoder", "toy", "--resolution", "64",
                      "--min-bucket", "32", "--max-bucket", "128", "--bucket-step", "32")
    assert proc.returncode == 0, proc.stderr
    cache = LatentCache(out)
    assert cache.meta["kind"] == "image" and len(cache) == 4
    assert [32, 128] in cache.meta["buckets"] and [64, 64] in cache.meta["buckets"]
    assert "4 of 4 images upscaled" not in proc.stdout and "images upscaled to fit their bucket" in proc.stdout
    assert "latent cache written" in proc.stdout
    no_upscale = latentfast("cache", "build", "--images", photos, "--out", str(tmp_path / "b"), "--encoder", "toy",
                            "--resolution", "128", "--min-bucket", "64", "--bucket-step", "32", "--no-upscale")
    assert no_upscale.returncode == 0 and "0 of 4 images upscaled" in no_upscale.stdout, no_upscale.stderr


@pytest.mark.slow
def test_text_lines_are_an_explicit_mode_and_a_failed_build_leaves_no_lock(photos, tmp_path):
    out = str(tmp_path / "out")
    proc = latentfast("cache", "build", "--images", photos, "--out", out, "--encoder", "toy", "--lines")
    assert proc.returncode == 1 and "line_height=32" in proc.stderr, proc.stderr
    assert not os.path.exists(out)  # neither the lock nor the folder it made
    os.makedirs(out)
    assert latentfast("cache", "build", "--images", photos, "--out", out, "--encoder", "toy", "--lines").returncode == 1
    assert os.listdir(out) == []  # the folder was there before: kept, but no stale .train.latents.lock
    both = latentfast("cache", "build", "--images", photos, "--out", out, "--encoder", "toy", "--lines", "--video")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr


@pytest.mark.slow
def test_help_lists_every_command_each_default_once_and_marks_required():
    top = latentfast("--help")
    assert top.returncode == 0 and "cache import" in top.stdout
    bench = latentfast("bench", "--help")
    from latentfast.bench_runner import SUITES
    assert "{" + ",".join(SUITES) + "}" in bench.stdout  # every suite listed as a choice
    assert latentfast("bench", "--suite", "nope").returncode == 2
    text = " ".join(latentfast("cache", "build", "--help").stdout.split())
    assert "(default: None)" not in text and "(default: False)" not in text
    assert "(default: as saved) (default:" not in text and "--vae-dtype" in text
    options = text.split("options:", 1)[1].split(" --")[1:]  # one chunk per option's help
    assert len(options) > 20 and all(chunk.count("(default:") <= 1 for chunk in options), options
    assert "--out OUT output folder (a cache per split) (required)" in text
    assert "--split SPLIT name of the split (the files' prefix) (default: train)" in text
