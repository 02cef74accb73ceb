"""A spawned 2-rank gloo group: each rank replays its own shard; the FSDP-style averaged gradient
equals single-process plain backprop on the concatenated data. An incomplete rank makes every
rank's finalize raise (no hang)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from latentfast.replay import FeatureGradientReplay
from latentfast.replay.demo import build_toy_problem, generator_gradients, max_relative_error, plain_step, replay_step

WORLD = 2
SCENARIOS = [dict(mode="exact", attraction=False), dict(mode="nystrom", attraction=True)]


def _problem(scenario):
    return build_toy_problem(local_samples=6, gradient_local_samples=4, microbatch=2, num_shards=WORLD, **scenario)


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        for i, scenario in enumerate(SCENARIOS):
            problem = _problem(scenario)
            result = replay_step(problem, problem.shards[rank], cotangents="fsdp")
            grads = generator_gradients(problem)
            for grad in grads.values():  # what FSDP/DDP do: average over ranks
                dist.all_reduce(grad)
                grad.div_(WORLD)
            meta = {k: result.metadata[k] for k in ("gradcache_world_size", "gradcache_global_samples")}
            ratio = [
                float((f / l)[l != 0].unique().item())
                for part_f, part_l in zip(result.fsdp_cotangents, result.local_cotangents)
                for f, l in ((part_f[n], part_l[n]) for n in part_l)
            ]
            if rank == 0:
                torch.save({"grads": grads, "loss": result.loss, "meta": meta, "ratios": ratio}, f"{out_dir}/s{i}.pt")
        # rank 1 stops one microbatch short: both ranks must raise, neither may hang
        problem = _problem(SCENARIOS[0])
        cache = FeatureGradientReplay(problem.loss, target_local_samples=6, gradient_local_samples=4)
        features = {n: torch.zeros(2, *s, dtype=torch.float64) for n, s in problem.loss.sample_shapes.items()}
        cache.add(features, gradient_selected=False)
        cache.add(features)
        if rank == 0:
            cache.add(features)
        try:
            cache.finalize()
            outcome = "finalized"
        except RuntimeError as exc:
            outcome = str(exc)
        torch.save(outcome, f"{out_dir}/incomplete{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_two_rank_replay_equals_single_process_plain(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, start_method="spawn")
    for i, scenario in enumerate(SCENARIOS):
        saved = torch.load(tmp_path / f"s{i}.pt")
        problem = _problem(scenario)
        plain_loss = plain_step(problem)  # all shards, concatenated, one process
        plain = generator_gradients(problem)
        assert all(g.abs().max() > 0 for g in plain.values())
        torch.testing.assert_close(saved["loss"], plain_loss, rtol=1e-12, atol=0)
        assert max_relative_error(plain, saved["grads"]) <= 1e-5, scenario
        assert int(saved["meta"]["gradcache_world_size"]) == WORLD
        assert int(saved["meta"]["gradcache_global_samples"]) == 6 * WORLD
        assert set(saved["ratios"]) == {float(WORLD)}  # fsdp cotangents = world size x local
    for rank in range(WORLD):
        outcome = torch.load(tmp_path / f"incomplete{rank}.pt")
        assert "incomplete distributed dual GradCache" in outcome and "(6, 4), (4, 2)" in outcome, outcome
