"""The index at scale: what a cache of N tiny items costs every process, beside its reads (issue 33).

Caches of N = 10^4, 10^5, 10^6 tiny items (``[4, 1, 1]`` float16, 8 bytes each; keys ``item{i:09d}``)
written with :class:`~latentfast.cache.LatentCacheWriter` (``flush_every=4096``). Each reader figure is
measured in a fresh Python process (imports done and a 1,000-item cache opened first, so the figure is
the cache's, not the first import's):

- **open**: wall time of ``LatentCache(folder)``; **anon after open**: growth of the process's anonymous
  memory (``RssAnon`` of ``/proc/self/status``: heap, not the mapped index files, whose pages are the page
  cache's and shared by every process of the node);
- **pickle**: bytes of ``pickle.dumps(cache)`` (what a spawned DataLoader worker receives);
- **+ after lookups**: anonymous growth after 1,000 ``cache.index(key)`` of random keys and one
  ``read_batch`` of 64 random items with ``return_keys=True``;
- **writer**: microseconds per tiny item appended one by one (``append``) and in batches of 4,096
  (``append_many``): the appends' wall time / N, ``finish`` apart, and (``append_many``) the process's
  CPU time / N (wall minus CPU: the fsyncs of the durability points and, on a shared host, waiting for a
  core); the writer process's anonymous memory growth (``RssAnon``) over each run (and after its
  ``finish``), and its file-backed growth (``RssFile``: the pages of the mapped key-hash table, the
  page cache's).

Targets at 10^6 (issue 33): open <= 20 ms, anon after open <= 8 MiB, pickle <= 64 KiB, <= +16 MiB after the
lookups and the keyed batch, writer growth <= 64 MiB, <= 5 us per tiny item. Median and range of ``runs``
fresh processes per reader figure; the writer is timed ``writer_runs`` times at each N (``append`` and
``append_many`` alike); the last ``append_many`` build is the cache the readers open. The writer's ``flush_every`` is
4,096: one durability point (an fdatasync of the data, then an fsync of the log) per batch.

``--scale`` (issue 33's bench at 10^8 items) takes caches of N = 10^6, 10^7, 10^8 tiny items (``--sizes``)
in ``--dir`` (default :data:`SCALE_DIR`), built there with ``append_many`` or kept from an earlier run when
they open as complete with N items, and measures in fresh processes (the reader's with the cache's files
dropped from the page cache first, so every N starts cold): open ms; the first and second keyed
batch of 64 random items (``return_keys=True``) and the anonymous memory they add; 1,000 random
``cache.index(key)``, ``key in cache`` (half absent) and ``cache.key(i)``, us each, then the same again (their
index blocks checked by then); the private memory (``Private_Dirty`` of ``/proc/self/smaps_rollup``) of each of
8 forked and 8 spawned workers (``multiprocessing`` contexts) that receive the opened cache and read 4 keyed
batches; a :class:`~latentfast.cache.LatentLoader`'s bucket sampler on the cache's shapes (the loader built,
3 epoch plans, an epoch's first batch); ``verify_cache`` with the cache's files dropped from the page cache
first (items/s, GB/s, the most anonymous memory it added). A table per kind of figure, N in rows. ``--only``
measures some kinds; ``--hot`` starts each reader with the cache's files read into the page cache instead.

    python -m latentfast.bench.bench_index [--quick] [--runs 5]
    python -m latentfast.bench.bench_index --scale [--sizes 1e6,1e7,1e8] [--dir DIR] [--runs 3] [--workers 8]
        [--only reader,workers,plan,verify] [--hot] [--json OUT]
    pytest latentfast/bench/bench_index.py --benchmark-only
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from latentfast.bench.common import format_table, machine_summary

SIZES = (10_000, 100_000, 1_000_000)
QUICK_SIZES = (10_000, 100_000)
LOOKUPS = 1000
BATCH = 64
BULK = 4096  # items per append_many


def anon_bytes(kind: str = "RssAnon") -> int:
    """This process's anonymous resident memory (``RssAnon``; or ``kind``, e.g. ``RssFile``), in bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(kind + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {kind} line (not Linux?)")


