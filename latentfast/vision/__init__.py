"""Vision encode units and cross-rank VAE encode balancing.

units: items -> encode calls (fused normalize + multiview split) -> one latent per item;
plan: the deterministic step-time planner; balance: offload_encode over torch.distributed;
encoder: VisionEncoder (local or balanced); cost: EncodeCostModel (measured seconds per shape).
The specification's names (``get_vae_pixel_shapes``, ``regroup_vision_latents``, ``tokenizer=``,
``fp32_kwargs=``) live in :mod:`latentfast.compat`. The spawned-group demo lives in :mod:`latentfast.vision.demo` (imported on its own, so importing
this package stays light).
"""
from .balance import OffloadEncodeError, measure_link_bandwidth, offload_encode
from .cost import EncodeCostModel
from .encoder import BalanceGroup, VisionEncoder
from .plan import Plan, lpt_makespan, plan_assignment
from .units import (
    VisionEncodeUnit,
    build_units,
    normalize_uint8_item,
    regroup_latents,
    vae_pixel_shapes,
    validate_multiview_length,
)

__all__ = [
    "BalanceGroup",
    "EncodeCostModel",
    "OffloadEncodeError",
    "Plan",
    "VisionEncodeUnit",
    "VisionEncoder",
    "build_units",
    "lpt_makespan",
    "measure_link_bandwidth",
    "normalize_uint8_item",
    "offload_encode",
    "plan_assignment",
    "regroup_latents",
    "vae_pixel_shapes",
    "validate_multiview_length",
]
