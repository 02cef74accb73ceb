"""Export a cache imported from a trainer back into that trainer's own files, so its loader reads the same tensors.

``export_cache(cache_dir, out_dir, format)`` writes, per record, the files the trainer's cache code writes,
through the save functions of :mod:`latentfast.cache.trainers.fixtures` (each the trainer's own, cited there):

- ``kohya``: ``{stem}_{W:04d}x{H:04d}_{arch}.npz`` (``{stem}.npz`` for legacy caches) by kohya's
  ``LatentsCachingStrategy.save_latents_to_disk`` (library/strategy_base.py: ``latents``, ``original_size``,
  ``crop_ltrb``, ``latents_flipped``, ``alpha_mask``, each ``_{h}x{w}``-suffixed for the multi-resolution
  architectures, several buckets into one file), and ``{stem}{TE suffix}`` by ``np.savez`` of the ``text_*``
  arrays and scalars as each strategy's ``cache_batch_outputs`` does. kohya's save writes float32 (float16
  latents widen exactly); an ``.npz`` cannot hold bfloat16, so a bfloat16 field is refused, naming it.
- ``musubi-tuner``: ``{item}[_{window}]_{W:04d}x{H:04d}_{arch}.safetensors`` by ``save_latent_cache_common`` and
  ``{item}_{arch}_te.safetensors`` by ``save_text_encoder_output_cache_common`` (src/musubi_tuner/dataset/
  cache_io.py), tensors named as the ``save_*`` functions name them (``latents_{F}x{H}x{W}_{dtype}``,
  ``{content}_{dtype}``, ``{content}_mask``, ``varlen_`` where the architecture's save function writes it).

Records need what the import keeps of the trainer's files (kohya: info ``arch``, ``original_size``,
``crop_ltrb``; musubi-tuner: ``architecture``, ``width``, ``height``); a record without it is refused, naming
the key and what is missing (a cache built by latentfast is not exported yet).
"""
from __future__ import annotations

import os

import numpy as np
import torch

from ..errors import InvalidArgumentError
from .trainers import fixtures, kohya
from .store.opening import LatentCache

FORMATS = ("kohya", "musubi-tuner")
# musubi-tuner's text tensors saved with the varlen_ prefix (cache_io.py save_text_encoder_output_cache_wan,
# _qwen_image, _krea2); the import drops the prefix, so it is put back per architecture
MUSUBI_VARLEN = {"wan": {"t5", "t5_preservation"}, "qwen_image": {"vl_embed"}, "krea2": {"krea2_vl_embed"},
                 "hunyuan_video": set(), "framepack": set(), "flux_kontext": set()}
MUSUBI_SHORT = {full: short for short, full in fixtures.MUSUBI_ARCH.values()}  # ARCHITECTURE_*_FULL -> file-name arch
# what the musubi import puts in a record's info beside the file's metadata
_MUSUBI_INFO = {"architecture", "width", "height", "format_version", "frame_count", "frame_pos", "caption", "variant",
                "latent_convention", "scaling_factor", "shift_factor"}


def export_cache(cache_dir, out_dir, format: str, split: str = "train") -> dict:
    """Write the records of the cache in ``cache_dir`` as ``format``'s files into ``out_dir``; returns counts
    (``items``, ``files``). Every record is checked before anything is written."""
    if format not in FORMATS:
        raise InvalidArgumentError(f"format must be one of {FORMATS}, got {format!r}")
    cache = LatentCache(cache_dir, split)
    records = [(key, cache.record(i), cache.info(i)) for i, key in enumerate(cache.keys)]
    plan = _kohya_files(records) if format == "kohya" else _musubi_files(records)
    out_dir = os.fspath(out_dir)
    for path, write in plan:
        os.makedirs(os.path.dirname(os.path.join(out_dir, path)) or out_dir, exist_ok=True)
        write(os.path.join(out_dir, path))
    return {"items": len(records), "files": len({path for path, _ in plan})}


def _need(key: str, info: dict, names, format: str) -> None:
    missing = [n for n in names if info.get(n) is None]
    if missing:
        raise InvalidArgumentError(f"record {key!r} has no {missing} in its info: --format {format} exports records "
                                   f"imported from {format} (a cache built by latentfast is not exported yet)")


# -- kohya ---------------------------------------------------------------------------------------------
def _npz_array(key: str, name: str, tensor: torch.Tensor) -> np.ndarray:
    if tensor.dtype == torch.bfloat16:
        raise InvalidArgumentError(f"record {key!r}: field {name!r} is bfloat16, which an .npz cannot hold "
                                   f"(numpy has no bfloat16; kohya's files are float32)")
    return tensor.numpy()


