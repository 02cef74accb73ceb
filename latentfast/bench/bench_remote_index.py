"""What opening a cache in object storage and its first keyed batch fetch, before and after the index is
read by range (issue 33).

Caches of N = 10^5 and 10^6 tiny items (``[4, 1, 1]`` float16, keys ``item{i:09d}``, written with
:class:`~latentfast.cache.LatentCacheWriter`) are pushed to a loopback moto S3 server
(``latentfast.testing.s3_server``). Each code tree named by ``--trees`` (default: this checkout, and
``--before`` when given, e.g. ``/work/main``) is measured in fresh Python processes that import the
package from that tree, side by side against the same server and caches, a fresh empty local chunk
folder every run:

- **open ms**: wall time of ``LatentCache("s3://...")`` straight to the server;
- **GETs / MB at open**, **GETs / MB at the first keyed batch** (``read_batch`` of 64 random items with
  ``return_keys=True``, after the open): counted by a recording proxy (``latentfast.testing.FaultProxy``
  with ``whole_gets``: every GET but listings), in a second cold open through it. HEADs and the LIST
  are not GETs and are not counted; the proxy's own latency is not in ``open ms``.

- **8 shards / one cache, open**: the same N items as 8 shards of N/8 (a manifest over 8 caches, pushed
  beside it), ``LatentCache("s3://...")`` of each timed cold, alternately, ``OPENS`` times each in one
  process; the run's ratio is the two medians' (issue 32's target: <= 2).

Median and [range] of ``runs`` runs per figure.

    python -m latentfast.bench.bench_remote_index --before /work/main [--sizes 1e5,1e6] [--runs 3]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

BATCH = 64
BUCKET = "bench"
SHARDS = 8
OPENS = 5  # cold opens of each cache per run for the shards' open ratio


def key_of(i: int) -> str:
    return f"item{i:09d}"


def write_tiny(folder: str, n: int, first: int = 0) -> None:
    """A cache of ``n`` tiny items, keyed from item ``first`` on."""
    from latentfast.cache import LatentCacheWriter

    batch = np.zeros((4096, 4, 1, 1), np.float16)
    with LatentCacheWriter(folder, "train", flush_every=1 << 16) as writer:
        for s in range(first, first + n, 4096):
            keys = [key_of(i) for i in range(s, min(first + n, s + 4096))]
            writer.append_many(keys, batch[: len(keys)])


def write_sharded(root: str, n: int) -> None:
    """``n`` tiny items as :data:`SHARDS` shards of ``n / SHARDS`` under ``root/shards``, with a manifest."""
    from latentfast.cache.store.shards import write_manifest

    dirs = [os.path.join(root, "shards", f"train-{k:05d}") for k in range(SHARDS)]
    for k, d in enumerate(dirs):
        write_tiny(d, n // SHARDS, k * (n // SHARDS))
    write_manifest(root, "train", dirs)


def _fetched(gets, folder: str) -> tuple[int, int]:
    """(GETs, bytes) of the proxy's records (a whole GET: the object's size in ``folder``)."""
    total = 0
    for path, byte_range in gets:
        if byte_range is None:
            total += os.path.getsize(os.path.join(folder, path.rsplit("/", 1)[1]))
        else:
            a, b = (int(x) for x in byte_range.split("=")[1].split("-"))
            total += b + 1 - a
    return len(gets), total


def open_ratio(endpoint: str, url: str, sharded_url: str, scratch: str) -> float:
    """Median cold open of the sharded cache / of the one cache, opened alternately :data:`OPENS` times each."""
    from latentfast.cache import LatentCache
    from latentfast.testing import s3_options

    times = {url: [], sharded_url: []}
    for k in range(OPENS):
        for where in times:
            start = time.perf_counter()
            LatentCache(where, storage_options=s3_options(endpoint), local_cache=os.path.join(scratch, f"o{k}{len(times[where])}{hash(where)}"),
                        local_cache_bytes=1 << 34)
            times[where].append(time.perf_counter() - start)
    return statistics.median(times[sharded_url]) / statistics.median(times[url])


def child(endpoint: str, url: str, folder: str, seed: int) -> dict:
    """One run in this process (the package imported from PYTHONPATH): a timed open, then a counted one."""
    from latentfast.cache import LatentCache, read_batch
    from latentfast.testing import FaultProxy, s3_options

    scratch = tempfile.mkdtemp(prefix="lf-idx-")
    try:
        LatentCache(url, storage_options=s3_options(endpoint), local_cache=os.path.join(scratch, "warmup"), local_cache_bytes=1 << 34)
        start = time.perf_counter()  # (imports and the client warmed up above, on another local folder)
        cache = LatentCache(url, storage_options=s3_options(endpoint), local_cache=os.path.join(scratch, "a"), local_cache_bytes=1 << 34)
        open_s = time.perf_counter() - start
        n = len(cache)
        with FaultProxy(endpoint, whole_gets=True) as proxy:
            cache = LatentCache(url, storage_options=s3_options(proxy.endpoint), local_cache=os.path.join(scratch, "b"),
                                local_cache_bytes=1 << 34)
            at_open = _fetched(proxy.gets, folder)
            proxy.gets.clear()
            picked = np.random.default_rng(seed).integers(0, n, BATCH)
            start = time.perf_counter()
            keys = read_batch(cache, picked, return_keys=True)[2]
            batch_s = time.perf_counter() - start
            if keys != [key_of(i) for i in picked.tolist()]:
                raise AssertionError("the keyed batch's keys are not its items'")
            at_batch = _fetched(proxy.gets, folder)
        figures = {"open_ms": open_s * 1e3, "open_gets": at_open[0], "open_mb": at_open[1] / 1e6,
                   "batch_gets": at_batch[0], "batch_mb": at_batch[1] / 1e6, "batch_ms_proxied": batch_s * 1e3}
        if os.path.isdir(folder + "-sharded"):
            figures["shards_open_ratio"] = open_ratio(endpoint, url, url + "-sharded", scratch)
        return figures
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def measure(trees: dict, sizes, runs: int) -> dict:
    from latentfast.cache.remote import push
    from latentfast.testing import create_bucket, s3_options, s3_server

    root = tempfile.mkdtemp(prefix="lf-idx-caches-")
    results = {}
    try:
        with s3_server() as endpoint:
            create_bucket(endpoint, BUCKET)
            for n in sizes:
                folder = os.path.join(root, f"n{n}")
                write_tiny(folder, n)
                url = f"s3://{BUCKET}/n{n}"
                push(folder, url, s3_options(endpoint))
                if n == sizes[0]:  # (the shards' open ratio: at the first size)
                    write_sharded(folder + "-sharded", n)
                    push(folder + "-sharded", url + "-sharded", s3_options(endpoint))
                for run in range(runs):  # the trees interleaved: each run measures every tree once
                    for tag, tree in trees.items():
                        env = {**os.environ, "PYTHONPATH": tree, "PYTHONDONTWRITEBYTECODE": "1"}  # (nothing written into the trees)
                        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", endpoint, url, folder, str(run)],
                                             env=env, capture_output=True, text=True, check=False)
                        if out.returncode:
                            raise RuntimeError(f"{tag} at n={n}: {out.stderr[-2000:]}")
                        results.setdefault((n, tag), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results


def _spread(values, fmt="{:.3g}") -> str:
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}, {fmt.format(max(values))}]"


def report(results: dict, trees: dict) -> str:
    lines = ["| N | tree | open ms | GETs at open | MB at open | GETs, first keyed batch of 64 | MB, first keyed batch | "
             "open, 8 shards / one cache |", "|---|---|---|---|---|---|---|---|"]
    for (n, tag), runs in sorted(results.items(), key=lambda kv: (kv[0][0], list(trees).index(kv[0][1]))):
        col = {k: [r[k] for r in runs] for k in runs[0]}
        lines.append(f"| {n:,} | {tag} | {_spread(col['open_ms'])} | {_spread(col['open_gets'])} | {_spread(col['open_mb'])} | "
                     f"{_spread(col['batch_gets'])} | {_spread(col['batch_mb'])} | "
                     f"{_spread(col['shards_open_ratio']) if 'shards_open_ratio' in col else '-'} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--before", help="another checkout to measure beside this one (e.g. the main branch's)")
    parser.add_argument("--sizes", default="1e5,1e6")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    if args.child:
        endpoint, url, folder, seed = args.child
        print(json.dumps(child(endpoint, url, folder, int(seed))))
        return
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    trees = {"before": os.path.abspath(args.before)} if args.before else {}
    trees["after"] = here
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    with open("/proc/loadavg") as fh:
        load = fh.read().split()[:3]
    results = measure(trees, sizes, args.runs)
    print(f"trees: {trees}; load average before: {' '.join(load)}")
    print(report(results, trees))
    with open("/proc/loadavg") as fh:
        print("load average after:", " ".join(fh.read().split()[:3]))


if __name__ == "__main__":
    main()
