"""SimpleTuner cosmos3 caches (text files keyed by dataset, path and a reasoner-prompt signature) import whole:
every item's reasoner cache equals what SimpleTuner's own loader returns for it, bit for bit.

SimpleTuner's side is re-implemented here from bghira/SimpleTuner bc8e6ab: which file its collate asks for
(helpers/training/collate.py, cosmos3/model.py ``text_embed_cache_metadata_for_sample`` and
``text_embed_cache_key_value``, helpers/caching/text_embeds.py ``create_hash``) and what it reads from it
(``TextEmbeddingCache.load_from_cache`` through ``LocalDataBackend.torch_load``, then cosmos3's
``collate_prompt_embeds``). The signature is latentfast's, pinned to values SimpleTuner's own
``_cosmos3_text_cache_signature`` gives (test_the_signature_is_simpletuners).
"""
import hashlib
import os
import shutil

import pytest
import torch

from latentfast.cache import LatentCache, import_latents
from latentfast.cache.cli import main as cache_cli
from latentfast.cache.trainers import TrainerCacheError, open_source
from latentfast.cache.trainers import simpletuner_cosmos3 as cosmos3
from latentfast.cache.trainers.fixtures import (cosmos3_reasoner_cache, records_via, same_bits, simpletuner_torch_save,
                                                write_simpletuner, write_simpletuner_cosmos3)

from test_trainers_simpletuner import torch_load

NANO = "SimpleTuner/cosmos3-component-reasoning-layers-bf16-nano"


def collate_text_file(text_dir, dataset_id, images, media, caption, latent, framerate=24.0, component=NANO):
    """The text file SimpleTuner's collate asks for: ``text_embed_cache_metadata_for_sample`` (the latent's frames,
    its height and width times 16), ``_cosmos3_text_cache_signature``, ``text_embed_cache_key_value``
    (``f"{default_key}:cosmos3:{signature}"`` with collate's default key ``f"{backend id}:{normalize_data_path}"``),
    then ``create_hash`` (``_normalize_key_value`` leaves a local path alone) + ``-cosmos3.pt``."""
    frames, height, width = latent.shape[-3], latent.shape[-2] * 16, latent.shape[-1] * 16
    signature = cosmos3.signature(caption, int(frames), int(height), int(width), float(framerate), component)
    relative = os.path.normcase(os.path.relpath(os.path.abspath(media), os.path.abspath(images)))
    md5_hash = hashlib.md5(f"{dataset_id}:{relative}:cosmos3:{signature}".encode())
    if caption:
        md5_hash.update(b"\0prompt\0")
        md5_hash.update(caption.encode())
    return os.path.join(text_dir, md5_hash.hexdigest() + "-cosmos3.pt")


def simpletuner_files(cache, images, compress, dataset_id="train", **kw):
    """``{key: (caption, latent, text file)}`` of each image or video under ``images`` as SimpleTuner trains on it:
    its caption (``caption_strategy=textfile``), the VAE cache's latent (``VAECache.generate_vae_cache_filename``,
    hashed) and the text file its collate asks for (:func:`collate_text_file`)."""
    out = {}
    for dirpath, _, names in os.walk(images):
        for name in names:
            if name.endswith(".txt"):
                continue
            stem, media = os.path.splitext(name)[0], os.path.join(dirpath, name)
            sub = os.path.relpath(dirpath, images)
            vae = os.path.join(cache, "vae", "cosmos3", dataset_id, "" if sub == "." else sub,
                               hashlib.sha256(stem.encode()).hexdigest() + ".pt")
            latent = torch_load(vae, compress)
            with open(os.path.splitext(media)[0] + ".txt", encoding="utf-8") as fh:
                caption = fh.read()
            text = collate_text_file(os.path.join(cache, "text", "cosmos3"), dataset_id, images, media, caption, latent, **kw)
            out[stem if sub == "." else f"{sub}/{stem}"] = (caption, latent, text)
    return out


def loader_entry(text, compress):
    """``TextEmbeddingCache.load_from_cache`` (``torch_load``; cosmos3 unpacks nothing), then the item's entry of
    cosmos3/model.py ``collate_prompt_embeds`` (``[e["cosmos3_reasoner_cache"] for e in outputs]``)."""
    (entry,) = [e["cosmos3_reasoner_cache"] for e in [torch_load(text, compress)]]
    return entry


