"""Scale-out: distributed builds over N gloo ranks and sharded reads.

**Distributed build.** An image cache built by N = 1, 2, 4 spawned gloo ranks
(:func:`latentfast.cache.build_image_cache` with ``group=``) into a fresh folder per run. The encoder
is the toy VAE plus an idle wait of ``SECONDS_PER_MPIXEL`` per megapixel encoded, standing in for a GPU
encode during which the host CPU is free (as bench_balance does): on this shared 2-core host 4 ranks
cannot each have a core for real compute. Throughput = items / wall time of the build, barrier to
barrier inside the group (process start, imports and one warm-up build excluded; planning, decode,
writes and the manifest included). Target: N ranks >= 0.9 x N x one rank's throughput. The "skewed" source has a
few 4x-area images among small ones (16x the encode cost each): each rank's encode wait (the sum
of its waits) against the mean over ranks; target: slowest <= 1.1 x mean.

**Sharded read.** Random batches of 64 ``[4, 32, 32]`` float16 latents (8 KiB each) from a cache of
``ITEMS`` items, read with ``read_batch`` from one cache vs the same items as 8 shards (a merged
cache: one gather call over 8 sources); the two are timed round-robin (interleaved medians), both
from the page cache, both allocating their output. Target: sharded >= 0.9 x one cache's rate.

**Opening shards.** One cache of ``OPEN_ITEMS`` ``[4, 8, 8]`` float16 latents (with keys) against the
same items as 8 and as 1,000 shards (``write_manifest`` over caches written by ``LatentCacheWriter``),
page cache hot, opened in one process round-robin: ``LatentCache(dir)`` alone, and open + the first
``read_batch`` of 64 random items (which opens every shard's index: the batch's widths and shapes come
from the joined tables); plus the file descriptors the process holds after the open and after 16
batches. Targets (issues 32, 33): 8 shards <= 2x one cache's open, 1,000 shards <= 2 s.

Every figure: median and range over ``ROUNDS`` runs.

    python -m latentfast.bench.bench_scale [--quick] [--only open]   # side-by-side report
    pytest latentfast/bench/bench_scale.py --benchmark-only
"""
from __future__ import annotations

import gc
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import pytest
import torch

from latentfast.bench.common import format_table, interleaved_median_seconds, machine_summary
from latentfast.toy import ToyVAE

SECONDS_PER_MPIXEL = 50.0  # a 32x32 image waits ~51 ms, a 64x64 one ~205 ms
ROUNDS = 3
ITEMS = 4096
OPEN_ITEMS = 8000
OPEN_SHARDS = (8, 1000)
BUCKETS = [(32, 32), (64, 64)]


class WaitingVAE(ToyVAE):
    """The toy VAE plus an idle wait proportional to the pixels encoded (a GPU encode's time)."""

    waited = 0.0

    def encode(self, images):
        seconds = SECONDS_PER_MPIXEL * images[0].numel() / 3 * images.shape[0] / 1e6
        time.sleep(seconds)
        WaitingVAE.waited += seconds
        return super().encode(images)


def make_images(folder: str, n: int, skewed: bool) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    os.makedirs(folder, exist_ok=True)
    for i in range(n):
        big = skewed and i % 8 == 0  # one in eight images four times the area
        side = 64 if big else 32
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(os.path.join(folder, f"im{i:04d}.png"))


def _rank_builds(rank: int, world: int, source: str, root: str, rounds: int) -> list[dict]:
    import torch.distributed as dist

    from latentfast.cache.builders.images import build_image_cache

    runs = []
    for r in range(-1, rounds):  # round -1 warms up (first imports, the encoder's first call), not counted
        WaitingVAE.waited = 0.0
        dist.barrier()
        start = time.perf_counter()
        build_image_cache(WaitingVAE(), source, os.path.join(root, f"run{r + 1}"), buckets=BUCKETS, batch_size=4, quiet=True,
                          num_workers=1, group=dist.group.WORLD)
        dist.barrier()
        runs.append({"wall_s": time.perf_counter() - start, "waited_s": WaitingVAE.waited})
    return runs[1:]


def distributed_build(n_items: int, skewed: bool, worlds=(1, 2, 4), rounds: int = ROUNDS) -> dict:
    from latentfast.testing import spawn_gloo

    out = {}
    with tempfile.TemporaryDirectory(prefix="latentfast_scale_") as tmp:
        source = os.path.join(tmp, "images")
        make_images(source, n_items, skewed)
        for world in worlds:
            per_rank = spawn_gloo(_rank_builds, world, source, os.path.join(tmp, f"w{world}"), rounds, timeout_s=300)
            for result in per_rank:
                if isinstance(result, BaseException):
                    raise result
            walls = [max(per_rank[k][r]["wall_s"] for k in range(world)) for r in range(rounds)]
            waits = [[per_rank[k][r]["waited_s"] for k in range(world)] for r in range(rounds)]
            out[world] = {"items_per_s": [n_items / w for w in walls],
                          "slowest_over_mean": [max(w) / statistics.mean(w) for w in waits]}
    return out


