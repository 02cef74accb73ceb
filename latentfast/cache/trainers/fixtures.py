"""Small random caches written the way each trainer's current save code writes them (for tests and benches).

Each writer follows the save path it names (repository, file, function) at the commits read for this
module: kohya-ss/sd-scripts 48d368f, kohya-ss/musubi-tuner 30c658c, ostris/ai-toolkit 27a03a9,
bghira/SimpleTuner bc8e6ab, tdrussell/diffusion-pipe 8f83dbf. Only the encoders are replaced by
random tensors; names, keys, dtypes, metadata and file layouts are the trainers'. Every writer returns
the list of image stems it cached (ai-toolkit: what its loader hashes, see there), and takes ``seed``
so two calls write the same bytes.
"""
from __future__ import annotations

import base64
import gzip
import hashlib
import io
import json
import os
import sqlite3
from collections import OrderedDict

import numpy as np
import torch
from ..builders.importers import import_latents
from ..store.opening import LatentCache
from . import Record, open_source

from . import simpletuner_cosmos3 as cosmos3


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=g).to(dtype)


# ---------------------------------------------------------------- kohya-ss/sd-scripts

def kohya_save_latents_to_disk(npz_path, latents_tensor, original_size, crop_ltrb, flipped_latents_tensor=None,
                               alpha_mask=None, key_reso_suffix=""):
    """library/strategy_base.py ``LatentsCachingStrategy.save_latents_to_disk``: update-in-place np.savez."""
    kwargs = {}
    if os.path.exists(npz_path):
        npz = np.load(npz_path)
        for key in npz.files:
            kwargs[key] = npz[key]
    kwargs["latents" + key_reso_suffix] = latents_tensor.float().cpu().numpy()
    kwargs["original_size" + key_reso_suffix] = np.array(original_size)
    kwargs["crop_ltrb" + key_reso_suffix] = np.array(crop_ltrb)
    if flipped_latents_tensor is not None:
        kwargs["latents_flipped" + key_reso_suffix] = flipped_latents_tensor.float().cpu().numpy()
    if alpha_mask is not None:
        kwargs["alpha_mask" + key_reso_suffix] = alpha_mask.float().cpu().numpy()
    np.savez(npz_path, **kwargs)


def _kohya_te_arrays(arch: str, g, length: int) -> dict:
    """Each ``*TextEncoderOutputsCachingStrategy.cache_batch_outputs`` np.savez keyword set (bf16 -> float32 first)."""
    f32 = lambda *s: _randn(g, *s).numpy()  # noqa: E731
    ints = lambda *s: torch.randint(0, 2, s, generator=g).numpy()  # noqa: E731 - tokenizer masks are int64
    if arch in ("sd", "sdxl", "legacy"):  # strategy_sdxl.py SdxlTextEncoderOutputsCachingStrategy
        return dict(hidden_state1=f32(length, 12), hidden_state2=f32(length, 20), pool2=f32(20))
    if arch == "flux":  # strategy_flux.py FluxTextEncoderOutputsCachingStrategy
        return dict(l_pooled=f32(12), t5_out=f32(length, 16), txt_ids=np.zeros((length, 3), np.float32),
                    t5_attn_mask=ints(length), apply_t5_attn_mask=False)
    if arch == "sd3":  # strategy_sd3.py Sd3TextEncoderOutputsCachingStrategy
        return dict(lg_out=f32(length, 16), lg_pooled=f32(20), t5_out=f32(length, 16), clip_l_attn_mask=ints(length),
                    clip_g_attn_mask=ints(length), t5_attn_mask=ints(length), apply_lg_attn_mask=True, apply_t5_attn_mask=True)
    if arch == "lumina":  # strategy_lumina.py LuminaTextEncoderOutputsCachingStrategy
        return dict(hidden_state=f32(length, 16), attention_mask=ints(length), input_ids=ints(length))
    if arch == "hi":  # strategy_hunyuan_image.py HunyuanImageTextEncoderOutputsCachingStrategy
        return dict(vlm_embed=f32(length, 16), vlm_mask=ints(length), byt5_embed=f32(length, 8), byt5_mask=ints(length),
                    ocr_mask=np.array([False]))
    if arch == "anima":  # strategy_anima.py AnimaTextEncoderOutputsCachingStrategy
        return dict(prompt_embeds=f32(length, 16), attn_mask=ints(length), t5_input_ids=ints(length).astype(np.int32),
                    t5_attn_mask=ints(length).astype(np.int32), caption_dropout_rate=torch.tensor(0.1, dtype=torch.float32))
    raise ValueError(arch)


KOHYA_TE_SUFFIX = {"sd": "_te_outputs.npz", "sdxl": "_te_outputs.npz", "legacy": "_te_outputs.npz", "flux": "_flux_te.npz",
                   "sd3": "_sd3_te.npz", "lumina": "_lumina_te.npz", "hi": "_hi_te.npz", "anima": "_anima_te.npz"}


