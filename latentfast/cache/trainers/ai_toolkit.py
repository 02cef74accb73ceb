"""ostris ai-toolkit: ``_latent_cache/`` and ``_t_e_cache/`` folders beside each dataset folder's images.

As ``toolkit/dataloader_mixins.py`` writes them: latents ``_latent_cache/{stem}_{hash}.safetensors``
(``LatentCachingMixin._cache_one_latent``; the hash is of ``get_latent_info_dict``, also stored as
the file's metadata: ``filename``, ``scale_to_width/height``, ``crop_x/y/width/height``, ``flip_x``,
...), optionally uint8-quantized (``_latent_to_uint8``); text embeddings
``_t_e_cache/{stem}_{hash}.safetensors`` (``toolkit/prompt_utils.py`` ``PromptEmbeds.save``).

Records: one per image and size; its ``flip_x`` / ``flip_y`` copies (separate files to the trainer)
become fields of the same record. Fields ``latent`` (uint8 dequantized as ``_latent_from_uint8``
does, to float32), ``latent_first_frame``, ``latent_audio``, ``pixels`` (the ``tensor`` entry,
dequantized), ``waveform`` (int16 dequantized as ``_waveform_from_int16``), each with suffix
``_flipped`` / ``_flipped_y`` / ``_flipped_xy`` for the flipped copies; text fields ``text_{entry}``
(``text_text_embed``, ``text_pooled_embed``, ``text_attention_mask``, ``text_text_embed_0``, ...; an
``AnimaPromptEmbeds`` file: ``text_qwen_prompt_embeds``, ``text_qwen_attention_mask``,
``text_t5_input_ids``, ``text_t5_attention_mask``, and info ``text_class_name``; other classes, such as
``AdvancedPromptEmbeds``, are refused naming the file).
Info: the latent file's metadata, JSON values parsed (flip keys left out), ``quantized: "uint8"`` when
so stored, ``num_frames``, ``waveform_sample_rate``. Several sizes of one image: ``{stem}@{h}x{w}``.

Text matching: the trainer hashes the caption into the name, so a stem's text file is its one
``_t_e_cache`` file, or -- when dropout or DOP embeddings are cached too -- the one whose hash no other
image shares (the blank-caption embedding's hash is the same for every image). Anything else is
reported, not guessed.
"""
from __future__ import annotations

import json
import os
import re
from collections import defaultdict

import torch

from .common import (DEFAULT_MAX_ITEM_BYTES, ItemPlan, Lack, Skipped, Source, TrainerCacheError, check_root,
                     load_safetensors, rel_key, safetensors_header, walk_files)

CACHE_NAME = re.compile(r"^(?P<stem>.+)_(?P<hash>[A-Za-z0-9_-]{22})\.safetensors$")
# what toolkit/prompt_utils.py PromptEmbeds.load reads here: plain PromptEmbeds files (no class_name), and
# those whose metadata class_name hands them to AnimaPromptEmbeds.load (AdvancedPromptEmbeds: not read)
TEXT_CLASSES = {"PromptEmbeds", "AnimaPromptEmbeds"}
VARIANT = {(False, False): "", (True, False): "_flipped", (False, True): "_flipped_y", (True, True): "_flipped_xy"}
LATENT_FIELDS = {"latent": "latent", "first_frame_latent": "latent_first_frame", "audio_latent": "latent_audio",
                 "tensor": "pixels", "waveform": "waveform"}


def dequantize_uint8(t: torch.Tensor) -> torch.Tensor:
    """``_latent_from_uint8``: uint8 0..255 -> float32 in [-1, 1]."""
    return t.to(torch.float32) / 127.5 - 1.0


def dequantize_int16(t: torch.Tensor) -> torch.Tensor:
    """``_waveform_from_int16``: int16 -> float32 in [-1, 1]."""
    return t.to(torch.float32) / 32767.0


