"""Issue 35, readers under replaced caches and faulty storage: one generation per reader (a local
folder deleted and rebuilt, a push replacing an ``s3://`` cache), a node-local chunk cache that
repairs its own damage, pulls that verify before they publish, a timeout for a silent endpoint,
short bodies, merges whose shards a later build would delete, and sharded rebuilds under readers."""
from __future__ import annotations

import functools
import os
import shutil

import numpy as np
import pytest
import torch

from latentfast.cache import LatentCache, LatentCacheWriter, read_batch
from latentfast.cache.store import shards as shardstore
from latentfast.errors import CacheCorruptError


def write_records(folder, gen: int, n: int = 6, split: str = "train", size: int = 4, keys: str = "k") -> None:
    """A cache of records (keys ``{keys}{i}``) whose every value says its generation: latent ``gen + i/8``
    (``[4, 3, size]`` float32), text ``gen * 100 + i`` (``[size, 2]`` int32)."""
    with LatentCacheWriter(folder, split, encoder={"pretrained": "test"}, meta={"gen": gen}, restart=True) as w:
        for i in range(n):
            w.append(f"{keys}{i}", {"latent": np.full((4, 3, size), gen + i / 8, dtype=np.float32),
                               "text": torch.full((size, 2), gen * 100 + i, dtype=torch.int32)})


def generations_seen(cache, i: int, row: int | None = None) -> set:
    """The generations item ``i`` (row ``row`` of the cache written, default ``i``) reads as, on every
    read path of the reader (``CacheCorruptError``: "raised")."""
    row = i if row is None else row
    seen = set()
    for read in (lambda: float(cache[i].flatten()[0]) - row / 8,
                 lambda: float(read_batch(cache, [i])[0].flatten()[0]) - row / 8,
                 lambda: (int(cache.record(i)["text"].flatten()[0]) - row) / 100,
                 lambda: (int(read_batch(cache, [i], fields=("latent", "text"))["text"].flatten()[0]) - row) / 100):
        try:
            seen.add(round(read()))
        except CacheCorruptError as exc:
            assert "rebuilt after this reader opened it" in str(exc) or "replaced" in str(exc), exc
            seen.add("raised")
    return seen


# -- 5: a folder deleted and rebuilt under an open reader: one generation per reader ----------------
@pytest.mark.parametrize("first", ["item", "batch", "record", "none"])
def test_a_folder_deleted_and_rebuilt_under_a_reader_reads_one_generation(tmp_path, first):
    folder = str(tmp_path / "c")
    write_records(folder, 1)
    cache = LatentCache(folder)
    {"item": lambda: cache[0], "batch": lambda: read_batch(cache, [0]), "record": lambda: cache.record(0),
     "none": lambda: None}[first]()  # what the reader had opened before the folder went
    shutil.rmtree(folder)
    write_records(folder, 2)  # same geometry, other values
    for i in range(len(cache)):
        seen = generations_seen(cache, i)
        assert seen in ({1}, {"raised"}), f"item {i} read as {seen} (first read: {first})"


def test_a_merged_cache_over_rebuilt_folders_reads_one_generation(tmp_path):
    parts = [str(tmp_path / p) for p in ("a", "b")]
    for p in parts:
        write_records(p, 1, keys=os.path.basename(p))  # (a key in two parts is refused)
    shardstore.merge_caches(parts, str(tmp_path / "m"))
    merged = LatentCache(str(tmp_path / "m"))
    merged[0]
    read_batch(merged, [len(merged) - 1])  # both shards' files opened and mapped
    for p in parts:
        shutil.rmtree(p)
        write_records(p, 2, keys=os.path.basename(p))
    for i in range(len(merged)):
        seen = generations_seen(merged, i, row=i % 6)
        assert seen in ({1}, {"raised"}), f"item {i} read as {seen}"


# -- evidence: a clean short answer to a ranged GET raises, and is never kept in the chunk cache ----
pytest.importorskip("obstore", reason="remote caches need obstore (pip install 'latentfast[s3]')")
pytest.importorskip("moto.server", reason="the loopback S3 server is moto[server] (pip install 'latentfast[test]')")

