"""The index at 10^8 items (issue 33): what a batch, a worker and ``verify`` cost must not grow with N.

Each test counts what a step allocates (``tracemalloc``: numpy reports its arrays to it) or what it
reads, against a bound well under one table of the cache's items; none measures time.
"""
from __future__ import annotations

import json
import tracemalloc
import zlib

import numpy as np
import pytest
import torch

from latentfast.cache import LatentCache, LatentCacheWriter, read_batch, verify_cache
from latentfast.cache.store import keytable, reader
from latentfast.errors import CacheCorruptError
from latentfast.testing import poisoned_like

N = 200_000  # tiny items: a table of 4 bytes an item is 800 KB, a key list ~14 MB


def write_tiny(folder, n: int = N) -> None:
    """``n`` items of shape [4, 1, 1], item ``i`` holding ``i % 2048``; keys ``k{i}`` (every 5th non-ASCII)."""
    values = np.arange(n) % 2048
    with LatentCacheWriter(folder, flush_every=1 << 14) as writer:
        for lo in range(0, n, 1 << 14):
            hi = min(n, lo + (1 << 14))
            keys = [f"k{i}" + ("-é" if i % 5 == 0 else "") for i in range(lo, hi)]
            writer.append_many(keys, np.broadcast_to(values[lo:hi, None, None, None], (hi - lo, 4, 1, 1)).astype(np.float16))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    write_tiny(folder)
    return folder


def peak_bytes(step) -> int:
    """The most memory traced while ``step()`` runs, above what was traced before it."""
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        step()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def test_a_first_keyed_batch_allocates_for_its_items_not_for_every_item(tiny):
    cache = LatentCache(tiny)
    cache.key(0), cache[0]  # the first-use costs that do not grow with N: the key table's and index's CRC files read
    picked = np.random.default_rng(0).integers(0, N, 64)
    got = {}
    peak = peak_bytes(lambda: got.update(batch=read_batch(cache, picked, return_keys=True)))
    # a table of every item's size (int32, made from their int64 differences) would be 2.4 MB here
    assert peak < 4 * N, f"a first batch of 64 items allocated {peak} bytes at N={N}"
    latents, shapes, keys = got["batch"]
    assert latents[:, 0, 0, 0].tolist() == (picked % 2048).tolist() and keys[1] == f"k{picked[1]}" + ("-é" if picked[1] % 5 == 0 else "")
    assert shapes.tolist() == [[4, 1, 1]] * 64
    # the public whole-cache source is still there, and reads the same rows
    data, row_offsets, widths, pitch = cache.gather_source()
    assert len(row_offsets) == len(widths) == N and pitch == 0 and widths[:3].tolist() == [4, 4, 4]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_shaped_batches_from_their_own_spans_equal_the_items(tmp_path, dtype):
    """Batches of several shapes and dtypes, odd sizes, repeated and reversed items, a non-contiguous index,
    into poisoned outputs, equal the items read one by one."""
    rng = np.random.default_rng(1)
    shapes = [(4, 3, 5), (4, 2, 7), (4, 1, 1)]
    with LatentCacheWriter(tmp_path) as writer:
        for i in range(300):
            writer.append(f"i{i}", torch.from_numpy(rng.standard_normal(shapes[i % 3], dtype=np.float32)).to(dtype))
    cache = LatentCache(tmp_path)
    for size in (1, 7, 33):
        members = np.flatnonzero(np.arange(300) % 3 == size % 3)
        picked = rng.choice(members, size)
        picked[-1] = picked[0]  # a repeat
        index = torch.from_numpy(np.repeat(picked[::-1], 2))[::2]  # reversed, a stride-2 view
        expected = torch.stack([cache[i] for i in index.tolist()])
        latents, got_shapes = read_batch(cache, index)
        assert torch.equal(latents, expected) and got_shapes.tolist() == [list(shapes[size % 3])] * size
        out = poisoned_like(expected.shape, dtype)
        latents, _ = read_batch(cache, index, out=out, dtype=dtype)
        assert latents.data_ptr() == out.data_ptr() and torch.equal(out, expected)
        as_float = read_batch(cache, picked.tolist(), dtype=torch.float32)[0]
        assert torch.equal(as_float, torch.stack([cache[i] for i in picked.tolist()]).float())


def test_a_batch_refuses_a_bad_index_before_reading(tiny):
    cache = LatentCache(tiny)
    with pytest.raises(IndexError, match=f"indices.1. = {N} is out of range for a cache of {N} rows"):
        read_batch(cache, [0, N])


def test_verify_builds_no_key_list(tiny, monkeypatch):
    """verify checks the key table block by block and its cuts a chunk at a time: a list of 10^8 keys would be
    ~7 GB in the verifying process."""
    def whole_list(self):
        raise AssertionError("verify loaded every key")

    monkeypatch.setattr(keytable.KeyTable, "all", whole_list)
    report = verify_cache(tiny)
    assert report["rows"] == N and report["checksummed"]


