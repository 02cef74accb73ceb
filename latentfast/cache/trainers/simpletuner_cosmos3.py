"""SimpleTuner's cosmos3 text cache: how its files are named, and its reasoner cache as record fields.

cosmos3 keys its text embeddings by dataset and file path (``TextEmbedCacheKey.DATASET_AND_FILENAME``) with
a signature appended: ``helpers/models/cosmos3/model.py`` ``text_embed_cache_key_value`` makes the key
``f"{dataset id}:{image path}:cosmos3:{signature}"``, and ``_cosmos3_text_cache_signature`` is the sha256 of a
sorted-keys compact JSON of the generation prompt (``helpers/models/cosmos3/pipeline.py``
``Cosmos3OmniPipeline._build_generation_json_prompt``), the geometry (``num_frames``, ``height``, ``width``,
``fps``) and the reasoner component's id. At training time ``helpers/training/collate.py`` takes the geometry
from the item's latent (``text_embed_cache_metadata_for_sample``: the latent's frames, its height and width
times 16, the config's ``framerate``, default 24) and the component from ``_reasoner_component_id`` (the
config's ``cosmos3_reasoner_component``, or the flavour's entry of ``helpers/models/cosmos3/reasoner.py``
``COSMOS3_REASONER_COMPONENTS``), so :func:`signature` computes it from exactly those.

A file holds ``{"cosmos3_reasoner_cache": {...}}`` (``_encode_prompts``): the tokenized reasoner prompt and
the reasoner's keys and values per layer. :func:`record_fields` lays it out as record fields; :func:`reasoner_cache`
turns a record back into the dict SimpleTuner's loader returns (``TextEmbeddingCache.load_from_cache``).

Fields (``text_`` + the cache's key): ``text_input_ids``, ``text_text_indexes`` (int64 ``[L]``),
``text_text_mrope_ids`` (``[3, L]``), and ``reasoner_memory_state["layer_kv"]`` stacked over the reasoner's
layers, one field per name of a layer's dict: ``text_layer_kv_k``, ``text_layer_kv_v`` (``[layers, L, kv_heads,
head_dim]``; ``text_layer_kv_k_for_gen`` where the layers keep one), so layer ``i``'s ``k`` is
``text_layer_kv_k[i]``. Stacked, not a field per layer: every layer of the reasoner has the same attention
config (reasoner.py builds them all from one ``Cosmos3ReasonerConfig``), and a record of a few fields imports
and batches faster than one of a hundred (36 layers x k and v); layers that differ are refused, naming them.
Info: ``text_cache_version``, ``text_cache_signature``, ``text_und_len`` (int),
``text_vision_start_temporal_offset`` (the float32 value as a float), ``text_layer_kv_names`` (a layer's
names in their order).
"""
from __future__ import annotations

import hashlib
import json
import math
import re

import torch

from .common import fail

# helpers/models/cosmos3/reasoner.py COSMOS3_REASONER_COMPONENTS: the ids ``_reasoner_component_id`` gives for
# cosmos3_reasoner_component "auto", one per model flavour; nano, cosmos3's DEFAULT_MODEL_FLAVOUR, first.
REASONER_COMPONENTS = tuple(f"SimpleTuner/cosmos3-component-reasoning-layers-bf16-{flavour}"
                            for flavour in ("nano", "edge", "super", "super-i2v", "super-t2i"))
DEFAULT_FRAMERATE = 24.0  # model.py: float(getattr(config, "framerate", 24.0) or 24.0)
LATENT_PIXELS = 16  # text_embed_cache_metadata_for_sample: height and width are the latent's times 16
PAYLOAD_KEY = "cosmos3_reasoner_cache"
CACHE_KEYS = ("cache_version", "cache_signature", "input_ids", "text_indexes", "und_len", "text_mrope_ids",
              "vision_start_temporal_offset", "reasoner_memory_state")
TENSOR_KEYS = ("input_ids", "text_indexes", "text_mrope_ids")
SCALARS = {"und_len": torch.int64, "vision_start_temporal_offset": torch.float32}  # 0-d tensors, as _encode_prompts makes them
ASPECT_RATIOS = ("1,1", "4,3", "3,4", "16,9", "9,16")


def latent_geometry(latent: torch.Tensor, where: str) -> tuple[int, int, int]:
    """``(num_frames, height, width)`` SimpleTuner's collate derives from a cached latent ``[C, T, h, w]``."""
    if latent.dim() < 3:
        raise fail(where, "a cosmos3 latent [C, T, h, w]", f"a tensor of shape {list(latent.shape)}")
    frames, h, w = latent.shape[-3:]
    return int(frames), int(h) * LATENT_PIXELS, int(w) * LATENT_PIXELS


def signature(caption: str, num_frames: int, height: int, width: int, fps: float, component: str) -> str:
    """``Cosmos3Image._cosmos3_text_cache_signature`` of a caption, its geometry and a reasoner component id."""
    return signatures(caption, num_frames, height, width, fps, (component,))[component]