from latentfast.cache.remote import RemoteReader, RemoteReadError  # noqa: E402
from latentfast.testing import FaultProxy, s3_options, s3_with_objects  # noqa: E402

PAYLOAD = np.random.default_rng(11).integers(0, 256, size=300_000, dtype=np.uint8)


@pytest.fixture(scope="module")
def objects(tmp_path_factory):
    files = {"data.bin": PAYLOAD.tobytes(), "meta.json": b"{}"}
    with s3_with_objects(str(tmp_path_factory.mktemp("objects")), "s3://lfrel/f", files) as endpoint:
        yield endpoint


def quick_options(endpoint: str, **kw) -> dict:
    return dict(s3_options(endpoint), max_retries=1, retry_backoff=0.01, retry_max_backoff=0.05, timeout=10, **kw)


@pytest.mark.parametrize("local", [False, True], ids=["direct", "chunk-cache"])
def test_a_clean_short_body_raises_and_is_never_cached(objects, tmp_path, local):
    local_kw = dict(local_cache=str(tmp_path / "lc"), local_cache_bytes=1 << 30) if local else {}
    spans = (np.array([5_000, 100_000]), np.array([40_000, 70_000]))
    want = np.concatenate([PAYLOAD[o:o + n] for o, n in zip(*spans)])
    with FaultProxy(objects, fault_all="short") as proxy:
        reader = RemoteReader("s3://lfrel/f", quick_options(proxy.endpoint), retry_backoff=0.01, **local_kw)
        out = np.zeros(int(spans[1].sum()), dtype=np.uint8)
        with pytest.raises(RemoteReadError, match=r"data\.bin bytes \[\d+, \d+\).*short read"):
            reader.read_ranges("data.bin", *spans, out)
        if local:
            assert reader.cache.used_bytes() == 0, "a short answer was kept in the chunk cache"
    with FaultProxy(objects, faults=["short", "short"]) as proxy:  # short once per run, then whole
        reader = RemoteReader("s3://lfrel/f", quick_options(proxy.endpoint), retry_backoff=0.01, coalesce_bytes=0, **local_kw)
        out = np.zeros(int(spans[1].sum()), dtype=np.uint8)
        reader.read_ranges("data.bin", *spans, out)
        np.testing.assert_array_equal(out, want)
    if local:  # what the chunk cache kept is the object's bytes: read back with the network refusing everything
        with FaultProxy(objects, fault_all="500") as proxy:
            reader = RemoteReader("s3://lfrel/f", quick_options(proxy.endpoint), retry_backoff=0.01, **local_kw)
            out = np.zeros(int(spans[1].sum()), dtype=np.uint8)
            reader.read_ranges("data.bin", *spans, out)
            np.testing.assert_array_equal(out, want)
            assert not proxy.gets


# -- 6: a push replacing an s3:// cache under an open reader: its generation or "replaced" ----------
from latentfast.cache.remote import RemoteReplacedError, push  # noqa: E402
from latentfast.testing import create_bucket, s3_server, write_cache  # noqa: E402


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with s3_server() as endpoint:
        create_bucket(endpoint, "lfrep")
        yield endpoint


def write_lines(folder, gen: int, n: int = 40) -> None:
    """A padded line cache (no checksums: nothing but the version pin can tell generations apart) of
    ``n`` rows ``[4, 2, 64]`` whose values are ``gen + i/8``: 512 bytes a row, several rows a chunk."""
    rows = [np.full((4, 2, 64), gen + i / 8, dtype=np.float16) for i in range(n)]
    write_cache(folder, rows, np.full(n, 64, dtype=np.int32), w_max=64)