def assert_same(ours, theirs, where=""):
    """Equal structures: same keys in dicts, same lengths in lists, tensors bit-equal, plain values equal and of one type."""
    assert type(ours) is type(theirs), where
    if isinstance(theirs, dict):
        assert list(ours) == list(theirs), where
        for k in theirs:
            assert_same(ours[k], theirs[k], f"{where}.{k}")
    elif isinstance(theirs, list):
        assert len(ours) == len(theirs), where
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same(a, b, f"{where}[{i}]")
    elif isinstance(theirs, torch.Tensor):
        assert same_bits(ours, theirs), where
    else:
        assert ours == theirs, where


@pytest.mark.parametrize("via,compress,frames,k_for_gen", [("reader", True, 1, False), ("import", False, 1, False),
                                                           ("auto", True, 3, True), ("import", True, 3, False)])
def test_every_field_equals_what_simpletuners_loader_returns(tmp_path, via, compress, frames, k_for_gen):
    cache, images = str(tmp_path / "cache"), str(tmp_path / "images")
    stems = write_simpletuner_cosmos3(cache, images, n=4, compress=compress, frames=frames, k_for_gen=k_for_gen)
    records = records_via(cache, "simpletuner", via, tmp_path / "out", images=images)
    theirs = simpletuner_files(cache, images, compress)
    assert set(records) == set(stems) == set(theirs)
    for stem, (caption, latent, text) in theirs.items():
        entry, rec = loader_entry(text, compress), records[stem]
        assert same_bits(rec.fields["latent"], latent)
        layers = entry["reasoner_memory_state"]["layer_kv"]
        assert set(rec.fields) == {"latent", "text_input_ids", "text_text_indexes", "text_text_mrope_ids", "text_layer_kv_k",
                                   "text_layer_kv_v"} | ({"text_layer_kv_k_for_gen"} if k_for_gen else set())
        for key in ("input_ids", "text_indexes", "text_mrope_ids"):
            assert same_bits(rec.fields[f"text_{key}"], entry[key]), key
        assert rec.info["text_layer_kv_names"] == list(layers[0]) and rec.fields["text_layer_kv_k"].shape[0] == len(layers) == 2
        for i, layer in enumerate(layers):  # layer i's tensors, stacked
            for name, value in layer.items():
                assert same_bits(rec.fields[f"text_layer_kv_{name}"][i], value), (i, name)
        assert rec.info["text_und_len"] == int(entry["und_len"].item())
        assert rec.info["text_cache_signature"] == entry["cache_signature"] and rec.info["text_reasoner_component"] == NANO
        assert_same(cosmos3.reasoner_cache(rec.fields, rec.info), entry)  # the loader's dict, rebuilt exactly
        # cosmos3/model.py _predict_single_sample refuses a cache whose signature is not the sample's geometry's
        _, t, h, w = latent.shape
        assert entry["cache_signature"] == cosmos3.signature(caption, t, 16 * h, 16 * w, 24.0, NANO)
    assert open_source(cache, "simpletuner", images=images).skipped == []


@pytest.mark.parametrize("caption,frames,height,width,fps,component,expected", [
    ("a photo of thing 0", 1, 64, 96, 24.0, NANO, "03644916b2ec7c2ae7b21074bb09d32b8b1a8efe90c784e7e036fca7d4b78745"),
    ("a robot drummer", 3, 64, 80, 24.0, "SimpleTuner/cosmos3-component-reasoning-layers-bf16-super",
     "3f5b185f5eda6baacdaa48cd472bbf4bdaabf631b7a3fda6f113ad1de551d67b"),
    ('{"style_medium": "oil painting"}  ', 1, 512, 512, 30.0, "my/reasoner",
     "4efd64eff6a4e6ca7f7c3349883fadb423b965cb5dd5d5a06f9e3935a44ec295"),
])
def test_the_signature_is_simpletuners(caption, frames, height, width, fps, component, expected):
    """Values of SimpleTuner bc8e6ab's own ``Cosmos3Image._cosmos3_text_cache_signature`` (with
    ``Cosmos3OmniPipeline._build_generation_json_prompt``) for an image, a video and a JSON-object caption;
    latentfast's re-implementation was also compared with it on 3000 random captions and geometries."""
    assert cosmos3.signature(caption, frames, height, width, fps, component) == expected


