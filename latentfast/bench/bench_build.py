"""Image build benchmark: does the builder's data side keep up with a plain decode loop? (issue 36)

Data side -- ``build_image_cache`` with a near-free encoder (zeros of the latent's shape: only decoding,
resizing, batching, the normalize, the copies and writing are timed, planning and hashing included),
against the ceiling: a plain PIL loop on a thread pool of the same size (open -> ``draft`` -> RGB ->
LANCZOS cover resize -> centre crop -> uint8 array; nothing kept), over the same files, page cache
warm. Photo-like sources (1/f noise) of 2560x1920 (1280x960 in --quick), one 4:3 bucket of 896x1152
(448x576) that shrinks them a little over 2x, so the JPEGs decode at 1/2 scale in both; JPEG (quality
90) and PNG. Each side runs ``--runs`` times (>= 3) alternately; median and range of images/s, and
the ratio of the medians; also the build's rate after its plan (listing, probing and hashing every
file, which the ceiling does not do; ``stats["plan_s"]``). Writing a decoded image into its slot, the
decoders' way against the transposing copy, both into one reused slot. The builder's ``stats`` say which stage
bounds it. CPU seconds per image of each side (every thread of the process) and their ratio: on a
host whose cores the decoders fill, the throughput ratio tends to it, and it moves far less with
other jobs' load than wall time does.

Main-thread host time -- the caller thread's CPU seconds per image outside the encoder (taking the
batch, on CUDA launching the normalize, splitting the latents), per 1024x1024 image. A CPU build
normalizes on the feed thread, beside the encoder (the host is the device there; its time is in
``stats["feed_s"]``), so the main thread does not; the normalize's own wall time
(``ops.normalize_uint8`` of one planar 1024^2 image to float32) is printed beside it.

Content hashes -- GB/s (CPU time of one thread) of each algorithm a build may hash its sources with
(``durable.CONTENT_HASHES``: BLAKE2b-128, the old caches'; SHA-256 cut to 16 bytes, new caches') over a
file of the benchmark's JPEG size, in memory.

With CUDA -- an SDXL-class VAE (random weights, bfloat16): ``build_image_cache`` images/s against the
encoder alone on batches already on the device (``vae_report``; bench/gpu_check.sh runs it).

Run:  python -m latentfast.bench.bench_build [--quick] [--runs N] [--workers N] [--images N]
      pytest latentfast/bench/bench_build.py --benchmark-enable (pytest-benchmark: one build, one ceiling pass)
``latentfast bench`` calls ``run_report(quick)``.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from latentfast import ops
from latentfast.bench.common import format_table, machine_summary, median_seconds
from latentfast.cache.builders import media
from latentfast.cache.builders.images import build_image_cache
from latentfast.cache.store.durable import CONTENT_HASHES, content_hash
from latentfast.testing import photo_like


class FreeEncoder:
    """A near-free encoder: zeros of the latent's shape; it keeps the CPU seconds its thread spent in it."""

    spatial_downscale = 8

    def __init__(self):
        self.seconds = 0.0

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        t0 = time.thread_time()
        B, _, H, W = images.shape
        z = torch.zeros(B, 4, H // 8, W // 8)
        self.seconds += time.thread_time() - t0
        return z

    def identity(self) -> dict:
        return {"pretrained": "bench.FreeEncoder", "latent_channels": 4, "downscale_factor": 8}


@contextlib.contextmanager
def main_thread_cpu():
    """Counts the CPU seconds the caller's thread spends in each batch's encode stage (taking the
    batch, on CUDA the normalize, the encoder, splitting the latents): CPU time, not wall time, so that
    waiting for a core on a busy machine is not counted. Yields a one-item list."""
    from latentfast.cache.builders.images import _Runner

    spent, stage = [0.0], _Runner._encode_batch

    def counted(self, *args):
        t0 = time.thread_time()
        try:
            return stage(self, *args)
        finally:
            spent[0] += time.thread_time() - t0

    _Runner._encode_batch = counted
    try:
        yield spent
    finally:
        _Runner._encode_batch = stage


def write_sources(folder: str, n: int, size: tuple[int, int], fmt: str) -> list[str]:
    from PIL import Image

    os.makedirs(folder, exist_ok=True)
    rng, paths = np.random.default_rng(0), []
    base = [photo_like(rng, *size) for _ in range(min(n, 4))]  # a few distinct images, each file its own bytes
    for i in range(n):
        array = np.roll(base[i % len(base)], i, axis=1)
        path = os.path.join(folder, f"im{i:04d}.{'jpg' if fmt == 'JPEG' else 'png'}")
        if fmt == "JPEG":
            Image.fromarray(array).save(path, quality=90)
        else:
            Image.fromarray(array).save(path, compress_level=6)
        paths.append(path)
    return paths


def ceiling_pass(paths: list[str], bucket: tuple[int, int], workers: int) -> float:
    """Seconds for the plain PIL loop over ``paths`` on ``workers`` threads."""
    from PIL import Image

    bh, bw = bucket

    def one(path):
        with Image.open(path) as im:
            rw, rh = media.cover_size(im.width, im.height, bucket)
            im.draft("RGB", (rw, rh))
            image = im.convert("RGB").resize((rw, rh), Image.LANCZOS)
        top, left = (rh - bh) // 2, (rw - bw) // 2
        return np.asarray(image.crop((left, top, left + bw, top + bh)), dtype=np.uint8).shape

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(one, paths))
    return time.perf_counter() - t0