@pytest.mark.parametrize("kind", ["records", "lines"])
def test_a_push_replacing_the_cache_under_a_reader_gives_its_generation_or_replaced(s3, tmp_path, kind):
    url, local = f"s3://lfrep/{kind}", dict(local_cache=str(tmp_path / "lc"), local_cache_bytes=1 << 30)
    n = 12 if kind == "records" else 40
    write = functools.partial(write_records, n=n, size=400) if kind == "records" else write_lines  # several chunks
    fields = ("latent", "text") if kind == "records" else ("latent",)
    write(str(tmp_path / "g1"), 1)
    push(str(tmp_path / "g1"), url, s3_options(s3))
    reader = LatentCache(url, storage_options=s3_options(s3), **local)
    first = read_batch(reader, [0], fields=fields)  # what this node holds of generation 1: item 0's chunks
    write(str(tmp_path / "g2"), 2)
    push(str(tmp_path / "g2"), url, s3_options(s3))
    outcomes = set()
    for i in range(n):
        try:
            batch = read_batch(reader, [i], fields=fields)
        except RemoteReplacedError as exc:
            assert "replaced since this reader opened it" in str(exc) and url in str(exc)
            outcomes.add("replaced")
            continue
        assert float(batch["latent"].flatten()[0]) == 1 + i / 8, f"item {i} is not generation 1's"
        if kind == "records":
            assert int(batch["text"].flatten()[0]) == 100 + i
        outcomes.add("old")
    assert outcomes == {"old", "replaced"}  # item 0 (and its chunk-mates) from the node, the rest refused
    assert torch.equal(read_batch(reader, [0], fields=fields)["latent"], first["latent"])
    fresh = LatentCache(url, storage_options=s3_options(s3), **local)  # opened after the push: generation 2 whole
    for i in range(n):
        assert float(fresh[i].flatten()[0]) == 2 + i / 8
    with pytest.raises(RemoteReplacedError):  # the new bytes the fresh reader fetched are not the old reader's
        read_batch(reader, [n - 1], fields=fields)


# -- 11: damage in the node-local chunk cache is repaired, never served nor blamed on the remote -----
def chunk_files(local_cache: str) -> list[str]:
    """The local copies (``*.data``) of the objects under ``local_cache`` with chunks present, largest first."""
    found = [os.path.join(local_cache, n) for n in os.listdir(local_cache) if n.endswith(".data")]
    return sorted(found, key=lambda p: -int(np.count_nonzero(np.fromfile(p[:-5] + ".present", dtype=np.uint8))))


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x10]))


