"""import_latents and `latentfast cache import` on files the test writes with numpy (kohya .npz),
safetensors (musubi-tuner / ai-toolkit) and torch.save (SimpleTuner .pt)."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from latentfast.cache import LatentCache, cache_path, read_batch
from latentfast.cache.cli import main as cache_cli
from latentfast.cache.build.importers import import_latents
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
    assert "(unchanged)" in capsys.readouterr().out
    assert cache_cli(["cache", "import", str(tmp_path / "nowhere"), "--out", out, "--format", "pt"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a folder" in err
