"""The runnable examples under examples/: each runs as its docstring says, and the README's excerpts
of them are the code that runs."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

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


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_text_to_image_example_trains_from_the_cache_and_on_the_fly(tmp_path, capsys):
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    import importlib.util

    from latentfast.cache import LatentCache

    spec = importlib.util.spec_from_file_location("train_text_to_image", T2I)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    common = ["--steps", "2", "--images", "12", "--batch-size", "4", "--workers", "2", "--threads", "1",
              "--workdir", str(tmp_path), "--device", "cpu"]
    assert example.main(common) == 0
    assert example.main(common + ["--encode-on-the-fly"]) == 0
    out = capsys.readouterr().out
    step = r"2 steps of 4, median step [\d.]+ ms, \d+% of the step waiting for data \(loss [\d.]+\)"
    assert re.search("from the cache: " + step, out) and re.search("on the fly: " + step, out), out
    cache = LatentCache(tmp_path / "cache")
    assert sorted(cache.fields) == ["latent", "latent_flipped", "latent_flipped_std", "latent_std", "text", "text_pooled"]
    assert len(cache) == 12 and cache.meta["text_encoder"]["class"] == "transformers.CLIPTextModel"


def test_the_readme_shows_the_text_to_image_loop():
    assert_readme_quotes(T2I, "cache-loop")
