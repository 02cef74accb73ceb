"""Object storage: a cache folder pushed to a real S3 server on loopback (moto), read back by byte
spans bit-equal to the local files, pulled back whole; options, env vars, bad input, checksums."""
from __future__ import annotations

import os
import zlib

import numpy as np
import pytest

pytest.importorskip("obstore", reason="remote caches need obstore (pip install 'latentfast[s3]')")
pytest.importorskip("moto.server", reason="the loopback S3 server is moto[server] (pip install 'latentfast[test]')")

from latentfast.cache import LatentCache
from latentfast.cache.remote import RemoteCorruptError, RemoteNotFoundError, RemoteReader, RemoteReadError, coalesce, pull, push
from latentfast.cache.remote import storage
from latentfast.errors import InvalidArgumentError
from latentfast.testing import create_bucket, free_port, s3_options, s3_server, write_random_cache

DATA = "train.latents.f16.dat"


@pytest.fixture(scope="module")
def server():
    with s3_server() as endpoint:
        create_bucket(endpoint, "lfcache")
        yield endpoint


@pytest.fixture(scope="module")
def pushed(server, tmp_path_factory):
    """A real padded cache (61 rows of 2 KiB) and its copy at s3://lfcache/c1."""
    folder = write_random_cache(str(tmp_path_factory.mktemp("cache")), 61, 4, 8, 32, layouts=("padded",))["padded"]
    push(folder, "s3://lfcache/c1", s3_options(server))
    return folder


def local_bytes(folder: str, name: str = DATA) -> np.ndarray:
    return np.fromfile(os.path.join(folder, name), dtype=np.uint8)


def random_spans(rng, size: int, n: int, max_len: int = 5000):
    lengths = rng.integers(1, max_len, size=n)
    offsets = rng.integers(0, size - lengths + 1)
    return offsets, lengths


def test_read_ranges_is_bit_equal_to_the_local_file(server, pushed):
    rng = np.random.default_rng(1)
    data = local_bytes(pushed)
    reader = RemoteReader("s3://lfcache/c1", s3_options(server), coalesce_bytes=1024)
    offsets, lengths = random_spans(rng, len(data), 37)
    dests = rng.permutation(np.concatenate([[0], np.cumsum(lengths)[:-1]]))  # any order in out
    out = np.full(int(lengths.sum()) + 7, 0x5A, dtype=np.uint8)
    reader.read_ranges(DATA, offsets, lengths, out, dest_offsets=None)
    packed = np.concatenate([data[o:o + n] for o, n in zip(offsets, lengths)])
    np.testing.assert_array_equal(out[: len(packed)], packed)
    assert (out[len(packed):] == 0x5A).all()  # nothing written past the spans
    out2 = np.zeros(int(lengths.sum()), dtype=np.uint8)
    order = np.argsort(dests)
    dests_packed = np.empty_like(dests)
    dests_packed[order] = np.concatenate([[0], np.cumsum(lengths[order])[:-1]])
    reader.read_ranges(DATA, offsets, lengths, memoryview(out2), dest_offsets=dests_packed)
    for o, n, d in zip(offsets, lengths, dests_packed):
        np.testing.assert_array_equal(out2[d:d + n], data[o:o + n])
    assert reader.stats["bytes_fetched"] >= int(lengths.sum())


def test_read_spans_over_several_objects_with_checksums(server, pushed):
    names = [DATA, "train.latents.widths.npy", DATA, "train.latents.meta.json"]
    sizes = {n: os.path.getsize(os.path.join(pushed, n)) for n in set(names)}
    offsets = np.array([100, 0, 9000, 3])
    lengths = np.array([2048, sizes[names[1]], 77, sizes[names[3]] - 3])
    want = [local_bytes(pushed, n)[o:o + l] for n, o, l in zip(names, offsets, lengths)]
    crcs = [zlib.crc32(w) for w in want]
    crcs[1] = None  # a span without a checksum
    out = bytearray(int(lengths.sum()))
    RemoteReader("s3://lfcache/c1", s3_options(server)).read_spans(names, offsets, lengths, out, crc32=crcs)
    assert bytes(out) == b"".join(w.tobytes() for w in want)
    bad = list(crcs)
    bad[2] ^= 1
    with pytest.raises(RemoteCorruptError, match=rf"c1/{DATA} bytes \[9000, 9077\)"):
        RemoteReader("s3://lfcache/c1", s3_options(server)).read_spans(names, offsets, lengths, out, crc32=bad)