def test_verify_refuses_keys_cut_inside_a_character(tiny, monkeypatch):
    """The key table's offsets must cut its bytes into UTF-8 keys: checked a chunk at a time (so a cut
    between chunks counts), against tables whose blocks have passed their CRCs."""
    cache = LatentCache(tiny)
    table = cache._key_table()
    table.check_all()  # every block checked: what follows changes the mapped arrays, not the files
    table.check_cuts(chunk=7)  # the real table passes with chunks that end anywhere
    maps = table._map()
    offsets, raw, first = maps["key_offsets"]
    accented = 5 * 11  # key 55 ends in "é", two bytes: cut it between them
    bad = np.array(offsets)
    bad[accented + 1] -= 1
    maps["key_offsets"] = (bad, bad.view(np.uint8), first)
    for chunk in (7, 1 << 18):
        with pytest.raises(CacheCorruptError, match="key_bytes file .* holds a key that is not UTF-8"):
            table.check_cuts(chunk=chunk)
    bad[accented + 1] = bad[accented] - 1  # offsets that go back
    with pytest.raises(CacheCorruptError, match="key_offsets file .* does not cut the key table into"):
        table.check_cuts(chunk=7)


def test_bad_blocks_a_group_at_a_time_finds_what_a_block_by_block_pass_finds(tmp_path, monkeypatch):
    """Damaged CRCs of a writer's cache and non-finite rows of a cache without checksums, in groups of a few
    blocks (a group is looked at block by block only when it holds a bad one)."""
    write_tiny(tmp_path / "crc", 5000)
    data = tmp_path / "crc" / "train.latents.f16.dat"
    raw = bytearray(data.read_bytes())
    for item in (3, 4, 2999, 4999):
        raw[8 * item] ^= 0xFF
    data.write_bytes(bytes(raw))
    monkeypatch.setattr(reader, "_CHECK_UNITS", 4 * 100)  # groups of 100 one-item blocks
    cache = LatentCache(tmp_path / "crc")
    found, block_rows = reader.bad_blocks(cache)
    assert block_rows == 1 and found == [(b, b, b + 1, None) for b in (3, 4, 2999, 4999)]
    assert reader.bad_blocks(cache, first_only=True)[0] == [(3, 3, 4, None)]
    with pytest.raises(CacheCorruptError, match=r"block 3 \(rows 3..3\) fails its CRC-32"):
        verify_cache(tmp_path / "crc")

    # non-finite values under matching checksums (as a writer that did not check them would leave): the
    # damaged items' CRCs restored, one value of three items made inf or NaN with its CRC (and the record
    # of the checksums file in the meta) updated
    data.write_bytes(bytes(raw[:8 * 3]) + bytes([raw[24] ^ 0xFF]) + bytes(raw[25:]))
    fixed = bytearray(data.read_bytes())
    for item in (4, 2999, 4999):
        fixed[8 * item] ^= 0xFF
    sums = np.load(tmp_path / "crc" / "train.latents.crc32.npy")
    for item, value in ((17, np.inf), (18, np.nan), (401, -np.inf)):
        fixed[8 * item + 2: 8 * item + 4] = np.float16(value).tobytes()
        sums[item] = zlib.crc32(bytes(fixed[8 * item: 8 * item + 8]))
    data.write_bytes(bytes(fixed))
    np.save(tmp_path / "crc" / "train.latents.crc32.npy", sums)
    meta_path = tmp_path / "crc" / "train.latents.meta.json"
    meta = json.loads(meta_path.read_text())
    meta["files"]["checksums"] = zlib.crc32((tmp_path / "crc" / "train.latents.crc32.npy").read_bytes())
    meta_path.write_text(json.dumps(meta))
    cache = LatentCache(tmp_path / "crc")
    assert reader.bad_blocks(cache)[0] == [(b, b, b + 1, b) for b in (17, 18, 401)]
    with pytest.raises(CacheCorruptError, match=r"row 17 \(block 17\) holds a non-finite value"):
        verify_cache(tmp_path / "crc")


def test_a_lookup_reads_one_or_two_hash_blocks_at_any_size(tiny, monkeypatch):
    """``index(key)`` starts at the block where the key's hash would sit among evenly spread hashes (they
    are: BLAKE2b) and steps from there: one or two of the hash index's blocks per lookup, not a binary
    search's log2(blocks) (5 of this table's 25), so a lookup costs the same at 10^6 and 10^9 items."""
    cache = LatentCache(tiny)
    table = cache._key_table()
    per = table.block_bytes // 8
    blocks = -(-N // per)
    assert blocks >= 16  # (else a binary search would read few blocks too)
    touched = []
    checked = type(table)._checked

    def spy(self, kind, lo, hi):
        if kind == "key_hashes":
            touched.extend(range(lo // per, (hi - 1) // per + 1))
        return checked(self, kind, lo, hi)

    monkeypatch.setattr(type(table), "_checked", spy)
    rng = np.random.default_rng(3)
    rows = rng.integers(0, N, 300).tolist() + [0, N - 1]
    for row in rows:
        touched.clear()
        key = f"k{row}" + ("-é" if row % 5 == 0 else "")
        assert cache.index(key) == row
        assert len(set(touched)) <= 2, f"index({key!r}) read hash blocks {sorted(set(touched))}"
    for absent in ("k-1", "nope", "k200000", ""):  # a miss reads as few
        touched.clear()
        assert absent not in cache and len(set(touched)) <= 2
