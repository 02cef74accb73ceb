"""Trainer folders that did not import whole before: ai-toolkit's AnimaPromptEmbeds text caches, SimpleTuner
models that key text embeddings by dataset and file path, legacy kohya ``{stem}.npz`` folders detected by
``format="auto"``, an ``.npz`` whose header claims a huge shape, and kohya's float32 latents stored narrower
(``latent_dtype=``). Each compared, field by field, with the trainer's own loader (re-implemented)."""
from __future__ import annotations

import glob
import hashlib
import io
import os
import shutil
import zipfile

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from latentfast.cache import LatentCache
from latentfast.cache.builders.importers import import_latents
from latentfast.cache.cli import main as cache_cli
from latentfast.cache.trainers import TrainerCacheError, open_source
from latentfast.cache.trainers.fixtures import (records_via, same_bits, simpletuner_text_cache_name, write_ai_toolkit,
                                                write_kohya, write_simpletuner)
from latentfast.errors import CacheError, InvalidArgumentError, NonFiniteError
from test_trainers_ai_toolkit import get_latent, hashed_path
from test_trainers_kohya import load_latents_from_disk, load_outputs_npz
from test_trainers_simpletuner import first_textfile_caption, torch_load, vae_cache_filename


# ---- ai-toolkit: AnimaPromptEmbeds -----------------------------------------------------------------
def anima_prompt_embeds_load(path):
    """extensions_built_in/diffusion_models/anima/anima.py ``AnimaPromptEmbeds.load`` (what toolkit/prompt_utils.py
    ``PromptEmbeds.load`` hands a file whose metadata class_name is AnimaPromptEmbeds), as
    ``(text_embeds, attention_mask, t5_input_ids, t5_attention_mask)``."""
    state_dict = load_file(path, device="cpu")
    return (state_dict["qwen_prompt_embeds"], state_dict["qwen_attention_mask"], state_dict["t5_input_ids"],
            state_dict["t5_attention_mask"])


@pytest.mark.parametrize("via", ["reader", "import", "auto"])
def test_anima_prompt_embeds_import_as_ai_toolkits_loader_reads_them(tmp_path, via):
    """Refused as "not supported" before."""
    folder = tmp_path / "src"
    manifest = write_ai_toolkit(folder, n=3, resolutions=(256,), text_class="AnimaPromptEmbeds")
    records = records_via(folder, "ai-toolkit", via, tmp_path / "out")
    assert len(records) == 3
    for entry in manifest:
        text, mask, t5_ids, t5_mask = anima_prompt_embeds_load(hashed_path(folder, "_t_e_cache", entry["stem"], entry["te_infos"][0]))
        for info in entry["latent_infos"]:
            rec = records[entry["stem"]]
            latent = get_latent(hashed_path(folder, "_latent_cache", entry["stem"], info))
            assert same_bits(rec.fields["latent_flipped" if info.get("flip_x") else "latent"], latent)
        assert same_bits(rec.fields["text_qwen_prompt_embeds"], text) and same_bits(rec.fields["text_qwen_attention_mask"], mask)
        assert same_bits(rec.fields["text_t5_input_ids"], t5_ids) and same_bits(rec.fields["text_t5_attention_mask"], t5_mask)
        assert set(rec.fields) == {"latent", "latent_flipped", "text_qwen_prompt_embeds", "text_qwen_attention_mask",
                                   "text_t5_input_ids", "text_t5_attention_mask"}
        assert rec.info["text_class_name"] == "AnimaPromptEmbeds"


def test_a_text_cache_of_another_class_is_refused_naming_the_file(tmp_path):
    manifest = write_ai_toolkit(tmp_path, n=1, resolutions=(256,), dropout=False)
    path = hashed_path(tmp_path, "_t_e_cache", manifest[0]["stem"], manifest[0]["te_infos"][0])
    save_file(load_file(path), path, metadata={"class_name": "AdvancedPromptEmbeds"})
    with pytest.raises(TrainerCacheError, match=f"{path}: expected the entries of one of .*AdvancedPromptEmbeds file"):
        open_source(tmp_path, "ai-toolkit")


# ---- SimpleTuner: text embeddings keyed by dataset and file path -----------------------------------
def path_keyed_text_file(text_dir, dataset_id, images, stem, caption, model_type):
    """helpers/caching/text_embeds.py ``hash_prompt_with_path`` for ``TextEmbedCacheKey.DATASET_AND_FILENAME``: the key
    helpers/training/collate.py builds (``f"{backend_id}:{normalize_data_path(path, instance_data_dir)}"``), hashed with
    the prompt by ``create_hash``."""
    relative = os.path.normcase(os.path.relpath(os.path.abspath(os.path.join(images, stem + ".png")), os.path.abspath(images)))
    md5_hash = hashlib.md5(f"{dataset_id}:{relative}".encode())
    md5_hash.update(b"\0prompt\0")
    md5_hash.update(caption.encode())
    return os.path.join(text_dir, md5_hash.hexdigest() + f"-{model_type}.pt")


