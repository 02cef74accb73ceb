"""The index at scale: keys looked up in the mapped key table (no key list loaded), its blocks checked on
first touch, caches from before the table read from their keys file; shapes and offsets mapped and checked
a block of items at a time; a cache that pickles as its paths and meta (a spawned worker maps the same files)."""
from __future__ import annotations

import json
import multiprocessing
import os
import pickle

import numpy as np
import pytest
import torch

from latentfast import sampling
from latentfast.cache import LatentCache, LatentCacheWriter, cache_path, read_batch, verify_cache
from latentfast.cache.store import keytable, tables
from latentfast.errors import CacheCorruptError, UnknownKeyError
from test_cache_draws import write_distributions


def write_tiny(folder, n, prefix="key"):
    """``n`` items of shape [4, 1, 1] whose values are their item number; keys ``{prefix}{i}`` (some non-ASCII)."""
    keys = [f"{prefix}{i}" + ("-é" if i % 7 == 0 else "") for i in range(n)]
    with LatentCacheWriter(folder, flush_every=4096) as writer:
        for i, key in enumerate(keys):
            writer.append(key, np.full((4, 1, 1), i % 2048, np.float16))
    return keys


def no_list_loaded(cache) -> bool:
    return cache.__dict__.get("_keys") is None and cache.__dict__.get("_key_index") is None


def test_keys_are_looked_up_in_the_table_across_its_blocks_without_a_key_list(tmp_path):
    keys = write_tiny(tmp_path, 20000)  # the hash index spans 3 blocks, the offsets 3, the bytes 4
    cache = LatentCache(tmp_path)
    assert cache.meta["key_table"] == {"block_bytes": keytable.BLOCK_BYTES}
    assert [cache.index(k) for k in keys] == list(range(len(keys)))
    assert all(k in cache for k in keys[::97]) and "key20000" not in cache and 5 not in cache
    with pytest.raises(UnknownKeyError, match="no item with key 'nope'"):
        cache.index("nope")
    assert [cache.key(i) for i in (0, 7, 19999, -1)] == [keys[0], keys[7], keys[19999], keys[-1]]
    assert cache.keys_of([19999, 3, 3]) == [keys[19999], keys[3], keys[3]]
    latents, _, batch_keys = read_batch(cache, [14, 2, 19999], return_keys=True)
    assert batch_keys == [keys[14], keys[2], keys[19999]] and latents[:, 0, 0, 0].tolist() == [14, 2, 19999 % 2048]
    assert no_list_loaded(cache)
    assert cache.keys == keys  # the compatible whole list, from the table
    verify_cache(tmp_path)


def test_draws_hash_the_batch_keys_from_the_table(tmp_path):
    write_distributions(tmp_path, n=40)
    cache = LatentCache(tmp_path)
    batch = cache.read_batch(list(range(40)), flip=0.5, seed=1, epoch=0)
    names = [f"item{i}" for i in range(40)]
    assert torch.equal(batch["flipped"], sampling.flip_draws(sampling.item_seeds(names, 1, 0), 0.5))
    assert no_list_loaded(cache)


def _flip_byte(path, at):
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x20]))


def test_a_damaged_key_table_block_is_refused_before_a_wrong_key_or_item(tmp_path):
    keys = write_tiny(tmp_path, 20000)
    # a key's bytes: key(i) and index(key) of an item in the damaged block raise, naming the file and block
    blob = cache_path(tmp_path, "train", "key_bytes")
    _flip_byte(blob, keytable.BLOCK_BYTES + 5)  # in block 1 of keys.bin
    cache = LatentCache(tmp_path)  # opening reads none of the table
    assert cache.key(0) == keys[0]  # block 0 is intact
    damaged = int(np.searchsorted(np.load(cache_path(tmp_path, "train", "key_offsets")), keytable.BLOCK_BYTES + 5, side="right")) - 1
    with pytest.raises(CacheCorruptError, match=r"keys\.bin: block 1 .*fails its CRC-32"):
        cache.key(damaged)
    with pytest.raises(CacheCorruptError, match=r"keys\.bin: block 1"):
        cache.index(keys[damaged])
    with pytest.raises(CacheCorruptError, match=r"keys\.bin: block 1"):
        read_batch(cache, [0, damaged], return_keys=True)
    with pytest.raises(CacheCorruptError, match=r"keys\.bin"):
        verify_cache(tmp_path)
    # the hash index: a lookup that probes the damaged block raises instead of answering "no such key"
    _flip_byte(blob, keytable.BLOCK_BYTES + 5)
    index = cache_path(tmp_path, "train", "key_hashes")
    _flip_byte(index, os.path.getsize(index) - 3)  # the last block
    fresh = LatentCache(tmp_path)
    largest = max(keys, key=sampling.key_hash)  # its entry is in the last block
    with pytest.raises(CacheCorruptError, match=r"keys\.hash\.npy: block 2"):
        fresh.index(largest)
    # the CRC file itself is checked against the meta's record
    _flip_byte(index, os.path.getsize(index) - 3)
    _flip_byte(cache_path(tmp_path, "train", "key_crc32"), os.path.getsize(cache_path(tmp_path, "train", "key_crc32")) - 1)
    with pytest.raises(CacheCorruptError, match=r"keys\.crc32\.npy fails its CRC-32"):
        LatentCache(tmp_path).key(0)


