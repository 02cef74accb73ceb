"""Encoders for the latent cache builders: a wrapper around diffusers VAEs (never a reimplementation).

:class:`DiffusersVAE` wraps a diffusers ``AutoencoderKL`` (SD 1.x/2.x, SDXL, SD3, Flux),
``AutoencoderKLWan``, ``AutoencoderKLQwenImage``, ``AutoencoderKLHunyuanVideo``,
``AutoencoderKLCogVideoX`` or ``AutoencoderKLLTXVideo`` and gives it the cache's encoder protocol:
``encode(images [B, 3, H, W] in [-1, 1])``, ``encode_video([B, 3, T, H, W])`` and ``identity()``.
Latents are normalized the way each model's diffusers pipeline normalizes them before the
transformer sees them:

- ``latents_mean`` / ``latents_std`` in the config (Wan, Qwen-Image, some SDXL-family VAEs) or
  as buffers (LTX-Video): ``(z - mean) * scaling_factor / std`` (``scaling_factor`` 1 if absent);
- otherwise ``(z - shift_factor) * scaling_factor`` (``shift_factor`` 0 if absent: SD, HunyuanVideo,
  CogVideoX; SD3 and Flux set it).

:class:`TextEncoder` wraps a transformers ``CLIPTextModel`` / ``CLIPTextModelWithProjection`` /
``T5EncoderModel`` / ``UMT5EncoderModel`` (Wan) / ``Gemma2Model`` and its tokenizer: ``encode(captions)`` gives each caption's prompt embedding
``[L_i, D]`` (computed as the diffusers pipelines compute it, then cut to its attention mask) and the
pooled embedding where the model has one.

diffusers and transformers are optional dependencies (``pip install latentfast[diffusers]``,
``latentfast[text]``); importing this module imports neither.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from typing import Any, NamedTuple

import torch

from .errors import ArgumentTypeError, InvalidArgumentError

IMAGE_VAES = ("AutoencoderKL",)  # 2-D VAEs: [B, 3, H, W]; the others take [B, 3, T, H, W]
VIDEO_VAES = ("AutoencoderKLWan", "AutoencoderKLQwenImage", "AutoencoderKLHunyuanVideo",
              "AutoencoderKLCogVideoX", "AutoencoderKLLTXVideo")
SAMPLE_MODES = ("mode", "sample", "store")
_CONFIG_NOISE = ("_name_or_path", "_diffusers_version", "_use_default_values", "_class_name")


class DiffusersVAE:
    """A diffusers VAE as a latent-cache encoder.

    Args:
        vae: an instance of one of the supported classes (:data:`IMAGE_VAES`, :data:`VIDEO_VAES`),
            e.g. ``AutoencoderKL.from_pretrained(path, subfolder="vae")``. It is put in eval mode
            and never trained here.
        sample: ``"mode"`` (the posterior's mode, deterministic: what most trainers cache),
            ``"sample"`` (a draw from the posterior, seeded: pass ``seeds`` to :meth:`encode` for
            one seed per item, which the builders do so a resumed build draws the same noise) or
            ``"store"`` (the posterior's normalized mean and std, for a fresh draw at every read:
            :meth:`encode` returns the mean, ``encode(..., with_std=True)`` the pair, and the
            builders store them as the fields ``latent`` and ``latent_std``; see
            ``read_batch(..., sample=True)``).
        seed: the seed of draws made without per-item ``seeds``.

    ``identity()`` stamps the class, the config (without paths and versions), a BLAKE2b hash of the
    weights (names, dtypes, shapes, bytes), the normalization and the sampling mode: a cache built
    with another VAE, other weights or another dtype is refused by ``LatentCache(..., expected=...)``.
    """

    def __init__(self, vae: Any, *, sample: str = "mode", seed: int = 0):
        name = type(vae).__name__
        if name not in IMAGE_VAES + VIDEO_VAES:
            raise ArgumentTypeError(f"vae must be a diffusers {' / '.join(IMAGE_VAES + VIDEO_VAES)}, got {type(vae).__qualname__}")
        if sample not in SAMPLE_MODES:
            raise InvalidArgumentError(f"sample must be one of {SAMPLE_MODES}, got {sample!r}")
        self.vae = vae.eval().requires_grad_(False)
        self.sample, self.seed = sample, int(seed)
        self.is_video_vae = name in VIDEO_VAES
        self._generator = torch.Generator().manual_seed(self.seed)
        self._weights_hash: str | None = None
        config = vae.config
        self.latent_channels = int(config.get("latent_channels") or config.get("z_dim"))
        self.spatial_downscale, self.temporal_downscale = _compression(vae)
        self._mean, self._std, self._scale, self._shift = _normalization(vae)

    # -- the protocol -------------------------------------------------------------------------
    def to(self, device) -> "DiffusersVAE":
        self.vae.to(device)
        return self

    @property
    def device(self) -> torch.device:
        return next(self.vae.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.vae.parameters()).dtype

    @torch.no_grad()
    def encode(self, images: torch.Tensor, *, seeds=None, with_std: bool = False):
        """``images [B, 3, H, W]`` in [-1, 1] -> float32 normalized latents ``[B, C, H/f, W/f]``
        (``with_std``, for ``sample="store"``: the pair ``(mean, std)`` of the normalized posterior)."""
        _check_pixels(images, 4, "images")
        if self.is_video_vae:
            return _map(lambda z: z.squeeze(2), self._latents(images.unsqueeze(2), seeds, with_std))
        return self._latents(images, seeds, with_std)

    @torch.no_grad()
    def encode_video(self, clips: torch.Tensor, *, seeds=None, with_std: bool = False):
        """``clips [B, 3, T, H, W]`` in [-1, 1] -> float32 normalized latents ``[B, C, T', H/f, W/f]``
        (an image VAE encodes each frame: ``T' = T``); ``with_std`` as in :meth:`encode`."""
        _check_pixels(clips, 5, "clips")
        if self.is_video_vae:
            return self._latents(clips, seeds, with_std)
        B, _, T, H, W = clips.shape
        frames = clips.permute(0, 2, 1, 3, 4).reshape(B * T, 3, H, W)
        frame_seeds = None if seeds is None else [int(s) * 1000003 + t for s in seeds for t in range(T)]
        z = self._latents(frames, frame_seeds, with_std)
        return _map(lambda z: z.reshape(B, T, *z.shape[1:]).permute(0, 2, 1, 3, 4).contiguous(), z)

    def identity(self) -> dict:
        config = {k: v for k, v in dict(self.vae.config).items() if k not in _CONFIG_NOISE}
        identity = {
            "pretrained": f"diffusers.{type(self.vae).__name__}",
            "subfolder": "",
            "class": f"diffusers.{type(self.vae).__name__}",
            "config": json.loads(json.dumps(config, default=list, sort_keys=True)),
            "weights_blake2b": self.weights_hash(),
            "latent_channels": self.latent_channels,
            "downscale_factor": self.spatial_downscale,
            "temporal_downscale": self.temporal_downscale,
            "normalization": self.normalization(),
            "sample": self.sample,
        }
        if self.sample == "sample":
            identity["seed"] = self.seed
        return identity

    # -- details ------------------------------------------------------------------------------
    def normalization(self) -> dict:
        """What :meth:`encode` applies to the raw posterior latents, as plain numbers."""
        out = {"scaling_factor": self._scale}
        if self._mean is not None:
            out.update(latents_mean=self._mean.tolist(), latents_std=self._std.tolist())
        else:
            out["shift_factor"] = self._shift
        return out

    def weights_hash(self) -> str:
        """BLAKE2b-128 over every parameter and buffer: name, dtype, shape and bytes (computed once)."""
        if self._weights_hash is None:
            self._weights_hash = state_dict_hash(self.vae)
        return self._weights_hash

    def _latents(self, pixels: torch.Tensor, seeds, with_std: bool = False):
        if with_std and self.sample != "store":
            raise InvalidArgumentError(f"with_std=True needs DiffusersVAE(..., sample='store'), this one has sample={self.sample!r}")
        dist = self.vae.encode(pixels.to(self.device, self.dtype)).latent_dist
        if self.sample == "mode":
            z = dist.mode()
        elif self.sample == "store":
            z = dist.mean  # a diagonal Gaussian's mode: what sample="mode" caches
        else:
            z = dist.mean + dist.std * self._noise(dist.mean, seeds)
        z = z.float()
        shape = (1, -1) + (1,) * (z.ndim - 2)
        if self._mean is not None:
            mean, std = self._mean.to(z.device).view(shape), self._std.to(z.device).view(shape)
            z = (z - mean) * self._scale / std
            scale = self._scale / std
        else:
            z = (z - self._shift) * self._scale
            scale = self._scale
        # the normalization is affine, so the normalized posterior's std is the raw std times its scale
        return (z, dist.std.float() * scale) if with_std else z

    def _noise(self, like: torch.Tensor, seeds) -> torch.Tensor:
        """Standard normal noise, drawn on the CPU (the same on every device): per item from
        ``seeds``, else from this encoder's generator."""
        if seeds is None:
            noise = torch.randn(like.shape, generator=self._generator)
        else:
            seeds = list(seeds)
            if len(seeds) != like.shape[0]:
                raise InvalidArgumentError(f"seeds must hold one seed per item ({like.shape[0]}), got {len(seeds)}")
            noise = torch.stack([torch.randn(like.shape[1:], generator=torch.Generator().manual_seed(int(s) % 2**63))
                                 for s in seeds])
        return noise.to(like.device, like.dtype)


def _map(fn, value):
    """``fn`` on a tensor, or on each of a ``(mean, std)`` pair."""
    return tuple(fn(v) for v in value) if isinstance(value, tuple) else fn(value)


def state_dict_hash(module: torch.nn.Module) -> str:
    """BLAKE2b-128 of a module's state dict: every tensor's name, dtype, shape and bytes, in name order."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in sorted(module.state_dict().items()):
        tensor = tensor.detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _check_pixels(x: Any, ndim: int, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != ndim or x.shape[1] != 3:
        want = "[B, 3, H, W]" if ndim == 4 else "[B, 3, T, H, W]"
        raise InvalidArgumentError(f"{name} must be {want} pixels in [-1, 1], got shape {list(x.shape)}")
    if not x.is_floating_point():
        raise InvalidArgumentError(f"{name} must be floating point in [-1, 1], got {x.dtype}")


def _compression(vae) -> tuple[int, int]:
    """``(spatial, temporal)`` downscale factors, from the structure the config describes."""
    config, name = vae.config, type(vae).__name__
    if name in ("AutoencoderKLWan", "AutoencoderKLQwenImage"):
        return 2 ** (len(config["dim_mult"]) - 1), 2 ** sum(bool(t) for t in config["temperal_downsample"])
    if name in ("AutoencoderKL", "AutoencoderKLCogVideoX"):
        spatial = 2 ** (len(config["block_out_channels"]) - 1)
        return spatial, (int(config.get("temporal_compression_ratio") or 4) if name != "AutoencoderKL" else 1)
    return int(vae.spatial_compression_ratio), int(vae.temporal_compression_ratio)


def _normalization(vae):
    """``(mean, std, scaling_factor, shift_factor)`` as each model's pipeline applies them."""
    config = vae.config
    scale = float(config.get("scaling_factor") or 1.0)
    shift = float(config.get("shift_factor") or 0.0)
    mean, std = config.get("latents_mean"), config.get("latents_std")
    if mean is None and type(vae).__name__ == "AutoencoderKLLTXVideo":  # LTX keeps them as buffers
        mean, std = vae.latents_mean, vae.latents_std
    if mean is None or std is None:
        return None, None, scale, shift
    return (torch.as_tensor(mean, dtype=torch.float32).detach().cpu().reshape(-1),
            torch.as_tensor(std, dtype=torch.float32).detach().cpu().reshape(-1), scale, shift)


def load_diffusers_vae(spec: str, *, sample: str = "mode", seed: int = 0, dtype: str | None = None,
                       config: str | None = None) -> DiffusersVAE:
    """A :class:`DiffusersVAE` from ``PATH`` or ``CLASS:PATH`` (never a download), where ``PATH`` is

    - a folder saved with ``save_pretrained`` (its class read from ``config.json``; a ``vae/`` subfolder
      is used when present);
    - a single-file checkpoint (``.safetensors``, ``.ckpt``, ``.pt``, ``.pth``: kohya's ``sdxl_vae.safetensors``,
      Flux's ``ae.safetensors``), loaded with ``CLASS.from_single_file`` (``AutoencoderKL`` by default),
      which converts the original key layout; ``config``: a diffusers VAE folder (or a model folder with
      ``vae/``, or a Hugging Face id in the local cache) giving its configuration, else the one
      diffusers infers from the keys, from the local Hugging Face cache;
    - a Hugging Face model id (``org/name``) already in the local Hugging Face cache."""
    import os

    name, sep, path = spec.partition(":")
    if not sep or os.path.exists(spec):
        name, path = None, spec
    torch_dtype = getattr(torch, dtype) if dtype else None
    if path.endswith(_SINGLE_FILE_SUFFIXES):
        if not os.path.isfile(path):
            raise InvalidArgumentError(f"VAE checkpoint file {path!r} does not exist")
        cls = _vae_class(name or "AutoencoderKL")
        kwargs = {} if config is None else _single_file_config(config)
        try:
            with _no_accelerate_warning():
                vae = cls.from_single_file(path, torch_dtype=torch_dtype, local_files_only=True, **kwargs)
        except OSError as exc:  # the inferred config is not in the local cache: say how to give it
            raise InvalidArgumentError(f"VAE checkpoint {path}: its diffusers config is not available offline ({exc}); "
                                       "pass config= (--vae-config DIR: a diffusers VAE folder with a config.json)") from None
        return DiffusersVAE(vae, sample=sample, seed=seed)
    if not os.path.exists(path) and _looks_like_hub_id(path):
        path = _hub_folder(path)
    if os.path.isfile(os.path.join(path, "vae", "config.json")):
        path = os.path.join(path, "vae")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise InvalidArgumentError(f"--encoder diffusers:PATH needs a folder with a config.json (a diffusers save_pretrained "
                                   f"folder), a single-file checkpoint or a Hugging Face id in the local cache, got {path!r}")
    if name is None:
        with open(config_path, encoding="utf-8") as fh:
            name = json.load(fh).get("_class_name")
    with _no_accelerate_warning():
        vae = _vae_class(name).from_pretrained(path, torch_dtype=torch_dtype)
    return DiffusersVAE(vae, sample=sample, seed=seed)


_SINGLE_FILE_SUFFIXES = (".safetensors", ".ckpt", ".pt", ".pth")


def _vae_class(name):
    import diffusers

    cls = getattr(diffusers, str(name), None)
    if cls is None or str(name) not in IMAGE_VAES + VIDEO_VAES:
        raise InvalidArgumentError(f"diffusers VAE class must be one of {IMAGE_VAES + VIDEO_VAES}, got {name!r}")
    return cls


def _looks_like_hub_id(text: str) -> bool:
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "~"))


def _hub_folder(repo_id: str) -> str:
    """The local snapshot folder of a Hugging Face model id (the local cache only: HF_HOME / HF_HUB_CACHE)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, local_files_only=True)
    except LocalEntryNotFoundError:
        raise InvalidArgumentError(f"{repo_id!r} is neither a local path nor a model in the local Hugging Face cache "
                                   "(download it first, e.g. huggingface-cli download, or give its folder)") from None


def _single_file_config(config: str) -> dict:
    """``from_single_file``'s ``config=`` (a folder holding the VAE's config.json) from a VAE folder,
    a model folder with ``vae/`` or a Hugging Face id in the local cache."""
    import os

    folder = _hub_folder(config) if not os.path.exists(config) and _looks_like_hub_id(config) else config
    if os.path.isfile(os.path.join(folder, "vae", "config.json")):
        folder = os.path.join(folder, "vae")
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise InvalidArgumentError(f"the VAE config must be a diffusers VAE folder with a config.json (or a model folder with "
                                   f"vae/), got {config!r}")
    return {"config": folder}


class NoAccelerateWarning(logging.Filter):
    """Drops diffusers' "install accelerate" warning, printed on every model load without accelerate: for a
    VAE (tens of millions of weights) accelerate saves little, the random initialization it would skip
    and a second copy of the weights while loading. Other warnings pass."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "because `accelerate` was not found" not in record.getMessage()


