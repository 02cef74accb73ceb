"""Latents stored in their own dtype (float16, bfloat16, float32): written as given, read back bit for bit."""
import numpy as np
import pytest
import torch

from latentfast.cache import LatentCache, LatentCacheWriter
from latentfast.cache.store import format as fmt
from latentfast.cache import inspect_cache, verify_cache
from latentfast.cache.trainers.fixtures import same_bits
from latentfast.errors import CacheCorruptError, InvalidArgumentError, NonFiniteError

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SHAPES = [(4, 3, 5), (4, 3, 5), (4, 2, 7), (4, 3, 5), (4, 2, 7)]


def _latents(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = [(torch.randn(*s, generator=g) * 3).to(dtype) for s in SHAPES]
    if dtype != torch.float16:  # values float16 cannot hold: 1e-9 flushes to zero, 1e5 overflows
        out[0][0, 0, 0], out[0][1, 2, 4] = 1e-9, 1e5
    out[1][0, 0, :] = torch.tensor([-0.0, 0.0, 2.0 ** -14, -(2.0 ** -24), 65504.0]).to(dtype)  # signed zero, subnormals
    return out


def _write(tmp_path, dtype, **kwargs):
    latents = _latents(dtype)
    texts = [torch.randn(2 + i, 3).to(torch.bfloat16) for i in range(len(latents))]
    with LatentCacheWriter(tmp_path, "train", **kwargs) as writer:
        for i, (z, t) in enumerate(zip(latents, texts)):
            writer.append(f"k{i}", {"latent": z, "text": t}, info={"i": i})
    return latents, texts


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_read_path_returns_the_stored_dtype_bit_for_bit(tmp_path, dtype):
    latents, texts = _write(tmp_path, dtype)
    cache = LatentCache(tmp_path)
    name = str(dtype).removeprefix("torch.")
    assert cache.dtype == dtype and cache.meta["dtype"] == name and cache.fields["latent"]["dtype"] == dtype
    for i, z in enumerate(latents):
        assert same_bits(cache[i], z) and same_bits(cache.record(i)["latent"], z)
        assert same_bits(cache.record(i)["text"], texts[i])
    same_shape = [0, 1, 3]
    for cold in (False, True):
        batch, shapes = cache.read_batch(same_shape, cold=cold)
        assert batch.dtype == dtype and same_bits(batch, torch.stack([latents[i] for i in same_shape]))
        assert shapes.tolist() == [list(SHAPES[i]) for i in same_shape]
    as_f32, _ = cache.read_batch([2, 4], dtype=torch.float32)
    assert same_bits(as_f32, torch.stack([latents[2], latents[4]]).float())
    out = torch.full((2, *SHAPES[2]), float("nan"), dtype=torch.float32)
    assert cache.read_batch([4, 2], dtype=torch.float32, out=out)[0].data_ptr() == out.data_ptr()
    assert same_bits(out, torch.stack([latents[4], latents[2]]).float())
    records = cache.read_batch([2, 4], fields=("latent", "text"), pad={"text": 0.0})
    assert same_bits(records["latent"], torch.stack([latents[2], latents[4]]))
    assert same_bits(records["text"][0, :4], texts[2]) and same_bits(records["text"][1], texts[4])
    checked = LatentCache(tmp_path, verify_rows=True)
    assert same_bits(checked.read_batch([1, 0])[0], torch.stack([latents[1], latents[0]])) and same_bits(checked[2], latents[2])
    report = verify_cache(tmp_path)
    assert report["bytes"] == sum(z.numel() * z.element_size() for z in latents)
    assert inspect_cache(tmp_path)["fields"]["latent"]["dtype"] == name
    with pytest.raises(InvalidArgumentError, match="one shape"):
        cache.read_batch([0, 2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_damaged_item_of_any_dtype_is_found(tmp_path, dtype):
    latents, _ = _write(tmp_path, dtype)
    path = fmt.cache_path(tmp_path, "train", "data")
    start = sum(z.numel() * z.element_size() for z in latents[:3])
    with open(path, "r+b") as fh:  # one byte of item 3
        fh.seek(start + 5)
        byte = fh.read(1)
        fh.seek(start + 5)
        fh.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(CacheCorruptError, match=r"block 3 \(rows 3\.\.3\) fails its CRC-32"):
        verify_cache(tmp_path)
    with pytest.raises(CacheCorruptError, match="block 3"):
        LatentCache(tmp_path, verify_rows=True)[3]


@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_values_are_found_in_each_dtype(tmp_path, dtype):
    for bad in (float("inf"), float("-inf"), float("nan")):
        z = torch.zeros(2, 3, 4, dtype=dtype)
        z[1, 2, 1] = bad
        writer = LatentCacheWriter(tmp_path / "w", "train", restart=True)
        with pytest.raises(NonFiniteError, match=f"key 'k'.*not finite.*{str(dtype).removeprefix('torch.')}"):
            writer.append("k", {"latent": z})
        assert len(writer) == 0
        writer.close()
        units = fmt.LATENT_DTYPES[str(dtype).removeprefix("torch.")] // 2
        flat = z.reshape(-1)
        raw = (flat.view(torch.int16) if dtype != torch.float32 else flat.view(torch.int32)).numpy().view(np.float16)
        assert fmt.first_nonfinite(raw, dtype=str(dtype).removeprefix("torch.")) == (4 * 3 + 2 * 4 + 1) * units
    big = torch.zeros(8, dtype=dtype)
    big[3] = 1e30 if dtype == torch.float32 else 60000.0  # large but finite in this dtype
    raw = (big.view(torch.int16) if dtype != torch.float32 else big.view(torch.int32)).numpy().view(np.float16)
    assert fmt.first_nonfinite(raw, dtype=str(dtype).removeprefix("torch.")) == -1


def test_dtypes_are_fixed_by_the_first_record_and_never_cast(tmp_path):
    with LatentCacheWriter(tmp_path, "train") as writer:
        writer.append("a", {"latent": torch.zeros(2, 2, 2, dtype=torch.bfloat16)})
        with pytest.raises(InvalidArgumentError, match=r"key 'b' is float32, but this cache's latents are bfloat16 \(first item 'a'\); no silent cast"):
            writer.append("b", {"latent": torch.zeros(2, 2, 2)})
        with pytest.raises(InvalidArgumentError, match=r"must be one of \['bfloat16', 'float16', 'float32'\].*got float64"):
            writer.append("c", {"latent": torch.zeros(2, 2, 2, dtype=torch.float64)})
        writer.append("d", {"latent": torch.ones(2, 2, 3, dtype=torch.bfloat16)})
    assert LatentCache(tmp_path).dtype == torch.bfloat16 and LatentCache(tmp_path).keys == ["a", "d"]


def test_a_bare_tensor_is_still_stored_as_float16(tmp_path):
    z = torch.randn(4, 3, 5).to(torch.bfloat16)
    with LatentCacheWriter(tmp_path, "train") as writer:
        writer.append("a", z)
    cache = LatentCache(tmp_path)
    assert cache.dtype == torch.float16 and "dtype" in cache.meta and cache.meta["dtype"] == "float16"
    assert same_bits(cache[0], z.half())


def test_an_interrupted_float32_write_resumes(tmp_path):
    latents = _latents(torch.float32)
    writer = LatentCacheWriter(tmp_path, "train", flush_every=1)
    for i in range(3):
        writer.append(f"k{i}", {"latent": latents[i]})
    writer.close()
    with LatentCacheWriter(tmp_path, "train") as writer:
        assert writer.resumed and writer.keys == ["k0", "k1", "k2"]
        for i in range(3, len(latents)):
            writer.append(f"k{i}", {"latent": latents[i]})
    cache = LatentCache(tmp_path)
    assert all(same_bits(cache[i], z) for i, z in enumerate(latents))


def test_a_line_cache_meta_claiming_bfloat16_is_refused(tmp_path):
    from latentfast.testing import random_rows, write_cache

    rows, widths = random_rows(np.random.default_rng(0), 3, 2, 2, 6)
    write_cache(str(tmp_path), rows, widths, w_max=6)
    meta_path = fmt.cache_path(tmp_path, "train", "meta")
    meta = fmt.read_meta(meta_path)
    assert "dtype" not in meta and LatentCache(tmp_path).dtype == torch.float16  # the original format opens as float16
    fmt.write_meta(meta_path, {**meta, "dtype": "bfloat16"})
    with pytest.raises(CacheCorruptError, match=r"dtype must be 'float16' in a padded cache, got 'bfloat16'"):
        LatentCache(tmp_path)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_device_path_returns_the_stored_dtype(tmp_path, dtype):
    latents, _ = _write(tmp_path, dtype)
    cache = LatentCache(tmp_path)
    batch, _ = cache.read_batch([3, 0, 1], device="cuda")
    assert batch.device.type == "cuda" and same_bits(batch.cpu(), torch.stack([latents[3], latents[0], latents[1]]))
    as_f32, _ = cache.read_batch([2, 4], device="cuda", dtype=torch.float32)
    assert same_bits(as_f32.cpu(), torch.stack([latents[2], latents[4]]).float())


def test_dataloader_workers_read_bfloat16_records(tmp_path):
    from latentfast.cache import batch_loader

    latents, texts = _write(tmp_path, torch.bfloat16)
    cache = LatentCache(tmp_path)
    batches = [[0, 3], [2, 4], [1]]
    loader = batch_loader(cache, batches, fields=("latent", "text"), pad={"text": 0.0}, num_workers=2,
                          multiprocessing_context="fork")
    for indices, batch in zip(batches, loader):
        assert batch["index"].tolist() == indices
        assert same_bits(batch["latent"], torch.stack([latents[i] for i in indices]))
