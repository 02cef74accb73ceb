"""Text encoding per model family: what each diffusers pipeline's ``encode_prompt`` computes, as named cache fields.

:class:`TextEncoders` combines several :class:`~latentfast.encoders.TextEncoder` s into the fields of one
cache record, each field an encoder's prompt embedding (``"name"``), its pooled embedding
(``"name.pooled"``) or several of them concatenated along the last dimension (a list). :func:`text_preset`
builds the combination a model family's pipeline uses from its components (named as the pipeline names
them: ``text_encoder``, ``tokenizer``, ``text_encoder_2``, ...), and :meth:`TextEncoders.pipeline_inputs`
turns stored fields back into what ``encode_prompt`` returns (``prompt_embeds``, ``pooled_prompt_embeds``):

============  ==========================================================================================
preset        fields (per caption)
============  ==========================================================================================
``sd15``      ``text_clip_l`` [77, D]: CLIP's last hidden state, all 77 rows (the UNet sees the pads)
``sdxl``      ``text_clip_l`` [77, 768], ``text_clip_g`` [77, 1280]: each CLIP's penultimate hidden state;
              ``text_pooled`` [1280]: the second's ``text_embeds``
``sd3``       ``text_clip_l``, ``text_clip_g`` (penultimate, 77 rows), ``text_t5`` [256, 4096] (last hidden
              state, no mask, all rows); ``text_pooled``: both CLIPs' ``text_embeds`` concatenated
``flux``      ``text_t5`` [512, 4096] (no mask, all rows); ``text_pooled`` [768]: CLIP's ``pooler_output``
``wan``       ``text_t5`` [L_i, 4096]: UMT5 with the attention mask, cut to it (the pipeline pads zeros
              after), on the caption cleaned as the pipeline cleans it
``hunyuan-``  ``text_llama`` [256, 4096]: Llama's third-last hidden state with the mask, of the caption in
``video``     the prompt template, the template's ``crop_start`` rows dropped; ``text_llama_mask`` [256]
              (the ``prompt_attention_mask``); ``text_pooled`` [768]: CLIP's ``pooler_output`` (77 tokens)
============  ==========================================================================================

The stored tensors are the pipeline's bit for bit (same model, dtype and device); equal captions are
encoded once per batch and stored once. transformers is imported only when a tokenizer or model is loaded.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from .encoders import TextEncoder
from .errors import ArgumentTypeError, InvalidArgumentError


class TextEncoders:
    """Several text encoders as one: captions -> named fields of a cache record.

    Args:
        encoders: ``{name: TextEncoder}``.
        fields: ``{field: ref}`` where ``ref`` is ``"name"`` (the encoder's per-caption prompt embedding),
            ``"name.pooled"`` (its pooled embedding), ``"name.mask"`` (its attention mask over the rows kept)
            or a list of refs concatenated along the last dimension.
        preset: the preset's name (stamped in the identity), or None for a combination made by hand.
        clean: a function applied to every caption first (a pipeline's prompt cleaning; stamped by name).

    ``encode(captions)`` returns ``{field: [one tensor per caption]}``; ``identity()`` stamps every
    encoder's identity, the fields and the preset.
    """

    def __init__(self, encoders: dict, fields: dict, *, preset: str | None = None, clean: Callable | None = None):
        if not isinstance(encoders, dict) or not encoders:
            raise ArgumentTypeError(f"encoders must be a non-empty dict of name -> TextEncoder, got {encoders!r:.80}")
        for name, encoder in encoders.items():
            if not isinstance(encoder, TextEncoder):
                raise ArgumentTypeError(f"encoders[{name!r}] must be a latentfast.encoders.TextEncoder, got {type(encoder).__qualname__}")
        if not isinstance(fields, dict) or not fields:
            raise ArgumentTypeError(f"fields must be a non-empty dict of field -> ref, got {fields!r:.80}")
        self.encoders, self.preset, self.clean = dict(encoders), preset, clean
        self.fields = {field: [_check_ref(field, r, encoders) for r in (ref if isinstance(ref, list) else [ref])]
                       for field, ref in fields.items()}

    def to(self, device) -> "TextEncoders":
        for encoder in self.encoders.values():
            encoder.to(device)
        return self

    @torch.no_grad()
    def encode(self, captions) -> dict:
        """B captions -> ``{field: [B tensors]}`` (each encoder runs once over the batch)."""
        captions = list(captions) if isinstance(captions, (list, tuple)) else captions
        if self.clean is not None and isinstance(captions, list):
            captions = [self.clean(c) if isinstance(c, str) else c for c in captions]
        outputs = {name: encoder.encode(captions) for name, encoder in self.encoders.items()}
        fields = {}
        for field, refs in self.fields.items():
            parts = [outputs[name].embeds if which == "embeds" else outputs[name].masks if which == "mask"
                     else list(outputs[name].pooled) for name, which in refs]
            fields[field] = [p[0] if len(p) == 1 else torch.cat(p, dim=-1) for p in zip(*parts)]
        return fields

    def identity(self) -> dict:
        return {"preset": self.preset,
                "clean": None if self.clean is None else f"{self.clean.__module__}.{self.clean.__qualname__}",
                "encoders": {name: encoder.identity() for name, encoder in self.encoders.items()},
                "fields": {field: [name if which == "embeds" else f"{name}.{which}" for name, which in refs]
                           for field, refs in self.fields.items()}}

    def pipeline_inputs(self, fields: dict) -> dict:
        """Stored fields of B items (``{field: [B tensors]}``, e.g. from ``cache.record``) -> what the
        preset's pipeline ``encode_prompt`` returns: ``prompt_embeds`` and, where the model has one,
        ``pooled_prompt_embeds``."""
        if self.preset not in PRESETS:
            raise InvalidArgumentError(f"pipeline_inputs needs a preset's encoders ({sorted(PRESETS)}), these are {self.preset!r}")
        missing = [f for f in self.fields if f not in fields]
        if missing:
            raise InvalidArgumentError(f"fields must hold {sorted(self.fields)}; missing {missing}")
        return PRESETS[self.preset].assemble(self, {f: list(fields[f]) for f in self.fields})


def _check_ref(field: str, ref: Any, encoders: dict) -> tuple[str, str]:
    name, _, which = ref.partition(".") if isinstance(ref, str) else (None, "", "")
    if name not in encoders or which not in ("", "pooled", "mask"):
        raise InvalidArgumentError(f"fields[{field!r}] must name an encoder of {sorted(encoders)} as 'name', "
                                   f"'name.pooled' or 'name.mask' (or a list of those), got {ref!r}")
    if which == "pooled" and encoders[name].pooled_field is None:
        raise InvalidArgumentError(f"fields[{field!r}]: encoder {name!r} ({type(encoders[name].model).__name__}) has no pooled output")
    return name, which or "embeds"


# -- the presets ---------------------------------------------------------------------------------------
class _Preset:
    """A pipeline's text path: its components, how each is encoded, the fields, and the way back."""

    def __init__(self, components, encoders, fields, assemble, clean=None):
        self.components = components  # (model attribute, tokenizer attribute) per encoder, in pipeline order
        self.encoders = encoders  # {name: (index into components, TextEncoder options)}
        self.fields, self.assemble, self.clean = fields, assemble, clean


def _stack(values):
    return torch.stack(values)


def _sd15(te, f):
    return {"prompt_embeds": _stack(f["text_clip_l"])}


def _sdxl(te, f):  # StableDiffusionXLPipeline.encode_prompt: torch.concat(prompt_embeds_list, dim=-1)
    return {"prompt_embeds": torch.cat([_stack(f["text_clip_l"]), _stack(f["text_clip_g"])], dim=-1),
            "pooled_prompt_embeds": _stack(f["text_pooled"])}


def _sd3(te, f):  # StableDiffusion3Pipeline.encode_prompt: CLIPs padded to T5's width, then T5's rows after
    clip = torch.cat([_stack(f["text_clip_l"]), _stack(f["text_clip_g"])], dim=-1)
    t5 = _stack(f["text_t5"])
    clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
    return {"prompt_embeds": torch.cat([clip, t5], dim=-2), "pooled_prompt_embeds": _stack(f["text_pooled"])}


def _flux(te, f):
    return {"prompt_embeds": _stack(f["text_t5"]), "pooled_prompt_embeds": _stack(f["text_pooled"])}


def _wan(te, f):  # WanPipeline._get_t5_prompt_embeds: each caption's rows, then zeros to max_length
    length = te.encoders["t5"].max_length
    return {"prompt_embeds": torch.stack([torch.cat([u, u.new_zeros(length - u.shape[0], u.shape[1])]) for u in f["text_t5"]])}


def _hunyuan_video(te, f):  # HunyuanVideoPipeline.encode_prompt: embeds, pooled, prompt_attention_mask
    return {"prompt_embeds": _stack(f["text_llama"]), "pooled_prompt_embeds": _stack(f["text_pooled"]),
            "prompt_attention_mask": _stack(f["text_llama_mask"])}


def _wan_clean(text: str) -> str:
    """The Wan pipeline's own ``prompt_clean`` (ftfy where installed, HTML unescape, whitespace)."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    return prompt_clean(text)


_CLIP, _CLIP_2, _TEXT_3 = ("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2"), ("text_encoder_3", "tokenizer_3")
PRESETS = {
    "sd15": _Preset([_CLIP], {"clip_l": (0, {"cut_to_mask": False})}, {"text_clip_l": "clip_l"}, _sd15),
    "sdxl": _Preset([_CLIP, _CLIP_2], {"clip_l": (0, {"hidden_state": -2, "cut_to_mask": False}),
                                       "clip_g": (1, {"hidden_state": -2, "cut_to_mask": False})},
                    {"text_clip_l": "clip_l", "text_clip_g": "clip_g", "text_pooled": "clip_g.pooled"}, _sdxl),
    "sd3": _Preset([_CLIP, _CLIP_2, _TEXT_3], {"clip_l": (0, {"hidden_state": -2, "cut_to_mask": False}),
                                               "clip_g": (1, {"hidden_state": -2, "cut_to_mask": False}),
                                               "t5": (2, {"max_length": 256, "cut_to_mask": False})},
                   {"text_clip_l": "clip_l", "text_clip_g": "clip_g", "text_t5": "t5",
                    "text_pooled": ["clip_l.pooled", "clip_g.pooled"]}, _sd3),
    "flux": _Preset([_CLIP, _CLIP_2], {"clip_l": (0, {}), "t5": (1, {"max_length": 512, "cut_to_mask": False})},
                    {"text_t5": "t5", "text_pooled": "clip_l.pooled"}, _flux),
    # the template and crop_start: the pipeline's DEFAULT_PROMPT_TEMPLATE unless text_preset(prompt_template=) says
    "hunyuan-video": _Preset([_CLIP, _CLIP_2], {"llama": (0, {"hidden_state": -3, "max_length": 256, "pass_attention_mask": True,
                                                        "cut_to_mask": False}),
                                                "clip": (1, {"max_length": 77})},
                             {"text_llama": "llama", "text_llama_mask": "llama.mask", "text_pooled": "clip.pooled"},
                             _hunyuan_video),
    "wan": _Preset([_CLIP], {"t5": (0, {"max_length": 512, "pass_attention_mask": True})}, {"text_t5": "t5"}, _wan,
                   clean=_wan_clean),
}


def text_preset(name: str, pipeline: Any = None, *, max_length: int | None = None, prompt_template: dict | None = None,
                **components) -> TextEncoders:
    """The :class:`TextEncoders` of a model family's pipeline (``sd15``, ``sdxl``, ``sd3``, ``flux``, ``wan``).

    The components come from ``pipeline`` (a diffusers pipeline object, or anything with those
    attributes) or as keywords named as the pipeline names them (``text_encoder=``, ``tokenizer=``,
    ``text_encoder_2=``, ...). ``max_length``: the T5 tokens per caption where the pipeline takes a
    ``max_sequence_length`` (``sd3`` 256, ``flux`` 512, ``wan`` 512, ``hunyuan-video`` 256 by default, as
    their ``__call__``). ``prompt_template`` (``hunyuan-video``): ``{"template": ..., "crop_start": N}``,
    default the pipeline's ``DEFAULT_PROMPT_TEMPLATE``.
    """
    if name not in PRESETS:
        raise InvalidArgumentError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    preset = PRESETS[name]
    wanted = [attr for pair in preset.components for attr in pair]
    if pipeline is not None:
        components = {attr: getattr(pipeline, attr, None) for attr in wanted} | components
    missing = [attr for attr in wanted if components.get(attr) is None]
    if missing:
        raise InvalidArgumentError(f"preset {name!r} needs {wanted}; missing {missing}")
    unknown = sorted(set(components) - set(wanted))
    if unknown:
        raise InvalidArgumentError(f"preset {name!r} takes the components {wanted}, got also {unknown}")
    encoders = {}
    for enc_name, (index, options) in preset.encoders.items():
        model_attr, tok_attr = preset.components[index]
        options = dict(options)
        if enc_name in ("t5", "llama") and max_length is not None:  # the pipeline's max_sequence_length
            options["max_length"] = max_length
        if name == "sd3" and model_attr != "text_encoder_3":  # SD3 tokenizes both CLIPs to the first's length
            options["max_length"] = components["tokenizer"].model_max_length
        if enc_name == "llama":
            options.update(_hunyuan_template(prompt_template))
        encoders[enc_name] = TextEncoder(components[model_attr], components[tok_attr], **options)
    return TextEncoders(encoders, preset.fields, preset=name, clean=preset.clean)


def _hunyuan_template(prompt_template) -> dict:
    """``template`` / ``crop_start`` options: HunyuanVideo's ``DEFAULT_PROMPT_TEMPLATE`` or the one given."""
    if prompt_template is None:
        from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

        prompt_template = DEFAULT_PROMPT_TEMPLATE
    if not isinstance(prompt_template, dict) or not isinstance(prompt_template.get("crop_start"), int):
        raise InvalidArgumentError(f"prompt_template must be a dict with 'template' and an int 'crop_start', got {prompt_template!r:.80}")
    return {"template": prompt_template["template"], "crop_start": prompt_template["crop_start"]}


def load_text_preset(name: str, folders, *, dtype: str | None = None, max_length: int | None = None) -> TextEncoders:
    """:func:`text_preset` with its components loaded from disk: ``folders`` is a diffusers pipeline
    folder (``text_encoder/``, ``tokenizer/``, ``text_encoder_2/``, ... subfolders) or a list with one
    folder per text encoder in the pipeline's order, each a transformers ``save_pretrained`` folder
    holding the model and its tokenizer. ``dtype``: e.g. ``"bfloat16"`` (default: as saved)."""
    if name not in PRESETS:
        raise InvalidArgumentError(f"preset must be one of {sorted(PRESETS)}, got {name!r}")
    pairs = PRESETS[name].components
    if isinstance(folders, (str, os.PathLike)):
        root = os.fspath(folders)
        places = [(os.path.join(root, model), os.path.join(root, tok)) for model, tok in pairs]
    else:
        folders = [os.fspath(f) for f in folders]
        if len(folders) != len(pairs):
            raise InvalidArgumentError(f"preset {name!r} needs {len(pairs)} text-encoder folders "
                                       f"({', '.join(m for m, _ in pairs)}), got {len(folders)}: {folders}")
        places = [(f, f) for f in folders]
    components = {}
    for (model_attr, tok_attr), (model_dir, tok_dir) in zip(pairs, places):
        components[model_attr], components[tok_attr] = load_text_model(model_dir, dtype=dtype, tokenizer_dir=tok_dir)
    return text_preset(name, max_length=max_length, **components)


def load_text_model(folder: str, *, dtype: str | None = None, tokenizer_dir: str | None = None):
    """``(model, tokenizer)`` from local transformers ``save_pretrained`` folders (never a download):
    the model class from ``config.json``'s ``architectures``, one of :data:`~latentfast.encoders.TEXT_MODELS`."""
    import json

    import transformers

    from .encoders import TEXT_MODELS

    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise InvalidArgumentError(f"text encoder folder {folder!r} has no config.json (a transformers save_pretrained folder expected)")
    with open(config_path, encoding="utf-8") as fh:
        architectures = json.load(fh).get("architectures") or []
    cls = next((a for a in architectures if a in TEXT_MODELS), None)
    if cls is None:
        raise InvalidArgumentError(f"{config_path}: architectures must name one of {sorted(TEXT_MODELS)}, got {architectures}")
    torch_dtype = getattr(torch, dtype) if dtype else None
    model = getattr(transformers, cls).from_pretrained(folder, dtype=torch_dtype, local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir or folder, local_files_only=True)
    return model, tokenizer
