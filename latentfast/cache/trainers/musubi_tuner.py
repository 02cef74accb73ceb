"""kohya-ss musubi-tuner: ``{item}_{WWWW}x{HHHH}_{arch}.safetensors`` beside ``{item}_{arch}_te.safetensors``.

As ``src/musubi_tuner/dataset/cache_io.py`` writes them (``save_latent_cache_*`` and
``save_text_encoder_output_cache_*``): tensors named ``<content>_FxHxW_<dtype>`` for latents and
``<content>_<dtype>`` / ``<content>_mask`` otherwise, text tensors ``varlen_``-prefixed when not
stacked; metadata ``architecture``, ``width``, ``height``, ``format_version`` (+ ``frame_count`` for
video, whose file names carry the frame window ``{item}_{pos:05d}-{count:03d}_...``).

Records, with names as ``BucketBatchManager.__getitem__`` (``dataset/bucket.py``) makes them:
``latents`` -> field ``latent``; ``latents_image`` / ``latents_control[_i]`` / ``latents_clean[_2x|_4x]``
-> ``latent_image``, ``latent_control[_i]``, ``latent_clean[_2x|_4x]``; every other latent-file
tensor under its content name (``clip``, ``image_embeddings``, ``latent_indices``,
``clean_latent_indices``, ``f_indices``, ``siglip``); text tensors ``text_{content}`` (``text_t5``,
``text_llama_vec``, ``text_llama_attention_mask``, ``text_clip_l_pooler``, ...). Info: the latent
file's metadata (``architecture``, ``width``, ``height`` as ints, ``frame_count``, ``format_version``),
``caption`` (the text file's ``caption1``), 0-d tensors (``vae_scaling_factor``), and for video
``frame_pos``. Several windows of one video: ``{item}@{pos:05d}-{count:03d}``. As the trainer does,
a latent file without its text file is not an item (listed as skipped).
"""
from __future__ import annotations

import os
import re
from functools import lru_cache

import torch

from .common import (DEFAULT_MAX_ITEM_BYTES, ItemPlan, Skipped, Source, TrainerCacheError, check_root,
                     load_safetensors, rel_key, safetensors_header, walk_files)

LATENT_NAME = re.compile(r"^(?P<key>.+)_(?P<w>\d{4,})x(?P<h>\d{4,})_(?P<arch>[A-Za-z0-9]+)\.safetensors$")
TEXT_NAME = re.compile(r"^(?P<key>.+)_(?P<arch>[A-Za-z0-9]+)_te\.safetensors$")
FRAMES = re.compile(r"^(?P<pos>\d+)-(?P<count>\d+)(?:-\d+)?$")
# Verified from each architecture's cache code; others are stamped "unknown".
CONVENTION = {"hunyuan_video": ("raw", 0.476986, None),  # cache_latents.py: scaling_factor left to training
              "qwen_image": ("scaled", None, None), "krea2": ("scaled", None, None)}  # (raw - mean) / std


@lru_cache(maxsize=1)
def _dtype_names() -> tuple[str, ...]:
    """Every name ``dtype_to_str`` can write (``utils/model_utils.py``), longest first."""
    names = {str(v).split(".")[-1] for v in vars(torch).values() if isinstance(v, torch.dtype)}
    return tuple(sorted(names, key=len, reverse=True))


def content_key(name: str) -> str:
    """A tensor's name as ``BucketBatchManager.__getitem__`` turns it into a batch key."""
    key = name.replace("varlen_", "") if name.startswith("varlen_") else name
    if key.endswith("_mask"):
        return key
    for dtype in _dtype_names():
        if key.endswith("_" + dtype):
            key = key[: -len(dtype) - 1]
            break
    if key.startswith("latents_"):
        key = key.rsplit("_", 1)[0]
    return key


def field_name(name: str, text: bool) -> str:
    key = content_key(name)
    if text:
        return f"text_{key}"
    return "latent" + key[len("latents"):] if key.startswith("latents") else key


