"""Latent cache: build throughput, ragged vs padded bytes, verify bandwidth, ``cache[i]`` rate, and
shaped caches against the per-item files image/video trainers keep.

- build: synthetic text lines (widths uniform in [20%, 100%] of max_line_width), toy VAE,
  both layouts; lines/s and the share of the build's work spent decoding images.
- verify: a synthetic padded cache in the page cache; GB/s of ``verify_cache`` (CRC-32 per block
  + finiteness) beside a bare ``zlib.crc32`` pass over the same bytes (the ceiling).
- read: ``cache[i]`` at random indices, latentfast's reader vs the original format's reader
  (a 4-D ``np.memmap`` sliced per row, then copied).
- shaped read: batches of 64 items of one shape (three aspect buckets of ``[4, h, w]`` latents,
  ShapeBucketBatchSampler order) from a shaped cache (``read_batch``, one call) vs one file per item
  read the way each trainer reads it and stacked: ``.safetensors`` (``safetensors.torch.load_file``),
  ``.npz`` (``np.load``), ``.pt`` (``torch.load``) and litdata (``StreamingDataset[i]``, when
  installed); every format stores the same float16 values; hot page cache (every file read once
  before timing); plus files and bytes on disk per format.
- shaped build: images in three buckets encoded with a tiny random diffusers ``AutoencoderKL``,
  ``build_image_cache`` (batches of one bucket, threaded decode, one writer) vs encoding the same
  images one by one and saving one ``.safetensors`` per image (what per-item trainers do).

    pytest latentfast/bench/bench_cache.py --benchmark-only     # pytest-benchmark tables
    python -m latentfast.bench.bench_cache [--quick]            # side-by-side ratios
"""
from __future__ import annotations

import contextlib
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
from latentfast.cache.store import format as fmt
from latentfast.synthetic import render_text_lines
from latentfast.testing import torch_threads
from latentfast.toy import ToyVAE

from latentfast.bench.common import format_table, median_seconds

from latentfast.cache import LatentCacheWriter, ShapeBucketBatchSampler, read_batch

LINE_HEIGHT, MAX_WIDTH = 32, 512


class SpecReader:
    """The original format's read path: a 4-D padded memmap, sliced to the row's width, copied."""

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


SHAPED_BUCKETS = [(4, 64, 64), (4, 48, 80), (4, 80, 48)]  # 512x512, 384x640, 640x384 images at f8
SHAPED_BATCH = 64


def write_shaped_sources(folder: str, n: int) -> dict:
    """The same ``n`` float16 latents as a shaped cache and as one file per item in each per-item format;
    returns ``{format: (files, bytes)}`` and the cache's folder."""
    rng = np.random.default_rng(0)
    latents = [rng.standard_normal(SHAPED_BUCKETS[i % 3], dtype=np.float32).astype(np.float16) for i in range(n)]
    keys = [f"item{i:06d}" for i in range(n)]
    with LatentCacheWriter(os.path.join(folder, "shaped"), flush_every=1024) as writer:
        for key, z in zip(keys, latents):
            writer.append(key, z)
    writers = {"npz": lambda path, z: np.savez(path, latents=z),
               "pt": lambda path, z: torch.save({"latents": torch.from_numpy(z)}, path)}
    try:
        from safetensors.torch import save_file

        writers["safetensors"] = lambda path, z: save_file({"latents": torch.from_numpy(z)}, path)
    except ImportError:
        pass
    for fmt_name, write in writers.items():
        os.makedirs(os.path.join(folder, fmt_name))
        for key, z in zip(keys, latents):
            write(os.path.join(folder, fmt_name, f"{key}.{fmt_name}"), z)
    return {"keys": keys, "formats": sorted(writers)}


def _one_thread(fn):
    def run(batch):
        with torch_threads(1):
            return fn(batch)
    return run


