"""Batches of padded records, hot, against the machine, and the loader against in-process reads.

Records like a text-to-image trainer's (the issue's case): a latent ``[16, 64, 64]`` bf16 and a T5
text ``[L, 4096]`` bf16 (L 50..512, every item its own text), batches of 64, the text padded to the
batch's longest. Hot: every file read once before timing. Per run, each reader passes over the same
batches (round robin, median of 4 passes, every other one in reverse order; the shaped rows in a round
robin of their own); the table gives the median and range over ``--runs`` runs of seconds per batch and
of the ratios.

- ``read_batch``: ``read_batch(idx, fields=("latent", "text"), pad={"text": 0.0})``, a fresh batch each;
- ``read_batch(out=)``: the same into one reused :class:`~latentfast.cache.BatchBuffers`, at torch's
  threads and at one thread;
- ``memcpy``: one copy of the batch's useful bytes (latents + unpadded texts) into a reused buffer,
  from one contiguous stretch of the data files (the ceiling: no gather, no padding written; one thread);
- ``numpy gather``: ``latents[idx]``, ``texts[idx]`` fancy-indexed from one memmap each (the texts
  stored padded to the cache's longest), into fresh arrays; ``numpy gather(out=)``: the same with
  ``np.take(..., out=)`` into reused arrays (like for like with ``read_batch(out=)``);
- packed: ``packed=("text",)`` (``[sum L_i, 4096]``) into reused buffers, against the same memcpy;
- shaped latents: the latents alone (64 items of one shape, ``[16, 64, 64]`` bf16, 128 KiB each) with
  ``read_batch(idx)`` at torch's threads and at one thread, fresh outputs, against one ``.safetensors``
  file per item loaded with ``safetensors.torch.load_file`` and stacked (what per-item trainers read;
  fresh outputs too);
- loader: the second epoch (batches of 16; steady state: workers started, buffers made) of
  :class:`~latentfast.cache.LatentLoader` with 2 workers, 1 worker and in process, against a loop of
  ``read_batch`` over the same batches (fresh outputs, as a DataLoader worker's), and
  ``DataLoader(cache.dataset(...), collate_fn=collate_records)`` (items one by one, then padded);
- ``--s3``: the loader rows again over the cache in object storage (moto on loopback), warm.

    python -m latentfast.bench.bench_loader [--quick] [--runs 3] [--s3] [--no-loader]
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from torch.utils.data import DataLoader

from latentfast.cache import BatchBuffers, LatentCache, LatentCacheWriter, LatentLoader, collate_records, read_batch
from latentfast.cache.store import fields as fieldstore
from latentfast.cache.store.format import cache_path
from latentfast.testing import torch_threads

BATCH = 64


def write(folder: str, n: int, dim: int, seed: int = 0) -> tuple[int, int]:
    """The cache of ``n`` records, the padded text memmap beside it and (with the safetensors package)
    one ``safetensors/k<i>.safetensors`` latent per item; ``(max L, latent bytes)``."""
    try:
        from safetensors.torch import save_file
    except ImportError:  # the per-item baseline is skipped
        save_file = None
    if save_file is not None:
        os.makedirs(os.path.join(folder, "safetensors"))
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(50, 513, (n,), generator=gen).tolist()
    longest = max(lengths)
    padded = np.lib.format.open_memmap(os.path.join(folder, "texts_padded.npy"), mode="w+", dtype=np.uint16,
                                       shape=(n, longest, dim))
    latents = np.lib.format.open_memmap(os.path.join(folder, "latents.npy"), mode="w+", dtype=np.uint16,
                                        shape=(n, 16, 64, 64))
    with LatentCacheWriter(os.path.join(folder, "cache")) as writer:
        for i, L in enumerate(lengths):
            z = torch.randn((16, 64, 64), generator=gen).bfloat16()
            text = torch.randn((L, dim), generator=gen).bfloat16()
            writer.append(f"k{i:05d}", {"latent": z, "text": text})
            latents[i] = z.view(torch.uint16).numpy()
            if save_file is not None:
                save_file({"latent": z}, os.path.join(folder, "safetensors", f"k{i:05d}.safetensors"))
            padded[i, :L] = text.view(torch.uint16).numpy()
            padded[i, L:] = 0
    padded.flush()
    latents.flush()
    return longest, 16 * 64 * 64 * 2


def timed(fn, batches) -> float:
    start = time.perf_counter()
    for batch in batches:
        fn(batch)
    return (time.perf_counter() - start) / len(batches)


def one_run(readers: dict, batches) -> dict[str, float]:
    """Seconds per batch of each reader: the median of 4 round-robin passes (a busy neighbour slows
    every reader alike), every other pass in reverse order (a reader is slowed by the one before it:
    measured, a read right after a 150 MB packed read ran 1.35x slower, whichever it was)."""
    times: dict[str, list[float]] = {name: [] for name in readers}
    for k in range(4):
        for name in list(readers) if k % 2 == 0 else list(readers)[::-1]:
            times[name].append(timed(readers[name], batches))
    return {name: statistics.median(t) for name, t in times.items()}


LOADER_BATCH = 16  # the loader runs: more batches per epoch of the same cache


def loader_run(cache, spec: dict, workers: int) -> float:
    """Seconds per batch of a LatentLoader's second epoch: in steady state (the first started the
    workers, which persist, and made every buffer of the rings); the pass's start is timed."""
    loader = LatentLoader(cache, LOADER_BATCH, seed=0, drop_last=True, num_workers=workers, **spec)
    sum(1 for _ in loader)
    loader.set_epoch(1)
    start = time.perf_counter()
    count = sum(1 for _ in loader)
    return (time.perf_counter() - start) / count