@pytest.mark.parametrize("via", ["reader", "import"])
def test_simpletuner_path_keyed_text_embeddings_import_with_their_items(tmp_path, via):
    """Every text embedding was dropped before (matched by caption only)."""
    cache, images = tmp_path / "cache", tmp_path / "images"
    stems = write_simpletuner(str(cache), str(images), n=3, model_type="qwen_image", dataset_id="edits")
    records = records_via(cache, "simpletuner", via, tmp_path / "out", images=str(images))
    assert set(records) == set(stems)
    vae_dir, text_dir = cache / "vae" / "qwen_image" / "edits", cache / "text" / "qwen_image"
    for stem in stems:
        latent = torch_load(vae_cache_filename(str(vae_dir), str(images), str(images / (stem + ".png"))), True)
        caption = first_textfile_caption(images / (stem + ".txt"))
        embeds = torch_load(path_keyed_text_file(text_dir, "edits", images, stem, caption, "qwen_image"), True)
        rec = records[stem]
        assert same_bits(rec.fields["latent"], latent)
        assert set(rec.fields) == {"latent"} | {f"text_{k}" for k in embeds}
        assert all(same_bits(rec.fields[f"text_{k}"], v) for k, v in embeds.items())
    assert open_source(cache, "simpletuner", images=str(images)).skipped == []


def test_a_path_keyed_cache_outside_the_default_layout_needs_its_dataset_id(tmp_path):
    cache, images = tmp_path / "cache", tmp_path / "images"
    write_simpletuner(str(cache), str(images), n=2, model_type="krea2", dataset_id="edits", compress=False)
    shutil.move(cache / "vae" / "krea2" / "edits", cache / "vae" / "krea2" / "elsewhere")  # a cache_dir_vae of its own
    with pytest.raises(TrainerCacheError, match=r"none of its 2 text embeddings matches an item .*pass dataset_id="):
        open_source(cache, "simpletuner", images=str(images))
    source = open_source(cache, "simpletuner", images=str(images), dataset_id="edits")
    assert all("text_prompt_embeds" in r.fields for r in source)
    out = str(tmp_path / "out")
    assert cache_cli(["cache", "import", str(cache), "--out", out, "--format", "simpletuner", "--images", str(images),
                      "--dataset-id", "edits", "--quiet"]) == 0
    assert "text_prompt_embeds" in LatentCache(out).fields


def test_the_fixtures_path_keyed_names_are_simpletuners(tmp_path):
    """The fixture's names, recomputed here from SimpleTuner's functions as re-implemented above."""
    images = tmp_path / "images"
    name = simpletuner_text_cache_name("a cat", "longcat_image", "ds", str(images / "sub" / "a.png"), str(images))
    assert os.path.join("t", name) == path_keyed_text_file("t", "ds", images, "sub/a", "a cat", "longcat_image")


# ---- kohya: legacy {stem}.npz folders found by format="auto" -----------------------------------------
def test_auto_detects_a_legacy_kohya_folder_without_text_files(tmp_path):
    """format="auto" found no trainer's files in such a folder before."""
    folder = tmp_path / "src"
    write_kohya(folder, arch="legacy", n=3, text=False)
    stats = {}
    import_latents(folder, tmp_path / "out", format="auto", quiet=True, stats=stats)
    assert stats["format"] == "kohya" and "img_000.npz" in stats["evidence"]
    cache = LatentCache(tmp_path / "out")
    for i, key in enumerate(cache.keys):
        latents, original_size, crop_ltrb, flipped, alpha = load_latents_from_disk(None, str(folder / f"{key}.npz"), None)
        record = cache.record(i)
        assert same_bits(record["latent"], torch.from_numpy(latents))
        assert same_bits(record["latent_flipped"], torch.from_numpy(flipped)) and same_bits(record["alpha_mask"], torch.from_numpy(alpha))
        assert cache.info(i)["original_size"] == original_size and cache.info(i)["crop_ltrb"] == crop_ltrb
    assert len(cache) == 3


def test_auto_does_not_take_other_npz_files_for_kohyas(tmp_path):
    np.savez(tmp_path / "embedding.npz", vectors=np.zeros(3))
    with pytest.raises(TrainerCacheError, match="no trainer's cache files"):
        import_latents(tmp_path, tmp_path / "out", format="auto", quiet=True)


# ---- an .npz whose header claims a huge shape ----------------------------------------------------------
def claim_huge_shape(path, array_name):
    """Rewrite ``path`` with ``array_name``'s .npy header claiming 2**40 elements over its own bytes."""
    arrays = dict(np.load(path))
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": arrays[array_name].dtype.str, "fortran_order": False,
                                                  "shape": (1 << 20, 1 << 20)})
    with zipfile.ZipFile(path, "w") as archive:
        for name, value in arrays.items():
            buffer = io.BytesIO()
            np.save(buffer, value)
            archive.writestr(f"{name}.npy", header.getvalue() + value.tobytes() if name == array_name else buffer.getvalue())


