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
``cache/vae/{model_family}/{dataset id}`` ends in). cosmos3 appends to that key a signature of its reasoner
prompt and the item's geometry (:mod:`.simpletuner_cosmos3`): computed per item from its caption, the shape of
its latent (read at scan time), ``framerate=`` (default 24) and the reasoner component (``reasoner_component=``,
default: each id ``cosmos3_reasoner_component: auto`` gives), then confirmed against the ``cache_signature``
stored in the file when it is read; its reasoner cache becomes ``text_input_ids``, ``text_text_indexes``,
``text_text_mrope_ids``, ``text_layer_kv_{k|v|k_for_gen}`` (stacked over the reasoner's layers) and ``text_*`` info
(:func:`.simpletuner_cosmos3.reasoner_cache` rebuilds SimpleTuner's dict from a record).
Unmatched text files are listed as skipped; when captions are known and no text file matches any item,
the scan raises instead of importing the latents alone (for cosmos3, saying from the smallest file's stored
signature whether the dataset id or the framerate / reasoner component differ).
Latents are stored scaled (``scale_vae_latents_for_cache``: ``(z - shift) * scale`` with the VAE
config's factors, which the cache does not record: pass ``scaling_factor=`` / ``shift_factor=``).
"""
from __future__ import annotations

import hashlib
import os
import re

import torch

from . import simpletuner_cosmos3 as cosmos3
from .common import (DEFAULT_MAX_ITEM_BYTES, ItemPlan, Lack, Skipped, Source, TrainerCacheError, check_root, fail,
                     load_pt, pt_nbytes, rel_key, split_tensors, walk_files)

TEXT_NAME = re.compile(r"^(?P<md5>[0-9a-f]{32})-(?P<model>[A-Za-z0-9_.]+)\.pt$")
SHA256_NAME = re.compile(r"^[0-9a-f]{64}$")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".jxl", ".avif",
                    ".mp4", ".mov", ".webm", ".mkv", ".avi", ".gif", ".wav", ".flac", ".mp3")


def scan(folder, images=None, captions: dict | None = None, model_type: str | None = None,
         scaling_factor: float | None = None, shift_factor: float | None = None, dataset_id: str | None = None,
         reasoner_component: str | None = None, framerate: float | None = None,
         max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES) -> Source:
    """A :class:`Source` of a SimpleTuner cache root (its VAE cache and ``text/`` cache folders).

    cosmos3 only: ``reasoner_component`` (the config's ``cosmos3_reasoner_component``; default: each id its
    ``auto`` gives) and ``framerate`` (the config's ``framerate``; default 24) enter its text files' names."""
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
    if model not in (None, "cosmos3") and (reasoner_component is not None or framerate is not None):
        raise TrainerCacheError(f"{root}: reasoner_component= and framerate= name cosmos3's text files; its text "
                                f"embeddings are {model}'s (pass model_type='cosmos3' if they are cosmos3's)")
    cosmos3_names = Cosmos3Names(reasoner_component, framerate, max_item_bytes) if model == "cosmos3" else None
    plans, used, hashed = [], set(), 0
    latent_root = os.path.commonpath([d for d, _, _ in latents])
    ids = [dataset_id] if dataset_id is not None else _dataset_ids(root, latent_root)
    for dirpath, name, path in latents:
        sub = os.path.relpath(dirpath, latent_root)
        stem = stems.get((sub, name), stems.get(name, name))
        hashed += bool(SHA256_NAME.match(stem))
        key, image, caption = rel_key(latent_root, dirpath, stem), image_files.get((sub, name)), captions.get(stem)
        if cosmos3_names is not None:
            names = cosmos3_names.names(key, path, image, caption, ids)
        elif caption is None:
            names = {}
        else:
            names = {caption_key_name(caption, model): None} | {path_key_name(d, image, caption, model): None
                                                                 for d in ids if image is not None}
        text = next((n for n in names if n in texts), None)
        used.add(text and texts[text])
        nbytes = pt_nbytes(path) + (pt_nbytes(texts[text]) if text else 0)
        lacks = () if text else (Lack("text_*", cosmos3_names.lack(names, root) if cosmos3_names is not None else
                                      f"text embedding {' or '.join(names) if names else '(caption unknown)'} under {root}"),)
        load = _loader(path, text and texts[text], max_item_bytes, names.get(text))
        plans.append(ItemPlan(key, "", nbytes, load, lacks))
    if texts and captions and not used - {None}:
        if cosmos3_names is not None:
            raise cosmos3_names.unmatched_error(root, texts, ids)
        raise TrainerCacheError(
            f"{root}: none of its {len(texts)} text embeddings matches an item by caption or by dataset and path "
            f"(tried dataset ids {ids}): pass dataset_id= (the SimpleTuner dataset's id) if the model keys text by "
            f"dataset and file path")
    reason = ("cosmos3 reasoner caches whose names are no item's (path, caption, latent geometry, framerate and "
              "reasoner component)") if cosmos3_names is not None else "text embeddings not matched to an item by caption or path"
    skipped.extend(Skipped(p, reason) for p in texts.values() if p not in used)
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


def path_key_name(dataset_id: str, image: str, caption: str, model: str | None, signature: str | None = None) -> str:
    """``hash_prompt`` of a ``DATASET_AND_FILENAME`` model: the key ``{dataset id}:{image path below
    instance_data_dir}`` (training/collate.py, ``normalize_data_path``), then the prompt (``create_hash``).
    cosmos3 (``signature``): the key with ``:cosmos3:{signature}`` appended (cosmos3/model.py ``text_embed_cache_key_value``)."""
    key = f"{dataset_id}:{os.path.normcase(image)}" + (f":cosmos3:{signature}" if signature is not None else "")
    digest = hashlib.md5(key.encode())
    if caption:
        digest.update(b"\0prompt\0")
        digest.update(str(caption).encode())
    return f"{digest.hexdigest()}-{model}.pt"


class Cosmos3Names:
    """The names cosmos3's text files of an item can have, as SimpleTuner's collate makes them: one per dataset id
    and reasoner component, for the caption, the image path and the geometry of the item's latent
    (:mod:`.simpletuner_cosmos3`). Each item's latent is read at scan time for its shape; the cost is linear in the
    items (a few names each), and the file a name finds is confirmed by the signature stored inside it when read."""

    def __init__(self, reasoner_component: str | None, framerate: float | None, max_item_bytes: int):
        self.components = (str(reasoner_component),) if reasoner_component is not None else cosmos3.REASONER_COMPONENTS
        self.fps = float(framerate) if framerate is not None else cosmos3.DEFAULT_FRAMERATE
        self.max_item_bytes = max_item_bytes
        self.items = []  # (key, caption, geometry) of each item names were made for: the unmatched error's evidence

    def names(self, key: str, path: str, image: str | None, caption: str | None, ids: list[str]) -> dict:
        """``{text file name: (signature, reasoner component)}`` of one item; none if its caption or image is unknown."""
        if caption is None or image is None:
            return {}
        geometry = cosmos3.latent_geometry(_latent(load_pt(path, self.max_item_bytes), path), path)
        self.items.append((key, caption, geometry))
        signatures = cosmos3.signatures(caption, *geometry, self.fps, self.components)
        return {path_key_name(d, image, caption, "cosmos3", sig): (sig, c) for d in ids for c, sig in signatures.items()}

    def lack(self, names: dict, root: str) -> str:
        """Where the text file of the item :meth:`names` was last called for would be."""
        if not names:
            return f"cosmos3 reasoner cache (caption or image unknown: pass images=) under {root}"
        frames, height, width = self.items[-1][2]  # (names() has just made this item's)
        return (f"cosmos3 reasoner cache {next(iter(names))} or {len(names) - 1} other names (for {frames} frames at "
                f"{height}x{width}, framerate {self.fps}, reasoner components {list(self.components)}) under {root}")

    def unmatched_error(self, root: str, texts: dict, ids: list[str]) -> TrainerCacheError:
        """No text file is any item's: what the smallest one's stored ``cache_signature`` says to pass."""
        path = min(texts.values(), key=os.path.getsize)
        stored = load_pt(path, self.max_item_bytes)
        cache = stored.get(cosmos3.PAYLOAD_KEY) if isinstance(stored, dict) else None
        signature = cache.get("cache_signature") if isinstance(cache, dict) else None
        tried = (f"tried dataset ids {ids}, framerate {self.fps} (framerate=), reasoner components {list(self.components)} "
                 f"(reasoner_component=: the config's cosmos3_reasoner_component), each item's latent geometry")
        head = f"{root}: none of its {len(texts)} cosmos3 reasoner caches is named as SimpleTuner names an item's ({tried})"
        if signature is None:
            return TrainerCacheError(f"{head}; {path} holds no {cosmos3.PAYLOAD_KEY}.cache_signature: is it cosmos3's?")
        if not self.items:
            return TrainerCacheError(f"{head}; no item's image path is known: pass images= (the dataset's instance_data_dir)")
        for key, caption, geometry in self.items:
            for component, computed in cosmos3.signatures(caption, *geometry, self.fps, self.components).items():
                if computed == signature:
                    return TrainerCacheError(
                        f"{head}; {path}'s stored cache_signature is item {key!r}'s (its caption and geometry, reasoner "
                        f"component {component}), so the dataset id or the image path differ: pass dataset_id= (the "
                        f"SimpleTuner dataset's id) and images= (its instance_data_dir)")
        return TrainerCacheError(
            f"{head}; {path}'s stored cache_signature {signature} is no item's caption and geometry with those: pass "
            f"reasoner_component= or framerate= as the SimpleTuner config has them (or images= where the captions differ)")


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
            with open(os.path.join(dirpath, name), "rb") as fh:
                out[name[:-4]] = textfile_caption(fh.read().decode("utf-8"))
    return out


def textfile_caption(text: str) -> str:
    """The caption SimpleTuner's ``caption_strategy=textfile`` hashes first: the file's text as read (not
    stripped), or, when it holds a newline, its first non-empty line (``helpers/prompts.py``
    ``PromptHandler.prepare_instance_prompt_from_textfile`` splits on ``\n`` and drops empty lines; a file
    of several captions gets one embedding per caption, of which the record keeps the first)."""
    if "\n" not in text:
        return text
    return next((line for line in text.split("\n") if line), "")


def _model_type(texts: dict, model_type: str | None, root: str) -> str | None:
    found = sorted({TEXT_NAME.match(n)["model"] for n in texts})
    if model_type is not None or len(found) <= 1:
        return model_type or (found[0] if found else None)
    raise TrainerCacheError(f"{root} holds text embeddings of several model types {found}; pass model_type=")


def _loader(path: str, text: str | None, limit: int, cosmos3_match: tuple | None = None):
    """``cosmos3_match``: ``(signature, reasoner component)`` the text file's name was made of."""
    def load():  # a gzip'd file is judged by what it inflates to: the latent's, then the text's, within the item's limit
        obj = load_pt(path, limit)
        latent = _latent(obj, path)
        fields, info = {"latent": latent}, {}
        if isinstance(obj, dict):
            tensors, info = split_tensors(obj, path)
            fields.update({k: v for k, v in tensors.items() if k != "latents"})
        if text is not None:
            embeds = load_pt(text, limit - sum(v.nbytes for v in fields.values()), limit)
            if not isinstance(embeds, dict):
                raise fail(text, "a dict of text-encoder outputs", _describe(embeds))
            if cosmos3_match is not None or cosmos3.PAYLOAD_KEY in embeds:
                tensors, plain = cosmos3.record_fields(embeds, text)
                if cosmos3_match is not None:
                    _check_signature(text, plain["text_cache_signature"], *cosmos3_match)
                    plain["text_reasoner_component"] = cosmos3_match[1]
            else:
                tensors, plain = split_tensors(embeds, text)
                tensors, plain = {f"text_{k}": v for k, v in tensors.items()}, {f"text_{k}": v for k, v in plain.items()}
            fields.update(tensors)
            info.update(plain)
        return fields, info
    return load


def _latent(obj, path: str) -> torch.Tensor:
    """The latent of a VAE cache file: the tensor, or a dict's ``latents`` (audio models)."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, dict) and isinstance(obj.get("latents"), torch.Tensor):
        return obj["latents"]
    raise fail(path, "a latent tensor or a dict with 'latents'", _describe(obj))


def _check_signature(text: str, stored: str, expected: str, component: str) -> None:
    """The signature inside a cosmos3 text file is the one its name was made of (cosmos3/model.py
    ``_predict_single_sample`` refuses a cache whose signature is not the sample's)."""
    if stored != expected:
        raise TrainerCacheError(f"{text}: expected the cosmos3 cache_signature its name is made of ({expected}, reasoner "
                                f"component {component}), found {stored}: a renamed or rewritten file")


def _describe(obj) -> str:
    return f"a dict of {sorted(map(str, obj))}" if isinstance(obj, dict) else f"a {type(obj).__name__}"
