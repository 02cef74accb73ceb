"""The specification-era names, importable from here only, each with a DeprecationWarning; the main namespaces hold the clean names.

- ``MultiRepresentationFreshVideoGradCache`` / ``...Result``: :class:`latentfast.replay.FeatureGradientReplay` / ``...Result``;
- ``get_vae_pixel_shapes`` / ``regroup_vision_latents``: :func:`latentfast.vision.vae_pixel_shapes` / ``regroup_latents``;
- :class:`VisionEncoder` taking ``tokenizer=`` (for ``cost_model=``) and ``fp32_kwargs={"device", "dtype"}``
  (for ``device=`` / ``dtype=``), with the ``tokenizer`` attribute;
- :func:`normalize_uint8_item` taking ``fp32_kwargs`` as its second argument.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch

from .devices import as_device
from .errors import InvalidArgumentError
from .replay.gradcache import FeatureGradientReplay, FeatureGradientReplayResult
from .vision import encoder as _encoder
from .vision import units as _units

_ALIASES = {
    "MultiRepresentationFreshVideoGradCache": (FeatureGradientReplay, "latentfast.replay.FeatureGradientReplay"),
    "MultiRepresentationFreshVideoGradCacheResult": (FeatureGradientReplayResult, "latentfast.replay.FeatureGradientReplayResult"),
    "get_vae_pixel_shapes": (_units.vae_pixel_shapes, "latentfast.vision.vae_pixel_shapes"),
    "regroup_vision_latents": (_units.regroup_latents, "latentfast.vision.regroup_latents"),
}
_UNSET = object()

__all__ = [*_ALIASES, "VisionEncoder", "normalize_uint8_item"]


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is the specification's name; use {new}", DeprecationWarning, stacklevel=3)


def __getattr__(name: str):
    if name in _ALIASES:
        target, new = _ALIASES[name]
        _deprecated(f"latentfast.compat.{name}", new)
        return target
    raise AttributeError(f"module 'latentfast.compat' has no attribute {name!r}")


def check_fp32_kwargs(fp32_kwargs) -> None:
    """The specification's ``fp32_kwargs``: a dict of ``device`` and/or ``dtype``."""
    if not isinstance(fp32_kwargs, dict) or set(fp32_kwargs) - {"device", "dtype"}:
        raise InvalidArgumentError(f"fp32_kwargs must be a dict with 'device' and/or 'dtype', got {fp32_kwargs!r}")


class VisionEncoder(_encoder.VisionEncoder):
    """:class:`latentfast.vision.VisionEncoder` also taking the specification's ``tokenizer=`` and
    ``fp32_kwargs=`` (each instead of its clean keywords, not beside them)."""

    def __init__(self, *, cost_model: Any = _UNSET, tokenizer: Any = _UNSET, fp32_kwargs: dict | None = None,
                 device=None, dtype=None, **kwargs) -> None:
        if tokenizer is not _UNSET:
            _deprecated("VisionEncoder(tokenizer=)", "cost_model=")
            if cost_model is not _UNSET:
                raise InvalidArgumentError("pass cost_model= or its alias tokenizer=, not both")
            cost_model = tokenizer
        if fp32_kwargs is not None:
            _deprecated("VisionEncoder(fp32_kwargs=)", "device= and dtype=")
            check_fp32_kwargs(fp32_kwargs)
            if device is not None or dtype is not None:
                raise InvalidArgumentError("pass device=/dtype= or their alias fp32_kwargs=, not both")
            device, dtype = fp32_kwargs.get("device"), fp32_kwargs.get("dtype")
        super().__init__(cost_model=None if cost_model is _UNSET else cost_model, device=device, dtype=dtype, **kwargs)

    @property
    def tokenizer(self) -> Any:
        """Alias of :attr:`cost_model` (the specification's name)."""
        return self.cost_model


def normalize_uint8_item(x: torch.Tensor, fp32_kwargs: dict | None = None, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`latentfast.vision.normalize_uint8_item` with the specification's ``fp32_kwargs``
    (``{"device": ..., "dtype": ...}``): the item is moved to that device first (at 1 byte per
    element) and normalized to that dtype."""
    if fp32_kwargs is not None:
        _deprecated("normalize_uint8_item(x, fp32_kwargs)", "normalize_uint8_item(x.to(device), dtype=dtype)")
        check_fp32_kwargs(fp32_kwargs)
        if "device" in fp32_kwargs:
            x = x.to(as_device(fp32_kwargs["device"]))
        dtype = fp32_kwargs.get("dtype", dtype)
    return _units.normalize_uint8_item(x, dtype=dtype)
