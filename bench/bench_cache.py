"""Latent cache: build throughput, ragged vs padded bytes, verify bandwidth, ``cache[i]`` rate.

- build: synthetic text lines (widths uniform in [20%, 100%] of max_line_width), toy VAE,
  both layouts; lines/s and the share of the build's work spent decoding images.
- verify: a synthetic padded cache in the page cache; GB/s of ``verify_cache`` (CRC-32 per block
  + finiteness) beside a bare ``zlib.crc32`` pass over the same bytes (the ceiling).
- read: ``cache[i]`` at random indices, latentfast's reader vs the specification's reader
  (a 4-D ``np.memmap`` sliced per row, then copied).

    pytest bench/bench_cache.py --benchmark-only     # pytest-benchmark tables
    python bench/bench_cache.py [--quick]            # side-by-side ratios
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import zlib

import numpy as np
import pytest
import torch

from latentfast.cache import LatentCache, build_latent_cache, verify_cache
from latentfast.cache import format as fmt
from latentfast.synthetic import render_text_lines
from latentfast.toy import ToyVAE

from latentfast.bench.common import format_table, median_seconds

LINE_HEIGHT, MAX_WIDTH = 32, 512


class SpecReader:
    """The specification's read path: a 4-D padded memmap, sliced to the row's width, copied."""

    def __init__(self, folder: str, split: str = "train"):
        with open(fmt.cache_path(folder, split, "meta")) as fh:
            self.meta = json.load(fh)
        self.widths = np.load(fmt.cache_path(folder, split, "widths"))
        self.path = fmt.cache_path(folder, split, "data")
        self.mm = None

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.mm is None:
            m = self.meta
            self.mm = np.memmap(self.path, dtype=np.float16, mode="r", shape=(m["n"], m["channels"], m["latent_h"], m["w_max"]))
        block = np.asarray(self.mm[i, :, :, : int(self.widths[i])])
        return torch.from_numpy(block.copy())


def make_lines(folder: str, count: int) -> str:
    """Widths uniform in [20%, 100%] of max_line_width, none wider: the issue's size-target case."""
    return render_text_lines(folder, count, line_height=LINE_HEIGHT, max_line_width=MAX_WIDTH, seed=0, oversize_fraction=0.0)


def build(manifest: str, out: str, layout: str) -> dict:
    stats: dict = {}
    build_latent_cache(ToyVAE(), manifest, out, line_height=LINE_HEIGHT, max_line_width=MAX_WIDTH,
                       batch_size=16, layout=layout, quiet=True, stats=stats)
    return stats