@contextlib.contextmanager
def _silenced():
    """stdout and stderr of this process and its children to /dev/null."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 1)
        os.dup2(null, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, null):
            os.close(fd)


def _litdata_item(path: str) -> dict:
    return {"latents": np.load(path)["latents"]}


def per_item_readers(folder: str, keys: list[str], formats: list[str]) -> dict:
    """``name -> fn(batch indices) -> float16 [B, *shape]``, each the way a trainer reads its files."""
    def stacked(load):
        return lambda batch: torch.stack([load(keys[i]) for i in batch])

    readers = {"npz": stacked(lambda k: torch.from_numpy(np.load(os.path.join(folder, "npz", k + ".npz"))["latents"])),
               "pt": stacked(lambda k: torch.load(os.path.join(folder, "pt", k + ".pt"), weights_only=True)["latents"])}
    if "safetensors" in formats:
        from safetensors.torch import load_file

        readers["safetensors"] = stacked(lambda k: load_file(os.path.join(folder, "safetensors", k + ".safetensors"))["latents"])
    try:
        readers["litdata"] = _litdata_reader(folder, keys)
    except Exception as exc:  # noqa: BLE001 - an optional baseline: report why it is missing
        readers["litdata"] = f"unavailable ({type(exc).__name__}: {str(exc)[:80]})"
    return readers


def _litdata_reader(folder: str, keys: list[str]):
    import litdata

    out = os.path.join(folder, "litdata")
    with _silenced():  # optimize() prints progress bars from its worker
        litdata.optimize(fn=_litdata_item, inputs=[os.path.join(folder, "npz", k + ".npz") for k in keys], output_dir=out,
                         chunk_bytes="64MB", num_workers=1, mode="overwrite")
    dataset = litdata.StreamingDataset(out)
    return lambda batch: torch.stack([torch.as_tensor(dataset[int(i)]["latents"]) for i in batch])


def disk_usage(folder: str) -> tuple[int, int]:
    files = [os.path.join(root, f) for root, _, names in os.walk(folder) for f in names]
    return len(files), sum(os.path.getsize(f) for f in files)


def shaped_read_report(quick: bool = False) -> dict:
    n = 384 if quick else 4096
    with tempfile.TemporaryDirectory() as tmp:
        sources = write_shaped_sources(tmp, n)
        cache = LatentCache(os.path.join(tmp, "shaped"))
        batches = list(ShapeBucketBatchSampler(cache.shapes, SHAPED_BATCH, seed=0, drop_last=True))[: 6 if quick else 48]
        readers = {"latentfast": lambda batch: read_batch(cache, batch)[0], "latentfast 1 thread": _one_thread(
            lambda batch: read_batch(cache, batch)[0])}
        readers.update(per_item_readers(tmp, sources["keys"], sources["formats"]))
        results = {"items": n, "batch": SHAPED_BATCH, "batches": len(batches), "ms_per_batch": {}, "disk": {}, "skipped": {}}
        expected = read_batch(cache, batches[-1])[0]
        for name, reader in readers.items():
            if isinstance(reader, str):
                results["skipped"][name] = reader
                continue
            for batch in batches:  # hot page cache, and the same values from every reader
                got = reader(batch)
            assert torch.equal(got, expected), name
            results["ms_per_batch"][name] = 1e3 * median_seconds(lambda: [reader(b) for b in batches], repeat=5, warmup=0) / len(batches)
            results["disk"][name] = disk_usage(os.path.join(tmp, "shaped" if name.startswith("latentfast") else name))
    ms = results["ms_per_batch"]
    one = ms["latentfast 1 thread"]  # like for like: the per-item readers run on one thread too
    results["ratios"] = {name: round(ms[name] / one, 1) for name in ms if not name.startswith("latentfast")}
    results["threads"] = torch.get_num_threads()
    rows = [[name, ms[name], SHAPED_BATCH / ms[name] * 1e3, ms[name] / one, ms[name] / ms["latentfast"],
             *results["disk"][name][:1], results["disk"][name][1] / 1e6] for name in ms]
    print(format_table(f"shaped cache: batches of {SHAPED_BATCH} items of one shape ({n} items [4,64,64]/[4,48,80]/[4,80,48] "
                       "float16, hot page cache)",
                       ["reader", "time (ms/batch)", "items/s", "vs latentfast 1 thread (x)",
                        f"vs latentfast {torch.get_num_threads()} threads (x)", "files (count)", "on disk (MB)"], rows))
    print(f"legend: latentfast = read_batch on one shaped cache ({torch.get_num_threads()} torch threads; '1 thread' like the "
          "per-item readers); safetensors / npz / pt = one file per item loaded with "
          "safetensors.torch.load_file / np.load / torch.load, then torch.stack (baselines); litdata = StreamingDataset[i] "
          "per item of an optimize()d dataset, then torch.stack (baseline)")
    for name, why in results["skipped"].items():
        print(f"  {name}: {why}")
    return results


def _naive_build(encoder, images: list[str], buckets, out: str) -> None:
    """The per-item way: decode, resize + crop, encode one image, save one .safetensors, next."""
    from PIL import Image
    from safetensors.torch import save_file

    from latentfast.cache.builders import media

    os.makedirs(out, exist_ok=True)
    for path in images:
        with Image.open(path) as im:
            image = im.convert("RGB")
        image, _ = media.fit(image, media.nearest_bucket(image.width, image.height, buckets))
        z = encoder.encode(media.to_pixels(image)[None])[0]
        save_file({"latents": z.half().contiguous()}, os.path.join(out, os.path.basename(path) + ".safetensors"))


def shaped_build_report(quick: bool = False) -> dict:
    try:
        import diffusers
        from safetensors.torch import save_file  # noqa: F401
    except ImportError as exc:
        print(f"shaped build: skipped ({exc}; pip install 'latentfast[diffusers]')")
        return {"skipped": str(exc)}
    from PIL import Image

    from latentfast.cache.builders.images import build_image_cache
    from latentfast.encoders import DiffusersVAE

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(block_out_channels=(8, 16), down_block_types=("DownEncoderBlock2D",) * 2,
                                  up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=4, norm_num_groups=4)
    encoder = DiffusersVAE(vae)
    n, buckets = (24 if quick else 192), [(64, 64), (48, 80), (80, 48)]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i in range(n):
            w, h = [(100, 100), (120, 72), (72, 120)][i % 3]
            paths.append(os.path.join(tmp, "imgs", f"im{i:04d}.png"))
            os.makedirs(os.path.dirname(paths[-1]), exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(paths[-1])
        t0 = time.perf_counter()
        build_image_cache(encoder, os.path.join(tmp, "imgs"), os.path.join(tmp, "cache"), buckets=buckets, batch_size=16, quiet=True)
        built = time.perf_counter() - t0
        t0 = time.perf_counter()
        _naive_build(encoder, paths, buckets, os.path.join(tmp, "naive"))
        naive = time.perf_counter() - t0
    result = {"images": n, "build_images_per_s": n / built, "one_by_one_images_per_s": n / naive, "speedup": round(naive / built, 2)}
    print(format_table(f"shaped build: {n} images in 3 buckets, tiny random diffusers AutoencoderKL (f2) on the CPU",
                       ["path", "images/s", "vs one by one (x)"],
                       [["build_image_cache (batch 16)", result["build_images_per_s"], naive / built],
                        ["one by one + .safetensors each", result["one_by_one_images_per_s"], 1.0]]))
    print("legend: one by one = decode, resize + crop, encode a single image, save one .safetensors file per image (baseline)")
    return result


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
                           ["layout", "lines (count)", "lines/s", "decode (s)", "encode (s)", "write (s)", "wall (s)",
                            "decode (% of work)", "data (MB)"], build_rows))
        print(f"ragged / padded data bytes: {results['ragged_over_padded_bytes']:.3f}")

        rng = np.random.default_rng(0)
        indices = rng.integers(0, lines, size=2000).tolist()
        padded, ragged, spec = (LatentCache(os.path.join(tmp, "padded")), LatentCache(os.path.join(tmp, "ragged")),
                                SpecReader(os.path.join(tmp, "padded")))
        rates = {"spec": read_rate(spec, indices), "padded": read_rate(padded, indices), "ragged": read_rate(ragged, indices)}
        results["getitem_rows_per_s"] = rates
        print(format_table("cache[i] at random indices", ["original reader (rows/s)", "latentfast padded (rows/s)",
                                                          "latentfast ragged (rows/s)", "padded/original (x)", "ragged/original (x)"],
                           [[rates["spec"], rates["padded"], rates["ragged"], rates["padded"] / rates["spec"], rates["ragged"] / rates["spec"]]]))
        print("legend: original reader = the seed format's per-row 4-D memmap slice + copy (baseline)")

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
        print(format_table("verify (hot page cache: the file was just read; a cold disk is slower)",
                           ["cache (MB)", "verify (GB/s)", "bare crc32 (GB/s)", "verify/crc32 (x)"],
                           [[row["cache_MB"], row["verify_GBps"], row["crc32_GBps"], row["verify_GBps"] / row["crc32_GBps"]]]))
    results["shaped_read"] = shaped_read_report(quick)
    results["shaped_build"] = shaped_build_report(quick)
    results["summary"] = {
        "shaped_read_over_safetensors": results["shaped_read"]["ratios"].get("safetensors"),
        "shaped_build_over_one_by_one": results["shaped_build"].get("speedup"),
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


@pytest.fixture(scope="module")
def shaped_sources():
    with tempfile.TemporaryDirectory() as tmp:
        sources = write_shaped_sources(tmp, 384)
        cache = LatentCache(os.path.join(tmp, "shaped"))
        batches = list(ShapeBucketBatchSampler(cache.shapes, SHAPED_BATCH, seed=0, drop_last=True))
        readers = {"latentfast": lambda batch: read_batch(cache, batch)[0]}
        readers.update(per_item_readers(tmp, sources["keys"], sources["formats"]))
        yield readers, batches


@pytest.mark.parametrize("reader", ["latentfast", "safetensors", "npz", "pt"])
def test_shaped_read(benchmark, shaped_sources, reader):
    readers, batches = shaped_sources
    if not callable(readers.get(reader)):
        pytest.skip(f"{reader}: not installed")
    benchmark(lambda: [readers[reader](b) for b in batches])


if __name__ == "__main__":
    start = time.perf_counter()
    run_report(quick="--quick" in sys.argv)
    print(f"({time.perf_counter() - start:.1f} s)")
