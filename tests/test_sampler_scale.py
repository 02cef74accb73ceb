"""Samplers at scale (issue 33): one small id per item, shapes read a block of rows at a time, an epoch's
plan as arrays built by blocks, and still the batches (in the order) the list-building code gave.

The plans are checked against references written here from the samplers' documented rules, with plain
per-bucket and per-window loops, on random shapes of odd sizes; ``PLAN_BLOCK`` is made tiny so every
blockwise pass crosses many block boundaries (a block of 37 items sees parts of batches, buckets and
windows). Memory is checked through the arrays' ``nbytes`` and tracemalloc, never by timing."""
from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from latentfast.cache import InOrderBatchSampler, LatentCache, LatentLoader, ShapeBucketBatchSampler, WidthBucketBatchSampler
from latentfast.cache.feed import sampler as sampler_module
from latentfast.cache.feed.sampler import Batches
from latentfast.testing import write_random_cache


@pytest.fixture(params=["native passes, tiny blocks", "numpy, tiny blocks, slices per key", "numpy, tiny blocks, scattered keys"])
def blocks(request, monkeypatch):
    """Blocks of 37 items (every pass crosses block boundaries), with the native library's shuffle and
    grouping (csrc/cpu/plan_epoch.cpp, where it is built) or numpy's, and either way numpy moves a block's items."""
    monkeypatch.setattr(sampler_module, "PLAN_BLOCK", 37)
    monkeypatch.setattr(sampler_module, "GROUP_RUNS", 0 if "scattered" in request.param else 4096)
    if "numpy" in request.param:
        monkeypatch.setattr(sampler_module, "NATIVE", None)
    elif sampler_module.NATIVE is None:
        pytest.skip("the native library is not built here")
    return request.param


def random_shapes(rng, n, distinct=7, ndim=3):
    table = rng.integers(1, 60, size=(distinct, ndim))
    return table[rng.integers(0, distinct, n)]


def lexicographic_ids(shapes):
    return np.unique(shapes, axis=0, return_inverse=True)[1].reshape(-1)


def dense(values):
    return np.unique(values, return_inverse=True)[1].reshape(-1)


# ---- references: the documented rules, written out with plain loops --------------------------
def ref_shape_batches(shapes, bs, seed, epoch, drop_last):
    ids = lexicographic_ids(shapes)
    rng = np.random.default_rng([seed, epoch])
    batches = []
    for b in range(int(ids.max()) + 1 if len(ids) else 0):
        members = np.flatnonzero(ids == b)[rng.permutation(int((ids == b).sum()))]
        stop = len(members) - len(members) % bs if drop_last else len(members)
        batches += [members[k : k + bs].tolist() for k in range(0, stop, bs)]
    return [batches[k] for k in rng.permutation(len(batches))]


def ref_width_batches(widths, bs, bucket_batches, seed, epoch, drop_last):
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(len(widths))
    batches = []
    for start in range(0, len(order), bs * bucket_batches):
        part = sorted(order[start : start + bs * bucket_batches].tolist(), key=lambda i: widths[i])  # (sorted is stable)
        batches += [part[k : k + bs] for k in range(0, len(part), bs)]
    short = batches.pop() if batches and len(batches[-1]) < bs else None
    batches = [batches[k] for k in rng.permutation(len(batches))]
    return batches + ([short] if short is not None and not drop_last else [])


def ref_stream(rng, n, chunks, window, buckets=None):
    """Every item ordered by (bucket, window of its chunk, place in a random permutation), and each item's window."""
    chunk = dense(chunks)
    rank_of_chunk = np.argsort(rng.permutation(int(chunk.max()) + 1 if n else 0))
    window_of = rank_of_chunk[chunk] // window if n else np.zeros(0, np.int64)
    place = np.argsort(rng.permutation(n))
    bucket = np.zeros(n, np.int64) if buckets is None else buckets
    return sorted(range(n), key=lambda i: (bucket[i], window_of[i], place[i])), window_of


