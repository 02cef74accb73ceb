"""Width-bucketing sampler, batch dataset mode, item-mode collate, device prefetcher, and real
DataLoader workers (fork and spawn) over a cache on disk."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from latentfast.testing import random_rows, write_cache
from torch.utils.data import DataLoader

from latentfast.cache.decode import read_batch
from latentfast.cache.loader import (
    CacheBatchDataset,
    DevicePrefetcher,
    WidthBucketBatchSampler,
    batch_loader,
    collate,
)


def widths_for(n, seed=0, w_max=64):
    return np.random.default_rng(seed).integers(1, w_max + 1, size=n).astype(np.int32)


def test_sampler_is_seeded_and_covers_every_row_once():
    widths = widths_for(1000)
    a = list(WidthBucketBatchSampler(widths, 32, seed=3, bucket_batches=4))
    b = list(WidthBucketBatchSampler(widths, 32, seed=3, bucket_batches=4))
    assert a == b
    assert sorted(i for batch in a for i in batch) == list(range(1000))
    assert [len(batch) for batch in a[:-1]] == [32] * (len(a) - 1) and len(a[-1]) == 1000 % 32
    other_seed = list(WidthBucketBatchSampler(widths, 32, seed=4, bucket_batches=4))
    assert other_seed != a
    sampler = WidthBucketBatchSampler(widths, 32, seed=3, bucket_batches=4)
    sampler.set_epoch(1)
    assert list(sampler) != a


def test_sampler_cuts_padding():
    widths = widths_for(4096, seed=1, w_max=256)

    def padding(batches):
        return sum(int(widths[b].max()) * len(b) - int(widths[b].sum()) for b in batches) / widths.sum()

    bucketed = list(WidthBucketBatchSampler(widths, 64, seed=0))
    rng = np.random.default_rng(0)
    random_batches = np.array_split(rng.permutation(len(widths)), len(widths) // 64)
    assert padding(bucketed) < 0.1 * padding(random_batches)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("n, world_size", [(1000, 3), (960, 3), (10, 4), (64, 1)])
def test_rank_shards(n, world_size, drop_last):
    widths = widths_for(n)
    shards = [
        list(WidthBucketBatchSampler(widths, 16, seed=9, rank=r, world_size=world_size, drop_last=drop_last,
                                     bucket_batches=3))
        for r in range(world_size)
    ]
    lengths = {len(shard) for shard in shards}
    assert len(lengths) == 1, f"ranks got different batch counts {lengths}"
    assert lengths.pop() == len(WidthBucketBatchSampler(widths, 16, world_size=world_size, drop_last=drop_last))
    rows = [i for shard in shards for batch in shard for i in batch]
    n_batches = -(-n // 16) if not drop_last else n // 16
    if drop_last:
        assert len(rows) == len(set(rows)), "shards overlap"
        assert all(len(batch) == 16 for shard in shards for batch in shard)
        assert len(rows) == (n_batches - n_batches % world_size) * 16
    else:
        assert set(rows) == set(range(n)), "shards do not cover every row"
        if n_batches % world_size == 0:
            assert len(rows) == n, "shards overlap"


def test_resume_mid_epoch_is_exact():
    widths = widths_for(500)
    sampler = WidthBucketBatchSampler(widths, 20, seed=5, rank=1, world_size=2)
    sampler.set_epoch(2)
    full = list(sampler)
    iterator = iter(sampler)
    seen = [next(iterator) for _ in range(4)]
    state = sampler.state_dict()
    assert state["consumed"] == 4 and state["epoch"] == 2
    resumed = WidthBucketBatchSampler(widths, 20, seed=5, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert seen + list(resumed) == full
    assert list(resumed) == full, "after the resumed epoch ends, the next iteration is the whole epoch"
    # a DataLoader prefetches: the trainer passes what it really consumed
    resumed.load_state_dict(sampler.state_dict(consumed=2))
    assert list(resumed) == full[2:]
    with pytest.raises(ValueError, match="state_dict was saved with seed=5, this sampler has 6"):
        WidthBucketBatchSampler(widths, 20, seed=6, rank=1, world_size=2).load_state_dict(state)


def test_sampler_argument_errors():
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        WidthBucketBatchSampler([1, 2], 0)
    with pytest.raises(ValueError, match="rank must be < world_size=2"):
        WidthBucketBatchSampler([1, 2], 1, rank=2, world_size=2)
    with pytest.raises(ValueError, match="widths must be 1-D"):
        WidthBucketBatchSampler([[1, 2]], 1)


@pytest.fixture
def disk_cache(tmp_path):
    rng = np.random.default_rng(21)
    rows, widths = random_rows(rng, 90, 3, 4, 24)
    white = rng.standard_normal((3, 4, 1)).astype(np.float16)
    return write_cache(str(tmp_path), rows, widths, w_max=24, layout="ragged", white=white)


def test_collate_pads_with_white(disk_cache):
    items = [disk_cache[i] for i in (5, 0, 44)]
    latents, widths = collate(items, disk_cache.white_column)
    expected, expected_widths = read_batch(disk_cache, [5, 0, 44])
    assert torch.equal(latents, expected) and torch.equal(widths, expected_widths)
    wide, _ = collate(items, disk_cache.white_column, dtype=torch.float32, width=30)
    expected_wide, _ = read_batch(disk_cache, [5, 0, 44], dtype=torch.float32, width=30)
    assert torch.equal(wide, expected_wide)
    loader = DataLoader([disk_cache[i] for i in range(10)], batch_size=4,
                        collate_fn=functools.partial(collate, white_column=disk_cache.white_column))
    for k, (batch, _) in enumerate(loader):
        assert torch.equal(batch, read_batch(disk_cache, range(4 * k, min(4 * k + 4, 10)))[0])
    with pytest.raises(ValueError, match=r"item 1 has shape \(3, 5, 2\), expected \[3, 4, w\]"):
        collate([items[0], torch.zeros(3, 5, 2)], disk_cache.white_column)
    with pytest.raises(ValueError, match="width must be >= the widest item"):
        collate(items, disk_cache.white_column, width=1)


def test_batch_dataset_returns_read_batch(disk_cache):
    dataset = CacheBatchDataset(disk_cache, dtype=torch.bfloat16)
    latents, widths, index = dataset[[7, 3, 7]]
    expected, expected_widths = read_batch(disk_cache, [7, 3, 7], dtype=torch.bfloat16)
    assert torch.equal(latents, expected) and torch.equal(widths, expected_widths)
    assert index.tolist() == [7, 3, 7]


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_match_single_process(disk_cache, context):
    sampler = WidthBucketBatchSampler(disk_cache.widths, 8, seed=1, bucket_batches=2)
    single = list(batch_loader(disk_cache, sampler, num_workers=0))
    workers = list(batch_loader(disk_cache, sampler, num_workers=2, multiprocessing_context=context))
    assert len(single) == len(workers) == len(sampler)
    for (a, wa, ia), (b, wb, ib) in zip(single, workers):
        assert torch.equal(a, b) and torch.equal(wa, wb) and torch.equal(ia, ib)
    assert sorted(i for _, _, index in single for i in index.tolist()) == list(range(len(disk_cache)))


def test_prefetcher_passes_through_on_cpu(disk_cache):
    loader = batch_loader(disk_cache, WidthBucketBatchSampler(disk_cache.widths, 16, seed=2))
    direct = list(loader)
    prefetched = list(DevicePrefetcher(loader, "cpu"))
    assert len(prefetched) == len(direct) == len(DevicePrefetcher(loader, "cpu"))
    for a, b in zip(direct, prefetched):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.gpu
def test_prefetcher_cuda(disk_cache):
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available here"):
            DevicePrefetcher([], "cuda")
        pytest.skip("needs a CUDA device")
    loader = batch_loader(disk_cache, WidthBucketBatchSampler(disk_cache.widths, 16, seed=2), pin_memory=True)
    direct = list(loader)
    for (a, wa, ia), (b, wb, ib) in zip(direct, DevicePrefetcher(loader, "cuda")):
        assert b.is_cuda and torch.equal(a, b.cpu()) and torch.equal(wa, wb.cpu()) and torch.equal(ia, ib.cpu())
        torch.cuda.current_stream().synchronize()
