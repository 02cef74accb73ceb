"""A step's vision items -> one latent per item, locally or with the encode work balanced across ranks.

:class:`VisionEncoder` is a small object over injected collaborators (a cost model, the balancing
group, the encode function, the normalize device/dtype), so it can be built and exercised without
a real model or config.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..devices import as_device
from ..errors import ArgumentTypeError, InvalidArgumentError
from .balance import offload_encode
from .plan import Plan, as_bandwidth
from .units import VisionEncodeUnit, build_units, check_item_layout, check_item_lists, item_views, normalize_uint8_item, regroup_latents


@dataclasses.dataclass(frozen=True)
class BalanceGroup:
    """The minimal ``parallel_dims`` a :class:`VisionEncoder` reads: the load-balancing group.

    ``group=None`` is the default process group. A real trainer may pass its own object with
    ``lb_enabled``, ``lb_rank``, ``lb_size`` and ``lb_mesh.get_group()`` instead.
    """

    group: Any = None
    enabled: bool = True

    @property
    def lb_enabled(self) -> bool:
        return self.enabled and dist.is_available() and dist.is_initialized()

    @property
    def lb_group(self):
        return self.group

    @property
    def lb_rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def lb_size(self) -> int:
        return dist.get_world_size(self.group)


def _device_and_dtype(device, dtype) -> tuple[torch.device, torch.dtype]:
    if device is None:
        raise InvalidArgumentError("device is required (where normalized views and received units live), e.g. device='cuda'")
    dtype = torch.float32 if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ArgumentTypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    return as_device(device), dtype


class VisionEncoder:
    """Encodes a step's vision items, optionally balancing the encode calls across the ``lb`` group.

    Args:
        cost_model: the cost source, read for ``encode_seconds_benchmarked`` and
            ``predicted_encode_seconds(t, h, w)`` (an :class:`EncodeCostModel` has both, and
            ``predicted_latent_bytes`` for transfer-aware plans). ``None`` or an object without
            them makes balancing unavailable. (The specification's ``tokenizer=`` and
            ``fp32_kwargs=`` are taken by :class:`latentfast.compat.VisionEncoder`.)
        parallel_dims: the balancing group (``lb_enabled``, ``lb_rank``, ``lb_size`` and
            ``lb_group`` or ``lb_mesh.get_group()``), e.g. :class:`BalanceGroup`; ``None`` = none.
        encode_fn: encodes one prepared tensor. Stored as the public attribute ``encode_fn`` and
            looked up on every call (late-bound): a timer wrapped around it later, or a caller
            passing ``lambda x: model.encode(x)`` and timing ``model.encode``, sees every call.
        device: where normalized views and received units live (``"cuda"`` = the current CUDA
            device). Taken from config rather than a tensor: a rank may have no items on a step
            and must still join the group's collectives.
        dtype: the normalized views' dtype (default float32).
        link_bandwidth: bytes per second of each rank's link, the same on every rank (e.g. from
            :func:`~latentfast.vision.balance.measure_link_bandwidth`). When given, the plan
            counts the transfers (pixels out, latents back) and minimizes the predicted step time.
    """

    def __init__(
        self,
        *,
        cost_model: Any = None,
        parallel_dims: Any = None,
        encode_fn: Callable[[torch.Tensor], torch.Tensor],
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        link_bandwidth: float | None = None,
    ) -> None:
        self.cost_model = cost_model
        self.device, self.dtype = _device_and_dtype(device, dtype)
        self.parallel_dims = parallel_dims
        self.encode_fn = encode_fn
        self.link_bandwidth = as_bandwidth(link_bandwidth, "link_bandwidth")
        self.last_plan: Plan | None = None  # the plan of the latest balanced step (step time, bytes moved)

    def balancing_available(self) -> bool:
        """Whether this step may balance encode across the group.

        Depends only on config (the group) and the installed cost table, never on this rank's
        batch: ranks may draw different modalities on the same step, and a batch-dependent answer
        would let one rank skip the collectives its peers are blocked in.
        """
        return bool(
            self.parallel_dims is not None
            and self.parallel_dims.lb_enabled
            and getattr(self.cost_model, "encode_seconds_benchmarked", False)
        )

    def _encode_prepared(self, tensor: torch.Tensor) -> torch.Tensor:
        """Encode one tensor already in the VAE's layout (through ``self.encode_fn``, late-bound)."""
        return self.encode_fn(tensor).contiguous().float()

    def encode_item(self, item: torch.Tensor, num_views: int = 1, frames_per_view: int | None = None) -> torch.Tensor:
        """Encode one item here. A multiview item is normalized and encoded one view at a time
        (peak memory: one normalized view) and its latents concatenated camera-major on T."""
        check_item_layout(item)
        num_views, frames_per_view = item_views(item, num_views, frames_per_view)
        if frames_per_view is None:
            return self._encode_prepared(item)
        item = item.to(self.device)
        time_axis = item.ndim - 3
        latents = [
            self._encode_prepared(normalize_uint8_item(item.narrow(time_axis, v * frames_per_view, frames_per_view), dtype=self.dtype))
            for v in range(num_views)
        ]
        return latents[0] if num_views == 1 else torch.cat(latents, dim=time_axis)

    def encode_local(
        self, items: Sequence[torch.Tensor], num_views_per_item: Sequence[int], frames_per_item: Sequence[int | None]
    ) -> list[torch.Tensor]:
        """Encode every item on this rank (the reference the balanced path must equal)."""
        check_item_lists(items, num_views_per_item, frames_per_item)
        return [self.encode_item(x, v, f) for x, v, f in zip(items, num_views_per_item, frames_per_item)]

    def _lb_group(self):
        mesh = getattr(self.parallel_dims, "lb_mesh", None)
        return mesh.get_group() if mesh is not None else self.parallel_dims.lb_group

    def _unit_costs(self, units: list[VisionEncodeUnit]) -> tuple[list[float], list[int] | None]:
        """Predicted seconds of every unit and, for transfer-aware plans, its latent's bytes."""
        # latent sizes only matter to a transfer-aware plan (and cost a model lookup per unit)
        latent_bytes = getattr(self.cost_model, "predicted_latent_bytes", lambda *_: None)
        seconds: list[float] = []
        latent: list[int] | None = [] if self.link_bandwidth is not None else None
        for unit in units:
            t = unit.tensor
            clips = t.shape[0] if t.ndim == 5 else 1
            seconds.append(self.cost_model.predicted_encode_seconds(*t.shape[-3:]) * clips)
            if latent is not None:
                size = latent_bytes(*t.shape[-3:])
                latent.append(0 if size is None else size * clips)
        return seconds, latent

    def encode_balanced(
        self, items: Sequence[torch.Tensor], num_views_per_item: Sequence[int], frames_per_item: Sequence[int | None]
    ) -> list[torch.Tensor]:
        """Encode every item with the encode calls spread across the group; same result as
        :meth:`encode_local`. Enters collectives unconditionally: call it on every rank of the
        group, after :meth:`balancing_available` said yes."""
        units, seconds, latent, failure = [], [], None, None
        try:
            units = build_units(items, num_views_per_item, frames_per_item, dtype=self.dtype, device=self.device)
            seconds, latent = self._unit_costs(units)
        except Exception as exc:  # noqa: BLE001
            # Still enter the collectives, carrying the error: peers raise naming this rank
            # instead of waiting for it.
            units, seconds, latent, failure = [], [], None, exc
        try:
            latents, self.last_plan = offload_encode(
                [unit.tensor for unit in units],
                seconds,
                self._encode_prepared,
                group=self._lb_group(),
                group_rank=self.parallel_dims.lb_rank,
                group_size=self.parallel_dims.lb_size,
                device=self.device,
                bandwidth=self.link_bandwidth,
                local_latent_bytes=latent,
                return_plan=True,
                failure=failure,
            )
        finally:
            failure = None  # this frame must not keep its own exception (a cycle that outlives the group)
        return regroup_latents(units, latents, items)

    def encode(
        self, items: Sequence[torch.Tensor], num_views_per_item: Sequence[int], frames_per_item: Sequence[int | None]
    ) -> list[torch.Tensor]:
        """Balanced when available (a rank-uniform decision), local otherwise."""
        if self.balancing_available():
            return self.encode_balanced(items, num_views_per_item, frames_per_item)
        return self.encode_local(items, num_views_per_item, frames_per_item)
