"""Shaped caches: LatentCacheWriter (append, resume by key, crash safety, checks), the reader's shapes
and keys on every cache, read_batch of one-shape batches (CPU gather through the flat view), and
ShapeBucketBatchSampler (coverage, rank balance, resume)."""
from __future__ import annotations

import json
import os
import pickle
import time
import zlib

import numpy as np
import pytest
import torch

from latentfast.cache import (
    IncompleteCacheError,
    LatentCache,
    LatentCacheWriter,
    ShapeBucketBatchSampler,
    cache_path,
    read_batch,
    verify_cache,
)
from latentfast.errors import CacheCorruptError, CacheError, CacheLockedError, InvalidArgumentError, NonFiniteError
from latentfast.testing import kill_and_resume, poisoned_like, random_rows, write_cache

SHAPES = [(4, 6, 8), (4, 8, 6), (4, 6, 6), (4, 6, 8), (4, 10, 3)]


def random_items(n, seed=0, shapes=SHAPES):
    rng = np.random.default_rng(seed)
    return [(f"item-{i:03d}", rng.standard_normal(shapes[i % len(shapes)]).astype(np.float32)) for i in range(n)]


def write(folder, items, **kw):
    with LatentCacheWriter(folder, encoder={"pretrained": "test", "latent_channels": 4}, **kw) as writer:
        for key, latent in items:
            writer.append(key, latent, source_hash=zlib.crc32(key.encode()).to_bytes(4, "little") * 4)
    return LatentCache(folder)


def test_writer_round_trip_shapes_keys_and_index(tmp_path):
    items = random_items(23)
    cache = write(str(tmp_path), items)
    assert cache.shaped and cache.layout == "shaped" and len(cache) == 23
    assert cache.keys == [k for k, _ in items]
    assert cache.shapes.dtype == np.int64 and cache.shapes.tolist() == [list(z.shape) for _, z in items]
    for i, (_, z) in enumerate(items):
        got = cache[i]
        assert got.dtype == torch.float16 and tuple(got.shape) == z.shape
        assert np.array_equal(got.numpy(), z.astype(np.float16))  # float32 sources stored as float16
    # back to back, no padding: the data file is exactly the items, and row_starts addresses them
    sizes = [z.size for _, z in items]
    assert os.path.getsize(cache_path(str(tmp_path), "train", "data")) == 2 * sum(sizes)
    assert cache.row_starts.tolist() == np.concatenate([[0], np.cumsum(sizes)]).tolist()
    assert cache.meta["encoder"] == {"latent_channels": 4, "pretrained": "test"}
    assert (cache.channels, cache.latent_h, cache.w_max, cache.meta["ndim"]) == (4, 10, 8, 3)
    assert verify_cache(str(tmp_path))["rows"] == 23
    clone = pickle.loads(pickle.dumps(cache))
    assert torch.equal(clone[7], cache[7]) and clone.keys == cache.keys


def test_line_caches_have_shapes_and_keys(tmp_path):
    rows, widths = random_rows(np.random.default_rng(0), 5, 4, 2, 9)
    cache = write_cache(str(tmp_path), rows, widths, w_max=9)
    assert cache.shapes.tolist() == [[4, 2, int(w)] for w in widths]
    assert cache.keys == ["0", "1", "2", "3", "4"]  # the original format stores no keys: row numbers
    assert not cache.shaped


def test_read_batch_of_one_shape(tmp_path):
    items = random_items(30, seed=1)
    cache = write(str(tmp_path), items)
    same = [i for i in range(30) if cache.shapes[i].tolist() == [4, 6, 8]]
    index = same[::-1] + same[:2]  # any order, duplicates allowed
    for dtype in (torch.float16, torch.float32, torch.bfloat16):
        latents, shapes = read_batch(cache, index, dtype=dtype)
        assert latents.dtype == dtype and tuple(latents.shape) == (len(index), 4, 6, 8)
        assert shapes.dtype == torch.int64 and shapes.tolist() == [[4, 6, 8]] * len(index)
        for j, i in enumerate(index):
            assert torch.equal(latents[j], torch.from_numpy(items[i][1].astype(np.float16)).to(dtype))
    out = poisoned_like((3, 4, 6, 8), torch.float32)
    got, _ = cache.read_batch(np.asarray(same[:3]), dtype=torch.float32, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out, torch.stack([cache[i].float() for i in same[:3]]))


