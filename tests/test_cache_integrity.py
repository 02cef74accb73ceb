"""Issue 26, cache core: one generation per reader, every file covered by a checksum, repairs that
repair, clear errors for damaged headers, the writer's lock and source hashes, keys of items, and
`cache inspect` on image and video caches."""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from latentfast.cache import LatentCache, LatentCacheWriter, cache_path, read_batch, verify_cache
from latentfast.cache.builders.images import build_image_cache, build_video_cache
from latentfast.cache.store.durable import BuildLock, lock_path
from latentfast.errors import CacheCorruptError, CacheError, CacheLockedError, InvalidArgumentError
from latentfast.toy import ToyVAE
from test_cache import build, make_lines
from test_cache_images import make_clips, make_images
from test_cache_reliability import run_cli
from test_cache_shaped import random_items, write

ENCODER = {"pretrained": "test", "latent_channels": 4}


def run_python(code: str, *args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=timeout)


def files_of(out, split="train"):
    return {n: open(os.path.join(out, n), "rb").read() for n in sorted(os.listdir(out)) if n.startswith(split + ".")}


@pytest.fixture(scope="module")
def manifest(tmp_path_factory):
    return make_lines(str(tmp_path_factory.mktemp("lines")), n=10, seed=3)


@pytest.fixture(scope="module")
def line_reference(manifest, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("line_ref"))
    build(manifest, out)
    return out


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("images"))
    make_images(folder, n=7, seed=5)
    return folder


def build_images(images, out):
    build_image_cache(ToyVAE(), images, out, buckets=[(32, 32), (32, 48), (48, 32)], batch_size=3, quiet=True)


@pytest.fixture(scope="module")
def image_reference(images, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("image_ref"))
    build_images(images, out)
    return out


def copy_of(reference, tmp_path):
    import shutil

    out = str(tmp_path / "cache")
    shutil.copytree(reference, out)
    return out


# -- 1: verify_rows on a truncated file raises, never SIGBUS ------------------------------------------
TRUNCATE_UNDER_VERIFY_ROWS = """
import os, sys
from latentfast.cache import LatentCache, cache_path, read_batch
from latentfast.errors import CacheCorruptError
folder, how = sys.argv[1], sys.argv[2]
cache = LatentCache(folder, verify_rows=True)
cache[0]
path = cache_path(folder, "train", "data")
os.truncate(path, os.path.getsize(path) // 4)
try:
    cache[len(cache) - 1] if how == "item" else read_batch(cache, [len(cache) - 1])
except CacheCorruptError as exc:
    print("raised:", exc)
"""


@pytest.mark.parametrize("how", ["item", "batch"])
def test_verify_rows_on_a_truncated_shaped_cache_raises_instead_of_sigbus(tmp_path, how):
    write(str(tmp_path), random_items(6, shapes=[(4, 8, 8)]))
    proc = run_python(TRUNCATE_UNDER_VERIFY_ROWS, tmp_path, how)
    assert proc.returncode == 0, f"died with {proc.returncode} (SIGBUS is {-signal.SIGBUS}): {proc.stderr[-2000:]}"
    assert "raised:" in proc.stdout and "changed size" in proc.stdout


# -- 4: a reader sees one generation of the cache or raises ---------------------------------------------
def test_a_reader_opened_before_a_rebuild_reads_its_own_generation_or_raises(manifest, tmp_path):
    out = str(tmp_path / "c")
    build(manifest, out, encoder=ToyVAE(seed=0))
    reading = LatentCache(out)
    old = [reading[i].clone() for i in range(len(reading))]  # this one holds the old file open
    unread = LatentCache(out)  # opened, nothing read yet
    pickled = pickle.dumps(LatentCache(out))  # what a DataLoader worker unpickles later
    build(manifest, out, encoder=ToyVAE(seed=1))
    new = LatentCache(out)
    assert any(not np.array_equal(new[i].numpy(), old[i].numpy()) for i in range(len(new)))
    for i in range(len(reading)):  # its descriptor is the old generation's file: old index, old data
        assert np.array_equal(reading[i].numpy(), old[i].numpy())
    for stale in (unread, pickle.loads(pickled)):
        with pytest.raises(CacheCorruptError, match="rebuilt after this reader opened it"):
            stale[0]
        with pytest.raises(CacheCorruptError, match="rebuilt after this reader opened it"):
            read_batch(stale, [0, 1])


