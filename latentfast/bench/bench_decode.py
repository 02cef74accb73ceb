"""Batch decode benchmark: batches of 64 random rows, with the page cache hot and with it cold.

Hot section -- caches of 128 MiB (32 in --quick) read once before timing, so the page cache holds
them. Every provider allocates its output each batch (like for like), except ``latentfast out=`` and
memcpy, which write into reused buffers (compared with each other); GB/s counts useful bytes (the
rows' real columns, float16). Providers:
  per-row reader   the specification's path: per-row memmap slice copy + torch.from_numpy, pad each
                   row with the white column, stack (the baseline)
  numpy fancy      vectorised numpy: ``mm[idx, :, :, :W]`` of the memmap + white fill with np.where (the
                   strongest baseline a user would write)
  tensordict       tensordict.MemoryMappedTensor indexing + white fill with torch.where ([bench] extra)
  latentfast       read_batch on the padded and on the ragged layout; ``out=``: padded, into an output
                   reused for batches of the same width (as a training loop reusing buffers)
  memcpy           one contiguous copy of as many bytes (64 MiB, and batch-sized) out of the same memmap
                   into a reused buffer: the ceilings; "% of memcpy" (of latentfast out=) uses the
                   faster (stricter) one

Cold section -- caches >= 1 GiB on disk (256 MiB in --quick), both layouts, padded rows of 8 KiB and
64 KiB. Before every timed batch every map of the data file is closed, the file is evicted
(fsync + posix_fadvise DONTNEED) and its resident bytes are measured (cachestat/mincore) and printed.
Providers: the per-row reader and numpy fancy indexing (each on a fresh np.memmap), per-item
safetensors files (what most trainers read today; one file per row of the timed batches, evicted
too), latentfast with the cold path off (pages fault in; MADV_RANDOM), latentfast as shipped
(read_batch, cold="auto"), and the parallel-pread ceiling (ops.read_spans: the batch's page-aligned
row spans read by 16 and by 64 pread workers into one buffer; the faster counts). Then a training
loop with a simulated 20 ms step (time.sleep: the host waits, as for a GPU step) reads from an
evicted cache with lookahead (the README's loop) and without, and reports how long each step waited
for its batch.

Contended section -- hot read_batch of 64 random full-width 32 KiB rows at torch's default threads and
at one thread, and the per-row reader (all allocating their output), then read_batch(out=) and
``np.take(memmap, idx, axis=0, out=)`` (one C loop of row copies into a reused array: the in-process
floor of the copy), with 0, 1 and one-per-core other processes each spinning on a core
(``while True: pass``); median [min-max] ms per batch over 7 passes (the fastest pass would hide the
stalls this measures).

Per-call section -- microseconds per call on tiny inputs (the fixed cost of dispatch and of entering
the compiled kernel): the gather_rows_into op per backend and read_batch of 4 small rows, uncontended
and with a busy process per core.

Run:  python -m latentfast.bench.bench_decode [--quick] [--hot-only | --cold-only | --contended-only | --per-call-only]
      pytest latentfast/bench/bench_decode.py --benchmark-enable (pytest-benchmark, hot, one test per provider)
``latentfast bench`` calls ``run_report(quick)``.
"""
from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import tempfile
import threading
import time

import numpy as np
import torch

from latentfast import ops
from latentfast.cache import LatentCache, LookaheadSampler, WidthBucketBatchSampler, cache_path
from latentfast.cache.feed import coldread as pf
from latentfast.cache.feed.gather import read_batch
from latentfast.cache import DevicePrefetcher
from latentfast.testing import torch_threads, write_random_cache

BATCH = 64
GEOMETRIES = [(16, 8, 256), (4, 8, 128)]  # (C, h, w_max): 64 KiB and 8 KiB padded rows
MIN_WIDTH_SHARE = 5  # real widths uniform in [w_max / 5, w_max]: 20-100% of the padded row
STEP_S = 0.020  # the simulated training step of the lookahead loop
HOT_NAMES = {"seed": "per-row reader", "numpy": "numpy fancy", "tensordict": "tensordict",
             "latentfast": "latentfast padded", "latentfast-ragged": "latentfast ragged",
             "latentfast-reuse": "latentfast padded out=", "memcpy-64MiB": "memcpy 64 MiB", "memcpy-batch": "memcpy batch-sized"}


def geometry_tag(geometry) -> str:
    channels, latent_h, w_max = geometry
    return f"C{channels} h{latent_h} w{w_max} ({channels * latent_h * w_max * 2 // 1024} KiB rows)"


def data_file(folder: str) -> str:
    return cache_path(folder, "train", "data")


# ---- the providers, hot and cold ---------------------------------------------------------------------
def open_memmap(folder: str) -> dict:
    """What the baselines read: the data file as a memmap (padded [N, C, h, w_max] or flat), widths, white."""
    cache = LatentCache(folder)  # reads the small index files only
    if cache.layout == "padded":
        shape = (len(cache), cache.channels, cache.latent_h, cache.w_max)
    else:
        shape = (int(cache.row_starts[-1]),)
    mm = np.memmap(data_file(folder), dtype=np.float16, mode="r", shape=shape)
    return {"mm": mm, "widths": cache.widths, "white": cache.white_column, "row_starts": cache.row_starts,
            "lines": (cache.channels, cache.latent_h), "layout": cache.layout}


def row_of(state: dict, i: int) -> np.ndarray:
    w = int(state["widths"][i])
    if state["layout"] == "padded":
        return state["mm"][i, :, :, :w]
    start = int(state["row_starts"][i])
    return state["mm"][start : start + state["lines"][0] * state["lines"][1] * w].reshape(*state["lines"], w)