def make_verify_cache(folder: str, megabytes: int) -> int:
    """A padded cache of random finite latents with our checksums; returns its data bytes."""
    C, h, w_max = 16, 4, 512
    n = max(1, megabytes * 2**20 // (C * h * w_max * 2))
    meta = dict(n=n, channels=C, latent_h=h, w_max=w_max, pretrained="bench", subfolder="", line_height=8 * h,
                max_line_width=8 * w_max, downscale_factor=8, format_version=fmt.FORMAT_VERSION, layout="padded",
                dtype="float16", complete=True)
    meta["checksum"] = {"algorithm": fmt.CHECKSUM_ALGORITHM, "block_rows": fmt.block_row_count(meta)}
    data = np.random.default_rng(0).standard_normal(n * C * h * w_max, dtype=np.float32).astype(np.float16)
    data.tofile(fmt.cache_path(folder, "train", "data"))
    starts = np.arange(n + 1, dtype=np.int64) * C * h * w_max
    np.save(fmt.cache_path(folder, "train", "checksums"), fmt.block_checksums(data, starts, meta["checksum"]["block_rows"]))
    np.save(fmt.cache_path(folder, "train", "widths"), np.full(n, w_max, dtype=np.int32))
    fmt.write_meta(fmt.cache_path(folder, "train", "meta"), meta)
    return data.nbytes


def read_rate(reader, indices) -> float:
    seconds = median_seconds(lambda: [reader[i] for i in indices], repeat=5, warmup=1)
    return len(indices) / seconds


def run_report(quick: bool = False) -> dict:
    lines = 64 if quick else 256
    verify_mb = 64 if quick else 512
    results: dict = {"threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory() as tmp:
        manifest = make_lines(os.path.join(tmp, "lines"), lines)
        build_rows, sizes = [], {}
        for layout in ("padded", "ragged"):
            out = os.path.join(tmp, layout)
            stats = build(manifest, out, layout)
            work = stats["decode_s"] + stats["encode_s"] + stats["write_s"]
            sizes[layout] = os.path.getsize(fmt.cache_path(out, "train", "data"))
            build_rows.append([layout, lines, lines / stats["wall_s"], stats["decode_s"], stats["encode_s"],
                               stats["write_s"], stats["wall_s"], 100 * stats["decode_s"] / work, sizes[layout] / 1e6])
            results[f"build_{layout}"] = {**stats, "lines_per_s": lines / stats["wall_s"], "decode_share": stats["decode_s"] / work}
        results["ragged_over_padded_bytes"] = sizes["ragged"] / sizes["padded"]
        print(format_table(f"build ({lines} lines {LINE_HEIGHT}x[20%..100%] of {MAX_WIDTH} px, toy VAE, batch 16)",
                           ["layout", "lines", "lines/s", "decode s", "encode s", "write s", "wall s", "decode %", "data MB"], build_rows))
        print(f"ragged / padded data bytes: {results['ragged_over_padded_bytes']:.3f}")

        rng = np.random.default_rng(0)
        indices = rng.integers(0, lines, size=2000).tolist()
        padded, ragged, spec = (LatentCache(os.path.join(tmp, "padded")), LatentCache(os.path.join(tmp, "ragged")),
                                SpecReader(os.path.join(tmp, "padded")))
        rates = {"spec": read_rate(spec, indices), "padded": read_rate(padded, indices), "ragged": read_rate(ragged, indices)}
        results["getitem_rows_per_s"] = rates
        print(format_table("cache[i] at random indices (rows/s)", ["spec reader", "latentfast padded", "latentfast ragged", "padded/spec", "ragged/spec"],
                           [[rates["spec"], rates["padded"], rates["ragged"], rates["padded"] / rates["spec"], rates["ragged"] / rates["spec"]]]))

        folder = os.path.join(tmp, "verify")
        os.makedirs(folder)
        nbytes = make_verify_cache(folder, verify_mb)
        verify_cache(folder)  # pull the file into the page cache
        verify_s = median_seconds(lambda: verify_cache(folder), repeat=3, warmup=0)
        mm = np.memmap(fmt.cache_path(folder, "train", "data"), dtype=np.uint8, mode="r")
        crc_s = median_seconds(lambda: zlib.crc32(mm), repeat=3, warmup=0)
        del mm
        results["rows"] = [{"cache_MB": nbytes / 1e6, "verify_GBps": nbytes / verify_s / 1e9, "crc32_GBps": nbytes / crc_s / 1e9}]
        row = results["rows"][0]
        print(format_table("verify (hot page cache)", ["cache MB", "verify GB/s", "bare crc32 GB/s", "verify/crc32"],
                           [[row["cache_MB"], row["verify_GBps"], row["crc32_GBps"], row["verify_GBps"] / row["crc32_GBps"]]]))
    results["summary"] = {
        "build_lines_per_s": round(results["build_padded"]["lines_per_s"], 1),
        "build_decode_share": round(results["build_padded"]["decode_share"], 3),
        "ragged_over_padded_bytes": round(results["ragged_over_padded_bytes"], 3),
        "verify_GBps": round(row["verify_GBps"], 2),
        "getitem_padded_over_spec": round(rates["padded"] / rates["spec"], 2),
    }
    return results


# -- pytest-benchmark -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory() as tmp:
        make_lines(os.path.join(tmp, "lines"), 64)
        for layout in ("padded", "ragged"):
            build(os.path.join(tmp, "lines", "lines.jsonl"), os.path.join(tmp, layout), layout)
        os.makedirs(os.path.join(tmp, "verify"))
        make_verify_cache(os.path.join(tmp, "verify"), 128)
        yield tmp


@pytest.mark.parametrize("layout", ["padded", "ragged"])
def test_build(benchmark, workdir, layout):
    manifest = os.path.join(workdir, "lines", "lines.jsonl")
    counter = iter(range(10**6))
    benchmark.pedantic(lambda: build(manifest, os.path.join(workdir, f"b-{layout}-{next(counter)}"), layout), rounds=3)


def test_verify(benchmark, workdir):
    folder = os.path.join(workdir, "verify")
    benchmark.extra_info["bytes"] = os.path.getsize(fmt.cache_path(folder, "train", "data"))
    benchmark(verify_cache, folder)


@pytest.mark.parametrize("reader", ["spec", "padded", "ragged"])
def test_getitem(benchmark, workdir, reader):
    cache = SpecReader(os.path.join(workdir, "padded")) if reader == "spec" else LatentCache(os.path.join(workdir, reader))
    indices = np.random.default_rng(0).integers(0, len(cache.widths), size=500).tolist()
    benchmark(lambda: [cache[i] for i in indices])


if __name__ == "__main__":
    start = time.perf_counter()
    run_report(quick="--quick" in sys.argv)
    print(f"({time.perf_counter() - start:.1f} s)")