def test_a_cache_from_before_the_key_table_reads_its_keys_file(tmp_path):
    keys = write_tiny(tmp_path, 50)
    meta_path = cache_path(tmp_path, "train", "meta")
    with open(meta_path) as fh:
        meta = json.load(fh)
    del meta["key_table"]
    for kind in (*keytable.TABLES, keytable.CRC_KIND):
        del meta["files"][kind]
        os.remove(cache_path(tmp_path, "train", kind))
    with open(meta_path, "w") as fh:
        json.dump(meta, fh)
    _forget(tmp_path, "index_blocks", tables.CRC_KIND)  # (written before both)
    cache = LatentCache(tmp_path)
    assert cache.index(keys[31]) == 31 and keys[2] in cache and "nope" not in cache
    assert cache.key(9) == keys[9] and cache.keys_of([4, 1]) == [keys[4], keys[1]]
    assert read_batch(cache, [3], return_keys=True)[2] == [keys[3]]
    verify_cache(tmp_path)


def _batch_in_child(cache, indices):
    return read_batch(cache, indices, return_keys=True)


def test_a_cache_pickles_as_its_paths_and_meta_and_a_spawned_worker_reads_the_same_batch(tmp_path):
    keys = write_tiny(tmp_path, 100_000)
    cache = LatentCache(tmp_path)
    picked = [99_999, 0, 4242]
    want = read_batch(cache, picked, return_keys=True)
    blob = pickle.dumps(cache)
    assert len(blob) < 64 << 10  # (the shapes alone are 2.4 MB)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got = pool.apply(_batch_in_child, (cache, picked))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2] == [keys[i] for i in picked]


def test_a_pickled_cache_unpickled_after_a_rebuild_of_other_items_raises(tmp_path):
    write_tiny(tmp_path, 30)
    blob = pickle.dumps(LatentCache(tmp_path))
    write_tiny(tmp_path, 31, prefix="other")  # a rebuild: more items, another index
    with pytest.raises(CacheCorruptError, match="rebuilt after this reader opened it"):
        pickle.loads(blob)


# -- the shapes and offsets: mapped at open, checked a block of items at a time ----------------------------------
def _forget(folder, entry, kind):
    """The cache as written before ``entry`` (and its file ``kind``) existed."""
    meta_path = cache_path(folder, "train", "meta")
    with open(meta_path) as fh:
        meta = json.load(fh)
    del meta[entry], meta["files"][kind]
    os.remove(cache_path(folder, "train", kind))
    with open(meta_path, "w") as fh:
        json.dump(meta, fh)


def _bump_shape(folder, item):
    """Item ``item``'s last size one larger in the shapes file (the offsets then disagree)."""
    path = cache_path(folder, "train", "shapes")
    shapes = np.load(path, mmap_mode="r+")
    shapes[item, -1] += 1
    shapes.flush()