def ref_windowed_shape_batches(shapes, bs, seed, epoch, drop_last, chunks, window):
    rng = np.random.default_rng([seed, epoch])
    ids = lexicographic_ids(shapes)
    stream, window_of = ref_stream(rng, len(shapes), chunks, window, ids)
    last_window = int(window_of.max()) if len(window_of) else 0
    batches, windows = [], []
    for b in range(int(ids.max()) + 1 if len(ids) else 0):
        members = [i for i in stream if ids[i] == b]
        stop = len(members) - len(members) % bs if drop_last else len(members)
        for k in range(0, stop, bs):
            batch = members[k : k + bs]
            batches.append(batch)
            windows.append(int(window_of[batch[-1]]) if len(batch) == bs else last_window)
    tie = rng.permutation(len(batches))
    return [batches[k] for k in sorted(range(len(batches)), key=lambda k: (windows[k], tie[k]))]


def ref_windowed_width_batches(widths, bs, bucket_batches, seed, epoch, drop_last, chunks, window):
    rng = np.random.default_rng([seed, epoch])
    stream, window_of = ref_stream(rng, len(widths), chunks, window)
    # pool p: the rows of the windows up to p, less those of whole batches already made
    batches, pools, made = [], [], 0
    for w in range(int(window_of.max()) + 1 if len(widths) else 0):
        reach = sum(int((window_of == v).sum()) for v in range(w + 1)) // bs * bs
        pool = stream[made:reach]
        for start in range(0, len(pool), bs * bucket_batches):
            part = sorted(pool[start : start + bs * bucket_batches], key=lambda i: widths[i])
            for k in range(0, len(part), bs):
                batches.append(part[k : k + bs])
                pools.append(w)
        made = reach
    tie = rng.permutation(len(batches))
    batches = [batches[k] for k in sorted(range(len(batches)), key=lambda k: (pools[k], tie[k]))]
    short = sorted(stream[made:], key=lambda i: widths[i])
    return batches + ([short] if short and not drop_last else [])


# ---- the plans ----------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 5, 301, 1000])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shape_plan_is_the_reference(blocks, n, drop_last):
    rng = np.random.default_rng(n)
    shapes = random_shapes(rng, n)
    for bs, seed, epoch in ((7, 0, 0), (16, 3, 2), (1, 1, 1)):
        sampler = ShapeBucketBatchSampler(shapes, bs, seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch)
        assert sampler.epoch_batches() == ref_shape_batches(shapes, bs, seed, epoch, drop_last)
        assert list(sampler) == ref_shape_batches(shapes, bs, seed, epoch, drop_last)


def test_one_bucket_and_one_window_plans_are_the_reference(blocks):
    shapes = np.tile([4, 8, 8], (401, 1))  # one shape: what LatentLoader(buckets=False) and one-shape caches get
    sampler = ShapeBucketBatchSampler(shapes, 16, seed=2)
    assert list(sampler) == ref_shape_batches(shapes, 16, 2, 0, False)
    chunks = np.arange(401) // 10
    windowed = ShapeBucketBatchSampler(shapes, 16, seed=2, chunks=chunks, chunk_window=100)  # all 41 chunks in one window
    assert list(windowed) == ref_windowed_shape_batches(shapes, 16, 2, 0, False, chunks, 100)


@pytest.mark.parametrize("n", [0, 3, 499, 1000])
@pytest.mark.parametrize("drop_last", [False, True])
def test_width_plan_is_the_reference(blocks, n, drop_last):
    widths = np.random.default_rng(n).integers(1, 90, n)
    for bs, bucket_batches, seed, epoch in ((7, 3, 0, 0), (16, 1, 2, 5), (5, 64, 1, 1)):
        sampler = WidthBucketBatchSampler(widths, bs, seed=seed, drop_last=drop_last, bucket_batches=bucket_batches)
        sampler.set_epoch(epoch)
        assert list(sampler) == ref_width_batches(widths, bs, bucket_batches, seed, epoch, drop_last)


