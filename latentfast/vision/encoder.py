"""A step's vision items -> one latent per item, locally or with the encode work balanced across ranks.

:class:`VisionEncoder` is a small object over four injected collaborators (a cost source, the
balancing group, the encode function, the normalize dtype/device), so it can be built and
exercised without a real model or config.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from .balance import offload_encode
from .plan import Plan
from .units import build_units, check_item_layout, normalize_uint8_item, regroup_latents, validate_multiview_length


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


class VisionEncoder:
    """Encodes a step's vision items, optionally balancing the encode calls across the ``lb`` group.

    Args:
        tokenizer: the cost source, read for ``encode_seconds_benchmarked`` and
            ``predicted_encode_seconds(t, h, w)`` (an :class:`EncodeCostModel` has both). ``None``
            or an object without them makes balancing unavailable.
        parallel_dims: the balancing group (``lb_enabled``, ``lb_rank``, ``lb_size`` and
            ``lb_group`` or ``lb_mesh.get_group()``), e.g. :class:`BalanceGroup`; ``None`` = none.
        encode_fn: encodes one prepared tensor. Stored as the public attribute ``encode_fn`` and
            looked up on every call (late-bound): a timer wrapped around it later, or a caller
            passing ``lambda x: model.encode(x)`` and timing ``model.encode``, sees every call.
        fp32_kwargs: ``{"device": ..., "dtype": ...}`` for normalized views and received units.
            Taken from config rather than a tensor: a rank may have no items on a step and must
            still join the group's collectives.
    """

    def __init__(
        self,
        *,
        tokenizer: Any,
        parallel_dims: Any,
        encode_fn: Callable[[torch.Tensor], torch.Tensor],
        fp32_kwargs: dict[str, Any],
    ) -> None:
        if "device" not in fp32_kwargs:
            raise ValueError(f"fp32_kwargs must name a device, got {fp32_kwargs}")
        self.tokenizer = tokenizer
        self.parallel_dims = parallel_dims
        self.encode_fn = encode_fn
        self.device = torch.device(fp32_kwargs["device"])
        self.dtype = fp32_kwargs.get("dtype", torch.float32)
        self.last_plan: Plan | None = None  # the plan of the latest balanced step (makespan, bytes moved)

    def balancing_available(self) -> bool:
        """Whether this step may balance encode across the group.

        Depends only on config (the group) and the installed cost table, never on this rank's
        batch: ranks may draw different modalities on the same step, and a batch-dependent answer
        would let one rank skip the collectives its peers are blocked in.
        """
        return bool(
            self.parallel_dims is not None
            and self.parallel_dims.lb_enabled
            and getattr(self.tokenizer, "encode_seconds_benchmarked", False)
        )

    def _encode_prepared(self, tensor: torch.Tensor) -> torch.Tensor:
        """Encode one tensor already in the VAE's layout (through ``self.encode_fn``, late-bound)."""
        return self.encode_fn(tensor).contiguous().float()

    def encode_item(self, item: torch.Tensor, num_views: int = 1, frames_per_view: int | None = None) -> torch.Tensor:
        """Encode one item here. A multiview item is normalized and encoded one view at a time
        (peak memory: one normalized view) and its latents concatenated camera-major on T."""
        check_item_layout(item)
        if frames_per_view is None:
            if num_views != 1:
                raise ValueError(f"frames_per_view is required when num_views is greater than one, got num_views={num_views}")
            return self._encode_prepared(item)
        validate_multiview_length(item, num_views=num_views, frames_per_view=frames_per_view)
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
        if not (len(items) == len(num_views_per_item) == len(frames_per_item)):
            raise ValueError(
                "items, num_views_per_item and frames_per_item must have the same length, got "
                f"{len(items)}, {len(num_views_per_item)} and {len(frames_per_item)}"
            )
        return [self.encode_item(x, v, f) for x, v, f in zip(items, num_views_per_item, frames_per_item)]

    def _lb_group(self):
        mesh = getattr(self.parallel_dims, "lb_mesh", None)
        return mesh.get_group() if mesh is not None else self.parallel_dims.lb_group

    def encode_balanced(
        self, items: Sequence[torch.Tensor], num_views_per_item: Sequence[int], frames_per_item: Sequence[int | None]
    ) -> list[torch.Tensor]:
        """Encode every item with the encode calls spread across the group; same result as
        :meth:`encode_local`. Enters collectives unconditionally: call it on every rank of the
        group, after :meth:`balancing_available` said yes."""
        units, tensors, seconds, failure = [], [], [], None
        try:
            units = build_units(items, num_views_per_item, frames_per_item, dtype=self.dtype, device=self.device)
            tensors = [unit.tensor for unit in units]
            seconds = [
                self.tokenizer.predicted_encode_seconds(*t.shape[-3:]) * (t.shape[0] if t.ndim == 5 else 1)
                for t in tensors
            ]
        except Exception as exc:  # noqa: BLE001
            # Still enter the collectives, carrying the error: peers raise naming this rank
            # instead of waiting for it.
            units, tensors, seconds, failure = [], [], [], exc
        try:
            latents, self.last_plan = offload_encode(
                tensors,
                seconds,
                self._encode_prepared,
                group=self._lb_group(),
                group_rank=self.parallel_dims.lb_rank,
                group_size=self.parallel_dims.lb_size,
                device=self.device,
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
