"""SimpleTuner caches read as records == what SimpleTuner's own cache reads return, bit for bit."""
import gzip
import hashlib
import io
import os

import pytest
import torch

from latentfast.cache.trainers import open_source
from latentfast.cache.trainers.fixtures import records_via, same_bits, simpletuner_torch_save, write_simpletuner


def torch_load(filename, compress_cache):
    """helpers/data_backend/local.py ``LocalDataBackend.torch_load`` (+ base.py ``_decompress_torch``)."""
    with open(filename, "rb") as fh:
        stored_tensor = io.BytesIO(fh.read())
    if compress_cache:
        stored_tensor.seek(0)
        with gzip.GzipFile(fileobj=stored_tensor, mode="rb") as file:
            stored_tensor = io.BytesIO(file.read())
    stored_tensor.seek(0)
    return torch.load(stored_tensor, map_location="cpu")


def vae_cache_filename(cache_dir, image_root, image_path, hash_filenames=True):
    """helpers/caching/vae.py ``VAECache.generate_vae_cache_filename`` (local files)."""
    base_filename = os.path.splitext(os.path.basename(image_path))[0]
    if hash_filenames:
        base_filename = str(hashlib.sha256(str(base_filename).encode()).hexdigest())
    base_filename = str(base_filename) + ".pt"
    subfolders = os.path.dirname(image_path).replace(image_root, "").lstrip(os.sep)
    return os.path.join(cache_dir, subfolders, base_filename) if subfolders else os.path.join(cache_dir, base_filename)


def text_cache_filename(cache_dir, caption, model_type):
    """helpers/caching/text_embeds.py ``TextEmbeddingCache.hash_prompt_with_path`` (caption keys)."""
    return os.path.join(cache_dir, hashlib.md5(str(caption).encode()).hexdigest() + f"-{model_type}" + ".pt")


def first_textfile_caption(path) -> str:
    """The first caption SimpleTuner reads from a ``.txt`` (helpers/prompts.py
    ``prepare_instance_prompt_from_textfile``: the bytes decoded, split on newlines when there are any, empty
    lines dropped), the one whose embedding the fixture writes."""
    with open(path, "rb") as fh:
        text = fh.read().decode("utf-8")
    return [line for line in text.split("\n") if line][0] if "\n" in text else text

@pytest.mark.parametrize("compress,hashed,via", [(True, True, "reader"), (False, False, "reader"), (True, False, "reader"),
                                                 (True, True, "import"), (False, False, "import"), (True, True, "auto")])
def test_every_field_matches_simpletuners_reads(tmp_path, compress, hashed, via):
    """Read by the reader, or imported (format="simpletuner" / "auto") and read back from the cache."""
    cache, images = str(tmp_path / "cache"), str(tmp_path / "images")
    stems = write_simpletuner(cache, images, n=4, compress=compress, hash_filenames=hashed)
    records = records_via(cache, "simpletuner", via, tmp_path / "out", images=images)
    assert set(records) == set(stems)
    for stem in stems:
        image = os.path.join(images, stem + ".png")
        latent = torch_load(vae_cache_filename(os.path.join(cache, "vae"), images, image, hashed), compress)
        caption = first_textfile_caption(os.path.join(images, stem + ".txt"))
        embeds = torch_load(text_cache_filename(os.path.join(cache, "text"), caption, "flux"), compress)
        rec = records[stem]
        assert same_bits(rec.fields["latent"], latent)
        assert set(rec.fields) == {"latent"} | {f"text_{k}" for k in embeds}
        for k, v in embeds.items():
            assert same_bits(rec.fields[f"text_{k}"], v), k
        assert rec.fields["text_prompt_embeds"].shape[1] == rec.fields["text_attention_mask"].shape[1]
        assert rec.info["latent_convention"] == "scaled"
    assert open_source(cache, "simpletuner", images=images).skipped == []


def test_without_images_keys_are_the_hashes_and_text_is_listed(tmp_path):
    cache, images = str(tmp_path / "cache"), str(tmp_path / "images")
    write_simpletuner(cache, images, n=2)
    source = open_source(cache, "simpletuner", scaling_factor=0.3611, shift_factor=0.1159)
    records = list(source)
    digest = {i: hashlib.sha256(f"img_{i:03d}".encode()).hexdigest() for i in range(2)}
    assert {r.key for r in records} == {digest[0], f"sub/{digest[1]}"}  # the image's subfolder is kept
    assert records[0].info["scaling_factor"] == 0.3611
    summary = source.summary()
    assert "2 text embeddings not matched to an item by caption" in summary
    assert "2 keys are SimpleTuner's sha256 file-name hashes" in summary


def test_captions_argument_matches_text(tmp_path):
    cache, images = str(tmp_path / "cache"), str(tmp_path / "images")
    write_simpletuner(cache, images, n=1, hash_filenames=False)
    (rec,) = open_source(cache, "simpletuner", captions={"img_000": "a photo of thing 0"})
    assert "text_prompt_embeds" in rec.fields


def test_gzipd_pt_is_read_not_refused(tmp_path):
    """The trainer's torch.load on the gzip bytes fails (misleading weights_only message); the reader decompresses."""
    cache, images = str(tmp_path / "cache"), str(tmp_path / "images")
    write_simpletuner(cache, images, n=1, compress=True, hash_filenames=False)
    path = os.path.join(cache, "vae", "img_000.pt")
    assert open(path, "rb").read(2) == b"\x1f\x8b"
    with pytest.raises(Exception):
        torch.load(path, map_location="cpu", weights_only=True)
    (rec,) = open_source(cache, "simpletuner", images=images)
    assert same_bits(rec.fields["latent"], torch_load(path, True))


@pytest.mark.parametrize("compress", [False, True])
def test_truncated_pt_says_truncated(tmp_path, compress):
    cache, images = str(tmp_path / "cache"), str(tmp_path / "images")
    write_simpletuner(cache, images, n=1, compress=compress, hash_filenames=False)
    path = os.path.join(cache, "vae", "img_000.pt")
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) - 40])
    with pytest.raises(ValueError, match=r"img_000\.pt: expected a (gzip'd )?torch\.save file, found a truncated one"):
        list(open_source(cache, "simpletuner", images=images))


def test_pickled_objects_are_refused_by_name(tmp_path):
    cache = tmp_path / "cache"
    simpletuner_torch_save({"latents": torch.zeros(2), "obj": io.BytesIO()}, str(cache / "vae" / "img.pt"), False)
    with pytest.raises(ValueError, match=r"img\.pt: expected a torch\.save file of tensors, found objects other than tensors"):
        list(open_source(cache, "simpletuner"))
