"""Sharded caches in object storage, and what the command line does with URLs: a sharded cache (its
shards under its folder, items interleaved over them) pushed to a real S3 server on loopback (moto)
opens with ``s3://`` as one cache and reads back bit-equal to the local one; a batch over several
shards fetches every shard's missing chunks at once and nothing when warm; push publishes the
manifest after every shard and refuses shards outside the folder; ``cache inspect`` / ``cache
verify`` take URLs; older local mirrors of a replaced cache go once no reader holds them."""
from __future__ import annotations

import collections
import gc
import os
import time

import numpy as np
import pytest
import torch

pytest.importorskip("obstore", reason="remote caches need obstore (pip install 'latentfast[s3]')")
pytest.importorskip("moto.server", reason="the loopback S3 server is moto[server] (pip install 'latentfast[test]')")

from latentfast.cache import LatentCache, LatentCacheWriter
from latentfast.cache.cli import main
from latentfast.cache.feed.loader import batch_loader
from latentfast.cache.remote import RemoteCorruptError, push
from latentfast.cache.remote.storage import ObjectFolder
from latentfast.cache.store import shards as shardstore
from latentfast.cache import inspect_cache, verify_cache
from latentfast.errors import InvalidArgumentError
from latentfast.testing import FaultProxy, create_bucket, peak_gets_in_flight, s3_options, s3_server
from test_remote_latent_cache import assert_same  # noqa: E402

SHARDS = 3
N = 26
FIELDS = {"fields": ("latent", "text", "pooled"), "pad": {"text": 0}}


def _write_shards(root, seed=6):
    """A sharded cache in ``root`` of N records over SHARDS shards under ``root/shards``, item i in shard
    ``perm[i] % SHARDS`` (interleaved: the order file is not the shards concatenated); returns root."""
    gen = torch.Generator().manual_seed(seed)
    owner = np.random.default_rng(seed).permutation(N) % SHARDS
    dirs = [os.path.join(root, "shards", f"train-{k:05d}") for k in range(SHARDS)]
    order, rows = [], [0] * SHARDS
    writers = [LatentCacheWriter(d) for d in dirs]
    for i in range(N):
        k = int(owner[i])
        writers[k].append(f"item{i:02d}", {"latent": torch.randn((4, 6, 5), generator=gen).half(),
                                           "text": torch.randn((1 + i % 4, 8), generator=gen).bfloat16(),
                                           "pooled": torch.randn(3, generator=gen)}, info={"i": i})
        order.append((k, rows[k]))
        rows[k] += 1
    for w in writers:
        w.finish()
    shardstore.write_manifest(root, "train", dirs, np.asarray(order, dtype=np.int64))
    return str(root)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(endpoint, local sharded cache folder, a single cache folder), both pushed to s3://lfshards/."""
    root = tmp_path_factory.mktemp("sharded")
    sharded = _write_shards(root / "sharded")
    single = str(root / "single")
    with LatentCacheWriter(single) as writer:
        for i in range(9):
            writer.append(f"s{i}", torch.randn(4, 6, 5).half())
    with s3_server() as endpoint:
        create_bucket(endpoint, "lfshards")
        push(sharded, "s3://lfshards/sharded", s3_options(endpoint))
        push(single, "s3://lfshards/single", s3_options(endpoint))
        yield endpoint, sharded, single


def remote(endpoint, name, local_cache, **kw):
    return LatentCache(f"s3://lfshards/{name}", storage_options=s3_options(endpoint), local_cache=str(local_cache),
                       local_cache_bytes=1 << 30, **kw)


def spanning_batches(cache, rng, n=6):
    """Random batches whose items lie in at least two shards each."""
    out = []
    while len(out) < n:
        batch = rng.choice(len(cache), size=7, replace=False).tolist()
        if len(set(cache.order[batch, 0].tolist())) >= 2:
            out.append(batch)
    return out


