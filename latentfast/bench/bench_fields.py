"""Records of fields: batches of 64 items of a float16 latent + a variable-length bf16 text embedding.

- latentfast: one cache of records (``text`` [L_i, D] bf16, captions repeating: ``distinct`` class
  prompts), read with ``read_batch(idx, fields=("latent", "text"), pad={"text": 0.0})`` (one compiled
  gather per field per batch), with all torch threads and with one (like the per-item reader);
  and with ``packed=("text",)`` (the texts back to back, ``[sum L_i, D]``: the true bytes only);
- musubi-style pairs: a latent ``.safetensors`` + a ``_te.safetensors`` per item, each read with
  ``safetensors.torch.load_file``, then stacked and padded (``pad_sequence``) into the same batch
  (like-for-like with the padded read), or the texts concatenated (``torch.cat``: the same
  ``[sum L_i, D]`` batch, like-for-like with the packed read; a list of the loaded tensors alone
  would leave the bytes in safetensors' file map, untouched until the step reads them);
- memcpy: one copy of the batch's true bytes (latents + texts, unpadded) into a fresh buffer: the ceiling.

The example's step from the cache vs encoding every step is measured by the example itself
(``python examples/train_text_to_image.py --compare 3``: both modes alternately in one process).

Every reader allocates its batch. Hot: every file read once before timing. Cold: every file evicted
from the page cache (``posix_fadvise(DONTNEED)``) before each pass. Ratios are per run (median and
range of ``--runs`` runs). Bytes on disk: the cache with equal values stored once, the cache written
with sharing disabled (the hash made unique per value), and the per-item pairs; file counts.

    python -m latentfast.bench.bench_fields [--quick] [--runs 3]

``--writer [--base DIR] [--sizes 100000,1000000] [--runs 3]``: the writer of records with fields (issue 33).
N tiny records (latent ``[4, 1, 1]`` float16, ``pooled`` float32 ``[4]`` all but distinct, ``mask`` uint8
``[3]`` of 3 distinct values), ``flush_every=4096``, each run a fresh process (runs alternate between the
writers): ``append`` one by one with this checkout's writer and with the one at ``--base`` (a checkout of
the code before, e.g. ``git archive main | tar -x -C /tmp/fw_base`` with its native library built there),
``append_many`` of record batches of 4,096 (this checkout only: the writer before took no records in
bulk), and ``append_many`` of the bare latents (no fields: the floor). Per run: wall and CPU us per
item of the appends (``finish`` apart), the process's ``RssAnon`` growth over the appends and after
``finish``, and the sha256 of the finished cache's files (the same for every writer and path).
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from latentfast.cache import LatentCache, LatentCacheWriter
from latentfast.cache.feed import coldread
from latentfast.cache.store import fields as fieldstore
from latentfast.testing import torch_threads

BATCH = 64
WRITER_BULK = 4096  # records per append_many, and the writer's flush_every
WRITER_MODES = ("append", "base append", "append_many", "plain append_many")


def make_items(n: int, dim: int, distinct: int, seed: int = 0):
    """``(latents, captions, caption_of)``: n latents [4, 32, 32] f16, ``distinct`` bf16 [L, dim] captions
    (L in 50..512), item i's caption index."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(50, 513, (distinct,), generator=gen).tolist()
    captions = [torch.randn((L, dim), generator=gen).bfloat16() for L in lengths]
    caption_of = torch.randint(0, distinct, (n,), generator=gen).tolist()
    latents = [torch.randn((4, 32, 32), generator=gen).half() for _ in range(n)]
    return latents, captions, caption_of


def write_cache(folder: str, latents, captions, caption_of) -> None:
    with LatentCacheWriter(folder) as writer:
        for i, z in enumerate(latents):
            writer.append(f"k{i:06d}", {"latent": z, "text": captions[caption_of[i]]})


def write_pairs(folder: str, latents, captions, caption_of) -> None:
    from safetensors.torch import save_file

    os.makedirs(folder)
    for i, z in enumerate(latents):
        save_file({"latents_32x32_float16": z}, os.path.join(folder, f"k{i:06d}_latent.safetensors"))
        save_file({"varlen_t5_bf16": captions[caption_of[i]]}, os.path.join(folder, f"k{i:06d}_te.safetensors"))


