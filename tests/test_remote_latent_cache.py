"""LatentCache over object storage: caches pushed to a real S3 server on loopback (moto) open with
``s3://`` and read back bit-equal to the local ones (line, shaped and records caches: len, keys,
shapes, fields, items, records, batches, verify, inspect); faults during read_batch; DataLoader
workers (fork and spawn) sharing one local chunk cache with one download per chunk; the lookahead
prefetching over the network; errors that name the object and byte range; push / pull on the CLI."""
from __future__ import annotations

import collections
import os
import time

import numpy as np
import pytest
import torch

pytest.importorskip("obstore", reason="remote caches need obstore (pip install 'latentfast[s3]')")
pytest.importorskip("moto.server", reason="the loopback S3 server is moto[server] (pip install 'latentfast[test]')")

from latentfast.cache import LatentCache, LatentCacheWriter
from latentfast.cache.feed.loader import batch_loader
from latentfast.cache.feed.sampler import LookaheadSampler
from latentfast.cache.remote import RemoteCorruptError, RemoteNotFoundError, RemoteReadError, push
from latentfast.cache import inspect_cache, verify_cache
from latentfast.errors import InvalidArgumentError
from latentfast.testing import FaultProxy, create_bucket, s3_options, s3_server, write_random_cache

CHUNK = 4096


def _shaped(folder):
    gen = torch.Generator().manual_seed(3)
    with LatentCacheWriter(folder) as writer:
        for i in range(23):
            shape = (4, 30, 40) if i % 3 else (4, 40, 24)  # 7-10 KiB: a batch spans several chunks
            writer.append(f"img{i:02d}", {"latent": torch.randn(shape, generator=gen).bfloat16()}, info={"i": i})  # stored as bf16


def _records(folder):
    gen = torch.Generator().manual_seed(4)
    captions = [torch.randn((2 + 3 * c, 6), generator=gen).to(torch.bfloat16) for c in range(3)]
    with LatentCacheWriter(folder) as writer:
        for i in range(17):
            writer.append(f"r{i}", {"latent": torch.randn((4, 3, 5), generator=gen).half(), "text": captions[i % 3],
                                    "pooled": torch.randn(7, generator=gen), "mask": torch.rand(2 + 3 * (i % 3), generator=gen) > 0.5})


def _optional(folder):
    """Records some of which lack a field (an optional field: its presence file comes along with the index)."""
    gen = torch.Generator().manual_seed(6)
    with LatentCacheWriter(folder, optional=True) as writer:
        for i in range(11):
            record = {"latent": torch.randn((4, 3, 5), generator=gen).half()}
            if i % 3:
                record["text"] = torch.randn((1 + i, 6), generator=gen).to(torch.bfloat16)
            writer.append(f"o{i}", record)


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """Local caches of each kind and their copies at s3://lfcache/<kind>; yields (endpoint, {kind: folder})."""
    root = tmp_path_factory.mktemp("caches")
    folders = write_random_cache(str(root), 37, 4, 8, 40, seed=5, layouts=("padded", "ragged"))
    for kind, make in (("shaped", _shaped), ("records", _records), ("optional", _optional)):
        folders[kind] = str(root / kind)
        make(folders[kind])
    with s3_server() as endpoint:
        create_bucket(endpoint, "lfcache")
        for kind, folder in folders.items():
            push(folder, f"s3://lfcache/{kind}", s3_options(endpoint))
        yield endpoint, folders


def remote(endpoint, kind, local_cache, budget=1 << 30, **kw):
    return LatentCache(f"s3://lfcache/{kind}", storage_options=s3_options(endpoint), local_cache=str(local_cache),
                       local_cache_bytes=budget, **kw)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same(a, b):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))
    else:
        assert a == b


def batches_of(cache, rng, n_batches=6):
    """Random batches the cache can serve (a shaped cache's: items of one shape)."""
    if cache.shaped:
        groups = collections.defaultdict(list)
        for i, shape in enumerate(map(tuple, cache.shapes.tolist())):
            groups[shape].append(i)
        return [rng.choice(g, size=min(len(g), 5), replace=False).tolist() for g in groups.values()] * 2
    return [rng.choice(len(cache), size=7).tolist() for _ in range(n_batches)]