def signatures(caption: str, num_frames: int, height: int, width: int, fps: float, components) -> dict[str, str]:
    """``{component: signature}`` for several reasoner components (the generation prompt is made once)."""
    fps = float(fps)
    prompt = generation_prompt(caption, num_frames=num_frames, fps=fps, height=height, width=width)
    out = {}
    for component in components:
        payload = {"prompt": prompt, "num_frames": int(num_frames), "height": int(height), "width": int(width),
                   "fps": fps, "reasoner_component": component}
        out[component] = hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode("utf-8")).hexdigest()
    return out


def generation_prompt(caption: str, *, num_frames: int, fps: float, height: int, width: int) -> str:
    """``Cosmos3OmniPipeline._build_generation_json_prompt``: the caption in the structured JSON the reasoner
    reads -- the image template for one frame, the video template otherwise; a caption that is itself a JSON
    object overrides the template's entries; resolution and aspect ratio (and a video's duration and fps) last."""
    text = " ".join(str(caption or "").split())
    video = num_frames != 1
    prompt = _video_template(text, num_frames, fps) if video else _image_template(text)
    prompt.update(_json_object(caption) or {})
    prompt["resolution"] = {"H": int(height), "W": int(width)}
    prompt["aspect_ratio"] = _aspect_ratio(width, height)
    if video:
        prompt["duration"] = _duration(num_frames, fps)[0]
        prompt["fps"] = int(fps) if float(fps).is_integer() else float(fps)
    return json.dumps(prompt, separators=(",", ":"), ensure_ascii=False)


_PROMPT_LED = "as described by the prompt"
_LIGHTING = {"conditions": "natural, balanced lighting", "direction": "front-lit", "shadows": "soft shadows",
             "illumination_effect": "clear visibility across the scene"}
_AESTHETICS = {"composition": "balanced composition centered on the requested subject",
               "color_scheme": "colors follow the prompt", "mood_atmosphere": "grounded and coherent", "patterns": ""}


def _subject(text: str, location: str, middle: dict, person: str, limbs: tuple) -> dict:
    """The one entry of the templates' ``subjects`` (entries in the pipeline's order)."""
    return {"description": text, "appearance_details": text, "relationship": "primary subject of the requested scene",
            "location": location, "relative_size": "medium within frame",
            "orientation": "facing the camera or main action", "pose": _PROMPT_LED, **middle, "clothing": "",
            "expression": "", "gender": person, "age": person, "skin_tone_and_texture": "", "facial_features": "",
            "number_of_subjects": 1 if text else 0, **{f"number_of_{limb}": 0 for limb in limbs}}


def _image_template(text: str) -> dict:
    """pipeline.py ``_build_image_json_prompt``'s template."""
    return {"subjects": [_subject(text, "center of the frame", {}, "Unknown", ("arms", "legs", "hands", "fingers"))],
            "subject_details": {}, "background_setting": text, "lighting": dict(_LIGHTING),
            "aesthetics": dict(_AESTHETICS),
            "cinematography": {"framing": "medium shot", "camera_angle": "eye-level", "depth_of_field": "uniform focus",
                               "focus": "the requested subject and scene", "lens_focal_length": "natural perspective"},
            "style_medium": "image", "artistic_style": _PROMPT_LED, "context": text, "text_and_signage_elements": [],
            "quadrant_scan": {**{corner: "scene detail follows the prompt"
                                 for corner in ("top_left", "top_right", "bottom_left", "bottom_right")},
                              "absolute_center": text},
            "comprehensive_t2i_caption": text}


def _video_template(text: str, num_frames: int, fps: float) -> dict:
    """pipeline.py ``_build_video_json_prompt``'s template."""
    time_range = _duration(num_frames, fps)[1]
    subject = _subject(text, "center foreground", {"action": text, "state_changes": text}, "", ("arms", "legs"))
    return {"subjects": [subject], "background_setting": text, "lighting": dict(_LIGHTING),
            "aesthetics": dict(_AESTHETICS),
            "cinematography": {"camera_motion": "static", "framing": "medium shot", "camera_angle": "eye-level",
                               "depth_of_field": "uniform", "focus": "the requested subject and action",
                               "lens_focal_length": "natural perspective"},
            "style_medium": "video", "artistic_style": _PROMPT_LED, "context": text,
            "actions": [{"time": time_range, "description": text}], "text_and_signage_elements": [],
            "segments": [{"segment_index": 0, "time_range": time_range, "description": text, "key_changes": text,
                          "camera": "static"}],
            "transitions": [], "temporal_caption": text, "audio_description": text}


def _aspect_ratio(width: int, height: int) -> str:
    """pipeline.py ``_aspect_ratio_label``: the nearest of five ratios (the first of equals)."""
    ratio = width / height if height > 0 else 1.0
    return min(ASPECT_RATIOS, key=lambda r: abs(int(r.split(",")[0]) / int(r.split(",")[1]) - ratio))


def _duration(num_frames: int, fps: float) -> tuple[str, str]:
    """pipeline.py ``_format_duration_and_range``: ``("{s}s", "0:00-{m}:{ss}")`` of the whole seconds."""
    seconds = num_frames / fps if fps > 0 else 0.0
    whole = max(int(round(seconds)), 0) if math.isfinite(seconds) else 0
    return f"{whole}s", f"0:00-{whole // 60}:{whole % 60:02d}"


