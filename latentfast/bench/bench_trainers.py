"""Trainer caches: the readers (records/s), ``import_latents`` (items/s) and reads of the imported cache, each vs the trainer's own bare per-file reads.

Run: ``python -m latentfast.bench.bench_trainers [--items N]``. Each trainer's fixture (latentfast.cache.trainers.
fixtures, the fixtures' small tensors: the figures measure per-item overhead, not bandwidth) is written
once to a temp folder (musubi-tuner and SimpleTuner items in 8 latent sizes, as buckets give; the other
fixtures have their own bucket sets); then, median of 5 runs (after 1 warm-up, files in the page cache), we time

- ``records``: ``open_source(folder, fmt)`` and iterating every record (scan + all reads, text included);
- ``trainer reads``: only the bare per-file load call the trainer makes for the same files
  (``np.load`` + every array, ``safetensors.torch.load_file``, ``torch.load``, gzip + ``torch.load``,
  sqlite + seek + ``torch.load``), with none of the pairing, key parsing or dequantizing.

Then, per trainer, median and range of 3 runs:

- ``import``: ``import_latents(folder, out, format=fmt)`` into a fresh folder each run (scan, reads,
  durable writes with fdatasync, CRC read-back, index): items/s;
- ``cache epoch``: every item of the imported cache once, in random batches of ``--batch`` items of one
  shape (a shaped cache's batch), every field read (variable-length ones padded; ones that vary past their
  first dimension in one read_batch per shape), vs ``trainer reads`` of
  every file once (an epoch of the trainer's own per-item loads). Both warm (page cache), both build new
  tensors (read_batch allocates its outputs; the trainer's loads allocate theirs).

Both sides read the same bytes and build new tensors (neither reuses buffers).
"""
from __future__ import annotations

import argparse
import glob
import gzip
import io
import os
import sqlite3
import statistics
import tempfile
import time

import numpy as np
import torch
from safetensors.torch import load_file

from latentfast.cache import LatentCache, import_latents
from latentfast.cache.trainers import fixtures as fx
from latentfast.cache.trainers import open_source
from latentfast.testing import torch_threads


def _npz_reads(folder):
    for path in sorted(glob.glob(os.path.join(folder, "*.npz"))):
        with np.load(path) as npz:
            [npz[k] for k in npz.files]


def _safetensors_reads(folder):
    for path in sorted(glob.glob(os.path.join(folder, "**", "*.safetensors"), recursive=True)):
        load_file(path)


def _pt_reads(folder):
    for path in sorted(glob.glob(os.path.join(folder, "**", "*.pt"), recursive=True)):
        with open(path, "rb") as fh:
            torch.load(io.BytesIO(gzip.decompress(fh.read())), map_location="cpu")


def _shard_reads(folder):
    for db in sorted(glob.glob(os.path.join(folder, "**", "metadata.db"), recursive=True)):
        con = sqlite3.connect(db)
        items = con.execute("SELECT shard, shard_index FROM items").fetchall()
        tables = {s: con.execute(f"SELECT offset, size FROM shard_{s}").fetchall() for s in {s for s, _ in items}}
        con.close()
        for shard, index in items:
            offset, size = tables[shard][index]
            with open(os.path.join(os.path.dirname(db), f"shard_{shard}.bin"), "rb") as fh:
                fh.seek(offset)
                torch.load(io.BytesIO(fh.read(size)), map_location="cpu")


CASES = {  # format: (writer(folder, n), bare reads, reader options)
    "kohya": (lambda d, n: fx.write_kohya(d, arch="flux", n=n), _npz_reads, {}),
    "musubi-tuner": (lambda d, n: fx.write_musubi(d, kind="wan_i2v", n=n, buckets=8), _safetensors_reads, {}),
    "ai-toolkit": (lambda d, n: fx.write_ai_toolkit(d, n=n, uint8=True), _safetensors_reads, {}),
    "simpletuner": (lambda d, n: fx.write_simpletuner(os.path.join(d, "c"), os.path.join(d, "i"), n=n, buckets=8), _pt_reads,
                    {"images": "i"}),
    "diffusion-pipe": (lambda d, n: fx.write_diffusion_pipe(d, n=n, shard_size_bytes=1 << 20), _shard_reads, {}),
}


def _median(fn, repeat=5):
    fn()
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), min(samples), max(samples)


def _batches(cache: LatentCache, batch: int, seed: int = 0) -> list[list[int]]:
    """Every item once, in random batches of one latent shape (the last of each shape may be smaller)."""
    rng = np.random.default_rng(seed)
    groups: dict[tuple, list[int]] = {}
    for i, shape in enumerate(cache.shapes.tolist()):
        groups.setdefault(tuple(shape), []).append(i)
    out = []
    for members in groups.values():
        members = rng.permutation(members).tolist()
        out.extend(members[k:k + batch] for k in range(0, len(members), batch))
    return [out[k] for k in rng.permutation(len(out))]


def _read_epoch(cache: LatentCache, batches, fields, pad: dict, apart: list) -> None:
    for indices in batches:
        cache.read_batch(indices, fields=fields, pad=pad)
        for name in apart:  # one read_batch per shape of the batch's values (every byte is read)
            shapes = cache.fields[name]["shapes"]
            groups: dict[tuple, list[int]] = {}
            for i in indices:
                groups.setdefault(tuple(shapes[i]), []).append(i)
            for group in groups.values():
                cache.read_batch(group, fields=(name,))