def test_a_pushed_sharded_cache_reads_back_bit_equal(server, tmp_path):
    endpoint, folder, _ = server
    local, cache = LatentCache(folder), remote(endpoint, "sharded", tmp_path / "lc", verify_rows=True)
    assert isinstance(cache, shardstore.ShardedCache) and len(cache.shards) == SHARDS
    assert all(s.remote is not None for s in cache.shards)  # every shard read from the server, none from `folder`
    assert len(cache) == len(local) == N and cache.keys == local.keys
    np.testing.assert_array_equal(cache.order, local.order)
    np.testing.assert_array_equal(cache.shapes, local.shapes)
    assert cache.fields.keys() == local.fields.keys()
    for name in local.fields:
        np.testing.assert_array_equal(cache.fields[name]["shapes"], local.fields[name]["shapes"])
    for batch in spanning_batches(local, np.random.default_rng(1)):
        assert_same(cache.read_batch(batch, return_keys=True), local.read_batch(batch, return_keys=True))
        assert_same(cache.read_batch(batch, **FIELDS), local.read_batch(batch, **FIELDS))
        packed = {"fields": ("latent", "text"), "packed": ("text",)}
        assert_same(cache.read_batch(batch, **packed), local.read_batch(batch, **packed))
    for i in range(N):
        assert_same(cache.record(i), local.record(i))
        assert cache.info(i) == local.info(i)
    opened = {"storage_options": s3_options(endpoint), "local_cache": str(tmp_path / "lc"), "local_cache_bytes": 1 << 30}
    got, want = verify_cache("s3://lfshards/sharded", **opened), verify_cache(folder)
    assert (got["rows"], got["bytes"], got["shards"]) == (want["rows"], want["bytes"], want["shards"])
    got, want = inspect_cache("s3://lfshards/sharded", **opened), inspect_cache(folder)
    for key in ("n", "layout", "files", "fields", "data_bytes", "shape_counts"):
        assert got[key] == want[key], key
    assert [s["path"] for s in got["shards"]] == [f"s3://lfshards/sharded/shards/train-{k:05d}" for k in range(SHARDS)]


