"""Chunk-aware shuffling (``chunks=item_chunks(cache), chunk_window=K``) against a full shuffle: what a
node downloads from object storage in an epoch, and how well the epoch is shuffled.

No server and no timing of the network: the batches of one epoch are computed by the real samplers
and replayed against a model of each node's local chunk cache: an LRU with a byte budget of 1/8 of
the data; a batch downloads the missing units under its items, one GET per run of adjacent missing
units. Two download units:

- ``16K``: 16 KiB chunks (``remote.chunks.CHUNK_BYTES``): what ``RemoteReader``'s ``ChunkCache``
  keeps and evicts, and how ``RemoteReader._ensure_local`` issues GETs today;
- ``1M``: whole sampler chunks of 1 MiB, as mosaic streaming and litdata download whole shards /
  chunks (or a prefetcher that fetches a window's chunks whole).

4 nodes (one rank each), batches of 64, sampler chunks of 1 MiB (``item_chunks(..., 1 << 20)``),
windows ``K`` of 1/8, 1/4, 1/2 and all of the local cache budget. Two caches (``--quick``: a
quarter of the items), item byte ranges as the writer lays them out:

- ``lines``: 65,536 text-line latents ``[4, 8, w]`` float16, ragged, ``w`` uniform in 16..240 (mean
  ~8 KiB, 512 MiB: about two items per 16 KiB chunk, items across chunk boundaries),
  :class:`WidthBucketBatchSampler`;
- ``images``: 8,192 1024 px images in 3 aspect buckets, ``[4, 128, 128]``, ``[4, 112, 144]``,
  ``[4, 144, 112]`` float16 (~128 KiB, 1 GiB; each a whole number of 16 KiB chunks), buckets
  interleaved in the file, :class:`ShapeBucketBatchSampler`.

Fetches (per node, mean over the 4 nodes), for each unit: ``fetch x`` = units downloaded / distinct
units its batches touch (1.0: each once per epoch per node); ``bytes x`` = bytes downloaded / bytes
its batches use (4 nodes share no cache: a unit that holds other nodes' items too costs every node
that touches it); ``GETs/b``: GETs per batch; and ``16K bytes x 1 node``: the same epoch read by
one node alone.

Shuffle quality, over the whole epoch, with file position = item index (items lie in the file in
index order); each also given for the full shuffle:

- ``spread``: mean over batches of the mean ``|i - j|`` over pairs of items of the batch, divided by
  the full shuffle's (1.0: a batch's items as far apart in the file as a full shuffle's; a batch of
  neighbours scores near 0);
- ``same-chunk %``: share of a batch's item pairs from one sampler chunk (full shuffle: ~1/chunks);
- ``nbr gap``: mean distance, in batches of the epoch, between items adjacent in the file, divided
  by the full shuffle's (~1/3 of the epoch): how far the epoch scatters file neighbours;
- ``rho``: Spearman correlation of an item's position in the epoch with its position in the file
  (0: the epoch does not walk through the file).

Samplers at scale (``--scale``; issue 33): for N items, with **synthetic bucket-id arrays** (no
cache: a 10^8-item cache does not fit this disk), each sampler's

- ``build s``: constructing it (its per-item ids from the labels it is given, drawn before the clock starts);
- ``plan s``: one epoch's plan (``epoch_batches()``), median [min-max] of ``--runs`` epochs, and
  ``/ perm``: its ratio to one bare ``numpy.random.Generator.permutation(N)`` timed in the same process
  right after it (the floor: the old code made that call too, and a plan with the old order must);
- ``numpy plan s``: one more plan of epoch 0 with the sampler's numpy passes (``sampler.NATIVE = None``: what
  runs without the native library, the reference of ``csrc/cpu/plan_epoch.cpp``'s shuffle, grouping and
  sort), timed in the same process, and ``native x``: its ratio to the median plan; ``same``: whether
  the two plans of epoch 0 are equal (they must be);
- ``first batch s``: ``next(iter(sampler))`` of a fresh epoch (the plan plus one batch);
- ``kept B/item``: the bytes of the arrays the sampler keeps, per item (``sampler.nbytes / N``), and
  ``plan B/item``: the plan's arrays (``Batches.nbytes / N``); ``peak B/item``: the most Python/numpy
  memory traced (tracemalloc) while planning, per item, in one more untimed epoch.

Samplers: ``shape, 100 buckets`` (uint8 ids drawn uniformly), ``shape, 1 bucket`` (what
``LatentLoader(buckets=False)`` and a one-shape cache get), ``width`` (widths 16..240, like lines),
``shape windowed K=8`` (3 buckets, chunks of 16 items). Also ``ids from shapes s``: bucket ids from a
mapped ``[N, 4]`` int64 shapes table (100 shapes, the ``.npy`` written to a temporary directory and
opened with ``mmap_mode="r"``, read a block of rows at a time), for N up to ``--shapes-max``.

``--cache N``: the same figures on a real cache's shapes and chunks: N tiny items (``[4, 2, 2]``,
``[4, 2, 3]``, ``[4, 3, 2]`` float16, in runs of 1-63 items of one shape) written with
``LatentCacheWriter.append_many`` to a temporary directory, then ``shape, cache`` (its mapped shapes)
and ``shape windowed K=8, cache`` (``chunks=item_chunks(cache, 512)``: ~16 items a chunk, as the
synthetic rows).

    python -m latentfast.bench.bench_sampler [--quick]
    python -m latentfast.bench.bench_sampler --scale [--sizes 1e6,1e7,1e8] [--runs 3] [--shapes-max 1e7] [--kinds 0,1,2,3] [--cache 1e6]

(``--kinds``: which of the samplers, by their place in :data:`SCALE_KINDS`).

``run_report(quick)`` is the ``latentfast bench`` suite interface (the scale table at 10^6 items, 10^5
with ``quick``).
"""
from __future__ import annotations

