"""Trainers' own cache folders read as records, one module per trainer.

``open_source(folder, format)`` -> :class:`~.common.Source`: iterate it for
:class:`~.common.Record` ``(key, fields, info)`` -- every field a tensor of its own dtype and
shape (the latent, its flipped copy, extra latents, masks, the item's text-encoder outputs as
``text_*``), info JSON-able (sizes, crops, file metadata, ``latent_convention``); ``source.skipped``
and ``source.summary()`` say what is not imported. ``format="auto"`` takes :func:`detect`'s answer.
Each module's docstring lists its fields and info keys; keys are the source image's stem below the
folder, ``stem@variant`` where one image gives several items (see :func:`~.common.unique_keys`).
"""
from __future__ import annotations

import os
import re
import zipfile

from . import ai_toolkit, diffusion_pipe, kohya, musubi_tuner, simpletuner
from .common import DEFAULT_MAX_ITEM_BYTES, Record, Skipped, Source, TrainerCacheError, check_root, walk_files

READERS = {"kohya": kohya, "musubi-tuner": musubi_tuner, "ai-toolkit": ai_toolkit, "simpletuner": simpletuner,
           "diffusion-pipe": diffusion_pipe}
FORMATS = tuple(READERS)
KOHYA_TE = re.compile(r"_(te_outputs|flux_te|sd3_te|lumina_te|hi_te|anima_te)\.npz$")

__all__ = ["FORMATS", "DEFAULT_MAX_ITEM_BYTES", "Record", "Skipped", "Source", "TrainerCacheError", "detect",
           "open_source", "iter_records"]


def detect(folder) -> tuple[str, str]:
    """``(format, evidence)``: which trainer wrote the cache under ``folder``, and what says so."""
    root = check_root(folder)
    found = {name: [] for name in READERS}
    for dirpath, name in walk_files(root):
        where = os.path.basename(dirpath)
        if name == "metadata.db" and os.path.basename(os.path.dirname(dirpath)).startswith("cache_"):
            found["diffusion-pipe"].append(os.path.join(dirpath, name))
        elif where in ("_latent_cache", "_t_e_cache") and name.endswith(".safetensors"):
            found["ai-toolkit"].append(name)
        elif musubi_tuner.LATENT_NAME.match(name) or musubi_tuner.TEXT_NAME.match(name):
            found["musubi-tuner"].append(name)
        elif kohya.LATENT_NAME.match(name) or KOHYA_TE.search(name) or _legacy_kohya(os.path.join(dirpath, name)):
            found["kohya"].append(name)
        elif name.endswith(".pt"):
            found["simpletuner"].append(name)
    hits = {k: v for k, v in found.items() if v}
    if len(hits) != 1:
        what = "; ".join(f"{k}: {len(v)} files such as {v[0]}" for k, v in hits.items()) or "no trainer's cache files"
        raise TrainerCacheError(f"{root}: expected one trainer's cache to detect, found {what}; pass format=")
    (fmt, files), = hits.items()
    return fmt, f"{len(files)} {fmt} cache files such as {os.path.basename(files[0])}"


def _legacy_kohya(path: str) -> bool:
    """A legacy kohya (sd / sdxl) latent cache ``{stem}.npz``: an archive holding an array ``latents``
    (what ``SdSdxlLatentsCachingStrategy`` reads from ``{stem}.npz``), told by its zip directory alone."""
    if not path.endswith(".npz"):
        return False
    try:
        with zipfile.ZipFile(path) as archive:
            return "latents.npy" in archive.namelist()
    except (OSError, zipfile.BadZipFile):
        return False  # (not detected; a kohya import names the file)


def open_source(folder, format: str = "auto", **options) -> Source:
    """The :class:`Source` of ``folder`` read as ``format`` (one of :data:`FORMATS`, or ``"auto"``).

    ``options`` go to that trainer's ``scan`` (``arch=`` for kohya, ``architecture=`` for
    musubi-tuner, ``images=`` / ``captions=`` / ``model_type=`` / ``scaling_factor=`` for SimpleTuner,
    ``max_item_bytes=`` for all).
    """
    evidence = None
    if format == "auto":
        format, evidence = detect(folder)
    if format not in READERS:
        raise TrainerCacheError(f"format must be one of {list(FORMATS)} or 'auto', got {format!r}")
    source = READERS[format].scan(folder, **options)
    if evidence:
        source.evidence = f"detected {format}: {evidence}; {source.evidence}"
    return source


def iter_records(folder, format: str = "auto", **options):
    """The records of :func:`open_source` ``(folder, format, **options)``."""
    return iter(open_source(folder, format, **options))