def test_without_a_local_cache_argument_the_node_default_is_used(caches, tmp_path, monkeypatch):
    # a folder under the user's cache dir (XDG_CACHE_HOME) with a 16 GiB budget, or the environment's
    endpoint, folders = caches
    monkeypatch.delenv("LATENTFAST_LOCAL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    cache = LatentCache("s3://lfcache/records", storage_options=s3_options(endpoint))
    assert cache.remote.reader.cache.capacity == 16 << 30
    assert_same(cache.read_batch([0, 3]), LatentCache(folders["records"]).read_batch([0, 3]))
    assert os.listdir(tmp_path / "xdg" / "latentfast" / "chunks")  # the index files and chunks live there
    monkeypatch.setenv("LATENTFAST_LOCAL_CACHE", str(tmp_path / "env"))
    monkeypatch.setenv("LATENTFAST_LOCAL_CACHE_BYTES", "1000000")
    assert_same(LatentCache("s3://lfcache/padded", storage_options=s3_options(endpoint))[2], LatentCache(folders["padded"])[2])
    assert os.listdir(tmp_path / "env")
    monkeypatch.setenv("LATENTFAST_LOCAL_CACHE_BYTES", "lots")
    with pytest.raises(InvalidArgumentError, match="LATENTFAST_LOCAL_CACHE_BYTES must be a number of bytes, got 'lots'"):
        LatentCache("s3://lfcache/padded", storage_options=s3_options(endpoint))


@pytest.mark.parametrize("kind", ["padded", "ragged", "shaped", "records", "optional"])
def test_a_pushed_cache_reads_back_bit_equal(caches, tmp_path, kind):
    endpoint, folders = caches
    local, cache = LatentCache(folders[kind]), remote(endpoint, kind, tmp_path / "lc")
    assert len(cache) == len(local) and cache.keys == local.keys and cache.layout == local.layout
    np.testing.assert_array_equal(cache.shapes, local.shapes)
    assert cache.fields.keys() == local.fields.keys()
    for name in local.fields:
        assert cache.fields[name]["dtype"] == local.fields[name]["dtype"]
        np.testing.assert_array_equal(cache.fields[name]["shapes"], local.fields[name]["shapes"])
    rng = np.random.default_rng(0)
    packed_reader = remote(endpoint, kind, tmp_path / "packed")
    for batch in batches_of(local, rng):
        assert_same(cache.read_batch(batch, return_keys=True), local.read_batch(batch, return_keys=True))
        assert_same(cache.read_batch(torch.tensor(batch), dtype=torch.float32), local.read_batch(torch.tensor(batch), dtype=torch.float32))
        if not local.shaped:
            assert_same(cache.read_batch(batch, width=45), local.read_batch(batch, width=45))
        if kind == "records":
            kw = {"fields": ("latent", "text", "pooled", "mask"), "pad": {"text": 0, "mask": True}}
            assert_same(cache.read_batch(batch, **kw), local.read_batch(batch, **kw))
            kw = {"fields": ("latent", "text"), "packed": ("text",)}  # from a cache of its own: its first reads
            assert_same(packed_reader.read_batch(batch, **kw), local.read_batch(batch, **kw))
        if kind == "optional":
            kw = {"fields": ("latent", "text"), "pad": {"text": 0}}
            assert_same(cache.read_batch(batch, **kw), local.read_batch(batch, **kw))
            assert cache.read_batch(batch, **kw)["text_present"].tolist() == [i % 3 != 0 for i in batch]
    for i in range(len(local)):
        assert_same(cache[i], local[i])
        assert_same(cache.record(i), local.record(i))
        assert cache.info(i) == local.info(i)
    opened = {"storage_options": s3_options(endpoint), "local_cache": str(tmp_path / "lc"), "local_cache_bytes": 1 << 30}
    assert verify_cache(f"s3://lfcache/{kind}", **opened)["rows"] == verify_cache(folders[kind])["rows"]
    got, want = inspect_cache(f"s3://lfcache/{kind}", **opened), inspect_cache(folders[kind])
    for key in ("n", "layout", "files", "fields", "data_bytes", "meta"):
        assert got[key] == want[key], key


def test_a_remote_cache_reads_only_what_batches_use_and_warm_batches_fetch_nothing(caches, tmp_path):
    endpoint, folders = caches
    local = LatentCache(folders["ragged"])
    with FaultProxy(endpoint) as proxy:
        cache = remote(proxy.endpoint, "ragged", tmp_path)
        batch = [3, 30, 17]
        first = cache.read_batch(batch)
        # (the widths and offsets, read whole by a line cache, come by range too: once, when it opens)
        assert {p.rsplit("/", 1)[1] for p, _r in proxy.gets} == {"train.latents.f16.dat", "train.latents.widths.npy", "train.latents.offsets.npy"}
        fetched = [(int(r.split("=")[1].split("-")[0]), int(r.split("-")[1])) for p, r in proxy.gets if p.endswith(".dat")]
        used = int(sum(local.row_starts[i + 1] - local.row_starts[i] for i in batch)) * 2
        assert used <= sum(b + 1 - a for a, b in fetched) <= used + 2 * len(batch) * cache.remote.reader.cache.chunk_bytes
        n_gets = len(proxy.gets)
        assert_same(cache.read_batch(batch), first)
        assert_same(remote(proxy.endpoint, "ragged", tmp_path).read_batch(batch), first)  # another reader of the node
        assert len(proxy.gets) == n_gets
    assert_same(first, local.read_batch(batch))


@pytest.mark.parametrize("faults", [["500", "503", "drop"], ["slow:0.3", "flip", "flip"]])
def test_faults_during_read_batch_are_retried_to_the_right_bytes(caches, tmp_path, faults):
    endpoint, folders = caches
    local = LatentCache(folders["shaped"])  # items with CRCs of their own: a flipped bit is caught
    with FaultProxy(endpoint, faults=faults) as proxy:
        cache = remote(proxy.endpoint, "shaped", tmp_path)
        for batch in batches_of(local, np.random.default_rng(1)):
            assert_same(cache.read_batch(batch), local.read_batch(batch))
        assert not proxy.faults  # every fault was met


def test_a_flipped_bit_in_a_neighbour_sharing_the_chunk_is_caught_too(caches, tmp_path):
    """Item i's GET brings in its chunk whole, neighbours' values included; a bit flipped in one of those
    is found when it arrives, not read later as if it were good."""
    endpoint, folders = caches
    local = LatentCache(folders["records"])
    text = local.field_items["text"]
    size = os.path.getsize(text.path)
    assert size < 16 << 10  # one chunk: the proxy flips the bit in the middle of the file
    holder = [i for i in range(len(local)) if 2 * text.row_starts[i] <= size // 2 < 2 * text.row_starts[i] + text.nbytes[i]]
    i = next(i for i in range(len(local)) if text.row_starts[i] != text.row_starts[holder[0]])  # another value
    kw = {"fields": ("text",), "pad": {"text": 0}}
    with FaultProxy(endpoint, faults=["flip"]) as proxy:
        cache = remote(proxy.endpoint, "records", tmp_path)
        assert_same(cache.read_batch([i], **kw), local.read_batch([i], **kw))
        assert not proxy.faults
        everything = list(range(len(local)))
        assert_same(cache.read_batch(everything, **kw), local.read_batch(everything, **kw))


def test_exhausted_retries_and_corrupt_objects_name_the_object_and_range(caches, tmp_path):
    endpoint, _ = caches
    options = {**s3_options(endpoint), "max_retries": 1, "retry_backoff": 0.01, "retry_timeout": 2}
    with FaultProxy(endpoint) as proxy:
        options["endpoint_url"] = proxy.endpoint
        cache = LatentCache("s3://lfcache/shaped", storage_options=options, local_cache=str(tmp_path / "a"), local_cache_bytes=1 << 20)
        proxy.fault_all = "500"  # (after the open: its index comes by ranged GETs too)
        # (the batch's items' CRC-32s are read by range before their bytes)
        with pytest.raises(RemoteReadError, match=r"s3://lfcache/shaped/train\.latents\.(f16\.dat|crc32\.npy) bytes \[\d+, \d+\)"):
            cache.read_batch([1, 2])
    with FaultProxy(endpoint) as proxy:
        options["endpoint_url"] = proxy.endpoint
        cache = LatentCache("s3://lfcache/records", storage_options=options, local_cache=str(tmp_path / "b"), local_cache_bytes=1 << 20)
        proxy.fault_all = "flip"
        with pytest.raises(RemoteCorruptError, match=r"s3://lfcache/records/train\.field\.(text|pooled|mask)\.dat bytes \[\d+, \d+\)"):
            cache.read_batch(list(range(17)), fields=("text", "pooled"), pad={"text": 0})  # the flipped middle byte is some item's


def test_a_half_pushed_cache_never_opens_and_bad_arguments_are_named(caches, tmp_path, monkeypatch):
    endpoint, folders = caches
    from latentfast.cache.remote import storage

    real_put = storage.ObjectFolder.put_file

    def put_data_only(self, name, path):
        if name.endswith("meta.json"):
            raise ConnectionError("the push died here")
        real_put(self, name, path)

    monkeypatch.setattr(storage.ObjectFolder, "put_file", put_data_only)
    with pytest.raises(ConnectionError):
        push(folders["padded"], "s3://lfcache/half", s3_options(endpoint))
    monkeypatch.undo()
    with pytest.raises(RemoteNotFoundError, match=r"s3://lfcache/half/train\.latents\.meta\.json does not exist.*push"):
        remote(endpoint, "half", tmp_path)
    with pytest.raises(InvalidArgumentError, match="local_cache_bytes must be positive, got -1"):
        LatentCache("s3://lfcache/padded", storage_options=s3_options(endpoint), local_cache_bytes=-1)
    with pytest.raises(InvalidArgumentError, match="object storage"):
        LatentCache(folders["padded"], local_cache=str(tmp_path))


def test_a_budget_smaller_than_a_batch_says_so(caches, tmp_path):
    endpoint, _ = caches
    cache = remote(endpoint, "padded", tmp_path, budget=8 << 10)
    with pytest.raises(RemoteReadError, match="local_cache_bytes"):
        cache.read_batch(list(range(20)))


def test_the_lookahead_prefetches_over_the_network(caches, tmp_path):
    endpoint, folders = caches
    local = LatentCache(folders["records"])
    with FaultProxy(endpoint) as proxy:
        cache = remote(proxy.endpoint, "records", tmp_path)
        sampler = LookaheadSampler([[0, 1, 2], [5, 9, 11], [3, 4]], cache, lookahead=1)
        it = iter(sampler)
        assert next(it) == [0, 1, 2]  # batch 2 is now being fetched in the background
        for _ in range(100):  # until its GETs stop
            n = len(proxy.gets)
            time.sleep(0.05)
            if n and len(proxy.gets) == n:
                break
        n = len(proxy.gets)
        kw = {"fields": ("latent", "text", "mask"), "pad": {"text": 0, "mask": False}}
        assert_same(cache.read_batch([5, 9, 11], **kw), local.read_batch([5, 9, 11], **kw))
        assert len(proxy.gets) == n  # the lookahead had fetched batch 2's latents and fields


@pytest.mark.parametrize("context, lookahead", [("fork", 0), ("spawn", 0), ("fork", 2)])
def test_dataloader_workers_share_one_download_per_chunk(caches, tmp_path, context, lookahead):
    endpoint, folders = caches
    local = LatentCache(folders["ragged"])
    batches = [list(range(k, 37, 4)) for k in range(4)] * 2  # each worker's batches overlap the others' chunks
    # (lookahead: the parent fetches the next batches while the workers read: still once per chunk)
    with FaultProxy(endpoint) as proxy:
        cache = remote(proxy.endpoint, "ragged", tmp_path)
        cache.read_batch([0])  # the parent used the client before the fork
        loader = batch_loader(cache, batches, num_workers=2, multiprocessing_context=context, lookahead=lookahead)
        for (latents, widths, index), batch in zip(loader, batches):
            assert index.tolist() == batch
            assert_same((latents, widths), local.read_batch(batch))
        chunk = cache.remote.reader.cache.chunk_bytes
        counts = collections.Counter()
        for path, rng in proxy.gets:
            a, b = (int(x) for x in rng.split("=")[1].split("-"))
            counts.update((path, c) for c in range(a // chunk, b // chunk + 1))  # (each object's chunks)
        assert counts and max(counts.values()) == 1  # no chunk downloaded twice on this node


def test_push_and_pull_on_the_command_line(caches, tmp_path, monkeypatch, capsys):
    endpoint, folders = caches
    from latentfast.cache.cli import main

    for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(key, value)
    assert main(["cache", "push", folders["records"], "s3://lfcache/cli", "--endpoint-url", endpoint]) == 0
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    assert main(["cache", "pull", "s3://lfcache/cli", str(tmp_path / "back")]) == 0
    assert "verify OK" in capsys.readouterr().out
    for i in range(len(LatentCache(folders["records"]))):
        assert_same(LatentCache(str(tmp_path / "back")).record(i), LatentCache(folders["records"]).record(i))
    assert main(["cache", "pull", "s3://lfcache/none", str(tmp_path / "none")]) == 1
    assert "s3://lfcache/none" in capsys.readouterr().err
