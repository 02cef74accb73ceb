"""Width-bucketing sampler, batch dataset mode, item-mode collate, device prefetcher, and real
DataLoader workers (fork and spawn) over a cache on disk."""
from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from latentfast.testing import random_rows, write_cache
from torch.utils.data import DataLoader

from latentfast.cache.feed.gather import read_batch
from latentfast.cache import (
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
    with pytest.raises(TypeError, match="widths must be integers"):
        WidthBucketBatchSampler([1.5, 2.0], 1)
    for bad in (2.0, True, "2"):
        with pytest.raises(TypeError, match="batch_size must be an int"):
            WidthBucketBatchSampler([1, 2], bad)


def test_sampler_takes_numpy_ints():
    widths = widths_for(300)
    plain = list(WidthBucketBatchSampler(widths, 16, seed=2, rank=1, world_size=3, bucket_batches=2))
    numpy_args = WidthBucketBatchSampler(widths, np.int64(16), seed=np.int32(2), rank=np.int64(1),
                                         world_size=np.uint8(3), bucket_batches=np.int16(2))
    assert list(numpy_args) == plain
    assert all(type(getattr(numpy_args, name)) is int for name in ("batch_size", "seed", "rank", "world_size"))


def test_sampler_upcoming_peeks_without_consuming():
    sampler = WidthBucketBatchSampler(widths_for(400), 16, seed=8, bucket_batches=2)
    expected = list(WidthBucketBatchSampler(widths_for(400), 16, seed=8, bucket_batches=2))
    assert sampler.upcoming(3) == expected[:3] and sampler.consumed == 0
    iterator = iter(sampler)
    for step in range(len(expected)):
        assert next(iterator) == expected[step]
        assert sampler.upcoming(2) == expected[step + 1 : step + 3]
        assert sampler.consumed == step + 1
    sampler.set_epoch(1)
    assert sampler.upcoming(1) == [next(iter(sampler))]


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
    for indices in (np.array([7, 3, 7], dtype=np.uint16), torch.tensor([7, 3, 7], dtype=torch.int32)):
        assert torch.equal(dataset[indices][0], expected)


def test_batch_dataset_refuses_non_integer_indices(disk_cache):
    dataset = CacheBatchDataset(disk_cache)
    for bad in ([0.9, 2.7], np.array([1.0, 2.0]), torch.tensor([0.0, 1.0])):
        with pytest.raises(TypeError, match="indices must be a 1-D (sequence|tensor) of ints"):
            dataset[bad]
    with pytest.raises(IndexError, match=r"indices\[1\] = 90 is out of range"):
        dataset[[0, 90]]


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


@pytest.mark.parametrize("lookahead", [0, 1, 2, 5])
def test_prefetcher_on_cpu_gives_every_batch_in_order(disk_cache, lookahead):
    loader = batch_loader(disk_cache, WidthBucketBatchSampler(disk_cache.widths, 16, seed=2))
    direct = list(loader)
    prefetched = list(DevicePrefetcher(loader, "cpu", lookahead=lookahead))
    assert len(prefetched) == len(direct) == len(DevicePrefetcher(loader, "cpu"))
    for a, b in zip(direct, prefetched):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_prefetcher_reads_ahead_in_a_thread():
    """While the loop holds batch 0, the next `lookahead` batches are produced (in another thread);
    never more."""
    produced, threads = [], set()
    import threading
    import time

    def source():
        for k in range(10):
            produced.append(k)
            threads.add(threading.get_ident())
            yield {"k": torch.tensor([k]), "name": f"b{k}"}

    iterator = iter(DevicePrefetcher(source(), "cpu", lookahead=3))
    first = next(iterator)
    deadline = time.monotonic() + 10
    while len(produced) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert first["k"].item() == 0 and first["name"] == "b0"
    assert produced == [0, 1, 2, 3, 4], "expected batch 0 handed out, 1-3 queued and 4 waiting for room"
    assert threading.get_ident() not in threads
    assert [b["k"].item() for b in iterator] == list(range(1, 10))


def test_prefetcher_raises_the_sources_error_and_stops_early():
    import threading

    def failing():
        yield torch.zeros(1)
        raise OSError("disk gone")

    iterator = iter(DevicePrefetcher(failing(), "cpu"))
    assert next(iterator).shape == (1,)
    with pytest.raises(OSError, match="disk gone"):
        next(iterator)
    before = threading.active_count()
    endless = iter(DevicePrefetcher((torch.zeros(1) for _ in iter(int, 1)), "cpu", lookahead=2))
    next(endless)
    endless.close()  # the loop breaks out: the producer has stopped (and let go of the source) when this returns
    assert threading.active_count() <= before


def test_prefetcher_arguments():
    with pytest.raises(ValueError, match="lookahead must be an int >= 0"):
        DevicePrefetcher([], "cpu", lookahead=-1)
    with pytest.raises(ValueError, match="device must name a device"):
        DevicePrefetcher([], "gpu")
    assert DevicePrefetcher([], np.int64(0) if torch.cuda.is_available() else "cpu").device.type in ("cpu", "cuda")


@pytest.mark.gpu
def test_prefetcher_waits_for_the_stream_that_made_a_cuda_batch():
    """Batches made on the producing thread's current stream (a side stream here, busy with a long
    kernel first): the prefetcher's copy and the loop see the finished values."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    producer = torch.cuda.Stream()

    def batches():
        for k in range(6):
            with torch.cuda.stream(producer):
                torch.cuda._sleep(50_000_000)  # keeps `producer` busy, so a copy that does not wait reads garbage
                yield torch.full((1 << 20,), float(k), device="cuda")

    for lookahead in (0, 2):
        for k, batch in enumerate(DevicePrefetcher(batches(), "cuda", lookahead=lookahead)):
            assert bool((batch == k).all())


@pytest.mark.gpu
def test_prefetcher_thread_uses_the_loops_current_device():
    """A generator that allocates on "cuda" runs in the producer thread with the loop's current device."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    torch.cuda.set_device(1)
    try:
        made = list(DevicePrefetcher((torch.zeros(4, device="cuda") for _ in range(3)), "cuda"))
        assert all(t.device == torch.device("cuda", 1) for t in made)
    finally:
        torch.cuda.set_device(0)


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
