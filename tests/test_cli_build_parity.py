"""``latentfast cache build`` does what ``build_image_cache`` does in Python: text encoders and presets,
--flip, --sample store, --latent-dtype, captions (--caption-ext, a manifest's "caption"), and VAEs from a
single-file checkpoint in the original (LDM) key layout, a diffusers folder, or the local Hugging Face
cache by id (offline). Each CLI build is compared, field by field and bit for bit, with the Python build of
the same inputs; tiny random-weight models built from configs, saved to real folders (no downloads)."""
from __future__ import annotations

import json
import re

import pathlib

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from test_encoders import tiny_kl  # noqa: E402
from test_text_encoders import clip_tokenizer, tiny_clip  # noqa: E402

from latentfast.cache import LatentCache  # noqa: E402
from latentfast.cache.builders.images import build_image_cache  # noqa: E402
from latentfast.cache.captions import Captions  # noqa: E402
from latentfast.cli import main  # noqa: E402
from latentfast.encoders import DiffusersVAE, TextEncoder  # noqa: E402
from latentfast.errors import InvalidArgumentError  # noqa: E402
from latentfast.text_presets import load_text_model, load_text_preset, text_preset  # noqa: E402
from latentfast.testing import write_captioned_images  # noqa: E402

BUCKETS = [(32, 32), (32, 48)]
CAPTIONS = ["a cat", "a dog", "a cat", "zebra quick"]


def ldm_state_dict(vae) -> dict:
    """A diffusers AutoencoderKL's weights in the original (LDM / kohya / BFL) key layout, the inverse of
    diffusers' ``convert_ldm_vae_checkpoint``: down/up ``block``s (the decoder's levels numbered from the
    bottom), ``mid.block_N`` / ``mid.attn_1``, ``norm_out``, ``nin_shortcut``, 1x1-conv attention weights."""
    levels = len(vae.config.block_out_channels)
    rules = [(r"conv_norm_out", "norm_out"), (r"conv_shortcut", "nin_shortcut"),
             (r"down_blocks\.(\d+)\.resnets\.(\d+)\.", r"down.\1.block.\2."),
             (r"down_blocks\.(\d+)\.downsamplers\.0\.", r"down.\1.downsample."),
             (r"up_blocks\.(\d+)\.resnets\.(\d+)\.", lambda m: f"up.{levels - 1 - int(m[1])}.block.{m[2]}."),
             (r"up_blocks\.(\d+)\.upsamplers\.0\.", lambda m: f"up.{levels - 1 - int(m[1])}.upsample."),
             (r"mid_block\.resnets\.(\d+)\.", lambda m: f"mid.block_{int(m[1]) + 1}."),
             (r"mid_block\.attentions\.0\.(group_norm|to_q|to_k|to_v|to_out\.0)\.",
              lambda m: "mid.attn_1." + {"group_norm": "norm", "to_out.0": "proj_out"}.get(m[1], m[1][-1]) + ".")]
    out = {}
    for key, value in vae.state_dict().items():
        for pattern, replacement in rules:
            key = re.sub(pattern, replacement, key)
        if ".attn_1." in key and key.endswith("weight") and value.ndim == 2:
            value = value[:, :, None, None]  # LDM's attention projections are 1x1 convolutions
        out[key] = value.contiguous()
    return out


@pytest.fixture()
def images(tmp_path):
    return pathlib.Path(write_captioned_images(tmp_path / "imgs", CAPTIONS, ext=".caption"))


def same_caches(a, b):
    """Every record's every field, the keys, infos and the stamps equal."""
    ca, cb = LatentCache(a), LatentCache(b)
    assert ca.keys == cb.keys and sorted(ca.fields) == sorted(cb.fields)
    for k in ("encoder", "text_encoder", "flip", "latent_std", "latent_dtype"):
        assert ca.meta.get(k) == cb.meta.get(k), k
    for i in range(len(ca)):
        ra, rb = ca.record(i), cb.record(i)
        for name in ra:
            assert ra[name].dtype == rb[name].dtype and torch.equal(ra[name], rb[name]), (ca.keys[i], name)
        assert ca.info(i) == cb.info(i)
    return ca


def test_cli_build_with_a_preset_flip_store_and_a_single_file_vae_equals_the_python_build(images, tmp_path):
    vae = tiny_kl()
    vae.save_pretrained(tmp_path / "vae_config")
    safetensors_torch.save_file(ldm_state_dict(vae), tmp_path / "sdxl_vae.safetensors")
    clip_l, clip_g, tok = tiny_clip(seed=0), tiny_clip("CLIPTextModelWithProjection", seed=1), clip_tokenizer()
    for name, model in (("enc_l", clip_l), ("enc_g", clip_g)):
        model.save_pretrained(tmp_path / name)
        tok.save_pretrained(tmp_path / name)
    assert main(["cache", "build", "--images", str(images), "--out", str(tmp_path / "cli"), "--buckets", "32x32,32x48",
                 "--encoder", f"diffusers:{tmp_path / 'sdxl_vae.safetensors'}", "--vae-config", str(tmp_path / "vae_config"),
                 "--sample", "store", "--flip", "--latent-dtype", "float32", "--preset", "sdxl",
                 "--text-encoder", str(tmp_path / "enc_l"), "--text-encoder", str(tmp_path / "enc_g"),
                 "--caption-ext", ".caption", "--batch-size", "3", "--quiet"]) == 0
    loaded = diffusers.AutoencoderKL.from_single_file(tmp_path / "sdxl_vae.safetensors", config=str(tmp_path / "vae_config"),
                                                      local_files_only=True)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in vae.state_dict().items())  # the layout converted back
    # the same folders loaded in Python (an in-memory model's weights sit elsewhere in memory, and a batch of one
    # caption's projection (a GEMV) then differs in the last bit: the same math, not the same bits)
    preset = load_text_preset("sdxl", [tmp_path / "enc_l", tmp_path / "enc_g"])
    assert preset.identity() == text_preset("sdxl", text_encoder=clip_l, tokenizer=tok, text_encoder_2=clip_g,
                                            tokenizer_2=tok).identity()
    build_image_cache(DiffusersVAE(vae, sample="store"), images, tmp_path / "py", buckets=BUCKETS, batch_size=3, quiet=True,
                      flip=True, latent_dtype="float32", text_encoder=preset, captions=Captions(caption_extension=".caption"))
    cache = same_caches(tmp_path / "cli", tmp_path / "py")
    assert sorted(cache.fields) == ["latent", "latent_flipped", "latent_flipped_std", "latent_std", "text_clip_g",
                                    "text_clip_l", "text_pooled"]
    assert cache.fields["latent"]["dtype"] == torch.float32


