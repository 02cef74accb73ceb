"""Balanced VAE encode across a torch.distributed group, end to end.

Every rank brings its own step's vision items -- here rank 0 a heavy batch of 4-camera uint8 clips
and every other rank a single clip. latentfast splits the items into the encode calls they cost,
spreads those calls so every rank does a comparable share, and hands each rank its own latents
back, in order, equal to encoding them locally.

Run it with torchrun (gloo on CPU; NCCL when every rank has a GPU):

    torchrun --standalone --nproc_per_node 2 examples/balanced_encode.py

The toy VAE stands in for yours: pass your model's encode as ``encode_fn``.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from latentfast.toy import ToyVAE
from latentfast.vision import BalanceGroup, EncodeCostModel, VisionEncoder, measure_link_bandwidth

VIEWS, FRAMES, SIZE = 4, 8, 64


def step_items(rank: int):
    """This rank's batch: uint8 camera-major clips ``[3, VIEWS * FRAMES, SIZE, SIZE]``, three on
    rank 0 and one elsewhere; returns ``(items, num_views_per_item, frames_per_item)``."""
    generator = torch.Generator().manual_seed(rank)
    count = 3 if rank == 0 else 1
    items = [torch.randint(0, 256, (3, VIEWS * FRAMES, SIZE, SIZE), dtype=torch.uint8, generator=generator) for _ in range(count)]
    return items, [VIEWS] * count, [FRAMES] * count


def main() -> int:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = "cuda" if backend == "nccl" else "cpu"
    rank = dist.get_rank()
    vae = ToyVAE(hidden=256).to(device)  # enough compute per clip that moving one pays off
    items, num_views_per_item, frames_per_item = step_items(rank)

    # --8<-- [start:balanced-encode]
    costs = EncodeCostModel.measure(vae.encode_video, [(FRAMES, SIZE, SIZE)], device=device)  # every rank; merged by max
    encoder = VisionEncoder(
        cost_model=costs,
        parallel_dims=BalanceGroup(),  # the default group, or your trainer's parallel_dims
        encode_fn=lambda x: vae.encode_video(x),  # late-bound: a timer wrapped around encode sees every call
        device=device,
        link_bandwidth=measure_link_bandwidth(device=device),  # optional: the plan counts the transfers
    )
    latents = encoder.encode(items, num_views_per_item, frames_per_item)  # balanced iff available on every rank
    # --8<-- [end:balanced-encode]

    local = encoder.encode_local(items, num_views_per_item, frames_per_item)
    equal = torch.tensor([float(len(latents) == len(local) and all(torch.equal(a, b) for a, b in zip(latents, local)))], device=device)
    dist.all_reduce(equal, op=dist.ReduceOp.MIN)
    plan = encoder.last_plan
    if rank == 0:
        print(f"units per rank: {[len(a) for a in plan.assignment]}, moved: {plan.moved_units} ({plan.moved_bytes / 1e6:.1f} MB)")
        print(f"predicted step: {plan.home_makespan * 1e3:.1f} ms unbalanced -> {plan.step_seconds * 1e3:.1f} ms balanced "
              f"(link {encoder.link_bandwidth / 1e9:.2f} GB/s, transfers counted)")  # fmt: skip
        print("balanced latents equal local encoding on every rank" if equal.item() else "MISMATCH: balanced latents differ")
    dist.destroy_process_group()
    return 0 if equal.item() else 1


if __name__ == "__main__":
    sys.exit(main())
