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
matched as the trainer names them (``TextEmbeddingCache.create_hash``), from each item's caption --
``captions=`` (``{stem: caption}``) or the ``{stem}.txt`` beside each image (``caption_strategy=textfile``):
by caption (``TextEmbedCacheKey.CAPTION``, most models), or by dataset and file path
(``DATASET_AND_FILENAME``: krea2, longcat_image, qwen_image and boogu_image edit flavours, ...:
``md5("{dataset id}:{image path below images=}\0prompt\0{caption}")``; the dataset id is
``dataset_id=``, else tried from the VAE cache folder's name, which SimpleTuner's default
``cache/vae/{model_family}/{dataset id}`` ends in). cosmos3's keys also hash a signature of its reasoner
prompt, which is not computed here: its text files stay unmatched. Unmatched text files are listed as
skipped; when captions are known and no text file matches any item, the scan raises instead of
importing the latents alone.
Latents are stored scaled (``scale_vae_latents_for_cache``: ``(z - shift) * scale`` with the VAE
config's factors, which the cache does not record: pass ``scaling_factor=`` / ``shift_factor=``).
"""
from __future__ import annotations

import hashlib
import os
import re

import torch

from .common import (DEFAULT_MAX_ITEM_BYTES, ItemPlan, Lack, Skipped, Source, TrainerCacheError, check_root, fail,
                     load_pt, pt_nbytes, rel_key, split_tensors, walk_files)

TEXT_NAME = re.compile(r"^(?P<md5>[0-9a-f]{32})-(?P<model>[A-Za-z0-9_.]+)\.pt$")
SHA256_NAME = re.compile(r"^[0-9a-f]{64}$")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".jxl", ".avif",
                    ".mp4", ".mov", ".webm", ".mkv", ".avi", ".gif", ".wav", ".flac", ".mp3")


def scan(folder, images=None, captions: dict | None = None, model_type: str | None = None,
         scaling_factor: float | None = None, shift_factor: float | None = None, dataset_id: str | None = None,
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
    stems, image_files = _image_stems(images)
    captions = dict(captions or {}) or _caption_files(images)
    model = _model_type(texts, model_type, root)
    plans, used, hashed = [], set(), 0
    latent_root = os.path.commonpath([d for d, _, _ in latents])
    ids = [dataset_id] if dataset_id is not None else _dataset_ids(root, latent_root)
    for dirpath, name, path in latents:
        sub = os.path.relpath(dirpath, latent_root)
        stem = stems.get((sub, name), stems.get(name, name))
        hashed += bool(SHA256_NAME.match(stem))
        names = [] if stem not in captions else \
            [caption_key_name(captions[stem], model)] + [path_key_name(d, image_files[(sub, name)], captions[stem], model)
                                                         for d in ids if (sub, name) in image_files]
        text = next((texts[n] for n in names if n in texts), None)
        used.add(text)
        nbytes = pt_nbytes(path) + (pt_nbytes(text) if text else 0)
        lacks = () if text else (Lack("text_*", f"text embedding {' or '.join(names) if names else '(caption unknown)'} under {root}"),)
        plans.append(ItemPlan(rel_key(latent_root, dirpath, stem), "", nbytes, _loader(path, text, max_item_bytes), lacks))
    if texts and captions and not used - {None}:
        raise TrainerCacheError(
            f"{root}: none of its {len(texts)} text embeddings matches an item by caption or by dataset and path "
            f"(tried dataset ids {ids}): pass dataset_id= (the SimpleTuner dataset's id) if the model keys text by "
            f"dataset and file path; cosmos3's signature keys are not supported")
    skipped.extend(Skipped(p, "text embeddings not matched to an item by caption or path") for p in texts.values() if p not in used)
    notes = [f"{hashed} keys are SimpleTuner's sha256 file-name hashes (pass images= to recover the stems)"] if hashed else []
    convention = {"latent_convention": "scaled", "scaling_factor": scaling_factor, "shift_factor": shift_factor}
    return Source("simpletuner", root, plans, skipped, convention, notes=notes, max_item_bytes=max_item_bytes,
                  evidence=f"{len(latents)} latent .pt files and {len(texts)} text embeddings {{md5}}-{{model}}.pt")


def iter_records(folder, **options):
    """The records of :func:`scan` ``(folder, **options)``."""
    return iter(scan(folder, **options))


def caption_key_name(caption: str, model: str | None) -> str:
    """``TextEmbeddingCache.hash_prompt`` of a caption-keyed model: ``{md5(caption)}-{model_type}.pt``."""
    return f"{hashlib.md5(str(caption).encode()).hexdigest()}-{model}.pt"


def path_key_name(dataset_id: str, image: str, caption: str, model: str | None) -> str:
    """``hash_prompt`` of a ``DATASET_AND_FILENAME`` model: the key ``{dataset id}:{image path below
    instance_data_dir}`` (training/collate.py, ``normalize_data_path``), then the prompt (``create_hash``)."""
    digest = hashlib.md5(f"{dataset_id}:{os.path.normcase(image)}".encode())
    if caption:
        digest.update(b"\0prompt\0")
        digest.update(str(caption).encode())
    return f"{digest.hexdigest()}-{model}.pt"


def _dataset_ids(root: str, latent_root: str) -> list[str]:
    """The folder names from the latents' folder up to ``root``: SimpleTuner's default VAE cache folder
    (``cache/vae/{model_family}/{dataset id}``) ends in the dataset's id."""
    names, here = [], latent_root
    while True:
        names.append(os.path.basename(here))
        if os.path.samefile(here, root) or os.path.dirname(here) == here:
            return names
        here = os.path.dirname(here)


def _image_stems(images) -> tuple[dict, dict]:
    """``({sha256(stem): stem, (subfolder, sha256(stem) or stem): stem}, {(subfolder, sha256(stem) or stem):
    the image's path below images=})`` of the images under ``images``."""
    if images is None:
        return {}, {}
    image_root, out, files = check_root(images), {}, {}
    for dirpath, name in walk_files(image_root):
        stem, ext = os.path.splitext(name)
        if ext.lower() in IMAGE_EXTENSIONS:
            digest, sub = hashlib.sha256(stem.encode()).hexdigest(), os.path.relpath(dirpath, image_root)
            out[(sub, digest)] = out[(sub, stem)] = stem
            out.setdefault(digest, stem)
            files[(sub, digest)] = files[(sub, stem)] = os.path.relpath(os.path.join(dirpath, name), image_root)
    return out, files


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