@pytest.mark.parametrize("n", [0, 2, 611])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("window", [1, 3, 50])
def test_windowed_plans_are_the_reference(blocks, n, drop_last, window):
    rng = np.random.default_rng(n + window)
    shapes = random_shapes(rng, n, distinct=4)
    widths = rng.integers(1, 90, n)
    chunks = rng.integers(0, max(1, n // 9), n) * 1000 + 17  # unsorted, sparse chunk ids
    shape = ShapeBucketBatchSampler(shapes, 8, seed=4, drop_last=drop_last, chunks=chunks, chunk_window=window)
    width = WidthBucketBatchSampler(widths, 8, seed=4, drop_last=drop_last, bucket_batches=2, chunks=chunks, chunk_window=window)
    for epoch in (0, 3):
        shape.set_epoch(epoch), width.set_epoch(epoch)
        assert list(shape) == ref_windowed_shape_batches(shapes, 8, 4, epoch, drop_last, chunks, window)
        assert list(width) == ref_windowed_width_batches(widths, 8, 2, 4, epoch, drop_last, chunks, window)


def test_in_order_plan_is_the_reference(blocks):
    shapes = random_shapes(np.random.default_rng(9), 777, distinct=5)
    ids = lexicographic_ids(shapes)
    for drop_last in (False, True):
        expected = []
        for b in range(int(ids.max()) + 1):
            members = np.flatnonzero(ids == b).tolist()
            stop = len(members) - len(members) % 10 if drop_last else len(members)
            expected += [members[k : k + 10] for k in range(0, stop, 10)]
        assert list(InOrderBatchSampler(shapes, 10, drop_last=drop_last)) == sorted(expected)


def test_rank_shares_are_the_global_plan_sharded(blocks):
    shapes = random_shapes(np.random.default_rng(2), 523)
    reference = ref_shape_batches(shapes, 6, 0, 1, False)
    for world_size in (1, 2, 5):
        for rank in range(world_size):
            sampler = ShapeBucketBatchSampler(shapes, 6, rank=rank, world_size=world_size)
            sampler.set_epoch(1)
            rest = reference + reference[: -len(reference) % world_size]
            assert list(sampler) == rest[rank::world_size]


@pytest.mark.parametrize("kind", ["shape", "width", "windowed"])
def test_resume_mid_epoch_equals_the_uninterrupted_run(blocks, kind):
    rng = np.random.default_rng(11)
    n = 1009
    shapes, widths, chunks = random_shapes(rng, n, distinct=5), rng.integers(1, 50, n), np.arange(n) // 13

    def make(rank, world_size):
        if kind == "width":
            s = WidthBucketBatchSampler(widths, 9, seed=5, rank=rank, world_size=world_size, bucket_batches=3)
        else:
            extra = {"chunks": chunks, "chunk_window": 4} if kind == "windowed" else {}
            s = ShapeBucketBatchSampler(shapes, 9, seed=5, rank=rank, world_size=world_size, **extra)
        s.set_epoch(2)
        return s

    whole = list(make(0, 1))
    for stop in (0, 1, 17, len(whole) - 1, len(whole)):
        first = make(0, 1)
        it = iter(first)
        head = [next(it) for _ in range(stop)]
        state = json.loads(json.dumps(first.state_dict()))
        resumed = make(0, 1)
        resumed.load_state_dict(state)
        assert head + list(resumed) == whole
    # saved by 2 ranks after 10 steps each, resumed by 3: the rest of the global plan, split 3 ways
    ranks = [make(r, 2) for r in range(2)]
    for s in ranks:
        it = iter(s)
        for _ in range(10):
            next(it)
    state = ranks[1].state_dict()
    rest = whole[20:] + whole[: -len(whole[20:]) % 3]
    for rank in range(3):
        resumed = make(rank, 3)
        resumed.load_state_dict(state)
        assert list(resumed) == rest[rank::3]


# ---- per-item state and plan memory ---------------------------------------------------------------
@pytest.mark.parametrize("distinct, dtype", [(1, np.uint8), (200, np.uint8), (257, np.uint16), (70_000, np.uint32)])
def test_bucket_ids_take_the_smallest_dtype(distinct, dtype):
    n = 80_000
    labels = np.random.default_rng(0).permutation(np.arange(n) % distinct) * 3 - 5  # every label present, negative ones too
    sampler = ShapeBucketBatchSampler(labels, 64)
    assert sampler.buckets.dtype == dtype
    assert sampler.buckets.tolist() == dense(labels).tolist()
    assert sampler.nbytes == n * np.dtype(dtype).itemsize  # the only per-item array kept


def test_kept_and_plan_bytes_per_item():
    rng = np.random.default_rng(1)
    n = 100_003
    shapes = random_shapes(rng, n, distinct=30, ndim=4)
    sampler = ShapeBucketBatchSampler(shapes, 64)
    assert sampler.nbytes == n  # uint8 bucket ids, not [N, 4] int64 (32 bytes an item)
    plan = sampler.epoch_batches()
    assert plan.items.dtype == np.int32 and len(plan.items) == n
    assert plan.nbytes == 4 * n + 16 * len(plan)  # int32 items + int64 start and end per batch
    share = ShapeBucketBatchSampler(shapes, 64, rank=1, world_size=3).rank_batches()
    assert share.items.nbytes == 4 * n and share.starts.nbytes == 8 * len(share)  # a rank's share: the items, not copied per rank
    widths = WidthBucketBatchSampler(rng.integers(16, 241, n), 64)
    assert widths.nbytes == n  # each row's width rank, uint8 (225 widths)
    chunked = WidthBucketBatchSampler(rng.integers(16, 241, n), 64, chunks=np.arange(n) // 3, chunk_window=4)
    assert chunked._chunk_of.dtype == np.uint16 and chunked.nbytes == n + 2 * n  # + dense chunk ids (33,335 chunks)


def test_bucket_ids_of_a_mapped_shapes_table_read_by_blocks(tmp_path, monkeypatch):
    rng = np.random.default_rng(3)
    n = 200_000
    path = str(tmp_path / "shapes.npy")
    np.save(path, random_shapes(rng, n, distinct=40, ndim=4).astype(np.int64))
    shapes = np.load(path, mmap_mode="r")
    monkeypatch.setattr(sampler_module, "PLAN_BLOCK", 4096)
    tracemalloc.start()
    sampler = ShapeBucketBatchSampler(shapes, 32)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert sampler.buckets.tolist() == lexicographic_ids(np.asarray(shapes)).tolist()
    # never an [N, 4] int64 copy (6.4 MB) nor an int64 key per item (1.6 MB): the ids (0.2 MB), blocks, the counts
    assert peak < 0.8e6, f"{peak} bytes traced while bucketing {n} mapped rows"


def test_ranges_too_wide_for_one_key_are_ranked_by_blocks(monkeypatch):
    monkeypatch.setattr(sampler_module, "PLAN_BLOCK", 3)
    shapes = np.array([[2**62, 1, 5], [0, 2, 5], [2**62, 1, 5], [-(2**62), 2**40, 3], [0, 2, 5], [0, 2, 4], [7, 7, 7]])
    assert ShapeBucketBatchSampler(shapes, 2).buckets.tolist() == lexicographic_ids(shapes).tolist()


def test_keys_beyond_the_table_are_ranked_by_a_sorted_list(monkeypatch):
    monkeypatch.setattr(sampler_module, "TABLE_KEYS", 10)
    monkeypatch.setattr(sampler_module, "PLAN_BLOCK", 50)
    shapes = random_shapes(np.random.default_rng(4), 1001, distinct=60)
    assert ShapeBucketBatchSampler(shapes, 2).buckets.tolist() == lexicographic_ids(shapes).tolist()


# ---- the plan as a sequence of batches --------------------------------------------------------------
def test_batches_behave_as_the_list_of_lists_they_replace():
    items = np.array([5, 3, 9, 1, 4, 7, 2], dtype=np.int32)
    plan = Batches(items, np.array([4, 0, 2]), np.array([7, 2, 4]))
    lists = [[4, 7, 2], [5, 3], [9, 1]]
    assert plan == lists and list(plan) == lists and len(plan) == 3
    assert plan[0] == [4, 7, 2] and plan[-1] == [9, 1] and plan[1:] == lists[1:] and plan[::2] == lists[::2]
    assert all(type(i) is int for i in plan[0])
    assert plan != lists[:2] and plan != [[4, 7, 2], [5, 3], [9, 2]]
    with pytest.raises(IndexError, match="batch 3 out of range: the plan has 3 batches"):
        plan[3]
    assert plan.select([2, 0]) == [[9, 1], [4, 7, 2]]


# ---- the loader hands the sampler ids, not [N, ndim] shapes -------------------------------------------
def test_loader_samplers_keep_one_byte_an_item(tmp_path):
    paths = write_random_cache(str(tmp_path), 300, 4, 4, 40)
    line = LatentCache(paths["ragged"])
    sampled = LatentLoader(line, 16, sample=True).sampler  # a line cache with draws: batches of one width
    assert sampled.buckets.dtype == np.uint8 and sampled.nbytes == len(line)
    assert sampled.buckets.tolist() == lexicographic_ids(line.shapes).tolist()  # as its [N, 3] shapes bucket
    plain = LatentLoader(line, 16, buckets=False).sampler
    assert plain.buckets.dtype == np.uint8 and not plain.buckets.any()
    ordered = LatentLoader(line, 16, shuffle=False, buckets=False).sampler
    assert ordered.nbytes == len(line) and list(ordered)[0] == list(range(16))