def test_the_generation_prompt_is_the_image_or_the_video_template():
    image = cosmos3.generation_prompt("a  cat\n", num_frames=1, fps=24.0, height=32, width=64)
    assert image.startswith('{"subjects":[{"description":"a cat","appearance_details":"a cat",')
    assert image.endswith('"comprehensive_t2i_caption":"a cat","resolution":{"H":32,"W":64},"aspect_ratio":"16,9"}')
    video = cosmos3.generation_prompt("東京", num_frames=49, fps=24.0, height=48, width=48)
    assert '"actions":[{"time":"0:00-0:02","description":"東京"}]' in video  # not escaped (ensure_ascii=False)
    assert video.endswith('"aspect_ratio":"1,1","duration":"2s","fps":24}')


def test_a_framerate_or_reasoner_component_other_than_the_default_is_asked_for(tmp_path):
    cache, images = str(tmp_path / "cache"), str(tmp_path / "images")
    write_simpletuner_cosmos3(cache, images, n=2, framerate=30.0, reasoner_component="me/my-reasoner")
    with pytest.raises(TrainerCacheError, match=r"none of its 2 cosmos3 reasoner caches .*stored cache_signature [0-9a-f]{64} "
                                                 r"is no item's .*pass reasoner_component= or framerate="):
        open_source(cache, "simpletuner", images=images)
    with pytest.raises(TrainerCacheError, match="pass reasoner_component="):
        open_source(cache, "simpletuner", images=images, framerate=30)
    out = str(tmp_path / "out")
    assert cache_cli(["cache", "import", cache, "--out", out, "--format", "simpletuner", "--images", images, "--framerate",
                      "30", "--reasoner-component", "me/my-reasoner", "--require", "text", "--quiet"]) == 0
    assert "text_input_ids" in LatentCache(out).fields  # (--require text: every item has it)
    source = open_source(cache, "simpletuner", images=images, framerate=30, reasoner_component="me/my-reasoner")
    theirs = simpletuner_files(cache, images, True, framerate=30.0, component="me/my-reasoner")
    for rec in source:
        assert_same(cosmos3.reasoner_cache(rec.fields, rec.info), loader_entry(theirs[rec.key][2], True))
        assert rec.info["text_reasoner_component"] == "me/my-reasoner"


def test_cosmos3_options_on_another_models_cache_are_refused(tmp_path):
    write_simpletuner(str(tmp_path / "cache"), str(tmp_path / "images"), n=1, model_type="flux")
    with pytest.raises(TrainerCacheError, match=r"framerate= name cosmos3's text files; its text embeddings are flux's"):
        open_source(tmp_path / "cache", "simpletuner", images=str(tmp_path / "images"), framerate=30)


def test_each_auto_reasoner_component_is_tried(tmp_path):
    cache, images = str(tmp_path / "cache"), str(tmp_path / "images")
    super_t2i = "SimpleTuner/cosmos3-component-reasoning-layers-bf16-super-t2i"
    write_simpletuner_cosmos3(cache, images, n=2, reasoner_component=super_t2i)
    assert [r.info["text_reasoner_component"] for r in open_source(cache, "simpletuner", images=images)] == [super_t2i] * 2


def test_a_dataset_id_other_than_the_folders_is_asked_for_by_the_stored_signature(tmp_path):
    cache, images = tmp_path / "cache", str(tmp_path / "images")
    write_simpletuner_cosmos3(str(cache), images, n=2, dataset_id="edits", compress=False)
    shutil.move(cache / "vae" / "cosmos3" / "edits", cache / "vae" / "cosmos3" / "elsewhere")  # a cache_dir_vae of its own
    with pytest.raises(TrainerCacheError, match=r"stored cache_signature is item '(sub/)?img_00[01]''s .*pass dataset_id="):
        open_source(cache, "simpletuner", images=images)
    assert all("text_input_ids" in r.fields for r in open_source(cache, "simpletuner", images=images, dataset_id="edits"))


def test_a_text_file_whose_signature_is_no_items_is_listed_as_skipped(tmp_path):
    cache, images = str(tmp_path / "cache"), str(tmp_path / "images")
    write_simpletuner_cosmos3(cache, images, n=2)
    stray = os.path.join(cache, "text", "cosmos3", "0123456789abcdef0123456789abcdef-cosmos3.pt")
    simpletuner_torch_save({"cosmos3_reasoner_cache": cosmos3_reasoner_cache(torch.Generator(), 4, 2, "f" * 64)}, stray, True)
    source = open_source(cache, "simpletuner", images=images)
    assert [s.path for s in source.skipped] == [stray] and "cosmos3 reasoner caches whose names are no item's" in source.summary()
    assert all("text_input_ids" in r.fields for r in source)