def test_a_repair_in_place_under_an_open_reader_raises(manifest, tmp_path):
    out = str(tmp_path / "c")
    build(manifest, out)
    reader = LatentCache(out)
    reader[0]
    path = cache_path(out, "train", "data")
    with open(path, "r+b") as fh:  # what the line builder's repair does: rows rewritten in the same file
        fh.seek(2 * int(reader.row_starts[-1]) - 2)
        fh.write(b"\x00\x3c")
    # a later write has a later mtime; within one clock tick of the build it may not: say it is later
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.raises(CacheCorruptError, match="modified under this reader"):
        read_batch(reader, [0])


REBUILDER = """
import sys, time
import numpy as np
from latentfast.cache import LatentCacheWriter
folder, seconds = sys.argv[1], float(sys.argv[2])
shapes = [(4, 2, 6), (4, 3, 4), (4, 6, 2)]  # one size: only the index tells them apart
end, g = time.monotonic() + seconds, 1
while time.monotonic() < end:
    with LatentCacheWriter(folder, encoder={"pretrained": "test"}, meta={"gen": g}, restart=True) as w:
        for i in range(6):
            w.append(f"k{i}", np.full(shapes[g % 3], g % 256 + i / 8, dtype=np.float32))
    g += 1
print(g)
"""


def _check_generation(cache) -> int:
    """Wrong items of one reader's pass over every item (each item i holds gen % 256 + i/8 everywhere)."""
    gen, wrong = cache.meta["gen"] % 256, 0
    batch, _ = read_batch(cache, list(range(len(cache))))
    for i in range(len(cache)):
        wrong += int(not bool((batch[i] == gen + i / 8).all()))
        wrong += int(not bool((cache[i] == gen + i / 8).all()))
    return wrong


def test_readers_opening_in_a_loop_while_another_process_rebuilds_read_no_wrong_item(tmp_path):
    folder = str(tmp_path)
    with LatentCacheWriter(folder, encoder={"pretrained": "test"}, meta={"gen": 0}) as w:
        for i in range(6):
            w.append(f"k{i}", np.full((4, 6, 2), i / 8, dtype=np.float32))
    rebuilder = subprocess.Popen([sys.executable, "-c", REBUILDER, folder, "4"], stdout=subprocess.PIPE, text=True)
    good = raised = wrong = 0
    rng = np.random.default_rng(0)
    try:
        while rebuilder.poll() is None:
            try:
                cache = LatentCache(folder)
                time.sleep(rng.uniform(0, 0.02))  # opened at start-up, read a little later (as a DataLoader does)
                wrong += _check_generation(cache)
                good += 1
            except (CacheError, FileNotFoundError):  # a publish under way, or the cache moved on: raise is fine
                raised += 1
    finally:
        rebuilder.wait(timeout=60)
    generations = int(rebuilder.stdout.read())
    assert rebuilder.returncode == 0 and generations > 5
    assert good > 20, (good, raised)
    assert wrong == 0, f"{wrong} wrong items in {good} passes ({raised} raised, {generations} generations)"


# -- 5: every index file is covered by a checksum that verify checks and a rebuild repairs -----------------
def _bump_npy(path):
    array = np.load(path)
    flat = array.reshape(-1)
    flat[0] = flat[0] + 1 if array.dtype.kind in "iu" else flat[0] * 3 + 1
    np.save(path, array)


def _edit_json(path, edit):
    with open(path) as fh:
        value = json.load(fh)
    edit(value)
    with open(path, "w") as fh:
        json.dump(value, fh)


LINE_FLIPS = {
    "widths": lambda p: _bump_npy(p),
    "white": lambda p: _bump_npy(p),
    "keys": lambda p: _edit_json(p, lambda keys: keys.__setitem__(0, keys[0] + "0")),
}


@pytest.mark.parametrize("kind", sorted(LINE_FLIPS))
def test_a_changed_line_index_file_fails_verify_and_the_rerun_repairs_it(line_reference, manifest, tmp_path, capsys, kind):
    out = copy_of(line_reference, tmp_path)
    path = cache_path(out, "train", kind)
    if kind == "widths":  # the width of a row that is narrower than w_max: a real 26 -> 27
        widths = np.load(path)
        row = int(np.flatnonzero(widths < int(LatentCache(line_reference).w_max))[0])
        widths[row] += 1
        np.save(path, widths)
    else:
        LINE_FLIPS[kind](path)
    with pytest.raises(CacheCorruptError, match=os.path.basename(path)):
        verify_cache(out)
    assert run_cli("verify", out) == 1
    assert os.path.basename(path) in capsys.readouterr().err
    build(manifest, out)
    verify_cache(out)
    assert files_of(out) == files_of(line_reference)


