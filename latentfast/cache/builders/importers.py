"""Import a trainer's cache folder, or per-item latent files of other tools, into one shaped cache.

Trainer formats (``"kohya"``, ``"musubi-tuner"``, ``"ai-toolkit"``, ``"simpletuner"``, ``"diffusion-pipe"``
and ``"auto"``, which detects one): the trainer's whole cache folder read as that trainer's loader reads
it (:mod:`latentfast.cache.trainers`), each item one record -- the latent, its flipped copy, extra
latents, masks and the item's text-encoder outputs as ``text_*`` fields, every field in its source
dtype (bfloat16 stays bfloat16) -- with the file's metadata and sizes as item info, keys the image's
stem. What is not imported is listed (``stats["skipped"]``, one summary line). The stamp records the
trainer (``import_format``, also when detected) and the latent convention (``latent_convention``:
scaled by the VAE config's ``scaling_factor`` / ``shift_factor``, or raw); ``scaled=`` converts on
import so one cache never mixes conventions. Each item's source hash is that of its record (fields and
info): a rerun resumes an interrupted import, starts over if an item written before has changed, and
writes nothing when every record is unchanged (it reads them all to know).

Extension formats (the generic path for other tools): ``"npz"`` (kohya sd-scripts: arrays ``latents``
and, kept as item info, small ones such as ``original_size`` and ``crop_ltrb``), ``"safetensors"`` (musubi-tuner, ai-toolkit: a tensor whose
name starts with ``latent``, e.g. ``latents_1x64x64_bfloat16``) and ``"pt"`` (SimpleTuner:
``torch.save`` of a tensor, or of a dict holding it). Files are taken in sorted order of their
path relative to ``source_dir`` (walked recursively); an item's key is that path without its
extension. Latents of any float dtype are stored as float16 (values beyond float16's range
raise, naming the file). Everything goes through :class:`~latentfast.cache.LatentCacheWriter`:
an import is crash-safe and resumable, and rerunning it over unchanged files writes nothing.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from typing import Any

import numpy as np
import torch

from ...errors import CacheError, InvalidArgumentError, NonFiniteError
from ..store import format as fmt
from ..store.durable import BuildLock, content_hash
from ..store.writer import LatentCacheWriter, check_file_name, encoder_identity, open_for_sources
from .. import trainers
from ..trainers.common import array_to_tensor, load_pt, npz_member_bytes, pt_nbytes
from . import distributed
from ...progress import progress_bar
from ..store.opening import LatentCache
from ..store.reader import bad_blocks

FORMATS = {"npz": ".npz", "safetensors": ".safetensors", "pt": ".pt"}
TRAINER_FORMATS = (*trainers.FORMATS, "auto")
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
                check_file_name(root, os.path.join(folder, name))
                rel = os.path.relpath(os.path.join(folder, name), root)
                found.append((os.path.splitext(rel)[0].replace(os.sep, "/"), os.path.join(folder, name)))
    return sorted(found)


def read_latent_file(path: str, format: str, key: str | None = None,
                     max_item_bytes: int = trainers.DEFAULT_MAX_ITEM_BYTES) -> tuple[Any, dict]:
    """``(latent tensor or array, info)`` from one file; ``key`` names the entry (default: see module);
    a gzip'd ``.pt`` that inflates to more than ``max_item_bytes`` is refused once it has."""
    try:
        if format == "npz":
            return _read_npz(path, key)
        if format == "safetensors":
            return _read_safetensors(path, key)
        return _read_pt(path, key, max_item_bytes)
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
    npz_member_bytes(path)  # every array's header against its stored bytes, before numpy allocates what one claims
    with np.load(path, allow_pickle=False) as archive:
        name = _pick(path, list(archive.files), key, "latents")
        latent = array_to_tensor(archive[name], path, name)  # bf16 bits saved by numpy (|V2) read as bfloat16
        info = {k: archive[k].tolist() for k in archive.files
                if k != name and archive[k].size <= INFO_MAX_ELEMENTS and archive[k].dtype.kind in "iuf"}
    return latent, info


def _read_safetensors(path: str, key: str | None):
    from safetensors import safe_open

    with safe_open(path, framework="pt") as fh:
        name = _pick(path, list(fh.keys()), key, "latent")
        return fh.get_tensor(name), {}


