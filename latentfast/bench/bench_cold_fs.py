"""Does ``posix_fadvise(WILLNEED)`` start parallel reads on this filesystem, or does the cold path need the pread pool?

For a file in ``FOLDER`` (e.g. on a FUSE or NFS mount), 64 random rows of ``ROW_KIB`` KiB, read right
after the file is evicted (its backing file too, given ``--backing DIR``: a FUSE passthrough
serves reads from the backing file's page cache otherwise), each way median of ``RUNS`` batches:

  faults      pread the rows one after another (what faulting them in one at a time costs)
  willneed    posix_fadvise(WILLNEED) over every row, then pread them (the cold path on a local disk)
  pool x16    ops.read_spans: 16 pread workers at once (the cold path's pool)
  advice      time spent inside the posix_fadvise calls (a call that reads synchronously shows here)
  resident    share of the rows' pages in the page cache 20 ms after WILLNEED, before any read: 0%
              means the advice started no reads here

Run: python -m latentfast.bench.bench_cold_fs FOLDER [--backing DIR] [--mib 256] [--row-kib 64] [--runs 7]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from latentfast import ops
from latentfast.cache.feed import coldread

ROWS = 64


def _evict(paths) -> None:
    for path in paths:
        coldread.evict(path)


def _one(path: str, backing: list[str], offsets: np.ndarray, length: int, way: str) -> tuple[float, float]:
    _evict([path, *backing])
    fd = os.open(path, os.O_RDONLY)
    try:
        handle = coldread.DataFile(path)
        resident, advise_s = 0.0, 0.0
        start = time.perf_counter()
        if way == "pool x16":
            ops.read_spans(fd, offsets, np.full(len(offsets), length), threads=16)
        else:
            if way == "willneed":
                for offset in offsets.tolist():
                    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
                advised = time.perf_counter()
                advise_s = advised - start
                time.sleep(0.02)
                pages = sum(handle.cached_pages(o, length) for o in offsets.tolist())
                resident = pages * coldread.PAGE / (len(offsets) * length)
                start += time.perf_counter() - advised  # the probe is not the read's time
            for offset in offsets.tolist():
                os.pread(fd, length, offset)
        seconds = time.perf_counter() - start
        handle.close()
        return seconds, resident, advise_s
    finally:
        os.close(fd)


def measure(folder: str, backing_dir: str | None, mib: int, row_kib: int, runs: int) -> dict:
    path = os.path.join(folder, "cold_fs_probe.bin")
    backing = [os.path.join(backing_dir, "cold_fs_probe.bin")] if backing_dir else []
    size, length = mib << 20, row_kib << 10
    if not os.path.exists(path) or os.path.getsize(path) != size:
        with open(path, "wb") as fh:
            for _ in range(mib):
                fh.write(os.urandom(1 << 20))
    rng = np.random.default_rng(0)
    found = {}
    for way in ("faults", "willneed", "pool x16"):
        times, resident, advising = [], [], []
        for _ in range(runs):
            offsets = rng.choice(size // length, ROWS, replace=False).astype(np.int64) * length
            seconds, share, advise_s = _one(path, backing, offsets, length, way)
            times.append(seconds)
            resident.append(share)
            advising.append(advise_s)
        found[way] = (statistics.median(times) * 1e3, min(times) * 1e3, max(times) * 1e3, statistics.median(resident),
                      statistics.median(advising) * 1e3)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--backing")
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--row-kib", type=int, default=64)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    kind = coldread.filesystem_type(args.folder)
    print(f"{args.folder}: filesystem {kind!r}; 64 random rows of {args.row_kib} KiB from a {args.mib} MiB file, evicted before each batch")
    for way, (median, low, high, resident, advise_ms) in measure(args.folder, args.backing, args.mib, args.row_kib, args.runs).items():
        print(f"  {way:10s} {median:8.2f} ms median ({low:.2f}-{high:.2f})" + (f", of which the advice calls {advise_ms:.2f} ms; {100 * resident:.0f}% resident after the advice"
                                                                               if way == "willneed" else ""))


if __name__ == "__main__":
    main()
