"""Run the balanced encode step in a real spawned gloo group (demo, benchmark and tests share this).

:func:`spawn_gloo` starts ``world_size`` processes in a fresh gloo group (rendezvous through a
FileStore in a temporary folder) and returns what each rank's function returned.
:func:`demo_balanced_encode` runs a skewed step: rank 0 holds several multiview uint8 clips, the
other ranks little or nothing; every rank encodes its items locally (unbalanced) and balanced,
checks the balanced latents equal the local ones bit for bit, and reports the wall clock of both.
"""
from __future__ import annotations

import datetime
import os
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..toy import ToyVAE
from .cost import EncodeCostModel
from .encoder import BalanceGroup, VisionEncoder


def _spawned_rank(rank: int, world_size: int, folder: str, timeout_s: float, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)  # one core per rank: the ranks stand for separate machines
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(folder, 'store')}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world_size, *args)
    except BaseException as exc:
        result = exc
    finally:
        dist.destroy_process_group()
    with open(os.path.join(folder, f"result{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def spawn_gloo(fn: Callable, world_size: int, *args, timeout_s: float = 60.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on every rank of a new gloo group; return the results
    in rank order. An exception raised on a rank is returned (not raised) as that rank's result.
    ``fn`` must be importable by name (module level); ``timeout_s`` is the group's timeout."""
    with tempfile.TemporaryDirectory(prefix="latentfast_gloo_") as folder:
        mp.start_processes(_spawned_rank, args=(world_size, folder, timeout_s, fn, args), nprocs=world_size, start_method="spawn")
        results = []
        for rank in range(world_size):
            with open(os.path.join(folder, f"result{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results


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


def _skewed_step(rank: int, world_size: int, config: dict) -> dict:
    vae = ToyVAE(hidden=config["hidden"])

    def encode(clip: torch.Tensor) -> torch.Tensor:
        if config["device_seconds"]:
            time.sleep(config["device_seconds"])  # the CPU idles while a device would encode
        return vae.encode_video(clip)

    costs = EncodeCostModel.measure(encode, [(config["frames"], config["size"], config["size"])], repeats=3)
    encoder = VisionEncoder(
        tokenizer=costs, parallel_dims=BalanceGroup(), encode_fn=encode, fp32_kwargs={"device": "cpu", "dtype": torch.float32}
    )
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

    local_times, balanced_times = [], []
    for _ in range(config["repeats"]):
        seconds, local = timed(lambda: encoder.encode_local(items, views, frames))
        local_times.append(seconds)
        seconds, balanced = timed(lambda: encoder.encode_balanced(items, views, frames))
        balanced_times.append(seconds)
        if len(local) != len(balanced) or not all(torch.equal(a, b) for a, b in zip(local, balanced)):
            raise AssertionError(f"rank {rank}: balanced latents differ from local encoding")
    plan = encoder.last_plan
    return {
        "rank": rank,
        "items": len(items),
        "planned_speedup": plan.home_makespan / plan.makespan,
        "moved_units": plan.moved_units,
        "moved_bytes": plan.moved_bytes,
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
    repeats: int = 3,
    timeout_s: float = 60.0,
) -> dict:
    """Spawn a ``world_size`` gloo group, encode a skewed step unbalanced and balanced with the toy
    VAE, check the balanced latents equal local encoding, and return the timings (medians over
    ``repeats``, measured on rank 0 between barriers), the speedup, and the plan's predicted one.

    ``hidden`` sizes the toy VAE's compute (one core per rank). ``device_seconds`` adds that much
    idle wait to every encode call, standing in for a GPU encode during which the host CPU is
    free: then the step's time does not depend on how many CPU cores other work leaves free."""
    config = dict(
        views=views, frames=frames, size=size, heavy_items=heavy_items, hidden=hidden, device_seconds=device_seconds, repeats=repeats
    )
    results = spawn_gloo(_skewed_step, world_size, config, timeout_s=timeout_s)
    for result in results:
        if isinstance(result, BaseException):
            raise RuntimeError(f"a rank of the demo failed: {result!r}") from result
    unbalanced, balanced = results[0]["unbalanced_s"], results[0]["balanced_s"]
    return {
        "world_size": world_size,
        "config": config,
        "items_per_rank": [r["items"] for r in results],
        "equal_to_local": True,
        "unbalanced_s": unbalanced,
        "balanced_s": balanced,
        "speedup": unbalanced / balanced,
        "planned_speedup": results[0]["planned_speedup"],
        "moved_units": results[0]["moved_units"],
        "moved_bytes": results[0]["moved_bytes"],
    }