def scan(folder, architecture: str | None = None, max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES) -> Source:
    """A :class:`Source` of a musubi-tuner ``cache_directory``; ``architecture`` (short name) picks one of several."""
    root = check_root(folder)
    latents, texts, skipped = {}, {}, []
    for dirpath, name in walk_files(root):
        path = os.path.join(dirpath, name)
        t, m = TEXT_NAME.match(name), LATENT_NAME.match(name)
        if t and not m:
            texts[(dirpath, t["key"], t["arch"])] = path
        elif m:
            latents.setdefault(m["arch"], []).append((dirpath, m, path))
        else:
            skipped.append(Skipped(path, "files that are not musubi-tuner caches"))
    arch = _pick_arch(root, latents, texts, architecture)
    plans, used, arch_full = [], set(), None
    for dirpath, m, path in latents.get(arch, []):
        entries, meta = safetensors_header(path)
        item, window = _item_key(m["key"], meta)
        te_path = texts.get((dirpath, item, arch))
        if te_path is None:
            skipped.append(Skipped(path, "latent files without their text-encoder file (musubi-tuner skips them too)"))
            continue
        used.add(te_path)
        arch_full = meta.get("architecture", arch_full)
        nbytes = sum(e[2] for e in entries.values()) + sum(e[2] for e in safetensors_header(te_path)[0].values())
        plans.append(ItemPlan(rel_key(root, dirpath, item), window, nbytes, _loader(path, te_path, meta, window)))
    for other, files in latents.items():
        if other != arch:
            skipped.extend(Skipped(p, f"latent files of architecture {other!r} (pass architecture={other!r})") for *_, p in files)
    skipped.extend(Skipped(p, "text-encoder files without a latent file") for p in texts.values() if p not in used)
    kind, scale, shift = CONVENTION.get(arch_full, ("unknown", None, None))
    evidence = f"{len(latents.get(arch, []))} latent files *_{{W}}x{{H}}_{arch}.safetensors and {len(texts)} *_te.safetensors"
    return Source("musubi-tuner", root, plans, skipped, {"latent_convention": kind, "scaling_factor": scale, "shift_factor": shift},
                  evidence=evidence, max_item_bytes=max_item_bytes)


def iter_records(folder, **options):
    """The records of :func:`scan` ``(folder, **options)``."""
    return iter(scan(folder, **options))


def _pick_arch(root, latents, texts, architecture):
    if architecture is not None:
        if architecture not in latents:
            raise TrainerCacheError(f"{root} holds no musubi-tuner latents of architecture {architecture!r}; "
                                    f"it holds {sorted(latents) or 'none'}")
        return architecture
    if len(latents) != 1:
        found = f"several architectures {sorted(latents)}; pass architecture=" if latents else (
            f"no latent files named {{item}}_{{W:04d}}x{{H:04d}}_{{arch}}.safetensors ({len(texts)} text files)")
        raise TrainerCacheError(f"{root}: expected one musubi-tuner cache, found {found}")
    return next(iter(latents))


def _item_key(key: str, meta: dict) -> tuple[str, str]:
    """``(item key, frame window or "")``: video caches end their key in ``_{pos:05d}-{count:03d}``."""
    body, _, last = key.rpartition("_")
    if "frame_count" in meta and body and FRAMES.match(last):
        return body, last
    return key, ""


def _loader(path: str, te_path: str, meta: dict, window: str):
    def load():
        fields, info = {}, {}
        for k, v in meta.items():
            info[k] = int(v) if k in ("width", "height", "frame_count") and v.isdigit() else v
        if window:
            info["frame_pos"] = int(FRAMES.match(window)["pos"])
        for text, file in ((False, path), (True, te_path)):
            for name, tensor in load_safetensors(file).items():
                target = info if tensor.dim() == 0 else fields
                target[field_name(name, text)] = tensor.item() if tensor.dim() == 0 else tensor
        te_meta = safetensors_header(te_path)[1]
        if "caption1" in te_meta:
            info["caption"] = te_meta["caption1"]
        return fields, info
    return load
