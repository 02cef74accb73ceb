"""The node-shared local chunk cache: warm reads make no requests, several processes share one
cache with one download per chunk (counted at a loopback proxy), LRU eviction keeps the byte
budget (on disk too) by a shared counter, prefetch, a corrupt local chunk is caught and fetched again,
and DataLoader workers read through it, spawned or forked after the parent used the client."""
from __future__ import annotations

import multiprocessing
import os
import time
import zlib

import numpy as np
import pytest

pytest.importorskip("obstore", reason="remote caches need obstore (pip install 'latentfast[s3]')")
pytest.importorskip("moto.server", reason="the loopback S3 server is moto[server] (pip install 'latentfast[test]')")

from latentfast.cache.remote import ChunkCache, RemoteReader
from latentfast.errors import InvalidArgumentError
from latentfast.testing import FaultProxy, s3_options, s3_with_objects

DATA = "data.bin"
CHUNK = 4096
PAYLOAD = np.random.default_rng(11).integers(0, 256, size=100 * CHUNK + 123, dtype=np.uint8)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    files = {DATA: PAYLOAD.tobytes(), "meta.json": b"{}"}
    with s3_with_objects(str(tmp_path_factory.mktemp("objects")), "s3://lfcache/f", files) as endpoint:
        yield endpoint


def cached_reader(endpoint: str, cache_dir, budget: int = 1 << 30, **kw) -> RemoteReader:
    return RemoteReader("s3://lfcache/f", s3_options(endpoint), local_cache=str(cache_dir), local_cache_bytes=budget,
                        chunk_bytes=CHUNK, **kw)


def read(reader, offsets, lengths, crc32=None) -> np.ndarray:
    out = np.zeros(int(np.sum(lengths)), dtype=np.uint8)
    reader.read_ranges(DATA, offsets, lengths, out, crc32=crc32)
    return out


def want(offsets, lengths) -> np.ndarray:
    return np.concatenate([PAYLOAD[o:o + n] for o, n in zip(offsets, lengths)])


