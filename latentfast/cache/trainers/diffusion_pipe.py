"""tdrussell diffusion-pipe: ``cache_{bucket}/latents/`` and ``cache_{bucket}/text_embeddings_{i}/`` shard caches.

As ``utils/cache.py`` ``Cache.add`` writes them: each record ``torch.save`` d into ``shard_{N}.bin``
back to back, its ``(offset, size)`` a row of table ``shard_{N}`` and its ``(shard, shard_index)`` a
row of table ``items`` in ``metadata.db`` (sqlite), read back by ``Cache.__getitem__``. Latent records
(``utils/dataset.py`` ``latents_map_fn``) hold ``latents``, ``mask`` (or None), ``image_spec``
(``[tar file or None, image path]``), ``caption`` (the image's captions), optionally
``control_latents``; text records (``text_embedding_map_fn``) hold the encoder's outputs and the
``image_spec``, one per caption, matched to images by ``image_spec`` in order
(``TextEmbeddingDataset``).

Records: fields ``latent``, ``latent_control``, ``mask`` (when not None), other tensors by name; text
fields ``text_{name}`` for the first caption and ``text_{name}_c{n}`` for caption ``n`` >= 1. Info
``image_spec``, ``captions``, ``bucket`` (the ``cache_{bucket}`` folder's suffix). Key: the image's
stem below the dataset folder (``{tar stem}/{stem}`` for tar members); one image in several buckets:
``{stem}@{latent size}``.
"""
from __future__ import annotations

import io
import os
import pickle
import sqlite3
import zipfile
from collections import OrderedDict, defaultdict

import torch

from .common import (DEFAULT_MAX_ITEM_BYTES, ItemPlan, Skipped, Source, TrainerCacheError, check_root, fail,
                     load_pt_bytes, split_tensors, walk_files)

FIELDS = {"latents": "latent", "control_latents": "latent_control"}


class ShardCache:
    """One ``Cache`` folder: ``items`` in order, each ``(shard, offset, size)``; reads one record at a time."""

    def __init__(self, folder: str):
        self.folder, db = folder, os.path.join(folder, "metadata.db")
        try:
            con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
            try:
                items = con.execute("SELECT shard, shard_index FROM items ORDER BY rowid").fetchall()
                tables = {int(t[6:]): con.execute(f"SELECT offset, size FROM {t} ORDER BY rowid").fetchall()
                          for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type='table'")
                          if t.startswith("shard_") and t[6:].isdigit()}
            finally:
                con.close()
        except sqlite3.Error as exc:
            raise fail(db, "diffusion-pipe's metadata.db (tables items, shard_N)", f"sqlite error: {exc}") from None
        self.entries = []
        for shard, index in items:
            if shard not in tables or index >= len(tables[shard]):
                raise fail(db, f"a row {index} in table shard_{shard}", "no such row")
            offset, size = tables[shard][index]
            self.entries.append((shard, offset, size))

    def __len__(self) -> int:
        return len(self.entries)

    def _shard(self, i: int) -> tuple[str, int, int]:
        shard, offset, size = self.entries[i]
        path = os.path.join(self.folder, f"shard_{shard}.bin")
        if not os.path.exists(path):
            raise fail(path, f"the shard holding record {i} of {self.folder}", "no such file")
        if os.path.getsize(path) < offset + size:
            raise fail(path, f"bytes {offset}..{offset + size} (record {i})",
                       f"a truncated shard ({os.path.getsize(path)} bytes)")
        return path, offset, size

    def read(self, i: int):
        path, offset, size = self._shard(i)
        with open(path, "rb") as fh:
            fh.seek(offset)
            data = fh.read(size)
        return load_pt_bytes(data, f"{path}[{offset}:{offset + size}]")

    def peek(self, i: int):
        """Record ``i`` with each tensor replaced by ``("shape", size)``, reading only its pickle (or all of it
        when the pickle holds anything but plain values and tensors)."""
        path, offset, size = self._shard(i)
        try:
            with open(path, "rb") as fh, zipfile.ZipFile(_Window(fh, offset, size)) as archive:
                name = next(n for n in archive.namelist() if n.endswith("/data.pkl"))
                return _ShapeUnpickler(io.BytesIO(archive.read(name))).load()
        except (zipfile.BadZipFile, StopIteration, pickle.UnpicklingError, EOFError):
            record = self.read(i)
            return {k: ("shape", tuple(v.shape)) if isinstance(v, torch.Tensor) else v for k, v in record.items()} \
                if isinstance(record, dict) else record


class _Window(io.RawIOBase):
    """Bytes ``[start, start + size)`` of an open file, as a seekable file (for ``zipfile``)."""

    def __init__(self, fh, start: int, size: int):
        self.fh, self.start, self.size, self.pos = fh, start, size, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, offset, whence=0):
        self.pos = max(0, {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence])
        return self.pos

    def tell(self):
        return self.pos

    def read(self, n=-1):
        n = self.size - self.pos if n is None or n < 0 else min(n, self.size - self.pos)
        self.fh.seek(self.start + self.pos)
        data = self.fh.read(max(0, n))
        self.pos += len(data)
        return data