def test_a_file_holding_another_items_signature_is_refused_naming_it(tmp_path):
    """A file renamed (or rewritten) under an item's name: its stored signature is not the one the name is made of."""
    cache, images = str(tmp_path / "cache"), str(tmp_path / "images")
    write_simpletuner_cosmos3(cache, images, n=2)
    theirs = {key: text for key, (_, _, text) in simpletuner_files(cache, images, True).items()}
    shutil.copy(theirs["sub/img_001"], theirs["img_000"])
    with pytest.raises(TrainerCacheError, match=rf"{theirs['img_000']}: expected the cosmos3 cache_signature its name is "
                                                r"made of \([0-9a-f]{64}, reasoner component .*nano\), found [0-9a-f]{64}"):
        list(open_source(cache, "simpletuner", images=images))


def test_a_missing_text_file_keeps_the_item_without_it_and_require_refuses_it(tmp_path):
    cache, images = str(tmp_path / "cache"), str(tmp_path / "images")
    write_simpletuner_cosmos3(cache, images, n=3)
    missing = simpletuner_files(cache, images, True)["sub/img_001"][2]
    os.remove(missing)  # its caption was never encoded
    stats = {}
    import_latents(cache, tmp_path / "out", format="simpletuner", images=images, quiet=True, stats=stats)
    ((key, field, where),) = stats["lacking"]
    assert (key, field) == ("sub/img_001", "text_*") and os.path.basename(missing) in where
    assert "for 1 frames at 48x64, framerate 24.0" in where  # (height x width)
    out = LatentCache(tmp_path / "out")
    assert out.fields["text_input_ids"]["present"].tolist() == [k != "sub/img_001" for k in out.keys]
    assert "text_input_ids" not in out.record(out.keys.index("sub/img_001"))
    with pytest.raises(TrainerCacheError, match=rf"sub/img_001: no text \(no cosmos3 reasoner cache {os.path.basename(missing)}"):
        import_latents(cache, tmp_path / "strict", format="simpletuner", images=images, quiet=True, require="text")


def test_a_payload_other_than_encode_prompts_is_refused_naming_the_entry(tmp_path):
    cache, images = str(tmp_path / "cache"), str(tmp_path / "images")
    write_simpletuner_cosmos3(cache, images, n=1, compress=False)
    (path,) = [os.path.join(d, n) for d, _, names in os.walk(os.path.join(cache, "text")) for n in names]
    payload = torch.load(path, weights_only=True)
    entry = payload["cosmos3_reasoner_cache"]
    simpletuner_torch_save({"cosmos3_reasoner_cache": {**entry, "extra": 1}}, path, False)
    with pytest.raises(TrainerCacheError, match=rf"{path}: expected .*cosmos3/model.py _encode_prompts.*'extra'"):
        list(open_source(cache, "simpletuner", images=images))
    simpletuner_torch_save({"cosmos3_reasoner_cache": {**entry, "und_len": entry["und_len"].int()}}, path, False)
    with pytest.raises(TrainerCacheError, match=rf"{path}#und_len: expected a 0-d torch.int64 tensor, found a torch.int32"):
        list(open_source(cache, "simpletuner", images=images))
    k = entry["reasoner_memory_state"]["layer_kv"][0]["k"]
    for layer_1, found in [("not a layer", "a str"), ({"k": k[:-1]}, r"k: a torch.bfloat16 tensor of shape \[4, 2, 4\]")]:
        layers = {"layer_kv": [{"k": k}, layer_1]}
        simpletuner_torch_save({"cosmos3_reasoner_cache": {**entry, "reasoner_memory_state": layers}}, path, False)
        with pytest.raises(TrainerCacheError, match=rf"{path}#reasoner_memory_state.layer_kv\[1\]: expected .*found {found}"):
            list(open_source(cache, "simpletuner", images=images))


def test_without_images_the_items_are_kept_and_images_is_asked_for(tmp_path):
    cache, images = str(tmp_path / "cache"), str(tmp_path / "images")
    write_simpletuner_cosmos3(cache, images, n=2)
    source = open_source(cache, "simpletuner")
    assert len(source) == 2 and len(source.skipped) == 2
    assert [where for _, where in source.lacks("text")] == [f"cosmos3 reasoner cache (caption or image unknown: pass "
                                                            f"images=) under {os.path.abspath(cache)}"] * 2
