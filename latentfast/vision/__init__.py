"""Vision encode units and cross-rank VAE encode balancing.

units: items -> encode calls (fused normalize + multiview split) -> one latent per item;
plan: the deterministic makespan planner; balance: offload_encode over torch.distributed;
encoder: VisionEncoder (local or balanced); cost: EncodeCostModel (measured seconds per shape).
"""
from .balance import OffloadEncodeError, offload_encode
from .cost import EncodeCostModel
from .demo import demo_balanced_encode, spawn_gloo
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
    "demo_balanced_encode",
    "lpt_makespan",
    "normalize_uint8_item",
    "offload_encode",
    "plan_assignment",
    "regroup_latents",
    "spawn_gloo",
    "vae_pixel_shapes",
    "validate_multiview_length",
]
