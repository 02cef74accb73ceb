"""Deterministic record streams for the writer of fields (tests/test_writer_fields_bounded.py).

Values are small integers (exact in every dtype), drawn with numpy's seeded generator, so a stream is the
same on every machine. This module imports only what the writer before issue 33's field tables had too
(``LatentCacheWriter``): the digests in the test were recorded by running these streams through that
writer (``python tests/fields_scenarios.py`` with ``PYTHONPATH`` at a checkout of ``main`` before the change).
"""
from __future__ import annotations

import hashlib
import os

import numpy as np
import torch


def _ints(rng, shape, dtype):
    return rng.integers(-8, 8, shape).astype(dtype)


def two_fields(n=300, seed=0):
    """A float16 latent, ``text`` bf16 ``[L, 3]`` (L 0..4: one of 12 captions, so equal values repeat, some
    empty), ``mask`` bool ``[5]`` (odd byte counts, few distinct values); source hashes and info on some."""
    rng = np.random.default_rng(seed)
    captions = [torch.from_numpy(_ints(rng, (int(rng.integers(0, 5)), 3), np.float32)).bfloat16() for _ in range(12)]
    masks = [rng.integers(0, 2, 5).astype(bool) for _ in range(4)]
    out = []
    for i in range(n):
        record = {"latent": _ints(rng, (4, 1, int(rng.integers(1, 4))), np.float16),
                  "text": captions[int(rng.integers(0, 12))], "mask": masks[int(rng.integers(0, 4))]}
        source = hashlib.blake2b(f"{seed}-{i}".encode(), digest_size=16).digest() if rng.random() < 0.5 else None
        info = {"i": i, "é": [1, 2]} if rng.random() < 0.2 else None
        out.append((f"item{i:04d}" + ("-ü" if i % 9 == 0 else ""), record, source, info))
    return {}, out


def optional_any(n=200, seed=1):
    """``optional=True``, a bfloat16 latent: ``pooled`` float32 ``[6]`` lacking in ~1 item of 5, ``extra``
    int16 ``[2, k]`` first seen at item 50 (then on every other item), ``ids`` int8 ``[3]`` (odd bytes)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        record = {"latent": torch.from_numpy(_ints(rng, (4, 2, 2), np.float32)).bfloat16()}
        if rng.random() > 0.2:
            record["pooled"] = _ints(rng, (6,), np.float32) if i % 3 else np.zeros(6, np.float32)
        if i >= 50 and i % 2 == 0:
            record["extra"] = _ints(rng, (2, int(rng.integers(1, 3))), np.int16)
        record["ids"] = _ints(rng, (3,), np.int8) if i % 4 else np.ones(3, np.int8)
        out.append((f"k{i}", record, None, None))
    return {"optional": True}, out


def optional_named(n=150, seed=2):
    """``optional=("caption",)`` though every item has one (so a presence file is written), ``score`` a
    0-dim float64, a float32 latent."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        record = {"latent": _ints(rng, (4, 1, 2), np.float32), "caption": _ints(rng, (int(rng.integers(1, 4)),), np.int32),
                  "score": np.asarray(float(i % 5), dtype=np.float64)}
        out.append((f"n{i}", record, None, None))
    return {"optional": ("caption",)}, out


def tiny(n=3000, seed=3):
    """Tiny items of one shape (the bulk path's case): ``pooled`` float32 ``[4]`` (mostly distinct), ``mask``
    uint8 ``[3]`` (odd bytes, 5 distinct values), source hashes on some."""
    rng = np.random.default_rng(seed)
    masks = [rng.integers(0, 3, 3).astype(np.uint8) for _ in range(5)]
    out = []
    for i in range(n):
        record = {"latent": _ints(rng, (4, 1, 1), np.float16), "pooled": _ints(rng, (4,), np.float32), "mask": masks[int(rng.integers(0, 5))]}
        source = hashlib.blake2b(f"{seed}-{i}".encode(), digest_size=16).digest() if i % 3 == 0 else None
        out.append((f"t{i:05d}", record, source, None))
    return {}, out


SCENARIOS = {"two_fields": two_fields, "optional_any": optional_any, "optional_named": optional_named, "tiny": tiny}


def write_one_by_one(folder, options, items, flush_every=7):
    from latentfast.cache import LatentCacheWriter

    with LatentCacheWriter(folder, flush_every=flush_every, **options) as writer:
        for key, record, source, info in items:
            writer.append(key, record, source_hash=source, info=info)


def digests(folder) -> dict[str, str]:
    """sha256 of every file of the finished cache, by name."""
    return {name: hashlib.sha256(open(os.path.join(folder, name), "rb").read()).hexdigest()
            for name in sorted(os.listdir(folder))}


if __name__ == "__main__":
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        found = {}
        for name, make in SCENARIOS.items():
            options, items = make()
            write_one_by_one(os.path.join(tmp, name), options, items)
            found[name] = digests(os.path.join(tmp, name))
    print(json.dumps(found, indent=1, sort_keys=True))
