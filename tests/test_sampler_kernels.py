"""The native library's planning passes (csrc/cpu/plan_epoch.cpp) against their numpy references: the
shuffle against ``numpy.random.Generator.shuffle`` (the same result and the same generator state after,
for several bit generators), the counts, the grouping (of items, or of items packed with their keys) and the
segments' sort against the sampler's numpy ones; on fresh random
inputs of odd sizes, every key dtype, outputs poisoned beforehand; and their argument checks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from latentfast.backends import native
from latentfast.cache import ShapeBucketBatchSampler, WidthBucketBatchSampler
from latentfast.cache.feed import sampler as sampler_module

pytestmark = pytest.mark.skipif(native.LIB is None, reason=f"the native library is not built here: {native.LOAD_ERROR}")

BIT_GENERATORS = [np.random.PCG64, np.random.MT19937, np.random.Philox, np.random.SFC64, np.random.PCG64DXSM]


@pytest.mark.parametrize("bit_generator", BIT_GENERATORS)
@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_shuffle_is_numpys_shuffle(bit_generator, dtype):
    for n in (0, 1, 2, 3, 63, 64, 65, 129, 1000, 77_777):  # around the kernel's 64 draws ahead
        seed = int(np.random.SeedSequence().entropy % 2**32)  # fresh each run
        values = np.random.default_rng(seed).integers(-(2**31), 2**31, n).astype(dtype)  # not an arange: values move
        theirs, mine = values.copy(), values.copy()
        numpy_rng, native_rng = np.random.Generator(bit_generator(seed)), np.random.Generator(bit_generator(seed))
        numpy_rng.shuffle(theirs)
        native.shuffle_like_numpy(native_rng, torch.from_numpy(mine))
        assert np.array_equal(mine, theirs), (bit_generator.__name__, n, seed)
        # the generator drew exactly what numpy's shuffle draws: the next draws agree
        assert native_rng.integers(0, 2**63, 4).tolist() == numpy_rng.integers(0, 2**63, 4).tolist()


def test_shuffle_of_a_slice_leaves_the_rest_alone():
    values = np.arange(1000, dtype=np.int32)
    rng, reference = np.random.default_rng(3), np.random.default_rng(3)
    native.shuffle_like_numpy(rng, torch.from_numpy(values[100:537]))
    expected = np.arange(1000, dtype=np.int32)
    reference.shuffle(expected[100:537])
    assert np.array_equal(values, expected) and values[:100].tolist() == list(range(100))


@pytest.mark.parametrize("key_dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize("item_dtype", [np.int32, np.int64])
def test_group_is_the_numpy_counting_sort(monkeypatch, key_dtype, item_dtype):
    monkeypatch.setattr(sampler_module, "PLAN_BLOCK", 101)  # the reference crosses block boundaries
    rng = np.random.default_rng()
    for n, bound in ((1, 2), (2, 2), (257, 3), (5003, 300), (5003, 5000), (20_011, 70_000)):
        bound = min(bound, int(np.iinfo(key_dtype).max) + 1)
        keys = rng.integers(0, bound, n).astype(key_dtype)
        seq = rng.permutation(n).astype(item_dtype)
        mine = sampler_module._group(keys, bound, seq)
        monkeypatch.setattr(sampler_module, "NATIVE", None)
        theirs = sampler_module._group(keys, bound, seq)
        monkeypatch.setattr(sampler_module, "NATIVE", native)
        assert mine.dtype == theirs.dtype == item_dtype
        assert np.array_equal(mine, theirs), (n, bound)
        assert np.array_equal(mine, seq[np.argsort(keys[seq], kind="stable")])  # and what it stands for


def test_group_writes_every_slot_and_advances_the_cursors():
    rng = np.random.default_rng()
    n, bound = 3001, 17
    keys = rng.integers(0, bound, n).astype(np.uint8)
    seq = rng.permutation(n).astype(np.int32)
    counts = np.bincount(keys, minlength=bound)
    cursor = np.cumsum(counts) - counts
    out = np.full(n, -7, dtype=np.int32)  # poisoned
    native.group_by_key(*(torch.from_numpy(a) for a in (seq, keys, cursor, out)))
    assert np.array_equal(out, seq[np.argsort(keys[seq], kind="stable")])
    assert np.array_equal(cursor, np.cumsum(counts))  # each key's cursor past its items


def _group_args(n=10, bound=4, out_n=None):
    keys = np.arange(n, dtype=np.uint8) % bound
    counts = np.bincount(keys, minlength=bound)
    return [torch.from_numpy(a) for a in (np.arange(n, dtype=np.int32), keys, np.cumsum(counts) - counts,
                                          np.zeros(n if out_n is None else out_n, dtype=np.int32))]


def test_group_refuses_bad_arguments():
    seq, keys, cursor, out = _group_args()
    with pytest.raises(IndexError, match=r"seq\[3\] = 10 is not an item of keys \[10\]"):
        native.group_by_key(torch.tensor([0, 1, 2, 10, 4], dtype=torch.int32), keys, cursor.clone(), out)
    with pytest.raises(IndexError, match=r"the key of item 3 is 3, keys must be < 3"):
        native.group_by_key(seq, keys, cursor[:3].clone(), out)
    seq, keys, cursor, out = _group_args(out_n=9)  # one slot short
    with pytest.raises(IndexError, match=r"cursor reached 9, past out \[9\]"):
        native.group_by_key(seq, keys, cursor, out)
    seq, keys, cursor, out = _group_args()
    with pytest.raises(ValueError, match="out must have seq's dtype Int, got Long"):
        native.group_by_key(seq, keys, cursor, out.long())
    with pytest.raises(ValueError, match="cursor must be int64, got Int"):
        native.group_by_key(seq, keys, cursor.int(), out)
    with pytest.raises(ValueError, match="keys must be 8, 16, 32 or 64-bit ints, got Float"):
        native.group_by_key(seq, keys.float(), cursor, out)
    with pytest.raises(ValueError, match=r"seq must be a contiguous 1-D CPU tensor, got cpu shape \[5\] strides \[2\]"):
        native.group_by_key(seq[::2], keys, cursor, out)


def test_shuffle_refuses_bad_arguments():
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="data must be int32 or int64, got Float"):
        native.shuffle_like_numpy(rng, torch.zeros(5))
    with pytest.raises(ValueError, match=r"data must be a contiguous 1-D CPU tensor, got cpu shape \[2, 3\]"):
        native.shuffle_like_numpy(rng, torch.zeros(2, 3, dtype=torch.int64))


@pytest.mark.parametrize("item_dtype", [np.int32, np.int64])
def test_packed_grouping_is_the_numpy_counting_sort(monkeypatch, item_dtype):
    monkeypatch.setattr(sampler_module, "PLAN_BLOCK", 101)  # packed a block at a time
    rng = np.random.default_rng()
    for n, bound in ((0, 1), (1, 1), (2, 2), (5003, 300), (20_011, 70_000)):
        keys = rng.integers(0, bound, n)
        seed = int(rng.integers(0, 2**32))
        mine = sampler_module._shuffled_groups(np.random.default_rng(seed), n, lambda r0: keys[r0 : r0 + 101], bound)
        monkeypatch.setattr(sampler_module, "NATIVE", None)
        theirs = sampler_module._group(keys, bound, np.random.default_rng(seed).permutation(n).astype(mine.dtype))
        monkeypatch.setattr(sampler_module, "NATIVE", native)
        assert np.array_equal(mine, theirs), (n, bound)
        out = np.full(n, -5, dtype=item_dtype)  # poisoned, then the kernel itself
        packed = (keys << 32) | np.random.default_rng(seed).permutation(n)
        packed = packed[np.random.default_rng(seed).permutation(n)]
        counts = np.bincount(keys, minlength=bound)
        native.group_packed(*(torch.from_numpy(a) for a in (packed, np.cumsum(counts) - counts, out)))
        items = packed & 0xFFFFFFFF
        assert np.array_equal(out, items[np.argsort(packed >> 32, kind="stable")])


def test_pack_keys_packs_and_counts():
    keys = np.array([3, 0, 3, 2], dtype=np.int64)
    packed, counts = np.full(4, -1, dtype=np.int64), np.full(5, 2, dtype=np.int64)
    native.pack_keys(torch.from_numpy(keys), 2**32 - 4, torch.from_numpy(packed), torch.from_numpy(counts))
    assert (packed >> 32).tolist() == [3, 0, 3, 2] and (packed & 0xFFFFFFFF).tolist() == [2**32 - 4 + i for i in range(4)]
    assert counts.tolist() == [3, 2, 3, 4, 2]


def test_packing_refuses_bad_arguments():
    keys, packed, counts = torch.tensor([1, 4, 0]), torch.zeros(3, dtype=torch.int64), torch.zeros(4, dtype=torch.int64)
    with pytest.raises(IndexError, match=r"keys\[1\] = 4, keys must be in \[0, 4\)"):
        native.pack_keys(keys, 0, packed, counts)
    with pytest.raises(ValueError, match=r"items and keys must be < 2\^32, got items from 4294967294 to 4294967297"):
        native.pack_keys(torch.tensor([1, 2, 0]), 2**32 - 2, packed, counts)
    with pytest.raises(ValueError, match=r"packed must hold one word per key \(3\), got 2"):
        native.pack_keys(torch.tensor([1, 2, 0]), 0, packed[:2], counts)
    with pytest.raises(ValueError, match="keys, packed and counts must be int64, got Int"):
        native.pack_keys(torch.tensor([1, 2, 0], dtype=torch.int32), 0, packed, counts)
    words = torch.tensor([(1 << 32) | 7, (5 << 32) | 8])
    with pytest.raises(IndexError, match=r"packed\[1\]'s key is 5, keys must be < 4"):
        native.group_packed(words, torch.tensor([0, 0, 1, 1]), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(IndexError, match=r"key 1's cursor reached 2, past out \[2\]"):
        native.group_packed(words[:1], torch.tensor([0, 2]), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="out must be int32 or int64, got Float"):
        native.group_packed(words[:1], torch.tensor([0, 0]), torch.zeros(2))


@pytest.mark.parametrize("key_dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_counts_are_numpys_bincount(key_dtype):
    rng = np.random.default_rng()
    for n, bound in ((0, 1), (1, 1), (999, 7), (10_007, 300), (10_007, 70_000)):
        bound = min(bound, int(np.iinfo(key_dtype).max) + 1)
        keys = rng.integers(0, bound, n).astype(key_dtype)
        assert np.array_equal(sampler_module._counts(keys, bound + 3), np.bincount(keys, minlength=bound + 3))
    counts = np.full(4, 10, dtype=np.int64)  # counts are added to
    native.count_keys(torch.tensor([3, 0, 3], dtype=torch.uint8), torch.from_numpy(counts))
    assert counts.tolist() == [11, 10, 10, 12]


def test_counts_refuse_bad_arguments():
    with pytest.raises(IndexError, match=r"keys\[2\] = 4, keys must be < 4 \(the counts\)"):
        native.count_keys(torch.tensor([3, 0, 4], dtype=torch.uint8), torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="counts must be int64, got Int"):
        native.count_keys(torch.tensor([3, 0], dtype=torch.uint8), torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="keys must be 8, 16, 32 or 64-bit ints, got Float"):
        native.count_keys(torch.zeros(3), torch.zeros(4, dtype=torch.int64))


@pytest.mark.parametrize("rank_dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
@pytest.mark.parametrize("item_dtype", [np.int32, np.int64])
def test_sort_segments_is_the_numpy_sort(monkeypatch, rank_dtype, item_dtype):
    monkeypatch.setattr(sampler_module, "PLAN_BLOCK", 97)  # the reference takes several segments a block
    rng = np.random.default_rng()
    # few ranks (a counting sort per segment) and far more ranks than a segment's items (a comparison sort)
    for n, count in ((0, 3), (1, 1), (211, 5), (4099, 225), (4099, 70_000), (3001, 2**40)):
        count = min(count, int(np.iinfo(rank_dtype).max) + 1)
        ranks = rng.integers(0, count, n + 13).astype(rank_dtype)  # ranks of more items than are sorted
        items = rng.permutation(n + 13)[:n].astype(item_dtype)
        cuts = np.sort(rng.integers(0, n + 1, rng.integers(0, 40)))
        bounds = np.concatenate([[0], cuts, [n]]).astype(np.int64)  # empty segments included
        mine, theirs = items.copy(), items.copy()
        sampler_module._sort_segments(mine, bounds, ranks, count)
        monkeypatch.setattr(sampler_module, "NATIVE", None)
        sampler_module._sort_segments(theirs, bounds, ranks, count)
        monkeypatch.setattr(sampler_module, "NATIVE", native)
        assert np.array_equal(mine, theirs), (n, count)
        for s0, s1 in zip(bounds[:-1], bounds[1:]):  # and what it stands for
            part = items[s0:s1]
            assert np.array_equal(mine[s0:s1], part[np.argsort(ranks[part], kind="stable")])


def test_sort_segments_refuses_bad_arguments():
    items = torch.arange(10, dtype=torch.int32)
    ranks = torch.from_numpy(np.arange(10, dtype=np.uint8) % 3)
    bounds = torch.tensor([0, 4, 10])
    with pytest.raises(IndexError, match=r"bounds\[1:3\] = \[4, 11\] is not a segment of items \[10\]"):
        native.sort_segments(items, torch.tensor([0, 4, 11]), ranks, 3)
    with pytest.raises(IndexError, match=r"bounds\[0:2\] = \[5, 4\] is not a segment"):
        native.sort_segments(items, torch.tensor([5, 4, 10]), ranks, 3)
    before = items.clone()
    with pytest.raises(IndexError, match=r"the rank of item 2 is 2, ranks must be < 2"):
        native.sort_segments(items, bounds, ranks, 2)
    with pytest.raises(IndexError, match=r"items\[3\] = 12 is not an item of ranks \[10\]"):
        native.sort_segments(torch.tensor([0, 1, 2, 12], dtype=torch.int32), torch.tensor([0, 4]), ranks, 3)
    assert torch.equal(items, before)  # a refused segment is left as it was
    with pytest.raises(ValueError, match="bounds must be int64, got Int"):
        native.sort_segments(items, bounds.int(), ranks, 3)
    with pytest.raises(ValueError, match="ranks must be 8, 16, 32 or 64-bit ints, got Double"):
        native.sort_segments(items, bounds, ranks.double(), 3)
    with pytest.raises(ValueError, match="items must be int32 or int64, got Short"):
        native.sort_segments(items.short(), bounds, ranks, 3)


# ---- the samplers' plans: the same with and without the library ---------------------------------
@pytest.mark.parametrize("n", [1, 977, 20_000])
def test_plans_are_the_same_without_the_library(monkeypatch, n):
    rng = np.random.default_rng(n)
    shapes = rng.integers(1, 4, (n, 2))
    widths = rng.integers(1, 300, n)
    chunks = rng.integers(0, max(1, n // 7), n)

    def plans():
        samplers = [ShapeBucketBatchSampler(shapes, 8, seed=2), WidthBucketBatchSampler(widths, 8, seed=2),
                    ShapeBucketBatchSampler(shapes, 8, seed=2, chunks=chunks, chunk_window=5),
                    WidthBucketBatchSampler(widths, 8, seed=2, chunks=chunks, chunk_window=5, drop_last=True)]
        for sampler in samplers:
            sampler.set_epoch(3)
        return [sampler.epoch_batches() for sampler in samplers]

    compiled = plans()
    monkeypatch.setattr(sampler_module, "NATIVE", None)
    for mine, theirs in zip(compiled, plans()):
        assert np.array_equal(mine.items, theirs.items)
        assert np.array_equal(mine.starts, theirs.starts) and np.array_equal(mine.ends, theirs.ends)