def test_read_batch_refuses_mixed_shapes_and_bad_arguments(tmp_path):
    cache = write(str(tmp_path), random_items(10))
    with pytest.raises(ValueError, match=r"one shape.*\[4, 6, 8\].*\[4, 8, 6\].*ShapeBucketBatchSampler"):
        read_batch(cache, [0, 1])
    with pytest.raises(IndexError, match="out of range"):
        read_batch(cache, [0, 10])
    with pytest.raises(ValueError, match="width applies to line caches only"):
        read_batch(cache, [0, 3], width=12)
    with pytest.raises(ValueError, match="out must have shape"):
        read_batch(cache, [0, 3], out=torch.empty(2, 4, 8, 6, dtype=torch.float16))
    latents, shapes = read_batch(cache, [])
    assert latents.shape[0] == 0 and tuple(shapes.shape) == (0, 3)


def test_writer_checks_its_input(tmp_path):
    with LatentCacheWriter(str(tmp_path)) as writer:
        writer.append("a", np.zeros((4, 2, 2), np.float32))
        with pytest.raises(InvalidArgumentError, match="already written"):
            writer.append("a", np.zeros((4, 2, 2), np.float32))
        with pytest.raises(InvalidArgumentError, match=r"3-D with 4 channels"):
            writer.append("b", np.zeros((3, 2, 2), np.float32))
        with pytest.raises(InvalidArgumentError, match=r"3-D with 4 channels"):
            writer.append("b", np.zeros((4, 1, 2, 2), np.float32))
        with pytest.raises(NonFiniteError, match=r"key 'c'.*beyond \+-65504"):
            writer.append("c", np.full((4, 2, 2), 1e5, np.float32))  # finite in float32, inf in float16
        with pytest.raises(InvalidArgumentError, match="floating point"):
            writer.append("d", np.zeros((4, 2, 2), np.int32))
        with pytest.raises(InvalidArgumentError, match="non-empty str"):
            writer.append("", np.zeros((4, 2, 2), np.float32))
    assert LatentCache(str(tmp_path)).keys == ["a"]
    with pytest.raises(InvalidArgumentError, match="no items"):
        LatentCacheWriter(str(tmp_path / "empty")).finish()


def test_writer_resumes_by_key_and_an_interrupted_cache_does_not_open(tmp_path):
    items = random_items(20, seed=2)
    folder = str(tmp_path / "out")
    writer = LatentCacheWriter(folder, flush_every=4)
    for key, latent in items[:11]:
        writer.append(key, latent)
    writer._close_files()  # a crash: items 8..10 were written but never logged
    writer._lock.release()
    with pytest.raises(IncompleteCacheError, match="resume"):
        LatentCache(folder)
    with LatentCacheWriter(folder, flush_every=4) as writer:
        assert writer.resumed and len(writer) == 8 and "item-007" in writer and "item-008" not in writer
        for key, latent in items:
            if key not in writer:
                writer.append(key, latent)
    reference = write(str(tmp_path / "ref"), items)
    assert open(cache_path(folder, "train", "data"), "rb").read() == open(cache_path(reference.cache_dir, "train", "data"), "rb").read()
    assert LatentCache(folder).keys == reference.keys
    assert not os.path.exists(cache_path(folder, "train", "progress"))
    # a resumed run that ends with fewer bytes than the crashed run had written leaves no stale tail
    short = str(tmp_path / "short")
    writer = LatentCacheWriter(short, flush_every=2)
    for key, latent in items[:5]:
        writer.append(key, latent)
    writer._close_files()  # crash: item 4 written, not logged
    writer._lock.release()
    with LatentCacheWriter(short) as writer:
        assert len(writer) == 4
    assert len(LatentCache(short)) == 4 and verify_cache(short)["rows"] == 4
    # another header (encoder) does not resume the log: it starts over
    writer = LatentCacheWriter(str(tmp_path / "other"), encoder={"pretrained": "a"})
    writer.append("x", np.ones((4, 2, 2), np.float32))
    writer.close()
    with LatentCacheWriter(str(tmp_path / "other"), encoder={"pretrained": "b"}) as again:
        assert not again.resumed and len(again) == 0
        again.append("y", np.ones((4, 2, 2), np.float32))
    assert LatentCache(str(tmp_path / "other")).keys == ["y"]