def read_pairs(folder: str, batch, pad: bool = True) -> dict:
    """The per-item pairs as one batch: the texts padded (``pad_sequence``) or concatenated."""
    from safetensors.torch import load_file

    zs, texts = [], []
    for i in batch:
        zs.append(load_file(os.path.join(folder, f"k{i:06d}_latent.safetensors"))["latents_32x32_float16"])
        texts.append(load_file(os.path.join(folder, f"k{i:06d}_te.safetensors"))["varlen_t5_bf16"])
    return {"latent": torch.stack(zs), "text": torch.nn.utils.rnn.pad_sequence(texts, batch_first=True) if pad else torch.cat(texts)}


def disk(folder: str) -> tuple[int, int]:
    names = [os.path.join(folder, f) for f in os.listdir(folder) if not f.startswith(".")]
    return len(names), sum(os.path.getsize(p) for p in names)


def evict_all(folder: str) -> None:
    for name in os.listdir(folder):
        if not name.startswith("."):
            coldread.evict(os.path.join(folder, name))


def time_pass(fn, batches, evict=None) -> float:
    """Seconds per batch of one pass over ``batches`` (after ``evict()``, if given)."""
    if evict is not None:
        evict()
    start = time.perf_counter()
    for batch in batches:
        fn(batch)
    return (time.perf_counter() - start) / len(batches)


def one_run(readers: dict, batches, evictors: dict, cold: bool) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in readers}
    for _ in range(1 if cold else 3):  # round-robin: a busy neighbour slows every reader alike
        for name, fn in readers.items():
            times[name].append(time_pass(fn, batches, evictors.get(name) if cold else None))
    return {name: statistics.median(t) for name, t in times.items()}


def run_report(quick: bool = False, runs: int = 3) -> dict:
    n, dim, distinct = (256, 512, 16) if quick else (256, 4096, 16)
    latents, captions, caption_of = make_items(n, dim, distinct)
    rng = np.random.default_rng(0)
    batches = [rng.choice(n, BATCH, replace=False).tolist() for _ in range(4 if quick else 8)]
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        shared, unshared, pairs = (os.path.join(tmp, d) for d in ("cache", "cache_unshared", "pairs"))
        write_cache(shared, latents, captions, caption_of)
        real_hash = fieldstore.value_hash
        fieldstore.value_hash = lambda payload: os.urandom(16)  # no candidates: every value stored
        try:
            write_cache(unshared, latents, captions, caption_of)
        finally:
            fieldstore.value_hash = real_hash
        write_pairs(pairs, latents, captions, caption_of)
        cache = LatentCache(shared)
        source = torch.empty(sum(z.nbytes for z in latents) + sum(captions[c].nbytes for c in caption_of), dtype=torch.uint8)
        source.random_()
        item_bytes = [latents[i].nbytes + captions[caption_of[i]].nbytes for i in range(n)]

        def lf(batch):
            return cache.read_batch(batch, fields=("latent", "text"), pad={"text": 0.0})

        def lf_packed(batch):
            return cache.read_batch(batch, fields=("latent", "text"), packed=("text",))

        def memcpy(batch):
            nbytes = sum(item_bytes[i] for i in batch)
            return torch.empty(nbytes, dtype=torch.uint8).copy_(source[:nbytes])

        readers = {"latentfast": lf, "latentfast 1 thread": lambda b: _one_thread(lf, b),
                   "musubi pairs": lambda b: read_pairs(pairs, b), "latentfast packed": lf_packed,
                   "musubi pairs cat": lambda b: read_pairs(pairs, b, pad=False), "memcpy": memcpy}
        for batch in batches:  # the same values from every reader; every file read once (hot)
            a, b, c = lf(batch), read_pairs(pairs, batch), lf_packed(batch)
            assert torch.equal(a["latent"], b["latent"]) and torch.equal(a["text"].view(torch.int16), b["text"].view(torch.int16))
            joined = read_pairs(pairs, batch, pad=False)["text"]
            assert torch.equal(c["latent"], b["latent"]) and torch.equal(c["text"].view(torch.int16), joined.view(torch.int16))
        evictors = {"latentfast": lambda: evict_all(shared), "latentfast 1 thread": lambda: evict_all(shared),
                    "musubi pairs": lambda: evict_all(pairs), "latentfast packed": lambda: evict_all(shared),
                    "musubi pairs cat": lambda: evict_all(pairs)}
        result = {"items": n, "dim": dim, "distinct_captions": distinct, "batch": BATCH, "threads": torch.get_num_threads(),
                  "mib_per_batch": statistics.mean(sum(item_bytes[i] for i in b) for b in batches) / 2**20,
                  "padded_mib_per_batch": statistics.mean(sum(v.nbytes for v in lf(b).values()) for b in batches) / 2**20}
        for mode in ("hot", "cold"):
            per_run = [one_run({k: v for k, v in readers.items() if mode == "hot" or k != "memcpy"}, batches, evictors, mode == "cold")
                       for _ in range(runs)]
            result[mode] = summarize(per_run)
        result["disk"] = {"latentfast (equal values once)": disk(shared), "latentfast (no sharing)": disk(unshared),
                          "musubi pairs": disk(pairs)}
    print_report(result)
    return result


