"""Out-of-core reads (latentfast.cache.feed.coldread): byte spans against a page-by-page count, residency
probes against reads made here, prefetch (same bytes as a hot read, the right pages, in DataLoader
workers under fork and spawn, bad indices), read_batch's cold path (advice issued, the auto switch),
MADV_RANDOM on the map, the lookahead sampler and the `cache inspect` residency line.

Eviction needs a file system with a page cache (not tmpfs); the tests that need it skip elsewhere."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from latentfast.cache import LatentCache, LookaheadSampler, WidthBucketBatchSampler, batch_loader, cache_path, read_batch
from latentfast.cache.feed import coldread as pf
from latentfast.testing import random_rows, write_cache

pytestmark = pytest.mark.skipif(not pf.SUPPORTED, reason="the cold-read path needs Linux (posix_fadvise)")

PAGE = pf.PAGE


# ---- byte spans --------------------------------------------------------------------------------------
def pages_of(row_starts, index, element_bytes=2):
    """Every page number rows ``index`` touch, counted one by one."""
    pages = set()
    for i in index:
        first, end = int(row_starts[i]) * element_bytes, int(row_starts[i + 1]) * element_bytes
        if end > first:
            pages.update(range(first // PAGE, (end - 1) // PAGE + 1))
    return pages


@pytest.mark.parametrize("kind", ["padded", "ragged", "huge-items"])
def test_row_spans_cover_exactly_the_rows_pages(kind):
    rng = np.random.default_rng({"padded": 1, "ragged": 2, "huge-items": 3}[kind])
    n = 500
    if kind == "padded":
        sizes = np.full(n, 3 * 5 * 37)  # rows of 1110 bytes: most straddle a page boundary
    elif kind == "ragged":
        sizes = rng.integers(1, 9000, size=n)
    else:  # items much longer than a WILLNEED piece, some empty
        sizes = rng.integers(0, 400_000, size=n) * (rng.random(n) > 0.1)
    row_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    for trial in range(20):
        index = rng.integers(0, n, size=int(rng.integers(1, 80)))
        if trial % 3 == 0:  # neighbours and duplicates: merged
            index = np.concatenate([index, index + 1, index])[: 3 * len(index)] % n
        offsets, lengths = pf.row_spans(row_starts, index)
        assert np.all(offsets % PAGE == 0) and np.all(lengths > 0) and np.all(lengths <= pf.CHUNK_BYTES)
        assert np.all(offsets[1:] >= offsets[:-1] + lengths[:-1]), "spans overlap or are out of order"
        covered = set()
        for offset, length in zip(offsets.tolist(), lengths.tolist()):
            covered.update(range(offset // PAGE, -(-(offset + length) // PAGE)))
        assert covered == pages_of(row_starts, index)


def test_row_spans_of_nothing():
    offsets, lengths = pf.row_spans(np.array([0, 10], dtype=np.int64), np.array([], dtype=np.int64))
    assert offsets.size == lengths.size == 0


# ---- a cache on disk, evicted ------------------------------------------------------------------------
def evicted(directory) -> str:
    """Evict the data file of the cache in ``directory`` (every cache object of it that read pages
    must be gone: pages a process maps stay) and return its path."""
    path = cache_path(str(directory), "train", "data")
    gc.collect()
    left = pf.evict(path)
    if left:
        pytest.skip(f"this file system keeps {left} bytes of the file in memory after eviction (tmpfs?)")
    return path


def file_system_type(path) -> str:
    """The type of the file system holding ``path`` (from /proc/mounts, the longest mount point)."""
    best, kind = "", ""
    with open("/proc/mounts") as fh:
        for line in fh:
            _, mount, fs_type = line.split()[:3]
            if str(path).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fs_type
    return kind


def test_evict_drops_a_file_just_written(tmp_path):
    """Fresh writes are dirty pages, which DONTNEED alone keeps: evict writes them back first."""
    if file_system_type(tmp_path) in ("tmpfs", "ramfs", ""):
        pytest.skip(f"{tmp_path} is on {file_system_type(tmp_path) or 'an unknown file system'}: no page cache to drop")
    path = tmp_path / "fresh.bin"
    with open(path, "wb") as fh:
        fh.write(os.urandom(3 * 2**20))
    assert pf.resident_bytes(str(path)) > 0
    assert pf.evict(str(path)) == 0


@pytest.fixture
def cache_dir(tmp_path):
    rng = np.random.default_rng(7)
    rows, widths = random_rows(rng, 400, 4, 8, 96, min_width=10)  # padded rows of 6 KiB
    white = rng.standard_normal((4, 8, 1)).astype(np.float16)
    for layout in ("padded", "ragged"):
        write_cache(str(tmp_path / layout), rows, widths, w_max=96, layout=layout, white=white)
    gc.collect()
    return tmp_path


def hot_batch(directory, indices, **kwargs):
    cache = LatentCache(str(directory))
    return read_batch(cache, indices, cold=False, **kwargs)


@pytest.mark.parametrize("probe", ["cachestat", "mincore"])
def test_residency_probe_sees_reads_made_here(cache_dir, probe, monkeypatch):
    monkeypatch.setattr(pf, "_MINCORE_WINDOW_PAGES", 3)  # several mincore windows per query
    path = evicted(cache_dir / "ragged")
    handle = pf.DataFile(path, probe=probe)
    if probe == "cachestat" and not pf._cachestat_works(handle.fd):
        pytest.skip("the kernel has no cachestat (Linux < 6.5)")
    try:
        assert handle.resident_bytes() == 0
        size = os.path.getsize(path)
        offsets = np.array([0, 5 * PAGE, (size // PAGE - 2) * PAGE], dtype=np.int64)
        lengths = np.array([2 * PAGE, 3 * PAGE, PAGE], dtype=np.int64)
        assert handle.missing(offsets, lengths).tolist() == [True, True, True]
        with open(path, "rb") as fh:  # a plain read of pages 5..7 (read-ahead may add neighbours)
            fh.seek(5 * PAGE)
            fh.read(3 * PAGE)
        assert handle.cached_pages(5 * PAGE, 3 * PAGE) == 3
        assert handle.cached_pages(4 * PAGE, 5 * PAGE) >= 3
        assert handle.missing(offsets, lengths)[1] == False  # noqa: E712
        with open(path, "rb") as fh:
            fh.read()
        assert handle.resident_bytes() == size and handle.cached_pages(PAGE, size) == -(-size // PAGE) - 1
    finally:
        handle.close()


def test_prefetch_reads_exactly_the_rows_pages_and_same_bytes(cache_dir):
    directory = cache_dir / "ragged"
    path = evicted(directory)
    cache = LatentCache(str(directory))
    wanted, elsewhere = np.array([3, 250, 17, 3]), np.array([120, 390])
    cache.prefetch(wanted)
    pf.wait_for_prefetches()
    handle = pf.DataFile(path)
    try:
        offsets, lengths = pf.row_spans(cache.row_starts, wanted)
        assert not handle.missing(offsets, lengths).any(), "a prefetched row's page is not in the page cache"
        far_offsets, far_lengths = pf.row_spans(cache.row_starts, elsewhere)
        assert handle.missing(far_offsets, far_lengths).all(), "pages of rows nobody asked for were read"
    finally:
        handle.close()
    got, widths = read_batch(cache, wanted)
    expected, expected_widths = hot_batch(directory, wanted)
    assert torch.equal(got, expected) and torch.equal(widths, expected_widths)


@pytest.mark.parametrize("bad", [400, -1, 10**12])
def test_prefetch_of_a_bad_index_raises_like_read_batch(cache_dir, bad):
    cache = LatentCache(str(cache_dir / "padded"))
    named = rf"indices\[2\] = {bad} is out of range for .*400 rows"
    with pytest.raises(IndexError, match=named):
        read_batch(cache, [0, 1, bad])
    with pytest.raises(IndexError, match=named):
        cache.prefetch([0, 1, bad])
    with pytest.raises(TypeError, match="indices must be a 1-D sequence of ints"):
        cache.prefetch([0.5, 2.0])


class PrefetchingDataset(Dataset):
    """Item k = read_batch of batch k after prefetching batch k + 1 -- inside the worker."""

    def __init__(self, cache, batches):
        self.cache, self.batches = cache, batches

    def __len__(self):
        return len(self.batches)

    def __getitem__(self, k):
        if k + 1 < len(self.batches):
            self.cache.prefetch(self.batches[k + 1])
        pf.wait_for_prefetches()
        return read_batch(self.cache, self.batches[k])[0]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_prefetch_in_dataloader_workers(cache_dir, context):
    directory = cache_dir / "padded"
    rng = np.random.default_rng(3)
    batches = [rng.integers(0, 400, size=12).tolist() for _ in range(8)]
    expected = [hot_batch(directory, b)[0] for b in batches]
    evicted(directory)
    cache = LatentCache(str(directory))
    cache.prefetch(batches[0])  # this process's prefetch thread exists before the workers start
    pf.wait_for_prefetches()
    loader = DataLoader(PrefetchingDataset(cache, batches), batch_size=None, num_workers=2,
                        multiprocessing_context=context)
    got = list(loader)
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected))


# ---- read_batch's cold path --------------------------------------------------------------------------
class AdviceSpy:
    """Records the WILLNEED advice read_batch gives. Advice is taken as never slow here: under load a
    slow advice call would switch the next batch to the pool of preads, which gives none (a flake)."""

    def __init__(self, monkeypatch):
        self.calls = []
        original = pf.DataFile.advise
        monkeypatch.setattr(pf, "SLOW_FLOOR_S", float("inf"))

        def advise(handle, offsets, lengths):
            self.calls.append((offsets.copy(), lengths.copy()))
            return original(handle, offsets, lengths)

        monkeypatch.setattr(pf.DataFile, "advise", advise)

    def pages(self):
        return {o // PAGE + k for offsets, lengths in self.calls for o, n in zip(offsets.tolist(), lengths.tolist())
                for k in range(n // PAGE)}


@pytest.mark.parametrize("layout", ["padded", "ragged"])
@pytest.mark.parametrize("device", ["cpu"])
def test_cold_read_batch_advises_the_missing_rows_and_returns_the_hot_bytes(cache_dir, layout, device, monkeypatch):
    directory = cache_dir / layout
    indices = np.array([5, 399, 5, 200, 31])
    expected, expected_widths = hot_batch(directory, indices, dtype=torch.float32)
    evicted(directory)
    spy = AdviceSpy(monkeypatch)
    cache = LatentCache(str(directory))
    got, widths = read_batch(cache, indices, dtype=torch.float32, device=device)
    assert torch.equal(got, expected) and torch.equal(widths, expected_widths)
    assert spy.pages() == pages_of(cache.row_starts, indices), "the cold path did not ask for the batch's pages"
    spy.calls.clear()
    read_batch(cache, indices)  # now resident: nothing to ask for
    assert spy.calls == []
    read_batch(cache, indices, cold=True)  # cold=True asks without checking
    assert spy.pages() == pages_of(cache.row_starts, indices)
    spy.calls.clear()
    del cache, got
    evicted(directory)
    cache = LatentCache(str(directory))
    got, _ = read_batch(cache, indices, dtype=torch.float32, cold=False)
    assert spy.calls == [] and torch.equal(got, expected)


def test_auto_mode_stops_checking_when_hot_and_resumes_after_a_slow_copy(cache_dir, monkeypatch):
    cache = LatentCache(str(cache_dir / "padded"))
    read_batch(cache, np.arange(400))  # all resident
    state = pf.cold_reads(cache)
    checks = []  # one per batch whose pages were looked at
    original = pf.row_spans
    monkeypatch.setattr(pf, "row_spans", lambda *args: checks.append(1) or original(*args))
    for _ in range(pf.HOT_AFTER + 5):
        read_batch(cache, [1, 2, 3])
    assert len(checks) == pf.HOT_AFTER - 1 and state.hot, "residency kept being checked on a hot cache"
    state.after_copy(0.5e-3, lambda: 10**9)  # fast: stays hot
    assert state.hot
    state.after_copy(0.2, lambda: 1 << 20)  # 1 MiB in 200 ms: page-fault speed
    assert not state.hot
    read_batch(cache, [1, 2, 3])
    assert len(checks) == pf.HOT_AFTER, "a slow copy did not turn the checks back on"
    assert state.hot, "a resident batch after a false alarm should end the checks at once"
    monkeypatch.setattr(pf, "SLOW_FLOOR_S", -1.0)  # every copy now looks slow to read_batch's clock
    monkeypatch.setattr(pf, "SLOW_BYTES_PER_S", 1e30)
    read_batch(cache, [1, 2, 3])
    assert not state.hot, "read_batch did not report a slow copy"
    del cache
    evicted(cache_dir / "padded")  # now really cold: the checks stay on until batches are resident
    cache = LatentCache(str(cache_dir / "padded"))
    state = pf.cold_reads(cache)
    state.hot, state.streak = False, pf.HOT_AFTER - 1  # on probation, as after a slow copy
    read_batch(cache, [1, 2, 3])
    assert not state.hot and state.streak == 0


def test_state_is_per_opened_cache_and_views_share_it(cache_dir):
    cache = LatentCache(str(cache_dir / "padded"))
    other = LatentCache(str(cache_dir / "padded"))
    assert pf.cold_reads(cache) is pf.cold_reads(cache)
    assert pf.cold_reads(cache) is not pf.cold_reads(other)

    class View:  # how a wrapper (e.g. the shaped-cache view) presents the same cache
        def __getattr__(self, name):
            return getattr(cache, name)

    assert pf.cold_reads(View()) is pf.cold_reads(cache)
    assert pf.cold_reads(object()) is None


def test_read_batch_marks_the_map_random(cache_dir):
    cache = LatentCache(str(cache_dir / "ragged"))
    read_batch(cache, [1, 2])
    start = cache.gather_source()[0].data_ptr()
    with open("/proc/self/smaps") as fh:
        lines = fh.read().splitlines()
    for k, line in enumerate(lines):
        low, high = (int(x, 16) for x in line.split()[0].split("-")) if "-" in line.split()[0] else (None, None)
        if low is not None and low <= start < high:
            flags = next(item for item in lines[k + 1 :] if item.startswith("VmFlags:"))
            assert " rr" in flags, f"MADV_RANDOM not set on the cache's map: {flags}"
            return
    pytest.fail("the cache's map is not in /proc/self/smaps")


def test_cold_argument_is_checked(cache_dir):
    cache = LatentCache(str(cache_dir / "padded"))
    with pytest.raises(ValueError, match="cold must be 'auto', True or False, got 'yes'"):
        read_batch(cache, [0], cold="yes")
    with pytest.raises(ValueError, match="cold must be"):
        read_batch(cache, [0], cold=1)


# ---- lookahead ---------------------------------------------------------------------------------------
class PrefetchSpy:
    def __init__(self, monkeypatch):
        self.batches = []
        monkeypatch.setattr(pf, "prefetch", lambda cache, indices: self.batches.append(list(indices)))


def test_lookahead_peeks_the_sampler_without_consuming(cache_dir, monkeypatch):
    cache = LatentCache(str(cache_dir / "padded"))
    spy = PrefetchSpy(monkeypatch)
    plain = WidthBucketBatchSampler(cache.widths, 16, seed=4, bucket_batches=2)
    expected = list(plain)
    sampler = WidthBucketBatchSampler(cache.widths, 16, seed=4, bucket_batches=2)
    wrapped = LookaheadSampler(sampler, cache, lookahead=3)
    iterator = iter(wrapped)
    for step in range(5):
        assert next(iterator) == expected[step]
        # batches 0..step+3 asked for, each once, in order
        assert spy.batches == expected[: step + 4]
        assert sampler.state_dict()["consumed"] == step + 1, "the lookahead advanced the sampler"
    assert list(iterator) == expected[5:]
    assert spy.batches == expected
    assert len(wrapped) == len(sampler) and wrapped.state_dict()["seed"] == 4  # delegated


def test_lookahead_over_a_plain_iterable(monkeypatch):
    spy = PrefetchSpy(monkeypatch)
    batches = [[k, k + 1] for k in range(7)]
    pulled = []

    def source():
        for batch in batches:
            pulled.append(batch)
            yield batch

    iterator = iter(LookaheadSampler(source(), cache=None, lookahead=2))
    assert next(iterator) == batches[0] and pulled == batches[:3] and spy.batches == batches[:3]
    assert list(iterator) == batches[1:] and spy.batches == batches
    assert list(LookaheadSampler(batches, cache=None, lookahead=0)) == batches
    with pytest.raises(ValueError, match="lookahead must be an int >= 0"):
        LookaheadSampler(batches, None, lookahead=-1)
    with pytest.raises(TypeError, match="lookahead must be an int"):
        LookaheadSampler(batches, None, lookahead=1.5)


def test_batch_loader_reads_ahead_by_default(cache_dir, monkeypatch):
    cache = LatentCache(str(cache_dir / "ragged"))
    spy = PrefetchSpy(monkeypatch)
    sampler = WidthBucketBatchSampler(cache.widths, 32, seed=1)
    expected = [list(b) for b in WidthBucketBatchSampler(cache.widths, 32, seed=1)]
    loader = batch_loader(cache, sampler)
    iterator = iter(loader)
    first = next(iterator)
    assert first[2].tolist() == expected[0]
    assert spy.batches[: 1 + pf.DEFAULT_LOOKAHEAD] == expected[: 1 + pf.DEFAULT_LOOKAHEAD]
    assert [b[2].tolist() for b in iterator] == expected[1:]
    spy.batches.clear()
    list(batch_loader(cache, sampler, lookahead=0))
    assert spy.batches == []


# ---- latentfast cache inspect ------------------------------------------------------------------------
def test_inspect_reports_resident_bytes(cache_dir):
    directory = cache_dir / "padded"
    path = evicted(directory)
    run = [sys.executable, "-m", "latentfast.cli", "cache", "inspect", str(directory)]
    cold = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert cold.returncode == 0, cold.stderr
    assert "in the page cache: 0 bytes (0% of the data file)" in cold.stdout, cold.stdout
    with open(path, "rb") as fh:
        fh.read()
    hot = subprocess.run(run + ["--json"], capture_output=True, text=True, timeout=120)
    resident, size = json.loads(hot.stdout)["resident_bytes"], os.path.getsize(path)
    # All of it, but for a page or two the host may reclaim between the read and the subprocess
    # (a CI run once found 599 of 600 pages); never more than the file.
    assert size - 4 * 4096 <= resident <= size, (resident, size)


def test_cold_batch_is_asked_for_after_a_short_probe_and_a_warm_one_row_by_row(cache_dir, monkeypatch):
    """A batch whose first spans are all missing is advised whole without checking every span; a batch
    that is partly resident has each span checked and only the missing ones advised."""
    directory = cache_dir / "padded"
    evicted(directory)
    spy = AdviceSpy(monkeypatch)
    looked = []
    original = pf.DataFile.missing
    monkeypatch.setattr(pf.DataFile, "missing", lambda handle, o, n: looked.append(len(o)) or original(handle, o, n))
    cache = LatentCache(str(directory))
    cold_rows = np.arange(100, 140, 2)  # 20 rows, none resident
    read_batch(cache, cold_rows)
    assert looked == [pf.PROBE_SPANS] and spy.pages() == pages_of(cache.row_starts, cold_rows)
    looked.clear()
    spy.calls.clear()
    warm_first = np.concatenate([np.arange(0, 8, 2), np.arange(300, 340, 2)])  # rows 0-6 are read below
    read_batch(cache, np.arange(0, 8, 2), cold=False)
    read_batch(cache, warm_first)
    assert sum(looked) == len(warm_first), "a partly resident batch must have every span checked"
    assert spy.pages() == pages_of(cache.row_starts, warm_first[4:]), "only the missing rows are asked for"


def test_shaped_caches_take_the_same_cold_path(tmp_path, monkeypatch):
    """Image-bucket / video caches: spans come from row_starts, so a one-shape batch is asked for page by
    page like a line batch, prefetch reads exactly its items, and the bytes equal a hot read."""
    from latentfast.cache.store.writer import LatentCacheWriter

    rng = np.random.default_rng(4)
    shapes = [(4, 2, 24, 32), (4, 3, 16, 16)]  # [C, T, h, w] clips of two sizes, 12 and 6 KiB
    with LatentCacheWriter(str(tmp_path), encoder={"pretrained": "test", "latent_channels": 4}) as writer:
        for i in range(60):
            writer.append(f"clip-{i}", rng.standard_normal(shapes[i % 2]).astype(np.float32))
    batch, other = np.arange(0, 40, 4), np.arange(1, 40, 4)  # ten items of the first shape; ten of the second
    expected, expected_shapes = LatentCache(str(tmp_path)).read_batch(batch, cold=False)
    evicted(tmp_path)
    spy = AdviceSpy(monkeypatch)
    cache = LatentCache(str(tmp_path))
    got, got_shapes = cache.read_batch(batch)
    assert torch.equal(got, expected) and torch.equal(got_shapes, expected_shapes)
    assert spy.pages() == pages_of(cache.row_starts, batch)
    monkeypatch.undo()
    cache.prefetch(other)
    pf.wait_for_prefetches()
    handle = pf.DataFile(pf.data_path(cache))
    try:
        assert not handle.missing(*pf.row_spans(cache.row_starts, other)).any()
        assert handle.missing(*pf.row_spans(cache.row_starts, np.arange(42, 60, 4))).all()
    finally:
        handle.close()


# ---- how cold spans are brought in, and on what filesystem ------------------------------------------
def test_filesystem_type_reads_the_longest_mount_point_above_a_path(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(
        "/dev/sda1 / ext4 rw 0 0\n"
        "server:/export /mnt/data nfs4 rw 0 0\n"
        "src /mnt/data/fused fuse.bindfs rw 0 0\n"
        "src2 /mnt/data/fused fuse rw 0 0\n"  # mounted over the previous one: the last listed wins
        "tmpfs /mnt/my\\040space tmpfs rw 0 0\n"
        "short line\n"
    )
    assert pf.filesystem_type("/mnt/data/fused/cache/x.dat", str(mounts)) == "fuse"
    assert pf.filesystem_type("/mnt/data/other", str(mounts)) == "nfs4"
    assert pf.filesystem_type("/mnt/datax/file", str(mounts)) == "ext4", "a longer name is not a mount point above"
    assert pf.filesystem_type("/mnt/my space/f", str(mounts)) == "tmpfs"
    assert pf.filesystem_type("/etc", str(tmp_path / "absent")) is None
    assert pf.filesystem_type("/proc/self") == "proc"  # the real table


@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_the_pread_pool_reads_a_batch_up_to_the_end_of_the_file(cache_dir, layout):
    """The pool reads whole pages too, but stops at the end of the file (a ragged cache's last page is
    partly past it: a pread there was refused, so a loaded host that had moved to the pool failed)."""
    directory = cache_dir / layout
    last = len(LatentCache(str(directory))) - 1
    indices = np.array([last, 3, last - 1, 200])
    expected, expected_widths = hot_batch(directory, indices)
    evicted(directory)
    cache = LatentCache(str(directory))
    assert os.path.getsize(cache_path(str(directory), "train", "data")) % PAGE or layout == "padded"
    pf.cold_reads(cache).way = "pool"  # as after a slow advice call
    got, widths = read_batch(cache, indices, cold=True)
    assert torch.equal(got, expected) and torch.equal(widths, expected_widths)


def test_slow_advice_tries_the_pread_pool_and_keeps_the_faster_way(cache_dir, monkeypatch):
    """Where advice reads inside the call (FUSE), the next cold batch is read by the pool; the way with
    the better rate then stays. Advice that returns at once chooses nothing."""
    cache = LatentCache(str(cache_dir / "padded"))
    state = pf.cold_reads(cache)
    pooled = []
    from latentfast import ops

    real_read_spans = ops.read_spans
    monkeypatch.setattr(ops, "read_spans", lambda fd, o, n, **kw: pooled.append(len(o)) or real_read_spans(fd, o, n, **kw))
    offsets, lengths = pf.row_spans(cache.row_starts, np.arange(0, 40, 4))
    state.bring_in(offsets, lengths)
    assert state.way == "advise" and state.rates == {} and pooled == [], "fast advice must choose nothing"
    monkeypatch.setattr(pf.DataFile, "advise", lambda self, o, n: __import__("time").sleep(0.05))
    state.bring_in(offsets, lengths)
    assert state.way == "pool" and set(state.rates) == {"advise"}
    state.bring_in(offsets, lengths)  # read by the pool: far faster than 50 ms of advice
    assert pooled == [len(offsets)] and set(state.rates) == {"advise", "pool"} and state.way == "pool"
    state.rates["pool"] = state.rates["advise"] / 2  # had the pool been slower, advice is back
    state.way = "pool"
    state.bring_in(offsets, lengths)
    assert len(pooled) == 2
    assert state.way == max(state.rates, key=state.rates.get)