def _fields_and_pad(cache: LatentCache, batches) -> tuple[tuple, dict, list]:
    """``(fields read, pad, fields read apart)``: a field whose first dimension varies within a batch is padded
    (0 / False); one that varies past its first dimension (``[1, L]`` masks kept as the trainer saved them)
    cannot be padded and is read in one batch per shape."""
    fields, pad, left_out = [], {}, []
    for name, f in cache.fields.items():
        per_batch = [f["shapes"][b] for b in batches]
        if name != "latent" and f["ndim"] > 1 and any(len(np.unique(s[:, 1:], axis=0)) > 1 for s in per_batch):
            left_out.append(name)
            continue
        fields.append(name)
        if name != "latent" and f["ndim"] and any(len(np.unique(s[:, 0])) > 1 for s in per_batch):
            pad[name] = False if f["dtype"] == torch.bool else 0
    return tuple(fields), pad, left_out


def _fixtures(items: int):
    """``(format, folder, reader options, bare reads, temp dir)`` of each trainer's fixture, written to a temp dir."""
    for fmt, (write, bare, options) in CASES.items():
        with tempfile.TemporaryDirectory() as d:
            write(d, items)
            folder = os.path.join(d, "c") if fmt == "simpletuner" else d
            yield fmt, folder, {k: os.path.join(d, v) for k, v in options.items()}, bare, d


def run_import(items: int, batch: int) -> list[tuple]:
    rows = []
    for fmt, folder, opts, bare, d in _fixtures(items):
        runs = []

        def one_import():
            out = tempfile.mkdtemp(dir=d)
            import_latents(folder, out, format=fmt, quiet=True, **opts)
            runs.append(out)
        imported = _median(one_import, repeat=3)
        cache = LatentCache(runs[-1])
        batches = _batches(cache, batch)
        fields, pad, left_out = _fields_and_pad(cache, batches)
        ours = _median(lambda: _read_epoch(cache, batches, fields, pad, left_out), repeat=3)
        theirs = _median(lambda: bare(folder), repeat=3)
        rows.append((fmt, len(cache), len(cache) / imported[0], imported, ours, theirs, theirs[0] / ours[0], left_out,
                     len(cache) / len(batches)))
    return rows


def run(items: int) -> list[tuple]:
    rows = []
    for fmt, folder, opts, bare, _ in _fixtures(items):
        count = len(open_source(folder, fmt, **opts))
        ours = _median(lambda: sum(1 for _ in open_source(folder, fmt, **opts)))
        theirs = _median(lambda: bare(folder))
        rows.append((fmt, count, count / ours[0], ours, theirs, ours[0] / theirs[0]))
    return rows


def run_report(quick: bool = False, items: int | None = None, batch: int = 16) -> dict:
    """The ``latentfast bench`` suite: both tables (printed) and their rows."""
    items = items or (40 if quick else 100)
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print(f"{'format':>15} {'records':>8} {'records/s':>10} {'records s (min-max)':>24} {'trainer reads s (min-max)':>26} {'ratio':>6}")
    with torch_threads(1):
        reads = run(items)
    for fmt, count, rate, ours, theirs, ratio in reads:
        print(f"{fmt:>15} {count:>8} {rate:>10.0f} {ours[0]:>8.3f} ({ours[1]:.3f}-{ours[2]:.3f}) "
              f"{theirs[0]:>10.3f} ({theirs[1]:.3f}-{theirs[2]:.3f}) {ratio:>6.2f}")
    print()
    print(f"{'format':>15} {'items':>6} {'batch':>6} {'import items/s':>15} {'import s (min-max)':>22} "
          f"{'cache epoch s (min-max)':>26} {'trainer reads s (min-max)':>26} {'trainer / cache':>16}")
    with torch_threads(1):
        imports = run_import(items, batch)
    for fmt, count, rate, imported, ours, theirs, ratio, left_out, per_batch in imports:
        print(f"{fmt:>15} {count:>6} {per_batch:>6.1f} {rate:>15.0f} {imported[0]:>9.3f} ({imported[1]:.3f}-{imported[2]:.3f}) "
              f"{ours[0]:>12.4f} ({ours[1]:.4f}-{ours[2]:.4f}) {theirs[0]:>12.4f} ({theirs[1]:.4f}-{theirs[2]:.4f}) {ratio:>16.1f}"
              + (f"   (read per shape: {', '.join(left_out)})" if left_out else ""))
    load = os.getloadavg()
    print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    return {"items": items, "batch": batch,
            "records": [{"format": r[0], "records": r[1], "records_per_s": r[2], "ratio": r[5]} for r in reads],
            "imports": [{"format": r[0], "items": r[1], "import_items_per_s": r[2], "trainer_over_cache": r[6],
                         "read_per_shape": r[7]} for r in imports]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=100, help="images per trainer fixture")
    parser.add_argument("--batch", type=int, default=16, help="items per read_batch of the imported cache")
    args = parser.parse_args()
    run_report(items=args.items, batch=args.batch)



if __name__ == "__main__":
    main()
