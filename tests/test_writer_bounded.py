"""The writer with bounded memory (issue 33): per-item records in the log and file tables, not Python objects.

The finished cache's files are checked byte for byte against the files the index helpers make from the
whole item list (what the writer wrote when it kept every record in memory), for ``append`` and
``append_many`` alike; the tables' parts (the hash table of keys, the bucketed sort of key hashes, the
bulk log lines) against their plain definitions; resume after SIGKILL against an uninterrupted build.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest

from latentfast.cache import LatentCache, LatentCacheWriter
from latentfast.cache.store import durable, keytable, tables
from latentfast.cache.store import format as fmt
from latentfast.cache.store.building import Column, HashRuns
from latentfast.errors import CacheCorruptError, CacheError, InvalidArgumentError
from latentfast.sampling import key_hash

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cache_files(folder, split="train") -> dict[str, bytes]:
    """Every file of a finished split, by name (nothing else may be left in the folder)."""
    names = sorted(os.listdir(folder))
    assert all(n.startswith(f"{split}.latents.") for n in names), names  # no build folder, progress log or partial left
    return {n: open(os.path.join(folder, n), "rb").read() for n in names}


def items(n, seed, shape=None):
    """``n`` random items: (key, float16 latent, source hash or None, info or None); ``shape``: all of one shape."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        s = shape or (4, int(rng.integers(1, 4)), int(rng.integers(1, 5)))
        source = hashlib.blake2b(f"{seed}-{i}".encode(), digest_size=16).digest() if rng.random() < 0.6 else None
        info = {"i": i, "crop": [int(rng.integers(9)), 2], "name": "é"} if rng.random() < 0.3 else None
        out.append((f"k{seed}-{i:05d}-ü" if i % 7 == 0 else f"k{seed}-{i:05d}", rng.standard_normal(s).astype(np.float16), source, info))
    return out


def expected_files(records, split="train") -> dict[str, bytes]:
    """The index files of a cache of ``records``, from the whole lists at once (the writer's files before
    issue 33), with the meta's CRC record of them."""
    shapes = np.asarray([list(z.shape) for _, z, _, _ in records], dtype=np.int64)
    offsets = fmt.shaped_offsets(shapes)
    keys = [k for k, _, _, _ in records]
    hashes = np.zeros((len(records), 16), np.uint8)
    for i, (_, _, h, _) in enumerate(records):
        if h is not None:
            hashes[i] = np.frombuffer(h, np.uint8)
    info = [inf or {} for _, _, _, inf in records]
    files = {"shapes": fmt.npy_bytes(shapes), "offsets": fmt.npy_bytes(offsets),
             "checksums": fmt.npy_bytes(np.asarray([zlib.crc32(z) for _, z, _, _ in records], dtype=np.uint32)),
             "keys": (json.dumps(keys, separators=(",", ":")) + "\n").encode()}
    if any(h is not None for _, _, h, _ in records):
        files["hashes"] = fmt.npy_bytes(hashes)
    if any(info):
        files["info"] = (json.dumps([json.loads(json.dumps(x, sort_keys=True)) for x in info], separators=(",", ":")) + "\n").encode()
    key_files, _ = keytable.table_files(keys)
    files.update(key_files)
    files[tables.CRC_KIND] = tables.index_files(shapes, offsets)[0]
    return {os.path.basename(fmt.cache_path("", split, kind)): payload for kind, payload in files.items()}, fmt.file_crcs(files)


def write_one_by_one(folder, records, **kwargs):
    with LatentCacheWriter(folder, flush_every=5, **kwargs) as writer:
        for key, z, h, info in records:
            writer.append(key, z, source_hash=h, info=info)


def write_in_batches(folder, records, batch=37):
    with LatentCacheWriter(folder, flush_every=64) as writer:
        for s in range(0, len(records), batch):
            part = records[s: s + batch]
            writer.append_many([k for k, _, _, _ in part], np.stack([z for _, z, _, _ in part]),
                               source_hashes=[h for _, _, h, _ in part])


