"""``export_cache`` / ``latentfast cache export``: a trainer's cache folder (written as its save code writes
it) imported, exported back, and read by the trainer's own loaders (re-implemented in test_trainers_kohya /
test_trainers_musubi, as written there) equals what those loaders read from the original folder, bit for
bit; what a format cannot hold is refused, naming the field."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from test_trainers_kohya import ARCHES, load_latents_from_disk, load_outputs_npz, trainer_items
from test_trainers_musubi import get_batch, prepare_for_training

from latentfast.cache.builders.importers import import_latents
from latentfast.cache.export import export_cache
from latentfast.cache.trainers.fixtures import KOHYA_TE_SUFFIX, MUSUBI_ARCH, same_bits, write_kohya, write_musubi
from latentfast.cli import main
from latentfast.errors import InvalidArgumentError


def round_trip(tmp_path, fmt, write, **import_options):
    src, cache, out = tmp_path / "src", tmp_path / "cache", tmp_path / "out"
    write(src)
    import_latents(src, cache, format=fmt, quiet=True, **import_options)
    export_cache(cache, out, fmt)
    return src, out


def same(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and same_bits(torch.from_numpy(a), torch.from_numpy(b))
    return a == b


@pytest.mark.parametrize("arch", ARCHES)
def test_kohya_round_trip_reads_the_same_in_kohyas_loaders(tmp_path, arch):
    src, out = round_trip(tmp_path, "kohya", lambda d: write_kohya(d, arch=arch, n=3, buckets=2))
    original, exported = list(trainer_items(src, arch)), list(trainer_items(out, arch))
    assert [(stem, bucket, hw) for stem, _, _, bucket, hw in exported] == [(s, b, h) for s, _, _, b, h in original]
    assert sorted(os.listdir(out)) == sorted(os.listdir(src))  # the same file names, text files included
    for (stem, path, stride, bucket, _), (_, new_path, _, _, _) in zip(original, exported):
        for a, b in zip(load_latents_from_disk(stride, path, bucket), load_latents_from_disk(stride, new_path, bucket)):
            assert same(a, b), (stem, bucket)
        want = load_outputs_npz(arch, os.path.join(src, stem + KOHYA_TE_SUFFIX[arch]))
        got = load_outputs_npz(arch, os.path.join(out, stem + KOHYA_TE_SUFFIX[arch]))
        # every array of the text file (flux's and sd3's apply_*_attn_mask flags are read by other code than load_outputs_npz)
        assert sorted(np.load(os.path.join(out, stem + KOHYA_TE_SUFFIX[arch])).files) == sorted(
            np.load(os.path.join(src, stem + KOHYA_TE_SUFFIX[arch])).files)
        for name in want:
            if want[name].ndim == 0:  # a scalar: kohya reads its value (.item())
                assert got[name].item() == want[name].item(), name
            else:
                assert same(got[name], want[name]), (stem, name)


def test_kohya_mixed_flip_and_without_text(tmp_path):
    src, out = round_trip(tmp_path, "kohya", lambda d: write_kohya(d, arch="sdxl", n=2, flip=False, alpha=False, text=False))
    assert sorted(os.listdir(out)) == sorted(os.listdir(src))
    for (_, path, stride, bucket, _), (_, new, _, _, _) in zip(trainer_items(src, "sdxl"), trainer_items(out, "sdxl")):
        a, b = load_latents_from_disk(stride, path, bucket), load_latents_from_disk(stride, new, bucket)
        assert all(same(x, y) for x, y in zip(a, b)) and b[3] is None and b[4] is None


def test_bf16_cannot_go_into_an_npz(tmp_path):
    bits = torch.randn(4, 3, 5).to(torch.bfloat16)
    (tmp_path / "src").mkdir()
    np.savez(tmp_path / "src" / "img_0040x0024_sdxl.npz", latents=bits.view(torch.int16).numpy().view("V2"),
             original_size=np.array([40, 24]), crop_ltrb=np.array([0, 0, 40, 24]))
    import_latents(tmp_path / "src", tmp_path / "cache", format="kohya", quiet=True)
    with pytest.raises(InvalidArgumentError, match=r"record 'img': field 'latent' is bfloat16, which an .npz cannot hold"):
        export_cache(tmp_path / "cache", tmp_path / "out", "kohya")
    assert not (tmp_path / "out").exists()  # checked before anything is written


@pytest.mark.parametrize("kind", sorted(MUSUBI_ARCH))
def test_musubi_round_trip_gives_the_same_batches(tmp_path, kind):
    src, out = round_trip(tmp_path, "musubi-tuner", lambda d: write_musubi(d, kind=kind, n=3, windows=2))
    arch, arch_full = MUSUBI_ARCH[kind]
    video = kind == "hunyuan_video"
    original, exported = prepare_for_training(src, arch, video), prepare_for_training(out, arch, video)
    assert [(k, w) for k, _, _, w in exported] == [(k, w) for k, _, _, w in original] and len(original) == (6 if video else 3)
    assert sorted(os.listdir(out)) == sorted(os.listdir(src))
    from safetensors import safe_open

    for (_, latent, te, _), (_, new_latent, new_te, _) in zip(original, exported):
        (want, want_te), (got, got_te) = get_batch(latent, te), get_batch(new_latent, new_te)
        assert sorted(got) == sorted(want) and got_te == want_te
        for name, value in want.items():
            assert isinstance(got[name], list) == isinstance(value, list), name  # varlen stays a list
            assert all(same_bits(g, w) for g, w in zip(got[name], value)), name
        for old, new in ((latent, new_latent), (te, new_te)):
            with safe_open(old, "pt") as a, safe_open(new, "pt") as b:
                assert a.metadata() == b.metadata()


def test_a_latentfast_built_cache_is_refused_naming_what_is_missing(tmp_path):
    from test_cache import build, make_lines

    build(make_lines(tmp_path / "lines", 2), tmp_path / "cache")
    with pytest.raises(InvalidArgumentError, match=r"has no \['arch', 'original_size', 'crop_ltrb'\] in its info"):
        export_cache(tmp_path / "cache", tmp_path / "out", "kohya")
    with pytest.raises(InvalidArgumentError, match="format must be one of"):
        export_cache(tmp_path / "cache", tmp_path / "out", "onetrainer")


def test_cli_export(tmp_path, capsys):
    write_kohya(tmp_path / "src", arch="flux", n=2)
    import_latents(tmp_path / "src", tmp_path / "cache", format="kohya", quiet=True)
    assert main(["cache", "export", str(tmp_path / "cache"), "--format", "kohya", "--out", str(tmp_path / "out")]) == 0
    assert "4 items exported as kohya: 4 files" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "out")) == sorted(os.listdir(tmp_path / "src"))