def test_a_batch_over_shards_fetches_every_shard_at_once_and_nothing_when_warm(server, tmp_path, monkeypatch):
    endpoint, folder, _ = server
    local = LatentCache(folder)
    batch = [int(np.flatnonzero(local.order[:, 0] == k)[0]) for k in range(SHARDS)]  # one item in each shard
    peak = peak_gets_in_flight(monkeypatch)
    with FaultProxy(endpoint, fault_all="slow:0.3") as proxy:  # every GET slow: fetched one shard after another, one at a time
        cache = remote(proxy.endpoint, "sharded", tmp_path)
        assert_same(cache.read_batch(batch, **FIELDS), local.read_batch(batch, **FIELDS))
        assert peak[0] >= SHARDS  # each shard's run in flight together
        objects = {path.split("/lfshards/sharded/", 1)[1] for path, _ in proxy.gets}
        assert {o.split("/")[1] for o in objects} == {f"train-{k:05d}" for k in range(SHARDS)}
        chunk = cache.shards[0].remote.reader.cache.chunk_bytes
        fetched = collections.Counter()
        for path, rng in proxy.gets:
            a, b = (int(x) for x in rng.split("=")[1].split("-"))
            fetched.update((path, c) for c in range(a // chunk, b // chunk + 1))
        assert max(fetched.values()) == 1  # no chunk twice
        before = len(proxy.gets)
        assert_same(cache.read_batch(batch, **FIELDS), local.read_batch(batch, **FIELDS))
        assert len(proxy.gets) == before  # warm: every byte from the local chunk cache


def test_the_lookahead_prefetches_every_shard_over_the_network(server, tmp_path):
    endpoint, folder, _ = server
    local = LatentCache(folder)
    batch = spanning_batches(local, np.random.default_rng(3), n=1)[0]
    with FaultProxy(endpoint) as proxy:
        cache = remote(proxy.endpoint, "sharded", tmp_path)
        cache.prefetch(batch)  # returns at once; the shards' chunks come in the background
        deadline = time.monotonic() + 30
        touched = set()
        while time.monotonic() < deadline and len(touched) < len(set(local.order[batch, 0].tolist())):
            touched = {path.split("/shards/")[1].split("/")[0] for path, _ in list(proxy.gets)}
            time.sleep(0.02)
        assert touched == {f"train-{k:05d}" for k in set(local.order[batch, 0].tolist())}  # before any read
        assert_same(cache.read_batch(batch, **FIELDS), local.read_batch(batch, **FIELDS))
        chunk = cache.shards[0].remote.reader.cache.chunk_bytes
        fetched = collections.Counter()
        for path, rng in proxy.gets:
            a, b = (int(x) for x in rng.split("=")[1].split("-"))
            fetched.update((path, c) for c in range(a // chunk, b // chunk + 1))
        assert max(fetched.values()) == 1  # the read waited for the prefetch's downloads, never fetched again


def test_workers_and_corrupt_shards(server, tmp_path):
    endpoint, folder, _ = server
    local = LatentCache(folder)
    batches = spanning_batches(local, np.random.default_rng(2), n=4)
    cache = remote(endpoint, "sharded", tmp_path / "w")
    cache.read_batch(batches[0])  # the parent used the client before the fork
    for (latents, _shapes, index), batch in zip(batch_loader(cache, batches, num_workers=2, multiprocessing_context="fork"), batches):
        assert index.tolist() == batch
        assert_same(latents, local.read_batch(batch)[0])
    with FaultProxy(endpoint, fault_all="flip") as proxy:  # every body has a flipped bit
        # (the first object read by range is a shard's index file, when it opens, or a data file: either is named with its bytes)
        with pytest.raises(RemoteCorruptError, match=r"s3://lfshards/sharded/shards/train-0000\d/train\.\S+\.(dat|npy) bytes \[\d+, \d+\)"):
            bad = LatentCache("s3://lfshards/sharded", storage_options={**s3_options(proxy.endpoint), "max_retries": 0},
                              local_cache=str(tmp_path / "flip"), local_cache_bytes=1 << 30)
            bad.read_batch(batches[0], **FIELDS)


def test_push_publishes_the_manifest_last_and_refuses_shards_outside(server, tmp_path):
    endpoint, folder, single = server
    names = push(folder, "s3://lfshards/again", s3_options(endpoint))
    assert names[-1] == "train.shards.json"
    metas = [n for n in names if n.endswith("meta.json")]
    assert len(metas) == SHARDS and all(names.index(m) < len(names) - 1 for m in metas)
    assert names.index("train.shards.order.npy") < names.index(metas[0])
    merged, other = str(tmp_path / "merged"), str(tmp_path / "other")
    with LatentCacheWriter(other) as writer:  # (a merge holds each key once)
        for i in range(9):
            writer.append(f"t{i}", torch.randn(4, 6, 5).half())
    shardstore.merge_caches([single, other], merged)  # refers to them: nothing under `merged` but the manifest
    with pytest.raises(InvalidArgumentError, match=r"outside .*--copy"):
        push(merged, "s3://lfshards/merged", s3_options(endpoint))
    assert not ObjectFolder("s3://lfshards/merged", s3_options(endpoint)).list()  # nothing uploaded
    shardstore.merge_caches([single, other], str(tmp_path / "copied"), copy=True)
    push(str(tmp_path / "copied"), "s3://lfshards/copied", s3_options(endpoint))
    cache = remote(endpoint, "copied", tmp_path / "lc")
    assert_same(cache.read_batch(list(range(18))), LatentCache(str(tmp_path / "copied")).read_batch(list(range(18))))


def test_inspect_and_verify_on_the_command_line_take_urls(server, tmp_path, monkeypatch, capsys):
    endpoint, folder, single = server
    for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(key, value)
    for name, local in (("sharded", folder), ("single", single)):
        assert main(["cache", "verify", f"s3://lfshards/{name}", "--endpoint-url", endpoint]) == 0
        assert f"verify OK: {len(LatentCache(local))} rows" in capsys.readouterr().out
        assert main(["cache", "inspect", f"s3://lfshards/{name}", "--endpoint-url", endpoint, "--json",
                     "--local-cache", str(tmp_path / "lc"), "--local-cache-bytes", "64M"]) == 0
        assert f'"n": {len(LatentCache(local))}' in capsys.readouterr().out
    assert os.listdir(tmp_path / "lc")  # the given local cache is kept (a temporary one is not)
    assert main(["cache", "pull", "s3://lfshards/sharded", str(tmp_path / "back"), "--endpoint-url", endpoint]) == 0
    assert f"verify OK: split 'train', {N} rows" in capsys.readouterr().out  # the pulled shards, verified
    assert_same(LatentCache(str(tmp_path / "back")).read_batch(list(range(N)), **FIELDS), LatentCache(folder).read_batch(list(range(N)), **FIELDS))
    assert main(["cache", "verify", "s3://lfshards/none", "--endpoint-url", endpoint]) == 1
    assert "s3://lfshards/none" in capsys.readouterr().err
    assert main(["cache", "verify", single, "--endpoint-url", endpoint]) == 2
    assert "not the folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["cache", "inspect", "s3://lfshards/single", "--local-cache-bytes", "lots"])
    assert "expected a byte count" in capsys.readouterr().err


def test_older_mirrors_of_a_replaced_cache_go_once_no_reader_holds_them(server, tmp_path):
    endpoint, folder, single = server
    index = tmp_path / "lc" / "index"

    def generations():
        return sorted(n for n in os.listdir(index) if not n.startswith("."))

    def push_version(seed):
        version = str(tmp_path / f"v{seed}")
        _write_shards(version, seed=seed)
        push(version, "s3://lfshards/replaced", s3_options(endpoint))
        return LatentCache(version)

    first = push_version(1)
    held = remote(endpoint, "replaced", tmp_path / "lc")  # a manifest mirror and one per shard
    assert_same(held.read_batch(list(range(5))), first.read_batch(list(range(5))))
    one = generations()
    assert len(one) == 1 + SHARDS
    second = push_version(2)
    newer = remote(endpoint, "replaced", tmp_path / "lc")
    assert_same(newer.read_batch(list(range(5))), second.read_batch(list(range(5))))
    assert set(one) < set(generations())  # the first is still open: kept
    two = sorted(set(generations()) - set(one))
    del held
    gc.collect()
    third = push_version(3)
    latest = remote(endpoint, "replaced", tmp_path / "lc")
    assert_same(latest.read_batch(list(range(5))), third.read_batch(list(range(5))))
    left = generations()
    assert not set(one) & set(left) and set(two) <= set(left) and len(left) == 2 * (1 + SHARDS)


def test_a_sharded_prefetch_is_one_submission_and_fetches_what_the_batch_reads(server, tmp_path, monkeypatch):
    # the lookahead of a batch over every shard and field hands the fetch loop one job, not one per
    # shard and per field; after it, the batch reads with nothing more fetched, equal to the local cache
    from latentfast.cache.remote.reader import RemoteReader

    endpoint, folder, _ = server
    local, cache = LatentCache(folder), remote(endpoint, "sharded", tmp_path / "lc")
    batch = spanning_batches(local, np.random.default_rng(4), n=1)[0]
    assert len(set(local.order[batch, 0].tolist())) >= 2
    assert len(cache.shards) > 1  # (every shard opened first: an opening fetches its index's header and last block)
    runs = []
    submit = RemoteReader._run
    monkeypatch.setattr(RemoteReader, "_run", lambda self, coro: runs.append(1) or submit(self, coro))
    fetching = cache.prefetch(batch)
    assert len(runs) == 1, f"{len(runs)} submissions to the fetch loop for one batch's prefetch"
    fetching.result()
    before = sum(s.remote.reader.stats["bytes_fetched"] for s in cache.shards)
    assert before > 0
    assert_same(cache.read_batch(batch, **FIELDS), local.read_batch(batch, **FIELDS))
    assert sum(s.remote.reader.stats["bytes_fetched"] for s in cache.shards) == before