def write_kohya(folder, arch: str = "flux", n: int = 3, flip: bool = True, alpha: bool = True, buckets: int = 2,
                text: bool = True, seed: int = 0, without_text=()) -> list[str]:
    """kohya-ss/sd-scripts caches of ``n`` images of mixed sizes beside their (absent) images.

    Latents: ``LatentsCachingStrategy._default_cache_batch_latents`` -> ``save_latents_to_disk``
    (library/strategy_base.py) into ``get_latents_npz_path`` of each strategy
    (``{stem}_{W:04d}x{H:04d}{suffix}``, library/strategy_{sd,flux,sd3,lumina,hunyuan_image,anima}.py;
    ``{stem}.npz`` for ``arch="legacy"``); for the multi-resolution architectures each of ``buckets``
    bucket resolutions adds its ``_{h}x{w}`` keys to the same file. Text: each strategy's
    ``cache_batch_outputs`` np.savez into ``get_outputs_npz_path`` (``{stem}{TE suffix}``), except for
    the images numbered in ``without_text`` (whose outputs were never cached). ``flip`` and ``alpha``
    are one subset's ``flip_aug`` and ``alpha_mask``: write each subset into its own image folder.
    """
    os.makedirs(folder, exist_ok=True)
    g, stems = _gen(seed), []
    multi = arch in ("flux", "sd3", "lumina", "hi", "anima")
    stride, channels = (32, 64) if arch == "hi" else (8, 16 if multi else 4)
    for i in range(n):
        stem = f"img_{i:03d}"
        width, height = 64 + 8 * i + 3, 48 + 16 * i  # original image size, as in the file name
        if arch == "legacy":
            path = os.path.join(folder, f"{stem}.npz")
        else:
            suffix = {"sd": "_sd.npz", "sdxl": "_sdxl.npz", "hi": "_hi.npz"}.get(arch, f"_{arch}.npz")
            path = os.path.join(folder, f"{stem}_{width:04d}x{height:04d}{suffix}")
        for b in range(buckets if multi else 1):
            bw, bh = 8 * stride * (1 + b + i % 2), 8 * stride * (1 + b)  # bucket_reso (W, H)
            h, w = bh // stride, bw // stride
            shape = (channels, 1, h, w) if arch == "anima" else (channels, h, w)  # anima's Qwen VAE keeps a frame axis
            mask = torch.rand(bh, bw, generator=g) if alpha else None
            kohya_save_latents_to_disk(path, _randn(g, *shape, dtype=torch.bfloat16), (width, height), (0, 0, bw, bh),
                                       _randn(g, *shape, dtype=torch.bfloat16) if flip else None, mask,
                                       f"_{h}x{w}" if multi else "")
        if text and i not in without_text:
            np.savez(os.path.join(folder, stem + KOHYA_TE_SUFFIX[arch]), **_kohya_te_arrays(arch, g, 5 + i))
        stems.append(stem)
    return stems


# ---------------------------------------------------------------- kohya-ss/musubi-tuner

def _dtype_str(dtype: torch.dtype) -> str:
    """src/musubi_tuner/utils/model_utils.py ``dtype_to_str``."""
    return str(dtype).split(".")[-1]


def musubi_save_latent_cache_common(path, sd, arch_fullname, original_size, frame_count=None):
    """src/musubi_tuner/dataset/cache_io.py ``save_latent_cache_common``."""
    from safetensors.torch import save_file

    metadata = {"architecture": arch_fullname, "width": f"{original_size[0]}", "height": f"{original_size[1]}",
                "format_version": "1.0.1"}
    if frame_count is not None:
        metadata["frame_count"] = f"{frame_count}"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(sd, path, metadata=metadata)


def musubi_save_text_encoder_output_cache_common(path, sd, arch_fullname, caption):
    """cache_io.py ``save_text_encoder_output_cache_common`` (fresh file; its writer
    ``safetensors_utils.mem_eff_save_file`` writes the same format as ``save_file``)."""
    from safetensors.torch import save_file

    save_file(sd, path, metadata={"architecture": arch_fullname, "caption1": caption, "format_version": "1.0.1"})


