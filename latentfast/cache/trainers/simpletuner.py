"""bghira SimpleTuner: ``.pt`` latent files (``torch.save``, gzip'd with ``compress_disk_cache``) and text ``.pt`` s.

As SimpleTuner writes them: latents ``{cache_dir_vae}/{subfolders}/{name}.pt`` with ``name`` =
``sha256(stem)`` (``hash_filenames``, the default) or the image stem
(``helpers/caching/vae.py`` ``VAECache.generate_vae_cache_filename``), holding the latent tensor,
or a dict with ``latents`` (audio models); text embeddings ``{md5(caption)}-{model_type}.pt``
(``helpers/caching/text_embeds.py`` ``TextEmbeddingCache.create_hash``) holding a dict
(``prompt_embeds`` and ``attention_mask`` cut to the mask's length, ``pooled_prompt_embeds``, ...).
Both are written by ``helpers/data_backend/local.py`` ``LocalDataBackend.torch_save``.

Records: field ``latent`` (+ every other tensor of a dict, by its name), text fields
``text_{key}`` (``text_prompt_embeds``, ``text_pooled_prompt_embeds``, ``text_attention_mask``);
plain values go to info. A hashed name is turned back into the image's stem when ``images=`` (the
``instance_data_dir``) is given; otherwise the key is the hash (a note says so). Text embeddings are
matched by caption as the trainer does: ``captions=`` (``{stem: caption}``) or the ``{stem}.txt``
beside each image (``caption_strategy=textfile``); unmatched text files are listed as skipped.
Latents are stored scaled (``scale_vae_latents_for_cache``: ``(z - shift) * scale`` with the VAE
config's factors, which the cache does not record: pass ``scaling_factor=`` / ``shift_factor=``).
"""
from __future__ import annotations

import hashlib
import os
import re

import torch

from .common import (DEFAULT_MAX_ITEM_BYTES, ItemPlan, Skipped, Source, TrainerCacheError, check_root, fail,
                     load_pt, pt_nbytes, rel_key, split_tensors, walk_files)

TEXT_NAME = re.compile(r"^(?P<md5>[0-9a-f]{32})-(?P<model>[A-Za-z0-9_.]+)\.pt$")
SHA256_NAME = re.compile(r"^[0-9a-f]{64}$")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".jxl", ".avif",
                    ".mp4", ".mov", ".webm", ".mkv", ".avi", ".gif", ".wav", ".flac", ".mp3")


def scan(folder, images=None, captions: dict | None = None, model_type: str | None = None,
         scaling_factor: float | None = None, shift_factor: float | None = None,
         max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES) -> Source:
    """A :class:`Source` of a SimpleTuner cache root (its VAE cache and ``text/`` cache folders)."""
    root = check_root(folder)
    latents, texts, skipped = [], {}, []
    for dirpath, name in walk_files(root):
        path = os.path.join(dirpath, name)
        if not name.endswith(".pt"):
            skipped.append(Skipped(path, "files that are not .pt caches"))
        elif TEXT_NAME.match(name):
            texts[name] = path
        else:
            latents.append((dirpath, name[:-3], path))
    if not latents:
        raise TrainerCacheError(f"{root}: expected SimpleTuner latent .pt files, found none ({len(texts)} text embeddings)")
    stems = _image_stems(images)
    captions = dict(captions or {}) or _caption_files(images)
    model = _model_type(texts, model_type, root)
    plans, used, hashed = [], set(), 0
    latent_root = os.path.commonpath([d for d, _, _ in latents])
    for dirpath, name, path in latents:
        stem = stems.get((os.path.relpath(dirpath, latent_root), name), stems.get(name, name))
        hashed += bool(SHA256_NAME.match(stem))
        text = texts.get(f"{hashlib.md5(str(captions[stem]).encode()).hexdigest()}-{model}.pt") if stem in captions else None
        used.add(text)
        nbytes = pt_nbytes(path) + (pt_nbytes(text) if text else 0)
        plans.append(ItemPlan(rel_key(latent_root, dirpath, stem), "", nbytes, _loader(path, text, max_item_bytes)))
    skipped.extend(Skipped(p, "text embeddings not matched to an item by caption") for p in texts.values() if p not in used)
    notes = [f"{hashed} keys are SimpleTuner's sha256 file-name hashes (pass images= to recover the stems)"] if hashed else []
    convention = {"latent_convention": "scaled", "scaling_factor": scaling_factor, "shift_factor": shift_factor}
    return Source("simpletuner", root, plans, skipped, convention, notes=notes, max_item_bytes=max_item_bytes,
                  evidence=f"{len(latents)} latent .pt files and {len(texts)} text embeddings {{md5}}-{{model}}.pt")


def iter_records(folder, **options):
    """The records of :func:`scan` ``(folder, **options)``."""
    return iter(scan(folder, **options))


def _image_stems(images) -> dict:
    """``{sha256(stem): stem}`` and ``{(subfolder, sha256(stem)): subfolder/stem}`` of the images under ``images``."""
    if images is None:
        return {}
    image_root, out = check_root(images), {}
    for dirpath, name in walk_files(image_root):
        stem, ext = os.path.splitext(name)
        if ext.lower() in IMAGE_EXTENSIONS:
            digest, sub = hashlib.sha256(stem.encode()).hexdigest(), os.path.relpath(dirpath, image_root)
            out[(sub, digest)] = out[(sub, stem)] = stem
            out.setdefault(digest, stem)
    return out


def _caption_files(images) -> dict:
    if images is None:
        return {}
    out = {}
    for dirpath, name in walk_files(check_root(images)):
        if name.endswith(".txt"):
            with open(os.path.join(dirpath, name), encoding="utf-8") as fh:
                out[name[:-4]] = fh.read().strip()
    return out


def _model_type(texts: dict, model_type: str | None, root: str) -> str | None:
    found = sorted({TEXT_NAME.match(n)["model"] for n in texts})
    if model_type is not None or len(found) <= 1:
        return model_type or (found[0] if found else None)
    raise TrainerCacheError(f"{root} holds text embeddings of several model types {found}; pass model_type=")


def _loader(path: str, text: str | None, limit: int):
    def load():  # a gzip'd file is judged by what it inflates to: the latent's, then the text's, within the item's limit
        obj = load_pt(path, limit)
        if isinstance(obj, torch.Tensor):
            fields, info = {"latent": obj}, {}
        elif isinstance(obj, dict) and isinstance(obj.get("latents"), torch.Tensor):
            tensors, info = split_tensors(obj, path)
            fields = {"latent": tensors.pop("latents"), **tensors}
        else:
            raise fail(path, "a latent tensor or a dict with 'latents'", _describe(obj))
        if text is not None:
            embeds = load_pt(text, limit - sum(v.nbytes for v in fields.values()), limit)
            if not isinstance(embeds, dict):
                raise fail(text, "a dict of text-encoder outputs", _describe(embeds))
            tensors, plain = split_tensors(embeds, text)
            fields.update({f"text_{k}": v for k, v in tensors.items()})
            info.update({f"text_{k}": v for k, v in plain.items()})
        return fields, info
    return load


def _describe(obj) -> str:
    return f"a dict of {sorted(map(str, obj))}" if isinstance(obj, dict) else f"a {type(obj).__name__}"
