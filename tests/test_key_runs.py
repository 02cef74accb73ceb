"""HashRuns (the writer's table of key and value hashes, issue 33): against a dict of lists on random
hashes with true 64-bit collisions, through many flushes and merges (a tiny memory table forces them),
``retain``, ``clear``; its memory bounded as the count grows; each run file written once, front to back."""
import os
import tracemalloc

import numpy as np
import pytest

from latentfast.cache.store import building
from latentfast.cache.store.building import HashRuns


def tiny(path, **kw) -> HashRuns:
    """A table of 16 slots (8 entries a run), merges 5 records at a time, a fence every 4th hash."""
    return HashRuns(str(path), **{"memory_slots": 16, "chunk": 5, "stride": 4, "fence_max": 8, **kw})


def colliding_hashes(rng, n: int) -> np.ndarray:
    hashes = rng.integers(0, 2**64, n, dtype=np.uint64)
    hashes[rng.integers(0, n, n // 5)] = hashes[rng.integers(0, n, n // 5)]  # true 64-bit collisions
    hashes[n // 3: n // 3 + 40] = hashes[1]  # a long stretch of one hash: across fences and chunks
    return hashes


def check(table: HashRuns, reference: dict, queries: np.ndarray) -> None:
    which, items = table.find(queries)
    got = {}
    for w, item in zip(which.tolist(), items.tolist()):
        got.setdefault(w, []).append(item)
    for w, h in enumerate(queries.tolist()):
        assert sorted(got.get(w, [])) == sorted(reference.get(h, [])), w
        assert sorted(table.find_one(h)) == sorted(reference.get(h, [])), w
    assert table.count == sum(map(len, reference.values()))


@pytest.mark.parametrize("seed", [0, 1])
def test_hash_runs_match_a_dict_through_flushes_merges_retain_and_clear(tmp_path, seed):
    rng = np.random.default_rng(seed)
    table, reference = tiny(tmp_path / "slots"), {}
    hashes = colliding_hashes(rng, 1500)
    absent = rng.integers(0, 2**64, 200, dtype=np.uint64)
    item = 0
    while item < 1000:  # batches of odd sizes (some larger than a run) and single adds, mixed
        size = int(rng.integers(1, 30))
        batch = hashes[item: item + size]
        if size % 3:
            table.add(batch, np.arange(item, item + len(batch)))
        else:
            for h, i in zip(batch.tolist(), range(item, item + len(batch))):
                table.add_one(h, i)
        for h, i in zip(batch.tolist(), range(item, item + len(batch))):
            reference.setdefault(h, []).append(i)
        item += len(batch)
    assert len(table._runs) == bin(1000 // 8).count("1")  # 125 runs' worth, merged as a binary counter: 6 runs
    assert table._made > 125  # (every flush and merge made a run file)
    check(table, reference, np.concatenate([hashes[:1000], absent]))

    table.retain(613)  # a cut inside a run and inside the memory table
    reference = {h: [i for i in items if i < 613] for h, items in reference.items()}
    check(table, reference, np.concatenate([hashes[:1000], absent]))
    for i in range(613, 1500):  # appending again after the cut
        table.add_one(int(hashes[i]), i) if i % 7 == 0 else table.add(hashes[i: i + 1], np.asarray([i]))
        reference.setdefault(int(hashes[i]), []).append(i)
    check(table, reference, np.concatenate([hashes, absent]))

    table.clear()
    assert table.count == 0 and table.find(hashes)[0].size == 0 and table.find_one(int(hashes[1])) == []
    assert not [f for f in os.listdir(tmp_path) if f.startswith("slots.run")]
    table.add(hashes[:50], np.arange(50))  # the writer's rebuild after a cut
    check(table, {h: [i for i in range(50) if hashes[i] == h] for h in hashes[:50].tolist()}, hashes[:60])
    table.close()
    assert not os.listdir(tmp_path)


def test_hash_runs_start_without_an_earlier_writers_runs(tmp_path):
    old = tiny(tmp_path / "slots")
    old.add(np.arange(100, dtype=np.uint64), np.arange(100))
    old._runs = []  # (a writer that crashed: its run files left behind)
    assert [f for f in os.listdir(tmp_path) if f.startswith("slots.run")]
    (tmp_path / "slots.runs.txt").write_text("not a run")  # (a file of another name is not touched)
    table = tiny(tmp_path / "slots")
    assert os.listdir(tmp_path) == ["slots.runs.txt"] and table.find(np.arange(100, dtype=np.uint64))[0].size == 0


def test_hash_runs_memory_is_bounded_as_the_count_grows(tmp_path):
    table = HashRuns(str(tmp_path / "slots"), memory_slots=1 << 10, chunk=256, stride=16, fence_max=64)
    rng = np.random.default_rng(2)
    budget = 16 << 10  # the memory table: 1,024 slots of 16 bytes
    fence_bound = 8 * 64 * 16  # at most ~fence_max hashes a run, at most 16 runs here
    tracemalloc.start()
    try:
        peaks = []
        for step in range(400):  # 400 batches of 500: ~390 runs' worth, merged into ~9 runs
            table.add(rng.integers(0, 2**64, 500, dtype=np.uint64), np.arange(500 * step, 500 * step + 500))
            assert table.memory_bytes() <= budget + fence_bound
            if step in (40, 399):
                peaks.append(tracemalloc.get_traced_memory()[1])
                tracemalloc.reset_peak()
    finally:
        tracemalloc.stop()
    assert table.count == 200_000 and len(table._runs) == bin(200_000 // 512).count("1")  # (a binary counter of full runs)
    assert all(run.fence.size <= 2 * 64 for run in table._runs)
    # the peak of the last batches (its runs 10 times larger) is the first batches' peak, give or take a merge's chunks
    assert peaks[1] <= peaks[0] + 8 * 16 * 256 + fence_bound, peaks
    table.close()


def test_hash_runs_write_each_file_once_front_to_back(tmp_path, monkeypatch):
    writes = []

    def recording(fd, data, offset):
        writes.append((os.readlink(f"/proc/self/fd/{fd}"), offset, memoryview(data).nbytes))
        real(fd, data, offset)

    real = building.pwrite_all
    monkeypatch.setattr(building, "pwrite_all", recording)
    table = tiny(tmp_path / "slots")
    rng = np.random.default_rng(3)
    hashes = colliding_hashes(rng, 600)
    for lo in range(0, 600, 37):
        table.add(hashes[lo: lo + 37], np.arange(lo, min(600, lo + 37)))
    table.retain(444)
    ends = {}
    for path, offset, nbytes in writes:  # each file appended to at its end only, never written back in place
        assert offset == ends.get(path, 0), (path, offset)
        ends[path] = offset + nbytes
    assert 75 < len(ends) <= table._made  # (a run the cut empties is never written)
    assert {os.path.join(tmp_path, f) for f in os.listdir(tmp_path)} <= set(ends)
    for run in table._runs:
        assert ends[run.path] == os.path.getsize(run.path) == 16 * run.count
    table.close()