def _one_thread(fn, batch):
    with torch_threads(1):
        return fn(batch)


def summarize(per_run: list[dict]) -> dict:
    """Median ms per batch of each reader, and per-run ratios (median, min, max)."""
    out = {"ms": {k: 1e3 * statistics.median(r[k] for r in per_run) for k in per_run[0]}, "ratios": {}}
    pairs = [("musubi pairs / latentfast", "musubi pairs", "latentfast"),
             ("musubi pairs / latentfast 1 thread", "musubi pairs", "latentfast 1 thread"),
             ("memcpy / latentfast (share of the ceiling)", "memcpy", "latentfast"),
             ("musubi pairs cat / latentfast packed", "musubi pairs cat", "latentfast packed"),
             ("memcpy / latentfast packed (share of the ceiling)", "memcpy", "latentfast packed")]
    for label, num, den in pairs:
        if num in per_run[0]:
            values = [r[num] / r[den] for r in per_run]
            out["ratios"][label] = (statistics.median(values), min(values), max(values))
    return out


def print_report(result: dict) -> None:
    print(f"records: batches of {result['batch']} of latent [4,32,32] f16 + text [L,{result['dim']}] bf16 (L 50..512, "
          f"{result['distinct_captions']} distinct captions over {result['items']} items), {result['mib_per_batch']:.1f} MiB "
          f"of true bytes per batch ({result['padded_mib_per_batch']:.1f} MiB padded, what the padded readers return), "
          f"{result['threads']} torch threads, load {os.getloadavg()[0]:.1f}")
    for mode in ("hot", "cold"):
        print(f"  {mode}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in result[mode]["ms"].items()))
        for label, (med, lo, hi) in result[mode]["ratios"].items():
            print(f"    {label}: {med:.2f}x (range {lo:.2f}-{hi:.2f})")
    for name, (files, nbytes) in result["disk"].items():
        print(f"  disk {name}: {files} files, {nbytes / 2**20:.1f} MiB")


def write_records(folder: str, n: int, mode: str) -> dict:
    """One writer run (see the module docstring): ``mode`` ``append``, ``append_many`` or ``plain``."""
    import hashlib

    import latentfast
    from latentfast.bench.bench_index import anon_bytes, key_of

    rng = np.random.default_rng(0)
    latents = np.zeros((WRITER_BULK, 4, 1, 1), np.float16)
    before = anon_bytes()
    writer = LatentCacheWriter(folder, "train", flush_every=WRITER_BULK)
    start, cpu = time.perf_counter(), time.process_time()
    for s in range(0, n, WRITER_BULK):
        count = min(WRITER_BULK, n - s)
        keys = [key_of(i) for i in range(s, s + count)]
        pooled = rng.integers(-99, 99, (count, 4)).astype(np.float32)
        mask = (np.arange(s, s + count) % 3).astype(np.uint8)[:, None].repeat(3, axis=1)
        if mode == "append":
            for k, key in enumerate(keys):
                writer.append(key, {"latent": latents[k], "pooled": pooled[k], "mask": mask[k]})
        elif mode == "append_many":
            writer.append_many(keys, {"latent": latents[:count], "pooled": pooled, "mask": mask})
        else:
            writer.append_many(keys, latents[:count])
    appended, cpu = time.perf_counter(), time.process_time() - cpu
    grown = anon_bytes() - before
    writer.finish()
    finished, after_finish = time.perf_counter(), anon_bytes() - before
    digest = hashlib.sha256()  # (after the figures: it reads every file whole)
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), "rb") as fh:
            digest.update(name.encode() + hashlib.sha256(fh.read()).digest())
    return {"us_per_item": (appended - start) / n * 1e6, "cpu_us_per_item": cpu / n * 1e6, "finish_s": finished - appended,
            "anon_growth": grown, "anon_after_finish": after_finish, "files_sha256": digest.hexdigest()[:16],
            "code": os.path.dirname(os.path.dirname(latentfast.__file__))}