def dataset_run(cache, spec: dict) -> float:
    """Seconds per batch of ``DataLoader(cache.dataset(...), collate_fn=collate_records)`` in process
    (items read one by one, then padded), from its third batch on."""
    loader = DataLoader(cache.dataset(**spec), batch_size=LOADER_BATCH, shuffle=True, drop_last=True,
                        collate_fn=collate_records, generator=torch.Generator().manual_seed(0))
    batches = iter(loader)
    next(batches), next(batches)
    start = time.perf_counter()
    count = sum(1 for _ in batches)
    return (time.perf_counter() - start) / count


def one_thread(fn):
    def run(batch):
        with torch_threads(1):
            return fn(batch)
    return run


def shaped_readers(cache, folder: str) -> dict:
    """The shaped-latents rows: read_batch of the latents alone (fresh outputs) at torch's threads and at
    one, and (with the safetensors package) one file per item loaded and stacked."""
    readers = {"shaped read_batch": lambda b: read_batch(cache, b),
               "shaped read_batch 1 thread": one_thread(lambda b: read_batch(cache, b))}
    try:
        from safetensors.torch import load_file
    except ImportError:
        return readers
    files = os.path.join(folder, "safetensors")
    readers["safetensors per item"] = lambda b: torch.stack([load_file(os.path.join(files, f"k{i:05d}.safetensors"))["latent"]
                                                             for i in b.tolist()])
    return readers