def _kohya_files(records) -> list:
    plan, text_written = [], set()
    for key, fields, info in records:
        _need(key, info, ("arch", "original_size", "crop_ltrb"), "kohya")
        arch, stem, _, variant = info["arch"], *key.partition("@")
        if arch == "legacy":
            name = stem + ".npz"
        else:
            _need(key, info, ("image_size",), "kohya")
            width, height = info["image_size"]
            name = f"{stem}_{width:04d}x{height:04d}_{arch}.npz"
        suffix = f"_{variant}" if arch in kohya.MULTI_RESOLUTION else ""
        arrays = {n: _npz_array(key, n, fields[n]) for n in ("latent", "latent_flipped", "alpha_mask") if n in fields}
        if "latent" not in arrays:
            raise InvalidArgumentError(f"record {key!r} has no field 'latent'")
        plan.append((name, lambda path, a=arrays, info=info, suffix=suffix: fixtures.kohya_save_latents_to_disk(
            path, torch.from_numpy(a["latent"]), info["original_size"], info["crop_ltrb"],
            _tensor(a.get("latent_flipped")), _tensor(a.get("alpha_mask")), suffix)))
        text = {n[5:]: _npz_array(key, n, v) for n, v in fields.items() if n.startswith("text_")}
        text.update({n[5:]: np.array(v) for n, v in info.items() if n.startswith("text_")})
        if text and stem not in text_written:  # one text file per image, whatever its buckets
            text_written.add(stem)
            plan.append((stem + kohya.TE_SUFFIX[arch], lambda path, t=text: np.savez(path, **t)))
    return plan


def _tensor(array):
    return None if array is None else torch.from_numpy(array)


# -- musubi-tuner ----------------------------------------------------------------------------------------
def _dtype_name(name: str, tensor: torch.Tensor) -> str:
    """``name`` as the save functions write it: masks bare, else ``_{dtype_to_str(dtype)}`` appended."""
    return name if name.endswith("_mask") else f"{name}_{str(tensor.dtype).split('.')[-1]}"


def _musubi_files(records) -> list:
    plan, texts = [], {}
    for key, fields, info in records:
        _need(key, info, ("architecture", "width", "height"), "musubi-tuner")
        full = info["architecture"]
        if full not in MUSUBI_SHORT or full not in MUSUBI_VARLEN:
            raise InvalidArgumentError(f"record {key!r}: musubi-tuner architecture {full!r} is not one the export knows "
                                       f"({sorted(MUSUBI_VARLEN)})")
        extra = sorted(set(info) - _MUSUBI_INFO)
        if extra:  # 0-d tensors of the latent file: the import kept their values, not their dtypes
            raise InvalidArgumentError(f"record {key!r}: info {extra} came from 0-d tensors whose dtype the import did not "
                                       "keep; musubi-tuner's files cannot be written back exactly")
        arch, item, _, window = MUSUBI_SHORT[full], *key.partition("@")
        latent_sd, text_sd = {}, {}
        for name, tensor in fields.items():
            if name.startswith("text_"):
                content = name[5:]
                prefix = "varlen_" if content in MUSUBI_VARLEN[full] else ""
                text_sd[prefix + _dtype_name(content, tensor)] = tensor.contiguous()
            elif name == "latent" or (name.startswith("latent_") and tensor.is_floating_point()):
                # latents_* tensors (the import's latent_*), not latent_indices (framepack's int64 indices)
                F = tensor.shape[1] if tensor.dim() == 4 else 1
                H, W = tensor.shape[-2:]
                latent_sd[_dtype_name(f"latents{name[len('latent'):]}_{F}x{H}x{W}", tensor)] = tensor.contiguous()
            else:
                latent_sd[_dtype_name(name, tensor)] = tensor.contiguous()
        size = (int(info["width"]), int(info["height"]))
        body = f"{item}_{window}" if window else item
        frames = info.get("frame_count")
        plan.append((f"{body}_{size[0]:04d}x{size[1]:04d}_{arch}.safetensors",
                     lambda path, sd=latent_sd, size=size, frames=frames, full=full:
                     fixtures.musubi_save_latent_cache_common(path, sd, full, size, frame_count=frames)))
        texts.setdefault(item, (text_sd, full, info.get("caption", "")))
    for item, (sd, full, caption) in texts.items():  # one text file per item, whatever its frame windows
        plan.append((f"{item}_{MUSUBI_SHORT[full]}_te.safetensors", lambda path, sd=sd, full=full, caption=caption:
                     fixtures.musubi_save_text_encoder_output_cache_common(path, sd, full, caption)))
    return plan