def _musubi_latents(kind: str, g, F: int, H: int, W: int) -> dict:
    """The state dict of cache_io.py ``save_latent_cache_wan`` / ``_framepack`` / ``_flux_kontext`` / ``_qwen_image`` / ``save_latent_cache``."""
    bf = torch.bfloat16
    s = _dtype_str(bf)
    if kind == "wan_i2v":
        return {f"latents_{F}x{H}x{W}_{s}": _randn(g, 16, F, H, W, dtype=bf), f"clip_{s}": _randn(g, 257, 32, dtype=bf),
                f"latents_image_{F}x{H}x{W}_{s}": _randn(g, 20, F, H, W, dtype=bf)}
    if kind == "framepack":
        ints = torch.int64
        return {f"latents_{F}x{H}x{W}_{s}": _randn(g, 16, F, H, W, dtype=bf), f"image_embeddings_{s}": _randn(g, 9, 16, dtype=bf),
                f"latent_indices_{_dtype_str(ints)}": torch.arange(F, dtype=ints)[None],
                f"clean_latent_indices_{_dtype_str(ints)}": torch.tensor([[0, F + 1]], dtype=ints),
                f"latents_clean_{F}x{H}x{W}_{s}": _randn(g, 16, 2, H, W, dtype=bf),
                f"clean_latent_2x_indices_{_dtype_str(ints)}": torch.tensor([[F + 2, F + 3]], dtype=ints),
                f"latents_clean_2x_{F}x{H}x{W}_{s}": _randn(g, 16, 2, H, W, dtype=bf),
                f"clean_latent_4x_indices_{_dtype_str(ints)}": torch.arange(F + 4, F + 8, dtype=ints)[None],
                f"latents_clean_4x_{F}x{H}x{W}_{s}": _randn(g, 16, 4, H, W, dtype=bf)}
    if kind == "flux_kontext":
        return {f"latents_1x{H}x{W}_{s}": _randn(g, 16, H, W, dtype=bf),
                f"latents_control_1x{H + 2}x{W}_{s}": _randn(g, 16, H + 2, W, dtype=bf)}
    if kind == "qwen_image_edit":
        return {f"latents_{F}x{H}x{W}_{s}": _randn(g, 16, F, H, W, dtype=bf),
                **{f"latents_control_{i}_1x{H + i}x{W}_{s}": _randn(g, 16, 1, H + i, W, dtype=bf) for i in range(2)}}
    if kind == "hunyuan_video":
        return {f"latents_{F}x{H}x{W}_{s}": _randn(g, 16, F, H, W, dtype=torch.float16)}
    raise ValueError(kind)


def _musubi_text(kind: str, g, length: int) -> dict:
    """cache_io.py ``save_text_encoder_output_cache_wan`` / ``_framepack`` / ``_flux_kontext`` / ``_qwen_image`` / ``save_text_encoder_output_cache``."""
    bf = torch.bfloat16
    s = _dtype_str(bf)
    if kind == "wan_i2v":
        return {f"varlen_t5_{s}": _randn(g, length, 32, dtype=bf)}
    if kind == "framepack":
        return {f"llama_vec_{s}": _randn(g, 12, 32, dtype=bf), "llama_attention_mask": torch.arange(12) < length,
                f"clip_l_pooler_{s}": _randn(g, 24, dtype=bf)}
    if kind == "flux_kontext":
        return {f"t5_vec_{s}": _randn(g, 12, 32, dtype=bf), f"clip_l_pooler_{s}": _randn(g, 24, dtype=bf)}
    if kind == "qwen_image_edit":
        return {f"varlen_vl_embed_{s}": _randn(g, length, 32, dtype=bf)}
    if kind == "hunyuan_video":  # two passes (llm, then clipL) merged into one file
        return {f"llm_{_dtype_str(torch.float16)}": _randn(g, 12, 32, dtype=torch.float16), "llm_mask": torch.arange(12) < length,
                f"clipL_{_dtype_str(torch.float16)}": _randn(g, 24, dtype=torch.float16)}
    raise ValueError(kind)


MUSUBI_ARCH = {"wan_i2v": ("wan", "wan"), "framepack": ("fp", "framepack"), "flux_kontext": ("fk", "flux_kontext"),
               "qwen_image_edit": ("qi", "qwen_image"), "hunyuan_video": ("hv", "hunyuan_video")}