def test_checksum_blocks_named_by_the_caller(server, pushed):
    data = local_bytes(pushed)
    block = 8192
    b_off = np.arange(0, len(data), block)
    b_len = np.minimum(block, len(data) - b_off)
    b_crc = [zlib.crc32(data[o:o + n]) for o, n in zip(b_off, b_len)]
    offsets, lengths = np.array([10, 8200, 3 * block + 5]), np.array([100, 4000, 300])
    out = np.zeros(int(lengths.sum()), dtype=np.uint8)
    reader = RemoteReader("s3://lfcache/c1", s3_options(server))
    reader.read_ranges(DATA, offsets, lengths, out, blocks=(b_off, b_len, b_crc))
    np.testing.assert_array_equal(out, np.concatenate([data[o:o + n] for o, n in zip(offsets, lengths)]))
    wrong = list(b_crc)
    wrong[1] ^= 0xFF
    with pytest.raises(RemoteCorruptError, match=r"bytes \[8192, 16384\)"):
        reader.read_ranges(DATA, offsets, lengths, out, blocks=(b_off, b_len, wrong))
    with pytest.raises(InvalidArgumentError, match="no single checksum block"):
        reader.read_ranges(DATA, [block - 10], [20], out, blocks=(b_off, b_len, b_crc))


def test_push_then_pull_is_the_same_cache(server, pushed, tmp_path):
    names = pull("s3://lfcache/c1", str(tmp_path / "back"), s3_options(server))
    assert names[-1].endswith("meta.json")
    for name in names:
        assert (tmp_path / "back" / name).read_bytes() == open(os.path.join(pushed, name), "rb").read()
    a, b = LatentCache(pushed), LatentCache(str(tmp_path / "back"))
    assert len(a) == len(b) == 61
    for i in (0, 30, 60):
        assert np.array_equal(np.asarray(a[i]), np.asarray(b[i]))


def test_an_unfinished_push_is_never_a_cache(server, pushed, tmp_path, monkeypatch):
    push(pushed, "s3://lfcache/c2", s3_options(server))
    real_put = storage.ObjectFolder.put_file
    written = []

    def put_then_die(self, name, path):
        if name == DATA:
            raise RuntimeError("killed mid-push")
        written.append(name)
        real_put(self, name, path)

    monkeypatch.setattr(storage.ObjectFolder, "put_file", put_then_die)
    with pytest.raises(RuntimeError, match="killed"):
        push(pushed, "s3://lfcache/c2", s3_options(server))  # a re-push: the old meta goes first
    assert not any(n.endswith("meta.json") for n in written)
    with pytest.raises(RemoteNotFoundError, match="push did not finish"):
        pull("s3://lfcache/c2", str(tmp_path / "half"), s3_options(server))
    assert not (tmp_path / "half").exists() or not any(p.name.endswith("meta.json") for p in (tmp_path / "half").iterdir())


def test_env_vars_are_honoured_and_storage_options_override_them(server, pushed, monkeypatch):
    want = local_bytes(pushed)[500:600]
    monkeypatch.setenv("AWS_ENDPOINT_URL", server)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    out = np.zeros(100, dtype=np.uint8)
    RemoteReader("s3://lfcache/c1").read_ranges(DATA, [500], [100], out)
    np.testing.assert_array_equal(out, want)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    out[:] = 0
    RemoteReader("s3://lfcache/c1", {"endpoint_url": server}).read_ranges(DATA, [500], [100], out)
    np.testing.assert_array_equal(out, want)
    with pytest.raises(RemoteReadError, match=rf"c1/{DATA}"):
        RemoteReader("s3://lfcache/c1", {"max_retries": 0, "connect_timeout": 2}, read_attempts=1).read_ranges(DATA, [500], [100], out)