def pad_and_stack(rows: list[torch.Tensor], white: torch.Tensor) -> torch.Tensor:
    W = max(row.shape[-1] for row in rows)
    return torch.stack([torch.cat([row, white.expand(-1, -1, W - row.shape[-1])], dim=-1) for row in rows])


def per_row_reader(state: dict, indices: np.ndarray) -> torch.Tensor:
    """The specification's path: copy each row out of the memmap, pad it with the white column, stack."""
    return pad_and_stack([torch.from_numpy(np.asarray(row_of(state, int(i))).copy()) for i in indices], state["white"])


def numpy_fancy(state: dict, indices: np.ndarray) -> torch.Tensor:
    """Vectorised numpy over the padded memmap: one fancy-indexing read, one np.where for the padding."""
    selected = state["widths"][indices]
    W = int(selected.max())
    batch = state["mm"][indices, :, :, :W]
    real = np.arange(W)[None, None, None, :] < selected[:, None, None, None]
    return torch.from_numpy(np.where(real, batch, state["white"].numpy()[None]))


def tensordict_reader(folder: str):
    """tensordict.MemoryMappedTensor indexing + white fill with torch.where, or None without tensordict."""
    try:
        from tensordict import MemoryMappedTensor
    except ImportError:  # the [bench] extra is not installed
        return None
    cache = LatentCache(folder)
    shape = torch.Size((len(cache), cache.channels, cache.latent_h, cache.w_max))
    mmt = MemoryMappedTensor.from_filename(data_file(folder), dtype=torch.float16, shape=shape)
    widths, white = torch.from_numpy(cache.widths), cache.white_column

    def read(indices):
        selected = widths[torch.from_numpy(indices)]
        W = int(selected.max())
        batch = mmt[torch.from_numpy(indices)][..., :W]
        return torch.where(torch.arange(W)[None, None, None, :] < selected[:, None, None, None], batch, white[None])

    return read


def useful_bytes(widths: np.ndarray, lines: int, indices: np.ndarray) -> int:
    return int(widths[indices].sum()) * lines * 2


# ---- hot ---------------------------------------------------------------------------------------------
def memcpy_fn(data: torch.Tensor, nbytes: int, rng: np.random.Generator):
    """Contiguous copies of ``nbytes`` from random places of the same hot memmap into one reused buffer."""
    n = min(nbytes // 2, data.numel())
    dst = torch.empty(n, dtype=torch.float16)
    starts = rng.integers(0, data.numel() - n + 1, size=64)
    state = {"k": 0}

    def copy(_idx=None):
        start = int(starts[state["k"] % len(starts)])
        state["k"] += 1
        dst.copy_(data[start : start + n])
        return dst

    return copy


def hot_providers(folders: dict) -> dict:
    """name -> function(int64 indices) -> padded batch, every one reading page-cache-hot files."""
    padded = open_memmap(folders["padded"])
    caches = {layout: LatentCache(folder) for layout, folder in folders.items()}
    found = {"seed": lambda idx: per_row_reader(padded, idx), "numpy": lambda idx: numpy_fancy(padded, idx)}
    td = tensordict_reader(folders["padded"])
    if td is not None:
        found["tensordict"] = td
    found["latentfast"] = lambda idx: read_batch(caches["padded"], idx)[0]
    found["latentfast-ragged"] = lambda idx: read_batch(caches["ragged"], idx)[0]
    found["latentfast-reuse"] = reused_output_reader(caches["padded"])
    return found


def reused_output_reader(cache: LatentCache):
    """read_batch into an output kept per batch width (``out=``), as a training loop that reuses its
    buffers does: compared with memcpy into a reused buffer, both sides skip the page faults of a
    fresh allocation."""
    outs: dict = {}

    def read(idx):
        width = int(cache.widths[idx].max())
        out = outs.get(width)
        if out is None:
            out = outs[width] = torch.empty(len(idx), cache.channels, cache.latent_h, width, dtype=torch.float16)
        return read_batch(cache, idx, out=out)[0]

    return read


def pass_times(fn, batches, repeats: int) -> list[float]:
    """Seconds per batch of each of ``repeats`` passes over ``batches`` (after a warm-up)."""
    for idx in batches[:3]:
        fn(idx)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for idx in batches:
            fn(idx)
        samples.append((time.perf_counter() - start) / len(batches))
    return samples


def time_per_batch(fn, batches, repeats: int) -> float:
    """Seconds per batch of the fastest of ``repeats`` passes: on a shared machine the least-disturbed
    pass is the figure that repeats (as timeit advises). (Under contention the median of pass_times is
    the figure instead: the fastest pass would hide exactly the stalls the contended section looks for.)"""
    return min(pass_times(fn, batches, repeats))


def python_progress_while(fn, batches, seconds: float = 0.2, rounds: int = 5) -> float:
    """Share of its idle pace that a pure-Python loop keeps while another thread decodes batches with
    ``fn`` (about 1 when ``fn`` releases the GIL and a core is free, far below when it holds it).
    Idle and busy windows alternate, and the median of the rounds' ratios is returned: on a shared
    host a single pair can be off by half either way."""
    return float(np.median([_progress_ratio(fn, batches, seconds) for _ in range(rounds)]))


def _progress_ratio(fn, batches, seconds: float) -> float:

    def count_for(duration):
        n, end = 0, time.perf_counter() + duration
        while time.perf_counter() < end:
            n += 1
        return n

    idle = count_for(seconds)
    stop = threading.Event()

    def decode():
        while not stop.is_set():
            for idx in batches:
                fn(idx)

    worker = threading.Thread(target=decode)
    worker.start()
    busy = count_for(seconds)
    stop.set()
    worker.join()
    return busy / idle


def measure_cuda(padded: LatentCache, batches, mean_useful: float, repeats: int) -> dict:
    """Batch-to-device throughput of read_batch(device="cuda") vs the plain pinned host-to-device copy
    of the same bytes; passes are pipelined (one synchronize per pass, so batch k+1's gather overlaps
    batch k's copy and expand)."""
    pinned = torch.empty(int(mean_useful) // 2, dtype=torch.float16, pin_memory=True)
    device_copy = torch.empty_like(pinned, device="cuda")

    def best_pass(fn):
        fn(batches[0])
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            for idx in batches:
                fn(idx)
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - start) / len(batches))
        return best

    seconds = {
        "pinned-h2d": best_pass(lambda _idx: device_copy.copy_(pinned, non_blocking=True)),
        "latentfast-cuda": best_pass(lambda idx: read_batch(padded, idx, device="cuda")),
        "latentfast-cuda-bf16": best_pass(lambda idx: read_batch(padded, idx, device="cuda", dtype=torch.bfloat16)),
    }
    return {name: {"ms": s * 1e3, "useful_gb_per_s": mean_useful / s / 1e9,
                   "share_of_pinned_h2d": seconds["pinned-h2d"] / s} for name, s in seconds.items()}