def key_of(i: int) -> str:
    return f"item{i:09d}"


def write_tiny(folder: str, n: int, bulk: bool = False, progress: bool = False) -> dict:
    """Write a cache of ``n`` tiny items (``bulk``: by ``append_many`` of :data:`BULK` items; ``progress``: a
    line to stderr every 1% of the items);
    ``{"us_per_item", "cpu_us_per_item", "finish_s", "anon_growth", "file_growth", "anon_after_finish"}``."""
    from latentfast.cache import LatentCacheWriter

    latent = np.zeros((4, 1, 1), np.float16)
    batch = np.zeros((BULK, 4, 1, 1), np.float16)
    before, before_file = anon_bytes(), anon_bytes("RssFile")
    writer = LatentCacheWriter(folder, "train", flush_every=4096)
    start, cpu = time.perf_counter(), time.process_time()
    if bulk:
        for s in range(0, n, BULK):
            keys = [key_of(i) for i in range(s, min(n, s + BULK))]
            writer.append_many(keys, batch[: len(keys)])
            if progress and (s // BULK) % max(1, n // BULK // 100) == 0:
                print(f"{time.strftime('%H:%M:%S')} {folder}: {s + len(keys):,} of {n:,} items appended "
                      f"({time.perf_counter() - start:.0f} s)", file=sys.stderr, flush=True)
    else:
        for i in range(n):
            writer.append(key_of(i), latent)
    appended, cpu = time.perf_counter(), time.process_time() - cpu
    grown, grown_file = anon_bytes() - before, anon_bytes("RssFile") - before_file
    writer.finish()
    if progress:
        print(f"{time.strftime('%H:%M:%S')} {folder}: finished ({time.perf_counter() - appended:.0f} s)", file=sys.stderr, flush=True)
    return {"us_per_item": (appended - start) / n * 1e6, "cpu_us_per_item": cpu / n * 1e6, "finish_s": time.perf_counter() - appended,
            "anon_growth": grown, "file_growth": grown_file, "anon_after_finish": anon_bytes() - before}


def read_figures(folder: str, warm: str, seed: int = 0) -> dict:
    """Open, pickle and look keys up in the cache at ``folder`` (``warm``: a small cache opened first)."""
    from latentfast.cache import LatentCache, read_batch

    LatentCache(warm).index(key_of(0))  # imports and first-use code paths, not this cache's cost
    read_batch(LatentCache(warm), [0], return_keys=True)
    before = anon_bytes()
    start = time.perf_counter()
    cache = LatentCache(folder)
    opened = time.perf_counter()
    after_open = anon_bytes()
    blob = len(pickle.dumps(cache))
    rng = np.random.default_rng(seed)
    n = len(cache)
    for i in rng.integers(0, n, LOOKUPS).tolist():
        if cache.index(key_of(i)) != i:
            raise AssertionError(f"index({key_of(i)!r}) is not {i}")
    picked = rng.integers(0, n, BATCH)
    keys = read_batch(cache, picked, return_keys=True)[2]
    if keys != [key_of(i) for i in picked.tolist()]:
        raise AssertionError("the keyed batch's keys are not its items'")
    return {"open_ms": (opened - start) * 1e3, "anon_after_open": after_open - before, "pickle_bytes": blob,
            "anon_after_lookups": anon_bytes() - after_open}


def _child(*args: str, progress: bool = False) -> dict:
    """Run this module's ``--child`` entry in a fresh interpreter; its JSON result (``progress``: its
    stderr passes through, not kept for the error)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), os.environ.get("PYTHONPATH")] if p)}
    done = subprocess.run([sys.executable, "-m", "latentfast.bench.bench_index", "--child", *args], stdout=subprocess.PIPE,
                          stderr=None if progress else subprocess.PIPE, text=True, env=env, timeout=4 * 3600)
    if done.returncode != 0:
        raise RuntimeError(f"bench_index child {args} failed:\n{(done.stderr or '(its stderr above)')[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(sizes=SIZES, runs: int = 3, writer_runs: int = 3) -> dict:
    out = {}
    with tempfile.TemporaryDirectory(prefix="latentfast_index_") as tmp:
        warm = os.path.join(tmp, "warm")
        _child("write", warm, "1000")
        for n in sizes:
            folder = os.path.join(tmp, f"n{n}")
            single = [_child("write", os.path.join(tmp, f"w{n}-{r}"), str(n)) for r in range(writer_runs)]
            bulk = [_child("write", os.path.join(tmp, f"b{n}-{r}"), str(n), "bulk") for r in range(writer_runs - 1)]
            bulk.append(_child("write", folder, str(n), "bulk"))  # (the last: the cache the readers open)
            reads = [_child("read", folder, warm, str(r)) for r in range(runs)]
            out[n] = {"writer": single, "writer_bulk": bulk, "reader": reads}
            for r in range(writer_runs):
                shutil.rmtree(os.path.join(tmp, f"w{n}-{r}"), ignore_errors=True)
                shutil.rmtree(os.path.join(tmp, f"b{n}-{r}"), ignore_errors=True)
    return out


def _spread(values, scale=1.0, fmt="{:.3g}") -> str:
    values = [v * scale for v in values]
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


MiB = 1 / 2**20


def run_report(quick: bool = False, runs: int = 3) -> dict:
    sizes = QUICK_SIZES if quick else SIZES
    figures = measure(sizes, runs=runs, writer_runs=1 if quick else 3)
    load = os.getloadavg()[0]
    rows = []
    for n, f in figures.items():
        r, w, b = f["reader"], f["writer"], f["writer_bulk"]
        rows.append([f"{n:,}", _spread([x["open_ms"] for x in r]), _spread([x["anon_after_open"] for x in r], MiB),
                     _spread([x["pickle_bytes"] for x in r], 1 / 1024), _spread([x["anon_after_lookups"] for x in r], MiB),
                     _spread([x["us_per_item"] for x in w]), _spread([x["us_per_item"] for x in b]), _spread([x["cpu_us_per_item"] for x in b]),
                     _spread([x["anon_growth"] for x in w], MiB), _spread([x["anon_growth"] for x in b], MiB),
                     _spread([x["anon_after_finish"] for x in b], MiB), _spread([x["file_growth"] for x in b], MiB),
                     _spread([x["finish_s"] for x in b])])
    print(format_table(
        f"caches of N tiny [4, 1, 1] f16 items: median [range] of {runs} fresh processes per reader figure, "
        f"writer runs as listed (host load average {load:.1f})",
        ["N", "open ms (<= 20)", "anon after open MiB (<= 8)", "pickle KiB (<= 64)", "+ after 1,000 lookups + keyed batch MiB (<= 16)",
         "append us/item", f"append_many({BULK}) us/item (<= 5)", "... CPU us/item", "append: writer anon growth MiB (<= 64)",
         "append_many: anon growth MiB (<= 64)", "... after finish MiB", "... RssFile growth MiB", "append_many finish s"], rows))
    largest = figures[max(figures)]
    summary = {f"{k}[{max(figures)}]": round(statistics.median(x[k] for x in largest["reader"]), 4)
               for k in ("open_ms", "pickle_bytes")}
    summary.update({f"anon_after_open_MiB[{max(figures)}]": round(statistics.median(x["anon_after_open"] for x in largest["reader"]) * MiB, 2),
                    f"anon_after_lookups_MiB[{max(figures)}]": round(statistics.median(x["anon_after_lookups"] for x in largest["reader"]) * MiB, 2),
                    f"writer_us_per_item[{max(figures)}]": round(statistics.median(x["us_per_item"] for x in largest["writer"]), 2),
                    f"append_many_us_per_item[{max(figures)}]": round(statistics.median(x["us_per_item"] for x in largest["writer_bulk"]), 2),
                    f"append_many_cpu_us_per_item[{max(figures)}]": round(statistics.median(x["cpu_us_per_item"] for x in largest["writer_bulk"]), 2),
                    f"writer_anon_growth_MiB[{max(figures)}]": round(statistics.median(x["anon_growth"] for x in largest["writer"]) * MiB, 1),
                    f"append_many_anon_growth_MiB[{max(figures)}]": round(statistics.median(x["anon_growth"] for x in largest["writer_bulk"]) * MiB, 1)})
    return {"machine": {**machine_summary(), "load_average_1min": load}, "figures": {str(n): f for n, f in figures.items()},
            "summary": summary}


# ---- at scale: caches of 10^6 to 10^8 items, what a training job pays in each process --------------------
SCALE_SIZES = (10**6, 10**7, 10**8)
SCALE_DIR = os.path.join(tempfile.gettempdir(), "latentfast_index_scale")  # (--dir: the caches are kept there, reused)
WORKERS = 8
WORKER_BATCHES = 4  # keyed batches of BATCH random items each worker reads
PLAN_EPOCHS = 3


def private_bytes() -> dict:
    """This process's ``Private_Dirty`` from ``/proc/self/smaps_rollup`` (pages no other process shares
    that it has written: its heap and the copy-on-write pages it touched; the mapped index files it reads
    are clean pages, the page cache's) and its ``RssAnon`` (which, in a forked process, also counts the
    anonymous pages it still shares with its parent), in bytes."""
    with open("/proc/self/smaps_rollup") as fh:
        dirty = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("Private_Dirty:"))
    return {"private_dirty": dirty, "rss_anon": anon_bytes()}


def scale_cache(folder: str, n: int) -> str:
    """Make ``folder`` a cache of ``n`` tiny items (:func:`write_tiny` by ``append_many``, a progress line
    on stderr every 1%), or keep the one there if it opens as complete (the meta's completion mark,
    the index's last block checked) with ``n`` items, the last keyed :func:`key_of` ``(n - 1)``.
    Returns ``"reused"`` or ``"built"``."""
    from latentfast.cache import LatentCache
    from latentfast.errors import CacheError

    try:
        cache = LatentCache(folder)
        if len(cache) == n and cache.key(n - 1) == key_of(n - 1):
            return "reused"
    except (OSError, CacheError):
        pass
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(folder)), exist_ok=True)
    _child("write", folder, str(n), "bulk", "progress", progress=True)
    return "built"


def _picks(n: int, rng: np.random.Generator, count: int = BATCH) -> np.ndarray:
    return rng.integers(0, n, count)


def _per_call_us(calls, expected) -> float:
    """Microseconds per call of the zero-argument ``calls``; their results must be ``expected``."""
    start = time.perf_counter()
    got = [call() for call in calls]
    seconds = time.perf_counter() - start
    if got != expected:
        raise AssertionError(f"lookups returned wrong results, e.g. {next(g for g, e in zip(got, expected) if g != e)!r}")
    return seconds / len(calls) * 1e6


def scale_reader(folder: str, warm: str, seed: int = 0) -> dict:
    """One fresh process's open, first (and second) keyed batch and key lookups of the cache at ``folder``;
    imports and first-use code paths are paid on the small cache ``warm`` first."""
    from latentfast.cache import LatentCache, read_batch

    small = LatentCache(warm)
    read_batch(small, [0, 1], return_keys=True)
    _ = small.index(key_of(0)), key_of(1) in small, "absent" in small, small.key(0)
    base = private_bytes()
    start = time.perf_counter()
    cache = LatentCache(folder)
    open_ms = (time.perf_counter() - start) * 1e3
    opened = private_bytes()
    n, rng = len(cache), np.random.default_rng(seed)
    batch_ms = []
    for _ in range(2):  # the first batch, then a second (its blocks mostly unchecked still)
        picked = _picks(n, rng)
        start = time.perf_counter()
        keys = read_batch(cache, picked, return_keys=True)[2]
        batch_ms.append((time.perf_counter() - start) * 1e3)
        if keys != [key_of(i) for i in picked.tolist()]:
            raise AssertionError("the keyed batch's keys are not its items'")
    after_batch = private_bytes()
    # each kind of lookup on 1,000 random items, then the same again (their index blocks checked by then)
    rows = _picks(n, rng, LOOKUPS).tolist()
    index_us = [_per_call_us([lambda k=key_of(i): cache.index(k) for i in rows], rows) for _ in range(2)]
    present = [j % 2 == 1 for j in range(LOOKUPS)]  # half present, half absent (a miss searches as far as a hit)
    probes = [key_of(i) if hit else f"absent{i:09d}" for hit, i in zip(present, _picks(n, rng, LOOKUPS).tolist())]
    contains_us = [_per_call_us([lambda k=k: k in cache for k in probes], present) for _ in range(2)]
    rows = _picks(n, rng, LOOKUPS).tolist()
    key_us = [_per_call_us([lambda i=i: cache.key(i) for i in rows], [key_of(i) for i in rows]) for _ in range(2)]
    done = private_bytes()
    return {"open_ms": open_ms, "first_batch_ms": batch_ms[0], "second_batch_ms": batch_ms[1],
            "index_us": index_us[0], "contains_us": contains_us[0], "key_us": key_us[0],
            "index_again_us": index_us[1], "contains_again_us": contains_us[1], "key_again_us": key_us[1],
            "anon_open": opened["rss_anon"] - base["rss_anon"], "anon_first_batch": after_batch["rss_anon"] - opened["rss_anon"],
            "anon_lookups": done["rss_anon"] - after_batch["rss_anon"]}


def _worker(cache, blob, warm: str, seed: int, results) -> None:
    """One worker: receive the cache (``blob``: pickled, as a spawned DataLoader worker gets it; else the
    parent's object, inherited by fork), read :data:`WORKER_BATCHES` keyed batches of random items,
    report its private memory before it received the cache (imports and first-use paths paid on the
    small cache ``warm``) and at the end."""
    from latentfast.cache import LatentCache, read_batch

    read_batch(LatentCache(warm), [0, 1], return_keys=True)
    start = private_bytes()
    cache = pickle.loads(blob) if blob is not None else cache
    rng = np.random.default_rng(seed)
    for _ in range(WORKER_BATCHES):
        picked = _picks(len(cache), rng)
        if read_batch(cache, picked, return_keys=True)[2] != [key_of(i) for i in picked.tolist()]:
            raise AssertionError("a worker's keyed batch has the wrong keys")
    results.put({"start": start, "end": private_bytes()})


def scale_workers(folder: str, warm: str, method: str, workers: int = WORKERS) -> dict:
    """Start ``workers`` real processes (``multiprocessing`` context ``method``: fork or spawn) over the
    cache at ``folder``, which this process has opened and read a batch from (as a loader's main process
    has); each worker's :func:`_worker` figures, and the pickle's size (what spawn sends each one). All
    run at once, as a loader's workers do."""
    import multiprocessing

    from latentfast.bench import bench_index  # (the workers' target by its module name, not __main__)
    from latentfast.cache import LatentCache, read_batch

    cache = LatentCache(folder)
    read_batch(cache, _picks(len(cache), np.random.default_rng(0)), return_keys=True)
    blob = pickle.dumps(cache) if method == "spawn" else None
    context = multiprocessing.get_context(method)
    results = context.Queue()
    procs = [context.Process(target=bench_index._worker, args=(None if blob else cache, blob, warm, 100 + k, results))
             for k in range(workers)]
    for proc in procs:
        proc.start()
    figures = [results.get(timeout=1800) for _ in procs]
    for proc in procs:
        proc.join()
        if proc.exitcode != 0:
            raise RuntimeError(f"a {method} worker exited with {proc.exitcode}")
    return {"workers": figures, "pickle_bytes": len(pickle.dumps(cache))}


def scale_plan(folder: str, warm: str) -> dict:
    """A :class:`~latentfast.cache.LatentLoader`'s sampler over the cache at ``folder`` (its real bucket
    sampler on the cache's shapes): the loader's construction (which reads the shapes and makes the bucket
    ids), :data:`PLAN_EPOCHS` epoch plans, the first batch of an epoch, and the anonymous memory they keep."""
    from latentfast.cache import LatentCache, LatentLoader

    next(iter(LatentLoader(LatentCache(warm), BATCH)))
    cache = LatentCache(folder)
    base = anon_bytes()
    start = time.perf_counter()
    loader = LatentLoader(cache, BATCH, seed=0)
    build_s = time.perf_counter() - start
    built = anon_bytes()
    plans = []
    for epoch in range(PLAN_EPOCHS):
        loader.sampler.set_epoch(epoch)
        start = time.perf_counter()
        plan = loader.sampler.epoch_batches()
        plans.append(time.perf_counter() - start)
        del plan
    loader.set_epoch(PLAN_EPOCHS)
    start = time.perf_counter()
    latents = next(iter(loader))["latent"]
    first_s = time.perf_counter() - start
    if latents.shape[0] != BATCH:
        raise AssertionError(f"the loader's first batch has {latents.shape[0]} items")
    return {"build_s": build_s, "plan_s": plans, "first_batch_s": first_s, "sampler": type(loader.sampler).__name__,
            "anon_loader": built - base, "sampler_bytes": int(loader.sampler.nbytes)}


def evict_files(folder: str) -> int:
    """Drop every file of the cache at ``folder`` from the page cache; the bytes still resident after."""
    from latentfast.cache.feed import coldread

    return sum(coldread.evict(os.path.join(folder, f)) or 0 for f in sorted(os.listdir(folder)))


def read_files(folder: str) -> int:
    """Read every file of the cache at ``folder`` once (into the page cache); the bytes resident after."""
    from latentfast.cache.feed import coldread

    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb", buffering=0) as fh:
            while fh.read(16 << 20):
                pass
    return sum(coldread.resident_bytes(os.path.join(folder, f)) or 0 for f in sorted(os.listdir(folder)))


class AnonPeak:
    """The most ``RssAnon`` this process had while the ``with`` block ran, sampled every 20 ms by a thread
    (``VmHWM`` would count the mapped files' pages too)."""

    def __enter__(self) -> "AnonPeak":
        import threading

        self.peak, self._done = anon_bytes(), threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._done.wait(0.02):
            self.peak = max(self.peak, anon_bytes())

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, anon_bytes())


def scale_verify(folder: str) -> dict:
    """``verify_cache`` of the cache at ``folder``, its files dropped from the page cache first (and the
    bytes still resident said); items/s, GB/s of the data file and of every file of the cache, and the
    most anonymous memory it added."""
    from latentfast.cache import verify_cache

    paths = [os.path.join(folder, f) for f in sorted(os.listdir(folder))]
    resident = evict_files(folder)
    before = anon_bytes()
    with AnonPeak() as peak:
        start = time.perf_counter()
        report = verify_cache(folder)
        seconds = time.perf_counter() - start
    total = sum(os.path.getsize(p) for p in paths)
    return {"seconds": seconds, "items_per_s": report["rows"] / seconds, "data_gb_per_s": report["bytes"] / seconds / 1e9,
            "files_gb_per_s": total / seconds / 1e9, "files_bytes": total, "resident_before": resident,
            "peak_anon_growth": peak.peak - before}


SCALE_PARTS = ("reader", "workers", "plan", "verify")


def measure_scale(sizes=SCALE_SIZES, folder: str = SCALE_DIR, runs: int = 3, workers: int = WORKERS,
                  parts=SCALE_PARTS, hot: bool = False) -> dict:
    """The scale figures of ``parts`` for each N in ``sizes``: the cache ``folder/n{N}`` built or reused, then
    fresh processes; the reader's start with the cache's files dropped from the page cache (``hot``: read in)."""
    warm = os.path.join(folder, "warm")
    scale_cache(warm, 1000)
    out = {}
    for n in sizes:
        path = os.path.join(folder, f"n{n}")
        how = scale_cache(path, n)
        print(f"{time.strftime('%H:%M:%S')} n={n:,}: cache {how}; measuring (load {os.getloadavg()[0]:.1f})",
              file=sys.stderr, flush=True)
        f = out[n] = {"cache": how}
        if "reader" in parts:
            f["reader"] = []
            for r in range(runs):
                f["resident"] = read_files(path) if hot else evict_files(path)
                f["reader"].append(_child("scale-read", path, warm, str(r)))
        if "workers" in parts:
            f["fork"], f["spawn"] = (_child("scale-workers", path, warm, method, str(workers)) for method in ("fork", "spawn"))
        if "plan" in parts:
            f["plan"] = _child("scale-plan", path, warm)
        if "verify" in parts:
            f["verify"] = _child("scale-verify", path)
        f["load"] = os.getloadavg()[0]
    return out


def scale_report(sizes=SCALE_SIZES, folder: str = SCALE_DIR, runs: int = 3, workers: int = WORKERS, parts=SCALE_PARTS,
                 hot: bool = False) -> dict:
    figures = measure_scale(sizes, folder, runs, workers, parts, hot)
    reader_rows, worker_rows, plan_rows, verify_rows = [], [], [], []
    for n, f in figures.items():
        if "reader" in f:
            r = f["reader"]
            reader_rows.append([f"{n:,}", _spread([x["open_ms"] for x in r]), _spread([x["first_batch_ms"] for x in r]),
                                _spread([x["second_batch_ms"] for x in r]), _spread([x["anon_open"] for x in r], MiB),
                                _spread([x["anon_first_batch"] for x in r], MiB),
                                *(f"{_spread([x[k] for x in r])} / {statistics.median(x[k.replace('_us', '_again_us')] for x in r):.3g}"
                                  for k in ("index_us", "contains_us", "key_us")),
                                _spread([x["anon_lookups"] for x in r], MiB), f"{f['resident'] / 2**20:.0f}", f"{f['load']:.1f}"])
        if "fork" in f:
            row = [f"{n:,}"]
            for method in ("fork", "spawn"):
                w = f[method]["workers"]
                row += [_spread([x["end"]["private_dirty"] for x in w], MiB),
                        _spread([x["end"]["private_dirty"] - x["start"]["private_dirty"] for x in w], MiB)]
            row += [_spread([x["end"]["rss_anon"] - x["start"]["rss_anon"] for x in f["spawn"]["workers"]], MiB),
                    f"{f['spawn']['pickle_bytes'] / 1024:.2f}"]
            worker_rows.append(row)
        if "plan" in f:
            p = f["plan"]
            plan_rows.append([f"{n:,}", p["sampler"], f"{p['build_s']:.3g}", _spread(p["plan_s"]),
                              f"{statistics.median(p['plan_s']) / n * 1e9:.0f}", f"{p['first_batch_s']:.3g}",
                              f"{p['anon_loader'] / n:.2f}", f"{p['sampler_bytes'] / n:.2f}"])
        if "verify" in f:
            v = f["verify"]
            verify_rows.append([f"{n:,}", f"{v['seconds']:.1f}", f"{v['items_per_s'] / 1e6:.3g}", f"{v['data_gb_per_s']:.3g}",
                                f"{v['files_gb_per_s']:.3g}", f"{v['files_bytes'] / 1e9:.2f}", f"{v['resident_before'] / 2**20:.0f}",
                                f"{v['peak_anon_growth'] * MiB:.0f}"])
    state = "read into the page cache" if hot else "dropped from the page cache"
    if reader_rows:
        print(format_table(f"reader, median [range] of {runs} fresh processes, the cache's files {state} before each "
                           f"(tiny [4, 1, 1] f16 items, batches of {BATCH} random items with keys)",
                           ["N", "open ms", "first batch ms", "second batch ms", "anon after open MiB", "+ first batch MiB",
                            "index(key) us / again", "key in cache us / again", "key(i) us / again", "+ 6,000 lookups MiB",
                            "resident MiB", "load"], reader_rows))
    if worker_rows:
        print(format_table(f"{workers} workers each (median [range] over them), after {WORKER_BATCHES} keyed batches",
                           ["N", "fork Private_Dirty MiB", "fork growth MiB", "spawn Private_Dirty MiB", "spawn growth MiB",
                            "spawn RssAnon growth MiB", "pickle KiB"], worker_rows))
    if plan_rows:
        print(format_table(f"LatentLoader's sampler (batches of {BATCH}), {PLAN_EPOCHS} epoch plans",
                           ["N", "sampler", "loader built s", "epoch plan s", "plan ns/item", "first batch of an epoch s",
                            "loader anon B/item", "sampler kept B/item"], plan_rows))
    if verify_rows:
        print(format_table("verify_cache, the cache's files dropped from the page cache first",
                           ["N", "s", "M items/s", "data GB/s", "all files GB/s", "files GB", "resident before MiB",
                            "peak anon growth MiB"], verify_rows))
    return {"machine": {**machine_summary(), "load_average_1min": os.getloadavg()[0]},
            "figures": {str(n): f for n, f in figures.items()}}


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(int(float(s)) for s in text.split(","))


def _option(name: str, default):
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def test_open_and_lookups(benchmark):
    with tempfile.TemporaryDirectory(prefix="latentfast_index_") as tmp:
        write_tiny(os.path.join(tmp, "warm"), 100)
        write_tiny(os.path.join(tmp, "c"), 10_000)
        result = benchmark.pedantic(lambda: read_figures(os.path.join(tmp, "c"), os.path.join(tmp, "warm")), rounds=3, iterations=1)
        benchmark.extra_info.update(result)


def test_writer(benchmark):
    with tempfile.TemporaryDirectory(prefix="latentfast_index_") as tmp:
        runs = iter(range(100))
        result = benchmark.pedantic(lambda: write_tiny(os.path.join(tmp, f"w{next(runs)}"), 5_000), rounds=3, iterations=1)
        benchmark.extra_info.update(result)


CHILDREN = {"read": lambda folder, warm, seed: read_figures(folder, warm, int(seed)),
            "scale-read": lambda folder, warm, seed: scale_reader(folder, warm, int(seed)),
            "scale-workers": lambda folder, warm, method, workers: scale_workers(folder, warm, method, int(workers)),
            "scale-plan": scale_plan, "scale-verify": scale_verify}

if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        what, folder, *rest = sys.argv[2:]
        if what == "write":
            result = write_tiny(folder, int(rest[0]), "bulk" in rest[1:], "progress" in rest[1:])
        else:
            result = CHILDREN[what](folder, *rest)
        print(json.dumps(result))
    elif "--scale" in sys.argv:
        parts = tuple(_option("--only", ",".join(SCALE_PARTS)).split(","))
        report = scale_report(_sizes(_option("--sizes", "1e6,1e7,1e8")), _option("--dir", SCALE_DIR), int(_option("--runs", 3)),
                              int(_option("--workers", WORKERS)), parts, hot="--hot" in sys.argv)
        if "--json" in sys.argv:  # every figure, each run's
            with open(_option("--json", None), "w") as fh:
                json.dump(report, fh, indent=1)
    else:
        run_report(quick="--quick" in sys.argv, runs=int(_option("--runs", 3)))
