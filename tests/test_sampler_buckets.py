"""ShapeBucketBatchSampler's bucket ids: the same buckets and batches as the lexicographic
``np.unique(axis=0)`` it used to call, at a fraction of its cost on many items."""
from __future__ import annotations


import numpy as np
import pytest

from latentfast.cache import ShapeBucketBatchSampler


def reference_batches(shapes: np.ndarray, batch_size: int, seed: int, epoch: int = 0, drop_last: bool = False):
    """The sampler's epoch as it was written before: rows bucketed by ``np.unique(axis=0)``, each
    bucket's members by ``flatnonzero`` (ascending), then the same seeded shuffles."""
    _, ids = np.unique(shapes, axis=0, return_inverse=True)
    ids = ids.reshape(-1)
    rng = np.random.default_rng([seed, epoch])
    batches = []
    for b in range(int(ids.max()) + 1):
        members = np.flatnonzero(ids == b)
        order = members[rng.permutation(len(members))]
        stop = len(order) - len(order) % batch_size if drop_last else len(order)
        batches += [order[k : k + batch_size].tolist() for k in range(0, stop, batch_size)]
    return [batches[k] for k in rng.permutation(len(batches))]


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint16, np.uint64])
@pytest.mark.parametrize("drop_last", [False, True])
def test_same_batches_as_lexicographic_unique(dtype, drop_last):
    rng = np.random.default_rng(7)
    distinct = rng.integers(0, 300, size=(37, 4)).astype(dtype)
    if np.issubdtype(dtype, np.signedinteger):
        distinct[::3, 1] -= 150  # negative sizes too: keys are offsets from each column's minimum
    shapes = distinct[rng.integers(0, len(distinct), size=5_003)]
    for seed, epoch in ((0, 0), (3, 2)):
        sampler = ShapeBucketBatchSampler(shapes, 16, seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch)
        assert list(sampler) == reference_batches(shapes, 16, seed, epoch, drop_last)


def test_ranges_too_wide_for_one_key_still_bucket_in_order():
    shapes = np.array([[2**62, 1, 5], [0, 2, 5], [2**62, 1, 5], [-(2**62), 2**40, 3]], dtype=np.int64)
    sampler = ShapeBucketBatchSampler(shapes, 1, seed=0)
    assert sampler.buckets.tolist() == [2, 1, 2, 0]
    assert sorted(map(tuple, sampler)) == [(0,), (1,), (2,), (3,)]


@pytest.mark.slow
def test_ten_million_items_build_without_a_row_sort(monkeypatch):
    """Before: 100 s, np.unique(axis=0) over the items' shape rows alone took 98 s. The time is measured in
    latentfast/bench/bench_sampler.py; here the slow path is simply never taken for shapes of ordinary ranges."""
    rng = np.random.default_rng(0)
    distinct = np.stack([np.full(100, 4), rng.integers(1, 9, 100), 8 * rng.integers(8, 64, 100), 8 * rng.integers(8, 64, 100)], 1)
    shapes = distinct[rng.integers(0, 100, size=10_000_000)]
    unique, row_sorts = np.unique, []

    def spy(values, *args, **kwargs):
        if kwargs.get("axis") is not None:
            row_sorts.append(np.shape(values))
        return unique(values, *args, **kwargs)

    monkeypatch.setattr(np, "unique", spy)
    sampler = ShapeBucketBatchSampler(shapes, 32, seed=0)
    monkeypatch.undo()
    assert not row_sorts, f"np.unique(axis=...) over {row_sorts}"
    assert sum(len(m) for m in sampler._members) == len(shapes)
    assert len(sampler._members) == len(np.unique(distinct, axis=0))