def measure_hot(geometry, cache_bytes: int, n_batches: int, repeats: int, thread_counts, root: str) -> dict:
    channels, latent_h, w_max = geometry
    n_rows = cache_bytes // (channels * latent_h * w_max * 2)
    folders = write_random_cache(os.path.join(root, "hot"), n_rows, channels, latent_h, w_max,
                                 min_width=w_max // MIN_WIDTH_SHARE)
    rng = np.random.default_rng(0)
    found = hot_providers(folders)
    padded = LatentCache(folders["padded"])
    data = padded.gather_source()[0]
    data.sum(dtype=torch.float32)  # page-cache hot: every byte read once
    LatentCache(folders["ragged"]).gather_source()[0].sum(dtype=torch.float32)
    batches = [rng.integers(0, n_rows, size=BATCH) for _ in range(n_batches)]
    mean_useful = statistics.mean(useful_bytes(padded.widths, channels * latent_h, idx) for idx in batches)
    expected = found["seed"](batches[0])
    for name, fn in found.items():  # every provider must return the same batch
        assert torch.equal(fn(batches[0]), expected), f"provider {name} disagrees with the per-row reader"
    found["memcpy-64MiB"] = memcpy_fn(data, 64 * 2**20, rng)
    found["memcpy-batch"] = memcpy_fn(data, int(mean_useful), rng)
    seconds = {}
    for threads in thread_counts:
        seconds[threads] = {}
        with torch_threads(threads):
            for name, fn in found.items():
                per = 64 * 2**20 if name == "memcpy-64MiB" else mean_useful
                seconds[threads][name] = time_per_batch(fn, batches, repeats) * mean_useful / per
    cuda = measure_cuda(padded, batches, mean_useful, repeats) if torch.cuda.is_available() else None
    with torch_threads(1):  # one decode thread, so a free core is left for the Python loop
        gil = {HOT_NAMES[name]: python_progress_while(found[name], batches) for name in ("seed", "latentfast")}
    return {"python_progress_while_decoding": gil, "cuda": cuda,
            "geometry": {"channels": channels, "latent_h": latent_h, "w_max": w_max}, "rows": n_rows,
            "cache_mib": n_rows * channels * latent_h * w_max * 2 / 2**20, "useful_bytes_per_batch": mean_useful,
            "seconds_per_batch": seconds}


# ---- contended ---------------------------------------------------------------------------------------
CONTENDED_GEOMETRY = (16, 8, 128)  # 32 KiB rows, every row full width
BUSY_LOOP = "while True:\n    pass\n"


@contextlib.contextmanager
def busy_cores(count: int):
    """``count`` processes that each keep a core busy (what DataLoader workers and other ranks do), for
    the ``with`` block (started and spinning before it runs, killed after)."""
    import subprocess

    loops = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(count)]
    try:
        time.sleep(0.2 if count else 0)  # the busy loops are running
        yield
    finally:
        for proc in loops:
            proc.kill()
            proc.wait()


