"""Import per-item latent files (one file per image or clip) into one shaped cache.

Formats: ``"npz"`` (kohya sd-scripts: arrays ``latents`` and, kept as item info, small ones such as
``original_size`` and ``crop_ltrb``), ``"safetensors"`` (musubi-tuner, ai-toolkit: a tensor whose
name starts with ``latent``, e.g. ``latents_1x64x64_bfloat16``) and ``"pt"`` (SimpleTuner:
``torch.save`` of a tensor, or of a dict holding it). Files are taken in sorted order of their
path relative to ``source_dir`` (walked recursively); an item's key is that path without its
extension. Latents of any float dtype are stored as float16 (values beyond float16's range
raise, naming the file). Everything goes through :class:`~latentfast.cache.LatentCacheWriter`:
an import is crash-safe and resumable, and rerunning it over unchanged files writes nothing.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from ...errors import CacheError, InvalidArgumentError
from ..store import format as fmt
from ..store.durable import BuildLock, content_hash
from ..store.writer import encoder_identity, open_for_sources
from . import distributed

FORMATS = {"npz": ".npz", "safetensors": ".safetensors", "pt": ".pt"}
INFO_MAX_ELEMENTS = 8  # small arrays beside the latents (sizes, crops) are kept as item info


def list_latent_files(source_dir, format: str) -> list[tuple[str, str]]:
    """``(key, path)`` of every ``format`` file under ``source_dir``, sorted by relative path."""
    if format not in FORMATS:
        raise InvalidArgumentError(f"format must be one of {sorted(FORMATS)}, got {format!r}")
    root = os.path.abspath(os.fspath(source_dir))
    if not os.path.isdir(root):
        raise FileNotFoundError(f"source_dir {source_dir} is not a folder")
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            if name.endswith(FORMATS[format]) and not name.startswith("."):
                rel = os.path.relpath(os.path.join(folder, name), root)
                found.append((os.path.splitext(rel)[0].replace(os.sep, "/"), os.path.join(folder, name)))
    return sorted(found)


def read_latent_file(path: str, format: str, key: str | None = None) -> tuple[Any, dict]:
    """``(latent tensor or array, info)`` from one file; ``key`` names the entry (default: see module)."""
    try:
        if format == "npz":
            return _read_npz(path, key)
        if format == "safetensors":
            return _read_safetensors(path, key)
        return _read_pt(path, key)
    except InvalidArgumentError:
        raise
    except Exception as exc:  # noqa: BLE001 - a file that cannot be parsed is reported by name
        raise CacheError(f"cannot read {format} latents from {path}: {exc}") from None


def _pick(path: str, names: list[str], key: str | None, default_prefix: str) -> str:
    if key is not None:
        if key not in names:
            raise InvalidArgumentError(f"{path} has no entry {key!r}; it holds {sorted(names)}")
        return key
    candidates = [n for n in names if n == default_prefix] or [n for n in names if n.startswith(default_prefix)]
    if len(candidates) == 1:
        return candidates[0]
    if len(names) == 1:
        return names[0]
    raise InvalidArgumentError(f"{path} holds {sorted(names)}; pass key= to say which entry is the latent")


def _read_npz(path: str, key: str | None):
    with np.load(path, allow_pickle=False) as archive:
        name = _pick(path, list(archive.files), key, "latents")
        latent = archive[name]
        info = {k: archive[k].tolist() for k in archive.files
                if k != name and archive[k].size <= INFO_MAX_ELEMENTS and archive[k].dtype.kind in "iuf"}
    return latent, info


def _read_safetensors(path: str, key: str | None):
    from safetensors import safe_open

    with safe_open(path, framework="pt") as fh:
        name = _pick(path, list(fh.keys()), key, "latent")
        return fh.get_tensor(name), {}


def _read_pt(path: str, key: str | None):
    obj = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(obj, torch.Tensor):
        if key is not None:
            raise InvalidArgumentError(f"{path} holds a bare tensor, not a dict with {key!r}")
        return obj, {}
    if isinstance(obj, dict):
        names = [k for k, v in obj.items() if isinstance(k, str) and isinstance(v, torch.Tensor)]
        return obj[_pick(path, names, key, "latents")], {}
    raise InvalidArgumentError(f"{path} holds a {type(obj).__name__}; expected a tensor or a dict of tensors")


def import_latents(source_dir, out_dir, split: str = "train", *, format: str, key: str | None = None,
                   encoder: Any = None, quiet: bool = False, lock_timeout: float = 0.0, stats: dict | None = None,
                   group=None) -> str:
    """Import every ``format`` file under ``source_dir`` into a shaped cache in ``out_dir``; returns the data path.

    ``key``: the entry holding the latent (npz array name, safetensors tensor name, or the key of a
    ``.pt`` dict); by default ``latents`` / the one tensor named ``latent...`` / the only entry.
    ``encoder``: the VAE (or its identity dict) that made the latents, stamped in the meta so a
    trainer can refuse a cache from another VAE. ``stats`` receives ``imported``, ``resumed``, ``unchanged``.
    ``group`` (a ``torch.distributed`` process group): a distributed import, see :mod:`latentfast.cache.build.distributed`.
    """
    if group is not None:  # each rank builds its share into a shard; rank 0 writes the manifest
        return distributed.build_sharded(import_latents, locals())
    from tqdm import tqdm

    files = list_latent_files(source_dir, format)
    if not files:
        raise InvalidArgumentError(f"source_dir {source_dir} holds no .{format} files")
    share = distributed.current_share()
    if share is not None:  # a distributed import: this rank's files, costed by their bytes
        files = share.keep(files, [[f] for f in files], key=lambda f: f[0], cost=lambda f: os.path.getsize(f[1]))
    meta = {"kind": "import", "import_format": format, "import_key": key, "source": os.path.abspath(os.fspath(source_dir))}
    digests = [content_hash(path) for _, path in files]
    lock = BuildLock(out_dir, split, lock_timeout)
    try:
        if _unchanged(out_dir, split, encoder_identity(encoder), meta, files, digests):
            lock.release()
            if stats is not None:
                stats.update(imported=0, resumed=0, unchanged=True)
            return fmt.cache_path(out_dir, split, "data")
        writer = open_for_sources(out_dir, split, encoder=encoder, meta=meta, lock=lock,
                                  digests={k: d for (k, _), d in zip(files, digests)})
    except BaseException:
        lock.release()
        raise
    done, resumed = 0, len(writer)
    with writer:
        for (name, path), digest in tqdm(list(zip(files, digests)), unit="files", desc="import", disable=True if quiet else None):
            if name in writer:
                continue
            latent, info = read_latent_file(path, format, key)
            writer.append(name, latent, source_hash=digest, info=info)
            done += 1
    if stats is not None:
        stats.update(imported=done, resumed=resumed, unchanged=False)
    return fmt.cache_path(out_dir, split, "data")


def _unchanged(out_dir, split, identity, meta, files, digests) -> bool:
    """A complete cache of exactly these files (same order, same bytes), imported the same way, intact."""
    from ..store.reader import LatentCache, bad_blocks

    try:
        cache = LatentCache(out_dir, split)
    except (OSError, ValueError, CacheError):
        return False
    hashes = cache.content_hashes()
    if (not cache.shaped or cache.meta.get("encoder") != identity or hashes is None
            or any(cache.meta.get(k) != v for k, v in meta.items() if k != "source")
            or cache.keys != [k for k, _ in files]
            or any(hashes[i].tobytes() != d for i, d in enumerate(digests))):
        return False
    return not bad_blocks(cache, first_only=True)[0]
