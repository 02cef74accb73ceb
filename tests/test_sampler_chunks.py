"""Chunk-aware shuffling (``chunks=`` / ``chunk_window=``) and resuming at another world size.

A node's local chunk cache is modelled as an LRU of chunk ids: the fetch counts are a property of
the batch order (how many times a chunk leaves the window and comes back), not a timing."""
from __future__ import annotations

import collections
import json
import zlib

import numpy as np
import pytest
import torch

from latentfast.cache import LatentCache, LatentCacheWriter, ShapeBucketBatchSampler, WidthBucketBatchSampler, item_chunks

N = 997  # odd: short batches and uneven chunks


def widths_and_chunks(n=N, items_per_chunk=10, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(1, 200, n), np.arange(n) // items_per_chunk


def shapes_for(n=N, seed=0):
    rng = np.random.default_rng(seed)
    distinct = np.array([[4, 8, 8], [4, 8, 12], [4, 12, 8], [4, 6, 6]])
    return distinct[rng.choice(4, size=n, p=[0.4, 0.3, 0.2, 0.1])]


def make(kind, batch_size=16, **kw):
    widths, chunks = widths_and_chunks()
    kw.setdefault("chunks", chunks)
    kw.setdefault("chunk_window", 4)
    if kw["chunks"] is None:
        kw.pop("chunk_window")
    if kind == "width":
        kw.setdefault("bucket_batches", 2)
        return WidthBucketBatchSampler(widths, batch_size, **kw)
    return ShapeBucketBatchSampler(shapes_for(), batch_size, **kw)


def lru_fetches(batches, chunk_of, capacity):
    """Chunk downloads of a node reading ``batches`` in order through an LRU of ``capacity`` chunks."""
    cache, fetches = collections.OrderedDict(), 0
    for batch in batches:
        for c in dict.fromkeys(chunk_of[batch].tolist()):
            if c in cache:
                cache.move_to_end(c)
                continue
            fetches += 1
            cache[c] = True
            if len(cache) > capacity:
                cache.popitem(last=False)
    return fetches


@pytest.mark.parametrize("kind", ["width", "shape"])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("window", [1, 3, 40, 1000])
def test_every_item_once_per_epoch_with_the_full_shuffles_batches(kind, drop_last, window):
    sampler = make(kind, drop_last=drop_last, chunk_window=window)
    full = make(kind, drop_last=drop_last, chunks=None)
    for epoch in (0, 3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler) == len(list(full))
        items = [i for b in batches for i in b]
        assert len(items) == len(set(items)), "an item twice in one epoch"
        # the same batch sizes as the full shuffle: whole batches, and the same short ones
        assert sorted(map(len, batches)) == sorted(map(len, full))
        if kind == "shape":
            shapes = sampler.buckets
            assert all(len(set(shapes[b].tolist())) == 1 for b in batches), "a batch mixes shapes"
            kept = sum(len(b) for b in full)
            assert len(items) == kept
            if not drop_last:
                assert sorted(items) == list(range(N))
        else:
            assert all(len(b) == 16 for b in batches[:-1]), "only the last batch may be short"
            if drop_last:
                assert len(items) == N // 16 * 16
            else:
                assert sorted(items) == list(range(N))


@pytest.mark.parametrize("kind", ["width", "shape"])
def test_deterministic_from_seed_and_epoch(kind):
    a, b = make(kind, seed=7), make(kind, seed=7)
    a.set_epoch(2), b.set_epoch(2)
    assert list(a) == list(b)
    b.set_epoch(3)
    assert list(a) != list(b), "every epoch the same order"
    other_seed = make(kind, seed=8)
    other_seed.set_epoch(2)
    assert list(a) != list(other_seed), "the seed is ignored"
    assert list(make(kind)) != list(make(kind, chunks=None)), "chunks= changes nothing"


@pytest.mark.parametrize("kind", ["width", "shape"])
@pytest.mark.parametrize("world_size", [1, 3])
def test_each_chunk_fetched_about_once_per_node_vs_a_full_shuffle(kind, world_size):
    _, chunk_of = widths_and_chunks()  # 100 chunks of 10 items
    # the shape sampler's rarest bucket (10%) needs ~16 items in a window not to wait for later ones
    window = 4 if kind == "width" else 12
    # between a chunk's last use in its window and its leftovers' batch in the next: at most the
    # rest of its window, the window before's leftovers and the next window -- 3 windows of chunks
    capacity = 3 * window
    windowed, full = [], []
    for rank in range(world_size):
        windowed.append(list(make(kind, chunk_window=window, rank=rank, world_size=world_size)))
        full.append(list(make(kind, chunks=None, rank=rank, world_size=world_size)))
    for rank in range(world_size):
        touched = len(set(chunk_of[np.concatenate(windowed[rank])].tolist()))
        fetched = lru_fetches(windowed[rank], chunk_of, capacity)
        if kind == "width":  # leftovers live one window: exactly once
            assert fetched == touched
        else:  # a bucket with fewer than a batch of items in a window carries its leftovers further
            assert fetched <= 1.15 * touched, (fetched, touched)
        assert lru_fetches(full[rank], chunk_of, capacity) > 1.8 * fetched, "a full shuffle fetches as rarely"


def test_windows_hold_k_chunks_in_random_order():
    sampler = make("width", chunk_window=5, bucket_batches=64)
    _, chunk_of = widths_and_chunks()
    batches = list(sampler)
    # the first window: 5 chunks (50 items) -> 3 whole batches of 16 from those chunks alone
    first = chunk_of[np.concatenate(batches[:3])]
    assert len(set(first.tolist())) <= 5
    assert not set(first.tolist()) <= set(range(5)), "chunks taken in file order"


def global_order(sampler_factory, world_size, start_state=None):
    """Each rank's batches, as (global index, batch) pairs: rank r's k-th is p + r + k * world_size."""
    out = []
    for rank in range(world_size):
        s = sampler_factory(rank, world_size)
        if start_state is not None:
            s.load_state_dict(json.loads(json.dumps(start_state)))
        p = s.start
        out += [(p + rank + k * world_size, b) for k, b in enumerate(s)]
    return out


@pytest.mark.parametrize("kind", ["width", "shape"])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("resume_at", [4, 2, 3, 1, 5])
def test_resume_mid_epoch_at_another_world_size_sees_each_batch_once(kind, chunked, drop_last, resume_at):
    def factory(rank, world_size):
        s = make(kind, rank=rank, world_size=world_size, drop_last=drop_last, **({} if chunked else {"chunks": None}))
        s.set_epoch(5)
        return s

    reference = list(factory(0, 1))  # the global order: the same at any world size
    total = len(reference)
    saved_at, steps = 4, 7
    ranks = [factory(r, saved_at) for r in range(saved_at)]
    before = []
    for rank, s in enumerate(ranks):
        it = iter(s)
        before += [(rank + k * saved_at, next(it)) for k in range(steps)]
    state = ranks[2].state_dict()  # any rank's: they stepped together
    assert state["position"] == saved_at * steps and state["world_size"] == saved_at
    after = global_order(factory, resume_at, state)
    seen = sorted(before + after, key=lambda pair: pair[0])
    positions = [p for p, _ in seen]
    assert positions == list(range(len(seen))), "a batch twice or lost"
    remaining = total - saved_at * steps
    if drop_last:
        assert len(seen) == saved_at * steps + remaining - remaining % resume_at
    else:
        assert len(seen) == saved_at * steps + remaining + (-remaining % resume_at)
    for p, batch in seen:
        assert batch == reference[p] if p < total else reference[p - total], f"global batch {p} differs"
    # after the resumed pass, the next iteration is the whole epoch again
    again = factory(resume_at - 1, resume_at)
    again.load_state_dict(state)
    list(again)
    assert list(again) == list(factory(resume_at - 1, resume_at))


def remaining(reference, position, rank, world_size):
    """Rank ``rank``'s batches from global ``position`` on: the rest of the epoch, filled to whole
    rounds with its first batches (no drop_last), every world_size-th."""
    rest = reference[position:]
    rest += reference[: -len(rest) % world_size]
    return rest[rank::world_size]


def test_state_dict_consumed_for_a_prefetching_loader_and_old_states():
    def factory(rank, world_size):
        s = make("shape", rank=rank, world_size=world_size)
        s.set_epoch(1)
        return s

    reference = list(factory(0, 1))
    assert len(reference) % 2 == 1 and len(reference) % 3 != 0, "the fill of the last round goes untested"
    s = factory(1, 2)
    it = iter(s)
    for _ in range(6):
        next(it)  # the sampler ran ahead; the loop used 4
    state = s.state_dict(consumed=4)
    assert state["position"] == 8
    resumed = factory(0, 3)
    resumed.load_state_dict(state)
    assert list(resumed) == remaining(reference, 8, 0, 3)
    # a state saved before positions existed: consumed batches of this rank at its world size
    old = {k: v for k, v in state.items() if k not in ("position", "chunk_window", "chunks_crc32")}
    same = factory(1, 2)
    same.load_state_dict(old)
    assert list(same) == remaining(reference, 8, 1, 2) == list(factory(1, 2))[4:]
    # resumed twice: position counts from where the resumed pass began
    twice = factory(0, 3)
    twice.load_state_dict(state)
    it = iter(twice)
    next(it), next(it)
    assert twice.state_dict()["position"] == 8 + 2 * 3


def test_state_from_another_chunking_is_refused():
    state = make("width", chunk_window=4).state_dict()
    with pytest.raises(ValueError, match="chunk_window=4, this sampler has 5"):
        make("width", chunk_window=5).load_state_dict(state)
    other_chunks = widths_and_chunks(items_per_chunk=11)[1]
    with pytest.raises(ValueError, match="chunks_crc32="):
        make("width", chunks=other_chunks).load_state_dict(state)
    with pytest.raises(ValueError, match="chunk_window=4, this sampler has None"):
        make("width", chunks=None).load_state_dict(state)
    with pytest.raises(ValueError, match="state_dict has no 'epoch'"):
        make("width").load_state_dict({"position": 3})
    with pytest.raises(ValueError, match="position must be an int >= 0"):
        make("width").load_state_dict({**state, "position": -1})


def test_argument_errors():
    widths, chunks = widths_and_chunks()
    with pytest.raises(ValueError, match=r"chunks= needs chunk_window=K"):
        WidthBucketBatchSampler(widths, 4, chunks=chunks)
    with pytest.raises(ValueError, match=r"chunk_window=3 needs chunks="):
        ShapeBucketBatchSampler(shapes_for(), 4, chunk_window=3)
    with pytest.raises(ValueError, match=r"chunks must be one chunk id per item \(997\), got shape \[996\]"):
        WidthBucketBatchSampler(widths, 4, chunks=chunks[:-1], chunk_window=2)
    with pytest.raises(TypeError, match="chunks must be integers, got float64"):
        WidthBucketBatchSampler(widths, 4, chunks=chunks.astype(float), chunk_window=2)
    with pytest.raises(ValueError, match="chunk_window must be an int >= 1"):
        WidthBucketBatchSampler(widths, 4, chunks=chunks, chunk_window=0)
    with pytest.raises(ValueError, match="item_chunks takes a LatentCache or int byte offsets"):
        item_chunks(np.zeros((3, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="item byte offsets must be >= 0, got -5"):
        item_chunks(np.array([0, -5]))
    with pytest.raises(ValueError, match="chunk_bytes must be an int >= 1"):
        item_chunks(np.array([0, 5]), chunk_bytes=0)


def test_item_chunks_of_a_real_cache_are_its_data_files_byte_offsets(tmp_path):
    rng = np.random.default_rng(3)
    shapes = [(4, 8, 8), (4, 16, 12), (4, 5, 7), (4, 32, 32)]  # 512 B .. 8 KiB: chunks of several items, items across boundaries
    latents = [rng.standard_normal(shapes[i % 4]).astype(np.float16) for i in range(40)]
    with LatentCacheWriter(str(tmp_path), encoder={"pretrained": "test", "latent_channels": 4}) as writer:
        for i, z in enumerate(latents):
            writer.append(f"k{i}", z, source_hash=zlib.crc32(b"%d" % i).to_bytes(4, "little") * 4)
    cache = LatentCache(str(tmp_path))
    chunk_bytes = 4096
    ids = item_chunks(cache, chunk_bytes)
    raw = open(cache.items.path, "rb").read()
    starts = []
    for i, z in enumerate(latents):  # find each item's bytes in the file: its first byte's chunk is its id
        start = raw.find(z.tobytes())
        assert start >= 0
        starts.append(start)
    assert ids.tolist() == [s // chunk_bytes for s in starts]
    assert any(s // chunk_bytes != (s + z.nbytes - 1) // chunk_bytes for s, z in zip(starts, latents)), "no item crosses a chunk boundary"
    assert item_chunks(np.array(starts), chunk_bytes).tolist() == ids.tolist()
    # the sampler over it: every item once, one shape per batch
    sampler = ShapeBucketBatchSampler(cache.shapes, 3, chunks=ids, chunk_window=2)
    batches = list(sampler)
    assert sorted(i for b in batches for i in b) == list(range(40))


def test_width_windows_still_batch_rows_of_similar_width():
    widths, chunks = widths_and_chunks()

    def mean_range(batches):
        return float(np.mean([np.ptp(widths[b]) for b in batches if len(b) == 16]))

    chunked = mean_range(WidthBucketBatchSampler(widths, 16, bucket_batches=8, chunks=chunks, chunk_window=40))
    plain = mean_range(WidthBucketBatchSampler(widths, 16, bucket_batches=8))
    unsorted = mean_range(np.random.default_rng(0).permutation(N)[: N // 16 * 16].reshape(-1, 16))
    assert chunked < 2 * plain and chunked < 0.3 * unsorted, (chunked, plain, unsorted)


def test_item_chunks_of_a_records_cache_follow_the_latent_field(tmp_path):
    rng = np.random.default_rng(5)
    latents = [torch.from_numpy(rng.standard_normal((4, 8, 8 + 4 * (i % 3))).astype(np.float16)) for i in range(12)]
    with LatentCacheWriter(str(tmp_path)) as writer:
        for i, z in enumerate(latents):  # a text field of its own size beside each latent
            writer.append(f"k{i}", {"latent": z, "text": torch.randn(3 + i, 16).bfloat16()})
    cache = LatentCache(str(tmp_path))
    raw = open(cache.items.path, "rb").read()
    starts = [raw.find(z.numpy().tobytes()) for z in latents]
    assert min(starts) >= 0
    assert item_chunks(cache, 1024).tolist() == [s // 1024 for s in starts]
