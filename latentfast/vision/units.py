"""A step's raw vision items -> the individual VAE encode calls they cost, and latents back per item.

A plain item (an already prepared clip) is one encode call. A camera-major multiview item, uint8
``[..., C, V*F, H, W]``, is one encode call per camera view: splitting it lets the balancer move
a single view to another rank, and keeps the amount of planned work equal to the number of
encode calls for every kind of batch.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from .. import ops
from ..checks import as_int
from ..devices import as_device
from ..errors import ArgumentTypeError, InvalidArgumentError


@dataclasses.dataclass(frozen=True)
class VisionEncodeUnit:
    """One encode call: the tensor to encode and the index of the item its latent belongs to."""

    item_index: int
    tensor: torch.Tensor


def check_item_layout(item: torch.Tensor, name: str = "item") -> None:
    """Raise unless ``item`` is a ``[C,T,H,W]`` or ``[B,C,T,H,W]`` tensor."""
    if not isinstance(item, torch.Tensor):
        raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(item).__name__}")
    if item.ndim not in (4, 5):
        raise InvalidArgumentError(f"{name}: VAE inputs must have shape [C,T,H,W] or [B,C,T,H,W], got {tuple(item.shape)}")


def vae_pixel_shapes(items: Sequence[torch.Tensor | None] | None) -> list[tuple[int, int, int]]:
    """Pixel-space ``(T, H, W)`` of every non-``None`` item, in order (cost prediction, FLOPs)."""
    if items is None:
        return []
    shapes = []
    for index, item in enumerate(items):
        if item is None:
            continue
        check_item_layout(item, f"items[{index}]")
        t, h, w = item.shape[-3:]
        shapes.append((int(t), int(h), int(w)))
    return shapes


def normalize_uint8_item(x: torch.Tensor, *, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """uint8 pixels -> ``x / 127.5 - 1`` in ``dtype`` (the fused op; non-uint8 input is an error)."""
    return ops.normalize_uint8(x, dtype=dtype)


def validate_multiview_length(x: torch.Tensor, *, num_views: int, frames_per_view: int) -> None:
    """Check a camera-major multiview item packs exactly ``num_views * frames_per_view`` frames on T."""
    num_views = as_int("num_views", num_views, minimum=1)
    frames_per_view = as_int("frames_per_view", frames_per_view, minimum=1)
    frames = int(x.shape[x.ndim - 3])
    if frames != num_views * frames_per_view:
        raise InvalidArgumentError(
            "multiview item length must equal num_views * frames_per_view: "
            f"got T={frames}, num_views={num_views}, frames_per_view={frames_per_view}"
        )


def check_item_lists(items, num_views_per_item, frames_per_item) -> None:
    """The three per-item lists of a step line up, and every item is a ``[C,T,H,W]`` /
    ``[B,C,T,H,W]`` tensor (checked before any item is touched)."""
    if not (len(items) == len(num_views_per_item) == len(frames_per_item)):
        raise InvalidArgumentError(
            "items, num_views_per_item and frames_per_item must have the same length, got "
            f"{len(items)}, {len(num_views_per_item)} and {len(frames_per_item)}"
        )
    for index, item in enumerate(items):
        if item is None:
            raise InvalidArgumentError(f"items[{index}] is None; drop items without vision before building units")
        check_item_layout(item, f"items[{index}]")


def item_views(item: torch.Tensor, num_views, frames, names: tuple[str, str] = ("num_views", "frames_per_view")) -> tuple[int, int | None]:
    """How an item splits into encode calls: ``(num_views, frames per view)`` as ints, with
    ``frames`` ``None`` for a plain item (one call on the tensor as it is, ``num_views`` must be 1)
    and otherwise a multiview item whose T is ``num_views * frames``. ``names`` name the two
    arguments in error messages."""
    num_views = as_int(names[0], num_views, minimum=1)
    if frames is None:
        if num_views != 1:
            raise InvalidArgumentError(f"{names[1]} is required when num_views is greater than one, got {names[0]}={num_views}")
        return 1, None
    frames = as_int(names[1], frames, minimum=1)
    validate_multiview_length(item, num_views=num_views, frames_per_view=frames)
    return num_views, frames


def build_units(
    items: Sequence[torch.Tensor],
    num_views_per_item: Sequence[int],
    frames_per_item: Sequence[int | None],
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> list[VisionEncodeUnit]:
    """Split items into the encode calls they cost, in item order.

    - ``frames_per_item[i] is None``: the item is one unit holding the item tensor unchanged
      (``num_views_per_item[i]`` must then be 1).
    - otherwise the item is uint8 camera-major multiview with ``T == num_views * frames``; it
      becomes ``num_views`` units, one normalized ``dtype`` view each, produced by a single fused
      normalize+split pass over the item (not one pass per view). Views are materialized here
      because a unit may be shipped to another rank, so it must hold a real tensor.

    ``device``: where normalized views live (the uint8 item is moved first, at 1 byte/element);
    ``None`` keeps the item's device.
    """
    check_item_lists(items, num_views_per_item, frames_per_item)
    units: list[VisionEncodeUnit] = []
    for index, (item, num_views, frames) in enumerate(zip(items, num_views_per_item, frames_per_item)):
        num_views, frames = item_views(item, num_views, frames, (f"num_views_per_item[{index}]", f"frames_per_item[{index}]"))
        if frames is None:
            units.append(VisionEncodeUnit(index, item))
            continue
        if device is not None:
            item = item.to(as_device(device))
        views = ops.normalize_uint8(item, num_views=num_views, dtype=dtype)
        views = [views] if num_views == 1 else views
        units.extend(VisionEncodeUnit(index, view) for view in views)
    return units


def regroup_latents(
    units: Sequence[VisionEncodeUnit], latents: Sequence[torch.Tensor], items: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """One latent per item, in item order.

    A multiview item's view latents are concatenated camera-major along the item's temporal axis
    (``item.ndim - 3``; encoding preserves rank, so the same axis holds in latent space).
    """
    if len(units) != len(latents):
        raise InvalidArgumentError(f"got {len(latents)} latents for {len(units)} units")
    per_item: list[list[torch.Tensor]] = [[] for _ in items]
    for unit, latent in zip(units, latents):
        if not 0 <= unit.item_index < len(items):
            raise InvalidArgumentError(f"unit item_index {unit.item_index} is out of range for {len(items)} items")
        per_item[unit.item_index].append(latent)
    regrouped = []
    for index, (parts, item) in enumerate(zip(per_item, items)):
        if not parts:
            raise InvalidArgumentError(f"items[{index}] has no encoded unit")
        regrouped.append(parts[0] if len(parts) == 1 else torch.cat(parts, dim=item.ndim - 3))
    return regrouped
