"""A cache in object storage reads its index by range (issue 33): opening fetches the meta and a few
small files, a batch fetches the index blocks it needs and no more, every fetched block is checked
against its CRC-32 before use, and a wrong byte on the server in one block is refused naming the
object and byte range -- while the blocks around it still read, equal to the local cache."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("obstore", reason="remote caches need obstore (pip install 'latentfast[s3]')")
pytest.importorskip("moto.server", reason="the loopback S3 server is moto[server] (pip install 'latentfast[test]')")

from latentfast.cache import LatentCache, LatentCacheWriter, read_batch
from latentfast.cache.remote import ObjectFolder, push
from latentfast.cache.store import format as fmt
from latentfast.cache.store.format import CHUNK_BYTES
from latentfast.errors import CacheCorruptError
from latentfast.testing import FaultProxy, create_bucket, s3_options, s3_server

N = 100_000  # tiny items: 8 bytes of latents each, ~9.5 MB of index files
BLOCK = 8192  # items per index block (tables.BLOCK_ITEMS)


def key_of(i: int) -> str:
    return f"item{i:09d}"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A cache of N tiny items (random latents) at s3://lfidx/tiny; yields (endpoint, local folder)."""
    folder = str(tmp_path_factory.mktemp("idx") / "tiny")
    rng = np.random.default_rng(0)
    with LatentCacheWriter(folder, flush_every=1 << 14) as writer:
        for s in range(0, N, 4096):
            keys = [key_of(i) for i in range(s, min(N, s + 4096))]
            writer.append_many(keys, rng.standard_normal((len(keys), 4, 1, 1)).astype(np.float16))
    with s3_server() as endpoint:
        create_bucket(endpoint, "lfidx")
        push(folder, "s3://lfidx/tiny", s3_options(endpoint))
        yield endpoint, folder


def remote(endpoint, local_cache, url="s3://lfidx/tiny"):
    return LatentCache(url, storage_options=s3_options(endpoint), local_cache=str(local_cache), local_cache_bytes=1 << 30)


def fetched(proxy, folder) -> dict:
    """Bytes fetched per object name, from the proxy's record of every GET (a whole GET: the object's size)."""
    per = {}
    for path, byte_range in proxy.gets:
        name = path.rsplit("/", 1)[1]
        if byte_range is None:
            size = os.path.getsize(os.path.join(folder, name))
        else:
            a, b = (int(x) for x in byte_range.split("=")[1].split("-"))
            size = b + 1 - a
        per[name] = per.get(name, 0) + size
    return per


def same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_opening_fetches_no_table_and_a_keyed_batch_only_the_blocks_it_needs(server, tmp_path):
    endpoint, folder = server
    local = LatentCache(folder)
    index_bytes = {n: os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder) if not n.endswith((".dat", "meta.json"))}
    with FaultProxy(endpoint, whole_gets=True) as proxy:  # (records every GET but listings)
        cache = remote(proxy.endpoint, tmp_path / "lc")
        at_open = fetched(proxy, folder)
        # the meta (twice: before and after the heads), the index block checksums; of the shapes and offsets
        # only their headers and the last block (its end offset sizes the data file); nothing of the keys
        assert set(at_open) <= {"train.latents.meta.json", "train.latents.index.crc32.npy", "train.latents.shapes.npy",
                                "train.latents.offsets.npy"}, at_open
        assert at_open["train.latents.shapes.npy"] <= 2 * BLOCK * 3 * 8 and at_open["train.latents.offsets.npy"] <= 2 * BLOCK * 8
        assert sum(at_open.values()) < sum(index_bytes.values()) / 10
        proxy.gets.clear()

        picked = np.random.default_rng(1).choice(BLOCK, 64, replace=False)  # 64 items of the first block
        latents, _shapes, keys = read_batch(cache, picked, return_keys=True)
        assert keys == [key_of(i) for i in picked.tolist()]
        want = read_batch(local, picked, return_keys=True)
        assert same(latents, want[0])
        batch = fetched(proxy, folder)
        assert "train.latents.keys.json" not in batch  # (the key list older readers read)
        for name in ("train.latents.keys.hash.npy", "train.latents.keys.rows.npy"):  # the lookup index: its header's chunk
            assert batch[name] <= CHUNK_BYTES, (name, batch[name])
        for name in ("train.latents.shapes.npy", "train.latents.offsets.npy", "train.latents.keys.offsets.npy",
                     "train.latents.keys.bin", "train.latents.crc32.npy"):
            assert 0 < batch.get(name, 0) <= index_bytes[name] / 4, (name, batch.get(name), index_bytes[name])  # not whole tables
        proxy.gets.clear()

        assert cache.index(key_of(54321)) == 54321  # a lookup: the hash blocks its binary search probes
        looked = fetched(proxy, folder)
        assert set(looked) <= {"train.latents.keys.hash.npy", "train.latents.keys.rows.npy", "train.latents.keys.crc32.npy",
                               "train.latents.keys.offsets.npy", "train.latents.keys.bin"}, looked
        assert looked["train.latents.keys.hash.npy"] < index_bytes["train.latents.keys.hash.npy"] / 2
        proxy.gets.clear()

        assert same(read_batch(cache, picked)[0], latents)  # warm: nothing fetched
        assert remote(proxy.endpoint, tmp_path / "lc").key(int(picked[0])) == key_of(int(picked[0]))  # another reader of the node
        # (its open: one GET of the meta, the node's mirror of that generation already there)
        assert fetched(proxy, folder) == {"train.latents.meta.json": os.path.getsize(os.path.join(folder, "train.latents.meta.json"))}


