"""The lookahead of a sharded cache in object storage (issue 32): a prefetch of a batch over shards not
opened yet opens them at once, not one after another; the shards share one limit of GETs in flight
(as one cache's reader has), so the next batch's prefetch queues behind the batch being read instead
of splitting the server with it; a batch's hold hands the fetch loop one job for every shard (a warm batch's prefetch none); and a loop reading each batch while the next one is prefetched fetches
every chunk once and nothing the batches do not read. Against moto on loopback, through the fault
proxy where GETs are counted or slowed."""
from __future__ import annotations

import collections
import pickle
import threading

import numpy as np
import pytest
import torch

pytest.importorskip("obstore", reason="remote caches need obstore (pip install 'latentfast[s3]')")
pytest.importorskip("moto.server", reason="the loopback S3 server is moto[server] (pip install 'latentfast[test]')")

from latentfast.cache import LatentCache, LatentCacheWriter
from latentfast.cache.remote import push
from latentfast.cache.remote.files import RemoteShards
from latentfast.cache.store import shards as shardstore
from latentfast.cache.store.layout import item_spans
from latentfast.testing import FaultProxy, create_bucket, peak_gets_in_flight, s3_options, s3_server
from test_remote_latent_cache import assert_same  # noqa: E402

SHARDS, PER_SHARD = 4, 48
URL = "s3://lflook/sharded"
FIELDS = {"fields": ("latent", "text"), "pad": {"text": 0}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(endpoint, the local sharded cache): SHARDS shards of PER_SHARD records, latents of 8 KiB (two to
    a 16 KiB chunk, so a batch reads some chunks of each shard, not all) and a text field, pushed to URL."""
    root = tmp_path_factory.mktemp("look")
    gen = torch.Generator().manual_seed(32)
    dirs = [str(root / "shards" / f"train-{k:05d}") for k in range(SHARDS)]
    for k, folder in enumerate(dirs):
        with LatentCacheWriter(folder) as writer:
            for i in range(PER_SHARD):
                writer.append(f"s{k}-{i:02d}", {"latent": torch.randn((4, 8, 128), generator=gen).half(),
                                                "text": torch.randn((1 + i % 5, 16), generator=gen).bfloat16()})
    shardstore.write_manifest(str(root), "train", dirs)
    with s3_server() as endpoint:
        create_bucket(endpoint, "lflook")
        push(str(root), URL, s3_options(endpoint))
        yield endpoint, str(root)


def remote(endpoint, local_cache):
    return LatentCache(URL, storage_options=s3_options(endpoint), local_cache=str(local_cache), local_cache_bytes=1 << 30)


def spanning_batches(n_batches, size=12, seed=0):
    """Random batches without repeats, each over every shard (the order is the shards concatenated)."""
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n_batches:
        batch = np.sort(rng.choice(SHARDS * PER_SHARD, size=size, replace=False))
        if len(set((batch // PER_SHARD).tolist())) == SHARDS:
            out.append(batch.tolist())
    return out


def chunks_fetched(gets, chunk: int) -> collections.Counter:
    """(object path, chunk) -> how many ranged GETs fetched it, from the proxy's ``gets``."""
    fetched = collections.Counter()
    for path, rng in gets:
        a, b = (int(x) for x in rng.split("=")[1].split("-"))
        fetched.update((path, c) for c in range(a // chunk, b // chunk + 1))
    return fetched


def test_a_prefetch_opens_the_new_shards_of_its_batch_at_once(server, tmp_path, monkeypatch):
    # each shard waits at a barrier for the others while it opens: opened one after another, the
    # first of them would wait alone until the barrier's timeout breaks it
    endpoint, folder = server
    batch = spanning_batches(1)[0]
    want, cache = LatentCache(folder).read_batch(batch, **FIELDS), remote(endpoint, tmp_path)
    assert len(cache.opened_shards()) == 1  # (the first opens with the cache)
    barrier = threading.Barrier(SHARDS - 1, timeout=30)
    open_shard = shardstore.ShardedCache._open_shard

    def meeting(self, k):
        barrier.wait()
        return open_shard(self, k)

    monkeypatch.setattr(shardstore.ShardedCache, "_open_shard", meeting)
    cache.prefetch(batch).result()
    assert len(cache.opened_shards()) == SHARDS and not barrier.broken
    assert_same(cache.read_batch(batch, **FIELDS), want)


def test_the_shards_share_one_limit_of_gets_in_flight(server, tmp_path, monkeypatch):
    endpoint, folder = server
    peak = peak_gets_in_flight(monkeypatch)
    batches = spanning_batches(2, seed=1)
    with FaultProxy(endpoint, fault_all="slow:0.05") as proxy:  # GETs slow enough to pile up behind the limit
        options = s3_options(proxy.endpoint)
        storage = RemoteShards(URL, "train", options, str(tmp_path), 1 << 30, max_concurrency=2)
        cache = shardstore.ShardedCache(URL, "train", storage=storage)
        fetching = [cache.prefetch(b) for b in batches]  # every shard's latents and text of two batches at once
        for f in fetching:
            f.result()
        assert len(proxy.gets) > 2 * SHARDS  # (more GETs than the limit, in every shard at once)
    assert peak[0] == 2  # the limit held over all shards together, and was reached
    assert all(s.remote.reader.limit is storage.limit for s in cache.shards)
    local = LatentCache(folder)
    for b in batches:
        assert_same(cache.read_batch(b, **FIELDS), local.read_batch(b, **FIELDS))
    worker = pickle.loads(pickle.dumps(cache))  # a DataLoader worker's copy: one limit for its shards too
    assert len({id(s.remote.reader.limit) for s in worker.shards} | {id(worker.storage.limit)}) == 1
    assert worker.storage.limit.n == 2


def test_a_cold_batch_over_every_shard_is_one_submission_to_the_fetch_loop_and_a_warm_one_none(server, tmp_path, monkeypatch):
    from latentfast.cache.remote.reader import RemoteReader

    endpoint, folder = server
    cache = remote(endpoint, tmp_path)
    cache.shards  # (opened first: only the batch's hold is counted)
    runs = []
    submit = RemoteReader._run
    monkeypatch.setattr(RemoteReader, "_run", lambda self, coro: runs.append(1) or submit(self, coro))
    batch = spanning_batches(1, seed=3)[0]
    assert_same(cache.read_batch(batch), LatentCache(folder).read_batch(batch))
    assert len(runs) == 1, f"{len(runs)} submissions to the fetch loop for one batch over {SHARDS} shards"
    cache.prefetch(batch).result()  # the text values' chunks: the latents' are local
    assert len(runs) == 2
    cache.prefetch(batch).result()  # warm: the lookahead of a batch whose chunks are all local costs no loop work
    assert_same(cache.read_batch(batch, **FIELDS), LatentCache(folder).read_batch(batch, **FIELDS))
    assert len(runs) == 2


def test_reading_each_batch_while_the_next_is_prefetched_fetches_every_chunk_once(server, tmp_path):
    endpoint, folder = server
    local = LatentCache(folder)
    batches = spanning_batches(6, seed=2)
    with FaultProxy(endpoint) as proxy:
        cache = remote(proxy.endpoint, tmp_path)
        for k, batch in enumerate(batches):  # what the lookahead does: batch k + 1 asked for before batch k is read
            if k + 1 < len(batches):
                cache.prefetch(batches[k + 1])
            assert_same(cache.read_batch(batch, **FIELDS), local.read_batch(batch, **FIELDS))
        gets = list(proxy.gets)
    chunk = cache.shards[0].remote.reader.cache.chunk_bytes
    fetched = chunks_fetched(gets, chunk)
    assert max(fetched.values()) == 1  # no chunk twice: a read waits for the prefetch of its chunks
    wanted = set()  # the chunks under the batches' latents and text values
    for batch in batches:
        for k, rows in cache.items.by_shard(np.asarray(batch)):
            shard = cache.shard(k)
            for items in (shard.items, shard.field_items["text"]):
                where = f"/lflook/sharded/shards/train-{k:05d}/{shard.remote.object_name(items.path)}"
                wanted.update((where, c) for s, e in zip(*item_spans(items, rows)) for c in range(int(s) // chunk, (int(e) - 1) // chunk + 1))
    data = {(where, c) for where, c in fetched if where.endswith(".dat")}  # (index blocks come by range too)
    assert data == wanted  # and nothing the batches do not read