def fetched_chunks(gets) -> list[int]:
    """Chunk indices covered by the proxy's recorded ``bytes=a-b`` GETs (with repeats)."""
    chunks = []
    for _path, rng in gets:
        a, b = (int(x) for x in rng.split("=")[1].split("-"))
        assert a % CHUNK == 0 and (b + 1) % CHUNK == 0 or b + 1 == len(PAYLOAD), rng  # whole chunks
        chunks.extend(range(a // CHUNK, b // CHUNK + 1))
    return chunks


def test_warm_reads_come_from_the_local_cache(server, tmp_path):
    offsets, lengths = np.array([10, 5 * CHUNK + 7, 40 * CHUNK]), np.array([100, 3 * CHUNK, CHUNK])
    with FaultProxy(server) as proxy:
        reader = cached_reader(proxy.endpoint, tmp_path)
        np.testing.assert_array_equal(read(reader, offsets, lengths), want(offsets, lengths))
        cold = len(proxy.gets)
        assert sorted(fetched_chunks(proxy.gets)) == [0, 5, 6, 7, 8, 40]  # the chunks under the spans, once
        np.testing.assert_array_equal(read(cached_reader(proxy.endpoint, tmp_path), offsets, lengths), want(offsets, lengths))
        assert len(proxy.gets) == cold  # a second reader (another worker) finds them on disk
    assert reader.stats["bytes_fetched"] == 6 * CHUNK


def _worker(endpoint, cache_dir, seed):
    rng = np.random.default_rng(seed)
    spans = np.random.default_rng(0).integers(0, len(PAYLOAD) - 3000, size=60)  # the same spans for all ...
    order = rng.permutation(len(spans))  # ... in each worker's own order, in batches of 6
    reader = cached_reader(endpoint, cache_dir)
    ok = True
    for batch in np.array_split(order, 10):
        lengths = np.full(len(batch), 3000)
        ok &= bool(np.array_equal(read(reader, spans[batch], lengths), want(spans[batch], lengths)))
    return ok


@pytest.mark.slow
def test_worker_processes_share_one_download_per_chunk(server, tmp_path):
    with FaultProxy(server) as proxy:
        with multiprocessing.get_context("spawn").Pool(4) as pool:
            oks = pool.starmap(_worker, [(proxy.endpoint, str(tmp_path), seed) for seed in range(4)])
        assert all(oks)
        chunks = fetched_chunks(proxy.gets)
    assert len(chunks) == len(set(chunks)), "a chunk was downloaded twice"
    spans = np.random.default_rng(0).integers(0, len(PAYLOAD) - 3000, size=60)
    assert set(chunks) == {c for s in spans for c in range(s // CHUNK, (s + 2999) // CHUNK + 1)}
    cache = ChunkCache(str(tmp_path), 1 << 30, CHUNK)
    assert cache.used.get() == cache.used_bytes() > 0  # four processes' downloads, each counted once
    assert not [f for f in os.listdir(tmp_path) if f.endswith(".tmp")]


def test_lru_eviction_keeps_the_byte_budget(server, tmp_path):
    budget = 10 * CHUNK
    with FaultProxy(server) as proxy:
        reader = cached_reader(proxy.endpoint, tmp_path, budget=budget)
        for c in range(30):  # one chunk at a time: chunk 29 is the newest
            read(reader, [c * CHUNK], [CHUNK])
            assert reader.cache.used.get() == reader.cache.used_bytes() <= budget
        data_files = [f for f in os.listdir(tmp_path) if f.endswith(".data")]
        assert os.stat(tmp_path / data_files[0]).st_blocks * 512 <= budget + CHUNK  # holes really punched
        n = len(proxy.gets)
        np.testing.assert_array_equal(read(reader, [20 * CHUNK], [10 * CHUNK]), PAYLOAD[20 * CHUNK:30 * CHUNK])
        assert len(proxy.gets) == n  # the ten newest stayed
        np.testing.assert_array_equal(read(reader, [0], [CHUNK]), PAYLOAD[:CHUNK])
        assert len(proxy.gets) == n + 1  # the oldest went
        assert reader.cache.used.get() == reader.cache.used_bytes() <= budget


def test_under_budget_a_download_reads_the_counter_not_the_marks(server, tmp_path, monkeypatch):
    reader = cached_reader(server, tmp_path, budget=3 * CHUNK)
    read(reader, [0], [2 * CHUNK])
    monkeypatch.setattr(reader.cache, "_all_objects", lambda: pytest.fail("evict scanned the chunk marks under budget"))
    np.testing.assert_array_equal(read(reader, [2 * CHUNK], [CHUNK]), PAYLOAD[2 * CHUNK:3 * CHUNK])  # 3 chunks: at the budget
    monkeypatch.undo()
    read(reader, [5 * CHUNK], [CHUNK])  # over it: the scan evicts chunk 0, the oldest
    assert reader.cache.used.get() == reader.cache.used_bytes() == 3 * CHUNK
    assert reader.cache.object(f"{reader.folder.url}/{DATA}\0{reader._head(DATA)[1]}", len(PAYLOAD)).present[[0, 1, 2, 5]].tolist() == [0, 1, 1, 1]


def test_prefetch_fills_the_cache_without_blocking(server, tmp_path):
    offsets, lengths = np.array([3 * CHUNK, 60 * CHUNK + 9]), np.array([2 * CHUNK, 500])
    with FaultProxy(server, faults=["slow:0.5"]) as proxy:
        reader = cached_reader(proxy.endpoint, tmp_path)
        future = reader.prefetch(DATA, offsets, lengths)
        assert not future.done()  # the slow answer is still on its way
        future.result(timeout=30)
        n = len(proxy.gets)
        np.testing.assert_array_equal(read(reader, offsets, lengths), want(offsets, lengths))
        assert len(proxy.gets) == n == 2
    other = cached_reader(server, tmp_path / "other")
    other.prefetch_spans([DATA, "meta.json", DATA], [0, 0, 50 * CHUNK], [10, 2, CHUNK]).result(timeout=30)
    assert other.stats["bytes_fetched"] == CHUNK + 2 + CHUNK  # meta.json is one short chunk
    no_cache = RemoteReader("s3://lfcache/f", s3_options(server))
    assert no_cache.prefetch(DATA, offsets, lengths).done()


def test_a_corrupt_local_chunk_is_caught_and_fetched_again(server, tmp_path):
    offsets, lengths = np.array([7 * CHUNK + 5]), np.array([1000])
    crc = [zlib.crc32(want(offsets, lengths))]
    reader = cached_reader(server, tmp_path)
    read(reader, offsets, lengths, crc)
    data_file = next(f for f in os.listdir(tmp_path) if f.endswith(".data"))
    with open(tmp_path / data_file, "r+b") as fh:  # a bit rots on the local disk
        fh.seek(7 * CHUNK + 100)
        byte = fh.read(1)
        fh.seek(7 * CHUNK + 100)
        fh.write(bytes([byte[0] ^ 1]))
    before = reader.stats["requests"]
    np.testing.assert_array_equal(read(reader, offsets, lengths, crc), want(offsets, lengths))
    assert reader.stats["requests"] == before + 1
    np.testing.assert_array_equal(read(reader, offsets, lengths, crc), want(offsets, lengths))  # and healed
    assert reader.cache.used.get() == reader.cache.used_bytes()  # the dropped chunk uncounted, its refetch counted


class Spans:
    """A map-style dataset: item i is bytes ``[5000 i, 5000 i + 4000)`` through a (picklable) reader."""

    def __init__(self, reader):
        self.reader = reader

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return read(self.reader, [i * 5000], [4000])


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_dataloader_workers_read_through_the_cache(server, tmp_path):
    import torch.utils.data as tud

    reader = cached_reader(server, tmp_path)
    read(reader, [0], [10])  # the parent uses the client before its workers start
    loader = tud.DataLoader(Spans(reader), batch_size=4, num_workers=2, multiprocessing_context="spawn")
    got = np.concatenate([b.numpy().reshape(-1) for b in loader])
    np.testing.assert_array_equal(got, want(np.arange(16) * 5000, np.full(16, 4000)))


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("cached", [True, False], ids=["local-cache", "no-cache"])
def test_forked_dataloader_workers_read_after_the_parent_did(server, tmp_path, cached):
    """fork (Linux's default start method) after the parent used obstore, whose runtime a fork
    kills: the workers' calls go through their helper processes, bytes equal."""
    import torch.utils.data as tud

    reader = cached_reader(server, tmp_path) if cached else RemoteReader("s3://lfcache/f", s3_options(server))
    np.testing.assert_array_equal(read(reader, [7], [5000]), PAYLOAD[7:5007])
    loader = tud.DataLoader(Spans(reader), batch_size=4, num_workers=2, multiprocessing_context="fork")
    for _epoch in range(2):  # the second epoch forks new workers again
        got = np.concatenate([b.numpy().reshape(-1) for b in loader])
        np.testing.assert_array_equal(got, want(np.arange(16) * 5000, np.full(16, 4000)))
    np.testing.assert_array_equal(read(reader, [90 * CHUNK], [CHUNK]), PAYLOAD[90 * CHUNK:91 * CHUNK])  # the parent still reads


def _forked_child_reads(reader, queue) -> None:
    from latentfast.cache.remote import client

    try:
        ok = np.array_equal(read(reader, [3], [9000]), PAYLOAD[3:9003])
        first = client.helper().proc
        first.kill()  # a helper that dies is replaced: the reader's retry goes to a new one
        first.wait()
        ok = ok and np.array_equal(read(reader, [50 * CHUNK + 1], [9000]), PAYLOAD[50 * CHUNK + 1:50 * CHUNK + 9001])
        ok = ok and client.helper().proc.pid != first.pid
        try:
            reader.size("no-such-object")
            missing = "no error"
        except Exception as exc:  # noqa: BLE001 (sent back to the test)
            missing = f"{type(exc).__name__}: {exc}"
        queue.put((ok, missing, client.helper().proc.pid))
    except Exception as exc:  # noqa: BLE001
        queue.put((False, repr(exc), None))


@pytest.mark.timeout(120)
def test_a_forked_child_gets_errors_that_name_the_object_and_a_new_helper_if_one_dies(server, tmp_path):
    reader = cached_reader(server, tmp_path)
    read(reader, [0], [10])
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_forked_child_reads, args=(reader, queue))
    child.start()
    ok, missing, helper_pid = queue.get(timeout=60)
    child.join(timeout=60)
    assert ok and child.exitcode == 0
    assert missing.startswith("RemoteNotFoundError") and "s3://lfcache/f/no-such-object" in missing, missing
    for _ in range(200):  # the helper sees its pipe close and exits
        if not os.path.exists(f"/proc/{helper_pid}") or open(f"/proc/{helper_pid}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"helper process {helper_pid} still running after its forked child exited")


def test_cache_arguments_are_checked(tmp_path):
    with pytest.raises(InvalidArgumentError, match="local_cache_bytes must be positive"):
        ChunkCache(str(tmp_path), 0)
    with pytest.raises(InvalidArgumentError, match="chunk_bytes must be a positive multiple of 4096"):
        ChunkCache(str(tmp_path), 1 << 20, chunk_bytes=1000)


def test_a_cache_folder_from_another_boot_starts_empty(server, tmp_path):
    """Chunks are marked present without an fsync of their bytes: only this boot's page cache
    vouches for them, so a folder stamped by another boot is emptied when opened."""
    reader = cached_reader(server, tmp_path)
    read(reader, [0], [3 * CHUNK])
    assert reader.cache.used_bytes() == 3 * CHUNK
    assert ChunkCache(str(tmp_path), 1 << 30, CHUNK).used_bytes() == 3 * CHUNK  # same boot: kept
    (tmp_path / "boot_id").write_text("a-boot-before-a-crash")
    assert ChunkCache(str(tmp_path), 1 << 30, CHUNK).used_bytes() == 0
    assert not [f for f in os.listdir(tmp_path) if f.endswith((".data", ".present"))]
    fresh = cached_reader(server, tmp_path)
    np.testing.assert_array_equal(read(fresh, [0], [3 * CHUNK]), PAYLOAD[:3 * CHUNK])
    assert fresh.stats["bytes_fetched"] == 3 * CHUNK
