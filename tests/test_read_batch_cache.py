"""The fast batch path on real caches: built from real images by the builder, opened by LatentCache."""
from __future__ import annotations

import multiprocessing

import numpy as np
import pytest
import torch

from latentfast.cache import LatentCache, build_latent_cache
from latentfast.cache import CacheBatchDataset, DevicePrefetcher, WidthBucketBatchSampler, batch_loader, collate
from latentfast.synthetic import render_text_lines
from latentfast.toy import ToyVAE

from latentfast.testing import poisoned_like


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    root = tmp_path_factory.mktemp("real_cache")
    manifest = render_text_lines(str(root / "images"), 37, line_height=16, max_line_width=160, seed=5)
    vae = ToyVAE(latent_channels=3, seed=2)
    built = {}
    for layout in ("padded", "ragged"):
        out = root / layout
        build_latent_cache(vae, manifest, str(out), line_height=16, max_line_width=160, batch_size=8, layout=layout, quiet=True)
        built[layout] = LatentCache(str(out))
    return built


def _expected(cache, indices, width=None):
    rows = [cache[i] for i in indices]
    W = width or max(r.shape[-1] for r in rows)
    white = cache.white_column
    return torch.stack([torch.cat([r, white.expand(-1, -1, W - r.shape[-1])], dim=-1) for r in rows])


@pytest.mark.parametrize("layout", ["padded", "ragged"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_read_batch_matches_rows_padded_with_white(caches, layout, dtype):
    cache = caches[layout]
    indices = [30, 2, 2, 17, 36, 0, 9]  # unsorted, with a duplicate
    out = poisoned_like((len(indices), cache.channels, cache.latent_h, int(cache.widths[indices].max())), dtype)
    latents, widths = cache.read_batch(indices, dtype=dtype, out=out)
    assert latents.data_ptr() == out.data_ptr()
    assert widths.tolist() == [int(cache.widths[i]) for i in indices]
    torch.testing.assert_close(latents, _expected(cache, indices).to(dtype), rtol=0, atol=0)


def test_layouts_give_identical_batches_and_explicit_width(caches):
    indices = np.random.default_rng(0).integers(0, len(caches["padded"]), 16)
    padded, _ = caches["padded"].read_batch(indices, width=caches["padded"].w_max)
    ragged, _ = caches["ragged"].read_batch(indices, width=caches["padded"].w_max)
    assert torch.equal(padded, ragged)
    torch.testing.assert_close(padded, _expected(caches["padded"], indices.tolist(), caches["padded"].w_max), rtol=0, atol=0)


def test_bad_indices_name_the_index(caches):
    cache = caches["padded"]
    with pytest.raises(IndexError, match=str(len(cache))):
        cache.read_batch([0, len(cache)])
    with pytest.raises(ValueError, match="width"):
        cache.read_batch([0, 1], width=1)


def test_item_collate_equals_read_batch(caches):
    cache = caches["ragged"]
    indices = [4, 8, 15, 16, 23]
    batch, widths = collate([cache[i] for i in indices], cache.white_column)
    assert torch.equal(batch, cache.read_batch(indices)[0])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_batch_loader_workers_match_single_process(caches, context):
    cache = caches["padded"]
    sampler = WidthBucketBatchSampler(cache.widths, 6, seed=3)
    single = [CacheBatchDataset(cache)[batch] for batch in sampler]
    loader = batch_loader(cache, sampler, num_workers=2, multiprocessing_context=multiprocessing.get_context(context))
    from_workers = list(DevicePrefetcher(loader, device="cpu"))
    assert len(from_workers) == len(single)
    for (a, wa, ia), (b, wb, ib) in zip(single, from_workers):
        assert torch.equal(a, b) and torch.equal(wa, wb) and list(ia) == list(ib)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_read_batch_to_cuda_equals_cpu(caches, layout):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    cache = caches[layout]
    for step in range(6):  # more batches than ring slots: slots get reused
        indices = np.random.default_rng(step).integers(0, len(cache), 9 + step)
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            on_gpu, widths = cache.read_batch(indices, device="cuda", dtype=dtype)
            on_cpu, _ = cache.read_batch(indices, dtype=dtype)
            assert on_gpu.is_cuda and torch.equal(on_gpu.cpu(), on_cpu)
