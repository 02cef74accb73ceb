"""import_latents and `latentfast cache import` on files the test writes with numpy (kohya .npz),
safetensors (musubi-tuner / ai-toolkit) and torch.save (SimpleTuner .pt)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from latentfast.cache import LatentCache, cache_path, read_batch
from latentfast.cache.cli import main as cache_cli
from latentfast.cache.builders.importers import import_latents
from latentfast.errors import CacheError, InvalidArgumentError, NonFiniteError


def latents(n=7, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((4, 6, 5 + i % 3)).astype(np.float32) for i in range(n)]


def names(n):
    return [f"img_{(3 * i) % n:02d}" for i in range(n)]  # written out of order: the import sorts


def write_npz(folder, zs):
    os.makedirs(folder, exist_ok=True)
    for name, z in zip(names(len(zs)), zs):
        np.savez(os.path.join(folder, name + ".npz"), latents=z, original_size=np.array([48, 40]),
                 crop_ltrb=np.array([0, 1, 0, 1]), latents_flipped=z[:, :, ::-1])


def write_safetensors(folder, zs, dtype=torch.bfloat16):
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    for name, z in zip(names(len(zs)), zs):
        t = torch.from_numpy(z).unsqueeze(1).to(dtype)  # musubi-tuner: [C, F, H, W] named by size and dtype
        save_file({f"latents_1x{z.shape[1]}x{z.shape[2]}_{str(dtype)[6:]}": t}, os.path.join(folder, name + ".safetensors"))


def write_pt(folder, zs, as_dict=True):
    os.makedirs(os.path.join(folder, "nested"), exist_ok=True)
    for k, (name, z) in enumerate(zip(names(len(zs)), zs)):
        path = os.path.join(folder, "nested" if k == 0 else "", name + ".pt")
        torch.save({"latents": torch.from_numpy(z), "step": torch.tensor(3)} if as_dict else torch.from_numpy(z), path)


def expected(zs):
    by_name = dict(zip(names(len(zs)), zs))
    return {name: z for name, z in sorted(by_name.items())}


def test_npz(tmp_path):
    pytest.importorskip("numpy")
    zs = latents()
    write_npz(str(tmp_path / "src"), zs)
    stats = {}
    import_latents(str(tmp_path / "src"), str(tmp_path / "out"), format="npz", quiet=True, stats=stats)
    cache = LatentCache(str(tmp_path / "out"))
    want = expected(zs)
    assert cache.keys == list(want) and stats["imported"] == 7
    for i, z in enumerate(want.values()):
        assert cache[i].dtype == torch.float16 and np.array_equal(cache[i].numpy(), z.astype(np.float16))
    assert cache.info(0) == {"original_size": [48, 40], "crop_ltrb": [0, 1, 0, 1]}  # small arrays kept as info
    flipped = str(tmp_path / "flipped")
    import_latents(str(tmp_path / "src"), flipped, format="npz", key="latents_flipped", quiet=True)
    assert np.array_equal(LatentCache(flipped)[0].numpy(), list(want.values())[0][:, :, ::-1].astype(np.float16))
    stats = {}
    import_latents(str(tmp_path / "src"), str(tmp_path / "out"), format="npz", quiet=True, stats=stats)
    assert stats["unchanged"]  # a rerun over the same files writes nothing


def test_safetensors_bf16_musubi_layout(tmp_path):
    pytest.importorskip("safetensors")
    zs = latents(seed=1)
    write_safetensors(str(tmp_path / "src"), zs)
    import_latents(str(tmp_path / "src"), str(tmp_path / "out"), format="safetensors", quiet=True)
    cache = LatentCache(str(tmp_path / "out"))
    want = expected(zs)
    assert cache.keys == list(want) and cache.meta["ndim"] == 4
    for i, z in enumerate(want.values()):
        bf16 = torch.from_numpy(z).to(torch.bfloat16).float().half()  # what the file holds, as float16
        assert torch.equal(cache[i], bf16.unsqueeze(1))
    same = [i for i in range(len(cache)) if cache.shapes[i].tolist() == cache.shapes[0].tolist()]
    batch, shapes = read_batch(cache, same)
    assert tuple(batch.shape) == (len(same), *cache.shapes[0].tolist())


@pytest.mark.parametrize("as_dict", [True, False])
def test_pt_tensor_or_dict_recursive(tmp_path, as_dict):
    zs = latents(seed=2)
    write_pt(str(tmp_path / "src"), zs, as_dict=as_dict)
    import_latents(str(tmp_path / "src"), str(tmp_path / "out"), format="pt", quiet=True)
    cache = LatentCache(str(tmp_path / "out"))
    first = names(7)[0]
    assert f"nested/{first}" in cache.keys and len(cache) == 7
    k = cache.keys.index(f"nested/{first}")
    assert np.array_equal(cache[k].numpy(), zs[0].astype(np.float16))


def test_resume_and_edits(tmp_path):
    zs = latents(seed=3)
    write_npz(str(tmp_path / "src"), zs)
    out = str(tmp_path / "out")
    import_latents(str(tmp_path / "src"), out, format="npz", quiet=True)
    zs[0] = zs[0] + 1
    write_npz(str(tmp_path / "src"), zs)  # rewritten files: the cache follows
    stats = {}
    import_latents(str(tmp_path / "src"), out, format="npz", quiet=True, stats=stats)
    assert not stats["unchanged"]
    cache = LatentCache(out)
    assert np.array_equal(cache[cache.keys.index(names(7)[0])].numpy(), zs[0].astype(np.float16))


def test_other_files_are_listed_bf16_npz_bits_are_read_and_a_truncated_pt_is_named(tmp_path):
    src = tmp_path / "src"
    write_npz(str(src), latents(n=2))
    write_safetensors(str(tmp_path / "st"), latents(n=1))
    os.replace(tmp_path / "st" / "img_00.safetensors", src / "other.safetensors")
    bits = torch.full((4, 1, 2), 2.5, dtype=torch.bfloat16)
    np.savez(src / "bf16.npz", latents=bits.view(torch.int16).numpy().view("V2"))
    stats = {}
    import_latents(str(src), str(tmp_path / "out"), format="npz", quiet=True, stats=stats)
    assert stats["summary"] == "npz: 3 files; skipped 1 files not .npz" and stats["skipped"][0][0].endswith("other.safetensors")
    cache = LatentCache(tmp_path / "out")
    assert cache[cache.index("bf16")].tolist() == [[[2.5, 2.5]]] * 4
    torch.save(torch.zeros(4, 2, 2), tmp_path / "x.pt")
    os.makedirs(tmp_path / "pt")
    (tmp_path / "pt" / "x.pt").write_bytes((tmp_path / "x.pt").read_bytes()[:300])
    with pytest.raises(CacheError, match=r"cannot read pt latents from .*x\.pt: .*truncated"):
        import_latents(str(tmp_path / "pt"), str(tmp_path / "out2"), format="pt", quiet=True)


def test_import_errors(tmp_path):
    src = tmp_path / "src"
    os.makedirs(src)
    with pytest.raises(InvalidArgumentError, match="no .npz files"):
        import_latents(str(src), str(tmp_path / "out"), format="npz")
    with pytest.raises(InvalidArgumentError, match="format must be one of"):
        import_latents(str(src), str(tmp_path / "out"), format="h5")
    np.savez(src / "a.npz", first=np.zeros((4, 2, 2)), second=np.zeros((4, 2, 2)))
    with pytest.raises(InvalidArgumentError, match=r"holds \['first', 'second'\]; pass key="):
        import_latents(str(src), str(tmp_path / "out"), format="npz")
    with pytest.raises(InvalidArgumentError, match="has no entry 'latents'"):
        import_latents(str(src), str(tmp_path / "out"), format="npz", key="latents")
    np.savez(src / "a.npz", latents=np.full((4, 2, 2), 1e6, np.float32))
    with pytest.raises(NonFiniteError, match="key 'a'"):
        import_latents(str(src), str(tmp_path / "out"), format="npz")
    (src / "a.npz").write_bytes(b"garbage")
    with pytest.raises(CacheError, match="cannot read npz latents from .*a.npz"):
        import_latents(str(src), str(tmp_path / "out"), format="npz")


def test_cli_import(tmp_path, capsys):
    write_npz(str(tmp_path / "src"), latents())
    out = str(tmp_path / "out")
    assert cache_cli(["cache", "import", str(tmp_path / "src"), "--out", out, "--format", "npz"]) == 0
    assert f"latent cache written: {cache_path(out, 'train', 'data')} (7 files imported" in capsys.readouterr().out
    assert cache_cli(["cache", "import", str(tmp_path / "src"), "--out", out, "--format", "npz"]) == 0
    assert f"up to date: 7 unchanged ({cache_path(out, 'train', 'data')})" in capsys.readouterr().out
    assert cache_cli(["cache", "import", str(tmp_path / "nowhere"), "--out", out, "--format", "pt"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a folder" in err


# ---- trainer caches (format="kohya", ...): every field of every item is compared with the trainer's own
# loaders in tests/test_trainers_*.py (via records_via(..., "import" / "auto")); here: what the import adds
from latentfast.cache.trainers import TrainerCacheError  # noqa: E402
from latentfast.cache.trainers import fixtures as fx  # noqa: E402
from latentfast.errors import IncompleteCacheError  # noqa: E402


def test_trainer_import_stamps_format_convention_and_keeps_dtypes(tmp_path):
    fx.write_musubi(tmp_path / "src", kind="wan_i2v", n=3)
    stats = {}
    import_latents(tmp_path / "src", tmp_path / "out", format="auto", quiet=True, stats=stats)
    cache = LatentCache(tmp_path / "out")
    assert cache.meta["import_format"] == "musubi-tuner" and cache.meta["kind"] == "import"
    assert cache.meta["latent_convention"]["latent_convention"] == cache.info(0)["latent_convention"]
    assert stats["evidence"].startswith("detected musubi-tuner: ") and stats["imported"] == len(cache) == 3
    assert cache.dtype == torch.bfloat16  # Wan latents are bf16 in musubi-tuner: kept, not narrowed
    assert cache.keys == ["img_000", "img_001", "img_002"]  # the image stems, suffixes removed
    batch = cache.read_batch([2], fields=("latent", "latent_image", "text_t5"))
    assert batch["latent"].dtype == torch.bfloat16 and fx.same_bits(batch["latent"][0], cache[2])


def test_skipped_files_are_one_summary_line_and_the_cli_prints_the_evidence(tmp_path, capsys):
    fx.write_kohya(tmp_path / "src", arch="sdxl", n=3)
    np.savez(tmp_path / "src" / "orphan_te_outputs.npz", hidden_state1=np.zeros(3, np.float32))
    (tmp_path / "src" / "notes.txt").write_text("x")
    out = str(tmp_path / "out")
    assert cache_cli(["cache", "import", str(tmp_path / "src"), "--out", out, "--format", "auto"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "detected kohya: 7 kohya cache files such as img_000_0067x0048_sdxl.npz; 3 .npz latent files (sdxl)"
    assert lines[1] == ("kohya: 3 items; skipped 2 files: 1 files that are not kohya .npz caches, "
                        "1 text-encoder outputs without a latent file")
    assert lines[2] == f"latent cache written: {cache_path(out, 'train', 'data')} (3 items imported, 0 resumed)"
    assert cache_cli(["cache", "import", str(tmp_path / "src"), "--out", out, "--format", "kohya"]) == 0
    assert "up to date: 3 unchanged" in capsys.readouterr().out
    assert LatentCache(out).meta["import_format"] == "kohya"


def test_a_failed_import_says_to_rerun_the_import_and_the_rerun_finishes_it(tmp_path):
    fx.write_kohya(tmp_path / "src", arch="flux", n=3, buckets=1)
    te = tmp_path / "src" / "img_002_flux_te.npz"
    kept = te.read_bytes()
    np.savez(te, **{**np.load(te), "l_pooled": np.zeros(12, np.complex64)})  # the last item fails when it is read
    with pytest.raises(TrainerCacheError, match=r"img_002_flux_te.npz#l_pooled: expected a numeric array, found dtype <c8"):
        import_latents(tmp_path / "src", tmp_path / "out", format="kohya", quiet=True)
    with pytest.raises(IncompleteCacheError, match="Re-run the same `latentfast cache import` command to resume it"):
        LatentCache(tmp_path / "out")
    te.write_bytes(kept)
    stats = {}
    import_latents(tmp_path / "src", tmp_path / "out", format="kohya", quiet=True, stats=stats)
    assert stats["resumed"] == 2 and stats["imported"] == 1
    assert LatentCache(tmp_path / "out").keys == ["img_000", "img_001", "img_002"]


def test_an_item_changed_after_an_interrupted_import_is_written_again(tmp_path):
    fx.write_kohya(tmp_path / "src", arch="flux", n=3, buckets=1, text=False)
    out = tmp_path / "out"
    import_latents(tmp_path / "src", out, format="kohya", quiet=True)
    stats = {}
    import_latents(tmp_path / "src", out, format="kohya", quiet=True, stats=stats)
    assert stats["unchanged"]
    path = next((tmp_path / "src").glob("img_001_*.npz"))
    arrays = dict(np.load(path))
    arrays["latents_8x16"] = arrays["latents_8x16"] + 1
    np.savez(path, **arrays)
    import_latents(tmp_path / "src", out, format="kohya", quiet=True, stats=stats)
    assert not stats["unchanged"] and stats["imported"] == 3
    assert fx.same_bits(LatentCache(out)[1], torch.from_numpy(arrays["latents_8x16"]))


def _kohya_and_simpletuner_of_the_same_latents(tmp_path, scale, shift):
    """The same VAE latents z as kohya caches them (raw, sd3) and as SimpleTuner does (scaled:
    ``scale_vae_latents_for_cache``, ``(z - shift) * scale`` on the VAE's float32 output)."""
    g = torch.Generator().manual_seed(5)
    zs = [torch.randn(16, 4, 6, generator=g) * 2 for _ in range(3)]
    os.makedirs(tmp_path / "kohya")
    for i, z in enumerate(zs):
        fx.kohya_save_latents_to_disk(str(tmp_path / "kohya" / f"img_{i}_0048x0032_sd3.npz"), z, (48, 32), (0, 0, 48, 32),
                                      key_reso_suffix="_4x6")
        fx.simpletuner_torch_save((z - shift) * scale, str(tmp_path / "st" / "vae" / f"img_{i}.pt"), compress=True)
    return zs


def test_scaled_converts_kohya_raw_latents_to_simpletuners_scaled_bit_for_bit(tmp_path):
    scale, shift = 1.5305, 0.0609  # the SD3 VAE config (kohya's sd3 cache is raw: process_in runs at train time)
    zs = _kohya_and_simpletuner_of_the_same_latents(tmp_path, scale, shift)
    import_latents(tmp_path / "kohya", tmp_path / "k_scaled", format="kohya", scaled=True, quiet=True)
    import_latents(tmp_path / "st", tmp_path / "st_kept", format="simpletuner", scaling_factor=scale, shift_factor=shift, quiet=True)
    import_latents(tmp_path / "st", tmp_path / "st_raw", format="simpletuner", scaled=False, scaling_factor=scale,
                   shift_factor=shift, quiet=True)
    assert cache_cli(["cache", "import", str(tmp_path / "st"), "--out", str(tmp_path / "st_raw_cli"), "--format", "simpletuner",
                      "--convention", "raw", "--scaling-factor", str(scale), "--shift-factor", str(shift), "--quiet"]) == 0
    k_scaled, st_kept, st_raw = (LatentCache(tmp_path / n) for n in ("k_scaled", "st_kept", "st_raw"))
    assert LatentCache(tmp_path / "st_raw_cli").meta["latent_convention"] == st_raw.meta["latent_convention"]
    assert all(fx.same_bits(LatentCache(tmp_path / "st_raw_cli")[i], st_raw[i]) for i in range(len(zs)))
    for i, z in enumerate(zs):
        assert fx.same_bits(k_scaled[i], st_kept[i]) and fx.same_bits(k_scaled[i], (z - shift) * scale)
        assert fx.same_bits(k_scaled.record(i)["latent"], (z - shift) * scale)
        assert fx.same_bits(st_raw[i], ((z - shift) * scale) / scale + shift)
    assert k_scaled.meta["latent_convention"] == {"latent_convention": "scaled", "scaling_factor": scale, "shift_factor": shift,
                                                  "converted_from": "raw"}
    assert st_kept.meta["latent_convention"] == {"latent_convention": "scaled", "scaling_factor": scale, "shift_factor": shift}
    assert st_raw.meta["latent_convention"]["latent_convention"] == "raw" == st_raw.info(0)["latent_convention"]
    assert k_scaled.info(0)["converted_from"] == "raw"


def test_scaled_needs_factors_that_agree_and_vae_latents(tmp_path):
    _kohya_and_simpletuner_of_the_same_latents(tmp_path, 1.0, 0.0)
    with pytest.raises(InvalidArgumentError, match=r"scaled=False converts scaled latents, which needs the VAE config's scaling_factor: pass scaling_factor="):
        import_latents(tmp_path / "st", tmp_path / "o1", format="simpletuner", scaled=False, quiet=True)
    with pytest.raises(InvalidArgumentError, match=r"scaling_factor disagrees: passed 2\.0, the trainer's files 1\.5305"):
        import_latents(tmp_path / "kohya", tmp_path / "o2", format="kohya", scaled=True, scaling_factor=2.0, quiet=True)
    vae = {"normalization": {"scaling_factor": 1.5305, "shift_factor": 0.0609}}  # an encoder's identity: the same factors
    import_latents(tmp_path / "kohya", tmp_path / "o3", format="kohya", scaled=True, encoder=vae, quiet=True)
    assert LatentCache(tmp_path / "o3").meta["encoder"] == vae
    wan = {"normalization": {"scaling_factor": 1.0, "latents_mean": [0.0] * 16, "latents_std": [1.0] * 16}}
    with pytest.raises(InvalidArgumentError, match="per-channel latents_mean / latents_std"):
        import_latents(tmp_path / "kohya", tmp_path / "o8", format="kohya", scaled=True, encoder=wan, quiet=True)
    fx.write_ai_toolkit(tmp_path / "ai", n=1, resolutions=(64,), uint8=True)
    with pytest.raises(InvalidArgumentError, match=r"its latents are 'pixels' \(neither scaled nor raw VAE latents\)"):
        import_latents(tmp_path / "ai", tmp_path / "o4", format="ai-toolkit", scaled=True, scaling_factor=1.0, quiet=True)
    with pytest.raises(InvalidArgumentError, match=r"format 'npz' takes no trainer options"):
        import_latents(tmp_path / "kohya", tmp_path / "o5", format="npz", scaled=True)
    with pytest.raises(InvalidArgumentError, match=r"key= applies to the extension formats"):
        import_latents(tmp_path / "kohya", tmp_path / "o6", format="kohya", key="latents")
    with pytest.raises(TrainerCacheError, match="expected one trainer's cache to detect"):
        import_latents(tmp_path, tmp_path / "o7", format="auto")


@pytest.mark.parametrize("format", ["npz", "safetensors", "pt"])
def test_an_item_over_max_item_bytes_is_refused_before_it_is_read(tmp_path, format):
    src = tmp_path / "src"
    {"npz": write_npz, "safetensors": write_safetensors, "pt": write_pt}[format](src, latents(7))
    with pytest.raises(InvalidArgumentError, match=rf"img_\d+\.{format}: its item takes \d+ bytes .* max_item_bytes=100"):
        import_latents(str(src), str(tmp_path / "out"), format=format, max_item_bytes=100)
    assert not os.path.exists(cache_path(str(tmp_path / "out"), "train", "meta"))
    import_latents(str(src), str(tmp_path / "ok"), format=format, max_item_bytes=1 << 20)
    assert len(LatentCache(str(tmp_path / "ok"))) == 7


def test_a_compressed_npz_is_judged_by_its_inflated_arrays(tmp_path):
    src = tmp_path / "src"
    os.makedirs(src)
    np.savez_compressed(src / "a.npz", latents=np.zeros((4, 64, 64), np.float32))  # 64 KiB of zeros: tiny on disk
    assert os.path.getsize(src / "a.npz") < 10_000
    with pytest.raises(InvalidArgumentError, match="max_item_bytes=10000"):
        import_latents(str(src), str(tmp_path / "out"), format="npz", max_item_bytes=10_000)