def write_musubi(folder, kind: str = "wan_i2v", n: int = 3, windows: int = 2, seed: int = 0,
                 buckets: int | None = None) -> list[str]:
    """A musubi-tuner ``cache_directory`` of ``n`` items (mixed bucket sizes: each its own, or ``buckets``
    sizes in turn) and their text-encoder files.

    Latents: ``ImageDataset``/``VideoDataset.get_latent_cache_path`` names
    (src/musubi_tuner/dataset/image_video_dataset.py; video item keys ``{body}_{pos:05d}-{count:03d}``,
    ``windows`` per video for ``kind="hunyuan_video"``) and the ``save_latent_cache_*`` state dicts of
    src/musubi_tuner/dataset/cache_io.py; text: ``get_text_encoder_output_cache_path``
    (``{item}_{arch}_te.safetensors``) and ``save_text_encoder_output_cache_*``.
    ``kind``: ``wan_i2v`` (clip + image latents), ``framepack`` (clean latents + int64 indices),
    ``flux_kontext`` / ``qwen_image_edit`` (control latents), ``hunyuan_video`` (video windows, fp16).
    """
    os.makedirs(folder, exist_ok=True)
    g, (arch, arch_full), stems = _gen(seed), MUSUBI_ARCH[kind], []
    video = kind == "hunyuan_video"
    for i in range(n):
        b = i if buckets is None else i % buckets
        stem, size = f"clip_{i:03d}" if video else f"img_{i:03d}", (96 + 16 * b, 80 + 8 * b)
        F, H, W = (5 if video else 1), 4 + 2 * (b % 2), 6 + 2 * b
        for w in range(windows if video else 1):
            key = f"{stem}_{w * 17:05d}-{17:03d}" if video else stem
            path = os.path.join(folder, f"{key}_{size[0]:04d}x{size[1]:04d}_{arch}.safetensors")
            musubi_save_latent_cache_common(path, _musubi_latents(kind, g, F, H, W), arch_full, size,
                                            frame_count=17 if video else None)
        musubi_save_text_encoder_output_cache_common(os.path.join(folder, f"{stem}_{arch}_te.safetensors"),
                                                     _musubi_text(kind, g, 3 + 2 * i), arch_full, f"caption {i}")
        stems.append(stem)
    return stems


# ---------------------------------------------------------------- ostris/ai-toolkit

def ai_toolkit_hash(info: OrderedDict) -> str:
    """toolkit/dataloader_mixins.py ``get_latent_path`` / ``_build_text_embedding_path``: urlsafe b64 md5 of the JSON."""
    digest = hashlib.md5(json.dumps(info, sort_keys=True).encode("utf-8")).digest()
    return base64.urlsafe_b64encode(digest).decode("ascii").replace("=", "")


def ai_toolkit_meta(info: OrderedDict) -> OrderedDict:
    """toolkit/metadata.py ``get_meta_for_safetensors`` (software_meta of info.py)."""
    meta = json.loads(json.dumps(info), object_pairs_hook=OrderedDict)
    meta["software"] = OrderedDict(name="ai-toolkit", repo="https://github.com/ostris/ai-toolkit", version="0.7.0")
    for key, value in meta.items():
        if not isinstance(value, str):
            meta[key] = json.dumps(value)
    meta["format"] = "pt"
    return meta