def test_a_local_folder_is_a_folder_of_objects_too(pushed):
    data = local_bytes(pushed)
    out = np.zeros(300, dtype=np.uint8)
    RemoteReader(pushed).read_ranges(DATA, [7, 4000], [100, 200], out)
    np.testing.assert_array_equal(out, np.concatenate([data[7:107], data[4000:4200]]))


def test_bad_input_names_the_object_and_range(server, pushed):
    reader = RemoteReader("s3://lfcache/c1", s3_options(server))
    size = reader.size(DATA)
    out = np.zeros(100, dtype=np.uint8)
    with pytest.raises(InvalidArgumentError, match=rf"{DATA} bytes \[{size - 10}, {size + 10}\).*ends past"):
        reader.read_ranges(DATA, [size - 10], [20], out)
    with pytest.raises(InvalidArgumentError, match="out holds 100 bytes"):
        reader.read_ranges(DATA, [0], [101], out)
    with pytest.raises(InvalidArgumentError, match="writable"):
        reader.read_ranges(DATA, [0], [10], bytes(100))
    with pytest.raises(InvalidArgumentError, match="lengths must have one entry per span"):
        reader.read_spans([DATA, DATA], [0, 1], [1], out)
    with pytest.raises(RemoteNotFoundError, match="c1/missing.dat"):
        reader.read_ranges("missing.dat", [0], [10], out)
    with pytest.raises(InvalidArgumentError, match="local_cache and local_cache_bytes"):
        RemoteReader("s3://lfcache/c1", s3_options(server), local_cache="/tmp/x")
    with pytest.raises(InvalidArgumentError, match="storage_options must be a dict"):
        RemoteReader("s3://lfcache/c1", ["endpoint"])


def test_coalesce_merges_exactly_the_close_ranges():
    rng = np.random.default_rng(3)
    for _ in range(50):
        starts = rng.integers(0, 1000, size=rng.integers(1, 20))
        ends = starts + rng.integers(1, 50, size=len(starts))
        gap = int(rng.integers(0, 30))
        rs, re = coalesce(starts, ends, gap)
        covered = np.zeros(1200, dtype=bool)
        for s, e in zip(starts, ends):
            covered[s:e] = True
        assert all(covered[s] for s in rs) and (np.diff(rs) > 0).all()
        for s, e in zip(starts, ends):  # every range inside exactly one run
            assert ((rs <= s) & (re >= e)).sum() == 1
        assert ((rs[1:] - re[:-1]) > gap).all()  # runs further apart than the gap stay apart


def test_large_files_push_in_parts_and_pull_back_whole(server, tmp_path, monkeypatch):
    monkeypatch.setattr(storage, "MULTIPART_BYTES", 1 << 20)
    folder = tmp_path / "big"
    folder.mkdir()
    payload = np.random.default_rng(5).integers(0, 256, size=(11 << 20) + 17, dtype=np.uint8)
    payload.tofile(folder / DATA)
    (folder / "train.latents.meta.json").write_text("{}")
    push(str(folder), "s3://lfcache/big", s3_options(server))
    reader = RemoteReader("s3://lfcache/big", s3_options(server))
    size, etag = reader.folder.head(DATA)
    assert size == len(payload) and etag.strip('"').endswith("-3")  # three 5 MiB parts (S3's multipart ETag)
    pull("s3://lfcache/big", str(tmp_path / "back"), s3_options(server), verify=False)  # (no cache: a transfer test)
    assert (tmp_path / "back" / DATA).read_bytes() == payload.tobytes()
    assert not [p for p in (tmp_path / "back").iterdir() if p.name.endswith(".pulling")]