def _writer_child(folder: str, n: int, mode: str, base: str | None) -> dict:
    """:func:`write_records` in a fresh interpreter, with this checkout's package or (``base``) the one at ``base``."""
    import json
    import subprocess

    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": base or here}
    code = f"import json, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); import bench_fields as b; " \
           f"print(json.dumps(b.write_records({folder!r}, {n}, {mode!r})))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=7200,
                          cwd=os.path.dirname(folder))  # (not this checkout: "-c" puts the working directory first on sys.path)
    if done.returncode != 0:
        raise RuntimeError(f"writer child {mode} ({base or here}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def writer_report(sizes=(100_000, 1_000_000), runs: int = 3, base: str | None = None, modes=WRITER_MODES) -> dict:
    """Every mode at every size, ``runs`` rounds of fresh processes (the modes alternate within a round)."""
    out: dict = {}
    for n in sizes:
        per_mode: dict[str, list[dict]] = {m: [] for m in modes if base or m != "base append"}
        for _ in range(runs):
            for mode in per_mode:
                with tempfile.TemporaryDirectory(prefix="latentfast_fieldswriter_", dir=os.environ.get("BENCH_TMP")) as tmp:
                    child_mode = {"base append": "append", "plain append_many": "plain"}.get(mode, mode)
                    per_mode[mode].append(_writer_child(os.path.join(tmp, "c"), n, child_mode, base if mode == "base append" else None))
                print(f"  N={n} {mode}: {per_mode[mode][-1]}", flush=True)
        out[n] = per_mode
    print_writer_report(out)
    return out


def print_writer_report(out: dict) -> None:
    print(f"writer of records with 2 tiny fields (flush_every={WRITER_BULK}), load {os.getloadavg()[0]:.1f}; median [range] of runs")
    print("| N | writer | us/item | CPU us/item | RssAnon growth MiB | after finish MiB | finish s | files sha256 |")
    print("|---|---|---|---|---|---|---|---|")
    for n, per_mode in out.items():
        for mode, results in per_mode.items():
            def spread(key, scale=1.0):
                values = [r[key] * scale for r in results]
                return f"{statistics.median(values):.3g} [{min(values):.3g}-{max(values):.3g}]"

            print(f"| {n:.0e} | {mode} | {spread('us_per_item')} | {spread('cpu_us_per_item')} | {spread('anon_growth', 2**-20)} | "
                  f"{spread('anon_after_finish', 2**-20)} | {spread('finish_s')} | {' '.join(sorted({r['files_sha256'] for r in results}))} |")


if __name__ == "__main__":
    runs = int(sys.argv[sys.argv.index("--runs") + 1]) if "--runs" in sys.argv else 3
    if "--writer" in sys.argv:
        sizes = [int(float(x)) for x in sys.argv[sys.argv.index("--sizes") + 1].split(",")] if "--sizes" in sys.argv else (100_000, 1_000_000)
        modes = sys.argv[sys.argv.index("--modes") + 1].split(",") if "--modes" in sys.argv else WRITER_MODES
        writer_report(sizes, runs, sys.argv[sys.argv.index("--base") + 1] if "--base" in sys.argv else None, modes)
    else:
        run_report(quick="--quick" in sys.argv, runs=runs)