def _latent_to_uint8(latent: torch.Tensor) -> torch.Tensor:
    """toolkit/dataloader_mixins.py ``_latent_to_uint8``."""
    return ((latent.float().clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8)


def ai_toolkit_prompt_embeds_save(path, text_embeds, pooled_embeds=None, attention_mask=None):
    """toolkit/prompt_utils.py ``PromptEmbeds.save``."""
    from safetensors.torch import save_file

    state_dict = {}
    if isinstance(text_embeds, (list, tuple)):
        for i, text_embed in enumerate(text_embeds):
            state_dict[f"text_embed_{i}"] = text_embed.cpu()
    else:
        state_dict["text_embed"] = text_embeds.cpu()
    if pooled_embeds is not None:
        state_dict["pooled_embed"] = pooled_embeds.cpu()
    if attention_mask is not None:
        state_dict["attention_mask"] = attention_mask.cpu()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file(state_dict, path)


def ai_toolkit_anima_prompt_embeds_save(path, qwen_prompt_embeds, t5_input_ids, qwen_attention_mask, t5_attention_mask):
    """extensions_built_in/diffusion_models/anima/anima.py ``AnimaPromptEmbeds.save``."""
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_file({"qwen_prompt_embeds": qwen_prompt_embeds.cpu(), "qwen_attention_mask": qwen_attention_mask.cpu(),
               "t5_input_ids": t5_input_ids.cpu(), "t5_attention_mask": t5_attention_mask.cpu()},
              path, metadata={"class_name": "AnimaPromptEmbeds"})


def write_ai_toolkit(folder, n: int = 3, resolutions=(256, 384), flip_x: bool = True, uint8: bool = False,
                     dropout: bool = True, seed: int = 0, text_class: str = "PromptEmbeds", text: bool = True) -> list[dict]:
    """An ai-toolkit dataset folder's ``_latent_cache`` and ``_t_e_cache`` (images not written).

    Returns, per image, what the trainer hashes to find its files: ``{"stem", "latent_infos": [the
    get_latent_info_dict of each file], "te_infos": [the get_text_embedding_info_dict of each]}``.

    Latents: ``LatentCachingMixin._cache_one_latent`` (toolkit/dataloader_mixins.py) -> ``save_file``
    with ``get_meta_for_safetensors(get_latent_info_dict())`` at ``get_latent_path``; one file per
    resolution and per ``flip_x`` copy; ``uint8`` as with ``cache_latents_as_uint8`` (``_latent_to_uint8``).
    Text: ``TextEmbeddingCachingMixin.cache_text_embeddings`` -> ``PromptEmbeds.save`` at
    ``get_text_embedding_path`` and, with ``dropout`` (caption_dropout_rate > 0), the blank caption's
    embedding at ``get_blank_text_embedding_path``; ``text_class="AnimaPromptEmbeds"`` as the Anima
    model caches them (``AnimaModel.get_prompt_embeds``: Qwen hidden states in bf16, their mask, and the
    T5 tokenizer's ids and mask, each ``padding="longest"``, int64) through ``AnimaPromptEmbeds.save``.
    ``text=False``: a dataset without ``cache_text_embeddings`` (no ``_t_e_cache``). ``flip_x`` is the
    dataset's: one folder per dataset.
    """
    g, manifest = _gen(seed), []
    for i in range(n):
        stem, filename = f"img_{i:03d}", f"img_{i:03d}.jpg"
        entry = {"stem": stem, "latent_infos": [], "te_infos": []}
        for res in resolutions:
            for flipped in ((False, True) if flip_x else (False,)):
                width, height = res + 64 * (i % 2), res
                info = OrderedDict([("filename", filename), ("scale_to_width", width), ("scale_to_height", height),
                                    ("crop_x", 0), ("crop_y", 4 * i), ("crop_width", width), ("crop_height", height),
                                    ("latent_space_version", "flux"), ("latent_version", 1)])
                if flipped:
                    info["flip_x"] = True
                entry["latent_infos"].append(info)
                latent = torch.tanh(_randn(g, 16, height // 8, width // 8)).to(torch.bfloat16)
                state_dict = OrderedDict(latent=_latent_to_uint8(latent) if uint8 else latent.clone())
                path = os.path.join(folder, "_latent_cache", f"{stem}_{ai_toolkit_hash(info)}.safetensors")
                os.makedirs(os.path.dirname(path), exist_ok=True)
                from safetensors.torch import save_file

                save_file(state_dict, path, metadata=ai_toolkit_meta(info))
        captions = ([f"a photo number {i}"] + ([""] if dropout else [])) if text else []
        for caption in captions:
            te_info = OrderedDict([("caption", caption), ("text_embedding_space_version", "flux"), ("text_embedding_version", 1)])
            entry["te_infos"].append(te_info)
            length = 4 + i if caption else 2
            te_path = os.path.join(folder, "_t_e_cache", f"{stem}_{ai_toolkit_hash(te_info)}.safetensors")
            if text_class == "AnimaPromptEmbeds":
                ai_toolkit_anima_prompt_embeds_save(te_path, _randn(g, 1, length, 32, dtype=torch.bfloat16),
                                                    torch.randint(0, 32000, (1, length + 1), generator=g),
                                                    torch.ones(1, length, dtype=torch.int64), torch.ones(1, length + 1, dtype=torch.int64))
                continue
            ai_toolkit_prompt_embeds_save(te_path, _randn(g, 1, length, 32, dtype=torch.bfloat16), _randn(g, 1, 24, dtype=torch.bfloat16),
                                          torch.ones(1, length, dtype=torch.int64))
        manifest.append(entry)
    return manifest


# ---------------------------------------------------------------- bghira/SimpleTuner

def simpletuner_torch_save(data, path: str, compress: bool):
    """helpers/data_backend/local.py ``LocalDataBackend.torch_save`` (+ base.py ``_compress_torch``)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        if compress:
            buffer = io.BytesIO()
            torch.save(data, buffer)
            with io.BytesIO() as compressed:
                with gzip.GzipFile(fileobj=compressed, mode="wb") as gz:
                    gz.write(buffer.getvalue())
                fh.write(compressed.getvalue())
        else:
            torch.save(data, fh)


def simpletuner_text_cache_name(caption: str, model_type: str, dataset_id: str | None = None, image_path=None,
                                instance_data_dir=None, signature: str | None = None) -> str:
    """helpers/caching/text_embeds.py ``TextEmbeddingCache.hash_prompt`` / ``create_hash`` of a caption key, or
    (``dataset_id``: ``TextEmbedCacheKey.DATASET_AND_FILENAME``) of the key helpers/training/collate.py
    builds, ``f"{data_backend_id}:{normalize_data_path(image_path, instance_data_dir)}"``, then the prompt;
    ``signature``: cosmos3's key, that key + ``f":cosmos3:{signature}"`` (cosmos3/model.py ``text_embed_cache_key_value``)."""
    if dataset_id is None:
        return hashlib.md5(str(caption).encode()).hexdigest() + f"-{model_type}.pt"
    abs_root = os.path.abspath(os.path.normpath(instance_data_dir))  # helpers/utils/pathing.py normalize_data_path
    relative = os.path.normcase(os.path.relpath(os.path.abspath(os.path.normpath(image_path)), abs_root))
    key = f"{dataset_id}:{relative}" if signature is None else f"{dataset_id}:{relative}:cosmos3:{signature}"
    md5_hash = hashlib.md5()
    md5_hash.update(str(key).encode())
    if caption:
        md5_hash.update(b"\0prompt\0")
        md5_hash.update(str(caption).encode())
    return md5_hash.hexdigest() + f"-{model_type}.pt"


def write_simpletuner(folder, images, n: int = 3, compress: bool = True, hash_filenames: bool = True,
                      model_type: str = "flux", seed: int = 0, buckets: int | None = None,
                      dataset_id: str | None = None) -> list[str]:
    """A SimpleTuner cache root (``vae/`` and ``text/``) and its ``images`` folder (tiny PNGs + ``.txt`` captions);
    latent sizes: each item its own, or ``buckets`` sizes in turn.

    Latents: ``VAECache.generate_vae_cache_filename`` names (helpers/caching/vae.py: ``sha256(stem)``
    with ``hash_filenames``) holding the per-sample latent that ``_write_latents_in_batch`` clones
    (after ``scale_vae_latents_for_cache``); text: ``TextEmbeddingCache.hash_prompt_with_path``
    (helpers/caching/text_embeds.py: ``md5(caption)-{model_type}.pt``) holding
    ``_slice_batch_output_for_cache``'s dict (prompt_embeds / attention_mask cut to the mask's length).
    Both through ``LocalDataBackend.torch_save``, gzip'd when ``compress`` (``compress_disk_cache``).
    ``dataset_id``: a model keying text by dataset and path (``TextEmbedCacheKey.DATASET_AND_FILENAME``:
    krea2 / longcat_image / qwen_image edit, ...), in SimpleTuner's default layout: latents in
    ``vae/{model_type}/{dataset_id}`` (data_backend/factory.py ``_default_vae_cache_dir``), text in
    ``text/{model_type}``, named by :func:`simpletuner_text_cache_name` of the dataset, path and caption.
    """
    from PIL import Image

    g, stems = _gen(seed), []
    os.makedirs(images, exist_ok=True)
    for i in range(n):
        stem, sub = f"img_{i:03d}", ("sub" if i % 2 else "")
        os.makedirs(os.path.join(images, sub), exist_ok=True)
        Image.new("RGB", (16 + 8 * i, 16), (i, 2 * i, 3 * i)).save(os.path.join(images, sub, stem + ".png"))
        # caption files as people write them: a trailing newline, spaces kept, several lines (SimpleTuner splits
        # on "\n", drops empty lines and embeds each caption; this fixture writes the first one's embedding)
        text = [f"a photo of thing {i}", f"a photo of thing {i}\n", f" a photo of thing {i} ",
                f"a photo of thing {i}\n\nanother caption\n"][i % 4]
        caption = next(line for line in text.split("\n") if line)
        with open(os.path.join(images, sub, stem + ".txt"), "w", encoding="utf-8") as fh:
            fh.write(text)
        name = hashlib.sha256(stem.encode()).hexdigest() if hash_filenames else stem
        latent = _randn(g, 16, 4 + (i if buckets is None else i % buckets), 6, dtype=torch.bfloat16)
        vae_dir, text_dir = ("vae", "text") if dataset_id is None else \
            (os.path.join("vae", model_type, dataset_id), os.path.join("text", model_type))
        simpletuner_torch_save(latent, os.path.join(folder, vae_dir, sub, name + ".pt"), compress)
        true_length, padded = 3 + i, 8
        embeds = {"prompt_embeds": _randn(g, 1, padded, 32, dtype=torch.bfloat16)[:, :true_length].clone().contiguous(),
                  "pooled_prompt_embeds": _randn(g, 24, dtype=torch.bfloat16),
                  "attention_mask": torch.ones(1, true_length, dtype=torch.int64)}
        text_name = simpletuner_text_cache_name(caption, model_type, dataset_id, os.path.join(images, sub, stem + ".png"), images)
        simpletuner_torch_save(embeds, os.path.join(folder, text_dir, text_name), compress)
        stems.append(f"{sub}/{stem}" if sub else stem)
    return stems


COSMOS3_CAPTIONS = ("a photo of thing 0", "a  photo of\tthing 1", '{"comprehensive_t2i_caption": "thing 2, in oil"}')


def cosmos3_reasoner_cache(g, length: int, layers: int, signature: str, k_for_gen: bool = False) -> dict:
    """One ``cosmos3_reasoner_cache`` as helpers/models/cosmos3/model.py ``_encode_prompts`` builds it (version 1),
    the reasoner replaced by random keys and values: ``_prepare_reasoner_text_segment``'s token segment (text
    mRoPE ids from pipeline.py ``get_3d_mrope_ids_text_tokens`` with float positions, the vision start offset
    with the 15000 modality margin) and reasoner.py ``Cosmos3Reasoner.forward``'s ``layer_kv`` (``k``, ``v``,
    ``k_for_gen`` where the layer normalizes the keys it gives the generator), in bfloat16 as the reasoner runs."""
    kv_heads, head_dim = 2, 4
    layer_kv = []
    for _ in range(layers):
        layer = {"k": _randn(g, length, kv_heads, head_dim, dtype=torch.bfloat16),
                 "v": _randn(g, length, kv_heads, head_dim, dtype=torch.bfloat16)}
        if k_for_gen:
            layer["k_for_gen"] = _randn(g, length, kv_heads, head_dim, dtype=torch.bfloat16)
        layer_kv.append(layer)
    return {"cache_version": 1, "cache_signature": signature,
            "input_ids": torch.randint(0, 151000, (length,), generator=g, dtype=torch.long),
            "text_indexes": torch.arange(length, dtype=torch.long),
            "und_len": torch.tensor(length, dtype=torch.long),
            "text_mrope_ids": torch.arange(length, dtype=torch.float32).unsqueeze(0).expand(3, -1).contiguous(),  # offset 0
            "vision_start_temporal_offset": torch.tensor(length + 15000, dtype=torch.float32),
            "reasoner_memory_state": {"layer_kv": layer_kv}}


def write_simpletuner_cosmos3(folder, images, n: int = 3, compress: bool = True, dataset_id: str = "train",
                              reasoner_component: str = cosmos3.REASONER_COMPONENTS[0], framerate: float = 24.0,
                              frames: int = 1, layers: int = 2, k_for_gen: bool = False, seed: int = 0) -> list[str]:
    """A SimpleTuner cosmos3 cache root in its default layout and its ``images`` folder (the dataset's
    instance_data_dir: PNGs, or ``frames > 1``: mp4 videos, with ``.txt`` captions, :data:`COSMOS3_CAPTIONS`).

    Latents ``vae/cosmos3/{dataset_id}/{sub}/{sha256(stem)}.pt`` (data_backend/factory.py ``_default_vae_cache_dir``;
    ``hash_filenames`` is always on) hold a bfloat16 ``[C, frames, h, w]`` latent; text files
    ``text/cosmos3/{name}`` are named as collate.py asks for them: ``text_embed_cache_metadata_for_sample``'s
    geometry (the latent's frames, h and w times 16, ``framerate``) and ``reasoner_component`` (default: the
    nano flavour's, cosmos3's default) give ``_cosmos3_text_cache_signature``, ``text_embed_cache_key_value``
    the key, :func:`simpletuner_text_cache_name` the name. Each holds ``{"cosmos3_reasoner_cache": ...}``
    (:func:`cosmos3_reasoner_cache`: ``_encode_prompts``'s output, which the cache's generic slicer
    ``_slice_batch_output_for_cache`` passes on whole), written by ``LocalDataBackend.torch_save``, gzip'd
    when ``compress`` (``compress_disk_cache``).
    """
    from PIL import Image

    g, stems = _gen(seed), []
    for i in range(n):
        stem, sub = f"img_{i:03d}", ("sub" if i % 2 else "")
        h, w = 2 + i % 2, 3 + i
        media = os.path.join(images, sub, stem + (".png" if frames == 1 else ".mp4"))
        os.makedirs(os.path.dirname(media), exist_ok=True)
        if frames == 1:
            Image.new("RGB", (16 * w, 16 * h), (i, 2 * i, 3 * i)).save(media)
        else:
            _write_mp4(media, 4 * (frames - 1) + 1, 16 * w, 16 * h)  # the Wan VAE's 4x temporal compression
        caption = COSMOS3_CAPTIONS[i % len(COSMOS3_CAPTIONS)]
        with open(os.path.join(images, sub, stem + ".txt"), "w", encoding="utf-8") as fh:
            fh.write(caption)
        latent = _randn(g, 8, frames, h, w, dtype=torch.bfloat16)
        name = hashlib.sha256(stem.encode()).hexdigest()
        simpletuner_torch_save(latent, os.path.join(folder, "vae", "cosmos3", dataset_id, sub, name + ".pt"), compress)
        signature = cosmos3.signature(caption, frames, 16 * h, 16 * w, framerate, reasoner_component)
        text_name = simpletuner_text_cache_name(caption, "cosmos3", dataset_id, media, images, signature=signature)
        payload = {cosmos3.PAYLOAD_KEY: cosmos3_reasoner_cache(g, 5 + i, layers, signature, k_for_gen)}
        simpletuner_torch_save(payload, os.path.join(folder, "text", "cosmos3", text_name), compress)
        stems.append(f"{sub}/{stem}" if sub else stem)
    return stems


def _write_mp4(path: str, frames: int, width: int, height: int):
    import av

    with av.open(path, "w") as container:
        stream = container.add_stream("mpeg4", rate=24)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for f in range(frames):
            picture = np.full((height, width, 3), 20 * f % 256, dtype=np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")))
        container.mux(stream.encode())


# ---------------------------------------------------------------- tdrussell/diffusion-pipe

class DiffusionPipeCache:
    """utils/cache.py ``Cache`` (write side: ``init``, ``create_new_shard``, ``add``, ``finalize_current_shard``)."""

    def __init__(self, path, fingerprint: str = "fixture", shard_size_bytes: int = 1 << 30):
        os.makedirs(path, exist_ok=True)
        self.path, self.shard_size_bytes = path, shard_size_bytes
        self.con = sqlite3.connect(os.path.join(path, "metadata.db"))
        self.con.execute("CREATE TABLE IF NOT EXISTS fingerprint(value)")
        self.con.execute("INSERT INTO fingerprint VALUES(?)", (fingerprint,))
        self.con.execute("CREATE TABLE IF NOT EXISTS items(shard, shard_index)")
        self.shard, self.shard_file = 0, None
        self.con.commit()

    def _new_shard(self):
        self.shard_file = open(os.path.join(self.path, f"shard_{self.shard}.bin"), "wb")
        self.con.execute(f"CREATE TABLE shard_{self.shard}(offset, size)")
        self.shard_index, self.offset = 0, 0

    def finalize(self):
        if self.shard_file is not None:
            self.shard_file.close()
            self.shard_file = None
            self.shard += 1
        self.con.commit()

    def add(self, item):
        if self.shard_file is None:
            self._new_shard()
        buffer = io.BytesIO()
        torch.save(item, buffer)
        data = buffer.getbuffer()
        self.shard_file.write(data)
        self.con.execute("INSERT INTO items VALUES(?, ?)", (self.shard, self.shard_index))
        self.shard_index += 1
        self.con.execute(f"INSERT INTO shard_{self.shard} VALUES (?, ?)", (self.offset, len(data)))
        self.offset += len(data)
        if self.shard_file.tell() >= self.shard_size_bytes:
            self.finalize()

    def close(self):
        self.finalize()
        self.con.close()


def write_diffusion_pipe(folder, n: int = 3, buckets=((256, 256), (384, 256)), captions: int = 2,
                         shard_size_bytes: int = 6000, seed: int = 0) -> list[str]:
    """A diffusion-pipe dataset folder's ``cache/{model}`` tree (images not written).

    ``cache_{bucket_suffix}`` per size bucket (utils/dataset.py ``bucket_suffix``, ``SizeBucketDataset``),
    each with ``latents/`` (``latents_map_fn`` records: latents, mask None, image_spec, caption list)
    and ``text_embeddings_1/`` (``text_embedding_map_fn`` records, one per caption) written by
    utils/cache.py ``Cache.add``; small ``shard_size_bytes`` so records span several shards.
    """
    g, stems = _gen(seed), [f"img_{i:03d}" for i in range(n)]
    base = os.path.join(folder, "cache", "flux")
    for w, h in buckets:
        bucket = os.path.join(base, f"cache_{w / h:.3f}x{w}x{h}x1")
        latents = DiffusionPipeCache(os.path.join(bucket, "latents"), shard_size_bytes=shard_size_bytes)
        texts = DiffusionPipeCache(os.path.join(bucket, "text_embeddings_1"), shard_size_bytes=shard_size_bytes)
        for i, stem in enumerate(stems):
            spec = [None, os.path.join(os.path.abspath(folder), f"{stem}.png")]
            caps = [f"caption {c} of {stem}" for c in range(captions)]
            latents.add({"latents": _randn(g, 16, h // 8 // 4, w // 8 // 4, dtype=torch.bfloat16), "mask": None,
                         "image_spec": spec, "caption": caps})
            for c in caps:
                texts.add({"clip_embed": _randn(g, 24, dtype=torch.bfloat16), "t5_embed": _randn(g, 5, 32, dtype=torch.bfloat16),
                           "image_spec": spec})
        latents.close()
        texts.close()
    return stems


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN-safe, -0.0 told from 0.0): what "read exactly" means in the tests."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.contiguous().reshape(-1), b.contiguous().reshape(-1)
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def records_via(folder, format: str, via: str, out_dir=None, **options) -> dict:
    """``{key: Record}`` of a trainer's cache folder as the tests compare it with the trainer's own loaders:
    ``via="reader"`` straight from :func:`~latentfast.cache.trainers.open_source`; ``"import"`` /
    ``"auto"`` imported into a latentfast cache in ``out_dir`` by ``import_latents(format=format / "auto")``
    and read back from that cache (``cache.record(i)``, ``cache.info(i)``)."""
    if via == "reader":
        return {r.key: r for r in open_source(folder, format, **options)}
    import_latents(folder, out_dir, format=format if via == "import" else "auto", quiet=True, **options)
    cache = LatentCache(out_dir)
    return {key: Record(key, cache.record(i), cache.info(i)) for i, key in enumerate(cache.keys)}