def measure_contended(root: str, busy_counts=(0, 1), n_batches: int = 24, repeats: int = 7) -> dict:
    """read_batch of 64 random 32 KiB rows (hot) at torch's default threads and at one thread, and the
    per-row reader, with ``busy`` other processes each keeping a core busy; ms per batch per pass."""
    channels, latent_h, w_max = CONTENDED_GEOMETRY
    n_rows = 64 * 2**20 // (channels * latent_h * w_max * 2)
    folders = write_random_cache(os.path.join(root, "contended"), n_rows, channels, latent_h, w_max, min_width=w_max)
    cache, padded = LatentCache(folders["padded"]), open_memmap(folders["padded"])
    cache.gather_source()[0].sum(dtype=torch.float32)  # page-cache hot
    rng = np.random.default_rng(3)
    batches = [rng.integers(0, n_rows, size=BATCH) for _ in range(n_batches)]
    default_threads = torch.get_num_threads()
    out = torch.empty((BATCH, channels, latent_h, w_max), dtype=torch.float16)
    floor = np.empty((BATCH, channels, latent_h, w_max), dtype=np.float16)
    providers = {f"latentfast {default_threads} thr (default)": (default_threads, lambda idx: read_batch(cache, idx)[0]),
                 "latentfast 1 thr": (1, lambda idx: read_batch(cache, idx)[0]),
                 "per-row reader": (1, lambda idx: per_row_reader(padded, idx)),
                 "latentfast out= 1 thr": (1, lambda idx: read_batch(cache, idx, out=out)[0]),
                 "numpy take(out=)": (1, lambda idx: np.take(padded["mm"], idx, axis=0, out=floor, mode="clip"))}
    table = {}
    for busy in busy_counts:
        with busy_cores(busy):
            for name, (threads, fn) in providers.items():
                with torch_threads(threads):
                    table.setdefault(name, {})[busy] = [t * 1e3 for t in pass_times(fn, batches, repeats)]
    return {"geometry": dict(zip(("channels", "latent_h", "w_max"), CONTENDED_GEOMETRY)), "cores": os.cpu_count(),
            "default_threads": default_threads, "busy_counts": list(busy_counts), "ms_per_batch": table}


def print_contended(c: dict) -> dict:
    """The table (median [min-max] ms per batch) and the ratios the issue targets, per busy count."""
    names = list(c["ms_per_batch"])
    default, one, seed, reused, floor = names
    print(f"\nhot read_batch under contention: 64 x 32 KiB rows, {c['cores']} cores, busy = other processes "
          "each spinning on a core (median [min-max] ms per batch over the passes)")
    print(f"  {'provider':<28}" + "".join(f"{f'busy={b}':>26}" for b in c["busy_counts"]))
    for name in names:
        cells = [c["ms_per_batch"][name][b] for b in c["busy_counts"]]
        print(f"  {name:<28}" + "".join(f"{statistics.median(x):>10.3f} [{min(x):.3f}-{max(x):.3f}]".rjust(26)
                                         for x in cells))
    ratios = {}
    for b in c["busy_counts"]:
        med = {n: statistics.median(c["ms_per_batch"][n][b]) for n in names}
        ratios[b] = {"default_vs_1thread": med[one] / med[default], "default_vs_per_row": med[seed] / med[default],
                     "out_vs_numpy_take_out": med[floor] / med[reused]}
        print(f"  busy={b}: default threads run at {ratios[b]['default_vs_1thread']:.2f}x one thread's speed and "
              f"{ratios[b]['default_vs_per_row']:.2f}x the per-row reader's; out= at "
              f"{ratios[b]['out_vs_numpy_take_out']:.2f}x numpy take(out=) (one C loop of row copies: the floor)")
    return ratios


def per_call_overhead(root: str, rounds: int = 7, busy: int = 0) -> dict:
    """Microseconds per call on inputs too small to cost anything but the fixed overhead (CPU):
    the kernel-form gather_rows_into op on one row of [4, 2, 8] per backend, and read_batch of 4 rows
    of a small hot cache (the small-batch decode); thread CPU time (see cpu_us_per_call), median
    [min-max] of ``rounds`` rounds. Single-threaded: the inputs are far below the kernels' thread threshold.
    ``busy``: that many other processes spin on a core meanwhile (contended: caches and cores shared)."""
    from latentfast import backends
    from latentfast.bench.common import cpu_us_per_call

    data = torch.randn(4 * 2 * 8 * 4).half()
    offsets, widths = torch.arange(4, dtype=torch.int64) * 64, torch.tensor([8, 5, 8, 3], dtype=torch.int32)
    indices, white, out = torch.tensor([1]), torch.zeros(8).half(), torch.empty(1, 4, 2, 8, dtype=torch.float16)
    calls = {f"gather_rows_into op, backend={b}":
             (lambda b=b: torch.ops.latentfast.gather_rows_into(data, offsets, widths, 8, indices, white, out, b))
             for b, why in backends.availability("gather_rows_into", "cpu").items() if not why}
    folders = write_random_cache(os.path.join(root, "per-call"), 256, 4, 8, 32, min_width=8)
    cache = LatentCache(folders["padded"])
    small = np.array([3, 77, 12, 200])
    calls["read_batch of 4 rows (4x8x32)"] = lambda: read_batch(cache, small)
    table = {}
    with busy_cores(busy):
        for name, call in calls.items():
            samples = cpu_us_per_call(call, rounds=rounds)
            table[name] = {"us_median": statistics.median(samples), "us_min": min(samples), "us_max": max(samples)}
            print(f"{name}, busy={busy}: {table[name]['us_median']:.2f} us per call "
                  f"[{table[name]['us_min']:.2f}-{table[name]['us_max']:.2f}]")
    return table


# ---- cold --------------------------------------------------------------------------------------------
def evicted(paths) -> int:
    """Evict ``paths`` (every map of them closed first) and return the bytes still resident."""
    gc.collect()
    return sum(pf.evict(path) or 0 for path in paths)