def test_a_changed_shaped_info_file_fails_verify_and_the_rerun_repairs_it(image_reference, images, tmp_path):
    out = copy_of(image_reference, tmp_path)
    path = cache_path(out, "train", "info")
    _edit_json(path, lambda info: info[0].__setitem__("original_size", [v + 10 for v in info[0]["original_size"]]))
    with pytest.raises(CacheCorruptError, match="info.json"):
        verify_cache(out)
    with pytest.raises(CacheCorruptError, match="info.json"):
        LatentCache(out).info(0)
    build_images(images, out)
    verify_cache(out)
    assert files_of(out) == files_of(image_reference)


# -- 11: a damaged .npy header is a clear error naming the file ---------------------------------------------
def _break_header(path):
    with open(path, "r+b") as fh:
        header = fh.read(128)
        fh.seek(header.index(b"}"))
        fh.write(b"|")  # one bit: '}' -> '|', and numpy's header tokenizer meets EOF inside the dict (tokenize.TokenError)


@pytest.mark.parametrize("recorded", [True, False], ids=["crc-recorded", "older-meta"])
def test_a_damaged_npy_header_names_the_file_in_open_verify_inspect_and_the_rerun(line_reference, manifest, tmp_path, capsys, recorded):
    out = copy_of(line_reference, tmp_path)
    if not recorded:  # a cache from before the meta recorded its files' CRCs
        _edit_json(cache_path(out, "train", "meta"), lambda meta: meta.pop("files"))
    path = cache_path(out, "train", "widths")
    _break_header(path)
    with pytest.raises(CacheCorruptError, match="widths.npy"):
        LatentCache(out)
    for command in ("verify", "inspect"):
        assert run_cli(command, out) == 1
        err = capsys.readouterr().err
        assert "widths.npy" in err and len(err.splitlines()) == 1, err
        assert "is not a valid .npy array: TokenError" in err, err
    build(manifest, out)
    assert files_of(out) == files_of(line_reference)


# -- 12: the repair rerun rebuilds lost or damaged index files --------------------------------------------------
@pytest.mark.parametrize("kind", ["checksums", "hashes"])
@pytest.mark.parametrize("damage", ["deleted", "header"])
def test_the_line_rerun_repairs_lost_or_damaged_checksums_and_hashes(line_reference, manifest, tmp_path, kind, damage):
    out = copy_of(line_reference, tmp_path)
    path = cache_path(out, "train", kind)
    os.remove(path) if damage == "deleted" else _break_header(path)
    with pytest.raises((CacheCorruptError, FileNotFoundError)):
        verify_cache(out)
    build(manifest, out)
    verify_cache(out)
    assert files_of(out) == files_of(line_reference)