def _read_pt(path: str, key: str | None, max_item_bytes: int):
    obj = load_pt(path, max_item_bytes)  # gzip'd or not; a truncated file is named as such
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
                   scaled: bool | None = None, scaling_factor: float | None = None, shift_factor: float | None = None,
                   require=None, latent_dtype: str | None = None, group=None, **options) -> str:
    """Import ``source_dir`` into a shaped cache in ``out_dir``; returns the data path.

    ``format``: a trainer's name or ``"auto"`` (see the module docstring; ``options`` go to the
    trainer's reader, e.g. ``arch=`` for kohya, ``images=`` for SimpleTuner) or a file extension
    format, ``"npz"`` / ``"safetensors"`` / ``"pt"``, which imports every such file under ``source_dir``.
    ``scaled`` (trainer formats): None keeps the trainer's latent convention; True stores latents
    scaled, ``(z - shift_factor) * scaling_factor``, False raw, converting those stored the other way
    (the factors: ``scaling_factor=`` / ``shift_factor=``, else what the trainer's files say, else
    ``encoder``'s normalization). ``stats`` also receives ``skipped`` (a list of ``(path, reason)``) and
    ``summary`` (one line), and for trainer formats ``format``, ``evidence`` (what detection found) and
    ``convention`` (what the stamp's ``latent_convention`` says).

    Items without an output other items have (kohya sets ``flip_aug`` and ``alpha_mask`` per subset; an
    image may lack its text-encoder file): kept as records without that field, an optional field of the
    cache (``read_batch`` gives ``<field>_present``), and listed in ``stats["lacking"]`` (``(key, field,
    file)``) and the summary. ``require`` (trainer formats: a field name or several; ``"text"`` for the
    text-encoder outputs) refuses them instead: every item that lacks one is named with the file it
    would come from, before anything is written.

    ``latent_dtype`` (trainer formats): ``"bfloat16"`` or ``"float16"`` stores every VAE latent field
    (``latent``, ``latent_flipped``, ``latent_std``, ...: not audio latents) in that dtype, rounded to
    nearest (``Tensor.to``) after any ``scaled=`` conversion -- kohya's float32 latents in half the bytes.
    A value the dtype cannot hold (beyond float16's +-65504; bfloat16 has float32's range) refuses the
    import at that item, naming its key, field and largest magnitude (the items before it stay written,
    resumable). None (default) keeps each field's source dtype.

    ``key``: the entry holding the latent (npz array name, safetensors tensor name, or the key of a
    ``.pt`` dict); by default ``latents`` / the one tensor named ``latent...`` / the only entry.
    ``encoder``: the VAE (or its identity dict) that made the latents, stamped in the meta so a
    trainer can refuse a cache from another VAE. ``stats`` receives ``imported``, ``resumed``, ``unchanged``.
    ``group`` (a ``torch.distributed`` process group): a distributed import, any format, see
    :mod:`latentfast.cache.builders.distributed`: every rank reads the same folder (the same scan, the
    same keys; ``"auto"`` must detect the same trainer everywhere, or every rank raises), imports its
    share (files, or a trainer's items, spread by the bytes they read) into a shard, and rank 0
    writes the manifest: the same keys in the same order with the same records as a one-process
    import. Returns the manifest's path. A rank's ``stats`` count its own shard (``imported``,
    ``resumed``, ``unchanged``; an idle rank: 0, 0, True); ``summary`` and ``skipped`` (and a
    trainer's ``format`` and ``evidence``) describe the whole folder, alike on every rank. Before
    anything is written the ranks compare their arguments and the digest of their source folder
    (:func:`source_digest`): ranks given other ones all raise the same error, naming what differs.
    """
    if group is not None:  # each rank builds its share into a shard; rank 0 writes the manifest
        args = dict(locals())
        args.update(args.pop("options"))
        return distributed.build_sharded(import_latents, args, agree=lambda: _agreement(args))
    if format in TRAINER_FORMATS:
        if key is not None:
            raise InvalidArgumentError(f"key= applies to the extension formats {sorted(FORMATS)}; format {format!r} reads "
                                       f"the trainer's own entry names")
        return _import_trainer(source_dir, out_dir, split, format, encoder, quiet, lock_timeout, stats, scaled,
                               scaling_factor, shift_factor, _required(require), _latent_dtype(latent_dtype), options)
    max_item_bytes = options.pop("max_item_bytes", trainers.DEFAULT_MAX_ITEM_BYTES)
    if options or scaled is not None or scaling_factor is not None or shift_factor is not None or require is not None \
            or latent_dtype not in (None, "float16"):
        raise InvalidArgumentError(f"format {format!r} takes no trainer options (scaled=, scaling_factor=, shift_factor=, "
                                   f"require=, latent_dtype= other than float16, which it stores, {sorted(options)}); those "
                                   f"are for the trainer formats {list(TRAINER_FORMATS)}")
    if format not in FORMATS:
        raise InvalidArgumentError(f"format must be one of {[*FORMATS, *TRAINER_FORMATS]}, got {format!r}")
    files = list_latent_files(source_dir, format)
    if not files:
        raise InvalidArgumentError(f"source_dir {source_dir} holds no .{format} files")
    for _, path in files:  # before anything is read: an item is loaded whole, so its size bounds the memory
        _check_item_bytes(path, format, max_item_bytes)
    whole = _listed(format, files, _other_files(source_dir, FORMATS[format]))
    share = distributed.current_share()
    if share is not None:  # a distributed import: this rank's files, costed by their bytes
        try:
            files = share.keep(files, [[f] for f in files], key=lambda f: f[0], cost=lambda f: os.path.getsize(f[1]))
        except distributed.IdleRank:
            if stats is not None:
                stats.update(whole, imported=0, resumed=0, unchanged=True)
            raise
    meta = {"kind": "import", "import_format": format, "import_key": key, "source": os.path.abspath(os.fspath(source_dir))}
    digests = [content_hash(path) for _, path in files]
    lock = BuildLock(out_dir, split, lock_timeout)
    try:
        if _unchanged(out_dir, split, encoder_identity(encoder), meta, files, digests):
            lock.release()
            if stats is not None:
                stats.update(whole, imported=0, resumed=0, unchanged=True)
            return fmt.cache_path(out_dir, split, "data")
        writer = open_for_sources(out_dir, split, encoder=encoder, meta=meta, lock=lock,
                                  digests={k: d for (k, _), d in zip(files, digests)})
    except BaseException:
        lock.release()
        raise
    done, resumed = 0, len(writer)
    with writer:
        for (name, path), digest in progress_bar(list(zip(files, digests)), unit="files", desc="import", disable=True if quiet else None):
            if name in writer:
                continue
            latent, info = read_latent_file(path, format, key, max_item_bytes)
            writer.append(name, latent, source_hash=digest, info=info)
            done += 1
    if stats is not None:
        stats.update(whole, imported=done, resumed=resumed, unchanged=False)
    return fmt.cache_path(out_dir, split, "data")


