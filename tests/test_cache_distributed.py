"""Distributed builds on spawned gloo ranks: images, video, lines and imports built by 2-3 ranks read
exactly as a single-process build (same keys, order, bytes; batches spanning shards); a rank SIGKILLed
mid-build loses nothing the others wrote and the rerun resumes each shard; a build of another world
size replaces the shards; a damaged manifest is refused and rewritten by a rerun; the CLI under torchrun."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from PIL import Image

from latentfast.cache import CacheCorruptError, IncompleteCacheError, LatentCache, cache_path
from latentfast.cache.builders.distributed import remove_other_worlds, shard_dir
from latentfast.cache.builders.images import build_image_cache, build_video_cache
from latentfast.cache.builders.importers import import_latents
from latentfast.cache.builders.lines import build_latent_cache
from latentfast.cache.store import shards as shardstore
from latentfast.cache.store.durable import BuildLock
from latentfast.testing import HOLD_ENV, progress_lines, spawn_gloo
from latentfast.toy import ToyVAE

BUCKETS = [(32, 32), (32, 48), (48, 32)]
SIZES = [(64, 48), (48, 64), (50, 50), (100, 40), (30, 70), (41, 39), (200, 60)]


def make_sources(root: str) -> dict:
    rng = np.random.default_rng(5)
    images = os.path.join(root, "images")
    os.makedirs(os.path.join(images, "sub"))
    for i in range(17):
        w, h = SIZES[i % len(SIZES)]
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(os.path.join(images, f"{'sub/' if i % 4 == 3 else ''}im{i:02d}.png"))
    lines = os.path.join(root, "lines")
    os.makedirs(lines)
    for i, w in enumerate(rng.integers(5, 120, size=23).tolist()):
        Image.fromarray(rng.integers(0, 256, (16, w, 3), dtype=np.uint8)).save(os.path.join(lines, f"l{i:02d}.png"))
    clips = os.path.join(root, "clips")
    for c in range(5):
        folder = os.path.join(clips, f"clip{c}")
        os.makedirs(folder)
        w, h = SIZES[c]
        for f in range(3 + c % 3):
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(os.path.join(folder, f"{f:03d}.png"))
    latents = os.path.join(root, "npz")
    os.makedirs(latents)
    for i in range(11):
        np.savez(os.path.join(latents, f"z{i:02d}.npz"), latents=rng.standard_normal((4, 2 + i % 3, 5)).astype(np.float32))
    return {"images": images, "lines": lines, "clips": clips, "npz": latents}


def build_all(sources: dict, out: str, group=None) -> None:
    """Every builder into ``out/<kind>`` (one process, or one rank of ``group``)."""
    vae = ToyVAE(seed=3)
    build_image_cache(vae, sources["images"], os.path.join(out, "images"), buckets=BUCKETS, batch_size=3, quiet=True, group=group)
    build_video_cache(vae, sources["clips"], os.path.join(out, "video"), buckets=[(2, 32, 32), (2, 32, 48), (4, 32, 48), (2, 48, 32)], quiet=True, group=group)
    build_latent_cache(vae, sources["lines"], os.path.join(out, "lines"), line_height=16, max_line_width=96, batch_size=4,
                       quiet=True, group=group)
    import_latents(sources["npz"], os.path.join(out, "npz"), format="npz", quiet=True, group=group)


def _rank_builds(rank: int, world: int, sources: dict, out: str):
    import torch.distributed as dist

    build_all(sources, out, group=dist.group.WORLD)
    return "ok"


def assert_same_cache(single: LatentCache, sharded: LatentCache) -> None:
    assert isinstance(sharded, shardstore.ShardedCache) and not isinstance(single, shardstore.ShardedCache)
    assert sharded.keys == single.keys and np.array_equal(sharded.shapes, single.shapes)
    for i in range(len(single)):
        assert torch.equal(sharded[i].view(torch.int16), single[i].view(torch.int16)), single.keys[i]
        assert sharded.info(i) == single.info(i)
    rng = np.random.default_rng(0)
    for _ in range(3):  # batches spanning shards
        if single.shaped:
            shape = single.shapes[rng.integers(len(single))]
            pool = np.flatnonzero((single.shapes == shape).all(axis=1))
        else:
            pool = np.arange(len(single))
        batch = rng.choice(pool, size=min(6, len(pool))).tolist()
        for x, y in zip(single.read_batch(batch), sharded.read_batch(batch)):
            assert torch.equal(x, y)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_three_ranks_build_what_one_process_builds(tmp_path):
    sources = make_sources(str(tmp_path / "src"))
    build_all(sources, str(tmp_path / "single"))
    assert spawn_gloo(_rank_builds, 3, sources, str(tmp_path / "dist"), timeout_s=120) == ["ok"] * 3
    for kind in ("images", "video", "lines", "npz"):
        single, sharded = LatentCache(str(tmp_path / "single" / kind)), LatentCache(str(tmp_path / "dist" / kind))
        assert_same_cache(single, sharded)
        used = [d for d in sharded.shard_dirs]
        assert len(used) >= 2, f"{kind}: the work went to one rank only"
        assert all(os.path.basename(d).endswith("-of-00003") for d in used)
    lines = LatentCache(str(tmp_path / "dist" / "lines"))
    assert lines.layout == "padded" and torch.equal(lines.white_column, LatentCache(str(tmp_path / "single" / "lines")).white_column)


def _rank_builds_bad_source(rank: int, world: int, images: str, out: str):
    import torch.distributed as dist

    from latentfast.errors import ImageError

    try:
        build_image_cache(ToyVAE(seed=3), images, out, buckets=BUCKETS, batch_size=3, quiet=True, group=dist.group.WORLD)
    except ImageError as exc:
        raised = str(exc)
    else:
        raised = None
    build_image_cache(ToyVAE(seed=3), images, out, buckets=BUCKETS, batch_size=3, quiet=True, skip_bad_images=True,
                      group=dist.group.WORLD)
    return raised


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_bad_image_fails_every_rank_alike_and_skips_alike(tmp_path):
    images = make_sources(str(tmp_path / "src"))["images"]
    with open(os.path.join(images, "im05.png"), "r+b") as fh:
        fh.truncate(60)  # probed by one rank only: the others learn of it in the exchange
    raised = spawn_gloo(_rank_builds_bad_source, 2, images, str(tmp_path / "dist"), timeout_s=120)
    assert all(r is not None and "im05" in r for r in raised), raised
    build_image_cache(ToyVAE(seed=3), images, str(tmp_path / "single"), buckets=BUCKETS, batch_size=3, quiet=True,
                      skip_bad_images=True)
    single, sharded = LatentCache(str(tmp_path / "single")), LatentCache(str(tmp_path / "dist"))
    assert "im05" not in sharded.keys and sharded.meta["skipped"] == single.meta["skipped"] and len(single.meta["skipped"]) == 1
    assert_same_cache(single, sharded)


def test_only_this_splits_shards_of_other_world_sizes_are_removed(tmp_path):
    names = ["train-00000-of-00003", "train-00002-of-00003", "train-00000-of-00002", "train-00001-of-00002",
             "train-a-00000-of-00003", "val-00000-of-00003", "train-00000-of-00003-00000-of-00002", "train-00000"]
    for name in names:
        os.makedirs(tmp_path / "shards" / name)
    removed = remove_other_worlds(tmp_path, "train", 2)
    assert sorted(os.path.basename(p) for p in removed) == ["train-00000-of-00003", "train-00002-of-00003"]
    assert sorted(os.listdir(tmp_path / "shards")) == sorted(set(names) - {"train-00000-of-00003", "train-00002-of-00003"})
    assert remove_other_worlds(tmp_path / "nothing", "train", 2) == []
    os.makedirs(tmp_path / "shards" / "train-00001-of-00004")
    with BuildLock(str(tmp_path / "shards" / "train-00001-of-00004"), "train"):  # a 4-rank build writing there now
        assert remove_other_worlds(tmp_path, "train", 2) == []
    assert [os.path.basename(p) for p in remove_other_worlds(tmp_path, "train", 2)] == ["train-00001-of-00004"]
    assert not [n for n in os.listdir(tmp_path / "shards") if n.startswith(".")]  # nothing left aside


def _rank_builds_splits(rank: int, world: int, images: str, out: str, splits: list):
    import torch.distributed as dist

    stats = {split: {} for split in splits}
    for split in splits:
        build_image_cache(ToyVAE(seed=3), images, out, split, buckets=BUCKETS, batch_size=3, quiet=True, stats=stats[split],
                          group=dist.group.WORLD)
    return stats


def file_mtimes(folders: list) -> dict:
    """``{path: mtime_ns}`` of every file in ``folders`` (a rerun that rewrites nothing leaves it equal)."""
    return {os.path.join(d, n): os.stat(os.path.join(d, n)).st_mtime_ns for d in folders for n in sorted(os.listdir(d))}


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_another_world_size_replaces_the_shards_and_a_damaged_manifest_is_rewritten_without_encoding(tmp_path):
    images, out = make_sources(str(tmp_path / "src"))["images"], str(tmp_path / "dist")
    shards = os.path.join(out, "shards")
    three = spawn_gloo(_rank_builds_splits, 3, images, out, ["train"], timeout_s=120)
    assert all(isinstance(r, dict) for r in three), three
    os.makedirs(os.path.join(shards, "val-00000-of-00003"))  # another split's (see the test above for the names)
    assert sorted(os.listdir(shards)) == [f"train-{r:05d}-of-00003" for r in range(3)] + ["val-00000-of-00003"]
    two = spawn_gloo(_rank_builds_splits, 2, images, out, ["train"], timeout_s=120)
    assert all(isinstance(r, dict) for r in two), two
    assert sorted(os.listdir(shards)) == [f"train-{r:05d}-of-00002" for r in range(2)] + ["val-00000-of-00003"], \
        "the 3-rank train shards go (nothing refers to them); the 2-rank ones and the other split's stay"
    build_image_cache(ToyVAE(seed=3), images, str(tmp_path / "single"), buckets=BUCKETS, batch_size=3, quiet=True)
    single = LatentCache(str(tmp_path / "single"))
    assert_same_cache(single, LatentCache(out))

    manifest, order = shardstore.manifest_path(out, "train"), shardstore.order_path(out, "train")
    good = open(manifest, "rb").read()
    for damaged in (good[: len(good) // 2], b'{"format": latentfast-shards}'):  # truncated; not JSON
        open(manifest, "wb").write(damaged)
        with pytest.raises(CacheCorruptError, match=re.escape(manifest)):
            LatentCache(out)
    open(manifest, "wb").write(good)
    payload = bytearray(open(order, "rb").read())
    payload[-1] ^= 0x01
    open(order, "wb").write(bytes(payload))
    with pytest.raises(CacheCorruptError, match=re.escape(order)):
        LatentCache(out)
    open(manifest, "wb").write(good[:-7])  # both damaged for the rerun
    folders = [shard_dir(out, "train", r, 2) for r in range(2)]
    before = file_mtimes(folders)
    again = spawn_gloo(_rank_builds_splits, 2, images, out, ["train"], timeout_s=120)
    assert all(r["train"]["unchanged"] and r["train"]["encoded"] == 0 for r in again), again
    assert file_mtimes(folders) == before, "the rerun rewrote a shard"
    assert_same_cache(single, LatentCache(out))


RANK_SCRIPT = r"""
import datetime, sys
import torch.distributed as dist
from latentfast.cache.builders.images import build_image_cache
from latentfast.testing import hold_when
from latentfast.toy import ToyVAE

