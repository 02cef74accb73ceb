"""The balanced encode step in a real spawned gloo group (the demo and the benchmark share it).

:func:`demo_balanced_encode` runs a skewed step: rank 0 holds several multiview uint8 clips, the
other ranks little or nothing; every rank encodes its items locally (unbalanced) and balanced,
compares the two bit for bit, and reports the wall clock of both plus per-item checksums of the
balanced latents (so a caller can check them against its own encoding).

Import it from here (``latentfast.vision.demo``): ``import latentfast.vision`` does not load it,
the toy models or ``torch.multiprocessing``.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from ..testing import spawn_gloo
from ..toy import ToyVAE
from .cost import EncodeCostModel
from .balance import measure_link_bandwidth
from .encoder import BalanceGroup, VisionEncoder


def skewed_items(rank: int, world_size: int, *, views: int, frames: int, size: int, heavy_items: int, seed: int = 0):
    """A skewed step: rank 0 gets ``heavy_items`` uint8 multiview clips (``views`` cameras), rank 1
    one plain normalized clip, any further rank nothing. Returns ``(items, num_views, frames)``."""
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    if rank == 0:
        items = [torch.randint(0, 256, (3, views * frames, size, size), dtype=torch.uint8, generator=generator) for _ in range(heavy_items)]
        return items, [views] * heavy_items, [frames] * heavy_items
    if rank == 1:
        return [torch.rand((3, frames, size, size), generator=generator) * 2 - 1], [1], [None]
    return [], [], []


def checksums(latents: list[torch.Tensor]) -> list[tuple[float, float]]:
    """``(sum, sum of squares)`` of every latent, in float64."""
    return [(float(t.double().sum()), float(t.double().square().sum())) for t in latents]


def _skewed_step(rank: int, world_size: int, config: dict) -> dict:
    vae = ToyVAE(hidden=config["hidden"])

    def encode(clip: torch.Tensor) -> torch.Tensor:
        if config["device_seconds"]:
            time.sleep(config["device_seconds"])  # the CPU idles while a device would encode
        return vae.encode_video(clip)

    costs = EncodeCostModel.measure(encode, [(config["frames"], config["size"], config["size"])], repeats=3)
    link = measure_link_bandwidth(nbytes=1 << 20, repeats=3) if config["transfer_aware"] else None
    encoder = VisionEncoder(cost_model=costs, parallel_dims=BalanceGroup(), encode_fn=encode, device="cpu", link_bandwidth=link)
    items, views, frames = skewed_items(
        rank, world_size, views=config["views"], frames=config["frames"], size=config["size"], heavy_items=config["heavy_items"]
    )
    if not encoder.balancing_available():
        raise RuntimeError("balancing should be available in a spawned gloo group with a measured cost table")

    def timed(step) -> tuple[float, list[torch.Tensor]]:
        dist.barrier()
        start = time.perf_counter()
        out = step()
        dist.barrier()  # the step ends when the slowest rank is done
        return time.perf_counter() - start, out

    local_times, balanced_times, equal = [], [], True
    for _ in range(config["repeats"]):
        seconds, local = timed(lambda: encoder.encode_local(items, views, frames))
        local_times.append(seconds)
        seconds, balanced = timed(lambda: encoder.encode_balanced(items, views, frames))
        balanced_times.append(seconds)
        equal = equal and len(local) == len(balanced) and all(torch.equal(a, b) for a, b in zip(local, balanced))
    plan = encoder.last_plan
    return {
        "rank": rank,
        "items": len(items),
        "equal_to_local": equal,
        "checksums": checksums(balanced),
        "planned_speedup": plan.home_makespan / plan.step_seconds,
        "moved_units": plan.moved_units,
        "moved_bytes": plan.moved_bytes,
        "link_bandwidth": link,
        "unbalanced_s": statistics.median(local_times),
        "balanced_s": statistics.median(balanced_times),
    }


def demo_balanced_encode(
    world_size: int = 2,
    *,
    views: int = 4,
    frames: int = 8,
    size: int = 64,
    heavy_items: int = 3,
    hidden: int = 16,
    device_seconds: float = 0.02,
    transfer_aware: bool = False,
    repeats: int = 3,
    timeout_s: float = 60.0,
) -> dict:
    """Spawn a ``world_size`` gloo group, encode a skewed step unbalanced and balanced with the toy
    VAE, and return the timings (medians over ``repeats``, measured on rank 0 between barriers),
    the speedup, the plan's predicted one, whether every rank's balanced latents equal its local
    encoding bit for bit (``equal_to_local``), and every rank's latent checksums.

    ``hidden`` sizes the toy VAE's compute (one core per rank). ``device_seconds`` adds that much
    idle wait to every encode call, standing in for a GPU encode during which the host CPU is
    free: then the step's time does not depend on how many CPU cores other work leaves free.
    ``transfer_aware`` measures the link between the ranks and plans with the transfers counted."""
    config = dict(
        views=views, frames=frames, size=size, heavy_items=heavy_items, hidden=hidden, device_seconds=device_seconds,
        transfer_aware=transfer_aware, repeats=repeats,
    )  # fmt: skip
    results = spawn_gloo(_skewed_step, world_size, config, timeout_s=timeout_s)
    for result in results:
        if isinstance(result, BaseException):
            raise RuntimeError(f"a rank of the demo failed: {result!r}") from result
    unbalanced, balanced = results[0]["unbalanced_s"], results[0]["balanced_s"]
    return {
        "world_size": world_size,
        "config": config,
        "items_per_rank": [r["items"] for r in results],
        "equal_to_local": all(r["equal_to_local"] for r in results),
        "checksums_per_rank": [r["checksums"] for r in results],
        "unbalanced_s": unbalanced,
        "balanced_s": balanced,
        "speedup": unbalanced / balanced,
        "planned_speedup": results[0]["planned_speedup"],
        "moved_units": results[0]["moved_units"],
        "moved_bytes": results[0]["moved_bytes"],
        "link_bandwidth": results[0]["link_bandwidth"],
    }