def test_batches_in_blocks_not_yet_fetched_read_right_and_whole_views_fetch_every_block(server, tmp_path):
    # the gather's per-item sizes are filled in as blocks are checked: a batch from a block first read
    # after the gather source was built reads its own items, not zeros
    endpoint, folder = server
    local, cache = LatentCache(folder), remote(endpoint, tmp_path / "lc")
    rng = np.random.default_rng(2)
    for block in (3, 0, 11, 7):
        picked = rng.integers(block * BLOCK, min(N, (block + 1) * BLOCK), 17)
        assert same(cache.read_batch(picked)[0], local.read_batch(picked)[0])
        assert same(cache[int(picked[0])], local[int(picked[0])])
    assert np.array_equal(cache.row_starts, local.row_starts)  # a whole view: every block fetched and checked first
    assert np.array_equal(cache.shapes, local.shapes)
    assert cache._index_blocks._checked.all()


def _corrupt_object(endpoint, folder, tmp_path, name: str, at: int, url: str) -> None:
    """Push the cache to ``url``, then replace object ``name`` there by a copy with byte ``at`` flipped."""
    push(folder, url, s3_options(endpoint))
    with open(os.path.join(folder, name), "rb") as fh:
        payload = bytearray(fh.read())
    payload[at] ^= 0x10
    bad = tmp_path / name
    bad.write_bytes(bytes(payload))
    ObjectFolder(url, s3_options(endpoint)).put_file(name, str(bad))


def test_a_wrong_byte_on_the_server_in_one_index_block_is_refused_naming_the_object_and_range(server, tmp_path):
    endpoint, folder = server
    local = LatentCache(folder)
    shapes = np.load(os.path.join(folder, "train.latents.shapes.npy"), mmap_mode="r")
    at = shapes.offset + (2 * BLOCK + 5) * shapes.strides[0]  # in block 2 (items 16384..24575)
    _corrupt_object(endpoint, folder, tmp_path, "train.latents.shapes.npy", at, "s3://lfidx/badshapes")
    cache = remote(endpoint, tmp_path / "lc", "s3://lfidx/badshapes")  # (opening checks the last block only)
    with pytest.raises(CacheCorruptError, match=r"s3://lfidx/badshapes/train\.latents\.shapes\.npy bytes \[\d+, \d+\).*block 2 "):
        cache.read_batch([2 * BLOCK + 5, 2 * BLOCK + 6])
    with pytest.raises(CacheCorruptError, match=r"block 2 "):
        cache[2 * BLOCK + 9]  # still refused: never read as if it were good
    for picked in ([1, 2, 3], [3 * BLOCK + 1, 3 * BLOCK + 2]):  # the other blocks read
        assert same(cache.read_batch(picked)[0], local.read_batch(picked)[0])

    keys = np.fromfile(os.path.join(folder, "train.latents.keys.bin"), dtype=np.uint8)
    assert keys.size > 3 * (64 << 10)
    _corrupt_object(endpoint, folder, tmp_path, "train.latents.keys.bin", 2 * (64 << 10) + 7, "s3://lfidx/badkeys")
    cache = remote(endpoint, tmp_path / "lc", "s3://lfidx/badkeys")
    offsets = np.load(os.path.join(folder, fmt.cache_path("", "train", "key_offsets").lstrip("/")), mmap_mode="r")
    item = int(np.searchsorted(offsets, 2 * (64 << 10) + 7, side="right")) - 1  # whose key holds the byte
    with pytest.raises(CacheCorruptError, match=r"s3://lfidx/badkeys/train\.latents\.keys\.bin bytes \[131072, 196608\)"):
        cache.key(item)
    assert cache.key(5) == key_of(5)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_workers_fetch_the_index_blocks_they_read_once_per_node(server, tmp_path, context):
    # a worker maps the same sparse copies: a block its parent fetched is not fetched again, one it needs
    # first is fetched (and checked) by the worker, once for the node
    from latentfast.cache.feed.loader import batch_loader

    endpoint, folder = server
    local = LatentCache(folder)
    with FaultProxy(endpoint) as proxy:
        cache = remote(proxy.endpoint, tmp_path / "lc")
        cache.read_batch([5, 6])  # the parent used the client (and fetched block 0) before the workers start
        batches = [np.random.default_rng(b).integers(b * BLOCK, (b + 1) * BLOCK, 9).tolist() for b in (0, 4, 9, 4)]
        for (latents, _shapes, index), batch in zip(batch_loader(cache, batches, num_workers=2, multiprocessing_context=context), batches):
            assert index.tolist() == batch
            assert same(latents, local.read_batch(batch)[0])
        chunk = CHUNK_BYTES
        counts = {}
        for path, byte_range in proxy.gets:
            a, b = (int(x) for x in byte_range.split("=")[1].split("-"))
            for c in range(a // chunk, b // chunk + 1):
                counts[(path, c)] = counts.get((path, c), 0) + 1
        assert max(counts.values()) == 1  # no chunk of any object downloaded twice on this node
        shapes = [c for p, c in counts if p.endswith("shapes.npy")]
        table = np.load(os.path.join(folder, "train.latents.shapes.npy"), mmap_mode="r")
        for b in (4, 9):  # the workers' blocks came too
            at = table.offset + (b * BLOCK + 1) * table.strides[0]
            assert any(c * chunk <= at < (c + 1) * chunk for c in shapes)
