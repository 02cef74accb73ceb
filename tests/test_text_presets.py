"""latentfast.text_presets on tiny random-weight transformers models built from small configs (no downloads):
each preset's fields against the diffusers pipeline's own ``encode_prompt`` (a real pipeline object built
from the tiny components, called under ``torch.no_grad()`` as its ``__call__`` runs it), a build storing the
named fields with equal captions stored once, loading a preset from folders, and combinations made by hand."""
from __future__ import annotations

import pathlib

import pytest
import torch

transformers = pytest.importorskip("transformers")
diffusers = pytest.importorskip("diffusers")

from test_text_encoders import clip_tokenizer, t5_tokenizer, tiny_clip, tiny_t5  # noqa: E402

from latentfast.cache import LatentCache  # noqa: E402
from latentfast.cache.builders.images import build_image_cache  # noqa: E402
from latentfast.errors import InvalidArgumentError  # noqa: E402
from latentfast.text_presets import TextEncoders, load_text_preset, text_preset  # noqa: E402
from latentfast.encoders import TextEncoder  # noqa: E402
from latentfast.toy import ToyVAE  # noqa: E402
from latentfast.testing import write_captioned_images  # noqa: E402

# the second caption is longer than CLIP's 16 and T5's 12 tokens; the third needs Wan's cleaning
CAPTIONS = ["a cat", "dog dog zebra quick brown", "  cat &amp;\n dog ", ""]
T5_LENGTH = 12
BUILD_CAPTIONS = ["a cat", "dog dog zebra quick brown", "cat dog", "", "a cat", "a cat"]  # as the .txt reader returns them


