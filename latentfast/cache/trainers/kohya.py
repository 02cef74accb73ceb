"""kohya-ss sd-scripts: ``{stem}_{W:04d}x{H:04d}_{arch}.npz`` latent caches beside the images.

As its strategies write them (``library/strategy_base.py`` ``LatentsCachingStrategy.save_latents_to_disk``):
arrays ``latents``, ``original_size``, ``crop_ltrb`` and optionally ``latents_flipped``, ``alpha_mask``;
for the multi-resolution architectures (flux, sd3, lumina, hi, anima) each name ends in the latent size
``_{h}x{w}`` and one file holds every bucket the image was cached at. The legacy ``{stem}.npz`` (sd /
sdxl) is read too. Text-encoder outputs (``{stem}_te_outputs.npz``, ``{stem}_flux_te.npz``, ...) are
matched by stem, as ``get_outputs_npz_path`` names them.

Records: fields ``latent``, ``latent_flipped``, ``alpha_mask`` and ``text_{array}`` for every array of
the text file (``text_hidden_state1``, ``text_t5_out``, ...); info ``original_size``, ``crop_ltrb``,
``latent_hw``, ``image_size`` (``[W, H]`` from the name), ``arch`` and the text file's 0-d arrays as
``text_{name}`` (``text_apply_t5_attn_mask``). Several buckets of one image: ``{stem}@{h}x{w}``.
kohya sets ``flip_aug`` and ``alpha_mask`` per subset (library/train_util.py ``BaseDataset.__getitem__``:
``flipped = subset.flip_aug and random.random() < 0.5``; ``cache_latents`` caches the flipped latent for
those subsets only), and an image may lack its text file, so one folder may hold items without
``latents_flipped``, ``alpha_mask`` or a text file: each is an item without that field
(``source.lacking`` lists them; the import keeps the field optional, and ``read_batch(flip=)`` flips only
items that have one, as kohya flips only flip_aug subsets).
"""
from __future__ import annotations

import os
import re

import numpy as np

from .common import (DEFAULT_MAX_ITEM_BYTES, ItemPlan, Lack, Skipped, Source, TrainerCacheError, array_to_tensor,
                     check_root, fail, npz_member_bytes, rel_key, truncated_or, walk_files)

LATENT_NAME = re.compile(r"^(?P<stem>.+)_(?P<w>\d{4,})x(?P<h>\d{4,})_(?P<arch>sd|sdxl|flux|sd3|lumina|hi|anima)\.npz$")
# text-encoder cache suffix per architecture (each strategy's *_TEXT_ENCODER_OUTPUTS_NPZ_SUFFIX)
TE_SUFFIX = {"sd": "_te_outputs.npz", "sdxl": "_te_outputs.npz", "legacy": "_te_outputs.npz", "flux": "_flux_te.npz",
             "sd3": "_sd3_te.npz", "lumina": "_lumina_te.npz", "hi": "_hi_te.npz", "anima": "_anima_te.npz"}
MULTI_RESOLUTION = {"flux", "sd3", "lumina", "hi", "anima"}
ENTRY = re.compile(r"^(?P<what>latents_flipped|latents|original_size|crop_ltrb|alpha_mask)(?:_(?P<h>\d+)x(?P<w>\d+))?$")
FIELD = {"latents": "latent", "latents_flipped": "latent_flipped", "alpha_mask": "alpha_mask"}
# What the cached latents are, per architecture (from each strategy's encode_by_vae and the VAE it calls).
CONVENTION = {
    "sd": ("raw", 0.18215, None), "sdxl": ("raw", 0.13025, None), "legacy": ("raw", None, None),
    "flux": ("scaled", 0.3611, 0.1159),  # library/flux_models.py AutoEncoder.encode applies scale/shift
    "sd3": ("raw", 1.5305, 0.0609),  # library/sd3_models.py SDVAE.encode; process_in runs at train time
    "lumina": ("scaled", 0.3611, 0.1159),  # Lumina caches with the Flux AutoEncoder
    "hi": ("scaled", None, None), "anima": ("scaled", None, None),  # the VAE normalizes inside encode
}