def safetensors_items(folder: str, rows, directory: str) -> dict | None:
    """One ``<row>.safetensors`` file (tensor "latent" [C, h, w_i]) per row in ``rows``, or None without
    the safetensors package."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        return None
    cache = LatentCache(folder)
    os.makedirs(directory, exist_ok=True)
    paths = {}
    for i in sorted(set(int(r) for r in rows)):
        paths[i] = os.path.join(directory, f"{i}.safetensors")
        save_file({"latent": cache[i]}, paths[i])
    return {"paths": paths, "white": cache.white_column}


def cold_providers(layout: str, items) -> dict:
    """name -> (open(folder, indices) -> state, read(state, indices) -> batch or bytes, files(folder, indices)
    -> the paths the read touches). Opening (maps, index files, the ceiling's spans) is not timed."""

    def data(folder, indices):
        return [data_file(folder)]

    def memmap(folder, indices):
        return open_memmap(folder)

    def cache(folder, indices):  # opened and mapped, like the baselines' np.memmap (no data page is read)
        opened = LatentCache(folder)
        opened.gather_source()
        return opened

    found = {"per-row reader": (memmap, per_row_reader, data)}
    if layout == "padded":
        found["numpy fancy"] = (memmap, numpy_fancy, data)
    if items is not None:
        from safetensors.torch import load_file

        found["safetensors per item"] = (
            lambda folder, indices: items,
            lambda state, idx: pad_and_stack([load_file(state["paths"][int(i)])["latent"] for i in idx], state["white"]),
            lambda folder, idx: [items["paths"][int(i)] for i in idx],
        )
    found["latentfast cold=False"] = (cache, lambda cache, idx: read_batch(cache, idx, cold=False)[0], data)
    found["latentfast"] = (cache, lambda cache, idx: read_batch(cache, idx)[0], data)
    for threads in (16, 64):
        found[f"pread x{threads}"] = (_spans_of_rows, _pread(threads), data)
    return found


def _spans_of_rows(folder: str, indices) -> dict:
    """The ceiling's input: the batch's page-aligned row spans (what read_batch asks the kernel for)."""
    offsets, lengths = pf.row_spans(LatentCache(folder).row_starts, indices)
    return {"fd": os.open(data_file(folder), os.O_RDONLY), "offsets": offsets, "lengths": lengths}


def _pread(threads: int):
    def read(state, indices):
        return ops.read_spans(state["fd"], state["offsets"], state["lengths"], threads=threads)

    return read


def timed_cold_batch(folder, provider, indices, expected) -> tuple[float, int]:
    """(seconds, resident bytes before) of one batch read right after its files were evicted."""
    open_fn, read_fn, files_fn = provider
    resident = evicted(files_fn(folder, indices))
    state = open_fn(folder, indices)
    start = time.perf_counter()
    got = read_fn(state, indices)
    seconds = time.perf_counter() - start
    if isinstance(state, dict) and "fd" in state:
        os.close(state["fd"])
    if got.dtype != torch.uint8 and not torch.equal(got, expected):
        raise AssertionError("a cold provider returned another batch than the hot read")
    return seconds, resident


def lookahead_loop(folder: str, lookahead: int, steps: int, seed: int) -> dict:
    """The README's loop over an evicted cache: sampler -> read_batch -> DevicePrefetcher, a 20 ms step;
    how long each step waited for its batch."""
    resident = evicted([data_file(folder)])
    cache = LatentCache(folder)
    sampler = WidthBucketBatchSampler(cache.widths, BATCH, seed=seed)
    batches = (read_batch(cache, b) for b in LookaheadSampler(sampler, cache, lookahead))
    loop = iter(DevicePrefetcher(batches, "cpu", lookahead=lookahead))
    waits, batch = [], None
    for _ in range(steps):
        start = time.perf_counter()
        fresh = next(loop)
        waits.append(time.perf_counter() - start)
        batch = fresh  # the previous batch is freed here, in the step, as in a training loop
        time.sleep(STEP_S)
    del batch
    loop.close()
    waits_ms = np.array(waits) * 1e3
    return {"resident_before": resident, "steps": steps, "share_under_1ms": float(np.mean(waits_ms < 1.0)),
            "median_ms": float(np.median(waits_ms)), "p95_ms": float(np.percentile(waits_ms, 95)),
            "max_ms": float(waits_ms.max()), "first_ms": float(waits_ms[0])}


def measure_cold(geometry, cache_bytes: int, n_batches: int, steps: int, root: str) -> dict:
    """Every cold provider on both layouts of caches of >= ``cache_bytes`` each, then the loops."""
    channels, latent_h, w_max = geometry
    lines = channels * latent_h
    mean_ragged = lines * 2 * (w_max // MIN_WIDTH_SHARE + w_max) / 2
    n_rows = int(cache_bytes / mean_ragged) + 1  # the ragged file (the smaller) holds >= cache_bytes
    folders = write_random_cache(os.path.join(root, "cold"), n_rows, channels, latent_h, w_max, seed=1,
                                 min_width=w_max // MIN_WIDTH_SHARE)
    rng = np.random.default_rng(2)
    rows = rng.choice(n_rows, size=n_batches * BATCH, replace=False)  # no row is read twice
    batches = [rows[k * BATCH : (k + 1) * BATCH] for k in range(n_batches)]
    items = safetensors_items(folders["padded"], rows, os.path.join(root, "items"))
    widths = LatentCache(folders["padded"]).widths
    result = {"geometry": dict(zip(("channels", "latent_h", "w_max"), geometry)), "rows": n_rows,
              "file_gib": {layout: os.path.getsize(data_file(f)) / 2**30 for layout, f in folders.items()},
              "useful_bytes_per_batch": statistics.mean(useful_bytes(widths, lines, b) for b in batches),
              "layouts": {}, "loops": {}}
    for layout, folder in folders.items():
        hot = LatentCache(folder)
        expected = [read_batch(hot, b, cold=False)[0] for b in batches]
        del hot
        providers = cold_providers(layout, items)
        table = {name: {"ms": [], "resident_before": []} for name in providers}
        for b, e in zip(batches, expected):  # providers take turns on each batch: a disturbance hits all alike
            for name, provider in providers.items():
                seconds, resident = timed_cold_batch(folder, provider, b, e)
                table[name]["ms"].append(seconds * 1e3)
                table[name]["resident_before"].append(resident)
        result["layouts"][layout] = table
        for lookahead in (pf.DEFAULT_LOOKAHEAD, 0):
            result["loops"][f"{layout}, lookahead {lookahead}"] = lookahead_loop(folder, lookahead, steps, seed=3)
    return result


# ---- report ------------------------------------------------------------------------------------------
HOT_LEGEND = (
    "per-row reader: the specification's path (per-row memmap slice copy, torch.from_numpy, pad with the "
    "white column, stack); numpy fancy: mm[idx, :, :, :W] + np.where, the strongest plain baseline; "
    "tensordict: MemoryMappedTensor indexing + torch.where; latentfast out=: read_batch into an output "
    "reused across batches of the same width; memcpy: one contiguous copy of as many bytes into a reused "
    "buffer (the ceiling; latentfast out='s share uses the faster of the two)"
)


def print_hot(r: dict, thread_counts) -> dict:
    from latentfast.bench.common import format_table

    useful = r["useful_bytes_per_batch"]
    header = ["provider"]
    for t in thread_counts:
        header += [f"ms/batch @{t}thr", f"useful GB/s @{t}thr", f"latentfast faster (x) @{t}thr"]
    rows = []
    for name in r["seconds_per_batch"][thread_counts[0]]:
        row = [HOT_NAMES[name]]
        for t in thread_counts:
            sec = r["seconds_per_batch"][t]
            row += [sec[name] * 1e3, useful / sec[name] / 1e9, sec[name] / sec["latentfast"]]
        rows.append(row)
    g = r["geometry"]
    print("\n" + format_table(
        f"hot: B={BATCH} random rows of {geometry_tag((g['channels'], g['latent_h'], g['w_max']))}, widths 20-100%, "
        f"{r['rows']} rows ({r['cache_mib']:.0f} MiB padded, page cache hot), {useful / 2**20:.2f} MiB useful/batch; "
        "every provider allocates its output, except latentfast out= and memcpy (reused buffers); "
        f"host load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", header, rows))
    print("legend: " + HOT_LEGEND)
    ratios = {}
    for t in thread_counts:
        sec = r["seconds_per_batch"][t]
        lf = sec["latentfast"]
        ceiling = min(sec["memcpy-64MiB"], sec["memcpy-batch"])
        ratios[t] = {f"x_{name}": sec[name] / lf for name in ("seed", "numpy", "tensordict") if name in sec}
        ratios[t]["share_of_memcpy"] = ceiling / sec["latentfast-reuse"]
        print(f"@{t} thread(s), hot, both sides allocate: latentfast = {ratios[t]['x_seed']:.1f}x the per-row "
              f"reader, {ratios[t]['x_numpy']:.1f}x numpy fancy"
              + (f", {ratios[t]['x_tensordict']:.1f}x tensordict" if "x_tensordict" in ratios[t] else "")
              + f" (ragged layout {sec['latentfast'] / sec['latentfast-ragged']:.2f}x padded); both into reused "
              f"buffers: latentfast out= = {ratios[t]['share_of_memcpy']:.0%} of memcpy (the faster memcpy)")
    for name, figures in (r["cuda"] or {}).items():
        print(f"{name:<22} {figures['ms']:.3f} ms/batch {figures['useful_gb_per_s']:.2f} GB/s "
              f"= {figures['share_of_pinned_h2d']:.0%} of pinned host-to-device")
    progress = r["python_progress_while_decoding"]
    print("a Python thread keeps " + ", ".join(f"{share:.0%} of its pace while {name} decodes"
                                              for name, share in progress.items())
          + " (1 decode thread, so a core is free; median of 5 rounds: a check that the GIL is released)")
    return ratios


COLD_LEGEND = (
    "per-row reader / numpy fancy: as in the hot table, on a fresh np.memmap; safetensors per item: "
    "safetensors.torch.load_file of one file per row, pad, stack; latentfast cold=False: read_batch with "
    "the pages faulted in as touched; latentfast: read_batch as shipped (cold='auto'); pread xN: the "
    "batch's page-aligned row spans read by N parallel pread workers into one buffer (ops.read_spans), "
    "no padding or cast: the I/O ceiling"
)


def cold_ratios(table: dict) -> dict:
    med = {name: statistics.median(entry["ms"]) for name, entry in table.items()}
    lf = med["latentfast"]
    ceiling = min(med["pread x16"], med["pread x64"])
    ratios = {f"x_{name}": med[name] / lf for name in med if not name.startswith(("latentfast", "pread"))}
    ratios["share_of_pread_ceiling"] = ceiling / lf
    return ratios


def print_cold(r: dict) -> dict:
    from latentfast.bench.common import format_table

    g = r["geometry"]
    useful = r["useful_bytes_per_batch"]
    layouts = list(r["layouts"])
    header = ["provider"] + [f"{layout} {col}" for layout in layouts
                             for col in ("ms/batch (median)", "useful MB/s", "latentfast faster (x)")]
    names = list(dict.fromkeys(name for table in r["layouts"].values() for name in table))
    rows = []
    for name in names:
        row = [name]
        for layout in layouts:
            table = r["layouts"][layout]
            if name not in table:
                row += ["-", "-", "-"]
                continue
            ms = statistics.median(table[name]["ms"])
            row += [ms, useful / ms / 1e3, ms / statistics.median(table["latentfast"]["ms"])]
        rows.append(row)
    files = ", ".join(f"{layout} {gib:.2f} GiB" for layout, gib in r["file_gib"].items())
    n = len(next(iter(r["layouts"].values()))["latentfast"]["ms"])
    print("\n" + format_table(
        f"cold: B={BATCH} random rows of {geometry_tag((g['channels'], g['latent_h'], g['w_max']))}, widths 20-100%, "
        f"{r['rows']} rows on disk ({files}); the file evicted before every timed batch, no map open; "
        f"median of {n} batches, {useful / 2**20:.2f} MiB useful/batch", header, rows))
    print("legend: " + COLD_LEGEND)
    for layout in layouts:
        resident = {name: entry["resident_before"] for name, entry in r["layouts"][layout].items()}
        print(f"resident bytes before each timed batch ({layout}): "
              + "; ".join(f"{name} {values}" for name, values in resident.items()))
    ratios = {layout: cold_ratios(r["layouts"][layout]) for layout in layouts}
    for layout, q in ratios.items():
        print(f"cold {layout}: latentfast = {q['x_per-row reader']:.1f}x the per-row reader"
              + (f", {q['x_numpy fancy']:.1f}x numpy fancy" if "x_numpy fancy" in q else "")
              + (f", {q['x_safetensors per item']:.1f}x safetensors per item" if "x_safetensors per item" in q else "")
              + f"; {q['share_of_pread_ceiling']:.0%} of the parallel-pread ceiling (targets: >= 10x "
              f"{_met(q['x_per-row reader'] >= 10)}, >= 70% {_met(q['share_of_pread_ceiling'] >= 0.7)})")
    print_loops(r["loops"])
    return ratios


def _met(ok: bool) -> str:
    return "met" if ok else "MISSED"


def print_loops(loops: dict) -> None:
    from latentfast.bench.common import format_table

    rows = [[name, loop["resident_before"], loop["steps"],
             f"{loop['share_under_1ms']:.0%}" + ("" if name.endswith("lookahead 0") else f" ({_met(loop['share_under_1ms'] >= 0.95)})"),
             loop["median_ms"], loop["p95_ms"], loop["max_ms"], loop["first_ms"]] for name, loop in loops.items()]
    print("\n" + format_table(
        f"training loop over an evicted cache, simulated {STEP_S * 1e3:.0f} ms step (sleep): "
        "WidthBucketBatchSampler -> LookaheadSampler -> read_batch -> DevicePrefetcher(cpu); wait = time to get "
        "the next batch (target with lookahead: >= 95% of steps < 1 ms)",
        ["loop", "resident bytes before", "steps (count)", "steps waiting < 1 ms", "median wait ms", "p95 wait ms",
         "max wait ms", "first step ms"], rows))


def conditions(root: str) -> dict:
    """What the figures depend on besides the code: the machine's load, its cores, the disk's read-ahead."""
    device = os.stat(root).st_dev
    read_ahead = f"/sys/dev/block/{os.major(device)}:{os.minor(device)}/queue/read_ahead_kb"
    if not os.path.exists(read_ahead):  # a partition: its disk's queue
        read_ahead = f"/sys/dev/block/{os.major(device)}:{os.minor(device)}/../queue/read_ahead_kb"
    found = {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
             "load_average_1min": round(os.getloadavg()[0], 2), "folder": root}
    if os.path.exists(read_ahead):
        with open(read_ahead) as fh:
            found["disk_read_ahead_kb"] = int(fh.read())
    return found


def run_report(quick: bool = False, sections=("hot", "cold", "contended", "per-call")) -> dict:
    """Measure every provider in one run, print the side-by-side tables, return the figures.

    The caches are written under the temporary folder (``TMPDIR``): the cold section needs a file
    system with a page cache (not tmpfs); its tables print the resident bytes that prove it."""
    thread_counts = sorted({1, torch.get_num_threads()})
    report = {"batch": BATCH, "threads": thread_counts, "quick": quick, "results": [], "cold": [], "summary": {}}
    for geometry in GEOMETRIES[:1] if quick else GEOMETRIES:
        tag = "C{}h{}w{}".format(*geometry)
        with tempfile.TemporaryDirectory(prefix="latentfast-bench-decode-") as root:
            if "hot" in sections:
                r = measure_hot(geometry, (32 if quick else 128) * 2**20, 8 if quick else 24, 3 if quick else 5,
                                thread_counts, root)
                r["ratios"] = print_hot(r, thread_counts)
                report["results"].append(r)
                for t, q in r["ratios"].items():
                    report["summary"].update({f"hot_{tag}@{t}thr_{k}": round(v, 3) for k, v in q.items()})
                for name, figures in (r["cuda"] or {}).items():  # batch to device vs pinned H2D (gpu_check's figure)
                    report["summary"][f"cuda_{tag}_{name}_share_of_pinned_h2d"] = round(figures["share_of_pinned_h2d"], 3)
            if "cold" in sections and pf.SUPPORTED:
                before = conditions(root)
                c = measure_cold(geometry, (128 if quick else 1024) * 2**20, 3 if quick else 12, 15 if quick else 40, root)
                c["conditions"] = {"before": before, "after": conditions(root)}
                print(f"\nconditions of the cold run: {before} (load after: {c['conditions']['after']['load_average_1min']})")
                c["ratios"] = print_cold(c)
                report["cold"].append(c)
                for layout, q in c["ratios"].items():
                    report["summary"].update({f"cold_{tag}_{layout}_{k}": round(v, 3) for k, v in q.items()})
                for name, loop in c["loops"].items():
                    report["summary"][f"loop_{tag}_{name}_share_under_1ms"] = round(loop["share_under_1ms"], 3)
    if "per-call" in sections:
        with tempfile.TemporaryDirectory(prefix="latentfast-bench-decode-") as root:
            report["per_call"] = {busy: per_call_overhead(root, busy=busy) for busy in (0, os.cpu_count() or 1)}
    if "contended" in sections:
        with tempfile.TemporaryDirectory(prefix="latentfast-bench-decode-") as root:
            c = measure_contended(root, busy_counts=(0, 1) if quick else (0, 1, os.cpu_count() or 1))
            c["ratios"] = print_contended(c)
            report["contended"] = c
            for busy, q in c["ratios"].items():
                report["summary"].update({f"contended_busy{busy}_{k}": round(v, 3) for k, v in q.items()})
    return report


def plot(report: dict, out_dir: str) -> list[str]:
    """Hot: useful GB/s per provider; cold: ms per batch per provider (log scale); per geometry."""
    from latentfast.bench.common import outside_legend, pyplot, save

    plt = pyplot()
    if plt is None:
        return []
    paths = []
    if report["results"]:
        fig, axes = plt.subplots(1, len(report["results"]), figsize=(6 * len(report["results"]), 4), squeeze=False)
        for ax, r in zip(axes[0], report["results"]):
            names = list(r["seconds_per_batch"][report["threads"][0]])
            width = 0.8 / len(report["threads"])
            for k, t in enumerate(report["threads"]):
                gbps = [r["useful_bytes_per_batch"] / r["seconds_per_batch"][t][n] / 1e9 for n in names]
                ax.bar([i + k * width for i in range(len(names))], gbps, width, label=f"{t} thread(s)")
            ax.set_xticks([i + width * (len(report["threads"]) - 1) / 2 for i in range(len(names))],
                          [HOT_NAMES[n] for n in names], rotation=30, ha="right")
            g = r["geometry"]
            ax.set(ylabel="useful GB/s", title=f"hot, B={BATCH}, {geometry_tag((g['channels'], g['latent_h'], g['w_max']))}")
            outside_legend(ax)
        paths.append(save(fig, out_dir, "decode.png"))
    if report["cold"]:
        paths += _plot_cold(plt, report["cold"], out_dir)
    return paths


def _plot_cold(plt, cold: list, out_dir: str) -> list[str]:
    from latentfast.bench.common import outside_legend, save

    fig, axes = plt.subplots(1, len(cold), figsize=(6 * len(cold), 4), squeeze=False)
    for ax, c in zip(axes[0], cold):
        layouts = list(c["layouts"])
        names = list(dict.fromkeys(n for table in c["layouts"].values() for n in table))
        width = 0.8 / len(layouts)
        for k, layout in enumerate(layouts):
            table = c["layouts"][layout]
            ms = [statistics.median(table[n]["ms"]) if n in table else 0 for n in names]
            ax.bar([i + k * width for i in range(len(names))], ms, width, label=layout)
        ax.set_xticks([i + width * (len(layouts) - 1) / 2 for i in range(len(names))], names, rotation=30, ha="right")
        g = c["geometry"]
        ax.set(yscale="log", ylabel="ms per batch (log)",
               title=f"cold, B={BATCH}, {geometry_tag((g['channels'], g['latent_h'], g['w_max']))}")
        outside_legend(ax)
    return [save(fig, out_dir, "decode_cold.png")]


# ---- pytest-benchmark (hot) --------------------------------------------------------------------------
try:
    import pytest
except ImportError:  # pragma: no cover - running the script without pytest
    pytest = None

if pytest is not None:

    @pytest.fixture(scope="module")
    def bench_setup():
        with tempfile.TemporaryDirectory(prefix="latentfast-bench-decode-") as root:
            folders = write_random_cache(root, 2048, *GEOMETRIES[0], min_width=GEOMETRIES[0][2] // MIN_WIDTH_SHARE)
            found = hot_providers(folders)
            padded = LatentCache(folders["padded"])
            rng = np.random.default_rng(0)
            batches = [rng.integers(0, len(padded), size=BATCH) for _ in range(16)]
            lines = padded.channels * padded.latent_h
            mean_useful = statistics.mean(useful_bytes(padded.widths, lines, idx) for idx in batches)
            found["memcpy-batch"] = memcpy_fn(padded.gather_source()[0], int(mean_useful), rng)
            yield found, batches, mean_useful

    @pytest.mark.parametrize("provider", ["seed", "numpy", "tensordict", "latentfast", "latentfast-ragged", "latentfast-reuse",
                                          "memcpy-batch"])
    def test_decode(benchmark, bench_setup, provider):
        found, batches, mean_useful = bench_setup
        if provider not in found:
            pytest.skip(f"{provider} is not installed")
        fn = found[provider]
        cycle = {"k": 0}

        def one_batch():
            cycle["k"] += 1
            return fn(batches[cycle["k"] % len(batches)])

        benchmark.extra_info["useful_bytes_per_batch"] = mean_useful
        benchmark(one_batch)


if __name__ == "__main__":
    only = {"--hot-only": ("hot",), "--cold-only": ("cold",), "--contended-only": ("contended",),
            "--per-call-only": ("per-call",)}
    chosen = next((v for k, v in only.items() if k in sys.argv), ("hot", "cold", "contended", "per-call"))
    run_report(quick="--quick" in sys.argv, sections=chosen)