def test_cli_build_with_one_text_encoder_and_manifest_captions(images, tmp_path, capsys):
    model, tok = tiny_clip(), clip_tokenizer()
    model.save_pretrained(tmp_path / "clip")
    tok.save_pretrained(tmp_path / "clip")
    tiny_kl().save_pretrained(tmp_path / "vae")
    manifest = tmp_path / "m.jsonl"  # the manifest's caption wins over the .txt beside the image; one has neither
    manifest.write_text("".join(json.dumps({"image": str(images / f"im{i}.png"), "key": f"k{i}",
                                            **({"caption": f"from json {i}"} if i < 2 else {})}) + "\n" for i in range(4)))
    for i in (2,):
        (images / f"im{i}.txt").write_text("from txt", encoding="utf-8")
    argv = ["cache", "build", "--manifest", str(manifest), "--buckets", "32x32,32x48", "--encoder",
            f"diffusers:{tmp_path / 'vae'}", "--text-encoder", str(tmp_path / "clip"), "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "refused")]) == 1  # im3 has no caption: refused, naming it
    assert "im3.png (key 'k3') has no caption" in capsys.readouterr().err
    assert main([*argv, "--out", str(tmp_path / "cli"), "--caption-missing", "empty"]) == 0
    vae = DiffusersVAE(diffusers.AutoencoderKL.from_pretrained(tmp_path / "vae"))
    te = TextEncoder(*load_text_model(str(tmp_path / "clip")))
    assert te.identity() == TextEncoder(model, tok).identity()
    build_image_cache(vae, manifest, tmp_path / "py", buckets=BUCKETS, quiet=True, batch_size=16,
                      text_encoder=te, captions=Captions(manifest, missing="empty"))
    cache = same_caches(tmp_path / "cli", tmp_path / "py")
    assert sorted(cache.fields) == ["latent", "text", "text_pooled"]
    for i, caption in enumerate(["from json 0", "from json 1", "from txt", ""]):
        torch.testing.assert_close(cache.record(cache.keys.index(f"k{i}"))["text"], te.encode([caption]).embeds[0],
                                   rtol=0, atol=1e-6)


def test_vae_by_id_from_the_local_hugging_face_cache_offline(images, tmp_path, monkeypatch):
    from huggingface_hub import constants

    hub = tmp_path / "hub"
    snapshot = hub / "models--tiny--sdxl" / "snapshots" / ("0" * 40)
    tiny_kl(seed=3).save_pretrained(snapshot / "vae")
    (hub / "models--tiny--sdxl" / "refs").mkdir(parents=True)
    (hub / "models--tiny--sdxl" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["cache", "build", "--images", str(images), "--out", str(tmp_path / "cli"), "--buckets", "32x32",
                 "--encoder", "diffusers:tiny/sdxl", "--quiet"]) == 0
    build_image_cache(DiffusersVAE(tiny_kl(seed=3)), images, tmp_path / "py", buckets=[(32, 32)], quiet=True)
    same_caches(tmp_path / "cli", tmp_path / "py")
    from latentfast.encoders import load_diffusers_vae

    with pytest.raises(InvalidArgumentError, match="'tiny/other' is neither a local path nor a model in the local Hugging Face cache"):
        load_diffusers_vae("tiny/other")


def test_clear_errors(images, tmp_path, capsys):
    vae = tiny_kl()
    safetensors_torch.save_file(ldm_state_dict(vae), tmp_path / "ae.safetensors")
    with pytest.raises(InvalidArgumentError, match="--vae-config"):  # the inferred config is not in any local cache
        from latentfast.encoders import load_diffusers_vae

        load_diffusers_vae(str(tmp_path / "ae.safetensors"))
    base = ["cache", "build", "--images", str(images), "--out", str(tmp_path / "o"), "--encoder", "toy", "--quiet"]
    for extra, message in ((["--preset", "sdxl"], "--preset sdxl needs --text-encoder folders"),
                           (["--text-encoder", "a", "--text-encoder", "b"], "several --text-encoder folders need --preset"),
                           (["--video", "--buckets", "1x32x32", "--flip"], "--flip: image caches only, not with --video"),
                           (["--preset", "nope", "--text-encoder", "a"], r"preset must be one of \['flux', 'hunyuan-video', 'sd15'")):
        assert main(base + extra) != 0
        assert re.search(message, capsys.readouterr().err), extra
