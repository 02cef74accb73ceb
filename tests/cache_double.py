"""A small stand-in for ``latentfast.cache.LatentCache`` over real files written with numpy.

It provides exactly the attributes ``read_batch`` and the loader rely on (``len``, ``meta``,
``widths``, ``white_column``, ``channels``, ``latent_h``, ``w_max``, ``layout``, ``cache[i]``,
``gather_source()``), opens its memmap lazily per process and pickles as paths only, so tests and
the benchmark can switch to the real reader by changing one fixture.

Files: the specification's padded layout (``{split}.latents.f16.dat`` float16 ``[N, C, h, w_max]``,
``{split}.latents.widths.npy`` int32, ``{split}.latents.meta.json``) or a ragged one (rows
``[C, h, w_i]`` back to back, ``{split}.latents.offsets.npy`` int64 ``[N + 1]`` in elements), plus
``{split}.latents.white.npy`` (``[C, h, 1]``) when a white column is written.
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch


class CacheDouble:
    def __init__(self, directory: str, split: str = "train"):
        self.directory, self.split = directory, split
        with open(self._path("meta.json")) as fh:
            self.meta = json.load(fh)
        self.channels, self.latent_h, self.w_max = self.meta["channels"], self.meta["latent_h"], self.meta["w_max"]
        self.layout = self.meta.get("layout", "padded")
        self.widths = np.load(self._path("widths.npy")).astype(np.int32)
        white_path = self._path("white.npy")
        self.white_column = torch.from_numpy(np.load(white_path)) if os.path.exists(white_path) else None
        self._source = None  # opened lazily in each process

    def _path(self, suffix: str) -> str:
        return os.path.join(self.directory, f"{self.split}.latents.{suffix}")

    def __len__(self) -> int:
        return int(self.meta["n"])

    def __getstate__(self):
        return {**self.__dict__, "_source": None}

    def gather_source(self):
        if self._source is None:
            # copy-on-write mapping: writable for numpy/torch, never written back
            data = torch.from_numpy(np.memmap(self._path("f16.dat"), dtype=np.float16, mode="c").reshape(-1))
            widths = torch.from_numpy(self.widths)
            rows = torch.arange(len(self), dtype=torch.int64)
            if self.layout == "padded":
                offsets = rows * (self.channels * self.latent_h * self.w_max)
                pitch = self.w_max
            else:
                offsets = torch.from_numpy(np.load(self._path("offsets.npy"))[:-1].astype(np.int64))
                pitch = 0
            self._source = (data, offsets.contiguous(), widths, pitch)
        return self._source

    def __getitem__(self, i: int) -> torch.Tensor:
        data, offsets, widths, pitch = self.gather_source()
        w = int(widths[i])
        line_pitch = pitch or w
        start = int(offsets[i])
        block = data[start : start + self.channels * self.latent_h * line_pitch]
        return block.reshape(self.channels, self.latent_h, line_pitch)[:, :, :w].clone()


def random_rows(rng: np.random.Generator, n: int, channels: int, latent_h: int, w_max: int, min_width: int = 1):
    """(rows: list of float16 [C, h, w_i] arrays, widths int32 [n]) with widths uniform in [min_width, w_max]."""
    widths = rng.integers(min_width, w_max + 1, size=n).astype(np.int32)
    rows = [rng.standard_normal((channels, latent_h, int(w)), dtype=np.float32).astype(np.float16) for w in widths]
    return rows, widths


def write_cache(directory: str, rows, widths, *, w_max: int, layout: str = "padded", white=None,
                split: str = "train") -> CacheDouble:
    """Write ``rows`` in ``layout`` under ``directory`` and open them."""
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
    np.save(path("widths.npy"), np.asarray(widths, dtype=np.int32))
    if white is not None:
        np.save(path("white.npy"), np.asarray(white, dtype=np.float16).reshape(channels, latent_h, 1))
    meta = {"n": n, "channels": int(channels), "latent_h": int(latent_h), "w_max": int(w_max), "layout": layout}
    with open(path("meta.json"), "w") as fh:
        json.dump(meta, fh)
    return CacheDouble(directory, split)