import collections
import os
import statistics
import sys
import tempfile
import time
import tracemalloc

import numpy as np
import pytest

from latentfast.bench.common import format_table
from latentfast.cache import LatentCache, LatentCacheWriter, ShapeBucketBatchSampler, WidthBucketBatchSampler, item_chunks
from latentfast.cache.feed import sampler as sampler_module
from latentfast.cache.remote.chunks import CHUNK_BYTES, chunk_indices

NODES, BATCH, SAMPLER_CHUNK = 4, 64, 1 << 20
WINDOW_SHARES = (8, 4, 2, 1)  # windows of 1/8, 1/4, 1/2 and all of a node's local cache budget
IMAGE_SHAPES = np.array([[4, 128, 128], [4, 112, 144], [4, 144, 112]])


def line_cache(n: int, seed: int = 0):
    """``(widths, starts, ends)``: ragged line latents [4, 8, w], bytes back to back."""
    widths = np.random.default_rng(seed).integers(16, 241, n)
    sizes = 4 * 8 * widths * 2
    ends = np.cumsum(sizes)
    return widths, ends - sizes, ends


def image_cache(n: int, seed: int = 0):
    """``(shapes, starts, ends)``: images of 3 buckets, interleaved, bytes back to back."""
    shapes = IMAGE_SHAPES[np.random.default_rng(seed).integers(0, 3, n)]
    sizes = shapes.prod(axis=1) * 2
    ends = np.cumsum(sizes)
    return shapes, ends - sizes, ends


