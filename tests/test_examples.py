"""The runnable examples under examples/: each runs as its docstring says, and the README's excerpts
of them are the code that runs."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "balanced_encode.py"


def marked_region(text: str, name: str) -> str:
    """The lines between ``# --8<-- [start:name]`` and ``# --8<-- [end:name]``, dedented."""
    match = re.search(rf"^([ \t]*)# --8<-- \[start:{name}\]\n(.*?)^[ \t]*# --8<-- \[end:{name}\]", text, re.S | re.M)
    assert match, f"no region {name!r}"
    indent = match.group(1)
    return "".join(line[len(indent) :] if line.startswith(indent) else line for line in match.group(2).splitlines(True))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_balanced_encode_example_runs_under_torchrun_with_two_gloo_processes(tmp_path):
    # As the script documents: torchrun --standalone --nproc_per_node 2 examples/balanced_encode.py
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1")  # gloo, also on a GPU machine
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(EXAMPLE)],
        capture_output=True, text=True, timeout=280, cwd=tmp_path, env=env,
    )  # fmt: skip
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "balanced latents equal local encoding on every rank" in proc.stdout, output[-4000:]
    assert re.search(r"units per rank: \[12, 4\], moved: \d+", proc.stdout), proc.stdout
    assert re.search(r"predicted step: [\d.]+ ms unbalanced -> [\d.]+ ms balanced", proc.stdout), proc.stdout


def assert_readme_quotes(script: pathlib.Path, region: str) -> None:
    """One block of the README or the docs is marked as an excerpt of ``script`` and is, line for line,
    its marked ``region`` (so it cannot drift from the code the tests run)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    name = f"examples/{script.name}"
    blocks = [b for page in pages for b in re.findall(r"```python\n(.*?)```", page.read_text(), re.S) if name in b]
    assert len(blocks) == 1, f"one block of the README or the docs quotes {name}"
    first, _, body = blocks[0].partition("\n")
    assert first.startswith(f"# excerpt of {name}")
    assert body == marked_region(script.read_text(), region)


def test_the_readme_shows_the_examples_code():
    assert_readme_quotes(EXAMPLE, "balanced-encode")


T2I = ROOT / "examples" / "train_text_to_image.py"


def load_t2i():
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_text_to_image", T2I)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    return example


STEP = r"2 steps of 4, median step [\d.]+ ms, \d+% of the step waiting for data \(loss [\d.]+\); first step [\d.]+ s"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_text_to_image_example_trains_from_the_cache_and_on_the_fly(tmp_path, capsys):
    from latentfast.cache import LatentCache

    example = load_t2i()
    assert example.main(["--tiny", "--compare", "1", "--steps", "2", "--count", "12", "--batch-size", "4", "--workers", "2",
                         "--threads", "1", "--workdir", str(tmp_path), "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert re.search("from the cache: " + STEP, out) and re.search("on the fly: " + STEP, out), out
    assert re.search(r"on the fly / from the cache: [\d.]+x \(range [\d.]+-[\d.]+\) over 1 runs of 2 steps of 4 at 16 px on cpu", out), out
    cache = LatentCache(tmp_path / "cache-tiny")
    assert sorted(cache.fields) == ["latent", "latent_flipped", "latent_flipped_std", "latent_std", "text", "text_pooled"]
    assert len(cache) == 12 and cache.meta["text_encoder"]["class"] == "transformers.CLIPTextModel"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_text_to_image_example_trains_on_a_folder_given_with_images(tmp_path, capsys):
    # a user's folder: JPEGs of other sizes in a subfolder, a caption file beside each
    import numpy as np
    from PIL import Image

    from latentfast.cache import LatentCache
    from latentfast.encoders import TextEncoder

    example = load_t2i()
    folder, rng = tmp_path / "photos", np.random.default_rng(1)
    (folder / "set").mkdir(parents=True)
    captions = {f"set/img{i}": f"photo number {'one two three four five'.split()[i]}" for i in range(5)}
    for i, (key, caption) in enumerate(captions.items()):
        size = [(23, 17), (40, 40), (17, 31), (64, 20), (18, 18)][i]
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(folder / f"{key}.jpg")
        (folder / f"{key}.txt").write_text(caption + "\n", encoding="utf-8")
    common = ["--tiny", "--images", str(folder), "--steps", "2", "--batch-size", "4", "--workers", "0", "--threads", "1",
              "--workdir", str(tmp_path / "work"), "--device", "cpu"]
    assert example.main(common) == 0 and example.main(common + ["--encode-on-the-fly"]) == 0
    out = capsys.readouterr().out
    assert re.search("from the cache: " + STEP, out) and re.search("on the fly: " + STEP, out), out
    assert not (tmp_path / "work" / "images-tiny").exists()  # nothing generated when --images is given
    cache = LatentCache(tmp_path / "work" / "cache-tiny")
    assert sorted(cache.keys) == sorted(captions) and tuple(cache.shapes[0]) == (4, 8, 8)
    _, text_model, tokenizer = example.encoders(tiny=True)  # seeded: the weights the example built
    for key, caption in captions.items():
        stored = cache.read_batch([cache.index(key)], fields=("text",))["text"][0]
        expected = TextEncoder(text_model, tokenizer).encode([caption]).embeds[0]
        torch.testing.assert_close(stored.float(), expected.float(), atol=1e-3, rtol=1e-3)


def test_text_to_image_example_refuses_images_that_are_no_folder_or_fewer_than_a_batch(tmp_path, capsys):
    example = load_t2i()
    with pytest.raises(SystemExit) as exc:
        example.main(["--tiny", "--images", str(tmp_path / "12"), "--workdir", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--images: expected a folder of images with a caption file (<stem>.txt) each" in err and "12" in err, err
    from PIL import Image

    for name in ("a", "b"):  # fewer images than a batch: no batch at all (drop_last), refused before any model is built
        Image.new("RGB", (8, 8)).save(tmp_path / f"{name}.png")
    with pytest.raises(SystemExit) as exc:
        example.main(["--tiny", "--images", str(tmp_path), "--batch-size", "4", "--workdir", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"--batch-size 4: expected at most as many images, and --images {tmp_path} has 2" in err, err


def test_text_to_image_example_defaults_to_the_sd_vae_and_clip_l_at_256_px():
    # the cost of the default encoders is what the README's ratio measures: the SD 1.x VAE (83.65M parameters,
    # 34.16M in the encoder) and CLIP-L's text tower (123.06M), built on the meta device (no memory, no time)
    example = load_t2i()
    with torch.device("meta"):
        vae, text_model, tokenizer = example.encoders(tiny=False)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    assert (count(vae), count(vae.encoder) + count(vae.quant_conv), count(text_model)) == (83_653_863, 34_163_664, 123_060_480)
    assert tokenizer.model_max_length == 77 and text_model.config.max_position_embeddings == 77
    assert vae.config.latent_channels == 4 and vae.config.scaling_factor == 0.18215


def test_the_readme_shows_the_text_to_image_loop():
    assert_readme_quotes(T2I, "cache-loop")