def scan(folder, max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES) -> Source:
    """A :class:`Source` of every ``_latent_cache`` under ``folder`` with its ``_t_e_cache`` beside it."""
    root = check_root(folder)
    if os.path.basename(root) in ("_latent_cache", "_t_e_cache"):  # given the cache folder itself: its dataset folder
        root = os.path.dirname(root)
    latent_files, text_files, skipped = [], defaultdict(list), []
    for dirpath, name in walk_files(root):
        path, kind = os.path.join(dirpath, name), os.path.basename(dirpath)
        m = CACHE_NAME.match(name)
        if kind in ("_latent_cache", "_t_e_cache") and m is None:
            skipped.append(Skipped(path, f"files in {kind} not named {{stem}}_{{hash}}.safetensors"))
        elif kind == "_latent_cache":
            latent_files.append(path)
        elif kind == "_t_e_cache":
            text_files[os.path.dirname(dirpath)].append((m["stem"], m["hash"], path))
    if not latent_files:
        raise TrainerCacheError(f"{root}: expected ai-toolkit _latent_cache folders of {{stem}}_{{hash}}.safetensors, found none")
    groups = _group_latents(latent_files, skipped)
    texts, used = _match_texts(text_files, skipped)
    plans, attached = [], set()
    for (image_dir, _), variants in groups.items():
        if "" not in variants:
            skipped.extend(Skipped(v[0], "flipped copies without their unflipped latent") for v in variants.values())
            continue
        stem = os.path.splitext(variants[""][1]["filename"])[0]
        te_path = texts.get((image_dir, stem))
        attached.add(te_path)
        nbytes = sum(sum(e[2] for e in v[2].values()) for v in variants.values())
        lacks = () if "_flipped" in variants else (Lack("latent_flipped", f"flip_x copy of {variants[''][0]}"),)
        if te_path:
            te_entries, te_meta = safetensors_header(te_path)
            if te_meta.get("class_name", "PromptEmbeds") not in TEXT_CLASSES:
                raise TrainerCacheError(f"{te_path}: expected the entries of one of {sorted(TEXT_CLASSES)}, found a "
                                        f"{te_meta['class_name']} file (not supported)")
            nbytes += sum(e[2] for e in te_entries.values())
        else:
            lacks += (Lack("text_*", os.path.join(image_dir, "_t_e_cache", f"{stem}_{{hash}}.safetensors")),)
        hw = "x".join(str(s) for s in variants[""][2]["latent"][1][-2:])
        plans.append(ItemPlan(rel_key(root, image_dir, stem), hw, nbytes, _loader(variants, te_path), lacks))
    skipped.extend(Skipped(p, "text embeddings not matched to one image") for files in text_files.values()
                   for *_, p in files if p not in used)
    skipped.extend(Skipped(p, "text embeddings of images without a latent") for p in texts.values() if p not in attached)
    uint8 = any(v[2]["latent"][0] == "U8" for g in groups.values() for v in g.values())
    convention = {"latent_convention": "pixels" if uint8 else "scaled", "scaling_factor": None, "shift_factor": None}
    return Source("ai-toolkit", root, plans, skipped, convention,
                  evidence=f"{len(latent_files)} files in _latent_cache folders", max_item_bytes=max_item_bytes)


def iter_records(folder, **options):
    """The records of :func:`scan` ``(folder, **options)``."""
    return iter(scan(folder, **options))


def _group_latents(paths: list[str], skipped: list) -> dict:
    """``{(image dir, metadata without flips): {variant suffix: (path, metadata, header)}}``."""
    groups = defaultdict(dict)
    for path in paths:
        entries, raw = safetensors_header(path)
        meta = {k: _parse(k, v) for k, v in raw.items()}
        if "latent" not in entries or "filename" not in meta:
            raise TrainerCacheError(f"{path}: expected an ai-toolkit latent cache (entry 'latent', metadata 'filename'), "
                                    f"found entries {sorted(entries)} and metadata {sorted(meta)}")
        suffix = VARIANT[(meta.pop("flip_x", False) is True, meta.pop("flip_y", False) is True)]
        image_dir = os.path.dirname(os.path.dirname(path))
        group = groups[(image_dir, json.dumps(meta, sort_keys=True))]
        if suffix in group:
            skipped.append(Skipped(path, "latent files duplicating another's metadata"))
            continue
        group[suffix] = (path, meta, entries)
    return groups


def _parse(key: str, value: str):
    if key == "filename":
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


def _match_texts(text_files: dict, skipped: list) -> tuple[dict, set]:
    """``{(image dir, stem): text file}`` by the rule in the module docstring."""
    matched, used = {}, set()
    for image_dir, files in text_files.items():
        stems_of_hash = defaultdict(set)
        for stem, h, _ in files:
            stems_of_hash[h].add(stem)
        per_stem = defaultdict(list)
        for stem, h, path in files:
            per_stem[stem].append((h, path))
        for stem, candidates in per_stem.items():
            own = candidates if len(candidates) == 1 else [c for c in candidates if len(stems_of_hash[c[0]]) == 1]
            if len(own) == 1:
                matched[(image_dir, stem)] = own[0][1]
                used.add(own[0][1])
                for _, p in candidates:
                    if p != own[0][1]:
                        skipped.append(Skipped(p, "dropout (blank-caption) text embeddings"))
                        used.add(p)
    return matched, used


def _loader(variants: dict, te_path: str | None):
    def load():
        fields, info = {}, dict(variants[""][1])
        for suffix, (path, _, _) in variants.items():
            for name, tensor in load_safetensors(path).items():
                if name in ("num_frames", "waveform_sample_rate") and tensor.dim() == 0:
                    info[name] = int(tensor.item())
                    continue
                if tensor.dtype == torch.uint8 and name != "tensor":
                    info["quantized"] = "uint8"
                if tensor.dtype == torch.uint8:
                    tensor = dequantize_uint8(tensor)
                elif name == "waveform":
                    tensor = dequantize_int16(tensor)
                fields[LATENT_FIELDS.get(name, name) + suffix] = tensor
        if te_path is not None:  # both classes save their tensors flat by name (PromptEmbeds.load dispatches on class_name)
            fields.update({f"text_{k}": v for k, v in load_safetensors(te_path).items()})
            text_class = safetensors_header(te_path)[1].get("class_name")
            if text_class:
                info["text_class_name"] = text_class
        return fields, info
    return load