def _json_object(caption) -> dict | None:
    """pipeline.py ``_maybe_json_object``: a caption that parses as a JSON object, else None."""
    text = str(caption or "").strip()
    if not text.startswith("{"):
        return None
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


# ---------------------------------------------------------------- the payload as record fields

def record_fields(payload: dict, where: str) -> tuple[dict[str, torch.Tensor], dict]:
    """``(fields, info)`` of a loaded cosmos3 text file ``{"cosmos3_reasoner_cache": {...}}`` (see the module
    docstring); anything but the layout ``_encode_prompts`` saves raises, naming ``where`` and the entry."""
    cache = payload.get(PAYLOAD_KEY)
    if set(payload) != {PAYLOAD_KEY} or not isinstance(cache, dict) or set(cache) != set(CACHE_KEYS):
        found = sorted(map(str, cache)) if isinstance(cache, dict) else f"a {type(cache).__name__}"
        raise fail(where, f"{{'{PAYLOAD_KEY}': a dict of {list(CACHE_KEYS)}}} (cosmos3/model.py _encode_prompts)",
                   f"keys {sorted(map(str, payload))}, {PAYLOAD_KEY}: {found}")
    fields = {}
    for key in TENSOR_KEYS:
        fields[f"text_{key}"] = _tensor(cache[key], f"{where}#{key}")
    info = {"text_cache_version": cache["cache_version"], "text_cache_signature": cache["cache_signature"]}
    if not isinstance(info["text_cache_signature"], str) or not isinstance(info["text_cache_version"], int):
        raise fail(where, "an int cache_version and a str cache_signature",
                   f"{type(cache['cache_version']).__name__} and {type(cache['cache_signature']).__name__}")
    for key, dtype in SCALARS.items():
        value = cache[key]
        if not isinstance(value, torch.Tensor) or value.dim() != 0 or value.dtype != dtype:
            raise fail(f"{where}#{key}", f"a 0-d {dtype} tensor", _what(value))
        info[f"text_{key}"] = value.item()
    state = cache["reasoner_memory_state"]
    layers = state.get("layer_kv") if isinstance(state, dict) and set(state) == {"layer_kv"} else None
    if not isinstance(layers, list) or not layers:
        raise fail(f"{where}#reasoner_memory_state", "{'layer_kv': a list of dicts of tensors, one per layer}", _what(state))
    first = layers[0]
    for i, layer in enumerate(layers):
        entry = f"{where}#reasoner_memory_state.layer_kv[{i}]"
        if not isinstance(layer, dict) or not layer or \
                not all(isinstance(k, str) and re.fullmatch(r"\w+", k) and isinstance(v, torch.Tensor) and v.dim() > 0
                        for k, v in layer.items()):
            raise fail(entry, "a dict of tensors named by letters, digits and _ ('k', 'v', ...)", _what(layer))
        if list(layer) != list(first) or any(v.shape != first[k].shape or v.dtype != first[k].dtype for k, v in layer.items()):
            raise fail(entry, f"the names, shapes and dtypes of layer 0 ({_layer(first)}), as one reasoner config gives",
                       _layer(layer))
    for name in first:
        fields[f"text_layer_kv_{name}"] = torch.stack([layer[name] for layer in layers])
    info["text_layer_kv_names"] = list(first)
    return fields, info


def reasoner_cache(fields: dict, info: dict) -> dict:
    """The ``cosmos3_reasoner_cache`` dict SimpleTuner's loader returns for an item, rebuilt from its imported
    record (``fields``: ``cache.record(i)``, ``info``: ``cache.info(i)``): what cosmos3/model.py
    ``collate_prompt_embeds`` lists per item and ``_predict_single_sample`` reads."""
    names = info["text_layer_kv_names"]
    stacked = {name: fields[f"text_layer_kv_{name}"] for name in names}
    layers = [{name: stacked[name][i] for name in names} for i in range(len(stacked[names[0]]))]
    return {"cache_version": info["text_cache_version"], "cache_signature": info["text_cache_signature"],
            "input_ids": fields["text_input_ids"], "text_indexes": fields["text_text_indexes"],
            "und_len": torch.tensor(info["text_und_len"], dtype=SCALARS["und_len"]),
            "text_mrope_ids": fields["text_text_mrope_ids"],
            "vision_start_temporal_offset": torch.tensor(info["text_vision_start_temporal_offset"],
                                                         dtype=SCALARS["vision_start_temporal_offset"]),
            "reasoner_memory_state": {"layer_kv": layers}}


def _tensor(value, where: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor) or value.dim() == 0:
        raise fail(where, "a tensor of at least one dimension", _what(value))
    return value


def _layer(layer: dict) -> str:
    return ", ".join(f"{k}: {_what(v)}" for k, v in layer.items())


def _what(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return f"a dict of {sorted(map(str, value))}" if isinstance(value, dict) else f"a {type(value).__name__}"