rank, world, store, src, out, hold = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6])

class Slow(ToyVAE):
    encoded = 0
    def encode(self, images):
        hold_when(rank == 1 and Slow.encoded == hold)
        Slow.encoded += images.shape[0]
        return super().encode(images)

dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
try:
    build_image_cache(Slow(seed=3), src, out, buckets=[(32, 32), (32, 48), (48, 32)], batch_size=1, quiet=True, group=dist.group.WORLD)
finally:
    print("encoded", Slow.encoded, flush=True)
    dist.destroy_process_group()
"""


def _start_ranks(script, tmp_path, src, out, run, hold, env=None):
    store = str(tmp_path / f"store{run}")
    return [subprocess.Popen([sys.executable, "-c", script, str(r), "2", store, src, out, str(hold)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for r in range(2)]


def kill_rank_and_rerun(script: str, tmp_path, src: str, out: str) -> tuple[int, int, list[int]]:
    """Run ``script`` as 2 ranks (argv: rank, world, store, src, out, the item before which rank 1 holds;
    it prints the items it wrote last), SIGKILL rank 1 while it holds before its 4th item, once rank 0's
    shard is complete and rank 1's logged at least 2 items; check rank 0 fails and the folder does not
    open, rerun both to completion. Returns (items in rank 0's shard, items rank 1 had logged, items each
    rank wrote in the rerun)."""
    marker = str(tmp_path / "held")
    ranks = _start_ranks(script, tmp_path, src, out, 0, hold=3, env=dict(os.environ, **{HOLD_ENV: marker}))
    progress = os.path.join(shard_dir(out, "train", 1, 2), "train.latents.progress")
    first_meta = cache_path(shard_dir(out, "train", 0, 2), "train", "meta")
    deadline = time.monotonic() + 600  # a hang guard only
    while not (os.path.exists(marker) and os.path.exists(first_meta) and progress_lines(progress) >= 3):
        assert ranks[1].poll() is None and time.monotonic() < deadline, ranks[1].communicate()
        time.sleep(0.02)
    ranks[1].send_signal(signal.SIGKILL)
    ranks[1].wait()
    ranks[0].communicate(timeout=600)
    assert ranks[1].returncode == -signal.SIGKILL and ranks[0].returncode != 0  # rank 0 learns its peer died
    first = LatentCache(shard_dir(out, "train", 0, 2))  # rank 0's shard: complete
    logged = progress_lines(progress) - 1
    assert len(first) > 0 and 2 <= logged <= 3
    with pytest.raises(IncompleteCacheError, match="manifest"):
        LatentCache(out)
    ranks = _start_ranks(script, tmp_path, src, out, 1, hold=-1)
    outputs = [p.communicate(timeout=600) for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outputs
    return len(first), logged, [int(o.split()[-1]) for o, _ in outputs]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a hang guard only
def test_a_sigkilled_rank_loses_nothing_the_others_wrote_and_the_rerun_resumes(tmp_path):
    src = make_sources(str(tmp_path / "src"))["images"]
    out = str(tmp_path / "out")
    first, logged, encoded = kill_rank_and_rerun(RANK_SCRIPT, tmp_path, src, out)
    assert encoded[0] == 0, "rank 0's finished shard is kept, not encoded again"
    assert encoded[1] == 17 - first - logged, "rank 1 encodes only what its log does not hold"
    single = str(tmp_path / "single")
    build_image_cache(ToyVAE(seed=3), src, single, buckets=BUCKETS, batch_size=1, quiet=True)
    assert_same_cache(LatentCache(single), LatentCache(out))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_distributed_build_under_torchrun(tmp_path):
    src = make_sources(str(tmp_path / "src"))["lines"]
    out = str(tmp_path / "out")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "latentfast",
           "cache", "build", "--images", src, "--out", out, "--lines", "--line-height", "16", "--max-line-width", "96",
           "--encoder", "toy", "--batch-size", "4", "--distributed", "--quiet"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    single = str(tmp_path / "single")
    build_latent_cache(ToyVAE(), src, single, line_height=16, max_line_width=96, batch_size=4, quiet=True)
    assert_same_cache(LatentCache(single), LatentCache(out))