def test_finished_files_are_the_whole_list_files_byte_for_byte(tmp_path):
    records = items(300, seed=1)
    write_one_by_one(tmp_path / "c", records)
    files = cache_files(tmp_path / "c")
    expected, crcs = expected_files(records)
    for name, payload in expected.items():
        assert files[name] == payload, name
    meta = json.loads(files["train.latents.meta.json"])
    assert meta["files"] == crcs
    assert meta["n"] == 300 and meta["w_max"] == max(z.shape[-1] for _, z, _, _ in records)
    assert files["train.latents.f16.dat"] == b"".join(z.tobytes() for _, z, _, _ in records)
    cache = LatentCache(tmp_path / "c")
    for i in (0, 7, 299):
        assert cache.index(records[i][0]) == i
        assert np.array_equal(cache[i].numpy(), records[i][1])


def test_append_many_writes_the_same_cache_as_append(tmp_path):
    records = [(k, z, h, None) for k, z, h, _ in items(1000, seed=2, shape=(4, 2, 3))]
    write_one_by_one(tmp_path / "one", records)
    write_in_batches(tmp_path / "many", records)
    one, many = cache_files(tmp_path / "one"), cache_files(tmp_path / "many")
    assert one.keys() == many.keys()
    for name in one:
        assert one[name] == many[name], name
    assert one == {**expected_files(records)[0], **{n: one[n] for n in one if n.endswith(("meta.json", ".dat"))}}


def test_bulk_log_lines_are_the_encoders_lines():
    keys = ["a", "é\"\\\n", "k" * 40, "\U0001f600"]
    hashes = [None, "00" * 16, None, "ab" * 16]
    crcs = [0, 1, 2**32 - 1, 12345]
    records = [{"k": k, "s": [4, 2, 3], "c": c, **({} if h is None else {"h": h})} for k, c, h in zip(keys, crcs, hashes)]
    assert durable.item_lines(keys, [4, 2, 3], crcs, hashes).encode() == durable.log_bytes(b"", records)


def test_key_hashes_are_sampling_key_hash():
    keys = ["", "a", "item000000001", "é" * 50, "\U0001f600x"]
    encoded = [k.encode() for k in keys]
    assert keytable.key_hashes(encoded).tolist() == [key_hash(k) for k in keys]
    assert [keytable.key_hash_of(e) for e in encoded] == [key_hash(k) for k in keys]