def tiny_umt5(seed=0):
    torch.manual_seed(seed)
    config = transformers.UMT5Config(vocab_size=60, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                     pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return transformers.UMT5EncoderModel(config).eval()


def tiny_llama(seed=0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=37, num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    return transformers.LlamaModel(config).eval()


# HunyuanVideo's template shape (a system part, the caption, an end), small; crop_start: the tokens before the caption
HUNYUAN_TEMPLATE = {"template": "system describe the video user {} end", "crop_start": 26}


def pipeline(name):
    """The diffusers pipeline of ``name`` with tiny text components (no VAE, denoiser or scheduler: encode_prompt needs none)."""
    clip, tok, none = tiny_clip(seed=0), clip_tokenizer(), dict(vae=None, scheduler=None)
    if name == "sd15":
        return diffusers.StableDiffusionPipeline(text_encoder=clip, tokenizer=tok, unet=None, safety_checker=None,
                                                 feature_extractor=None, requires_safety_checker=False, **none)
    if name == "sdxl":
        return diffusers.StableDiffusionXLPipeline(text_encoder=clip, tokenizer=tok, unet=None, tokenizer_2=tok,
                                                   text_encoder_2=tiny_clip("CLIPTextModelWithProjection", seed=1), **none)
    if name == "sd3":
        return diffusers.StableDiffusion3Pipeline(transformer=None, text_encoder=tiny_clip("CLIPTextModelWithProjection", seed=2),
                                                  tokenizer=tok, text_encoder_2=tiny_clip("CLIPTextModelWithProjection", seed=3),
                                                  tokenizer_2=tok, text_encoder_3=tiny_t5(), tokenizer_3=t5_tokenizer(), **none)
    if name == "flux":
        return diffusers.FluxPipeline(transformer=None, text_encoder=clip, tokenizer=tok, text_encoder_2=tiny_t5(),
                                      tokenizer_2=t5_tokenizer(), **none)
    if name == "hunyuan-video":  # its CLIP always reads 77 tokens
        return diffusers.HunyuanVideoPipeline(transformer=None, text_encoder=tiny_llama(), tokenizer=t5_tokenizer(),
                                              text_encoder_2=tiny_clip(seed=4, positions=77), tokenizer_2=tok, **none)
    return diffusers.WanPipeline(transformer=None, text_encoder=tiny_umt5(), tokenizer=t5_tokenizer(), **none)


@torch.no_grad()  # as the pipelines' __call__ (autograd on picks other attention kernels: last-bit differences)
def pipeline_encode(name, pipe, captions):
    """What the pipeline's own encode_prompt returns for the captions, without classifier-free guidance."""
    if name == "sd15":
        return {"prompt_embeds": pipe.encode_prompt(captions, "cpu", 1, False)[0]}
    if name in ("sdxl", "sd3"):
        extra = dict(prompt_2=None, prompt_3=None, max_sequence_length=T5_LENGTH) if name == "sd3" else {}
        embeds, _, pooled, _ = pipe.encode_prompt(captions, device="cpu", do_classifier_free_guidance=False, **extra)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
    if name == "flux":
        embeds, pooled, _ = pipe.encode_prompt(captions, None, device="cpu", max_sequence_length=T5_LENGTH)
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled}
    if name == "hunyuan-video":
        embeds, pooled, mask = pipe.encode_prompt(captions, prompt_template=HUNYUAN_TEMPLATE, max_sequence_length=T5_LENGTH,
                                                  device="cpu")
        return {"prompt_embeds": embeds, "pooled_prompt_embeds": pooled, "prompt_attention_mask": mask}
    return {"prompt_embeds": pipe.encode_prompt(captions, do_classifier_free_guidance=False, max_sequence_length=T5_LENGTH,
                                                device="cpu")[0]}


FIELDS = {"sd15": ["text_clip_l"], "sdxl": ["text_clip_g", "text_clip_l", "text_pooled"],
          "sd3": ["text_clip_g", "text_clip_l", "text_pooled", "text_t5"], "flux": ["text_pooled", "text_t5"], "wan": ["text_t5"],
          "hunyuan-video": ["text_llama", "text_llama_mask", "text_pooled"]}


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_preset_fields_are_what_the_pipelines_encode_prompt_computes(name):
    pipe = pipeline(name)
    want = pipeline_encode(name, pipe, CAPTIONS)
    preset = text_preset(name, pipe, max_length=T5_LENGTH, **({"prompt_template": HUNYUAN_TEMPLATE} if name == "hunyuan-video" else {}))
    fields = preset.encode(CAPTIONS)
    assert sorted(fields) == FIELDS[name] and all(len(v) == len(CAPTIONS) for v in fields.values())
    got = preset.pipeline_inputs(fields)
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (name, key)
    if name == "wan":  # the mask: each caption's rows only (the pipeline pads zeros), on the cleaned caption
        lengths = [len(t5_tokenizer()(c)["input_ids"]) for c in ["a cat", "dog dog zebra quick brown", "cat & dog", ""]]
        assert [v.shape[0] for v in fields["text_t5"]] == [min(n, T5_LENGTH) for n in lengths]


def test_sdxl_fields_are_each_clips_penultimate_layer_and_the_seconds_projection():
    pipe = pipeline("sdxl")
    fields = text_preset("sdxl", pipe).encode(CAPTIONS)
    ids = clip_tokenizer()(CAPTIONS, padding="max_length", max_length=16, truncation=True, return_tensors="pt").input_ids
    with torch.no_grad():
        out_l = pipe.text_encoder(ids, output_hidden_states=True)
        out_g = pipe.text_encoder_2(ids, output_hidden_states=True)
    assert torch.equal(torch.stack(fields["text_clip_l"]), out_l.hidden_states[-2])
    assert torch.equal(torch.stack(fields["text_clip_g"]), out_g.hidden_states[-2])
    assert torch.equal(torch.stack(fields["text_pooled"]), out_g.text_embeds)


@pytest.fixture()
def images(tmp_path):
    return pathlib.Path(write_captioned_images(tmp_path / "imgs", BUILD_CAPTIONS, width_step=5))


def test_a_build_with_a_preset_stores_its_fields_and_equal_captions_once(images, tmp_path):
    pipe = pipeline("sd3")
    preset = text_preset("sd3", pipe, max_length=T5_LENGTH)
    build_image_cache(ToyVAE(), images, tmp_path / "c", buckets=[(32, 32), (32, 48)], batch_size=4, quiet=True,
                      text_encoder=preset)
    cache = LatentCache(tmp_path / "c", expected={"text_encoder": preset.identity()})
    assert sorted(cache.fields) == ["latent"] + FIELDS["sd3"]
    captions = [(images / f"{key}.txt").read_text(encoding="utf-8") for key in cache.keys]
    records = [cache.record(i) for i in range(len(cache))]
    got = preset.pipeline_inputs({f: [r[f] for r in records] for f in FIELDS["sd3"]})
    want = pipeline_encode("sd3", pipe, captions)
    for key in want:  # encoded in batches of other sizes than the pipeline's one batch: the same math, not the same bits
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-6)
    t5 = cache.meta["fields"]["text_t5"]
    assert t5["logical_bytes"] == 6 * T5_LENGTH * 32 * 4 and t5["stored_bytes"] == 4 * T5_LENGTH * 32 * 4  # "a cat" x3 once
    other = text_preset("sd3", pipeline("sd3"), max_length=T5_LENGTH + 1)
    with pytest.raises(ValueError, match="text_encoder"):
        LatentCache(tmp_path / "c", expected={"text_encoder": other.identity()})