DIGEST_EDGE_BYTES = 64 << 10
# what a distributed import's ranks need not share: where they write from (a folder on another mount is
# compared by its digest), how they report and wait
_UNCOMPARED = ("source_dir", "out_dir", "group", "quiet", "stats", "lock_timeout")


def _agreement(args: dict) -> dict:
    """What every rank of a distributed import must hold alike: each argument that shapes the cache (the
    encoder by its identity, a folder argument such as ``images=`` by its digest) and the source's digest."""
    out = {"source listing (names, sizes, first and last 64 KiB of each file)": source_digest(args["source_dir"])}
    for name, value in sorted(args.items()):
        if name in _UNCOMPARED:
            continue
        if name == "encoder":
            value = encoder_identity(value)
        elif isinstance(value, (str, os.PathLike)) and os.path.isdir(value):
            value = {"folder digest": source_digest(value)}
        out[name] = value
    return out


def source_digest(folder) -> str:
    """BLAKE2b-128 (hex) of a folder's listing as an import reads it (hidden entries left out): each file's
    relative path, size, and its first and last 64 KiB. Not modification times: a copy of the folder on
    another node has other ones. Not every byte: each rank would read the whole folder, not its share;
    two files of one name and size whose bytes differ only past their first and last 64 KiB are not told apart."""
    root = trainers.check_root(folder)
    digest = hashlib.blake2b(digest_size=16)
    for dirpath, name in trainers.walk_files(root):
        path = os.path.join(dirpath, name)
        with open(path, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(DIGEST_EDGE_BYTES)
            fh.seek(max(size - DIGEST_EDGE_BYTES, len(head)))
            tail = fh.read(DIGEST_EDGE_BYTES)
        digest.update(f"{os.path.relpath(path, root)}\0{size}\0".encode("utf-8"))
        digest.update(hashlib.blake2b(head + tail, digest_size=16).digest())
    return digest.hexdigest()


def _check_item_bytes(path: str, format: str, limit: int) -> None:
    """Refuse a file whose item would take more than ``limit`` bytes of memory to read: its size on
    disk, for ``.npz`` the sum of its arrays' uncompressed sizes (what ``np.load`` inflates), for a gzip'd
    ``.pt`` what its last member says (its real size is judged while it inflates: :func:`read_latent_file`)."""
    if format == "npz":
        import zipfile

        try:
            with zipfile.ZipFile(path) as archive:
                size = sum(info.file_size for info in archive.infolist())
        except (OSError, zipfile.BadZipFile) as exc:
            raise CacheError(f"cannot read npz latents from {path}: {exc}") from None
    else:
        size = pt_nbytes(path) if format == "pt" else os.path.getsize(path)
    if size > limit:
        raise InvalidArgumentError(f"{path}: its item takes {size} bytes to read, more than max_item_bytes={limit} "
                                   f"(items are read whole); pass a larger max_item_bytes= if the memory is there")


def _listed(format: str, files: list, others: list[str]) -> dict:
    """``skipped`` and the one-line ``summary`` of an extension import."""
    what = f"files not {FORMATS[format]}"
    return {"skipped": [(p, what) for p in others],
            "summary": f"{format}: {len(files)} files" + (f"; skipped {len(others)} {what}" if others else "")}


def _other_files(source_dir, extension: str) -> list[str]:
    """The files under ``source_dir`` an extension import does not read (listed, never dropped silently)."""
    found = []
    for folder, dirs, files in os.walk(os.fspath(source_dir)):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        found.extend(os.path.join(folder, f) for f in files if not f.startswith(".") and not f.endswith(extension))
    return sorted(found)


def _unchanged(out_dir, split, identity, meta, files, digests) -> bool:
    """A complete cache of exactly these files (same order, same bytes), imported the same way, intact."""
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


# ---- trainer caches ---------------------------------------------------------------------------------
def _required(require) -> tuple[str, ...]:
    """``require=`` as a tuple of field names (``text``: the text-encoder outputs)."""
    names = () if require is None else (require,) if isinstance(require, str) else tuple(require)
    for name in names:
        if not isinstance(name, str) or not name.isidentifier():
            raise InvalidArgumentError(f"require must name record fields (e.g. 'latent_flipped', 'text'), got {require!r}")
    return names


def _refuse_lacking(source, required: tuple[str, ...]) -> None:
    """Raise naming every item (and the file it would come from) that lacks a ``required`` field; nothing is written yet."""
    lacking = [(field, key, where) for field in required for key, where in source.lacks(field)]
    if lacking:
        lines = "\n".join(f"  {key}: no {field} (no {where})" for field, key, where in lacking)
        raise trainers.TrainerCacheError(f"{source.root}: require={list(required)}: {len(lacking)} items lack a required "
                                         f"field; nothing was written:\n{lines}")


def _check_required(record, fields: dict, required: tuple[str, ...], root: str) -> None:
    """An item the scan could not judge (its files hold fewer outputs than others): refused before it is written."""
    for field in required:
        if not any(name == field or (field == "text" and name.startswith("text_")) for name in fields):
            raise trainers.TrainerCacheError(f"{root}: require={list(required)}: item {record.key!r} has no {field!r} "
                                             f"(its fields: {sorted(fields)}); the items before it are written, resumable")


def _latent_dtype(name) -> torch.dtype | None:
    """``latent_dtype=`` as a torch dtype (None: each field's source dtype)."""
    if name is None:
        return None
    if name not in ("bfloat16", "float16"):
        raise InvalidArgumentError(f"latent_dtype must be 'bfloat16', 'float16' or None (the source's dtype), got {name!r}")
    return getattr(torch, name)


def _import_trainer(source_dir, out_dir, split, format, encoder, quiet, lock_timeout, stats, scaled,
                    scaling_factor, shift_factor, required, latent_dtype, options) -> str:
    if format == "simpletuner":  # its reader records the factors it was told (its files do not say)
        options = {"scaling_factor": scaling_factor, "shift_factor": shift_factor, **options}
    source = trainers.open_source(source_dir, format, **options)
    if not len(source):
        raise trainers.TrainerCacheError(f"{source.root}: {source.format} cache with no items to import ({source.summary()})")
    _refuse_lacking(source, required)  # (every rank of a distributed import: the whole folder, the same message)
    whole = _described(source)
    share = distributed.current_share()
    if share is not None:  # a distributed import: this rank's items, each a unit costed by its tensor bytes
        items = list(zip(source.keys, source.item_bytes))
        try:
            mine = share.keep(items, [[x] for x in items], key=lambda x: x[0], cost=lambda x: x[1], plan=source.format)
        except distributed.IdleRank:
            if stats is not None:
                stats.update(whole, imported=0, resumed=0, unchanged=True)
            raise
        source = source.only([k for k, _ in mine])
    identity = encoder_identity(encoder)
    convert, convention = latent_conversion(source.convention, scaled, scaling_factor, shift_factor, identity, source.root)
    meta = {"kind": "import", "import_format": source.format, "import_key": None, "source": source.root,
            "latent_convention": convention}
    if latent_dtype is not None:  # (absent otherwise: the meta of imports made before the option)
        meta["import_latent_dtype"] = str(latent_dtype).removeprefix("torch.")
    lock = BuildLock(out_dir, split, lock_timeout)
    try:
        if _records_unchanged(out_dir, split, identity, meta, source, convert, convention, latent_dtype):
            lock.release()
            _report(stats, whole, imported=0, resumed=0, unchanged=True, convention=convention)
            return fmt.cache_path(out_dir, split, "data")
        # optional=True: an item without an output other items have is a record without that field
        writer = LatentCacheWriter(out_dir, split, encoder=encoder, meta=meta, lock=lock, optional=True)
    except BaseException:
        lock.release()
        raise
    try:
        if not set(writer.keys) <= set(source.keys):  # an interrupted import of other items: start over
            writer = writer.reopen(restart=True)
        resumed = len(writer)
        while True:  # a second pass only when an item written by an interrupted run has changed since
            done, stale = 0, False
            for record in progress_bar(source, total=len(source), unit="items", desc="import", disable=True if quiet else None):
                fields, info = _as_stored(record, convert, convention, latent_dtype, source.root)
                _check_required(record, fields, required, source.root)
                digest = record_hash(fields, info)
                if record.key in writer:
                    if writer.source_hash(record.key) == digest.hex():
                        continue
                    stale = True
                    break
                writer.append(record.key, fields, source_hash=digest, info=info)
                done += 1
            if not stale:
                break
            writer, resumed = writer.reopen(restart=True), 0
        writer.finish()
    except BaseException:
        writer.__exit__(*sys.exc_info())  # flushed and resumable: a rerun continues after the last logged item
        raise
    _report(stats, whole, imported=done, resumed=resumed, unchanged=False, convention=convention)
    return fmt.cache_path(out_dir, split, "data")


def _described(source) -> dict:
    """What ``stats`` says of a trainer's whole folder (a distributed import's share says the same)."""
    return {"format": source.format, "evidence": source.evidence, "summary": source.summary(),
            "skipped": [tuple(s) for s in source.skipped], "lacking": source.lacking}


def _report(stats, whole: dict, **counts) -> None:
    if stats is not None:
        stats.update(counts, **whole)


# Fields holding latents of the image VAE (what scaled= converts); an audio VAE's latents are not.
def is_vae_latent(name: str, value: torch.Tensor) -> bool:
    return (name == "latent" or name.startswith("latent_")) and not name.startswith("latent_audio") \
        and value.is_floating_point()


def latent_conversion(found: dict, scaled, scaling_factor, shift_factor, identity, root: str):
    """``(convert, convention)``: the function taking a latent of the source's convention to the cache's
    (None: kept as stored) and the cache's convention (what the stamp records)."""
    if scaled is not None and not isinstance(scaled, bool):
        raise InvalidArgumentError(f"scaled must be True, False or None (keep the trainer's convention), got {scaled!r}")
    kind = found.get("latent_convention", "unknown")
    scale = _one_factor("scaling_factor", scaling_factor, found.get("scaling_factor"), identity, root)
    shift = _one_factor("shift_factor", shift_factor, found.get("shift_factor"), identity, root)
    if scaled is None or (kind == "scaled") == scaled and kind in ("scaled", "raw"):
        return None, {"latent_convention": kind, "scaling_factor": scale, "shift_factor": shift}
    if kind not in ("scaled", "raw"):
        raise InvalidArgumentError(f"{root}: its latents are {kind!r} (neither scaled nor raw VAE latents): scaled={scaled} "
                                   f"cannot convert them")
    if "latents_mean" in ((identity or {}).get("normalization") or {}):
        raise InvalidArgumentError(f"{root}: the encoder normalizes with per-channel latents_mean / latents_std (Wan, "
                                   f"Qwen-Image, LTX): scaled= converts only (z - shift_factor) * scaling_factor latents")
    if scale is None:
        raise InvalidArgumentError(f"{root}: scaled={scaled} converts {kind} latents, which needs the VAE config's scaling_factor: "
                                   f"pass scaling_factor= (and shift_factor=) or encoder= (the trainer's files do not say)")
    target = {"latent_convention": "scaled" if scaled else "raw", "scaling_factor": scale, "shift_factor": shift,
              "converted_from": kind}
    return (lambda z: to_scaled(z, scale, shift)) if scaled else (lambda z: to_raw(z, scale, shift)), target


def _one_factor(name: str, given, found, identity, root: str):
    """A VAE factor: the one passed, else the trainer's, else the encoder's; two that disagree raise."""
    normalization = (identity or {}).get("normalization") or {}
    from_encoder = None if "latents_mean" in normalization else normalization.get(name)  # per-channel: not these factors
    known = [(w, float(v)) for w, v in (("passed", given), ("the trainer's files", found), ("the encoder", from_encoder)) if v is not None]
    if len({v for _, v in known}) > 1:
        raise InvalidArgumentError(f"{root}: {name} disagrees: " + ", ".join(f"{w} {v!r}" for w, v in known))
    return known[0][1] if known else None


def to_scaled(z: torch.Tensor, scale: float, shift: float | None) -> torch.Tensor:
    """``(z - shift) * scale`` as the diffusers pipelines normalize a VAE latent (computed in float32, kept in z's dtype)."""
    x = z.to(torch.float32)
    return ((x - shift if shift else x) * scale).to(z.dtype)


def to_raw(z: torch.Tensor, scale: float, shift: float | None) -> torch.Tensor:
    """``z / scale + shift``: what a trainer that scales at train time (kohya) caches (float32, kept in z's dtype)."""
    x = z.to(torch.float32) / scale
    return (x + shift if shift else x).to(z.dtype)


def _as_stored(record, convert, convention, latent_dtype=None, root: str = "") -> tuple[dict, dict]:
    fields = {name: convert(v) if convert is not None and is_vae_latent(name, v) else v for name, v in record.fields.items()}
    if latent_dtype is not None:
        fields = {name: narrowed(record.key, name, v, latent_dtype, root) if is_vae_latent(name, v) else v
                  for name, v in fields.items()}
    info = {**record.info, **convention}  # the item says what the stamp says
    return fields, info


def narrowed(key: str, name: str, value: torch.Tensor, dtype: torch.dtype, root: str) -> torch.Tensor:
    """``value`` in ``dtype`` (rounded to nearest); a finite value that overflows it raises, naming the item."""
    out = value.to(dtype)
    overflow = torch.isinf(out) & torch.isfinite(value)
    if bool(overflow.any()):
        largest = float(value[torch.isfinite(value)].abs().max())
        raise NonFiniteError(f"item {key!r} of {root}: field {name!r} holds values beyond {str(dtype).removeprefix('torch.')}'s "
                             f"range (largest magnitude {largest:.6g}, limit {torch.finfo(dtype).max:.6g}): latent_dtype="
                             f"{str(dtype).removeprefix('torch.')!r} cannot store it (bfloat16 can; or keep the source's dtype)")
    return out


def record_hash(fields: dict, info: dict) -> bytes:
    """BLAKE2b-128 of a record: each field's name, dtype, shape and bytes, and the info (what a rerun compares)."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(fields):
        value = fields[name].detach().to("cpu").contiguous()
        digest.update(f"{name}:{value.dtype}:{list(value.shape)};".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    digest.update(json.dumps(info, sort_keys=True, default=str).encode())
    return digest.digest()


def _records_unchanged(out_dir, split, identity, meta, source, convert, convention, latent_dtype=None) -> bool:
    """A complete cache of exactly these records (same keys, same content), imported the same way, intact."""
    try:
        cache = LatentCache(out_dir, split)
    except (OSError, ValueError, CacheError):
        return False
    hashes = cache.content_hashes()
    if (not cache.shaped or cache.meta.get("encoder") != identity or hashes is None or cache.keys != source.keys
            or any(cache.meta.get(k) != v for k, v in meta.items() if k != "source")):
        return False
    for i, record in enumerate(source):
        if record_hash(*_as_stored(record, convert, convention, latent_dtype, source.root)) != hashes[i].tobytes():
            return False
    return not bad_blocks(cache, first_only=True)[0]
