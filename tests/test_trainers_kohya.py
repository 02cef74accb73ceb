"""kohya sd-scripts caches read as records == what sd-scripts' own loaders return, bit for bit."""
import glob
import os
import re

import numpy as np
import pytest
import torch

from latentfast.cache.trainers import kohya, open_source
from latentfast.cache.trainers.fixtures import KOHYA_TE_SUFFIX, records_via, same_bits, write_kohya

ARCHES = ["sd", "sdxl", "legacy", "flux", "sd3", "lumina", "hi", "anima"]
STRIDE = {"hi": 32}  # each strategy's latents_stride (8 elsewhere); None = no resolution suffix (sd, sdxl, legacy)


def load_latents_from_disk(latents_stride, npz_path, bucket_reso):
    """library/strategy_base.py ``LatentsCachingStrategy._default_load_latents_from_disk``, as written."""
    if latents_stride is None:
        key_reso_suffix = ""
    else:
        latents_size = (bucket_reso[1] // latents_stride, bucket_reso[0] // latents_stride)
        key_reso_suffix = f"_{latents_size[0]}x{latents_size[1]}"
    npz = np.load(npz_path)
    latents = npz["latents" + key_reso_suffix]
    original_size = npz["original_size" + key_reso_suffix].tolist()
    crop_ltrb = npz["crop_ltrb" + key_reso_suffix].tolist()
    flipped_latents = npz["latents_flipped" + key_reso_suffix] if "latents_flipped" + key_reso_suffix in npz else None
    alpha_mask = npz["alpha_mask" + key_reso_suffix] if "alpha_mask" + key_reso_suffix in npz else None
    return latents, original_size, crop_ltrb, flipped_latents, alpha_mask


# each strategy's load_outputs_npz reads these names, in this order (strategy_{sdxl,flux,sd3,lumina,hunyuan_image,anima}.py)
OUTPUT_NAMES = {
    "sdxl": ["hidden_state1", "hidden_state2", "pool2"],
    "flux": ["l_pooled", "t5_out", "txt_ids", "t5_attn_mask"],
    "sd3": ["lg_out", "t5_out", "lg_pooled", "clip_l_attn_mask", "clip_g_attn_mask", "t5_attn_mask"],
    "lumina": ["hidden_state", "input_ids", "attention_mask"],
    "hi": ["vlm_embed", "vlm_mask", "byt5_embed", "byt5_mask", "ocr_mask"],
    "anima": ["prompt_embeds", "attn_mask", "t5_input_ids", "t5_attn_mask", "caption_dropout_rate"],
}


def load_outputs_npz(arch, npz_path):
    data = np.load(npz_path)
    return {name: data[name] for name in OUTPUT_NAMES.get(arch, OUTPUT_NAMES["sdxl"])}


def trainer_items(folder, arch):
    """(stem, npz path, bucket_reso) for every bucket the trainer would load, as its dataset finds them."""
    multi = arch in kohya.MULTI_RESOLUTION
    stride = STRIDE.get(arch, 8)
    for path in sorted(glob.glob(os.path.join(folder, "*.npz"))):
        name = os.path.basename(path)
        if any(name.endswith(s) for s in set(KOHYA_TE_SUFFIX.values())):
            continue
        stem = name[:-4] if arch == "legacy" else kohya.LATENT_NAME.match(name)["stem"]
        keys = np.load(path).files
        sizes = [tuple(map(int, m.groups())) for k in keys if (m := re.fullmatch(r"latents_(\d+)x(\d+)", k))] if multi else [None]
        for hw in sizes:
            bucket = (hw[1] * stride, hw[0] * stride) if hw else None
            yield stem, path, (stride if multi else None), bucket, hw


@pytest.mark.parametrize("arch,via", [(a, "reader") for a in ARCHES] + [(a, "import") for a in ARCHES] + [("flux", "auto")])
def test_every_field_matches_kohyas_loaders(tmp_path, arch, via):
    """Read by the reader, or imported (format="kohya" / "auto") and read back from the cache."""
    folder = tmp_path / "src"
    write_kohya(folder, arch=arch, n=3, buckets=2)
    records = records_via(folder, "kohya", via, tmp_path / "out")
    expected_keys = set()
    for stem, path, stride, bucket, hw in trainer_items(folder, arch):
        key = f"{stem}@{hw[0]}x{hw[1]}" if hw else stem
        expected_keys.add(key)
        rec = records[key]
        latents, original_size, crop_ltrb, flipped, alpha = load_latents_from_disk(stride, path, bucket)
        assert same_bits(rec.fields["latent"], torch.from_numpy(latents))
        assert same_bits(rec.fields["latent_flipped"], torch.from_numpy(flipped))
        assert same_bits(rec.fields["alpha_mask"], torch.from_numpy(alpha))
        assert rec.info["original_size"] == original_size and rec.info["crop_ltrb"] == crop_ltrb
        outputs = load_outputs_npz(arch, os.path.join(folder, stem + KOHYA_TE_SUFFIX[arch]))
        for name, array in outputs.items():
            if array.ndim == 0:
                assert rec.info[f"text_{name}"] == array.item()
            else:
                assert same_bits(rec.fields[f"text_{name}"], torch.from_numpy(array)), name
        text_fields = {k for k in rec.fields if k.startswith("text_")}
        te = np.load(os.path.join(folder, stem + KOHYA_TE_SUFFIX[arch]))
        assert text_fields == {f"text_{n}" for n in te.files if te[n].ndim}  # nothing more, nothing less
        assert set(rec.fields) - text_fields == {"latent", "latent_flipped", "alpha_mask"}
        assert rec.info["latent_convention"] == kohya.CONVENTION[arch][0]
    assert set(records) == expected_keys
    assert open_source(folder, "kohya").skipped == []


def test_multi_resolution_items_keep_their_bucket_and_arrays(tmp_path):
    write_kohya(tmp_path, arch="flux", n=2, buckets=3)
    records = list(open_source(tmp_path, "kohya"))
    assert [r.key for r in records] == ["img_000@8x8", "img_000@16x16", "img_000@24x24",
                                        "img_001@8x16", "img_001@16x24", "img_001@24x32"]
    assert [r.info["latent_hw"] for r in records[:3]] == [[8, 8], [16, 16], [24, 24]]
    assert [r.info["crop_ltrb"] for r in records[:3]] == [[0, 0, 64, 64], [0, 0, 128, 128], [0, 0, 192, 192]]
    assert all(r.info["image_size"] == [67, 48] for r in records[:3])


def test_single_bucket_key_is_the_bare_stem(tmp_path):
    write_kohya(tmp_path, arch="flux", n=2, buckets=1, flip=False, alpha=False, text=False)
    source = open_source(tmp_path, "kohya")
    records = list(source)
    assert [r.key for r in records] == ["img_000", "img_001"]
    assert set(records[0].fields) == {"latent"}
    assert "2 items have no text-encoder outputs" in source.summary()


def test_bf16_bits_in_an_npz_are_read_as_bfloat16(tmp_path):
    bits = torch.randn(4, 3, 5).to(torch.bfloat16)
    bits[0, 0, 0] = 1e-9  # a value float16 would flush to zero
    np.savez(tmp_path / "img_0040x0024_sdxl.npz", latents=bits.view(torch.int16).numpy().view("V2"),
             original_size=np.array([40, 24]), crop_ltrb=np.array([0, 0, 40, 24]))
    assert np.load(tmp_path / "img_0040x0024_sdxl.npz")["latents"].dtype.str == "|V2"
    (record,) = open_source(tmp_path, "kohya")
    assert same_bits(record.fields["latent"], bits)


def test_text_files_without_latents_and_stray_files_are_listed(tmp_path):
    write_kohya(tmp_path, arch="sdxl", n=2)
    np.savez(tmp_path / "orphan_te_outputs.npz", hidden_state1=np.zeros(3, np.float32))
    (tmp_path / "notes.txt").write_text("x")
    np.savez(tmp_path / "img_000_0067x0048_flux.npz", latents_8x8=np.zeros((4, 8, 8), np.float32),
             original_size_8x8=np.array([1, 1]), crop_ltrb_8x8=np.array([0, 0, 1, 1]))
    with pytest.raises(ValueError, match=r"several architectures \['flux', 'sdxl'\]; pass arch="):
        open_source(tmp_path, "kohya")
    source = open_source(tmp_path, "kohya", arch="sdxl")
    assert len(list(source)) == 2
    summary = source.summary()
    assert "skipped 3 files" in summary and "1 text-encoder outputs without a latent file" in summary
    assert "1 files that are not kohya .npz caches" in summary and "architecture 'flux' (pass arch='flux')" in summary


def test_unknown_arrays_are_listed_not_dropped(tmp_path):
    np.savez(tmp_path / "img_0016x0016_sdxl.npz", latents=np.ones((4, 2, 2), np.float32), original_size=np.array([16, 16]),
             crop_ltrb=np.array([0, 0, 16, 16]), extra=np.zeros(2))
    source = open_source(tmp_path, "kohya")
    assert len(list(source)) == 1
    assert source.skipped[0].path.endswith("img_0016x0016_sdxl.npz#extra")


def test_truncated_npz_names_the_file(tmp_path):
    write_kohya(tmp_path, arch="sdxl", n=1, text=False)
    (path,) = glob.glob(str(tmp_path / "*.npz"))
    data = open(path, "rb").read()
    open(path, "wb").write(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"img_000_0067x0048_sdxl\.npz: expected an \.npz .*truncated file"):
        open_source(tmp_path, "kohya")


def test_legacy_npz_beside_sdxl_files_is_read_with_them_and_wins(tmp_path):
    write_kohya(tmp_path, arch="sdxl", n=2, text=False)
    legacy = tmp_path / "img_001.npz"  # kohya's get_latents_npz_path returns this one when it exists
    np.savez(legacy, latents=np.full((4, 2, 2), 7, np.float32), original_size=np.array([16, 16]), crop_ltrb=np.array([0, 0, 16, 16]))
    np.savez(tmp_path / "old_only.npz", latents=np.ones((4, 2, 2), np.float32), original_size=np.array([16, 16]),
             crop_ltrb=np.array([0, 0, 16, 16]))
    source = open_source(tmp_path, "kohya")
    records = {r.key: r for r in source}
    assert sorted(records) == ["img_000", "img_001", "old_only"]
    assert same_bits(records["img_001"].fields["latent"], torch.full((4, 2, 2), 7.0))
    assert "1 latent files superseded by a legacy {stem}.npz" in source.summary()
