"""musubi-tuner cache directories read as records == what musubi-tuner's own dataset code returns, bit for bit."""
import glob
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from latentfast.cache.trainers import open_source
from latentfast.cache.trainers.fixtures import MUSUBI_ARCH, records_via, same_bits, write_musubi


def remove_dtype_suffix(name):
    """src/musubi_tuner/utils/model_utils.py ``remove_dtype_suffix`` (with ``_known_dtype_strs``)."""
    names = sorted({str(getattr(torch, a)).split(".")[-1] for a in dir(torch) if isinstance(getattr(torch, a), torch.dtype)},
                   key=len, reverse=True)
    for dtype_str in names:
        if name.endswith("_" + dtype_str):
            return name[: -len("_" + dtype_str)]
    return name


def prepare_for_training(cache_directory, architecture, video):
    """ImageDataset / VideoDataset ``prepare_for_training`` (dataset/image_video_dataset.py): (item_key, latent, te)."""
    items = []
    for cache_file in sorted(glob.glob(os.path.join(cache_directory, f"*_{architecture}.safetensors"))):
        tokens = os.path.basename(cache_file).split("_")
        if video:
            frame_pos, frame_count = tokens[-3].split("-")[:2]
            item_key = "_".join(tokens[:-3])
        else:
            item_key = "_".join(tokens[:-2])
        te = os.path.join(cache_directory, f"{item_key}_{architecture}_te.safetensors")
        if not os.path.exists(te):
            continue
        items.append((item_key, cache_file, te, tokens[-3] if video else None))
    return items


def get_batch(latent_cache_path, text_encoder_output_cache_path):
    """dataset/bucket.py ``BucketBatchManager.__getitem__`` for a batch of one item."""
    batch_tensor_data, varlen_keys = {}, set()
    sd_latent = load_file(latent_cache_path)
    sd_te = load_file(text_encoder_output_cache_path)
    sd = {**sd_latent, **sd_te}
    for key in sd.keys():
        is_varlen_key = key.startswith("varlen_")
        content_key = batch_key(key)
        batch_tensor_data.setdefault(content_key, []).append(sd[key])
        if is_varlen_key:
            varlen_keys.add(content_key)
    for key in batch_tensor_data.keys():
        if key not in varlen_keys:
            batch_tensor_data[key] = torch.stack(batch_tensor_data[key])
    return batch_tensor_data, {batch_key(k) for k in sd_te}


def batch_key(key):
    """The content key ``__getitem__`` files a tensor under."""
    content_key = key
    if key.startswith("varlen_"):
        content_key = content_key.replace("varlen_", "")
    if content_key.endswith("_mask"):
        pass
    else:
        content_key = remove_dtype_suffix(content_key)
        if content_key.startswith("latents_"):
            content_key = content_key.rsplit("_", 1)[0]
    return content_key


@pytest.mark.parametrize("kind,via", [(k, v) for k in sorted(MUSUBI_ARCH) for v in ("reader", "import")] + [("wan_i2v", "auto")])
def test_every_field_matches_musubis_batches(tmp_path, kind, via):
    """Read by the reader, or imported (format="musubi-tuner" / "auto") and read back from the cache."""
    folder = tmp_path / "src"
    write_musubi(folder, kind=kind, n=3, windows=2)
    arch, arch_full = MUSUBI_ARCH[kind]
    video = kind == "hunyuan_video"
    records = records_via(folder, "musubi-tuner", via, tmp_path / "out")
    expected = set()
    for item_key, latent_path, te_path, window in prepare_for_training(folder, arch, video):
        key = f"{item_key}@{window}" if video else item_key
        expected.add(key)
        rec = records[key]
        batch, te_keys = get_batch(latent_path, te_path)
        fields = dict(rec.fields)
        for content_key, value in batch.items():
            one = value[0]  # a batch of one (stacked, or a varlen list): its only item
            name = f"text_{content_key}" if content_key in te_keys else (
                "latent" + content_key[len("latents"):] if content_key.startswith("latents") else content_key)
            assert same_bits(fields.pop(name), one), name
        assert fields == {}  # every record field is one the trainer batches
        with safe_open(latent_path, "pt") as fh:
            meta = fh.metadata()
        assert rec.info["architecture"] == meta["architecture"] == arch_full
        assert (rec.info["width"], rec.info["height"]) == (int(meta["width"]), int(meta["height"]))
        assert rec.info["format_version"] == "1.0.1"
        if video:
            assert rec.info["frame_count"] == 17 and rec.info["frame_pos"] == int(window.split("-")[0])
    assert set(records) == expected


def test_i2v_framepack_and_control_fields_are_named_for_the_trainer(tmp_path):
    write_musubi(tmp_path / "wan", kind="wan_i2v", n=1)
    write_musubi(tmp_path / "fp", kind="framepack", n=1)
    write_musubi(tmp_path / "qi", kind="qwen_image_edit", n=1)
    (wan,), (fp,), (qi,) = (list(open_source(tmp_path / k, "musubi-tuner")) for k in ("wan", "fp", "qi"))
    assert set(wan.fields) == {"latent", "latent_image", "clip", "text_t5"}
    assert wan.fields["latent"].dtype == torch.bfloat16
    assert {"latent_clean", "latent_clean_2x", "latent_clean_4x", "latent_indices", "clean_latent_indices",
            "image_embeddings", "text_llama_vec", "text_llama_attention_mask", "text_clip_l_pooler"} <= set(fp.fields)
    assert fp.fields["latent_indices"].dtype == torch.int64
    assert {"latent_control_0", "latent_control_1", "text_vl_embed"} <= set(qi.fields)
    assert qi.info["caption"] == "caption 0"


def test_latents_without_text_are_skipped_as_the_trainer_does(tmp_path):
    write_musubi(tmp_path, kind="wan_i2v", n=3)
    os.remove(tmp_path / "img_001_wan_te.safetensors")
    save_file({"varlen_t5_bfloat16": torch.zeros(2, 3, dtype=torch.bfloat16)}, str(tmp_path / "lonely_wan_te.safetensors"),
              metadata={"architecture": "wan", "caption1": "", "format_version": "1.0.1"})
    source = open_source(tmp_path, "musubi-tuner")
    assert [r.key for r in source] == ["img_000", "img_002"]
    summary = source.summary()
    assert "1 latent files without their text-encoder file" in summary
    assert "1 text-encoder files without a latent file" in summary


def test_several_architectures_need_architecture(tmp_path):
    write_musubi(tmp_path, kind="wan_i2v", n=1)
    write_musubi(tmp_path, kind="framepack", n=1)
    with pytest.raises(ValueError, match=r"several architectures \['fp', 'wan'\]; pass architecture="):
        open_source(tmp_path, "musubi-tuner")
    assert len(list(open_source(tmp_path, "musubi-tuner", architecture="fp"))) == 1


def test_truncated_safetensors_names_the_file(tmp_path):
    write_musubi(tmp_path, kind="wan_i2v", n=1)
    path = str(tmp_path / "img_000_0096x0080_wan.safetensors")
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-10])
    with pytest.raises(ValueError, match=r"img_000_0096x0080_wan\.safetensors: expected \d+ bytes .*truncated file"):
        open_source(tmp_path, "musubi-tuner")