def node_fetches(batches, starts, ends, budget_bytes: int, unit: int) -> dict:
    """Replay one node's batches against an LRU of ``budget_bytes`` in units of ``unit`` bytes."""
    lru: collections.OrderedDict = collections.OrderedDict()
    budget_chunks = budget_bytes // unit
    fetched = gets = used_bytes = 0
    touched = set()
    for batch in batches:
        idx = np.asarray(batch)
        used_bytes += int((ends[idx] - starts[idx]).sum())
        chunks = np.unique(chunk_indices(starts[idx] // unit, (ends[idx] - 1) // unit + 1))
        touched.update(chunks.tolist())
        missing = [c for c in chunks.tolist() if c not in lru]
        for c in chunks.tolist():
            if c in lru:
                lru.move_to_end(c)
        if missing:
            gets += 1 + int(np.count_nonzero(np.diff(missing) > 1))  # one GET per run of adjacent chunks
            fetched += len(missing)
            for c in missing:
                lru[c] = True
            while len(lru) > budget_chunks:
                lru.popitem(last=False)
    return {"fetch_ratio": fetched / max(1, len(touched)), "bytes_ratio": fetched * unit / max(1, used_bytes),
            "gets_per_batch": gets / max(1, len(batches))}


def quality(batches, n: int, chunk_of: np.ndarray) -> dict:
    """Raw shuffle-quality figures of one epoch's global batch list (see the module docstring)."""
    spreads, same = [], []
    batch_of = np.full(n, -1, dtype=np.int64)
    position = np.full(n, -1, dtype=np.int64)
    at = 0
    for b, batch in enumerate(batches):
        x = np.sort(np.asarray(batch))
        k = len(x)
        batch_of[x] = b
        position[np.asarray(batch)] = at + np.arange(k)
        at += k
        if k < 2:
            continue
        pairs = k * (k - 1) / 2
        spreads.append(float(((2 * np.arange(k) - k + 1) * x).sum()) / pairs)  # sum over pairs of |xi - xj|
        counts = np.bincount(chunk_of[x] - chunk_of[x].min())
        same.append(float((counts * (counts - 1) / 2).sum()) / pairs)
    seen = batch_of >= 0
    both = seen[:-1] & seen[1:]
    gap = float(np.abs(np.diff(batch_of))[both].mean())
    order = np.flatnonzero(seen)
    rho = float(np.corrcoef(np.argsort(np.argsort(position[order])), order)[0, 1])
    return {"spread": statistics.mean(spreads), "same_chunk": statistics.mean(same), "nbr_gap": gap, "rho": rho}


def scenario(name: str, n: int) -> dict:
    if name == "lines":
        widths, starts, ends = line_cache(n)
        make = lambda **kw: WidthBucketBatchSampler(widths, BATCH, seed=0, **kw)  # noqa: E731
    else:
        shapes, starts, ends = image_cache(n)
        make = lambda **kw: ShapeBucketBatchSampler(shapes, BATCH, seed=0, **kw)  # noqa: E731
    chunk_of = item_chunks(starts, SAMPLER_CHUNK)
    budget = int(ends[-1]) // 8
    windows = [max(1, round(budget / SAMPLER_CHUNK) // share) for share in WINDOW_SHARES]
    rows = {}
    for window in (None, *windows):
        kw = {} if window is None else {"chunks": chunk_of, "chunk_window": window}
        per_node = [list(make(rank=r, world_size=NODES, **kw)) for r in range(NODES)]
        row = {}
        for label, unit in (("16K", CHUNK_BYTES), ("1M", SAMPLER_CHUNK)):
            nodes = [node_fetches(batches, starts, ends, budget, unit) for batches in per_node]
            row[label] = {key: statistics.mean(node[key] for node in nodes) for key in nodes[0]}
        row["16K one node"] = node_fetches(list(make(**kw)), starts, ends, budget, CHUNK_BYTES)
        row.update(quality(make(**kw).epoch_batches(), n, chunk_of))
        rows["full shuffle" if window is None else f"K={window}"] = row
    full = rows["full shuffle"]
    for row in rows.values():
        row["spread_vs_full"] = row["spread"] / full["spread"]
        row["nbr_gap_vs_full"] = row["nbr_gap"] / full["nbr_gap"]
    return {"items": n, "data_mib": int(ends[-1]) / 2**20, "budget_mib": budget / 2**20,
            "sampler_chunks": int(len(np.unique(chunk_of))), "rows": rows}


SCALE_KINDS = ("shape, 100 buckets", "shape, 1 bucket", "width", "shape windowed K=8")


def scale_inputs(kind: str, n: int):
    """``(sampler class, args, kwargs)`` of ``kind`` over ``n`` synthetic items (labels, widths, chunks drawn here)."""
    rng = np.random.default_rng(0)
    if kind == "shape, 100 buckets":
        return ShapeBucketBatchSampler, (rng.integers(0, 100, n, dtype=np.uint8), BATCH), {}
    if kind == "shape, 1 bucket":
        return ShapeBucketBatchSampler, (np.zeros(n, np.uint8), BATCH), {}
    if kind == "width":
        return WidthBucketBatchSampler, (rng.integers(16, 241, n, dtype=np.int16), BATCH), {}
    chunks = {"chunks": np.arange(n) // 16, "chunk_window": 8}
    return ShapeBucketBatchSampler, (rng.integers(0, 3, n, dtype=np.uint8), BATCH), chunks


def spread(times: list[float]) -> dict:
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def scale_row(kind: str, n: int, runs: int) -> dict:
    cls, args, kwargs = scale_inputs(kind, n)
    return timed_plans(lambda: cls(*args, **kwargs), n, runs)


def timed_plans(make, n: int, runs: int) -> dict:
    """The figures of one row (see the module docstring) of the sampler ``make()`` builds over ``n`` items."""
    t0 = time.perf_counter()
    sampler = make()
    build = time.perf_counter() - t0
    plans, floors = [], []
    for epoch in range(runs):
        sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        plan = sampler.epoch_batches()
        plans.append(time.perf_counter() - t0)
        first_plan = plan if epoch == 0 else first_plan
        del plan
        t0 = time.perf_counter()
        np.random.default_rng(epoch).permutation(n)
        floors.append(time.perf_counter() - t0)
    sampler.set_epoch(0)
    native, sampler_module.NATIVE = sampler_module.NATIVE, None
    try:
        t0 = time.perf_counter()
        reference = sampler.epoch_batches()
        numpy_plan = time.perf_counter() - t0
    finally:
        sampler_module.NATIVE = native
    same = all(np.array_equal(getattr(first_plan, a), getattr(reference, a)) for a in ("items", "starts", "ends"))
    del first_plan, reference
    sampler.set_epoch(runs)
    t0 = time.perf_counter()
    next(iter(sampler))
    first = time.perf_counter() - t0
    sampler.set_epoch(runs + 1)
    tracemalloc.start()
    plan = sampler.epoch_batches()
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"build_s": build, "plan_s": spread(plans), "plan_vs_permutation": spread([p / f for p, f in zip(plans, floors)]),
            "permutation_s": spread(floors), "numpy_plan_s": numpy_plan, "native_speedup": numpy_plan / statistics.median(plans),
            "same_plan": same, "native": native is not None, "first_batch_s": first, "kept_bytes_per_item": sampler.nbytes / n,
            "plan_bytes_per_item": plan.nbytes / n, "peak_bytes_per_item": peak / n, "load_average": os.getloadavg()[0]}


def ids_from_shapes_seconds(n: int, runs: int) -> dict:
    """Seconds to make the bucket ids of a mapped [n, 4] int64 shapes table of 100 shapes."""
    rng = np.random.default_rng(0)
    distinct = np.stack([np.full(100, 4), rng.integers(1, 9, 100), 8 * rng.integers(8, 64, 100), 8 * rng.integers(8, 64, 100)], 1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "shapes.npy")
        table = np.lib.format.open_memmap(path, mode="w+", dtype=np.int64, shape=(n, 4))
        for r0 in range(0, n, 1 << 20):
            table[r0 : r0 + (1 << 20)] = distinct[rng.integers(0, 100, min(n, r0 + (1 << 20)) - r0)]
        table.flush()
        del table
        times = []
        for _ in range(runs):
            shapes = np.load(path, mmap_mode="r")
            t0 = time.perf_counter()
            sampler = ShapeBucketBatchSampler(shapes, BATCH)
            times.append(time.perf_counter() - t0)
            assert sampler.buckets.dtype == np.uint8
            del shapes, sampler
    return spread(times)


CACHE_SHAPES = ((4, 2, 2), (4, 2, 3), (4, 3, 2))


def cache_rows(n: int, runs: int) -> dict:
    """The rows ``shape, cache`` and ``shape windowed K=8, cache`` over a real cache of ``n`` tiny items."""
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        with LatentCacheWriter(os.path.join(tmp, "cache"), flush_every=1 << 16) as writer:
            done = 0
            while done < n:  # runs of one shape, of 1-63 items
                count, shape = min(n - done, int(rng.integers(1, 64))), CACHE_SHAPES[int(rng.integers(0, len(CACHE_SHAPES)))]
                writer.append_many([f"item{i}" for i in range(done, done + count)], np.zeros((count, *shape), np.float16))
                done += count
        cache = LatentCache(os.path.join(tmp, "cache"))
        chunks = item_chunks(cache, 512)
        return {"shape, cache": timed_plans(lambda: ShapeBucketBatchSampler(cache.shapes, BATCH), n, runs),
                "shape windowed K=8, cache": timed_plans(
                    lambda: ShapeBucketBatchSampler(cache.shapes, BATCH, chunks=chunks, chunk_window=8), n, runs)}


def scale_report(sizes=(10**6, 10**7, 10**8), runs: int = 3, shapes_max: int = 10**7, kinds=SCALE_KINDS,
                 cache_items: int = 0) -> dict:
    result = {"batch": BATCH, "runs": runs, "rows": {}, "ids_from_shapes": {}}

    def report(label: str, row: dict) -> None:
        result["rows"][label] = row
        print(f"{label}: plan {row['plan_s']['median']:.2f} s ({row['plan_vs_permutation']['median']:.2f}x a permutation, "
              f"numpy's plan {row['native_speedup']:.2f}x its time), load {row['load_average']:.1f}", flush=True)

    for n in sizes:
        for kind in kinds:
            report(f"{kind} @ {n:.0e}", scale_row(kind, n, runs))
        if n <= shapes_max:
            result["ids_from_shapes"][f"{n:.0e}"] = ids_from_shapes_seconds(n, runs)
    if cache_items:
        for label, row in cache_rows(cache_items, runs).items():
            report(f"{label} @ {cache_items:.0e}", row)
    print_scale(result)
    return result


def print_scale(result: dict) -> None:
    def span(t: dict, digits: int = 2) -> str:
        return f"{t['median']:.{digits}f} [{t['min']:.{digits}f}-{t['max']:.{digits}f}]"

    rows = [[label, round(r["build_s"], 2), span(r["plan_s"]), span(r["plan_vs_permutation"]), span(r["permutation_s"]),
             round(r["numpy_plan_s"], 2), round(r["native_speedup"], 2), "yes" if r["same_plan"] else "NO",
             round(r["first_batch_s"], 2), r["kept_bytes_per_item"], r["plan_bytes_per_item"], r["peak_bytes_per_item"],
             round(r["load_average"], 1)] for label, r in result["rows"].items()]
    native = "native passes" if sampler_module.NATIVE is not None else "NO native library: numpy's passes both ways"
    print(format_table(f"samplers at scale, synthetic bucket ids (the rows ', cache': a real cache's), batches of {result['batch']}, {result['runs']} epochs each, {native}",
                       ["sampler @ N", "build s", "plan s", "/ perm", "perm s", "numpy plan s", "native x", "same",
                        "first batch s", "kept B/item", "plan B/item", "peak B/item", "load"], rows))
    if result["ids_from_shapes"]:
        print(format_table("bucket ids from a mapped [N, 4] int64 shapes table, 100 shapes", ["N", "ids from shapes s"],
                           [[n, span(t)] for n, t in result["ids_from_shapes"].items()]))


def run_report(quick: bool = False) -> dict:
    sizes = {"lines": 16384 if quick else 65536, "images": 2048 if quick else 8192}
    result = {"nodes": NODES, "batch": BATCH, "sampler_chunk_bytes": SAMPLER_CHUNK, "local_chunk_bytes": CHUNK_BYTES,
              "scenarios": {name: scenario(name, n) for name, n in sizes.items()}}
    result["load_average"] = os.getloadavg()
    print_report(result)
    result["scale"] = scale_report(sizes=(10**5 if quick else 10**6,), runs=3)
    return result


def print_report(result: dict) -> None:
    header = ["order", *(f"{u} {m}" for u in ("16K", "1M") for m in ("fetch x", "bytes x", "GETs/b")),
              "16K bytes x 1 node", "spread", "same-chunk %", "nbr gap", "rho"]
    for name, sc in result["scenarios"].items():
        rows = [[label, *(r[u][m] for u in ("16K", "1M") for m in ("fetch_ratio", "bytes_ratio", "gets_per_batch")),
                 r["16K one node"]["bytes_ratio"], r["spread_vs_full"], 100 * r["same_chunk"], r["nbr_gap_vs_full"],
                 round(r["rho"], 3)] for label, r in sc["rows"].items()]
        title = (f"{name}: {sc['items']} items, {sc['data_mib']:.0f} MiB, {sc['sampler_chunks']} sampler chunks of 1 MiB, "
                 f"{result['nodes']} nodes, local cache {sc['budget_mib']:.0f} MiB each (fetch/bytes per node; "
                 f"spread and nbr gap relative to the full shuffle)")
        print(format_table(title, header, rows) + "\n")


@pytest.mark.parametrize("order", ["full shuffle", "K=16"])
def test_epoch_order(benchmark, order):
    """One epoch's batches of 100k images in 3 buckets (the cost set_epoch's first batch pays)."""
    shapes, starts, _ = image_cache(100_000)
    kw = {} if order == "full shuffle" else {"chunks": item_chunks(starts, SAMPLER_CHUNK), "chunk_window": 16}
    benchmark(ShapeBucketBatchSampler(shapes, BATCH, **kw).epoch_batches)


def _option(args: list[str], name: str, default: str) -> str:
    return args[args.index(name) + 1] if name in args else default


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--scale" in args:
        kinds = [SCALE_KINDS[int(k)] for k in _option(args, "--kinds", ",".join(map(str, range(len(SCALE_KINDS))))).split(",")]
        scale_report(sizes=[int(float(x)) for x in _option(args, "--sizes", "1e6,1e7,1e8").split(",")],
                     runs=int(_option(args, "--runs", "3")), shapes_max=int(float(_option(args, "--shapes-max", "1e7"))),
                     kinds=kinds, cache_items=int(float(_option(args, "--cache", "0"))))
    else:
        run_report(quick="--quick" in args)
