"""Distributed imports of trainers' cache folders on spawned gloo ranks: kohya, musubi-tuner (detected by
``auto``) and diffusion-pipe folders, written as the trainers write them, imported by 3 ranks read
exactly as a one-process import (same keys, order, fields, info); a rerun writes nothing; ranks of
other folders or encoders, or a manifest rank 0 cannot write, fail every rank alike; a
rank SIGKILLed mid-import loses nothing the other wrote and the rerun resumes; ``latentfast cache
import --distributed`` under torchrun."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from test_cache_distributed import file_mtimes, kill_rank_and_rerun

from latentfast.cache import IncompleteCacheError, LatentCache
from latentfast.cache.builders.distributed import shard_dir
from latentfast.cache.builders.importers import import_latents
from latentfast.cache.store import shards as shardstore
from latentfast.cache.trainers import fixtures
from latentfast.testing import spawn_gloo

RUNS = (("kohya", "kohya"), ("musubi", "auto"), ("dp", "diffusion-pipe"))


def make_folders(root: str) -> dict:
    folders = {name: os.path.join(root, name) for name in ("kohya", "kohya_sd", "musubi", "dp")}
    fixtures.write_kohya(folders["kohya"], arch="flux", n=4)  # two resolutions per image: keys img_000@8x8, ...
    with open(os.path.join(folders["kohya"], "notes.txt"), "w") as fh:  # listed as skipped, alike on every rank
        fh.write("not a cache file\n")
    fixtures.write_kohya(folders["kohya_sd"], arch="sd", n=3)  # keys img_000.. as musubi's below
    fixtures.write_musubi(folders["musubi"], n=3)  # latents, image latents, clip and text-encoder files
    fixtures.write_diffusion_pipe(folders["dp"], n=3)
    os.makedirs(os.path.join(root, "npz"))
    for i in range(3):
        np.savez(os.path.join(root, "npz", f"z{i}.npz"), latents=np.full((4, 2, 3), i, dtype=np.float32))
    return {**folders, "npz": os.path.join(root, "npz")}


def test_a_part_of_a_source_keeps_the_whole_folders_keys_and_description(tmp_path):
    from latentfast.cache.trainers import open_source

    fixtures.write_kohya(str(tmp_path), arch="flux", n=2)
    open(tmp_path / "notes.txt", "w").write("x")
    whole = open_source(str(tmp_path), "auto")
    part = whole.only(["img_001@16x24", "img_000@8x8"])
    assert part.keys == ["img_000@8x8", "img_001@16x24"]  # the whole folder's order and keys (not "img_000")
    assert [r.key for r in part] == part.keys and len(part) == 2 and len(whole) == 4
    assert part.item_bytes == [b for k, b in zip(whole.keys, whole.item_bytes) if k in part.keys]
    assert (part.format, part.evidence, part.skipped, part.convention) == (whole.format, whole.evidence, whole.skipped, whole.convention)
    for got, want in zip(part, (r for r in whole if r.key in part.keys)):
        assert got.info == want.info and all(fixtures.same_bits(got.fields[n], want.fields[n]) for n in want.fields)
    with pytest.raises(KeyError, match="no item 'img_009'"):
        whole.only(["img_009"])


def _rank_imports(rank: int, world: int, folders: dict, out: str):
    import torch.distributed as dist

    from latentfast.errors import InvalidArgumentError

    result = {}
    for kind, format in RUNS:
        target, stats, again = os.path.join(out, kind), {}, {}
        import_latents(folders[kind], target, format=format, quiet=True, stats=stats, group=dist.group.WORLD)
        mine = shard_dir(target, "train", rank, world)
        before = file_mtimes([mine]) if os.path.isdir(mine) else None
        import_latents(folders[kind], target, format=format, quiet=True, stats=again, group=dist.group.WORLD)
        result[kind] = (stats, again, before, file_mtimes([mine]) if os.path.isdir(mine) else None)
    try:  # the same keys, but rank 0 (and 2) read a kohya folder, rank 1 a musubi-tuner one: refused before reading
        import_latents(folders["kohya_sd" if rank % 2 == 0 else "musubi"], os.path.join(out, "mixed"), format="auto",
                       quiet=True, group=dist.group.WORLD)
    except InvalidArgumentError as exc:
        result["mixed"] = str(exc)
    try:  # other encoders: refused alike before anything is written
        import_latents(folders["npz"], os.path.join(out, "stamps"), format="npz", encoder={"vae": rank}, quiet=True,
                       group=dist.group.WORLD)
    except Exception as exc:  # noqa: BLE001 - compared in the test
        result["stamps"] = f"{type(exc).__name__}: {exc}"
    real = shardstore.write_manifest
    if rank == 0:  # rank 0's manifest write fails (a full disk): every rank hears of it
        shardstore.write_manifest = lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    try:
        import_latents(folders["npz"], os.path.join(out, "manifest"), format="npz", quiet=True, group=dist.group.WORLD)
    except Exception as exc:  # noqa: BLE001 - the type differs by rank: compared in the test
        result["manifest"] = f"{type(exc).__name__}: {exc}"
    finally:
        shardstore.write_manifest = real
    return result


def assert_same_records(single: LatentCache, sharded: LatentCache) -> None:
    assert isinstance(sharded, shardstore.ShardedCache) and not isinstance(single, shardstore.ShardedCache)
    assert sharded.keys == single.keys and list(sharded.fields) == list(single.fields)
    for k in ("import_format", "latent_convention", "source"):
        assert sharded.meta.get(k) == single.meta.get(k), k
    for i in range(len(single)):
        want, got = single.record(i), sharded.record(i)
        assert list(got) == list(want), single.keys[i]
        assert all(fixtures.same_bits(got[name], want[name]) for name in want), single.keys[i]
        assert sharded.info(i) == single.info(i), single.keys[i]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_three_ranks_import_what_one_process_imports_and_a_rerun_writes_nothing(tmp_path):
    folders = make_folders(str(tmp_path / "src"))
    results = spawn_gloo(_rank_imports, 3, folders, str(tmp_path / "dist"), timeout_s=120)
    assert all(isinstance(r, dict) for r in results), results
    for kind, format in RUNS:
        target, stats = str(tmp_path / "single" / kind), {}
        import_latents(folders[kind], target, format=format, quiet=True, stats=stats)
        single, sharded = LatentCache(target), LatentCache(str(tmp_path / "dist" / kind))
        assert_same_records(single, sharded)
        assert len(sharded.shard_dirs) == 3, f"{kind}: every rank imports a share"
        firsts = [r[kind][0] for r in results]
        assert sum(s["imported"] for s in firsts) == len(single) and not any(s["unchanged"] for s in firsts)
        for key in ("format", "evidence", "summary", "skipped"):  # the whole folder, on every rank
            assert all(s[key] == stats[key] for s in firsts), (kind, key)
        for rank, (_, again, before, after) in enumerate(r[kind] for r in results):
            assert again["unchanged"] and again["imported"] == 0, (kind, rank, again)
            assert before is not None and after == before, f"{kind}: rank {rank}'s rerun rewrote its shard"
    assert stats_of(results, "musubi")[0]["evidence"].startswith("detected musubi-tuner")
    assert any("notes.txt" in path for path, _ in stats_of(results, "kohya")[0]["skipped"])
    for rank, r in enumerate(results):
        assert r["mixed"] == results[0]["mixed"] and "source listing" in r["mixed"], (rank, r["mixed"])
        assert r["stamps"] == results[0]["stamps"] and "encoder: rank 0 {'vae': 0}; rank 1 {'vae': 1}" in r["stamps"], r["stamps"]
    assert not os.path.exists(tmp_path / "dist" / "mixed") and not os.path.exists(tmp_path / "dist" / "stamps")
    assert results[0]["manifest"] == "OSError: [Errno 28] No space left on device", results[0]["manifest"]
    for r in results[1:]:
        assert r["manifest"].startswith("CacheError: distributed build of") and "rank 0 could not write the manifest" in r["manifest"], r["manifest"]
    with pytest.raises(IncompleteCacheError):
        LatentCache(str(tmp_path / "dist" / "manifest"))


def stats_of(results, kind):
    return [r[kind][0] for r in results]


RANK_SCRIPT = r"""
import datetime, sys
import torch.distributed as dist
from latentfast.cache.builders import importers
from latentfast.testing import hold_when