def test_load_a_preset_from_a_pipeline_folder_or_one_folder_per_encoder(tmp_path):
    pipe = pipeline("flux")
    for part in ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"):
        getattr(pipe, part).save_pretrained(tmp_path / "pipe" / part)
    for i, (model, tok) in enumerate([("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")]):
        getattr(pipe, model).save_pretrained(tmp_path / f"enc{i}")
        getattr(pipe, tok).save_pretrained(tmp_path / f"enc{i}")
    want = text_preset("flux", pipe, max_length=T5_LENGTH)
    for folders in (tmp_path / "pipe", [tmp_path / "enc0", tmp_path / "enc1"]):
        loaded = load_text_preset("flux", folders, max_length=T5_LENGTH)
        assert loaded.identity() == want.identity()
        for name, values in loaded.encode(CAPTIONS).items():
            assert torch.equal(torch.stack(values), torch.stack(want.encode(CAPTIONS)[name]))
    with pytest.raises(InvalidArgumentError, match=r"needs 2 text-encoder folders \(text_encoder, text_encoder_2\), got 1"):
        load_text_preset("flux", [tmp_path / "enc0"])
    with pytest.raises(InvalidArgumentError, match="has no config.json"):
        load_text_preset("flux", tmp_path / "enc0")


def test_encoders_combined_by_hand():
    clip, t5 = TextEncoder(tiny_clip(), clip_tokenizer()), TextEncoder(tiny_t5(), t5_tokenizer(), max_length=T5_LENGTH)
    both = TextEncoders({"clip": clip, "t5": t5}, {"text": "t5", "text_pooled": ["clip.pooled", "clip.pooled"]})
    fields = both.encode(CAPTIONS)
    want_t5, want_clip = t5.encode(CAPTIONS), clip.encode(CAPTIONS)
    assert all(torch.equal(a, b) for a, b in zip(fields["text"], want_t5.embeds))
    assert torch.equal(torch.stack(fields["text_pooled"]), torch.cat([want_clip.pooled] * 2, dim=-1))
    assert both.identity()["fields"] == {"text": ["t5"], "text_pooled": ["clip.pooled", "clip.pooled"]}
    with pytest.raises(InvalidArgumentError, match=r"fields\['x'\].*got 'clip.hidden'"):
        TextEncoders({"clip": clip}, {"x": "clip.hidden"})
    with pytest.raises(InvalidArgumentError, match=r"encoder 't5' \(T5EncoderModel\) has no pooled output"):
        TextEncoders({"t5": t5}, {"x": "t5.pooled"})
    with pytest.raises(InvalidArgumentError, match="pipeline_inputs needs a preset"):
        both.pipeline_inputs(fields)
    with pytest.raises(InvalidArgumentError, match=r"preset 'sdxl' needs .*missing \['text_encoder_2', 'tokenizer_2'\]"):
        text_preset("sdxl", text_encoder=clip.model, tokenizer=clip.tokenizer)
