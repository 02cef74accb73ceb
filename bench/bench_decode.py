"""Batch decode benchmark: random batches of 64 rows from a page-cache-hot cache (>= 128 MB).

Providers, side by side in one run (useful bytes = the real columns of the batch's rows, float16):
  seed        the specification's path: per-row memmap slice copy + torch.from_numpy, pad each row
              with the white column, stack
  numpy       numpy fancy indexing of the memmap ``mm[idx, :, :, :W]`` + white fill with np.where
  tensordict  tensordict.MemoryMappedTensor indexing + white fill with torch.where (``[bench]`` extra)
  latentfast  read_batch (compiled gather, padded layout; and the ragged layout)
  memcpy      one contiguous copy of the same number of bytes out of the same hot memmap (the ceiling)

Run:  python bench/bench_decode.py [--quick]          (prints the table, ratios side by side)
      pytest bench/bench_decode.py --benchmark-enable (pytest-benchmark, one test per provider)
The lead's ``latentfast bench`` calls ``run_report(quick)``.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from latentfast.cache import LatentCache, cache_path
from latentfast.cache.decode import read_batch
from latentfast.testing import write_cache  # caches of arbitrary rows, shared with the tests

BATCH = 64


GEOMETRIES = [(16, 8, 256), (4, 8, 128)]  # (C, h, w_max): 64 KiB and 8 KiB padded rows


def build_caches(directory: str, n_rows: int, geometry=GEOMETRIES[0], seed: int = 0) -> dict[str, LatentCache]:
    """Padded and ragged caches of the same ``n_rows`` random rows, widths uniform in [20%, 100%] of w_max."""
    channels, latent_h, w_max = geometry
    rng = np.random.default_rng(seed)
    widths = rng.integers(w_max // 5, w_max + 1, size=n_rows).astype(np.int32)
    rows = [rng.standard_normal((channels, latent_h, int(w)), dtype=np.float32).astype(np.float16) for w in widths]
    white = rng.standard_normal((channels, latent_h, 1)).astype(np.float16)
    caches = {layout: write_cache(os.path.join(directory, layout), rows, widths, w_max=w_max, layout=layout,
                                  white=white) for layout in ("padded", "ragged")}
    for cache in caches.values():  # page-cache hot: touch every byte once
        cache.gather_source()[0].sum(dtype=torch.float32)
    return caches


def seed_path(mm: np.memmap, widths: np.ndarray, white: torch.Tensor, indices: np.ndarray) -> torch.Tensor:
    rows = [torch.from_numpy(np.asarray(mm[i, :, :, : widths[i]]).copy()) for i in indices]
    W = max(row.shape[-1] for row in rows)
    return torch.stack([torch.cat([row, white.expand(-1, -1, W - row.shape[-1])], dim=-1) for row in rows])


def numpy_path(mm: np.memmap, widths: np.ndarray, white: np.ndarray, indices: np.ndarray) -> torch.Tensor:
    selected = widths[indices]
    W = int(selected.max())
    batch = mm[indices, :, :, :W]
    real = np.arange(W)[None, None, None, :] < selected[:, None, None, None]
    return torch.from_numpy(np.where(real, batch, white[None]))


def tensordict_path(mmt, widths: torch.Tensor, white: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    selected = widths[indices]
    W = int(selected.max())
    batch = mmt[indices][..., :W]
    real = torch.arange(W)[None, None, None, :] < selected[:, None, None, None]
    return torch.where(real, batch, white[None])


def providers(caches: dict[str, LatentCache]) -> dict:
    """name -> function(indices as int64 numpy array) -> padded batch."""
    padded = caches["padded"]
    shape = (len(padded), padded.channels, padded.latent_h, padded.w_max)
    mm = np.memmap(cache_path(padded.cache_dir, padded.split, "data"), dtype=np.float16, mode="r", shape=shape)
    widths, white = padded.widths, padded.white_column
    found = {
        "seed": lambda idx: seed_path(mm, widths, white, idx),
        "numpy": lambda idx: numpy_path(mm, widths, white.numpy(), idx),
    }
    try:
        from tensordict import MemoryMappedTensor

        mmt = MemoryMappedTensor.from_filename(cache_path(padded.cache_dir, padded.split, "data"), dtype=torch.float16, shape=torch.Size(shape))
        widths_t = torch.from_numpy(widths)
        found["tensordict"] = lambda idx: tensordict_path(mmt, widths_t, white, torch.from_numpy(idx))
    except ImportError:  # the [bench] extra is not installed
        pass
    found["latentfast"] = lambda idx: read_batch(padded, idx)[0]
    found["latentfast-ragged"] = lambda idx: read_batch(caches["ragged"], idx)[0]
    return found


def useful_bytes(cache: LatentCache, indices: np.ndarray) -> int:
    return int(cache.widths[indices].sum()) * cache.channels * cache.latent_h * 2


def memcpy_fn(cache: LatentCache, nbytes: int, rng: np.random.Generator):
    """Contiguous copies of ``nbytes`` from random places of the same hot memmap into one buffer."""
    data = cache.gather_source()[0]
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


def time_per_batch(fn, batches, repeats: int) -> float:
    """Seconds per batch of the fastest of ``repeats`` passes over ``batches`` (after a warm-up): on a
    shared machine the least-disturbed pass is the figure that repeats (as timeit advises)."""
    for idx in batches[:3]:
        fn(idx)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for idx in batches:
            fn(idx)
        samples.append((time.perf_counter() - start) / len(batches))
    return min(samples)


def cold_seconds(cache: LatentCache, fn, batches) -> float | None:
    """Mean seconds per batch right after the data file was evicted from the page cache
    (posix_fadvise DONTNEED; None where the OS lacks it)."""
    if not hasattr(os, "posix_fadvise"):
        return None
    total = 0.0
    for idx in batches:
        fd = os.open(cache_path(cache.cache_dir, cache.split, "data"), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        start = time.perf_counter()
        fn(idx)
        total += time.perf_counter() - start
    return total / len(batches)


def python_progress_while(fn, batches, seconds: float = 0.3) -> float:
    """Share of its idle pace that a pure-Python loop keeps while another thread decodes batches with
    ``fn`` (about 1 when ``fn`` releases the GIL and a core is free, far below when it holds it)."""
    import threading

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


def measure_geometry(geometry, cache_bytes: int, n_batches: int, repeats: int, thread_counts) -> dict:
    channels, latent_h, w_max = geometry
    n_rows = cache_bytes // (channels * latent_h * w_max * 2)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="latentfast-bench-decode-") as directory:
        caches = build_caches(directory, n_rows, geometry)
        padded = caches["padded"]
        batches = [rng.integers(0, n_rows, size=BATCH) for _ in range(n_batches)]
        mean_useful = statistics.mean(useful_bytes(padded, idx) for idx in batches)
        found = providers(caches)
        expected = found["seed"](batches[0])
        for name, fn in found.items():  # every provider must return the same batch
            assert torch.equal(fn(batches[0]), expected), f"provider {name} disagrees with the seed path"
        # the machine's copy bandwidth (a 64 MiB block, as "memcpy" in the issue) and a batch-sized copy
        # (destination cache-hot, a stricter ceiling)
        found["memcpy-64MiB"] = memcpy_fn(padded, 64 * 2**20, rng)
        found["memcpy-batch"] = memcpy_fn(padded, int(mean_useful), rng)
        default_threads = torch.get_num_threads()
        seconds = {}
        for threads in thread_counts:
            torch.set_num_threads(threads)
            seconds[threads] = {}
            for name, fn in found.items():
                per = 64 * 2**20 if name == "memcpy-64MiB" else mean_useful
                seconds[threads][name] = time_per_batch(fn, batches, repeats) * mean_useful / per
        torch.set_num_threads(default_threads)
        cold = {name: cold_seconds(padded, found[name], batches[:4]) for name in ("seed", "latentfast")}
        cuda = measure_cuda(padded, batches, mean_useful, repeats) if torch.cuda.is_available() else None
        torch.set_num_threads(1)  # one decode thread, so a free core is left for the Python loop
        gil = {name: python_progress_while(found[name], batches) for name in ("seed", "latentfast")}
        torch.set_num_threads(default_threads)
    return {"python_progress_while_decoding": gil, "cuda": cuda,
            "geometry": {"channels": channels, "latent_h": latent_h, "w_max": w_max}, "rows": n_rows,
            "cache_mib": n_rows * channels * latent_h * w_max * 2 / 2**20, "useful_bytes_per_batch": mean_useful,
            "seconds_per_batch": seconds, "cold_seconds_per_batch": cold}


def run_report(quick: bool = False) -> dict:
    """Measure every provider in one run, print the side-by-side table, return the figures.

    Times are per batch of 64 random rows; the memcpy rows are scaled to the same useful bytes.
    """
    cache_bytes = (32 if quick else 128) * 2**20
    n_batches, repeats = (8, 3) if quick else (24, 5)
    thread_counts = sorted({1, torch.get_num_threads()})
    results = []
    for geometry in GEOMETRIES[:1] if quick else GEOMETRIES:
        r = measure_geometry(geometry, cache_bytes, n_batches, repeats, thread_counts)
        g = r["geometry"]
        print(f"\nbatch decode: B={BATCH}, C={g['channels']}, h={g['latent_h']}, w_max={g['w_max']}, "
              f"{r['rows']} rows ({r['cache_mib']:.0f} MiB padded, page-cache hot), "
              f"useful {r['useful_bytes_per_batch'] / 2**20:.2f} MiB/batch")
        header = "".join(f"{f'ms @{t}thr':>11}{'GB/s':>7}{'lf x':>7}" for t in thread_counts)
        print(f"{'provider':<18}{header}")
        ratios = {}
        for name in r["seconds_per_batch"][thread_counts[0]]:
            cells = ""
            for t in thread_counts:
                s = r["seconds_per_batch"][t][name]
                lf = r["seconds_per_batch"][t]["latentfast"]
                cells += f"{s * 1e3:>11.3f}{r['useful_bytes_per_batch'] / s / 1e9:>7.2f}{s / lf:>7.2f}"
            print(f"{name:<18}{cells}")
        for t in thread_counts:
            sec = r["seconds_per_batch"][t]
            lf = sec["latentfast"]
            ratios[t] = {f"latentfast_vs_{name}": sec[name] / lf for name in sec if name != "latentfast"}
            print(f"@{t} thread(s): latentfast = {ratios[t]['latentfast_vs_seed']:.1f}x seed, "
                  + (f"{ratios[t]['latentfast_vs_tensordict']:.1f}x tensordict, " if "tensordict" in sec else "")
                  + f"{sec['memcpy-64MiB'] / lf:.0%} of memcpy-64MiB, {sec['memcpy-batch'] / lf:.0%} of memcpy-batch")
        for name, s in r["cold_seconds_per_batch"].items():
            if s is not None:
                print(f"cold page cache (file evicted before each batch): {name} {s * 1e3:.2f} ms/batch "
                      f"({r['useful_bytes_per_batch'] / s / 1e9:.2f} GB/s)")
        for name, figures in (r["cuda"] or {}).items():
            print(f"{name:<22} {figures['ms']:.3f} ms/batch {figures['useful_gb_per_s']:.2f} GB/s "
                  f"= {figures['share_of_pinned_h2d']:.0%} of pinned host-to-device")
        progress = r["python_progress_while_decoding"]
        print("a Python thread keeps "
              + ", ".join(f"{share:.0%} of its pace while {name} decodes" for name, share in progress.items())
              + " (GIL)")
        r["ratios"] = ratios
        results.append(r)
    summary = {}
    for r in results:
        g = r["geometry"]
        tag = f"C{g['channels']}h{g['latent_h']}w{g['w_max']}"
        for t in thread_counts:
            sec = r["seconds_per_batch"][t]
            lf = sec["latentfast"]
            summary[f"{tag}@{t}thr_x_seed"] = round(sec["seed"] / lf, 2)
            summary[f"{tag}@{t}thr_fraction_of_memcpy"] = round(sec["memcpy-64MiB"] / lf, 3)
            if "tensordict" in sec:
                summary[f"{tag}@{t}thr_x_tensordict"] = round(sec["tensordict"] / lf, 2)
        for name, figures in (r["cuda"] or {}).items():
            summary[f"{tag}_{name}_share_of_pinned_h2d"] = round(figures["share_of_pinned_h2d"], 3)
    return {"batch": BATCH, "threads": thread_counts, "results": results, "summary": summary}


# ---- pytest-benchmark --------------------------------------------------------------------------
try:
    import pytest
except ImportError:  # pragma: no cover - running the script without pytest
    pytest = None

if pytest is not None:

    @pytest.fixture(scope="module")
    def bench_setup():
        with tempfile.TemporaryDirectory(prefix="latentfast-bench-decode-") as directory:
            caches = build_caches(directory, 2048)  # 128 MiB padded
            rng = np.random.default_rng(0)
            batches = [rng.integers(0, len(caches["padded"]), size=BATCH) for _ in range(16)]
            found = providers(caches)
            mean_useful = statistics.mean(useful_bytes(caches["padded"], idx) for idx in batches)
            found["memcpy-batch"] = memcpy_fn(caches["padded"], int(mean_useful), rng)
            yield found, batches, mean_useful

    @pytest.mark.parametrize("provider", ["seed", "numpy", "tensordict", "latentfast", "latentfast-ragged",
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



def plot(report: dict, out_dir: str) -> list[str]:
    """Useful GB/s per provider, per geometry and thread count."""
    from latentfast.bench.common import pyplot, save

    plt = pyplot()
    if plt is None:
        return []
    fig, axes = plt.subplots(1, len(report["results"]), figsize=(6 * len(report["results"]), 4), squeeze=False)
    for ax, r in zip(axes[0], report["results"]):
        g = r["geometry"]
        names = list(r["seconds_per_batch"][report["threads"][0]])
        width = 0.8 / len(report["threads"])
        for k, t in enumerate(report["threads"]):
            gbps = [r["useful_bytes_per_batch"] / r["seconds_per_batch"][t][n] / 1e9 for n in names]
            ax.bar([i + k * width for i in range(len(names))], gbps, width, label=f"{t} thread(s)")
        ax.set_xticks([i + width * (len(report["threads"]) - 1) / 2 for i in range(len(names))], names, rotation=30, ha="right")
        ax.set(ylabel="useful GB/s", title=f"read_batch B={report['batch']}, C{g['channels']} h{g['latent_h']} w{g['w_max']}")
        ax.legend()
    return [save(fig, out_dir, "decode.png")]

if __name__ == "__main__":
    run_report(quick="--quick" in sys.argv)
