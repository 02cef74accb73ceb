"""Object storage under faults: a proxy on loopback in front of the moto server injects 500s, 503
SlowDown, dropped connections, slow answers and flipped bits into ranged GETs."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

pytest.importorskip("obstore", reason="remote caches need obstore (pip install 'latentfast[s3]')")
pytest.importorskip("moto.server", reason="the loopback S3 server is moto[server] (pip install 'latentfast[test]')")

from latentfast.cache.remote import RemoteCorruptError, RemoteReader, RemoteReadError
from latentfast.testing import FaultProxy, s3_options, s3_with_objects

DATA = "data.bin"
PAYLOAD = np.random.default_rng(7).integers(0, 256, size=200_000, dtype=np.uint8)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    files = {DATA: PAYLOAD.tobytes(), "meta.json": b"{}"}
    with s3_with_objects(str(tmp_path_factory.mktemp("objects")), "s3://lfcache/f", files) as endpoint:
        yield endpoint


def reader_via(proxy, **kw):
    options = dict(s3_options(proxy.endpoint), max_retries=kw.pop("max_retries", 3), retry_backoff=0.01,
                   retry_max_backoff=0.05, timeout=kw.pop("timeout", 5))
    return RemoteReader("s3://lfcache/f", options, retry_backoff=0.01, **kw)


SPANS = (np.array([0, 50_000, 150_000]), np.array([1000, 20_000, 49_999]))


def expected():
    return np.concatenate([PAYLOAD[o:o + n] for o, n in zip(*SPANS)])


@pytest.mark.parametrize("fault", ["500", "503", "drop", "slow:1.5"])
def test_transient_faults_are_retried_to_the_right_bytes(server, fault):
    with FaultProxy(server, faults=[fault, fault]) as proxy:
        out = np.zeros(int(SPANS[1].sum()), dtype=np.uint8)
        reader_via(proxy, timeout=0.5).read_ranges(DATA, *SPANS, out)
        np.testing.assert_array_equal(out, expected())
        assert len(proxy.gets) == 2 + 2  # two runs (the first two spans coalesce), both answered with the fault first


def test_exhausted_retries_raise_naming_object_and_range(server):
    with FaultProxy(server, fault_all="503") as proxy:
        out = np.zeros(1000, dtype=np.uint8)
        with pytest.raises(RemoteReadError, match=r"s3://lfcache/f/data\.bin bytes \[0, 1000\): failed after 2 attempts"):
            reader_via(proxy, max_retries=2, read_attempts=2).read_ranges(DATA, [0], [1000], out)
        assert len(proxy.gets) == (2 + 1) * 2  # bounded: the client's 1 + 2 retries, twice


def test_always_dropped_connections_never_return_short_bytes(server):
    with FaultProxy(server, fault_all="drop") as proxy:
        out = np.zeros(1000, dtype=np.uint8)
        with pytest.raises(RemoteReadError, match=r"data\.bin bytes \[100, 1100\)"):
            reader_via(proxy, max_retries=1, read_attempts=2).read_ranges(DATA, [100], [1000], out)


def test_flipped_bits_are_caught_by_the_checksum_and_refetched(server):
    crcs = [zlib.crc32(PAYLOAD[o:o + n]) for o, n in zip(*SPANS)]
    with FaultProxy(server, faults=["flip"]) as proxy:
        out = np.zeros(int(SPANS[1].sum()), dtype=np.uint8)
        reader_via(proxy, coalesce_bytes=0).read_ranges(DATA, *SPANS, out, crc32=crcs)
        np.testing.assert_array_equal(out, expected())
        assert len(proxy.gets) == 4  # one flipped answer fetched again
    with FaultProxy(server, fault_all="flip") as proxy:
        with pytest.raises(RemoteCorruptError, match=r"data\.bin bytes \[50000, 70000\): CRC-32"):
            reader_via(proxy, coalesce_bytes=0).read_ranges(DATA, SPANS[0][1:2], SPANS[1][1:2], out, crc32=crcs[1:2])


def test_the_proxy_injects_what_it_says(server):
    """The faults are real: without the reader's checks the flipped bit would reach the caller."""
    import obstore
    from obstore.store import S3Store

    with FaultProxy(server, faults=["flip"]) as proxy:
        store = S3Store("lfcache", prefix="f", endpoint=proxy.endpoint, access_key_id="testing", secret_access_key="testing",
                        region="us-east-1", client_options={"allow_http": True})
        raw = np.frombuffer(bytes(obstore.get_range(store, DATA, start=0, end=1000)), dtype=np.uint8)
        assert (raw != PAYLOAD[:1000]).sum() == 1