def scan(folder, arch: str | None = None, max_item_bytes: int = DEFAULT_MAX_ITEM_BYTES) -> Source:
    """A :class:`Source` of every kohya latent cache under ``folder``; ``arch`` picks one when several are there."""
    root = check_root(folder)
    latents, texts, skipped = {}, set(), []
    for dirpath, name in walk_files(root):
        path = os.path.join(dirpath, name)
        if any(name.endswith(s) for s in set(TE_SUFFIX.values())):
            texts.add(path)
            continue
        m = LATENT_NAME.match(name)
        if m:
            latents.setdefault(m["arch"], []).append((dirpath, m["stem"], path, (int(m["w"]), int(m["h"]))))
        elif name.endswith(".npz"):
            latents.setdefault("legacy", []).append((dirpath, name[:-4], path, None))
        else:
            skipped.append(Skipped(path, "files that are not kohya .npz caches"))
    _merge_legacy(latents, skipped)
    arch = _pick_arch(root, latents, arch)
    plans, used, no_text = [], set(), 0
    for dirpath, stem, path, size in latents.get(arch, []):
        if size is None and "latents" not in npz_member_bytes(path):
            skipped.append(Skipped(path, ".npz files that are not latent caches (no array 'latents')"))
            continue
        te_path = os.path.join(dirpath, stem) + TE_SUFFIX[arch]
        te_path = te_path if te_path in texts else None
        used.add(te_path)
        new = _plans_for_file(root, dirpath, stem, path, size, arch, te_path, skipped)
        no_text += len(new) if te_path is None else 0
        plans.extend(plan._replace(lacks=(*plan.lacks, Lack("text_*", os.path.join(dirpath, stem) + TE_SUFFIX[arch])))
                     if te_path is None else plan for plan in new)
    for other, files in latents.items():
        if other != arch:
            skipped.extend(Skipped(p, f"latent files of architecture {other!r} (pass arch={other!r})") for *_, p, _ in files)
    skipped.extend(Skipped(p, "text-encoder outputs without a latent file") for p in sorted(texts) if p not in used)
    # (items without a text file while others have one are listed by source.lacking: a field kept optional)
    notes = [f"{no_text} items have no text-encoder outputs"] if no_text and no_text == len(plans) else []
    kind, scale, shift = CONVENTION[arch]
    evidence = f"{sum(len(v) for v in latents.values())} .npz latent files ({arch})"
    return Source("kohya", root, plans, skipped, {"latent_convention": kind, "scaling_factor": scale, "shift_factor": shift},
                  evidence=evidence, notes=notes, max_item_bytes=max_item_bytes)


def iter_records(folder, **options):
    """The records of :func:`scan` ``(folder, **options)``."""
    return iter(scan(folder, **options))


def _merge_legacy(latents: dict, skipped: list) -> None:
    """Legacy ``{stem}.npz`` files belong to an sd / sdxl cache beside them; where both exist for an
    image, kohya reads the legacy one (``SdSdxlLatentsCachingStrategy.get_latents_npz_path``)."""
    others = set(latents) - {"legacy"}
    if "legacy" not in latents or len(others) != 1 or not others <= {"sd", "sdxl"}:
        return
    (arch,) = others
    old = {(d, stem) for d, stem, _, _ in latents["legacy"]}
    kept = []
    for entry in latents[arch]:
        if (entry[0], entry[1]) in old:
            skipped.append(Skipped(entry[2], "latent files superseded by a legacy {stem}.npz (kohya reads that one)"))
        else:
            kept.append(entry)
    latents[arch] = sorted(kept + latents.pop("legacy"), key=lambda e: e[2])


