"""Helpers for tests of code that uses latentfast -- this project's own tests and benchmarks, and yours.

- :func:`poisoned_like` -- an output buffer full of garbage, so a kernel that skips an element is caught;
- :func:`runnable_backends` -- every backend that can run an op on a device type in this process;
- :func:`random_rows` / :func:`write_cache` -- latent caches with arbitrary rows, written with plain
  numpy in the original (seed) layouts and opened by the real :class:`~latentfast.cache.LatentCache`;
  :func:`write_random_cache` -- the same for caches of any size (larger than RAM), written in chunks.
- :func:`spawn_gloo` -- run a function on every rank of a real spawned gloo process group.
"""
from __future__ import annotations

import contextlib
import gc
import json
import os

import numpy as np
import torch

from . import backends


def runnable_backends(op: str, device_type: str = "cpu") -> list[str]:
    """Every concrete backend that can run ``op`` on ``device_type`` tensors in this process."""
    return [name for name, why in backends.availability(op, device_type).items() if not why]


def poisoned_like(shape, dtype, device="cpu") -> torch.Tensor:
    """An output buffer full of garbage (NaN for floats, 0x5A bytes otherwise)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(0x5A)
    return t


def random_rows(rng: np.random.Generator, n: int, channels: int, latent_h: int, w_max: int, min_width: int = 1):
    """``(rows, widths)``: ``n`` float16 ``[C, h, w_i]`` arrays with widths uniform in ``[min_width, w_max]``."""
    widths = rng.integers(min_width, w_max + 1, size=n).astype(np.int32)
    rows = [rng.standard_normal((channels, latent_h, int(w)), dtype=np.float32).astype(np.float16) for w in widths]
    return rows, widths


def write_cache(directory: str, rows, widths, *, w_max: int, layout: str = "padded", white=None, split: str = "train"):
    """Write ``rows`` under ``directory`` in ``layout`` ("padded" or "ragged") and open them as a LatentCache.

    Padded: ``{split}.latents.f16.dat`` float16 ``[N, C, h, w_max]`` + ``widths.npy`` + the nine-field
    ``meta.json``. Ragged: rows ``[C, h, w_i]`` back to back + ``offsets.npy`` int64 ``[N + 1]``.
    Plus ``white.npy`` (``[C, h, 1]``) when ``white`` is given.
    """
    from .cache import LatentCache

    os.makedirs(directory, exist_ok=True)
    channels, latent_h = rows[0].shape[:2]
    n = len(rows)

    def path(suffix):
        return os.path.join(directory, f"{split}.latents.{suffix}")

    if layout == "padded":
        mm = np.memmap(path("f16.dat"), dtype=np.float16, mode="w+", shape=(n, channels, latent_h, w_max))
        for i, row in enumerate(rows):
            mm[i, :, :, : row.shape[-1]] = row
        mm.flush()
        del mm
    else:
        sizes = np.array([row.size for row in rows], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        np.concatenate([row.reshape(-1) for row in rows]).astype(np.float16).tofile(path("f16.dat"))
        np.save(path("offsets.npy"), offsets)
    _write_index(directory, split, widths, channels, latent_h, w_max, layout, white)
    return LatentCache(directory, split)


def _write_index(directory: str, split: str, widths, channels: int, latent_h: int, w_max: int, layout: str, white):
    """The small files beside the data: widths, white column (if any), and the nine-field meta."""

    def path(suffix):
        return os.path.join(directory, f"{split}.latents.{suffix}")

    np.save(path("widths.npy"), np.asarray(widths, dtype=np.int32))
    if white is not None:
        np.save(path("white.npy"), np.asarray(white, dtype=np.float16).reshape(channels, latent_h, 1))
    meta = {"n": len(widths), "channels": int(channels), "latent_h": int(latent_h), "w_max": int(w_max),
            "layout": layout, "pretrained": "test-rows", "subfolder": "", "line_height": 8 * int(latent_h),
            "max_line_width": 8 * int(w_max), "downscale_factor": 8}
    with open(path("meta.json"), "w") as fh:
        json.dump(meta, fh)


def write_random_cache(directory: str, n: int, channels: int, latent_h: int, w_max: int, *, seed: int = 0,
                       min_width: int = 1, layouts=("padded", "ragged"), split: str = "train",
                       chunk_rows: int = 4096) -> dict[str, str]:
    """Caches of ``n`` random rows (widths uniform in ``[min_width, w_max]``, values in [0, 1)), one per
    layout in ``directory/<layout>``, written in chunks of rows: any size, in little memory (for caches
    larger than RAM). The layouts hold the same rows. Returns layout -> folder (nothing is opened)."""
    rng = np.random.default_rng(seed)
    widths = rng.integers(min_width, w_max + 1, size=n).astype(np.int32)
    white = rng.random((channels, latent_h, 1)).astype(np.float16)
    folders = {layout: os.path.join(directory, layout) for layout in layouts}
    files = {}
    for layout, folder in folders.items():
        os.makedirs(folder, exist_ok=True)
        files[layout] = open(os.path.join(folder, f"{split}.latents.f16.dat"), "wb")
    try:
        for start in range(0, n, chunk_rows):
            part = widths[start : start + chunk_rows]
            rows = rng.integers(0, 0x3C00, size=(len(part), channels, latent_h, w_max), dtype=np.uint16).view(np.float16)
            real = np.arange(w_max)[None, None, None, :] < part[:, None, None, None]
            rows = np.where(real, rows, np.float16(0))
            if "padded" in files:
                rows.tofile(files["padded"])
            if "ragged" in files:  # boolean selection keeps C order: row by row, [C, h, w_i] each
                rows[np.broadcast_to(real, rows.shape)].tofile(files["ragged"])
    finally:
        for fh in files.values():
            fh.close()
    for layout, folder in folders.items():
        if layout == "ragged":
            sizes = widths.astype(np.int64) * channels * latent_h
            np.save(os.path.join(folder, f"{split}.latents.offsets.npy"), np.concatenate([[0], np.cumsum(sizes)]))
        _write_index(folder, split, widths, channels, latent_h, w_max, layout, white)
    return folders


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the block with ``torch.set_num_threads(n)``, restoring the previous count after it."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def teardown_process_group() -> None:
    """End a spawned rank's process group safely: free what still holds it (a DDP/FSDP module, a
    reference cycle), wait for every rank, then destroy it. Tearing gloo down while a peer still
    talks to it, or freeing a module that holds the group after ``destroy_process_group``, aborts
    the process ("terminate called without an active exception"). Call it once the objects that
    used the group are out of scope (return them from a function, don't keep them in locals)."""
    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _spawned_rank(rank: int, world_size: int, folder: str, timeout_s: float, fn, args: tuple) -> None:
    import datetime
    import pickle

    import torch.distributed as dist

    torch.set_num_threads(1)  # one core per rank: the ranks stand for separate machines
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(folder, 'store')}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world_size, *args)
    except BaseException as exc:  # returned to the caller, not raised in the child
        result = exc
    finally:
        gc.collect()  # a cycle still holding the group, freed after destroy_process_group, aborts the process
        dist.destroy_process_group()
    with open(os.path.join(folder, f"result{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def spawn_gloo(fn, world_size: int, *args, timeout_s: float = 60.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on every rank of a new gloo group of spawned processes
    (rendezvous through a FileStore in a temporary folder, one thread per rank) and return the
    results in rank order. An exception raised on a rank is returned (not raised) as that rank's
    result. ``fn`` must be importable by name (module level); ``timeout_s`` is the group's timeout."""
    import pickle
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="latentfast_gloo_") as folder:
        mp.start_processes(_spawned_rank, args=(world_size, folder, timeout_s, fn, args), nprocs=world_size, start_method="spawn")
        results = []
        for rank in range(world_size):
            with open(os.path.join(folder, f"result{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results