def sharded_read(items: int = ITEMS, shards: int = 8, rounds: int = ROUNDS, repeat: int = 15) -> dict:
    from latentfast.cache import LatentCache, LatentCacheWriter
    from latentfast.cache.store.shards import merge_caches

    gen = torch.Generator().manual_seed(0)
    latents = torch.randn((items, 4, 32, 32), generator=gen).half()
    with tempfile.TemporaryDirectory(prefix="latentfast_shards_") as tmp:
        with LatentCacheWriter(os.path.join(tmp, "one")) as writer:
            for i in range(items):
                writer.append(f"k{i:05d}", latents[i])
        parts = []
        for s, cut in enumerate(np.array_split(np.arange(items), shards)):
            parts.append(os.path.join(tmp, f"part{s}"))
            with LatentCacheWriter(parts[-1]) as writer:
                for i in cut.tolist():
                    writer.append(f"k{i:05d}", latents[i])
        merge_caches(parts, os.path.join(tmp, "sharded"))
        one, many = LatentCache(os.path.join(tmp, "one")), LatentCache(os.path.join(tmp, "sharded"))
        rng = np.random.default_rng(1)
        batches = [rng.integers(0, items, 64) for _ in range(64)]
        for b in batches[:4]:
            assert torch.equal(one.read_batch(b)[0], many.read_batch(b)[0])
        ratios, rates = [], []
        for _ in range(rounds):
            state = {"k": 0}

            def reader(cache):
                def read():
                    state["k"] = (state["k"] + 1) % len(batches)
                    cache.read_batch(batches[state["k"]])
                return read

            t = interleaved_median_seconds({"one": reader(one), "sharded": reader(many)}, repeat=repeat, warmup=3, min_time=0.02)
            rates.append({name: 64 / s for name, s in t.items()})
            ratios.append(t["one"] / t["sharded"])
    return {"ratio": ratios, "items_per_s": rates, "shards": shards, "items": items}


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def shard_open(items: int = OPEN_ITEMS, shard_counts=OPEN_SHARDS, rounds: int = ROUNDS, repeat: int = 5) -> dict:
    """Seconds to open one cache of ``items`` and the same items as each of ``shard_counts`` shards (and to
    open and read a first batch), and the descriptors held; see the module."""
    from latentfast.cache import LatentCache, LatentCacheWriter
    from latentfast.cache.store.shards import write_manifest

    latents = torch.randn((items, 4, 8, 8), generator=torch.Generator().manual_seed(0)).half()
    keys = [f"k{i:06d}" for i in range(items)]
    batch = np.random.default_rng(2).choice(items, 64, replace=False)
    with tempfile.TemporaryDirectory(prefix="latentfast_open_") as tmp:
        folders = {"one cache": os.path.join(tmp, "one")}
        with LatentCacheWriter(folders["one cache"]) as writer:
            writer.append_many(keys, latents)
        for count in shard_counts:
            parts = []
            for s, cut in enumerate(np.array_split(np.arange(items), count)):
                parts.append(os.path.join(tmp, f"s{count}", "shards", f"{s:05d}"))
                with LatentCacheWriter(parts[-1]) as writer:
                    writer.append_many([keys[i] for i in cut.tolist()], latents[cut])
            write_manifest(os.path.join(tmp, f"s{count}"), "train", parts)
            folders[f"{count} shards"] = os.path.join(tmp, f"s{count}")
        want = LatentCache(folders["one cache"]).read_batch(batch)[0]
        for name, folder in folders.items():  # (each once first: the same items, and the page cache hot)
            assert torch.equal(LatentCache(folder).read_batch(batch)[0], want), name
        opened = {name: [] for name in folders}
        first = {name: [] for name in folders}
        fds = {}
        for _ in range(rounds):
            for name, folder in folders.items():  # round-robin: every config sees the same load
                times, firsts = [], []
                for _ in range(repeat):
                    start = time.perf_counter()
                    cache = LatentCache(folder)
                    times.append(time.perf_counter() - start)
                    cache.read_batch(batch)
                    firsts.append(time.perf_counter() - start)
                    del cache
                opened[name].append(statistics.median(times))
                first[name].append(statistics.median(firsts))
        for name, folder in folders.items():
            gc.collect()  # (the caches opened above let go of their descriptors first)
            before = _open_fds()
            cache = LatentCache(folder)
            after_open = _open_fds() - before
            rng = np.random.default_rng(3)
            for _ in range(16):
                cache.read_batch(rng.choice(items, 64, replace=False))
            fds[name] = {"after_open": after_open, "after_16_batches": _open_fds() - before}
            del cache
    return {"items": items, "open_s": opened, "open_and_batch_s": first, "fds": fds,
            "ratio_8_over_one": [a / b for a, b in zip(opened.get("8 shards", []), opened["one cache"])]}