def run_report(quick: bool = False, runs: int = 3, loader: bool = True) -> dict:
    n, dim = (128, 1024) if quick else (192, 4096)
    rng = np.random.default_rng(0)
    batches = [rng.choice(n, BATCH, replace=False) for _ in range(3 if quick else 4)]
    spec = dict(fields=("latent", "text"), pad={"text": 0.0})
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        longest, latent_bytes = write(tmp, n, dim)
        cache = LatentCache(os.path.join(tmp, "cache"))
        lat_mm = np.load(os.path.join(tmp, "latents.npy"), mmap_mode="r")
        txt_mm = np.load(os.path.join(tmp, "texts_padded.npy"), mmap_mode="r")
        text_bytes = cache.field_items["text"].nbytes
        # the memcpy source: the first stretch of each data file as long as the batch's useful bytes
        lat_src = np.memmap(cache_path(cache.cache_dir, "train", "data"), dtype=np.uint8, mode="r")
        txt_src = np.memmap(fieldstore.field_path(cache.cache_dir, "train", "text", "data"), dtype=np.uint8, mode="r")
        useful = max(int(text_bytes[b].sum()) for b in batches)
        dst = np.empty(BATCH * latent_bytes + useful, dtype=np.uint8)
        dst[:] = 0  # (its pages faulted in once, as a reused buffer's are)

        def memcpy(b):
            t = int(text_bytes[b].sum())
            np.copyto(dst[: BATCH * latent_bytes], lat_src[: BATCH * latent_bytes])
            np.copyto(dst[BATCH * latent_bytes : BATCH * latent_bytes + t], txt_src[:t])

        padded_out, packed_out = BatchBuffers(), BatchBuffers()
        lat_buf = np.empty((BATCH, *lat_mm.shape[1:]), dtype=lat_mm.dtype)
        txt_buf = np.empty((BATCH, *txt_mm.shape[1:]), dtype=txt_mm.dtype)

        def numpy_out(b):
            np.take(lat_mm, np.sort(b), axis=0, out=lat_buf, mode="clip")  # (mode="raise" buffers out)
            np.take(txt_mm, np.sort(b), axis=0, out=txt_buf, mode="clip")

        readers = {
            "read_batch": lambda b: read_batch(cache, b, **spec),
            "read_batch(out=)": lambda b: read_batch(cache, b, out=padded_out, **spec),
            "read_batch(out=) 1 thread": one_thread(lambda b: read_batch(cache, b, out=padded_out, **spec)),
            "memcpy": memcpy,
            "numpy gather": lambda b: (lat_mm[np.sort(b)], txt_mm[np.sort(b)]),
            "numpy gather(out=)": numpy_out,
            "packed(out=)": lambda b: read_batch(cache, b, fields=("latent", "text"), packed=("text",), out=packed_out),
        }
        shaped = shaped_readers(cache, tmp)  # (a round robin of their own, away from the 256 MB readers)
        for fn in (*readers.values(), *shaped.values()):  # hot: every page read once, every reused buffer made
            for b in batches:
                fn(b)
        per_run = [{**one_run(readers, batches), **one_run(shaped, batches)} for _ in range(runs)]
        loops = []
        for _ in range(runs if loader else 0):
            every = [b["index"].clone() for b in LatentLoader(cache, LOADER_BATCH, seed=0, drop_last=True, **spec)]
            loops.append({"loader 2 workers": loader_run(cache, spec, 2), "loader 1 worker": loader_run(cache, spec, 1),
                          "loader in process": loader_run(cache, spec, 0),
                          "read_batch loop": timed(lambda b: read_batch(cache, b, **spec), every),
                          "cache.dataset + DataLoader": dataset_run(cache, spec)})
        del lat_src, txt_src, lat_mm, txt_mm
    return {"n": n, "dim": dim, "longest": longest, "runs": per_run, "loops": loops, "threads": torch.get_num_threads(),
            "load": os.getloadavg()[0]}