def test_a_damaged_index_block_is_refused_when_its_items_are_first_read(tmp_path):
    write_tiny(tmp_path, 20000)  # 3 blocks of 8192 items
    assert LatentCache(tmp_path).meta["index_blocks"] == {"block_items": tables.BLOCK_ITEMS}
    _bump_shape(tmp_path, 9000)  # in block 1
    cache = LatentCache(tmp_path)  # opening checks only the last block
    assert cache[5].tolist() == [[[5.0]]] * 4 and read_batch(cache, [0, 8191])[0].shape == (2, 4, 1, 1)
    for read in (lambda: cache[8192], lambda: read_batch(cache, [0, 9000]), lambda: cache.record(8200),
                 lambda: cache.shapes):
        with pytest.raises(CacheCorruptError, match=r"block 1 \(items 8192\.\.16383\) fails its CRC-32"):
            read()
    with pytest.raises(CacheCorruptError, match=r"shapes\.npy fails its CRC-32"):
        verify_cache(tmp_path)
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # a worker checks for itself
        with pytest.raises(CacheCorruptError, match="block 1"):
            pool.apply(_batch_in_child, (cache, [9000]))
    _bump_shape(tmp_path, 19999)  # the last block, whose end offset sizes the data file: refused at open
    with pytest.raises(CacheCorruptError, match=r"block 2 \(items 16384\.\.19999\) fails its CRC-32"):
        LatentCache(tmp_path)


def test_a_cache_from_before_the_index_blocks_is_checked_whole_when_it_opens(tmp_path):
    write_tiny(tmp_path, 20000)
    _forget(tmp_path, "index_blocks", tables.CRC_KIND)
    cache = LatentCache(tmp_path)
    assert cache.__dict__["_index_blocks"] is None and cache[9000].tolist() == [[[9000 % 2048]]] * 4
    _bump_shape(tmp_path, 19999)
    with pytest.raises(CacheCorruptError, match="offsets .* disagree with the shapes"):
        LatentCache(tmp_path)


# -- the writer's bulk path --------------------------------------------------------------------------------------
def test_append_many_writes_the_bytes_of_one_append_per_item_and_checks_everything_first(tmp_path):
    rng = np.random.default_rng(0)
    latents = rng.standard_normal((300, 4, 2, 3)).astype(np.float32)
    keys = [f"k{i}" for i in range(300)]
    hashes = [bytes([i % 256]) * 16 if i % 3 else None for i in range(300)]
    with LatentCacheWriter(tmp_path / "one", flush_every=64) as writer:
        for key, latent, h in zip(keys, latents, hashes):
            writer.append(key, latent, source_hash=h)
    writer = LatentCacheWriter(tmp_path / "bulk", flush_every=64)
    writer.append_many(keys[:100], torch.from_numpy(latents[:100]), source_hashes=hashes[:100])
    for bad, match in (((["k100", "k100"], latents[100:102]), "'k100' appears twice"),
                       ((["k5", "k101"], latents[100:102]), "'k5' was already written"),
                       ((["k100"], latents[100:102]), r"B = len\(keys\) = 1"),
                       ((["k100", "k101"], np.stack([latents[100], np.full((4, 2, 3), np.inf, np.float32)])), "key 'k101' holds values"),
                       ((["k100"], latents[100:101, :2]), "4 channels")):
        with pytest.raises((ValueError, TypeError), match=match):
            writer.append_many(*bad)
    assert len(writer) == 100
    writer.close()  # an interrupted bulk import resumes like any other
    with LatentCacheWriter(tmp_path / "bulk", flush_every=64) as writer:
        assert writer.resumed and len(writer) == 100
        writer.append_many(keys[100:], latents[100:], source_hashes=hashes[100:])
    for kind in ("data", "shapes", "offsets", "checksums", "hashes", "keys", *keytable.TABLES, keytable.CRC_KIND, tables.CRC_KIND, "meta"):
        assert open(cache_path(tmp_path / "bulk", "train", kind), "rb").read() == open(cache_path(tmp_path / "one", "train", kind), "rb").read(), kind


def test_a_sharded_cache_pickles_as_its_shards_paths_and_reads_keys_from_their_tables(tmp_path):
    from latentfast.cache.store.shards import merge_caches

    parts = [str(tmp_path / f"part{s}") for s in range(2)]
    keys = [write_tiny(part, 30_000, prefix=f"s{s}-") for s, part in enumerate(parts)]
    merge_caches(parts[::-1], str(tmp_path / "merged"))
    cache = LatentCache(str(tmp_path / "merged"))
    picked = [0, 29_999, 30_000, 59_999]
    want = read_batch(cache, picked, return_keys=True)
    assert want[2] == [keys[1][0], keys[1][-1], keys[0][0], keys[0][-1]] and cache.key(30_001) == keys[0][1]
    assert no_list_loaded(cache) and all(no_list_loaded(s) for s in cache.shards)
    blob = pickle.dumps(cache)
    assert len(blob) < 64 << 10  # (the order alone is 960 KB)
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        got = pool.apply(_batch_in_child, (cache, picked))
    assert torch.equal(got[0], want[0]) and got[2] == want[2]