def _spread(values) -> str:
    return f"{statistics.median(values):.3g} [{min(values):.3g}-{max(values):.3g}]"


def report_shard_open(quick: bool = False) -> dict:
    result = shard_open(shard_counts=(8, 100) if quick else OPEN_SHARDS)
    load = os.getloadavg()[0]
    one = statistics.median(result["open_s"]["one cache"])
    rows = [[name, _spread([1e3 * x for x in result["open_s"][name]]), _spread([x / one for x in result["open_s"][name]]),
             _spread([1e3 * x for x in result["open_and_batch_s"][name]]),
             f"{result['fds'][name]['after_open']}, {result['fds'][name]['after_16_batches']}"] for name in result["open_s"]]
    print(format_table(
        f"LatentCache(dir) of {result['items']} [4, 8, 8] f16 items with keys, as one cache and as shards (page cache hot; "
        f"median [range] of {ROUNDS} rounds of 5 opens; host load average {load:.1f})",
        ["cache", "open ms", "/ one cache's (8 shards: target <= 2)", "open + first batch of 64, ms",
         "fds held after open, after 16 batches"], rows))
    return {"machine": {**machine_summary(), "load_average_1min": load}, "shard_open": result}


def run_report(quick: bool = False) -> dict:
    if "--only" in sys.argv and sys.argv[sys.argv.index("--only") + 1] == "open":
        return report_shard_open(quick)
    opening = report_shard_open(quick)
    n_items = 48 if quick else 96
    rounds = ROUNDS
    builds = {"uniform": distributed_build(n_items, False, rounds=rounds), "skewed": distributed_build(n_items, True, rounds=rounds)}
    load = os.getloadavg()[0]
    rows = []
    for case, by_world in builds.items():
        base = statistics.median(by_world[1]["items_per_s"])
        for world, r in by_world.items():
            scaling = [x / base / world for x in r["items_per_s"]]
            rows.append([case, world, _spread(r["items_per_s"]), _spread(scaling), _spread(r["slowest_over_mean"])])
    print(format_table(
        f"distributed image build, {n_items} images, toy VAE + {SECONDS_PER_MPIXEL:g} s/Mpixel idle wait, gloo ranks "
        f"(median [range] of {rounds} runs; host load average {load:.1f})",
        ["source", "ranks", "items/s", "items/s / (N x 1 rank's) (target >= 0.9)", "slowest rank's wait / mean (target <= 1.1)"], rows))
    read = sharded_read(rounds=rounds, repeat=7 if quick else 15)
    load = os.getloadavg()[0]
    print(format_table(
        f"read_batch of 64 random [4, 32, 32] f16 items from {read['items']} (page cache; median [range] of {rounds} rounds; "
        f"host load average {load:.1f})",
        ["cache", "items/s", "vs one shard (target >= 0.9)"],
        [["1 shard", _spread([r["one"] for r in read["items_per_s"]]), "1"],
         [f"{read['shards']} shards", _spread([r["sharded"] for r in read["items_per_s"]]), _spread(read["ratio"])]]))
    summary = {}
    for case, by_world in builds.items():
        base = statistics.median(by_world[1]["items_per_s"])
        for world, r in by_world.items():
            summary[f"build_scaling[{case},{world}]"] = round(statistics.median(r["items_per_s"]) / base / world, 3)
            summary[f"slowest_over_mean[{case},{world}]"] = round(statistics.median(r["slowest_over_mean"]), 3)
    summary["sharded_read_over_one_shard"] = round(statistics.median(read["ratio"]), 3)
    summary["open_8_shards_over_one_cache"] = round(statistics.median(opening["shard_open"]["ratio_8_over_one"]), 3)
    return {"machine": {**machine_summary(), "load_average_1min": load}, "builds": builds, "sharded_read": read,
            "shard_open": opening["shard_open"], "summary": summary}


@pytest.mark.parametrize("world", [1, 2])
def test_distributed_build(benchmark, world):
    result = benchmark.pedantic(lambda: distributed_build(16, False, worlds=(world,), rounds=1), rounds=1, iterations=1)
    benchmark.extra_info["items_per_s"] = result[world]["items_per_s"][0]


def test_shard_open(benchmark):
    result = benchmark.pedantic(lambda: shard_open(items=800, shard_counts=(8, 100), rounds=1, repeat=3), rounds=1, iterations=1)
    benchmark.extra_info["ratio_8_over_one"] = result["ratio_8_over_one"][0]


def test_sharded_read(benchmark):
    result = benchmark.pedantic(lambda: sharded_read(items=1024, rounds=1, repeat=5), rounds=1, iterations=1)
    benchmark.extra_info["ratio"] = result["ratio"][0]


if __name__ == "__main__":
    run_report(quick="--quick" in sys.argv)