def s3_loops(runs: int) -> list[dict]:
    """The loader rows over a cache in object storage (a loopback moto server), warm: every chunk in
    the node-local chunk cache (each run's first epoch fetched what the second reads). A smaller cache
    (128 records, texts [L, 1024]): moto holds its objects in memory."""
    from latentfast.cache.remote import push
    from latentfast.testing import create_bucket, s3_options, s3_server

    spec = dict(fields=("latent", "text"), pad={"text": 0.0})
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp, s3_server() as endpoint:
        write(tmp, 128, 1024)
        create_bucket(endpoint, "bench")
        push(os.path.join(tmp, "cache"), "s3://bench/cache", s3_options(endpoint))
        cache = LatentCache("s3://bench/cache", storage_options=s3_options(endpoint), local_cache=os.path.join(tmp, "lc"),
                            local_cache_bytes=1 << 32)
        loops = []
        for _ in range(runs):
            every = [b["index"].clone() for b in LatentLoader(cache, LOADER_BATCH, seed=0, drop_last=True, **spec)]
            loops.append({"loader 2 workers": loader_run(cache, spec, 2), "loader 1 worker": loader_run(cache, spec, 1),
                          "loader in process": loader_run(cache, spec, 0),
                          "read_batch loop": timed(lambda b: read_batch(cache, b, **spec), every)})
    return loops


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.3g} [{min(values):.3g}, {max(values):.3g}]"


# reader -> what its ratio says: (label, numerator, denominator) of seconds per batch, per run
RATIOS = {
    "read_batch": [("of memcpy", "memcpy", "read_batch")],
    "read_batch(out=)": [("of memcpy", "memcpy", "read_batch(out=)"),
                         ("x numpy gather(out=)", "numpy gather(out=)", "read_batch(out=)")],
    "read_batch(out=) 1 thread": [("of memcpy", "memcpy", "read_batch(out=) 1 thread"),
                                  ("x numpy gather(out=)", "numpy gather(out=)", "read_batch(out=) 1 thread")],
    "numpy gather": [("x: read_batch(out=) over it", "numpy gather", "read_batch(out=)"),
                     ("x: read_batch (fresh) over it", "numpy gather", "read_batch")],
    "packed(out=)": [("of memcpy", "memcpy", "packed(out=)")],
    "shaped read_batch": [("x safetensors per item", "safetensors per item", "shaped read_batch"),
                          ("x 1 thread", "shaped read_batch 1 thread", "shaped read_batch")],
    "shaped read_batch 1 thread": [("x safetensors per item", "safetensors per item", "shaped read_batch 1 thread")],
}


def print_report(report: dict) -> None:
    runs, loops = report["runs"], report["loops"]
    print(f"{report['n']} records: latent [16, 64, 64] bf16 + text [L, {report['dim']}] bf16 (L <= {report['longest']}), "
          f"batches of {BATCH}, hot; {report['threads']} torch threads; load average {report['load']:.1f}; "
          f"median [range] of {len(runs)} runs")
    print("| reader | ms / batch | ratio |")
    print("|---|---|---|")
    for name in runs[0]:
        ms = summary([r[name] * 1e3 for r in runs])
        ratio = "; ".join(f"{summary([r[top] / r[bottom] for r in runs])} {label}"
                          for label, top, bottom in RATIOS.get(name, ()) if top in runs[0] and bottom in runs[0])
        print(f"| {name} | {ms} | {ratio} |")
    if not loops and not report.get("s3"):
        return
    print(f"| loader (batches of {LOADER_BATCH}) | ms / batch | speed vs read_batch loop | vs loader in process |")
    print("|---|---|---|---|")
    for label, rows in (("", loops), ("s3:// warm, ", report.get("s3") or [])):
        for name in [k for k in ("loader 2 workers", "loader 1 worker", "loader in process", "read_batch loop",
                                 "cache.dataset + DataLoader")
                     if rows and k in rows[0]]:
            print(f"| {label}{name} | {summary([r[name] * 1e3 for r in rows])} | "
                  f"{summary([r['read_batch loop'] / r[name] for r in rows])}x | "
                  f"{summary([r['loader in process'] / r[name] for r in rows])}x |")


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--s3", action="store_true", help="also the loader over s3:// (a loopback moto server), warm")
    parser.add_argument("--no-loader", action="store_true", help="the batch readers only, not the loader rows")
    args = parser.parse_args(argv)
    report = run_report(quick=args.quick, runs=args.runs, loader=not args.no_loader)
    if args.s3:
        report["s3"] = s3_loops(args.runs)
    print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