def build_pass(folder: str, out: str, bucket: tuple[int, int], workers: int, batch_size: int) -> tuple[float, dict, float]:
    """``(seconds, stats, the caller thread's CPU seconds outside the encoder)`` of one fresh build of ``folder``."""
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    encoder, stats = FreeEncoder(), {}
    with main_thread_cpu() as spent:
        t0 = time.perf_counter()
        build_image_cache(encoder, folder, out, buckets=[bucket], batch_size=batch_size, num_workers=workers,
                          quiet=True, stats=stats)
        seconds = time.perf_counter() - t0
    return seconds, stats, spent[0] - encoder.seconds


def process_cpu() -> float:
    """CPU seconds of this process, every thread (the decoders', the native kernels') counted."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run_report(quick: bool = False, runs: int = 3, workers: int | None = None, images: int | None = None) -> dict:
    runs = max(3, runs)
    workers = workers or len(os.sched_getaffinity(0))
    size, bucket = ((1280, 960), (448, 576)) if quick else ((2560, 1920), (896, 1152))
    n, batch_size = (16, 4) if quick else (32, 8)
    n = images or n  # (more images: the build's fixed costs -- its lock, fresh buffers, publish -- weigh less)
    result = {"machine": machine_summary(), "workers": workers, "images": n, "source_size": list(size),
              "bucket": list(bucket), "batch_size": batch_size, "runs": runs, "formats": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for fmt in ("JPEG", "PNG"):
            folder = os.path.join(tmp, fmt)
            paths = write_sources(folder, n, size, fmt)
            ceiling_pass(paths, bucket, workers)  # warm the page cache and the decoders
            ceiling, build, phase, host, cpu, stats = [], [], [], [], {"ceiling": [], "build": []}, None
            idle = {"head_s": [], "tail_s": []}  # the build's wall seconds before its first decode and after its last
            for _ in range(runs):
                c0 = process_cpu()
                ceiling.append(n / ceiling_pass(paths, bucket, workers))
                c1 = process_cpu()
                seconds, stats, host_s = build_pass(folder, os.path.join(tmp, "out"), bucket, workers, batch_size)
                cpu["ceiling"].append((c1 - c0) / n)
                cpu["build"].append((process_cpu() - c1) / n)
                build.append(n / seconds)
                phase.append(n / (seconds - stats["plan_s"]))
                host.append(host_s / n / (bucket[0] * bucket[1] / 2**20))
                for key, values in idle.items():
                    values.append(stats[key])
            result["formats"][fmt] = {
                "ceiling_images_s": _spread(ceiling), "build_images_s": _spread(build),
                "ratio": statistics.median(build) / statistics.median(ceiling),
                "after_plan_images_s": _spread(phase), "after_plan_ratio": statistics.median(phase) / statistics.median(ceiling),
                "main_thread_ms_per_1024sq": 1000 * statistics.median(host),
                "cpu_ms_per_image": {side: 1000 * statistics.median(v) for side, v in cpu.items()},
                "cpu_ratio": statistics.median(cpu["ceiling"]) / statistics.median(cpu["build"]),
                **{key: _spread(values) for key, values in idle.items()},
                "last_stats": {k: v for k, v in stats.items() if k.endswith("_s") or k in ("bound", "decode_workers")},
                "file_mib": sum(os.path.getsize(p) for p in paths) / n / 2**20,
            }
    if torch.cuda.is_available():
        result["vae"] = vae_report("cuda", quick)
    result["slot_write_ms_per_1024sq"] = slot_write_report(bucket)
    result["content_hash_gb_s"] = hash_report(int(result["formats"]["JPEG"]["file_mib"] * 2**20))
    one = torch.randint(0, 256, (1, 3, 1024, 1024), dtype=torch.uint8)
    result["cpu_normalize_ms_per_1024sq"] = 1000 * median_seconds(lambda: ops.normalize_uint8(one), repeat=7, warmup=2)
    result["load_average"] = os.getloadavg()
    result["summary"] = {f"{fmt.lower()}_build_over_ceiling": round(r["ratio"], 3) for fmt, r in result["formats"].items()}
    result["summary"].update({f"{fmt.lower()}_after_plan_over_ceiling": round(r["after_plan_ratio"], 3)
                              for fmt, r in result["formats"].items()})
    result["summary"].update({f"{fmt.lower()}_cpu_ceiling_over_build": round(r["cpu_ratio"], 3)
                              for fmt, r in result["formats"].items()})
    result["summary"]["main_thread_cpu_ms_per_1024sq"] = round(result["formats"]["JPEG"]["main_thread_ms_per_1024sq"], 3)
    if "vae" in result:
        result["summary"]["vae_build_over_encoder_alone"] = round(result["vae"]["ratio"], 3)
    print_report(result)
    return result


def slot_write_report(bucket: tuple[int, int]) -> dict:
    """CPU ms per 1024^2 to write one decoded RGB image into its planar slot of a batch buffer (a CPU build's
    layout): Pillow packing each plane (``media.write_rgb``, what the decoders do) against the
    transposing copy of its ``[h, w, 3]`` array (what they did before); both into the same reused slot."""
    from PIL import Image

    image = Image.fromarray(photo_like(np.random.default_rng(1), bucket[1], bucket[0]))
    slot = np.empty((3, *bucket), dtype=np.uint8)
    per = bucket[0] * bucket[1] / 2**20

    def cpu_ms(fn, repeat: int = 15) -> float:  # the thread's CPU time: a loaded host's waits are not counted
        fn()
        samples = []
        for _ in range(repeat):
            t0 = time.thread_time()
            fn()
            samples.append(time.thread_time() - t0)
        return 1000 * statistics.median(samples) / per

    return {"pillow_planes": cpu_ms(lambda: media.write_rgb(image, slot, planar=True)),
            "transposing_copy": cpu_ms(lambda: np.copyto(slot, np.moveaxis(media.to_uint8(image), -1, 0)))}


def hash_report(nbytes: int, repeat: int = 15) -> dict:
    """GB/s of each content hash algorithm over ``nbytes`` already in memory: the thread's CPU time,
    median of ``repeat`` (a loaded host's waits for a core are not counted)."""
    data = np.random.default_rng(2).bytes(nbytes)
    rates = {}
    for algorithm in CONTENT_HASHES:
        content_hash("source.jpg", algorithm=algorithm, data=data)
        samples = []
        for _ in range(repeat):
            t0 = time.thread_time()
            content_hash("source.jpg", algorithm=algorithm, data=data)
            samples.append(time.thread_time() - t0)
        rates[algorithm] = nbytes / statistics.median(samples) / 1e9
    return rates


def sdxl_class_vae(tiny: bool = False):
    """An SDXL-sized diffusers AutoencoderKL, random weights (the encode cost is the architecture's);
    ``tiny``: a small one, to try the measurement on a CPU."""
    import diffusers

    blocks = (8, 16) if tiny else (128, 256, 512, 512)
    torch.manual_seed(0)
    return diffusers.AutoencoderKL(block_out_channels=blocks, down_block_types=("DownEncoderBlock2D",) * len(blocks),
                                   up_block_types=("UpDecoderBlock2D",) * len(blocks), latent_channels=4,
                                   norm_num_groups=4 if tiny else 32, layers_per_block=1 if tiny else 2)


def vae_report(device: str, quick: bool = False, tiny: bool = False) -> dict:
    """A real-size VAE (bfloat16) on ``device``: images/s of ``build_image_cache`` against the encoder
    alone on batches already on the device (the target: the build >= 0.9x of it)."""
    from latentfast.encoders import DiffusersVAE

    size, bucket = ((2560, 1920), (896, 1152)) if not tiny else ((256, 192), (64, 96))
    n, batch_size = (32, 8) if quick else (96, 8)
    vae = DiffusersVAE(sdxl_class_vae(tiny).to(device=device, dtype=torch.bfloat16))
    pixels = torch.rand(batch_size, 3, *bucket, device=device).mul_(2).sub_(1).to(torch.bfloat16)
    encode_alone = median_seconds(lambda: vae.encode(pixels), repeat=3, warmup=1, device=device)
    with tempfile.TemporaryDirectory() as tmp:
        write_sources(os.path.join(tmp, "src"), n, size, "JPEG")
        out, stats = os.path.join(tmp, "out"), {}
        build_image_cache(vae, os.path.join(tmp, "src"), out, buckets=[bucket], batch_size=batch_size, device=device,
                          quiet=True)  # warm: kernels compiled, files in the page cache
        import shutil

        shutil.rmtree(out)
        t0 = time.perf_counter()
        build_image_cache(vae, os.path.join(tmp, "src"), out, buckets=[bucket], batch_size=batch_size, device=device,
                          quiet=True, stats=stats)
        seconds = time.perf_counter() - t0
    result = {"device": str(device), "images": n, "bucket": list(bucket), "batch_size": batch_size,
              "encoder_alone_images_s": batch_size / encode_alone, "build_images_s": n / seconds,
              "build_after_plan_images_s": n / (seconds - stats["plan_s"]),
              "stats": {k: v for k, v in stats.items() if k.endswith("_s") or k in ("bound", "decode_workers")}}
    result["ratio"] = result["build_images_s"] / result["encoder_alone_images_s"]
    result["after_plan_ratio"] = result["build_after_plan_images_s"] / result["encoder_alone_images_s"]
    print(f"vae-build: SDXL-class VAE (bf16, random weights) on {device}, {n} JPEGs {size[0]}x{size[1]} -> "
          f"{bucket}, batch {batch_size}: encoder alone {result['encoder_alone_images_s']:.1f} images/s, build "
          f"{result['build_images_s']:.1f} ({result['ratio']:.2f}x; after its plan {result['after_plan_ratio']:.2f}x), "
          f"bound by {stats['bound']}; stage seconds " +
          " ".join(f"{k.removesuffix('_s')} {v:.2f}" for k, v in result["stats"].items() if k.endswith("_s")))
    return result


def print_report(result: dict) -> None:
    rows = []
    for fmt, r in result["formats"].items():
        c, b, p, s = r["ceiling_images_s"], r["build_images_s"], r["after_plan_images_s"], r["last_stats"]
        rows.append([fmt, f"{r['file_mib']:.1f}", f"{c['median']:.1f} [{c['min']:.1f}-{c['max']:.1f}]",
                     f"{b['median']:.1f} [{b['min']:.1f}-{b['max']:.1f}]", f"{r['ratio']:.2f}",
                     f"{p['median']:.1f} [{p['min']:.1f}-{p['max']:.1f}]", f"{r['after_plan_ratio']:.2f}",
                     f"{r['cpu_ms_per_image']['ceiling']:.1f} / {r['cpu_ms_per_image']['build']:.1f} = {r['cpu_ratio']:.2f}",
                     f"{r['main_thread_ms_per_1024sq']:.2f}", s["bound"],
                     " ".join(f"{k.removesuffix('_s')} {s[k]:.2f}" for k in ("plan_s", "decode_s", "feed_s", "encode_s",
                                                                            "write_s", "encode_wait_s"))])
    w, h = result["source_size"]
    print(format_table(
        f"image build, near-free encoder, {result['images']} images {w}x{h} -> bucket {result['bucket']}, batch "
        f"{result['batch_size']}, {result['workers']} decode workers; images/s median [min-max] of {result['runs']} runs",
        ["format", "MiB/file", "PIL+draft ceiling", "build_image_cache", "build/ceiling", "build after its plan",
         "after plan/ceiling", "CPU ms/image ceiling / build", "main-thread CPU ms/1024^2",
         "bound", "last run's stage seconds"], rows))
    for fmt, r in result["formats"].items():
        print(f"({fmt}: the decoders idle {r['head_s']['median']:.3f} s [{r['head_s']['min']:.3f}-{r['head_s']['max']:.3f}] "
              f"before the first decode, {r['tail_s']['median']:.3f} s [{r['tail_s']['min']:.3f}-{r['tail_s']['max']:.3f}] "
              f"after the last)")
    load = ", ".join(f"{x:.1f}" for x in result["load_average"])
    w = result["slot_write_ms_per_1024sq"]
    print(f"(writing a decoded image into its planar slot: {w['pillow_planes']:.2f} CPU ms per 1024^2 by Pillow's planes, "
          f"{w['transposing_copy']:.2f} by the transposing copy of its array)")
    print("(content hashes over one source file in memory: " +
          ", ".join(f"{name} {rate:.2f} GB/s" for name, rate in result["content_hash_gb_s"].items()) + ")")
    print(f"(the CPU normalize of one 1024^2 image, on the feed thread of a CPU build: "
          f"{result['cpu_normalize_ms_per_1024sq']:.2f} ms; load average {load})")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("build"))
    return root, {fmt: write_sources(os.path.join(root, fmt), 8, (1280, 960), fmt) for fmt in ("JPEG", "PNG")}


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_build(benchmark, sources, fmt):
    root, _ = sources
    benchmark(build_pass, os.path.join(root, fmt), os.path.join(root, "out"), (448, 576), 2, 4)


@pytest.mark.parametrize("fmt", ["JPEG", "PNG"])
def test_ceiling(benchmark, sources, fmt):
    benchmark(ceiling_pass, sources[1][fmt], (448, 576), 2)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=None, help="decode threads on both sides (default: the cores available)")
    parser.add_argument("--images", type=int, default=None, help="images per build (default 32; 16 with --quick)")
    args = parser.parse_args(sys.argv[1:])
    run_report(quick=args.quick, runs=args.runs, workers=args.workers, images=args.images)
