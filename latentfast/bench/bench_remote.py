"""Object storage: random batches from a latent cache pushed to a loopback S3 server.

A padded cache of ``--items`` rows of ``--item-kib`` KiB (default 2,048 x 128 KiB = 256 MiB, float16
``[16, 32, 128]`` latents) is pushed to `s3rver <https://github.com/jamhall/s3rver>`_ (npm,
filesystem-backed, serves a Range GET by seeking: stock moto copies the whole object per range, see
issue 25) on 127.0.0.1, then read back in ``--batches`` random batches of ``--batch`` items (the first
batches of an epoch's permutation: no item twice). Per configuration, ``--runs`` runs (median, range):

- ceiling: one ``obstore.get_range_async`` per item, all of a batch's at once, each copied into the
  batch buffer -- exactly the batch's bytes with the same client;
- remote: :class:`RemoteReader` without a local cache (coalesced ranged GETs);
- cold: with an empty local chunk cache (fresh folder per run);
- cold + prefetch: the same, ``prefetch`` of batch k+1 issued before reading batch k (a lookahead of 1);
- cold, spans 1000 B off the chunks: the same, every span shifted (ragged rows do not start on a
  chunk): what the 16 KiB chunk granularity costs in bytes;
- warm: the same batches again from the filled local chunk cache;
- local file: ``preadv`` of the same rows from the cache's own data file (page cache hot), the
  target a warm chunk cache should reach. Warm and local: the median of 5 interleaved passes per run.
- LatentCache s3://, cold / cold + lookahead / warm: ``LatentCache("s3://...", local_cache=...)
  .read_batch(rows)`` (float16 ``[64, 16, 32, 128]`` batches; the lookahead is ``cache.prefetch`` of
  batch k+1 before reading batch k, what ``LookaheadSampler`` does), against
- LatentCache local: ``read_batch`` of the same rows from the local cache (page cache hot): the
  issue's "warm local chunk cache >= 0.9x a local cache" compares these two (5 interleaved passes).
- LatentCache s3://, 8 shards, cold / cold + lookahead / warm: the same rows as a sharded cache of 8
  shards (contiguous ranges: every batch spans all 8) pushed beside it, read the same way: what a pushed
  distributed build costs against one cache in the bucket. Beside each cold run, the seconds its
  ``LatentCache("s3://...")`` took to open (from an empty local folder): "open ms" in the lines below
  the table (the issue-32 target: 8 shards <= 2x one cache; and 8 shards with the lookahead >= without).

- mosaic streaming / litdata (when installed: ``pip install 'latentfast[bench-compare]'``), over the
  same server and rows: an MDS dataset written by ``MDSWriter`` (defaults: 64 MiB shards) read by
  ``StreamingDataset(remote="s3://...", local=DIR)``, ``S3_ENDPOINT_URL`` set; litdata chunks from
  ``optimize()`` (64 MB) read by ``StreamingDataset("s3://...", cache_dir=DIR, storage_options=...)``.
  Both map-style, ``dataset[i]`` per item (a random batch), cold from an empty local folder, then warm.
  Done to make them run: litdata's ``optimize()`` gets uint8 rows (its serializers refuse bfloat16; the
  bytes are the same); mosaic's package imports torchvision, whose wheel fails to load beside this
  torch build, so an empty ``streaming.vision`` stands in when it does (:func:`import_mosaic`).
  litdata 0.2.76 needed no patch for the ``http://`` endpoint on this path.

items/s over all batches, time to first batch (client creation and HEAD included), MiB fetched over
the network and its ratio to the bytes the batches use; then ours over the best peer per run.

``--rtt-ms 0,10,30``: instead, only the four LatentCache cold configs (one cache and 8 shards, each cold
and cold + lookahead; the open included), per round-trip time: loopback has none, so a lookahead there
can only reorder the same work, while a real endpoint's RTT is what it hides. A TCP proxy on 127.0.0.1
(:func:`latency_proxy`, a process of its own) delays every request by the RTT and every new connection
by one more (no bandwidth limit, no TLS); RTT 0 reads the server directly. The runs interleave the RTTs.

    python -m latentfast.bench.bench_remote [--quick] [--no-peers] [--s3rver PATH] [--endpoint URL --access-key K --secret-key S] [--rtt-ms LIST]

``run_report(quick)`` is the ``latentfast bench`` suite interface (suite ``remote``; it finds s3rver at
``$LATENTFAST_S3RVER``, on PATH or in ./node_modules/.bin).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import multiprocessing
import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.parse

import numpy as np
import torch

from latentfast.bench.common import format_table
from latentfast.cache import LatentCache
from latentfast.cache.remote import RemoteReader, push
from latentfast.cache.store.shards import write_manifest
from latentfast.testing import free_port, write_cache, write_random_cache

BUCKET, PREFIX, DATA = "bench", "cache", "train.latents.f16.dat"
PASSES = 5  # warm and local passes per run (their median), interleaved
SHARDS = 8


def start_s3rver(binary: str, directory: str):
    """s3rver on 127.0.0.1 with the bucket made; returns (process, endpoint, options)."""
    port = free_port()
    proc = subprocess.Popen([binary, "-d", directory, "-a", "127.0.0.1", "-p", str(port), "-s", "--configure-bucket", BUCKET],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError(f"s3rver did not start on 127.0.0.1:{port}")
    endpoint = f"http://127.0.0.1:{port}"
    return proc, endpoint, {"endpoint_url": endpoint, "access_key_id": "S3RVER", "secret_access_key": "S3RVER", "region": "us-east-1"}


def s3rver_version(binary: str) -> str:
    try:
        with open(os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(binary))), "package.json")) as fh:
            return json.load(fh)["version"]
    except (OSError, KeyError, ValueError):
        return "(version unknown)"


def peer_versions() -> str:
    from importlib.metadata import version

    return f"mosaicml-streaming {version('mosaicml-streaming')}, litdata {version('litdata')}"


def make_cache(folder: str, n: int, item_kib: int) -> tuple[str, int]:
    """A padded cache of ``n`` full-width rows of ``item_kib`` KiB; returns (its folder, row bytes)."""
    channels, latent_h = 16, 32
    w_max = item_kib * 1024 // (2 * channels * latent_h)
    path = write_random_cache(folder, n, channels, latent_h, w_max, min_width=w_max, layouts=("padded",))["padded"]
    return path, channels * latent_h * w_max * 2


def make_sharded(path: str, out: str) -> str:
    """The rows of the cache in ``path`` as one sharded cache in ``out`` of SHARDS shards of contiguous rows."""
    cache = LatentCache(path)
    bounds = np.linspace(0, len(cache), SHARDS + 1).astype(int)
    dirs = []
    for k, (a, b) in enumerate(zip(bounds[:-1].tolist(), bounds[1:].tolist())):
        rows, widths = cache.read_batch(list(range(a, b)))
        dirs.append(os.path.join(out, "shards", f"train-{k:05d}"))
        write_cache(dirs[-1], list(rows.numpy()), widths.numpy(), w_max=cache.w_max)
    write_manifest(out, "train", dirs)
    return out


def epoch_batches(n: int, batch: int, count: int, seed: int) -> list[np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    return [np.sort(order[i * batch:(i + 1) * batch]) for i in range(count)]


def timed(read_batch, batches) -> tuple[float, float]:
    """(seconds for all batches, seconds to the first); ``read_batch(k)`` reads batch k."""
    start = time.perf_counter()
    read_batch(0)
    first = time.perf_counter() - start
    for k in range(1, len(batches)):
        read_batch(k)
    return time.perf_counter() - start, first


def run_ceiling(url: str, options: dict, batches, row: int, out: np.ndarray):
    import obstore
    from obstore.store import S3Store

    async def one_batch(store, rows):
        datas = await asyncio.gather(*(obstore.get_range_async(store, f"{PREFIX}/{DATA}", start=int(r) * row, length=row) for r in rows))
        for i, d in enumerate(datas):
            out[i * row:(i + 1) * row] = np.frombuffer(d, dtype=np.uint8)
        return sum(len(d) for d in datas)

    loop = asyncio.new_event_loop()
    fetched = []
    try:
        def read_batch(k):
            if k == 0:
                read_batch.store = S3Store(BUCKET, endpoint=options["endpoint_url"], access_key_id=options["access_key_id"],
                                           secret_access_key=options["secret_access_key"], region=options["region"],
                                           client_options={"allow_http": True})
            fetched.append(loop.run_until_complete(one_batch(read_batch.store, batches[k])))
        total, first = timed(read_batch, batches)
    finally:
        loop.close()
    return total, first, sum(fetched)


def run_reader(url, options, batches, row, out, cache_dir=None, budget=None, prefetch=False, reader=None, shift=0):
    """``shift``: every span starts that many bytes after its row (unaligned to the chunks)."""
    lengths = np.full(len(batches[0]), row)

    def read_batch(k):
        nonlocal reader
        if reader is None:
            reader = RemoteReader(url, options, local_cache=cache_dir, local_cache_bytes=budget)
        if prefetch and k + 1 < len(batches):
            reader.prefetch(DATA, batches[k + 1] * row + shift, lengths)
        reader.read_ranges(DATA, batches[k] * row + shift, lengths, out)

    before = 0 if reader is None else reader.stats["bytes_fetched"]
    total, first = timed(read_batch, batches)
    return total, first, reader.stats["bytes_fetched"] - before, reader


def run_local(path: str, batches, row: int, out: np.ndarray):
    fd = os.open(path, os.O_RDONLY)
    view = memoryview(out)
    try:
        def read_batch(k):
            for i, r in enumerate(batches[k]):
                os.preadv(fd, [view[i * row:(i + 1) * row]], int(r) * row)
        for k in range(len(batches)):  # page cache hot
            read_batch(k)
        total, first = timed(read_batch, batches)
    finally:
        os.close(fd)
    return total, first, 0


def run_latent_cache(open_cache, batches, lookahead=False, cache=None):
    """``read_batch`` of each batch from a :class:`LatentCache` (``open_cache()`` on the first, timed);
    returns (seconds, first, bytes fetched, the cache, the last batch, seconds the open took or None)."""
    last, opened = [], []

    def read_batch(k):
        nonlocal cache
        if cache is None:
            start = time.perf_counter()
            cache = open_cache()
            opened.append(time.perf_counter() - start)
        if lookahead and k + 1 < len(batches):
            cache.prefetch(batches[k + 1])
        last[:] = [cache.read_batch(batches[k])[0]]

    def fetched():
        if cache is None:
            return 0
        remotes = [s.remote for s in getattr(cache, "shards", [cache]) if s.remote is not None]  # (a sharded cache: its shards')
        return sum(r.reader.stats["bytes_fetched"] for r in remotes)

    before = fetched()
    total, first = timed(read_batch, batches)
    return total, first, fetched() - before, cache, last[0], opened[0] if opened else None


def last_batch_check(local: LatentCache, batches):
    """``check(tag, got)``: raises unless ``got`` is the last batch as the local cache reads it, bit for bit."""
    want = local.read_batch(batches[-1])[0]

    def check(tag, got):
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            raise AssertionError(f"{tag}: the last batch differs from the local cache's")

    return check


COLD_CONFIGS = ("cold", "cold + lookahead", f"{SHARDS} shards, cold", f"{SHARDS} shards, cold + lookahead")


def cold_latent_cache_runs(url, options, batches, row, chunks_dir, sharded_url, check) -> tuple[dict, dict]:
    """LatentCache over s3:// from an empty local chunk folder each, in the order of COLD_CONFIGS (one
    cache, then SHARDS shards; each cold, then cold + lookahead): ``({config: (seconds, first, bytes)}
    plus {"open " + config: seconds}, {url: the last cache opened from it})``. ``check(tag, last batch)``."""
    budget = 4 * len(batches) * len(batches[0]) * row
    results, filled = {}, {}
    for tag in COLD_CONFIGS:
        where, lookahead = (sharded_url if tag.startswith(f"{SHARDS} shards") else url), tag.endswith("lookahead")
        opened = lambda: LatentCache(where, storage_options=options, local_cache=tempfile.mkdtemp(dir=chunks_dir), local_cache_bytes=budget)  # noqa: E731
        run = run_latent_cache(opened, batches, lookahead)
        check(f"LatentCache s3://, {tag}", run[4])
        results[f"LatentCache s3://, {tag}"] = run[:3]
        results[f"open LatentCache s3://, {tag}"] = run[5]
        filled[where] = run[3]
    return results, filled


def latent_cache_runs(url, options, folder, batches, row, chunks_dir, sharded_url) -> dict:
    """{config: (seconds, first, bytes)} of LatentCache over s3:// (cold, cold + lookahead, warm; one
    cache and SHARDS shards) and local."""
    local = LatentCache(folder)
    check = last_batch_check(local, batches)
    results, filled = cold_latent_cache_runs(url, options, batches, row, chunks_dir, sharded_url, check)
    passes = {"LatentCache s3://, warm": filled[url], f"LatentCache s3://, {SHARDS} shards, warm": filled[sharded_url],
              "LatentCache local": local}
    times = {tag: [] for tag in passes}
    run_latent_cache(None, batches, cache=local)  # page cache hot
    for _ in range(PASSES):  # interleaved, so all see the same load on a shared machine
        for tag, cache in passes.items():
            got = run_latent_cache(None, batches, cache=cache)
            check(tag, got[4])
            times[tag].append(got[:3])
    results.update({tag: tuple(statistics.median(x) for x in zip(*t)) for tag, t in times.items()})
    return results


# ---- peers: mosaic streaming and litdata over the same server and rows --------------------------

def peer_env(options: dict) -> dict:
    """The environment both peers read their S3 endpoint and keys from (boto3 underneath)."""
    return {"S3_ENDPOINT_URL": options["endpoint_url"], "AWS_ACCESS_KEY_ID": options["access_key_id"],
            "AWS_SECRET_ACCESS_KEY": options["secret_access_key"], "AWS_REGION": options["region"],
            "AWS_DEFAULT_REGION": options["region"]}


def put_folder(local: str, url: str, options: dict) -> None:
    from latentfast.cache.remote import ObjectFolder

    folder = ObjectFolder(url, options)
    for root, _dirs, files in os.walk(local):
        for f in files:
            full = os.path.join(root, f)
            folder.put_file(os.path.relpath(full, local), full)


def import_mosaic():
    """``streaming``; its package imports ``streaming.vision`` (torchvision's datasets) first, and the
    torchvision that pip puts beside a torch build of its own may fail to load (here: "operator
    torchvision::nms does not exist"): then an empty ``streaming.vision`` stands in (nothing of it is used)."""
    import sys
    import types

    try:
        import torchvision  # noqa: F401
    except (ImportError, RuntimeError):
        sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))
    import streaming

    return streaming