def test_an_npz_header_claiming_a_huge_shape_is_named_before_anything_is_written(tmp_path):
    """A bare ``ValueError: EOF ...`` (or an allocation of the claimed size) naming no file before."""
    folder = tmp_path / "src"
    write_kohya(folder, arch="sdxl", n=3)
    (path,) = glob.glob(str(folder / "img_001_*_sdxl.npz"))
    claim_huge_shape(path, "latents")
    with pytest.raises(TrainerCacheError, match=rf"{path}#latents: expected 4398046511104 bytes of array data \(its header's "
                                                rf"shape \[1048576, 1048576\], dtype <f4\), found \d+ bytes: a damaged array"):
        import_latents(folder, tmp_path / "out", format="kohya", quiet=True)
    assert not (tmp_path / "out").exists()  # refused at the scan
    write_kohya(tmp_path / "other", arch="sdxl", n=3)
    te = str(tmp_path / "other" / "img_002_te_outputs.npz")
    claim_huge_shape(te, "hidden_state1")
    with pytest.raises(TrainerCacheError, match=rf"{te}#hidden_state1: expected"):
        open_source(tmp_path / "other", "kohya")


def test_an_npz_file_of_the_extension_format_with_a_huge_header_is_named(tmp_path):
    np.savez(tmp_path / "a.npz", latents=np.zeros((4, 2, 2), np.float32))
    claim_huge_shape(str(tmp_path / "a.npz"), "latents")
    with pytest.raises(CacheError, match=r"cannot read npz latents from .*a\.npz: .*a\.npz#latents: expected"):
        import_latents(tmp_path, tmp_path / "out", format="npz", quiet=True)


# ---- latent_dtype= on import ---------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_latent_dtype_stores_kohyas_float32_latents_narrower(tmp_path, dtype):
    folder = tmp_path / "src"
    write_kohya(folder, arch="sdxl", n=2)
    out = str(tmp_path / "out")
    assert cache_cli(["cache", "import", str(folder), "--out", out, "--format", "kohya", "--latent-dtype", dtype, "--quiet"]) == 0
    cache = LatentCache(out)
    assert cache.dtype == getattr(torch, dtype) and cache.meta["import_latent_dtype"] == dtype
    for i, key in enumerate(cache.keys):
        (path,) = glob.glob(str(folder / f"{key}_*_sdxl.npz"))
        latents, _, _, flipped, alpha = load_latents_from_disk(None, path, None)
        record = cache.record(i)
        assert same_bits(record["latent"], torch.from_numpy(latents).to(getattr(torch, dtype)))  # kohya's loader, then the cast
        assert same_bits(record["latent_flipped"], torch.from_numpy(flipped).to(getattr(torch, dtype)))
        assert same_bits(record["alpha_mask"], torch.from_numpy(alpha))  # not a latent: as stored
        outputs = load_outputs_npz("sdxl", str(folder / f"{key}_te_outputs.npz"))
        assert all(same_bits(record[f"text_{n}"], torch.from_numpy(a)) for n, a in outputs.items())
    stats = {}
    import_latents(folder, out, format="kohya", quiet=True, latent_dtype=dtype, stats=stats)
    assert stats["unchanged"]
    import_latents(folder, out, format="kohya", quiet=True, stats=stats)  # the source's dtype again: rewritten
    assert not stats["unchanged"] and LatentCache(out).dtype == torch.float32


def test_latent_dtype_refuses_a_value_float16_cannot_hold_naming_the_item(tmp_path):
    folder = tmp_path / "src"
    write_kohya(folder, arch="sdxl", n=3)
    (path,) = glob.glob(str(folder / "img_001_*_sdxl.npz"))
    arrays = dict(np.load(path))
    arrays["latents_flipped"][0, 0, 0] = -1.5e5
    np.savez(path, **arrays)
    with pytest.raises(NonFiniteError, match=r"item 'img_001' of .*: field 'latent_flipped' holds values beyond float16's range "
                                             r"\(largest magnitude 150000, limit 65504\)"):
        import_latents(folder, tmp_path / "out", format="kohya", quiet=True, latent_dtype="float16")
    import_latents(folder, tmp_path / "bf16", format="kohya", quiet=True, latent_dtype="bfloat16")
    assert same_bits(LatentCache(tmp_path / "bf16").record(1)["latent_flipped"],
                     torch.from_numpy(arrays["latents_flipped"]).to(torch.bfloat16))


def test_latent_dtype_arguments(tmp_path):
    write_kohya(tmp_path / "src", arch="sdxl", n=1)
    with pytest.raises(InvalidArgumentError, match="latent_dtype must be 'bfloat16', 'float16' or None"):
        import_latents(tmp_path / "src", tmp_path / "out", format="kohya", quiet=True, latent_dtype="float32")
    (tmp_path / "npz").mkdir()
    np.savez(tmp_path / "npz" / "a.npz", latents=np.zeros((4, 2, 2), np.float32))
    with pytest.raises(InvalidArgumentError, match="latent_dtype= other than float16"):
        import_latents(tmp_path / "npz", tmp_path / "out", format="npz", quiet=True, latent_dtype="bfloat16")
    import_latents(tmp_path / "npz", tmp_path / "out", format="npz", quiet=True, latent_dtype="float16")