class _ShapeUnpickler(pickle.Unpickler):
    """Unpickles a ``torch.save`` record's ``data.pkl`` without its storages: tensors become their shape.

    Only torch's tensor rebuild, its storage types and ``OrderedDict`` are allowed; anything else raises."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, *rest: ("shape", tuple(size))
        if module == "torch" and name.endswith("Storage"):
            return name
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        return None


def scan(folder, max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES) -> Source:
    """A :class:`Source` of every ``cache_{bucket}`` under ``folder`` (a dataset's ``cache/{model}`` or above)."""
    root = check_root(folder)
    buckets, skipped = defaultdict(dict), []
    for dirpath, name in walk_files(root):
        parent, kind = os.path.split(dirpath)
        if name == "metadata.db" and os.path.basename(parent).startswith("cache_"):
            buckets[parent][kind] = ShardCache(dirpath)
        elif not (name.startswith("shard_") and name.endswith(".bin")):
            if os.path.basename(dirpath) != "iteration_order" and "metadata" not in dirpath:
                skipped.append(Skipped(os.path.join(dirpath, name), "files that are not shard caches"))
    if not any("latents" in b for b in buckets.values()):
        raise TrainerCacheError(f"{root}: expected diffusion-pipe caches (cache_{{bucket}}/latents/metadata.db with "
                                f"shard_N.bin), found {'none' if not buckets else sorted(k for b in buckets.values() for k in b)}")
    plans = []
    for bucket_dir, caches in sorted(buckets.items()):
        if "latents" not in caches:
            skipped.extend(Skipped(c.folder, "text caches of a bucket without latents") for c in caches.values())
            continue
        texts = {k: c for k, c in caches.items() if k.startswith("text_embeddings_")}
        skipped.extend(Skipped(c.folder, "caches that are neither latents nor text embeddings")
                       for k, c in caches.items() if k != "latents" and k not in texts)
        plans.extend(_bucket_plans(bucket_dir, caches["latents"], texts))
    return Source("diffusion-pipe", root, plans, skipped, {"latent_convention": "scaled", "scaling_factor": None, "shift_factor": None},
                  evidence=f"{len(buckets)} cache_{{bucket}} folders with metadata.db and shard_N.bin",
                  max_item_bytes=max_item_bytes)


def iter_records(folder, **options):
    """The records of :func:`scan` ``(folder, **options)``."""
    return iter(scan(folder, **options))


def _bucket_plans(bucket_dir: str, latents: ShardCache, texts: dict) -> list[ItemPlan]:
    """Peeks at each record's pickle for its ``image_spec`` and latent size (text records: to index them,
    as ``TextEmbeddingDataset`` does); tensors are read when the item is."""
    text_index = {}
    for name, cache in texts.items():
        per_spec = defaultdict(list)
        for i in range(len(cache)):
            per_spec[_spec(cache.peek(i), cache.folder, i)].append(i)
        text_index[name] = per_spec
    bucket = os.path.basename(bucket_dir)[len("cache_"):]
    plans = []
    for i in range(len(latents)):
        record = latents.peek(i)  # the key and the variant (latent size) come from the record itself
        spec = _spec(record, latents.folder, i)
        base = os.path.splitext(os.path.basename(spec[1]))[0]
        if spec[0]:
            base = f"{os.path.splitext(os.path.basename(spec[0]))[0]}/{base}"
        shape = record.get("latents")
        hw = "x".join(str(s) for s in shape[1][1:]) if isinstance(shape, tuple) and shape[:1] == ("shape",) else ""
        refs = {name: per_spec.get(spec, []) for name, per_spec in text_index.items()}
        nbytes = latents.entries[i][2] + sum(texts[n].entries[j][2] for n, js in refs.items() for j in js)
        plans.append(ItemPlan(base, hw, nbytes, _loader(latents, i, texts, refs, bucket)))
    return plans


def _spec(record, where: str, i: int) -> tuple:
    if not isinstance(record, dict) or not isinstance(record.get("image_spec"), (list, tuple)) or len(record["image_spec"]) != 2:
        raise fail(f"{where} record {i}", "a dict with image_spec [tar file or None, path]",
                   f"a dict of {sorted(record)}" if isinstance(record, dict) else f"a {type(record).__name__}")
    return tuple(record["image_spec"])


def _loader(latents: ShardCache, i: int, texts: dict, refs: dict, bucket: str):
    def load():
        record = latents.read(i)
        if not isinstance(record.get("latents"), torch.Tensor):
            raise fail(f"{latents.folder} record {i}", "a 'latents' tensor", f"{type(record.get('latents')).__name__}")
        tensors, plain = split_tensors({k: v for k, v in record.items() if v is not None}, f"{latents.folder} record {i}")
        fields = {FIELDS.get(k, k): v for k, v in tensors.items()}
        info = {"image_spec": list(plain.pop("image_spec")), "captions": plain.pop("caption", None), "bucket": bucket, **plain}
        for name, indices in refs.items():
            for n, j in enumerate(indices):
                text, other = split_tensors({k: v for k, v in texts[name].read(j).items() if k != "image_spec"},
                                            f"{texts[name].folder} record {j}")
                tail = f"_c{n}" if n else ""
                fields.update({f"text_{k}{tail}": v for k, v in text.items()})
                info.update({f"text_{k}{tail}": v for k, v in other.items()})
        return fields, info
    return load