rank, world, store, src, out, hold = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6])
appended, append = 0, importers.LatentCacheWriter.append

def slow_append(self, *args, **kwargs):
    global appended
    hold_when(rank == 1 and appended == hold)
    appended += 1
    append(self, *args, **kwargs)
    if rank == 1:
        self.flush()  # each item durable (imports flush every 64): the log holds what was appended when killed

importers.LatentCacheWriter.append = slow_append
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=30))
try:
    importers.import_latents(src, out, format="kohya", quiet=True, group=dist.group.WORLD)
finally:
    print("appended", appended, flush=True)
    dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(1200)  # a hang guard only
def test_a_sigkilled_rank_loses_nothing_the_other_imported_and_the_rerun_resumes(tmp_path):
    src, out = str(tmp_path / "kohya"), str(tmp_path / "out")
    fixtures.write_kohya(src, arch="flux", n=6)  # 12 items
    first, logged, appended = kill_rank_and_rerun(RANK_SCRIPT, tmp_path, src, out)
    assert appended[0] == 0, "rank 0's finished shard is kept, not imported again"
    assert appended[1] == 12 - first - logged, "rank 1 imports only what its log does not hold"
    single = str(tmp_path / "single")
    import_latents(src, single, format="kohya", quiet=True)
    assert_same_records(LatentCache(single), LatentCache(out))


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_distributed_import_under_torchrun(tmp_path):
    src, out = str(tmp_path / "dp"), str(tmp_path / "out")
    fixtures.write_diffusion_pipe(src, n=3)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "latentfast",
           "cache", "import", src, "--out", out, "--format", "auto", "--distributed"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    single, stats = str(tmp_path / "single"), {}
    import_latents(src, single, format="auto", quiet=True, stats=stats)
    assert_same_records(LatentCache(single), LatentCache(out))
    printed = done.stdout.splitlines()
    assert printed.count(stats["summary"]) == 1, done.stdout  # rank 0 says it once, for the whole folder
    assert f"{len(LatentCache(single))} items imported, 0 resumed by 2 ranks" in done.stdout, done.stdout
