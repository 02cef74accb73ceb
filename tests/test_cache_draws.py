"""Read-time draws from a latent cache: ``read_batch(sample=True)`` (latent distributions stored by
``DiffusersVAE(sample="store")``) and ``read_batch(flip=p)`` (mirror latents stored by
``build_image_cache(flip=True)``): the reference formula, the same draw for an item whatever the batch,
the DataLoader workers (fork and spawn) or a resume mid-epoch, and the errors."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from latentfast import sampling
from latentfast.cache import DevicePrefetcher, LatentCache, LatentCacheWriter, verify_cache
from latentfast.cache.builders.images import build_image_cache
from latentfast.cache.feed.loader import CacheBatchDataset
from latentfast.errors import InvalidArgumentError, NonFiniteError
from latentfast.toy import ToyVAE

BUCKETS = [(32, 32), (32, 48)]


def write_distributions(folder, n=10, seed=0):
    """Records of a latent mean and std (float16, shapes [4, 3, 5]) and a mirror pair, as the builder writes them."""
    gen = torch.Generator().manual_seed(seed)
    records = []
    with LatentCacheWriter(folder) as writer:
        for i in range(n):
            record = {"latent": torch.randn((4, 3, 5), generator=gen).half(),
                      "latent_std": torch.rand((4, 3, 5), generator=gen).half(),
                      "latent_flipped": torch.randn((4, 3, 5), generator=gen).half(),
                      "latent_flipped_std": torch.rand((4, 3, 5), generator=gen).half()}
            writer.append(f"item{i}", record)
            records.append(record)
    return records


def expected(records, keys, indices, seed, epoch, flipped=None):
    """``mean + std * eps`` by the reference, item by item (each alone: a batch of one)."""
    rows = []
    for b, i in enumerate(indices):
        pick = "latent_flipped" if flipped is not None and flipped[b] else "latent"
        seeds = sampling.item_seeds([keys[i]], seed, epoch)
        rows.append(sampling.sample_latents_reference(records[i][pick][None], records[i][pick + "_std"][None], seeds)[0])
    return torch.stack(rows)


def test_sample_is_the_reference_formula_and_the_same_in_any_batch(tmp_path):
    records = write_distributions(tmp_path)
    cache = LatentCache(tmp_path)
    keys = cache.keys
    batch = cache.read_batch([3, 1, 7], sample=True, seed=5, epoch=2)
    assert sorted(batch) == ["latent", "latent_shape"]
    torch.testing.assert_close(batch["latent"], expected(records, keys, [3, 1, 7], 5, 2), rtol=0, atol=2e-3)
    other = cache.read_batch([7, 9, 3, 3, 0], sample=True, seed=5, epoch=2)["latent"]
    assert torch.equal(other[0], batch["latent"][2]) and torch.equal(other[2], batch["latent"][0])
    assert torch.equal(other[2], other[3])
    mean = cache.read_batch([3, 1, 7], fields="latent")["latent"]
    assert not torch.equal(batch["latent"], mean)  # a draw, not the mean
    assert not torch.equal(cache.read_batch([3], sample=True, seed=5, epoch=3)["latent"][0], batch["latent"][0])
    assert not torch.equal(cache.read_batch([3], sample=True, seed=6, epoch=2)["latent"][0], batch["latent"][0])
    wide = cache.read_batch([3, 1, 7], sample=True, seed=5, epoch=2, dtype=torch.float32, fields=("latent", "latent_std"))
    assert wide["latent"].dtype == torch.float32 and torch.equal(wide["latent_std"][0], records[3]["latent_std"])
    torch.testing.assert_close(wide["latent"], expected(records, keys, [3, 1, 7], 5, 2).float(), rtol=0, atol=2e-3)


def test_one_sample_latents_call_per_batch(tmp_path, monkeypatch):
    from latentfast import ops

    write_distributions(tmp_path)
    calls = []
    real = ops.sample_latents
    monkeypatch.setattr(ops, "sample_latents", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    LatentCache(tmp_path).read_batch(list(range(10)), sample=True, seed=0, flip=0.5)
    assert calls == [torch.Size([10, 4, 3, 5])]


def test_flip_picks_per_item_from_the_item_seed(tmp_path):
    records = write_distributions(tmp_path, n=40)
    cache = LatentCache(tmp_path)
    batch = cache.read_batch(list(range(40)), flip=0.5, seed=1, epoch=0)
    flipped = batch["flipped"]
    assert flipped.dtype == torch.bool and flipped.shape == (40,) and 5 < int(flipped.sum()) < 35
    want = sampling.flip_draws(sampling.item_seeds(cache.keys, 1, 0), 0.5)
    assert torch.equal(flipped, want)
    for i in range(40):
        assert torch.equal(batch["latent"][i], records[i]["latent_flipped" if flipped[i] else "latent"])
    again = cache.read_batch([9, 2, 9], flip=0.5, seed=1, epoch=0)
    assert torch.equal(again["flipped"], flipped[[9, 2, 9]]) and torch.equal(again["latent"], batch["latent"][[9, 2, 9]])
    assert not torch.equal(cache.read_batch(list(range(40)), flip=0.5, seed=1, epoch=1)["flipped"], flipped)
    assert not cache.read_batch(list(range(40)), flip=0.0, seed=1)["flipped"].any()
    assert cache.read_batch(list(range(40)), flip=1.0, seed=1)["flipped"].all()
    both = cache.read_batch(list(range(40)), flip=0.5, sample=True, seed=1, epoch=0)
    assert torch.equal(both["flipped"], flipped)
    torch.testing.assert_close(both["latent"], expected(records, cache.keys, range(40), 1, 0, flipped), rtol=0, atol=2e-3)


def test_errors_name_what_is_missing(tmp_path):
    with LatentCacheWriter(tmp_path / "plain") as writer:
        writer.append("a", torch.zeros(4, 3, 5))
    plain = LatentCache(tmp_path / "plain")
    with pytest.raises(InvalidArgumentError, match=r"sample=True needs the field 'latent_std'.*sample='store'"):
        plain.read_batch([0], sample=True, seed=0)
    with pytest.raises(InvalidArgumentError, match=r"flip= needs the field 'latent_flipped'.*flip=True"):
        plain.read_batch([0], flip=0.5, seed=0)
    write_distributions(tmp_path / "d")
    cache = LatentCache(tmp_path / "d")
    with pytest.raises(InvalidArgumentError, match="need seed="):
        cache.read_batch([0], sample=True)
    with pytest.raises(InvalidArgumentError, match=r"flip must be a probability in \[0, 1\], got 1.5"):
        cache.read_batch([0], flip=1.5, seed=0)
    with pytest.raises(InvalidArgumentError, match="fields must include 'latent'"):
        cache.read_batch([0], sample=True, seed=0, fields=("latent_std",))
    with pytest.raises(InvalidArgumentError, match="epoch must be >= 0"):
        cache.read_batch([0], sample=True, seed=0, epoch=-1)


def test_a_padded_line_batch_is_refused_not_drawn_over_its_padding(tmp_path):
    with LatentCacheWriter(tmp_path) as writer:
        for i, w in enumerate((5, 7)):
            writer.append(f"k{i}", {"latent": torch.zeros(4, 3, w).half(), "latent_std": torch.ones(4, 3, w).half()})
    cache = LatentCache(tmp_path)
    with pytest.raises(InvalidArgumentError, match="one shape"):
        cache.read_batch([0, 1], sample=True, seed=0, pad={"latent_std": 0.0}, fields=("latent", "latent_std"))
    with pytest.raises(InvalidArgumentError, match="2 shapes"):
        cache.read_batch([0, 1], sample=True, seed=0)


def draws(loader):
    out = {}
    for batch in loader:
        for b, i in enumerate(batch["index"].tolist()):
            out[i] = (batch["latent"][b].clone(), bool(batch["flipped"][b]))
    return out


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_draws_are_the_same_with_any_workers_and_after_a_resume(tmp_path, context):
    write_distributions(tmp_path, n=12)
    cache = LatentCache(tmp_path)
    dataset = CacheBatchDataset(cache, fields=("latent",), sample=True, flip=0.5, seed=3, epoch=1)
    batches = [[0, 1, 2], [5, 3], [11, 7, 8, 4], [6, 9, 10]]
    alone = draws(DataLoader(dataset, batch_size=None, sampler=batches))
    workers = draws(DevicePrefetcher(DataLoader(dataset, batch_size=None, sampler=batches, num_workers=2,
                                                multiprocessing_context=context), "cpu"))
    regrouped = draws(DataLoader(dataset, batch_size=None, sampler=[[4, 10, 2, 6], [1, 0, 3, 5, 7, 8, 9, 11]]))
    resumed = draws(DataLoader(dataset, batch_size=None, sampler=batches[2:]))  # a run resumed at the third batch
    for other in (workers, regrouped, resumed):
        for i, (z, f) in other.items():
            assert f == alone[i][1] and torch.equal(z, alone[i][0]), i
    dataset.set_epoch(2)
    assert any(not torch.equal(z, alone[i][0]) for i, (z, _) in draws(DataLoader(dataset, batch_size=None, sampler=batches)).items())


# -- built from real images ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("imgs"))
    rng = np.random.default_rng(0)
    for i, (w, h) in enumerate([(64, 48), (40, 40), (70, 50), (33, 31), (48, 64)]):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(os.path.join(folder, f"im{i}.png"))
    return folder


def test_flip_build_encodes_each_image_and_its_mirror(images, tmp_path):
    from test_cache_images import by_hand

    vae = ToyVAE()
    build_image_cache(vae, images, tmp_path, buckets=BUCKETS, batch_size=2, quiet=True, flip=True)
    cache = LatentCache(tmp_path)
    assert sorted(cache.fields) == ["latent", "latent_flipped"] and cache.meta["flip"] is True
    for i, key in enumerate(cache.keys):
        bucket = cache.info(i)["bucket"]
        pixels = by_hand(os.path.join(images, key + ".png"), bucket)[0]
        record = cache.record(i)
        torch.testing.assert_close(record["latent"].float(), vae.encode(pixels[None])[0], rtol=0, atol=2e-3)
        torch.testing.assert_close(record["latent_flipped"].float(), vae.encode(pixels.flip(-1)[None])[0], rtol=0, atol=2e-3)
        assert not torch.equal(record["latent"], record["latent_flipped"])
    same_shape = [i for i in range(len(cache)) if cache.shapes[i].tolist() == cache.shapes[0].tolist()]
    batch = cache.read_batch(same_shape, flip=0.5, seed=0)
    for b, i in enumerate(same_shape):
        assert torch.equal(batch["latent"][b], cache.record(i)["latent_flipped" if batch["flipped"][b] else "latent"])
    assert verify_cache(tmp_path)["rows"] == 5


def test_a_store_vae_build_samples_its_posterior(images, tmp_path):
    pytest.importorskip("diffusers")
    from test_cache_images import by_hand
    from test_encoders import tiny_kl

    from latentfast.encoders import DiffusersVAE

    vae = DiffusersVAE(tiny_kl(), sample="store")
    build_image_cache(vae, images, tmp_path, buckets=[(16, 16)], batch_size=2, quiet=True, flip=True)
    cache = LatentCache(tmp_path, expected={"encoder": vae.identity()})
    assert sorted(cache.fields) == ["latent", "latent_flipped", "latent_flipped_std", "latent_std"]
    i = cache.keys.index("im1")
    pixels = by_hand(os.path.join(images, "im1.png"), (16, 16))[0][None]
    mean, std = vae.encode(pixels, with_std=True)
    dist = vae.vae.encode(pixels).latent_dist
    scale = vae.vae.config.scaling_factor
    torch.testing.assert_close(mean, dist.mean * scale)
    torch.testing.assert_close(std, dist.std * scale)
    torch.testing.assert_close(cache.record(i)["latent_std"].float(), std[0], rtol=2e-3, atol=2e-3)
    batch = cache.read_batch([i, 0], sample=True, seed=4, epoch=0)
    want = sampling.sample_latents_reference(cache.record(i)["latent"][None], cache.record(i)["latent_std"][None],
                                             sampling.item_seeds(["im1"], 4, 0))[0]
    torch.testing.assert_close(batch["latent"][0], want, rtol=0, atol=2e-3)
    with pytest.raises(InvalidArgumentError, match="sample='store'"):
        DiffusersVAE(tiny_kl()).encode(pixels, with_std=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_draws_on_the_device_equal_the_host_draws(tmp_path):
    records = write_distributions(tmp_path, n=12)
    cache = LatentCache(tmp_path)
    order = [11, 3, 0, 7, 7]
    host = cache.read_batch(order, sample=True, flip=0.5, seed=2, epoch=1)
    device = cache.read_batch(order, sample=True, flip=0.5, seed=2, epoch=1, device="cuda")
    assert device["latent"].is_cuda and torch.equal(device["flipped"], host["flipped"])
    torch.testing.assert_close(device["latent"].cpu(), host["latent"], rtol=0, atol=2e-3)
    torch.testing.assert_close(host["latent"], expected(records, cache.keys, order, 2, 1, host["flipped"]), rtol=0, atol=2e-3)


def test_a_store_video_vae_build_keeps_the_normalized_std(tmp_path):
    pytest.importorskip("diffusers")
    from test_cache_images import make_clips
    from test_encoders import tiny_wan

    from latentfast.cache.builders.images import build_video_cache
    from latentfast.encoders import DiffusersVAE

    make_clips(str(tmp_path / "clips"))
    vae = DiffusersVAE(tiny_wan(), sample="store")
    build_video_cache(vae, str(tmp_path / "clips"), str(tmp_path / "out"), buckets=[(5, 16, 16)], quiet=True)
    cache = LatentCache(tmp_path / "out")
    assert sorted(cache.fields) == ["latent", "latent_std"] and cache.meta["latent_std"] is True
    clip = torch.rand(1, 3, 5, 16, 24) * 2 - 1
    mean, std = vae.encode_video(clip, with_std=True)
    dist = vae.vae.encode(clip).latent_dist
    shape = (1, -1, 1, 1, 1)
    latents_mean, latents_std = (torch.tensor(vae.vae.config[k]).view(shape) for k in ("latents_mean", "latents_std"))
    torch.testing.assert_close(mean, (dist.mean - latents_mean) / latents_std)  # Wan: (z - mean) / std, scale 1
    torch.testing.assert_close(std, dist.std / latents_std)
    i = cache.keys.index("clip0")
    assert cache.record(i)["latent_std"].shape == cache.record(i)["latent"].shape and (cache.record(i)["latent_std"] > 0).all()
    drawn = cache.read_batch([i], sample=True, seed=0)["latent"][0]
    assert drawn.shape == cache[i].shape and not torch.equal(drawn, cache[i])


class LoudVAE(ToyVAE):
    """ToyVAE's latents times 1e5: beyond float16's range (65504), as bf16-native latents can be."""

    def encode(self, x, **kwargs):
        return super().encode(x, **kwargs) * 1e5

    def identity(self) -> dict:
        return {**super().identity(), "scale": 1e5}


@pytest.mark.parametrize("flip", [False, True])
def test_latent_dtype_stores_bf16_latents_float16_cannot_hold(images, tmp_path, flip):
    from test_cache_images import by_hand

    vae = LoudVAE()
    with pytest.raises(NonFiniteError, match="beyond (float16.s range|\+-65504)"):
        build_image_cache(vae, images, tmp_path / "f16", buckets=BUCKETS, batch_size=2, quiet=True, flip=flip)
    build_image_cache(vae, images, tmp_path / "bf16", buckets=BUCKETS, batch_size=2, quiet=True, flip=flip,
                      latent_dtype="bfloat16")
    cache = LatentCache(tmp_path / "bf16")
    assert cache.dtype == torch.bfloat16 and cache.meta["latent_dtype"] == "bfloat16"
    for i, key in enumerate(cache.keys):
        pixels = by_hand(os.path.join(images, key + ".png"), cache.info(i)["bucket"])[0]
        want = vae.encode(pixels[None])[0]
        assert want.abs().max() > 65504  # the point: float16 could not hold these
        record = cache.record(i)
        assert record["latent"].dtype == torch.bfloat16 and torch.equal(cache[i], record["latent"])
        torch.testing.assert_close(record["latent"].float(), want, rtol=1e-2, atol=0)
        if flip:
            assert record["latent_flipped"].dtype == torch.bfloat16
    same_shape = [i for i in range(len(cache)) if cache.shapes[i].tolist() == cache.shapes[0].tolist()]
    batch = cache.read_batch(same_shape, fields=("latent",))
    assert batch["latent"].dtype == torch.bfloat16
    assert torch.equal(batch["latent"], torch.stack([cache[i] for i in same_shape]))
    assert verify_cache(tmp_path / "bf16")["rows"] == 5


def test_a_rebuild_with_another_latent_dtype_re_encodes(images, tmp_path):
    vae = ToyVAE()
    build_image_cache(vae, images, tmp_path, buckets=BUCKETS, batch_size=2, quiet=True)
    assert LatentCache(tmp_path).dtype == torch.float16
    stats = {}
    build_image_cache(vae, images, tmp_path, buckets=BUCKETS, batch_size=2, quiet=True, latent_dtype=torch.float32,
                      stats=stats)
    cache = LatentCache(tmp_path)
    assert cache.dtype == torch.float32 and stats["encoded"] == 5
    with pytest.raises(InvalidArgumentError, match="latent_dtype must be one of"):
        build_image_cache(vae, images, tmp_path, buckets=BUCKETS, quiet=True, latent_dtype="int8")
