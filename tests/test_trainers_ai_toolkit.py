"""ai-toolkit caches read as records == what ai-toolkit's own loaders return, bit for bit."""
import base64
import hashlib
import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from latentfast.cache.trainers import open_source
from latentfast.cache.trainers.fixtures import records_via, same_bits, write_ai_toolkit


def hashed_path(folder, sub, stem, info):
    """toolkit/dataloader_mixins.py ``get_latent_path`` / ``_build_text_embedding_path``."""
    hash_input = json.dumps(info, sort_keys=True).encode("utf-8")
    hash_str = base64.urlsafe_b64encode(hashlib.md5(hash_input).digest()).decode("ascii").replace("=", "")
    return os.path.join(folder, sub, f"{stem}_{hash_str}.safetensors")


def get_latent(path):
    """``LatentCachingFileItemDTOMixin.get_latent``: load_file, then ``_latent_from_uint8`` for uint8."""
    state_dict = load_file(path, device="cpu")
    latent = state_dict["latent"]
    if latent.dtype == torch.uint8:
        latent = (latent.to(torch.float32) / 127.5 - 1.0).to(torch.float32)
    return latent


def prompt_embeds_load(path):
    """toolkit/prompt_utils.py ``PromptEmbeds.load`` -> (text_embeds, pooled_embeds, attention_mask)."""
    state_dict = load_file(path, device="cpu")
    text_embeds, pooled_embeds, attention_mask, is_list = [], None, [], False
    for key in sorted(state_dict.keys()):
        if key.startswith("text_embed_"):
            is_list = True
            text_embeds.append(state_dict[key])
        elif key == "text_embed":
            text_embeds.append(state_dict[key])
        elif key == "pooled_embed":
            pooled_embeds = state_dict[key]
        elif key.startswith("attention_mask_") or key == "attention_mask":
            attention_mask.append(state_dict[key])
    text = text_embeds[0] if len(text_embeds) == 1 and not is_list else text_embeds
    return text, pooled_embeds, attention_mask[0] if len(attention_mask) == 1 else attention_mask


@pytest.mark.parametrize("uint8,via", [(False, "reader"), (True, "reader"), (False, "import"), (True, "import"), (True, "auto")])
def test_every_field_matches_ai_toolkits_loaders(tmp_path, uint8, via):
    """Read by the reader, or imported (format="ai-toolkit" / "auto") and read back from the cache."""
    folder = tmp_path / "src"
    manifest = write_ai_toolkit(folder, n=3, resolutions=(256, 384), flip_x=True, uint8=uint8, dropout=True)
    by_key = records_via(folder, "ai-toolkit", via, tmp_path / "out")
    assert len(by_key) == 3 * 2  # one per image and size; flip_x copies are fields, not items
    for entry in manifest:
        te_path = hashed_path(folder, "_t_e_cache", entry["stem"], entry["te_infos"][0])
        text, pooled, mask = prompt_embeds_load(te_path)
        for info in entry["latent_infos"]:
            latent = get_latent(hashed_path(folder, "_latent_cache", entry["stem"], info))
            h, w = info["scale_to_height"] // 8, info["scale_to_width"] // 8
            rec = by_key[f"{entry['stem']}@{h}x{w}"]
            assert same_bits(rec.fields["latent_flipped" if info.get("flip_x") else "latent"], latent)
            for k in ("filename", "scale_to_width", "scale_to_height", "crop_x", "crop_y", "crop_width", "crop_height",
                      "latent_space_version", "latent_version"):
                assert rec.info[k] == info[k]
            assert same_bits(rec.fields["text_text_embed"], text)
            assert same_bits(rec.fields["text_pooled_embed"], pooled)
            assert same_bits(rec.fields["text_attention_mask"], mask)
            assert set(rec.fields) == {"latent", "latent_flipped", "text_text_embed", "text_pooled_embed", "text_attention_mask"}
            assert rec.info.get("quantized") == ("uint8" if uint8 else None)
    assert open_source(folder, "ai-toolkit").summary() == "ai-toolkit: 6 items; skipped 3 files: 3 dropout (blank-caption) text embeddings"


def test_uint8_latents_are_dequantized_to_float32(tmp_path):
    write_ai_toolkit(tmp_path, n=1, resolutions=(64,), flip_x=False, uint8=True, dropout=False)
    (rec,) = open_source(tmp_path, "ai-toolkit")
    assert rec.fields["latent"].dtype == torch.float32
    assert rec.fields["latent"].min() >= -1 and rec.fields["latent"].max() <= 1
    assert rec.info["latent_convention"] == "pixels" and rec.key == "img_000"


def test_header_metadata_is_kept_as_info(tmp_path):
    write_ai_toolkit(tmp_path, n=2, resolutions=(64,), flip_x=False, dropout=False)
    rec = list(open_source(tmp_path, "ai-toolkit"))[1]
    (path,) = [p for p in os.listdir(tmp_path / "_latent_cache") if p.startswith("img_001")]
    with safe_open(str(tmp_path / "_latent_cache" / path), "pt") as fh:
        meta = fh.metadata()
    assert rec.info["crop_y"] == int(meta["crop_y"]) == 4
    assert rec.info["software"] == json.loads(meta["software"]) and rec.info["format"] == "pt"


def test_ambiguous_text_files_are_listed_not_guessed(tmp_path):
    write_ai_toolkit(tmp_path, n=1, resolutions=(64,), flip_x=False, dropout=False)
    for tag in ("x" * 22, "y" * 22):  # two more embeddings of img_000 whose hashes no other image shares
        save_file({"text_embed": torch.zeros(1, 2, 4)}, str(tmp_path / "_t_e_cache" / f"img_000_{tag}.safetensors"))
    source = open_source(tmp_path, "ai-toolkit")
    (rec,) = source
    assert not any(k.startswith("text_") for k in rec.fields)
    assert "3 text embeddings not matched to one image" in source.summary()


def test_flipped_copy_without_base_is_listed(tmp_path):
    write_ai_toolkit(tmp_path, n=2, resolutions=(64,), flip_x=True, dropout=False)
    meta_of = {}
    for name in os.listdir(tmp_path / "_latent_cache"):
        with safe_open(str(tmp_path / "_latent_cache" / name), "pt") as fh:
            meta_of[name] = fh.metadata()
    base = next(n for n, m in meta_of.items() if m["filename"] == "img_001.jpg" and "flip_x" not in m)
    os.remove(tmp_path / "_latent_cache" / base)
    source = open_source(tmp_path, "ai-toolkit")
    assert [r.key for r in source] == ["img_000"]
    assert "1 flipped copies without their unflipped latent" in source.summary()
    assert "1 text embeddings of images without a latent" in source.summary()


def test_the_latent_cache_folder_itself_reads_as_its_dataset_folder(tmp_path):
    write_ai_toolkit(tmp_path, n=2, resolutions=(64,), flip_x=False, dropout=False)
    source = open_source(tmp_path / "_latent_cache", "ai-toolkit")
    assert [r.key for r in source] == ["img_000", "img_001"]
    assert all("text_text_embed" in r.fields for r in source)