def make_mds(path: str, row: int, out_dir: str) -> None:
    """The rows as an MDS dataset, one ``bytes`` column, written with mosaic's ``MDSWriter`` defaults."""
    MDSWriter = import_mosaic().MDSWriter

    rows = np.memmap(path, dtype=np.uint8, mode="r").reshape(-1, row)
    with MDSWriter(out=out_dir, columns={"x": "bytes"}) as writer:
        for r in rows:
            writer.write({"x": r.tobytes()})


def _litdata_item(args):
    path, row, i = args
    return {"x": np.array(np.memmap(path, dtype=np.uint8, mode="r", offset=i * row, shape=(row,)))}


def make_litdata(path: str, row: int, n: int, out_dir: str) -> None:
    """The rows as litdata chunks, by its ``optimize()`` (64 MB chunks, as its README): uint8 arrays,
    because its serializers refuse bfloat16 (float16 would do here; the bytes are the same)."""
    from litdata import optimize

    optimize(fn=_litdata_item, inputs=[(path, row, i) for i in range(n)], output_dir=out_dir, chunk_bytes="64MB", num_workers=1)


def folder_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _d, files in os.walk(folder) for f in files)


def run_peer(open_dataset, get_bytes, batches, row, out, local: str, dataset=None, kept_locally=True):
    """Items one ``dataset[i]`` at a time (both peers' map-style access), copied into ``out``; bytes
    fetched = what the peer keeps in its local folder (mosaic: whole shards plus its index). litdata
    0.2.76 reads a map-style item by one ranged GET straight into memory and keeps nothing: its bytes
    are not counted here (None)."""
    def read_batch(k):
        nonlocal dataset
        if dataset is None:
            dataset = open_dataset()
        for i, r in enumerate(batches[k]):
            out[i * row:(i + 1) * row] = np.frombuffer(get_bytes(dataset[int(r)]), dtype=np.uint8)

    before = folder_bytes(local)
    total, first = timed(read_batch, batches)
    return total, first, folder_bytes(local) - before if kept_locally else None, dataset