@pytest.mark.parametrize("n, chunk", [(1, 4), (1000, 1000), (5000, 64), (4097, 100)])
def test_bucketed_hash_sort_is_the_stable_argsort(n, chunk):
    rng = np.random.default_rng(n)
    hashes = rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False)
    hashes[rng.integers(0, n, n // 3)] = hashes[rng.integers(0, n, n // 3)]  # equal hashes: must stay in item order
    hashes[: n // 10] = hashes[0]
    out_h, out_r = np.zeros(n, np.uint64), np.zeros(n, np.int64)
    keytable.sort_hashes(lambda lo, hi: hashes[lo:hi], n, out_h, out_r, chunk=chunk)
    order = np.argsort(hashes, kind="stable")
    assert np.array_equal(out_r, order) and np.array_equal(out_h, hashes[order])


def test_hash_runs_find_every_item_through_growth_and_collisions(tmp_path):
    slots = HashRuns(str(tmp_path / "slots"), memory_slots=64, chunk=7, stride=4, fence_max=8)
    rng = np.random.default_rng(0)
    hashes = rng.integers(0, 2**64, 3000, dtype=np.uint64)
    hashes[100:200] = hashes[7]  # a run of equal hashes (true 64-bit collisions)
    hashes[300:400] = (hashes[300:400] >> np.uint64(20)) << np.uint64(20)  # equal low bits: the same first slot
    for s in range(0, 2000, 333):
        slots.add(hashes[s: min(2000, s + 333)], np.arange(s, min(2000, s + 333)))
    for i in range(2000, 3000):
        slots.add_one(int(hashes[i]), i)
    assert slots.count == 3000 and len(slots._runs) > 1  # (entries in the memory table and in merged runs)
    which, found = slots.find(hashes)
    pairs = set(zip(which.tolist(), found.tolist()))
    for i in range(3000):
        assert (i, i) in pairs
        expected = {j for j in range(3000) if hashes[j] == hashes[i]}
        assert {item for w, item in pairs if w == i} == expected
        assert set(slots.find_one(int(hashes[i]))) == expected
    assert slots.find_one(12345) == [] and slots.find(np.asarray([12345], np.uint64))[0].size == 0
    slots.close()


def test_column_reads_back_staged_and_written_rows(tmp_path, monkeypatch):
    monkeypatch.setattr("latentfast.cache.store.building.STAGE_BYTES", 64)
    column = Column(str(tmp_path / "c"), np.int64, 3)
    rows = np.arange(300, dtype=np.int64).reshape(100, 3)
    for s in range(0, 100, 7):
        column.append(rows[s: s + 7], len(rows[s: s + 7]))
    assert column.rows == 100 and np.array_equal(column.read(0, 100), rows) and np.array_equal(column.read(95, 100), rows[95:])
    column.truncate(40)
    column.append(rows[:2].tobytes(), 2)
    assert np.array_equal(column.read(0, 42), np.concatenate([rows[:40], rows[:2]]))
    assert [lo for lo, _ in column.chunks(16)] == [0, 16, 32]
    column.close()


def test_duplicate_keys_are_refused_pending_logged_or_in_one_batch(tmp_path):
    z = np.zeros((4, 1, 2), np.float16)
    with LatentCacheWriter(tmp_path, flush_every=3) as writer:
        for i in range(10):
            writer.append(f"k{i}", z)
        with pytest.raises(InvalidArgumentError, match=r"key 'k1' was already written"):  # logged
            writer.append("k1", z)
        with pytest.raises(InvalidArgumentError, match=r"key 'k9' was already written"):  # pending, not logged yet
            writer.append("k9", z)
        with pytest.raises(InvalidArgumentError, match=r"key 'k4' was already written"):
            writer.append_many(["new", "k4", "k2"], np.zeros((3, 4, 1, 2), np.float16))
        with pytest.raises(InvalidArgumentError, match=r"key 'x' appears twice"):
            writer.append_many(["x", "y", "x"], np.zeros((3, 4, 1, 2), np.float16))
        with pytest.raises(InvalidArgumentError, match="not valid UTF-8"):
            writer.append_many(["ok", "bad\udcff"], np.zeros((2, 4, 1, 2), np.float16))
        assert len(writer) == 10 and "new" not in writer and "x" not in writer and "k3" in writer and 3 not in writer
        writer.append_many(["new", "x"], np.ones((2, 4, 1, 2), np.float16))
        assert "new" in writer and len(writer) == 12
    assert LatentCache(tmp_path).index("x") == 11
    with pytest.raises(CacheError, match="writer .* is finished: its tables of keys are gone"):
        "x" in writer  # noqa: B015 (a finished writer answers no lookup rather than a wrong False)


def test_colliding_key_hashes_are_told_apart_by_their_bytes(tmp_path, monkeypatch):
    """Every key under one hash: membership, refusal and source hashes come from the key bytes compared."""
    monkeypatch.setattr(keytable, "key_hashes", lambda encoded: np.full(len(encoded), 42, np.uint64))
    monkeypatch.setattr(keytable, "key_hash_of", lambda encoded: 42)
    z = np.zeros((4, 1, 1), np.float16)
    writer = LatentCacheWriter(tmp_path)
    for i in range(30):
        writer.append(f"k{i}", z, source_hash=bytes([i]) * 16)
    writer.append_many([f"m{i}" for i in range(30)], np.zeros((30, 4, 1, 1), np.float16))
    assert all(f"k{i}" in writer and f"m{i}" in writer for i in range(30)) and "k30" not in writer
    assert writer.source_hash("k17") == (bytes([17]) * 16).hex() and writer.source_hash("m3") is None
    with pytest.raises(InvalidArgumentError, match="'m29' was already written"):
        writer.append_many(["fresh", "m29"], np.zeros((2, 4, 1, 1), np.float16))
    with pytest.raises(InvalidArgumentError, match="'k0' was already written"):
        writer.append("k0", z)
    assert writer.keys == [f"k{i}" for i in range(30)] + [f"m{i}" for i in range(30)]
    writer.close()


_KILLED_BUILD = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    from latentfast.cache import LatentCacheWriter
    folder, stop = sys.argv[1], int(sys.argv[2])
    writer = LatentCacheWriter(folder, flush_every=50)
    rng = np.random.default_rng(0)
    batch = rng.standard_normal((stop, 4, 2, 2)).astype(np.float16)
    for s in range(0, stop, 64):
        writer.append_many([f"item{i}" for i in range(s, min(stop, s + 64))], batch[s: s + 64])
    for i in range(stop, stop + 30):  # one by one, with info: more lines after the last flush
        writer.append(f"item{i}", batch[i % stop], info={"i": i})
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_resume_after_sigkill_finishes_the_same_cache_as_one_run(tmp_path):
    stop = 1000
    done = subprocess.run([sys.executable, "-c", _KILLED_BUILD, str(tmp_path / "killed"), str(stop)],
                          env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, timeout=600)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    rng = np.random.default_rng(0)
    batch = rng.standard_normal((stop, 4, 2, 2)).astype(np.float16)
    everything = [(f"item{i}", batch[i % stop], {"i": i} if i >= stop else None) for i in range(stop + 30)]
    writer = LatentCacheWriter(tmp_path / "killed", flush_every=50)
    # the last durable point: the 50th item after the last batch's flush at 960 (1,010 items logged, 20 lost)
    assert writer.resumed and len(writer) == 1010
    assert "item1009" in writer and "item1010" not in writer and writer.source_hash("item5") is None
    for key, z, info in everything:
        if key not in writer:
            writer.append(key, z, info=info)
    writer.finish()
    with LatentCacheWriter(tmp_path / "whole", flush_every=50) as whole:
        for key, z, info in everything:
            whole.append(key, z, info=info)
    assert cache_files(tmp_path / "killed") == cache_files(tmp_path / "whole")


def test_a_damaged_item_is_dropped_with_all_after_it_and_rewritten(tmp_path):
    records = items(60, seed=3, shape=(4, 1, 3))
    writer = LatentCacheWriter(tmp_path / "c", flush_every=8)
    for key, z, h, info in records:
        writer.append(key, z, source_hash=h, info=info)
    writer.flush()
    with open(fmt.partial_path(fmt.cache_path(tmp_path / "c", "train", "data")), "r+b") as fh:
        fh.seek(41 * 24 + 5)
        fh.write(bytes([fh.read(1)[0] ^ 0x10]))
    with pytest.raises(CacheCorruptError, match=r"item 41 .* the 18 items after it were dropped"):
        writer.finish()
    writer.close()
    writer = LatentCacheWriter(tmp_path / "c", flush_every=8)
    assert len(writer) == 41 and records[40][0] in writer and records[41][0] not in writer
    for key, z, h, info in records[41:]:
        writer.append(key, z, source_hash=h, info=info)
    writer.finish()
    write_one_by_one(tmp_path / "whole", records)
    assert cache_files(tmp_path / "c") == cache_files(tmp_path / "whole")


_MEMORY = textwrap.dedent("""
    import sys
    import numpy as np
    from latentfast.bench.bench_index import write_tiny
    print(write_tiny(sys.argv[1], int(sys.argv[2]), bulk=True)["anon_growth"])
""")


def test_writer_memory_does_not_grow_with_the_item_count(tmp_path):
    """RssAnon growth while appending 300,000 tiny items: the writer before issue 33 grew ~130 MiB here."""
    done = subprocess.run([sys.executable, "-c", _MEMORY, str(tmp_path / "c"), "300000"], env={**os.environ, "PYTHONPATH": REPO},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) < 24 * 2**20
