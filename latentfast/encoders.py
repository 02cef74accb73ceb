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

diffusers is an optional dependency (``pip install latentfast[diffusers]``); importing this
module does not import it.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import torch

from .errors import ArgumentTypeError, InvalidArgumentError

IMAGE_VAES = ("AutoencoderKL",)  # 2-D VAEs: [B, 3, H, W]; the others take [B, 3, T, H, W]
VIDEO_VAES = ("AutoencoderKLWan", "AutoencoderKLQwenImage", "AutoencoderKLHunyuanVideo",
              "AutoencoderKLCogVideoX", "AutoencoderKLLTXVideo")
SAMPLE_MODES = ("mode", "sample")
_CONFIG_NOISE = ("_name_or_path", "_diffusers_version", "_use_default_values", "_class_name")


class DiffusersVAE:
    """A diffusers VAE as a latent-cache encoder.

    Args:
        vae: an instance of one of the supported classes (:data:`IMAGE_VAES`, :data:`VIDEO_VAES`),
            e.g. ``AutoencoderKL.from_pretrained(path, subfolder="vae")``. It is put in eval mode
            and never trained here.
        sample: ``"mode"`` (the posterior's mode, deterministic: what most trainers cache) or
            ``"sample"`` (a draw from the posterior, seeded: pass ``seeds`` to :meth:`encode` for
            one seed per item, which the builders do so a resumed build draws the same noise).
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
    def encode(self, images: torch.Tensor, *, seeds=None) -> torch.Tensor:
        """``images [B, 3, H, W]`` in [-1, 1] -> float32 normalized latents ``[B, C, H/f, W/f]``."""
        _check_pixels(images, 4, "images")
        if self.is_video_vae:
            return self._latents(images.unsqueeze(2), seeds).squeeze(2)
        return self._latents(images, seeds)

    @torch.no_grad()
    def encode_video(self, clips: torch.Tensor, *, seeds=None) -> torch.Tensor:
        """``clips [B, 3, T, H, W]`` in [-1, 1] -> float32 normalized latents ``[B, C, T', H/f, W/f]``
        (an image VAE encodes each frame: ``T' = T``)."""
        _check_pixels(clips, 5, "clips")
        if self.is_video_vae:
            return self._latents(clips, seeds)
        B, _, T, H, W = clips.shape
        frames = clips.permute(0, 2, 1, 3, 4).reshape(B * T, 3, H, W)
        frame_seeds = None if seeds is None else [int(s) * 1000003 + t for s in seeds for t in range(T)]
        z = self._latents(frames, frame_seeds)
        return z.reshape(B, T, *z.shape[1:]).permute(0, 2, 1, 3, 4).contiguous()

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
            digest = hashlib.blake2b(digest_size=16)
            for name, tensor in sorted(self.vae.state_dict().items()):
                tensor = tensor.detach().to("cpu").contiguous()
                digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}\n".encode())
                digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
            self._weights_hash = digest.hexdigest()
        return self._weights_hash

    def _latents(self, pixels: torch.Tensor, seeds) -> torch.Tensor:
        dist = self.vae.encode(pixels.to(self.device, self.dtype)).latent_dist
        if self.sample == "mode":
            z = dist.mode()
        else:
            z = dist.mean + dist.std * self._noise(dist.mean, seeds)
        z = z.float()
        shape = (1, -1) + (1,) * (z.ndim - 2)
        if self._mean is not None:
            mean, std = self._mean.to(z.device).view(shape), self._std.to(z.device).view(shape)
            return (z - mean) * self._scale / std
        return (z - self._shift) * self._scale

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


def load_diffusers_vae(spec: str, *, sample: str = "mode", seed: int = 0, dtype: str | None = None) -> DiffusersVAE:
    """A :class:`DiffusersVAE` from a folder saved with ``save_pretrained`` (``PATH``, its class read
    from ``config.json``; a ``vae/`` subfolder is used when present) or ``CLASS:PATH``."""
    import os

    import diffusers

    name, sep, path = spec.partition(":")
    if not sep or os.path.exists(spec):
        name, path = None, spec
    if os.path.isfile(os.path.join(path, "vae", "config.json")):
        path = os.path.join(path, "vae")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise InvalidArgumentError(f"--encoder diffusers:PATH needs a folder with a config.json (a diffusers save_pretrained folder), got {path!r}")
    if name is None:
        with open(config_path, encoding="utf-8") as fh:
            name = json.load(fh).get("_class_name")
    cls = getattr(diffusers, str(name), None)
    if cls is None or str(name) not in IMAGE_VAES + VIDEO_VAES:
        raise InvalidArgumentError(f"diffusers VAE class must be one of {IMAGE_VAES + VIDEO_VAES}, got {name!r}")
    torch_dtype = getattr(torch, dtype) if dtype else None
    return DiffusersVAE(cls.from_pretrained(path, torch_dtype=torch_dtype), sample=sample, seed=seed)