@pytest.mark.parametrize("damage", ["flip", "truncate"])
@pytest.mark.parametrize("kind", ["records", "lines"])
def test_damaged_local_chunks_are_fetched_again(s3, tmp_path, kind, damage):
    from latentfast.cache import verify_cache

    url, lc = f"s3://lfrep/damage-{kind}-{damage}", str(tmp_path / "lc")
    local = dict(storage_options=s3_options(s3), local_cache=lc, local_cache_bytes=1 << 30)
    n = 12 if kind == "records" else 40
    (functools.partial(write_records, n=n, size=400) if kind == "records" else write_lines)(str(tmp_path / "src"), 1)
    push(str(tmp_path / "src"), url, s3_options(s3))
    want = [LatentCache(str(tmp_path / "src"))[i] for i in range(n)]
    warm = LatentCache(url, **local)
    for i in range(n):  # every chunk local
        assert torch.equal(warm[i], want[i])
    data = chunk_files(lc)[0]
    if damage == "flip":
        flip_byte(data, os.path.getsize(data) * 2 // 3)  # in a chunk that is present
    else:
        os.truncate(data, os.path.getsize(data) // 3)
    reader = LatentCache(url, **local)  # another process's reader, in effect: its first reads check the chunks
    for i in range(n):
        assert torch.equal(reader[i], want[i]), f"item {i} read wrong from the damaged local copy"
    assert torch.equal(read_batch(reader, list(range(n)))[0], torch.stack(want))  # one shape: the items stacked
    if damage == "flip":
        flip_byte(data, os.path.getsize(data) * 2 // 3)  # damaged again, under verify: verify repairs it and says OK
    result = verify_cache(url, **local)
    assert result["rows"] == n


def test_a_damaged_local_chunk_under_a_span_reader_is_fetched_again(objects, tmp_path):
    local = dict(local_cache=str(tmp_path / "lc"), local_cache_bytes=1 << 30)
    spans = (np.array([0, 150_000]), np.array([100_000, 120_000]))
    want = np.concatenate([PAYLOAD[o:o + n] for o, n in zip(*spans)])
    out = np.zeros(int(spans[1].sum()), dtype=np.uint8)
    RemoteReader("s3://lfrel/f", quick_options(objects), **local).read_ranges("data.bin", *spans, out)
    data = chunk_files(local["local_cache"])[0]
    flip_byte(data, 40_000)
    reader = RemoteReader("s3://lfrel/f", quick_options(objects), **local)
    out[:] = 0
    reader.read_ranges("data.bin", *spans, out)  # no CRC given: only the chunk's own can tell
    np.testing.assert_array_equal(out, want)
    assert reader.stats["requests"] == 1  # the damaged chunk alone, fetched again
    assert np.fromfile(data, dtype=np.uint8)[40_000] == PAYLOAD[40_000]  # and repaired in place


# -- 12: a pull checks what it downloaded before it publishes the meta ---------------------------
from latentfast.cache.remote import pull  # noqa: E402
from latentfast.errors import CacheError  # noqa: E402
from test_cache_reliability import run_cli  # noqa: E402


@pytest.fixture
def aws_keys(monkeypatch):
    """The loopback server's dummy keys for the CLI (which takes only --endpoint-url): without keys the
    client would ask the instance metadata address for some."""
    for key, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(key, value)


def assert_no_cache(folder):
    with pytest.raises((FileNotFoundError, CacheError)):
        LatentCache(folder)


@pytest.mark.parametrize("kind", ["records", "lines"])
def test_a_pull_over_a_corrupting_link_publishes_nothing(s3, tmp_path, kind, capsys, aws_keys):
    url = f"s3://lfrep/pull-{kind}"
    (write_records if kind == "records" else write_lines)(str(tmp_path / "src"), 1)
    push(str(tmp_path / "src"), url, s3_options(s3))
    with FaultProxy(s3, fault_all="flip", whole_gets=True) as proxy:
        with pytest.raises(CacheError, match=r"MD5 .* corrupted in transit"):  # a single-part upload's ETag is its MD5
            pull(url, str(tmp_path / "py"), quick_options(proxy.endpoint))
        assert_no_cache(str(tmp_path / "py"))
        assert run_cli("pull", url, str(tmp_path / "cli"), "--endpoint-url", proxy.endpoint) == 1
        assert "corrupted in transit" in capsys.readouterr().err
        assert_no_cache(str(tmp_path / "cli"))
    stats = {}
    pull(url, str(tmp_path / "py"), s3_options(s3), stats=stats)  # through a good link: published, and verified
    assert stats["verified"]["train"]["rows"] == len(LatentCache(str(tmp_path / "py")))
    assert not [n for n in os.listdir(tmp_path / "py") if n.startswith(".")], "the staging folder was left behind"


def test_a_corrupt_pull_of_a_multipart_upload_is_caught_by_verify_and_keeps_the_old_cache(s3, tmp_path, monkeypatch, capsys, aws_keys):
    from latentfast.cache.remote import storage

    url, dest = "s3://lfrep/pull-parts", str(tmp_path / "dest")
    monkeypatch.setattr(storage, "MULTIPART_BYTES", 0)  # every file in parts: no ETag is an MD5, verify must catch it
    write_records(str(tmp_path / "g1"), 1)
    push(str(tmp_path / "g1"), url, s3_options(s3))
    pull(url, dest, s3_options(s3))
    write_records(str(tmp_path / "g2"), 2)
    push(str(tmp_path / "g2"), url, s3_options(s3))
    with FaultProxy(s3, fault_all="flip", whole_gets=True) as proxy:
        with pytest.raises(CacheCorruptError):
            pull(url, dest, quick_options(proxy.endpoint))
        assert run_cli("pull", url, dest, "--endpoint-url", proxy.endpoint) == 1
    assert "error" in capsys.readouterr().err
    kept = LatentCache(dest)  # the earlier pull's cache, whole: nothing of the failed pulls was published
    assert kept.meta["gen"] == 1 and float(kept[3].flatten()[0]) == 1 + 3 / 8


# -- 14: an endpoint that accepts and never answers fails within the timeout ----------------------
@pytest.fixture
def silent_endpoint():
    """A socket on loopback that accepts connections, reads nothing and never answers."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held, stop = [], threading.Event()

    def accept():
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


@pytest.mark.timeout(120)  # the client's own bounds were 30 s a request, 180 s of retries: that fails here
@pytest.mark.parametrize("command", ["inspect", "verify", "pull"])
def test_a_silent_endpoint_fails_within_the_timeout(silent_endpoint, tmp_path, capsys, aws_keys, command):
    argv = [command, "s3://lfdead/cache", *([str(tmp_path / "out")] if command == "pull" else []),
            "--endpoint-url", silent_endpoint, "--timeout", "1"]
    assert run_cli(*argv) != 0
    err = capsys.readouterr().err
    assert "s3://lfdead/cache" in err and "timed out" in err.lower(), err  # our --timeout's, not a hang's


@pytest.mark.timeout(120)
def test_a_silent_endpoint_fails_within_the_storage_options_timeout(silent_endpoint, tmp_path):
    options = dict(s3_options(silent_endpoint), timeout=1, retry_timeout=1)
    with pytest.raises(OSError, match="s3://lfdead/cache"):
        LatentCache("s3://lfdead/cache", storage_options=options, local_cache=str(tmp_path / "lc"), local_cache_bytes=1 << 20)


# -- also seen: a merge without --copy keeps the shards it refers to from a later build's cleanup --------
def test_shards_a_merge_refers_to_survive_a_build_of_another_world_size(tmp_path):
    from latentfast.cache.builders.distributed import remove_other_worlds, shard_dir

    out, merged = str(tmp_path / "dist"), str(tmp_path / "merged")
    three = [shard_dir(out, "train", r, 3) for r in range(3)]
    for r, folder in enumerate(three):  # what a 3-rank build leaves: its shards and its manifest
        write_records(folder, 1, n=2 + r, keys=f"r{r}-")
    shardstore.write_manifest(out, "train", three)
    write_records(str(tmp_path / "other"), 1, n=2, keys="other-")
    shardstore.merge_caches([out, str(tmp_path / "other")], merged)  # no --copy
    two = [shard_dir(out, "train", r, 2) for r in range(2)]
    for r, folder in enumerate(two):  # a 2-rank build of the same folder, finishing: its manifest, then the cleanup
        write_records(folder, 2, n=4, keys=f"r{r}-")
    shardstore.write_manifest(out, "train", two)
    assert remove_other_worlds(out, "train", 2) == []  # the merge still refers to every 3-rank shard
    cache = LatentCache(merged)
    assert len(cache) == 2 + 3 + 4 + 2 and float(read_batch(cache, [4])[0].flatten()[0]) == 1 + 2 / 8
    assert len(LatentCache(out)) == 8
    os.remove(shardstore.manifest_path(merged, "train"))  # the merge is gone: nothing refers to them now
    assert sorted(remove_other_worlds(out, "train", 2)) == three
    assert sorted(os.listdir(os.path.join(out, "shards"))) == [os.path.basename(f) for f in two]


# -- evidence: a reader opening a sharded folder while a distributed rebuild of it is under way ------
REBUILD_RANK = r"""
import datetime, sys
import torch.distributed as dist
from latentfast.cache.builders.images import build_image_cache
from latentfast.toy import ToyVAE

rank, store, src, out, seed = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=60))
try:
    build_image_cache(ToyVAE(seed=seed), src, out, buckets=[(32, 32), (32, 48), (48, 32)], batch_size=1, quiet=True,
                      group=dist.group.WORLD)
finally:
    dist.destroy_process_group()
"""


def run_ranks(tmp_path, run: int, src: str, out: str, seed: int):
    import subprocess
    import sys

    store = str(tmp_path / f"store{run}")
    return [subprocess.Popen([sys.executable, "-c", REBUILD_RANK, str(r), store, src, out, str(seed)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]


def read_all(cache) -> list:
    """``(cache[i], read_batch(cache, [i])[0][0])`` of every item, or ``["raised"]`` if a read raised."""
    try:
        return [(cache[i], read_batch(cache, [i])[0][0]) for i in range(len(cache))]
    except CacheError:
        return ["raised"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_reader_during_a_distributed_rebuild_gets_the_old_cache_the_new_or_an_error(tmp_path):
    from latentfast.cache.builders.distributed import shard_dir
    from latentfast.cache.builders.images import build_image_cache
    from latentfast.toy import ToyVAE
    from test_cache_distributed import BUCKETS, make_sources

    src, out = make_sources(str(tmp_path / "src"))["images"], str(tmp_path / "out")
    ranks = run_ranks(tmp_path, 0, src, out, 3)
    assert [p.wait(timeout=300) for p in ranks] == [0, 0], [p.stderr.read()[-2000:] for p in ranks]
    generations = {}
    for seed in (3, 4):  # what each generation holds, built by one process
        build_image_cache(ToyVAE(seed=seed), src, str(tmp_path / f"single{seed}"), buckets=BUCKETS, batch_size=1, quiet=True)
        single = LatentCache(str(tmp_path / f"single{seed}"))
        generations[seed] = [single[i] for i in range(len(single))]

    def generation_of(items: list):
        if items == ["raised"]:
            return "raised"
        for seed, want in generations.items():
            if len(items) == len(want) and all(torch.equal(a, w) and torch.equal(b, w) for (a, b), w in zip(items, want)):
                return seed
        return None  # a mix, or wrong bytes

    held = LatentCache(out)
    assert generation_of(read_all(held)) == 3  # (every file of both shards open from here on)
    ranks = run_ranks(tmp_path, 1, src, out, 4)
    seen = []
    try:
        while any(p.poll() is None for p in ranks):
            try:
                seen.append(generation_of(read_all(LatentCache(out))))
            except (CacheError, FileNotFoundError):  # no manifest yet, a shard mid-publish, one changed since
                seen.append("raised")
            assert generation_of(read_all(held)) == 3, "the reader opened before the rebuild left its generation"
    finally:
        codes = [p.wait(timeout=300) for p in ranks]
    assert codes == [0, 0], [p.stderr.read()[-2000:] for p in ranks]
    assert None not in seen and seen, f"a reader opened during the rebuild read a mix: {seen}"
    assert generation_of(read_all(LatentCache(out))) == 4 and generation_of(read_all(held)) == 3
    # a rank that republished its shard while the old manifest was still there (a builder with no collective
    # before its writes) from edited sources: the same items and encoder, other values -- the manifest no
    # longer describes that shard, and the folder is refused, never read as one cache of two generations
    from PIL import Image

    edited, other = str(tmp_path / "edited"), str(tmp_path / "other")
    shutil.copytree(src, edited)
    for root, _dirs, names in os.walk(edited):
        for name in names:
            path = os.path.join(root, name)
            Image.fromarray(255 - np.asarray(Image.open(path).convert("RGB"))).save(path)
    ranks = run_ranks(tmp_path, 2, edited, other, 4)
    assert [p.wait(timeout=300) for p in ranks] == [0, 0], [p.stderr.read()[-2000:] for p in ranks]
    theirs, ours = shard_dir(other, "train", 1, 2), shard_dir(out, "train", 1, 2)
    for name in sorted(os.listdir(theirs), key=lambda n: n.endswith("meta.json")):  # the meta last, as a publish does
        if name.startswith("train."):
            shutil.copyfile(os.path.join(theirs, name), os.path.join(ours, name))
    assert len(LatentCache(ours)) == shardstore.load_manifest(shardstore.manifest_path(out, "train"))["shards"][1]["n"]
    with pytest.raises(CacheCorruptError, match="changed after the manifest was written"):
        LatentCache(out)