def open_mosaic(local: str, batch: int):
    StreamingDataset = import_mosaic().StreamingDataset

    return lambda: StreamingDataset(remote=f"s3://{BUCKET}/mds", local=local, shuffle=False, batch_size=batch)


def open_litdata(local: str, options: dict):
    from litdata import StreamingDataset

    storage = {"endpoint_url": options["endpoint_url"], "aws_access_key_id": options["access_key_id"],
               "aws_secret_access_key": options["secret_access_key"], "region_name": options["region"]}
    return lambda: StreamingDataset(f"s3://{BUCKET}/lit", cache_dir=local, storage_options=storage)


def peer_runs(options, batches, row, out, scratch, check) -> dict:
    """{config: (seconds, first, bytes)} of both peers: cold from an empty local folder, then warm."""
    results = {}
    mosaic_local = tempfile.mkdtemp(dir=scratch)
    cold = run_peer(open_mosaic(mosaic_local, len(batches[0])), lambda item: item["x"], batches, row, out, mosaic_local)
    check("mosaic cold")
    warm = run_peer(None, lambda item: item["x"], batches, row, out, mosaic_local, dataset=cold[3])
    check("mosaic warm")
    results["mosaic streaming, cold"], results["mosaic streaming, warm"] = cold[:3], warm[:3]
    lit_local = tempfile.mkdtemp(dir=scratch)
    cold = run_peer(open_litdata(lit_local, options), lambda item: item["x"], batches, row, out, lit_local, kept_locally=False)
    check("litdata cold")
    warm = run_peer(None, lambda item: item["x"], batches, row, out, lit_local, dataset=cold[3], kept_locally=False)
    check("litdata warm")
    results["litdata, cold"], results["litdata, warm"] = cold[:3], warm[:3]
    return results