# -- text encoders ------------------------------------------------------------------------------------
# transformers class -> the output field of its pooled embedding (None: the model has none)
TEXT_MODELS = {"CLIPTextModel": "pooler_output", "CLIPTextModelWithProjection": "text_embeds", "T5EncoderModel": None,
               "UMT5EncoderModel": None, "Gemma2Model": None, "LlamaModel": None}
_TEXT_CONFIG_NOISE = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "_attn_implementation_autoset",
                      "_commit_hash")


class TextEncoding(NamedTuple):
    """What :meth:`TextEncoder.encode` returns for B captions."""

    embeds: list  # B tensors [L_i, D] in the model's dtype (L_i = the caption's tokens, or max_length uncut)
    pooled: torch.Tensor | None  # [B, P] where the model has a pooled output, else None
    lengths: list  # B ints: tokens of each caption in the attention mask (special tokens included)
    masks: list | None = None  # B attention masks [L] (int64, as the tokenizer gives them) of the rows kept uncut


class TextEncoder:
    """A transformers text encoder and its tokenizer as a cache encoder: captions -> prompt embeddings.

    Computes what the diffusers pipelines feed their denoisers: the captions are tokenized with
    ``padding="max_length"`` to ``max_length`` and truncated to it (``truncate=False`` refuses a longer
    caption instead, naming it), the padded batch runs through the model as the pipeline runs it, and
    each caption's rows are then cut to its attention mask (``cut_to_mask=False`` keeps all
    ``max_length`` rows: SD and SDXL feed the pad positions' embeddings too, and a causal CLIP's
    unpadded rows do not depend on them, so cutting only drops the pad rows).

    Args:
        model: a ``CLIPTextModel``, ``CLIPTextModelWithProjection``, ``T5EncoderModel`` or ``Gemma2Model``
            (eval mode, never trained here). Its device and dtype are the outputs' (bfloat16 stays bfloat16).
        tokenizer: its tokenizer (a ``PreTrainedTokenizer(Fast)``).
        hidden_state: ``-1`` for ``last_hidden_state`` (SD 1.x/2.x, Flux's and SD3's T5), else the index
            into ``hidden_states`` as the model returns them (``-2``, the penultimate layer without the
            final layer norm: SDXL and SD3's CLIPs; ``-(clip_skip + 2)`` with a clip skip).
        max_length: tokens per caption (default the tokenizer's ``model_max_length``: 77 for CLIP; give it
            for T5: 512 for Flux, 256 for SD3).
        pass_attention_mask: give the model the attention mask (the pipelines do not for CLIP, Flux's or
            SD3's T5; their pad tokens take part).
        cut_to_mask: return each caption's ``L_i`` rows (default) or all ``max_length`` rows.
        truncate: cut captions longer than ``max_length`` tokens (default, as the pipelines do, which
            only log a warning) or raise ``InvalidArgumentError`` naming the first such caption.
        prefix: text put before every caption (a pipeline's prompt template), part of the embedding.
        template: a prompt template with ``{}`` where the caption goes (HunyuanVideo's), instead of ``prefix``.
        crop_start: tokens dropped from the front after encoding (the template's tokens before the caption:
            HunyuanVideo's ``crop_start``); ``max_length`` counts the tokens after them, as the pipeline does.

    The outputs are on the model's device; ``lengths`` counts each caption's tokens in the mask.

    Per pipeline: SD 1.x/2.x ``TextEncoder(clip, tok)``; SDXL ``TextEncoder(clip_l, tok, hidden_state=-2)``
    and ``TextEncoder(clip_g_with_projection, tok_2, hidden_state=-2)`` (the pooled embedding is the
    second's ``text_embeds``); SD3 the two CLIPs with projection at ``hidden_state=-2`` plus
    ``TextEncoder(t5, tok_3, max_length=256)``; Flux ``TextEncoder(clip_l, tok)`` (its ``pooler_output``)
    plus ``TextEncoder(t5, tok_2, max_length=512)``; Lumina 2 ``TextEncoder(gemma2, tok, hidden_state=-2,
    max_length=256, pass_attention_mask=True, prefix=pipe.system_prompt + " <Prompt Start> ")``. Qwen-Image's
    Qwen2.5-VL path (a chat template whose first 34 tokens are dropped) is not wrapped.
    """

    def __init__(self, model: Any, tokenizer: Any, *, hidden_state: int = -1, max_length: int | None = None,
                 pass_attention_mask: bool = False, cut_to_mask: bool = True, truncate: bool = True, prefix: str = "",
                 template: str | None = None, crop_start: int = 0):
        name = type(model).__name__
        if name not in TEXT_MODELS:
            raise ArgumentTypeError(f"model must be a transformers {' / '.join(TEXT_MODELS)}, got {type(model).__qualname__}")
        if not callable(tokenizer) or not hasattr(tokenizer, "model_max_length"):
            raise ArgumentTypeError(f"tokenizer must be a transformers tokenizer, got {type(tokenizer).__qualname__}")
        self.model, self.tokenizer = model.eval().requires_grad_(False), tokenizer
        self.pooled_field = TEXT_MODELS[name]
        self.hidden_state = _text_layer(model, hidden_state)
        self.max_length = _max_length(tokenizer, max_length)
        self.pass_attention_mask, self.cut_to_mask, self.truncate = bool(pass_attention_mask), bool(cut_to_mask), bool(truncate)
        if not isinstance(prefix, str):
            raise ArgumentTypeError(f"prefix must be a str, got {type(prefix).__name__}")
        self.prefix = prefix
        if template is not None and (not isinstance(template, str) or "{}" not in template or prefix):
            raise InvalidArgumentError(f"template must be a str with '{{}}' where the caption goes (and no prefix), got {template!r:.80}")
        if isinstance(crop_start, bool) or not isinstance(crop_start, int) or crop_start < 0:
            raise InvalidArgumentError(f"crop_start must be an int >= 0, got {crop_start!r}")
        self.template, self.crop_start = template, crop_start
        self._weights_hash: str | None = None

    def to(self, device) -> "TextEncoder":
        self.model.to(device)
        return self

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @torch.no_grad()
    def encode(self, captions) -> TextEncoding:
        """B captions (str) -> per-caption ``[L_i, D]`` embeddings, the pooled ``[B, P]`` (or None), the lengths."""
        texts = [self.template.format(c) if self.template else self.prefix + c for c in _check_captions(captions)]
        tokens = self._tokenize(texts)
        ids, mask = tokens["input_ids"].to(self.device), tokens["attention_mask"].to(self.device)
        out = self.model(input_ids=ids, attention_mask=mask if self.pass_attention_mask else None,
                         output_hidden_states=self.hidden_state != -1, return_dict=True)
        sequence = out.last_hidden_state if self.hidden_state == -1 else out.hidden_states[self.hidden_state]
        sequence, mask = sequence[:, self.crop_start:], mask[:, self.crop_start:]  # the template's rows go
        keep = mask.bool()
        embeds = [row[m] if self.cut_to_mask else row.clone() for row, m in zip(sequence, keep)]
        pooled = None if self.pooled_field is None else getattr(out, self.pooled_field)
        return TextEncoding(embeds, pooled, [int(n) for n in keep.sum(1).tolist()], list(mask.cpu()))

    def _tokenize(self, captions: list[str]):
        if not self.truncate:
            counts = [len(ids) for ids in self.tokenizer(captions)["input_ids"]]
            long = [(i, n) for i, n in enumerate(counts) if n > self.max_length + self.crop_start]
            if long:
                i, n = long[0]
                raise InvalidArgumentError(f"captions[{i}] is {n} tokens, more than max_length={self.max_length} ({len(long)} "
                                           f"such captions; truncate=True cuts them as the pipelines do): {captions[i][:120]!r}")
        return self.tokenizer(captions, padding="max_length", max_length=self.max_length + self.crop_start, truncation=True,
                              return_tensors="pt")

    def identity(self) -> dict:
        config = {k: v for k, v in self.model.config.to_dict().items() if k not in _TEXT_CONFIG_NOISE}
        return {
            "class": f"transformers.{type(self.model).__name__}",
            "config": json.loads(json.dumps(config, default=str, sort_keys=True)),
            "weights_blake2b": self.weights_hash(),
            "dtype": str(self.dtype).removeprefix("torch."),
            "tokenizer": _tokenizer_identity(self.tokenizer),
            "hidden_state": self.hidden_state,
            "max_length": self.max_length,
            "pass_attention_mask": self.pass_attention_mask,
            "cut_to_mask": self.cut_to_mask,
            "truncate": self.truncate,
            "prefix": self.prefix,
            **({"template": self.template, "crop_start": self.crop_start} if self.template or self.crop_start else {}),
            "pooled": self.pooled_field,
        }

    def weights_hash(self) -> str:
        """BLAKE2b-128 over every parameter and buffer (computed once: the weights are frozen)."""
        if self._weights_hash is None:
            self._weights_hash = state_dict_hash(self.model)
        return self._weights_hash