@pytest.mark.parametrize("kind", ["keys", "checksums", "hashes"])
@pytest.mark.parametrize("damage", ["deleted", "flipped"])
def test_the_image_rerun_repairs_lost_or_damaged_index_files(image_reference, images, tmp_path, kind, damage):
    out = copy_of(image_reference, tmp_path)
    path = cache_path(out, "train", kind)
    if damage == "deleted":
        os.remove(path)
    else:
        with open(path, "r+b") as fh:
            payload = bytearray(fh.read())
            payload[len(payload) // 2] ^= 0x04
            fh.seek(0)
            fh.write(payload)
    with pytest.raises((CacheCorruptError, FileNotFoundError)):
        verify_cache(out)
    build_images(images, out)
    verify_cache(out)
    assert files_of(out) == files_of(image_reference)


# -- 14: the writer's lock after a failed finish, and the lock file ---------------------------------------------
def test_a_failed_finish_inside_with_releases_the_lock_and_the_retry_works(tmp_path):
    folder = str(tmp_path)
    items = random_items(5, shapes=[(4, 8, 8)])
    with pytest.raises(CacheCorruptError) as failed:
        with LatentCacheWriter(folder, encoder=ENCODER) as writer:
            for key, latent in items:
                writer.append(key, latent)
            writer.flush()
            with open(cache_path(folder, "train", "data") + ".partial", "r+b") as fh:  # item 3's bytes go bad on disk
                fh.seek(3 * 4 * 8 * 8 * 2)
                fh.write(b"\xff\x7b")
    assert "item 3" in str(failed.value) and "the 1 items after it" in str(failed.value)
    with LatentCacheWriter(folder, encoder=ENCODER) as retry:  # no CacheLockedError naming our own pid
        assert retry.resumed and len(retry) == 3
        for key, latent in items[3:]:
            retry.append(key, latent)
    cache = LatentCache(folder)
    assert [np.array_equal(cache[i].numpy(), z.astype(np.float16)) for i, (_, z) in enumerate(items)] == [True] * 5
    assert not os.path.exists(lock_path(folder, "train"))


def test_the_lock_file_goes_with_its_holder_and_a_waiter_never_shares_the_lock(tmp_path, monkeypatch):
    first = BuildLock(tmp_path, "train")
    got, refused = [], threading.Event()
    try_lock = BuildLock._try_lock
    monkeypatch.setattr(BuildLock, "_try_lock", lambda lock: try_lock(lock) or refused.set())  # (set() is None: falsy)
    waiter = threading.Thread(target=lambda: got.append(BuildLock(tmp_path, "train", timeout=60)))
    waiter.start()
    assert refused.wait(60)  # the waiter found the lock held and waits (it holds the file open only while it tries)
    first.release()
    waiter.join()
    second = got[0]
    assert os.path.exists(lock_path(tmp_path, "train"))  # the waiter holds the path's file, not a deleted one
    with pytest.raises(CacheLockedError):
        BuildLock(tmp_path, "train")
    second.release()
    assert not os.path.exists(lock_path(tmp_path, "train"))


# -- 15: source hashes are checked at append ------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["not-a-hash", "zz" * 16, "ab" * 8, b"\x01" * 5, 12345])
def test_append_refuses_a_malformed_source_hash_naming_the_key(tmp_path, bad):
    with LatentCacheWriter(str(tmp_path), encoder=ENCODER) as writer:
        with pytest.raises(InvalidArgumentError, match="source_hash of key 'k1'"):
            writer.append("k1", np.zeros((4, 2, 2), np.float32), source_hash=bad)
        writer.append("k2", np.zeros((4, 2, 2), np.float32), source_hash="AB" * 16)
        assert writer.source_hash("k2") == "ab" * 16
    assert LatentCache(str(tmp_path)).keys == ["k2"]


# -- first use: keys of items, inspect on image and video caches ---------------------------------------------------
def test_index_of_a_key_and_batches_that_carry_their_keys(line_reference, image_reference):
    for folder in (line_reference, image_reference):
        cache = LatentCache(folder)
        keys = cache.keys
        assert [cache.index(k) for k in keys] == list(range(len(cache)))
        with pytest.raises(KeyError, match="no item with key 'nope'"):
            cache.index("nope")
        picked = [i for i in range(len(cache)) if cache.shapes[i].tolist() == cache.shapes[-1].tolist()][::-1]
        latents, _, batch_keys = read_batch(cache, picked, return_keys=True)
        assert batch_keys == [keys[i] for i in picked] and latents.shape[0] == len(picked)
        assert cache.read_batch(picked, return_keys=True)[2] == batch_keys
        assert len(read_batch(cache, picked)) == 2
        with pytest.raises(IndexError):
            read_batch(cache, [len(cache)], return_keys=True)
        assert pickle.loads(pickle.dumps(cache)).index(keys[-1]) == len(cache) - 1


def _inspect(folder) -> str:
    proc = subprocess.run([sys.executable, "-m", "latentfast.cli", "cache", "inspect", folder], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_inspect_an_image_cache_shows_buckets_fields_sizes_and_residency(image_reference):
    text = _inspect(image_reference)
    cache = LatentCache(image_reference)
    counts = {}
    for i in range(len(cache)):
        counts[tuple(cache.info(i)["bucket"])] = counts.get(tuple(cache.info(i)["bucket"]), 0) + 1
    assert "items per bucket" in text
    for (h, w), count in counts.items():
        assert any(line.split()[0] == f"{h}x{w}" and line.split()[-1] == str(count) for line in text.splitlines() if "->" in line), text
    assert "fields per item:" in text and "original_size" in text
    assert "KiB" in text and "in the page cache:" in text
    for line_only in ("latent_h:", "w_max:", "line_height:", "max_line_width:"):
        assert line_only not in text, text


def test_inspect_a_video_cache_shows_its_buckets(tmp_path):
    make_clips(str(tmp_path / "clips"))
    out = str(tmp_path / "out")
    build_video_cache(ToyVAE(seed=1), str(tmp_path / "clips"), out, buckets=[(4, 32, 48), (8, 32, 32)], quiet=True)
    text = _inspect(out)
    cache = LatentCache(out)
    buckets = {"x".join(map(str, cache.info(i)["bucket"])) for i in range(len(cache))}
    assert "items per bucket" in text and all(f" {b} -> " in text for b in buckets), text
    assert "fields per item:" in text and "line_height:" not in text and "w_max:" not in text