def _pick_arch(root: str, latents: dict, arch: str | None) -> str:
    if arch is not None:
        if arch not in latents:
            raise TrainerCacheError(f"{root} holds no kohya latent files of arch {arch!r}; it holds {sorted(latents) or 'none'}")
        return arch
    if not latents:
        raise TrainerCacheError(f"{root} holds no kohya latent caches (expected files named "
                                "{stem}_{W:04d}x{H:04d}_{sd|sdxl|flux|sd3|lumina|hi|anima}.npz or {stem}.npz)")
    if len(latents) > 1:
        raise TrainerCacheError(f"{root} holds kohya latents of several architectures {sorted(latents)}; pass arch=")
    return next(iter(latents))


def _plans_for_file(root, dirpath, stem, path, image_size, arch, te_path, skipped) -> list[ItemPlan]:
    """One plan per bucket (key suffix) of one latent file; unknown arrays are listed as skipped."""
    sizes = npz_member_bytes(path)
    groups: dict[str, dict[str, str]] = {}
    for name in sizes:
        m = ENTRY.match(name)
        multi = m is not None and (m["h"] is not None) == (arch in MULTI_RESOLUTION)
        if not multi:
            skipped.append(Skipped(f"{path}#{name}", "arrays kohya's loader does not read"))
            continue
        groups.setdefault(f"{m['h']}x{m['w']}" if m["h"] else "", {})[m["what"]] = name
    te_bytes = sum(npz_member_bytes(te_path).values()) if te_path else 0
    plans = []
    for suffix, names in groups.items():
        if "latents" not in names:
            skipped.extend(Skipped(f"{path}#{n}", "arrays of a bucket with no latents") for n in names.values())
            continue
        nbytes = sum(sizes[n] for n in names.values()) + te_bytes
        load = _loader(path, names, te_path, {"arch": arch, "image_size": list(image_size) if image_size else None})
        # flip_aug and alpha_mask are set per subset: one folder may hold items with and without them
        lacks = tuple(Lack(FIELD[what], f"{path}#{what}" + (f"_{suffix}" if suffix else ""))
                      for what in ("latents_flipped", "alpha_mask") if what not in names)
        plans.append(ItemPlan(rel_key(root, dirpath, stem), suffix, nbytes, load, lacks))
    if not plans:
        raise fail(path, "a kohya latent cache (arrays latents[_{h}x{w}], original_size, crop_ltrb)",
                   f"arrays {sorted(sizes)}")
    return plans


def _loader(path: str, names: dict[str, str], te_path: str | None, base_info: dict):
    def load(path=path, names=names, te_path=te_path, base_info=base_info):
        fields, info = {}, dict(base_info)
        with _open_npz(path) as npz:
            for what, name in names.items():
                if what in FIELD:
                    fields[FIELD[what]] = array_to_tensor(_member(npz, path, name), path, name)
                else:
                    info[what] = _member(npz, path, name).tolist()
        info["latent_hw"] = list(fields["latent"].shape[-2:])
        if te_path is not None:
            with _open_npz(te_path) as npz:
                for name in npz.files:
                    array = _member(npz, te_path, name)
                    if array.ndim == 0:
                        info[f"text_{name}"] = array.item()
                    else:
                        fields[f"text_{name}"] = array_to_tensor(array, te_path, name)
        return fields, info
    return load


def _member(npz, path: str, name: str) -> np.ndarray:
    """Array ``name`` of an open archive; a member that cannot be read (a failed CRC, a damaged header) is named."""
    try:
        return npz[name]
    except Exception as exc:  # noqa: BLE001 - named by file and array
        raise fail(f"{path}#{name}", "an .npy array", f"{type(exc).__name__}: {exc}") from None


def _open_npz(path: str):
    try:
        return np.load(path, allow_pickle=False)
    except Exception as exc:  # noqa: BLE001 - named by file
        raise fail(path, "an .npz archive", truncated_or(path, f"{type(exc).__name__}: {exc}")) from None