def _check_captions(captions) -> list[str]:
    if isinstance(captions, str) or not isinstance(captions, (list, tuple)):
        raise ArgumentTypeError(f"captions must be a list of str, got {type(captions).__name__}")
    if not captions:
        raise InvalidArgumentError("captions must hold at least one caption, got an empty list")
    for i, caption in enumerate(captions):
        if not isinstance(caption, str):
            raise ArgumentTypeError(f"captions[{i}] must be a str, got {type(caption).__name__} ({caption!r:.80})")
    return list(captions)


def _text_layer(model, hidden_state) -> int:
    """``hidden_state`` checked against the model's ``hidden_states`` (layers + 1 embedding output)."""
    if isinstance(hidden_state, bool) or not isinstance(hidden_state, int):
        raise ArgumentTypeError(f"hidden_state must be an int, got {type(hidden_state).__name__}")
    states = int(model.config.num_hidden_layers if hasattr(model.config, "num_hidden_layers") else model.config.num_layers) + 1
    if not -states <= hidden_state < states:
        raise InvalidArgumentError(f"hidden_state must index the model's {states} hidden states (-{states} .. {states - 1}), "
                                   f"got {hidden_state}")
    return hidden_state


def _max_length(tokenizer, max_length) -> int:
    if max_length is None:
        max_length = tokenizer.model_max_length
        if max_length > 1_000_000:  # transformers' VERY_LARGE_INTEGER: the tokenizer sets no limit
            raise InvalidArgumentError("max_length is required: the tokenizer sets no model_max_length "
                                       "(e.g. 512 for Flux's T5, 256 for SD3's)")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
        raise InvalidArgumentError(f"max_length must be an int >= 1, got {max_length!r}")
    return max_length


def _tokenizer_identity(tokenizer) -> dict:
    """The tokenizer's class, limits and a BLAKE2b-128 of what maps text to ids (a fast tokenizer's whole
    definition; else the vocabulary, BPE merges and SentencePiece model it has)."""
    digest = hashlib.blake2b(digest_size=16)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # without the padding / truncation state each tokenizer call sets on it
        definition = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("padding", "truncation")}
        digest.update(json.dumps(definition, sort_keys=True).encode())
    else:
        digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
        ranks = getattr(tokenizer, "bpe_ranks", None)
        if ranks:
            digest.update(json.dumps(sorted((list(pair), r) for pair, r in ranks.items())).encode())
        sp_model = getattr(tokenizer, "sp_model", None)
        if sp_model is not None:
            digest.update(sp_model.serialized_model_proto())
    return {"class": type(tokenizer).__name__, "model_max_length": min(int(tokenizer.model_max_length), 2**31),
            "padding_side": tokenizer.padding_side, "blake2b": digest.hexdigest()}


@contextlib.contextmanager
def _no_accelerate_warning():
    logger, quiet = logging.getLogger("diffusers.models.modeling_utils"), NoAccelerateWarning()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