def test_short_writes_are_completed_and_crcs_come_from_the_intended_bytes(tmp_path, monkeypatch):
    """os.pwrite may write fewer bytes than asked (a disk filling up): the writer loops until every
    byte is written, and a write that makes no progress raises instead of leaving zeros."""
    items = random_items(6, seed=3)
    real = os.pwrite

    def short(fd, data, offset):
        data = memoryview(data).cast("B")
        return real(fd, data[: max(1, len(data) // 3)], offset)  # a third at a time

    monkeypatch.setattr(os, "pwrite", short)
    cache = write(str(tmp_path / "a"), items)
    for i, (_, z) in enumerate(items):
        assert np.array_equal(cache[i].numpy(), z.astype(np.float16))
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: 0)  # disk full
    writer = LatentCacheWriter(str(tmp_path / "b"))
    with pytest.raises(OSError, match="no progress"):
        writer.append("a", items[0][1])
    writer.close()


def test_finish_reads_back_and_refuses_bytes_that_differ(tmp_path):
    items = random_items(5, seed=4)
    folder = str(tmp_path)
    writer = LatentCacheWriter(folder)
    for key, latent in items:
        writer.append(key, latent)
    writer.flush()
    partial = cache_path(folder, "train", "data") + ".partial"
    with open(partial, "r+b") as fh:  # item 2's bytes change on disk after they were written
        fh.seek(2 * (items[0][1].size + items[1][1].size) + 6)
        fh.write(b"\x00\x7c")
    with pytest.raises(CacheCorruptError, match="item 2 .*item-002.*run the same build again"):
        writer.finish()
    writer.close()
    with pytest.raises(IncompleteCacheError):
        LatentCache(folder)
    with LatentCacheWriter(folder) as writer:  # the rerun rewrites item 2 and the ones after it
        assert writer.keys == ["item-000", "item-001"]
        for key, latent in items[2:]:
            writer.append(key, latent)
    assert verify_cache(folder)["rows"] == 5


def test_a_second_writer_is_locked_out(tmp_path):
    first = LatentCacheWriter(str(tmp_path))
    with pytest.raises(CacheLockedError, match=rf"pid {os.getpid()}"):
        LatentCacheWriter(str(tmp_path))
    t0 = time.monotonic()
    with pytest.raises(CacheLockedError):
        LatentCacheWriter(str(tmp_path), lock_timeout=0.3)
    assert time.monotonic() - t0 >= 0.3
    LatentCacheWriter(str(tmp_path), split="val").close()  # another split is another lock
    first.close()
    LatentCacheWriter(str(tmp_path)).close()


WRITER_SCRIPT = """
import sys
import numpy as np
from latentfast.cache import LatentCacheWriter
from latentfast.testing import hold_when
folder = sys.argv[1]
rng = np.random.default_rng(0)
items = [(f"k{i:03d}", rng.standard_normal((4, 5 + i % 3, 6)).astype(np.float32)) for i in range(60)]
written = 0
with LatentCacheWriter(folder, flush_every=2) as writer:
    for key, z in items:
        if key in writer:
            continue
        writer.append(key, z)
        written += 1
        hold_when(written == int(sys.argv[2]))  # the test kills it here, on its first run
print("written", written)
"""


@pytest.mark.slow
@pytest.mark.timeout(900)  # a hang guard only: three Python processes under whatever load the machine has
def test_writer_sigkill_and_resume(tmp_path):
    folder, ref = str(tmp_path / "out"), str(tmp_path / "ref")

    def incomplete():
        with pytest.raises(IncompleteCacheError):
            LatentCache(folder)

    logged, written = kill_and_resume(WRITER_SCRIPT, folder, ref, between=incomplete)
    assert written <= 60 - logged  # the logged items were not written again
    for kind in ("data", "shapes", "offsets", "keys", "checksums", "meta"):
        assert open(cache_path(folder, "train", kind), "rb").read() == open(cache_path(ref, "train", kind), "rb").read(), kind


# -- the sampler -------------------------------------------------------------------------------

def bucket_shapes(counts):
    return np.asarray([[4, 8 + 2 * b, 8] for b, c in enumerate(counts) for _ in range(c)])


def test_sampler_batches_are_one_shape_and_cover_every_item_once():
    shapes = bucket_shapes([10, 3, 7, 1])
    sampler = ShapeBucketBatchSampler(shapes, 4, seed=0)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 3 + 1 + 2 + 1
    assert sorted(i for b in batches for i in b) == list(range(21))
    for b in batches:
        assert len({tuple(shapes[i]) for i in b}) == 1 and 1 <= len(b) <= 4
    assert batches == list(ShapeBucketBatchSampler(shapes, 4, seed=0))  # seeded
    assert batches != list(ShapeBucketBatchSampler(shapes, 4, seed=1))
    sampler.set_epoch(1)
    assert list(sampler) != batches  # a new order each epoch
    dropped = list(ShapeBucketBatchSampler(shapes, 4, seed=0, drop_last=True))
    assert all(len(b) == 4 for b in dropped) and len(dropped) == 2 + 0 + 1 + 0
    labels = ["a", "b", "a", "c", "b"]  # plain bucket labels work too
    assert sorted(len(b) for b in ShapeBucketBatchSampler(labels, 2, seed=0)) == [1, 2, 2]


@pytest.mark.parametrize("world_size", [1, 2, 3, 8])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_ranks_get_equal_batches(world_size, drop_last):
    shapes = bucket_shapes([13, 5, 9, 2, 1])
    samplers = [ShapeBucketBatchSampler(shapes, 3, seed=5, rank=r, world_size=world_size, drop_last=drop_last)
                for r in range(world_size)]
    per_rank = [list(s) for s in samplers]
    assert len({len(b) for b in per_rank}) == 1 and all(len(b) == len(s) for b, s in zip(per_rank, samplers))
    seen = [i for batches in per_rank for b in batches for i in b]
    if drop_last:
        assert len(seen) == len(set(seen))  # nothing repeated
    else:
        assert set(seen) == set(range(len(shapes)))  # everything seen at least once
    for batches in per_rank:
        for b in batches:
            assert len({tuple(shapes[i]) for i in b}) == 1


def test_sampler_resumes_mid_epoch():
    shapes = bucket_shapes([11, 6, 9])
    sampler = ShapeBucketBatchSampler(shapes, 2, seed=3, rank=1, world_size=2)
    sampler.set_epoch(4)
    full = list(sampler)
    sampler.set_epoch(4)
    it = iter(sampler)
    first = [next(it) for _ in range(3)]
    state = sampler.state_dict()
    resumed = ShapeBucketBatchSampler(shapes, 2, seed=3, rank=1, world_size=2)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    assert first + list(resumed) == full
    assert list(resumed) == full  # the next pass is the epoch again from its start
    with pytest.raises(ValueError, match="batch_size=2"):
        ShapeBucketBatchSampler(shapes, 3, seed=3, rank=1, world_size=2).load_state_dict(state)


def test_sampler_argument_errors():
    shapes = bucket_shapes([3])
    with pytest.raises(ValueError, match="batch_size must be an int >= 1"):
        ShapeBucketBatchSampler(shapes, 0)
    with pytest.raises(ValueError, match="rank must be < world_size"):
        ShapeBucketBatchSampler(shapes, 1, rank=2, world_size=2)
    with pytest.raises(TypeError, match="batch_size must be an int"):
        ShapeBucketBatchSampler(shapes, 2.0)
    assert len(ShapeBucketBatchSampler(shapes, np.int64(2))) == 2  # numpy ints are ints
    with pytest.raises(ValueError, match="shapes must be"):
        ShapeBucketBatchSampler(np.zeros((2, 2, 2), int), 1)


def test_sampler_feeds_read_batch_and_the_batch_loader(tmp_path):
    from latentfast.cache import batch_loader

    items = random_items(17, seed=6)
    cache = write(str(tmp_path), items)
    sampler = ShapeBucketBatchSampler(cache.shapes, 3, seed=0)
    for latents, shapes, index in batch_loader(cache, sampler):
        assert tuple(latents.shape[1:]) == tuple(shapes[0].tolist())
        for j, i in enumerate(index.tolist()):
            assert torch.equal(latents[j], cache[i])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_read_batch_to_cuda_equals_cpu(tmp_path):
    cache = write(str(tmp_path), random_items(40, seed=7))
    for batch in ShapeBucketBatchSampler(cache.shapes, 5, seed=0):
        for dtype in (torch.float16, torch.float32):
            gpu, shapes = read_batch(cache, batch, device="cuda", dtype=dtype)
            cpu, _ = read_batch(cache, batch, dtype=dtype)
            assert gpu.is_cuda and torch.equal(gpu.cpu(), cpu) and shapes.tolist() == cache.shapes[batch].tolist()


def test_cache_error_classes():
    assert issubclass(CacheLockedError, CacheError) and issubclass(CacheCorruptError, ValueError)


def test_shape_sampler_shows_upcoming_batches_without_consuming():
    # LookaheadSampler peeks a sampler through upcoming(); it must not advance the resumable state
    sampler = ShapeBucketBatchSampler(bucket_shapes([5, 3, 4]), 2, seed=1)
    expected = sampler.rank_batches()
    assert sampler.upcoming(3) == expected[:3] and sampler.consumed == 0
    for step, batch in enumerate(sampler):
        assert batch == expected[step]
        assert sampler.upcoming(2) == expected[step + 1 : step + 3]
