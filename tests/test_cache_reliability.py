"""Regression tests for the cache's reliability defects: short writes, edited images, reruns over a
damaged cache, concurrent builds, malformed meta in verify, CLI failures as one line, a data file
truncated under a reader (SIGBUS), and verify_rows."""
from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from PIL import Image

from latentfast.cache import LatentCache, cache_path, read_batch, verify_cache
from latentfast.cache.cli import add_cache_subparsers
from latentfast.cache.store.durable import BuildLock
from latentfast.errors import CacheCorruptError, CacheLockedError
from latentfast.testing import random_rows, write_cache
from latentfast.toy import ToyVAE
from test_cache import build, cache_files, make_lines
from test_cache_shaped import random_items, write


class Counting(ToyVAE):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def encode(self, images):
        self.calls += 1
        return super().encode(images)


def run_cli(*argv) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="latentfast")
    add_cache_subparsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["cache", *argv])
    return args.func(args)


@pytest.fixture(scope="module")
def lines(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("lines"))
    make_lines(folder, n=12, seed=11)
    return folder


@pytest.fixture(scope="module")
def reference(lines, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("reference"))
    build(os.path.join(lines, "lines.jsonl"), out)
    return out


# -- short writes -----------------------------------------------------------------------------

def test_line_builder_completes_short_writes(lines, reference, tmp_path, monkeypatch):
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: real(fd, memoryview(data).cast("B")[: max(1, len(memoryview(data).cast("B")) // 5)], offset))
    build(os.path.join(lines, "lines.jsonl"), str(tmp_path))
    assert cache_files(str(tmp_path)) == cache_files(reference)


def test_disk_full_fails_then_the_rerun_finishes_with_the_right_bytes(lines, reference, tmp_path, monkeypatch):
    real, writes = os.pwrite, []

    def filling(fd, data, offset):
        writes.append(offset)
        if len(writes) > 9:  # the disk fills up: a short write, then no progress
            return 0 if len(writes) > 10 else real(fd, memoryview(data).cast("B")[:96], offset)
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", filling)
    with pytest.raises(OSError) as info:
        build(os.path.join(lines, "lines.jsonl"), str(tmp_path))
    assert info.value.errno == errno.ENOSPC
    monkeypatch.setattr(os, "pwrite", real)  # space freed
    build(os.path.join(lines, "lines.jsonl"), str(tmp_path))
    assert cache_files(str(tmp_path)) == cache_files(reference)
    verify_cache(str(tmp_path))


def test_rows_that_read_back_wrong_are_encoded_again(lines, reference, tmp_path, monkeypatch):
    """A write the kernel acknowledged but the disk lost (simulated: the row is zeroed right after its
    batch is logged) is caught by the read-back check and encoded again before the cache is complete."""
    from latentfast.cache.builders import lines as builder

    real_mark, spoiled = builder._Progress.mark, []

    def mark(self, batch, crcs, src):
        real_mark(self, batch, crcs, src)
        if not spoiled:
            spoiled.append(batch)
            with open(self.path.replace("progress", "f16.dat.partial"), "r+b") as fh:
                fh.write(b"\0" * 64)

    monkeypatch.setattr(builder._Progress, "mark", mark)
    stats = {}
    build(os.path.join(lines, "lines.jsonl"), str(tmp_path), stats=stats)
    assert spoiled and stats["encoded_batches"] == 3 + 1
    assert cache_files(str(tmp_path)) == cache_files(reference)


# -- edited images and source spelling --------------------------------------------------------------

def test_edited_image_reencodes_only_its_batch_and_spelling_does_not_matter(lines, reference, tmp_path, monkeypatch):
    src = str(tmp_path / "lines")
    shutil.copytree(lines, src)
    out = str(tmp_path / "out")
    vae = Counting()
    build(os.path.join(src, "img"), out, encoder=vae)
    assert vae.calls == 1 + 3  # white column + 3 batches of 4
    monkeypatch.chdir(src)
    for spelling in ("img", "./img", os.path.join(src, "img"), "img/"):
        stats = {}
        build(spelling, out, encoder=vae, stats=stats)
        assert stats["up_to_date"] and vae.calls == 1 + 3 + 1, spelling  # only the white-column probe ran
        vae.calls -= 1
    # same size, new pixels: the old latents must not stay
    old = Image.open(os.path.join(src, "img", "005.png"))
    Image.fromarray(255 - np.asarray(old)).save(os.path.join(src, "img", "005.png"))
    stats = {}
    build("img", out, encoder=vae, stats=stats)
    assert stats["encoded_batches"] == 1
    fresh = str(tmp_path / "fresh")
    build(os.path.join(src, "img"), fresh)
    assert cache_files(out) == cache_files(fresh)
    assert not np.array_equal(LatentCache(out)[5].numpy(), LatentCache(reference)[5].numpy())


def test_rerun_over_a_corrupted_cache_repairs_it(lines, reference, tmp_path, capsys):
    out = str(tmp_path)
    shutil.copytree(reference, out, dirs_exist_ok=True)
    with open(cache_path(out, "train", "data"), "r+b") as fh:
        fh.seek(100)
        fh.write(b"\x12\x34")
    with pytest.raises(CacheCorruptError):
        verify_cache(out)
    vae = Counting()
    assert run_cli("build", "--manifest", os.path.join(lines, "lines.jsonl"), "--out", out, "--lines", "--line-height", "16",
                   "--max-line-width", "96", "--batch-size", "4", "--encoder", "test_cache_reliability:Counting") == 0
    assert "latent cache written" in capsys.readouterr().out
    assert cache_files(out) == cache_files(reference)
    assert verify_cache(out)["rows"] == 12
    del vae


# -- concurrent builds ------------------------------------------------------------------------------

def test_a_second_build_is_locked_out(lines, tmp_path, capsys):
    held = BuildLock(str(tmp_path), "train")
    with pytest.raises(CacheLockedError, match=rf"pid {os.getpid()}"):
        build(os.path.join(lines, "lines.jsonl"), str(tmp_path))
    assert run_cli("build", "--images", os.path.join(lines, "img"), "--out", str(tmp_path), "--lines", "--encoder", "toy",
                   "--line-height", "16", "--max-line-width", "96", "--quiet") == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "another build holds the lock" in err
    held.release()
    build(os.path.join(lines, "lines.jsonl"), str(tmp_path))


SLOW_BUILD = """
import os, sys, time
from latentfast.cache import build_latent_cache
from latentfast.toy import ToyVAE
class Slow(ToyVAE):
    def encode(self, images):  # says it is encoding (under the build lock), then waits for the file argv[4]
        open(sys.argv[4] + ".encoding", "w").close()
        deadline = time.monotonic() + 90
        while not os.path.exists(sys.argv[4]) and time.monotonic() < deadline:
            time.sleep(0.02)
        return super().encode(images)
build_latent_cache(Slow(), sys.argv[1], sys.argv[2], line_height=16, max_line_width=96, batch_size=6, layout=sys.argv[3], quiet=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_concurrent_builds_in_two_processes(lines, tmp_path):
    out = str(tmp_path / "out")
    manifest = os.path.join(lines, "lines.jsonl")
    release, unheld = str(tmp_path / "release"), str(tmp_path / "unheld")
    open(unheld, "w").close()  # (a second build that got the lock anyway would not wait: the assert says so)
    first = subprocess.Popen([sys.executable, "-c", SLOW_BUILD, manifest, out, "padded", release], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not os.path.exists(release + ".encoding") and time.monotonic() < deadline:
            time.sleep(0.02)
        second = subprocess.run([sys.executable, "-c", SLOW_BUILD, manifest, out, "ragged", unheld], capture_output=True,
                                text=True, timeout=60)
    finally:
        open(release, "w").close()  # the first build goes on only now, however slowly the second started
    assert second.returncode != 0 and "CacheLockedError" in second.stderr and f"pid {first.pid}" in second.stderr
    assert first.wait(timeout=90) == 0
    assert LatentCache(out).layout == "padded" and verify_cache(out)["rows"] == 12


# -- verify and inspect on malformed caches ---------------------------------------------------------

@pytest.mark.parametrize("checksum, message", [
    ({"algorithm": "crc32", "block_rows": 0}, "block_rows must be a positive integer"),
    ({"algorithm": "crc32"}, "block_rows must be a positive integer"),
    ({"block_rows": 4}, "unknown checksum algorithm None"),
    ("crc32", "checksum must be an object"),
])
def test_verify_reports_malformed_checksum_meta(reference, tmp_path, capsys, checksum, message):
    out = str(tmp_path)
    shutil.copytree(reference, out, dirs_exist_ok=True)
    meta_path = cache_path(out, "train", "meta")
    meta = json.load(open(meta_path))
    json.dump({**meta, "checksum": checksum}, open(meta_path, "w"))
    with pytest.raises(CacheCorruptError, match=message):
        verify_cache(out)
    assert run_cli("verify", out) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("verify FAILED") and message.split()[0] in err


def test_verify_reports_huge_geometries(tmp_path, capsys):
    folder = str(tmp_path)
    meta = dict(n=0, channels=4, latent_h=4, w_max=2**40, pretrained="x", subfolder="", line_height=32,
                max_line_width=8, downscale_factor=8)
    open(cache_path(folder, "train", "data"), "wb").close()
    np.save(cache_path(folder, "train", "widths"), np.zeros(0, np.int32))
    json.dump(meta, open(cache_path(folder, "train", "meta"), "w"))
    with pytest.raises(CacheCorruptError, match="not a plausible geometry"):
        verify_cache(folder)
    json.dump({**meta, "w_max": 2**20, "checksum": {"algorithm": "crc32", "block_rows": 2**40}}, open(cache_path(folder, "train", "meta"), "w"))
    np.save(cache_path(folder, "train", "checksums"), np.zeros(0, np.uint32))
    assert verify_cache(folder)["rows"] == 0  # an empty cache with a huge block size: no huge scratch buffer
    assert run_cli("verify", folder) == 0


def test_inspect_and_verify_without_a_cache_print_one_line(tmp_path, capsys):
    assert run_cli("inspect", str(tmp_path)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "does not exist (no cache for split 'train'" in err
    assert run_cli("verify", str(tmp_path / "nope")) == 1
    assert capsys.readouterr().err.count("\n") == 1


def test_build_failures_print_one_line(lines, tmp_path, capsys, monkeypatch):
    src = str(tmp_path / "img")
    shutil.copytree(os.path.join(lines, "img"), src)
    with open(os.path.join(src, "bad.png"), "wb") as fh:
        fh.write(b"not an image")
    common = ["--out", str(tmp_path / "out"), "--lines", "--encoder", "toy", "--line-height", "16", "--max-line-width", "96",
              "--quiet"]
    assert run_cli("build", "--images", src, *common) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.png" in err and "cannot read image" in err
    os.remove(os.path.join(src, "bad.png"))

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    assert run_cli("build", "--images", src, *common) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No space left on device" in err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_cli_failure_in_a_real_process_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "latentfast.cli", "cache", "build", "--images", str(tmp_path / "none"),
                           "--out", str(tmp_path / "out"), "--encoder", "toy"], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1
    assert "neither" in proc.stderr


def test_build_help_shows_every_default():
    import argparse

    parser = argparse.ArgumentParser(prog="latentfast")
    add_cache_subparsers(parser.add_subparsers(dest="command"))
    build_parser = parser._subparsers._group_actions[0].choices["cache"]._subparsers._group_actions[0].choices["build"]
    text = " ".join(build_parser.format_help().split())
    for action in build_parser._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, action.dest
            shown = action.default not in (None, False) and "default" not in action.help  # once, where there is one
            assert (f"{action.help} (default: {action.default})" in text) == shown, action.dest
            assert f"{action.help} (required)" in text or not action.required, action.dest
    assert "diffusers:PATH" in text and "--encoder ENCODER required: the VAE," in text


# -- a data file truncated under a reader --------------------------------------------------------------

TRUNCATE_SCRIPT = """
import os, sys
from latentfast.cache import LatentCache, read_batch, cache_path
from latentfast.errors import CacheCorruptError
cache = LatentCache(sys.argv[1])
cache.read_batch([0, 1])  # mapped and read
os.truncate(cache_path(sys.argv[1], "train", "data"), 64)  # another process truncates the file in place
for attempt in (lambda: cache[len(cache) - 1], lambda: read_batch(cache, [len(cache) - 1, 0]) if not cache.shaped
                else read_batch(cache, [len(cache) - 1])):
    try:
        attempt()
        print("read past the end")
    except CacheCorruptError as exc:
        print("refused:", "changed size" in str(exc))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["padded", "ragged", "shaped"])
def test_truncated_data_file_raises_instead_of_sigbus(tmp_path, kind):
    folder = str(tmp_path)
    if kind == "shaped":
        write(folder, random_items(40, shapes=[(4, 64, 64)]))
    else:
        rows, widths = random_rows(np.random.default_rng(0), 40, 4, 16, 512, min_width=500)
        write_cache(folder, rows, widths, w_max=512, layout=kind, white=np.zeros((4, 16, 1)))
    proc = subprocess.run([sys.executable, "-c", TRUNCATE_SCRIPT, folder], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])  # -7 would be SIGBUS
    assert proc.stdout.split("\n")[:2] == ["refused: True", "refused: True"]


# -- verify_rows --------------------------------------------------------------------------------------

def test_verify_rows_checks_the_rows_block_on_read(reference, tmp_path):
    out = str(tmp_path / "line")
    shutil.copytree(reference, out)
    shaped = str(tmp_path / "shaped")
    write(shaped, random_items(6))
    for folder, offset in ((out, 4), (shaped, 2 * 4 * 6 * 8 + 4)):  # row / item 0 of the line cache, item 1 of the shaped
        with open(cache_path(folder, "train", "data"), "r+b") as fh:
            fh.seek(offset)
            fh.write(b"\x11\x22")
    plain, checked = LatentCache(out), LatentCache(out, verify_rows=True)
    plain[0]  # no check asked: no error
    with pytest.raises(CacheCorruptError, match="block 0 .*CRC-32"):
        checked[0]
    with pytest.raises(CacheCorruptError, match="CRC-32"):
        read_batch(checked, [3, 0])
    items = LatentCache(shaped, verify_rows=True)
    assert torch.equal(items[0], LatentCache(shaped)[0])  # item 0 is intact (one block per item)
    with pytest.raises(CacheCorruptError, match="block 1 "):
        items[1]
    with pytest.raises(CacheCorruptError, match="block 1 "):
        items.read_batch([1, 3])
    rows, widths = random_rows(np.random.default_rng(0), 3, 4, 2, 5)
    seed = write_cache(str(tmp_path / "seed"), rows, widths, w_max=5)
    with pytest.raises(ValueError, match="stores no checksums"):
        LatentCache(seed.cache_dir, verify_rows=True)[0]