def prepare_peers(path: str, row: int, n: int, scratch: str, options: dict) -> None:
    mds, lit = os.path.join(scratch, "mds"), os.path.join(scratch, "lit")
    make_mds(path, row, mds)
    make_litdata(path, row, n, lit)
    put_folder(mds, f"s3://{BUCKET}/mds", options)
    put_folder(lit, f"s3://{BUCKET}/lit", options)


def one_run(url, options, path, batches, row, scratch, peers=False, chunks_dir=None, sharded_url=None):
    """{config: (seconds, first batch seconds, bytes fetched)} for one run; checks the bytes read."""
    out = np.empty(len(batches[0]) * row, dtype=np.uint8)
    local = np.memmap(path, dtype=np.uint8, mode="r")

    def check(tag):
        want = np.concatenate([local[int(r) * row:(int(r) + 1) * row] for r in batches[-1]])
        if not np.array_equal(out, want):
            bad = [i for i in range(len(batches[-1])) if not np.array_equal(out[i * row:(i + 1) * row], want[i * row:(i + 1) * row])]
            raise AssertionError(f"{tag}: items {bad} of the last batch (rows {batches[-1][bad].tolist()}) differ from the local file")

    chunks_dir = chunks_dir or scratch  # where the local chunk caches go (a fresh folder per cold run)
    results = {}
    results["ceiling"] = run_ceiling(url, options, batches, row, out)
    check("ceiling")
    results["remote"] = run_reader(url, options, batches, row, out)[:3]
    check("remote")
    budget = 4 * len(batches) * len(batches[0]) * row
    cold = run_reader(url, options, batches, row, out, cache_dir=tempfile.mkdtemp(dir=chunks_dir), budget=budget)
    results["cold"] = cold[:3]
    check("cold")
    results["cold + prefetch"] = run_reader(url, options, batches, row, out, cache_dir=tempfile.mkdtemp(dir=chunks_dir), budget=budget, prefetch=True)[:3]
    check("cold + prefetch")
    shifted = [np.minimum(b, len(local) // row - 2) for b in batches]  # room for the shift after the last row
    results["cold, spans 1000 B off the chunks"] = run_reader(url, options, shifted, row, out, cache_dir=tempfile.mkdtemp(dir=chunks_dir), budget=budget, shift=1000)[:3]
    warm, plain = [], []
    for _ in range(PASSES):  # interleaved, so both see the same load on a shared machine
        warm.append(run_reader(url, options, batches, row, out, reader=cold[3])[:3])
        check("warm")
        plain.append(run_local(path, batches, row, out))
        check("local file")
    results["warm"] = tuple(statistics.median(x) for x in zip(*warm))
    results["local file"] = tuple(statistics.median(x) for x in zip(*plain))
    results.update(latent_cache_runs(url, options, os.path.dirname(path), batches, row, chunks_dir, sharded_url))
    if peers:
        results.update(peer_runs(options, batches, row, out, chunks_dir, check))
    return results


def summarize(runs: list[dict], n_items: int, used: int) -> str:
    def fmt(values, scale=1.0):
        values = [v * scale for v in values]
        return f"{statistics.median(values):.4g} [{min(values):.4g}, {max(values):.4g}]"

    ceiling = [n_items / r["ceiling"][0] for r in runs]
    rows = []
    for config in [c for c in runs[0] if not c.startswith("open ")]:
        rate = [n_items / r[config][0] for r in runs]
        ratio = [a / b for a, b in zip(rate, ceiling)]
        first = [r[config][1] for r in runs]
        fetched = [r[config][2] for r in runs]
        mib, share = ("n/a", "n/a") if None in fetched else (f"{statistics.median(fetched) / 2**20:.1f}", f"{statistics.median(fetched) / used:.3f}")
        rows.append([config, fmt(rate), fmt(ratio), fmt(first, 1000), mib, share])
    header = ["config", "items/s median [range]", "x ceiling", "first batch ms", "MiB fetched", "fetched / used"]
    warm_vs_local = [r["local file"][0] / r["warm"][0] for r in runs]
    cache_vs_local = [r["LatentCache local"][0] / r["LatentCache s3://, warm"][0] for r in runs]
    lines = [format_table(f"random batches, {len(runs)} runs", header, rows),
             f"warm chunk cache / local file (items/s, per run): {fmt(warm_vs_local)}",
             f"LatentCache s3:// warm / LatentCache local (read_batch items/s, per run): {fmt(cache_vs_local)}   target >= 0.9"]
    for kind in ("cold + lookahead", "warm"):
        ratio = [r[f"LatentCache s3://, {kind}"][0] / r[f"LatentCache s3://, {SHARDS} shards, {kind}"][0] for r in runs]
        lines.append(f"LatentCache s3:// {SHARDS} shards / one cache, {kind} (items/s, per run): {fmt(ratio)}   target >= 0.9")
    ahead = [r[f"LatentCache s3://, {SHARDS} shards, cold"][0] / r[f"LatentCache s3://, {SHARDS} shards, cold + lookahead"][0] for r in runs]
    lines.append(f"LatentCache s3:// {SHARDS} shards, cold + lookahead / cold (items/s, per run): {fmt(ahead)}   target >= 1")
    for tag in ("cold", "cold + lookahead", f"{SHARDS} shards, cold", f"{SHARDS} shards, cold + lookahead"):
        lines.append(f"open LatentCache s3://, {tag} (ms, per run): {fmt([r[f'open LatentCache s3://, {tag}'] for r in runs], 1000)}")
    opens = [r[f"open LatentCache s3://, {SHARDS} shards, {k}"] / r[f"open LatentCache s3://, {k}"] for r in runs for k in ("cold", "cold + lookahead")]
    lines.append(f"open LatentCache s3:// {SHARDS} shards / one cache (both cold runs of each run): {fmt(opens)}   target <= 2")
    if "litdata, cold" in runs[0]:
        lines += peer_ratios(runs, fmt)
    return "\n".join(lines)


def peer_ratios(runs: list[dict], fmt) -> list[str]:
    """Ours over the best peer of each run (issue 25's targets beside each)."""
    def best(r, kind, i, pick):
        return pick(r[f"{p}, {kind}"][i] for p in ("mosaic streaming", "litdata"))

    lines = []
    for ours in ("cold", "cold + prefetch", "LatentCache s3://, cold", "LatentCache s3://, cold + lookahead"):
        lines.append(f"{ours} / best peer cold, items/s: {fmt([best(r, 'cold', 0, min) / r[ours][0] for r in runs])}   target >= 1")
        lines.append(f"{ours} / best peer cold, time to first batch: {fmt([r[ours][1] / best(r, 'cold', 1, min) for r in runs])}   target <= 0.333")
    for ours in ("warm", "LatentCache s3://, warm"):
        lines.append(f"{ours} / best peer warm, items/s: {fmt([best(r, 'warm', 0, min) / r[ours][0] for r in runs])}   target >= 1")
    return lines


# ---- round-trip time: a loopback TCP proxy that delays what the client sends -------------------

def serve_latency_proxy(upstream_port: int, rtt_s: float, lifetime_s: float, conn) -> None:
    """A TCP proxy on 127.0.0.1 in front of ``127.0.0.1:upstream_port`` (run in a process of its own:
    :func:`latency_proxy`) that forwards every piece the client sends ``rtt_s`` after it arrived, in
    order, and the server's answers at once: each request waits one round trip before the server sees
    it, a large body costs its bytes once, not one round trip per piece, and a new connection one more
    (its TCP handshake; no TLS). Sends its port through ``conn``; stops after ``lifetime_s``."""
    async def pipe(src, dst, delay):
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()

        async def forward():
            while (piece := await pieces.get())[1]:
                await asyncio.sleep(piece[0] - loop.time())
                dst.write(piece[1])
                await dst.drain()
            dst.close()

        forwarding = asyncio.ensure_future(forward())
        try:
            while data := await src.read(1 << 16):
                pieces.put_nowait((loop.time() + delay, data))
        finally:
            pieces.put_nowait((loop.time() + delay, b""))
            await forwarding

    async def handle(client_r, client_w):
        await asyncio.sleep(rtt_s)  # the handshake
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", upstream_port)
        except OSError:
            client_w.close()
            return
        await asyncio.gather(pipe(client_r, server_w, rtt_s), pipe(server_r, client_w, 0.0), return_exceptions=True)
        client_w.close()
        server_w.close()

    async def main():
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        conn.send(server.sockets[0].getsockname()[1])
        async with server:
            await asyncio.sleep(lifetime_s)

    asyncio.run(main())


@contextlib.contextmanager
def latency_proxy(endpoint: str, rtt_ms: float, lifetime_s: float = 3 * 3600):
    """:func:`serve_latency_proxy` in front of ``endpoint`` (``http://127.0.0.1:PORT``) in a spawned
    process (its own interpreter: the proxy's work never waits on the benchmark's GIL); yields the
    proxy's endpoint. ``rtt_ms`` 0: ``endpoint`` itself, no proxy."""
    if not rtt_ms:
        yield endpoint
        return
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    proc = context.Process(target=serve_latency_proxy, args=(urllib.parse.urlsplit(endpoint).port, rtt_ms / 1000, lifetime_s, theirs),
                           daemon=True)
    proc.start()
    try:
        if not ours.poll(60):
            raise RuntimeError(f"the {rtt_ms} ms latency proxy in front of {endpoint} did not start")
        yield f"http://127.0.0.1:{ours.recv()}"
    finally:
        proc.terminate()
        proc.join(30)


def rtt_runs(url, sharded_url, options_at: dict, path: str, batches, row, chunks_dir) -> dict:
    """{rtt_ms: {config: (seconds, first, bytes)}} of the COLD_CONFIGS through each RTT's endpoint
    (``options_at[rtt_ms]``), one run; the last batch of each checked against the local cache."""
    check = last_batch_check(LatentCache(os.path.dirname(path)), batches)
    return {rtt: cold_latent_cache_runs(url, options, batches, row, chunks_dir, sharded_url, check)[0] for rtt, options in options_at.items()}


def summarize_rtt(runs: list[dict], n_items: int) -> str:
    """The RTT sweep's table: items/s of each cold config and the lookahead's gain, per RTT."""
    def fmt(values):
        return f"{statistics.median(values):.4g} [{min(values):.4g}, {max(values):.4g}]"

    rows = []
    for rtt in runs[0]:
        rates = {c: [n_items / r[rtt][f"LatentCache s3://, {c}"][0] for r in runs] for c in COLD_CONFIGS}
        gain = [[rates[f"{prefix}cold + lookahead"][i] / rates[f"{prefix}cold"][i] for i in range(len(runs))]
                for prefix in ("", f"{SHARDS} shards, ")]
        rows.append([f"{rtt:g}", *(fmt(rates[c]) for c in COLD_CONFIGS), fmt(gain[0]), fmt(gain[1])])
    header = ["RTT ms", *(f"{c} items/s" for c in COLD_CONFIGS), "one cache: lookahead / cold", f"{SHARDS} shards: lookahead / cold (>= 1)"]
    return format_table(f"LatentCache s3:// cold, by round-trip time, {len(runs)} runs (RTT 0: no proxy)", header, rows)


def run_report(quick: bool = False, *, items: int = 2048, item_kib: int = 128, batch: int = 64, batches: int = 16,
               runs: int = 3, s3rver: str | None = None, endpoint: str | None = None, access_key: str = "S3RVER",
               secret_key: str = "S3RVER", peers: bool | None = None, chunks_dir: str | None = None, rtt_ms=()) -> dict:
    """The side-by-side report (the ``latentfast bench`` suite interface): ``{"table", "runs", ...}``.
    ``rtt_ms`` (round-trip times in ms): instead, only the LatentCache cold configs, through a
    :func:`latency_proxy` of each RTT (0: straight to the server), the runs interleaving the RTTs."""
    if quick:
        items, batches = 256, 4
    if rtt_ms:
        peers = False
    if peers is None:  # by default: when both are installed (pip install 'latentfast[bench-compare]')
        peers = all(importlib.util.find_spec(m) is not None for m in ("streaming", "litdata"))
    s3rver = s3rver or os.environ.get("LATENTFAST_S3RVER") or shutil.which("s3rver") or "node_modules/.bin/s3rver"
    chunks_arg = chunks_dir
    with tempfile.TemporaryDirectory(prefix="bench_remote_") as scratch, \
            tempfile.TemporaryDirectory(prefix="bench_remote_chunks_", dir=chunks_dir) as chunks_dir:
        proc = None
        if endpoint:
            options = {"endpoint_url": endpoint, "access_key_id": access_key, "secret_access_key": secret_key, "region": "us-east-1"}
        elif not os.path.exists(s3rver):
            raise RuntimeError(f"s3rver not found at {s3rver!r}: npm install s3rver (node >= 14) here, put it on PATH or set LATENTFAST_S3RVER, "
                               f"or pass --s3rver / --endpoint")
        else:
            proc, endpoint, options = start_s3rver(s3rver, os.path.join(scratch, "s3rver"))
        try:
            path, row = make_cache(os.path.join(scratch, "local"), items, item_kib)
            url = f"s3://{BUCKET}/{PREFIX}"
            start = time.perf_counter()
            push(path, url, options)
            pushed_s = time.perf_counter() - start
            sharded_url = f"s3://{BUCKET}/{PREFIX}-sharded"
            push(make_sharded(path, os.path.join(scratch, "sharded")), sharded_url, options)
            if peers:
                prepare_peers(os.path.join(path, DATA), row, items, scratch, options)
            saved = {k: os.environ.get(k) for k in peer_env(options)}
            os.environ.update(peer_env(options) if peers else {})
            try:
                with contextlib.ExitStack() as proxies:
                    options_at = {rtt: {**options, "endpoint_url": proxies.enter_context(latency_proxy(endpoint, rtt))} for rtt in rtt_ms}
                    results = [rtt_runs(url, sharded_url, options_at, os.path.join(path, DATA), epoch_batches(items, batch, batches, seed),
                                        row, chunks_dir) if rtt_ms else
                               one_run(url, options, os.path.join(path, DATA), epoch_batches(items, batch, batches, seed), row, scratch, peers,
                                       chunks_dir, sharded_url)
                               for seed in range(runs)]
            finally:
                for k, v in saved.items():
                    os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=30)
    n_items = batch * batches
    server = f"s3rver {s3rver_version(s3rver)} on 127.0.0.1 (filesystem-backed, Range GETs by seeking)" if proc is not None else endpoint
    report = {"server": server, "peers": peer_versions() if peers else "not run", "items": items, "item_bytes": row,
              "push_s": pushed_s, "runs": results,
              "table": summarize_rtt(results, n_items) if rtt_ms else summarize(results, n_items, n_items * row)}
    print(f"pushed {items} x {row // 1024} KiB to {server} in {pushed_s:.1f} s", flush=True)
    print(report["table"])
    print(f"server: {server}; peers: {report['peers']}; local chunk caches in {chunks_arg or 'TMPDIR'}", flush=True)
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--items", type=int, default=2048)
    parser.add_argument("--item-kib", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=16)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="256 items, 4 batches, 3 runs")
    parser.add_argument("--s3rver", help="the s3rver executable (default: $LATENTFAST_S3RVER, on PATH, else ./node_modules/.bin/s3rver)")
    parser.add_argument("--endpoint", help="an S3 endpoint already running (bucket 'bench' must exist) instead of s3rver")
    parser.add_argument("--access-key", default="S3RVER")
    parser.add_argument("--secret-key", default="S3RVER")
    parser.add_argument("--no-peers", action="store_true", help="skip mosaic streaming and litdata")
    parser.add_argument("--chunks-dir", help="where the local chunk caches go (default: the scratch folder under TMPDIR); "
                        "a cold read writes every chunk there, so its disk's write speed is part of the cold figures")
    parser.add_argument("--rtt-ms", type=lambda text: [float(x) for x in text.split(",")], default=[],
                        help="comma-separated round-trip times, e.g. 0,10,30: run only the LatentCache cold configs (one cache and "
                        f"{SHARDS} shards, each cold and cold + lookahead), through a loopback proxy that delays every request by "
                        "the RTT (0: no proxy)")
    a = parser.parse_args(argv)
    run_report(a.quick, items=a.items, item_kib=a.item_kib, batch=a.batch, batches=a.batches, runs=a.runs,
               s3rver=a.s3rver, endpoint=a.endpoint, access_key=a.access_key, secret_key=a.secret_key,
               peers=False if a.no_peers else None, chunks_dir=a.chunks_dir, rtt_ms=tuple(a.rtt_ms))


if __name__ == "__main__":
    main()
