"""Spawned 2-rank gloo groups.

1. Each rank replays its own shard; the FSDP-style averaged gradient equals single-process plain
   backprop on the concatenated data. An incomplete rank, or a rank holding non-finite features or
   cotangents, makes every rank's finalize raise (no hang).
2. Real DDP, FSDP2 (``fully_shard`` on a CPU mesh) and FSDP1 (``FullyShardedDataParallel`` on the
   CPU): with ``gradient_sync`` the replayed step reduces once per bucket / FSDP unit, not once per
   replay (counted by a DDP comm hook, an FSDP2 custom reduce-scatter and an FSDP1 comm hook), and
   the gradients equal syncing every replay and plain backprop.
"""
from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from latentfast.errors import NonFiniteReplayError
from latentfast.replay import FeatureGradientReplay
from latentfast.replay.demo import build_toy_problem, generator_gradients, max_relative_error, plain_step, replay_step
from latentfast.testing import teardown_process_group

WORLD = 2
SCENARIOS = [dict(mode="exact", attraction=False), dict(mode="nystrom", attraction=True)]


def _problem(scenario, B=6, b=4):
    return build_toy_problem(local_samples=B, gradient_local_samples=b, microbatch=2, num_shards=WORLD, **scenario)


def _spawn(worker, tmp_path) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=WORLD, start_method="spawn")


def _init(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=90))
    torch.set_num_threads(1)


def _outcome(fn) -> str:
    try:
        fn()
        return "finalized"
    except (RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


def _failures(rank: int) -> dict[str, str]:
    """finalize on each rank when one rank is incomplete / non-finite."""
    problem = _problem(SCENARIOS[0])
    features = {n: torch.zeros(2, *s, dtype=torch.float64) for n, s in problem.loss.sample_shapes.items()}

    def incomplete():  # rank 1 stops one microbatch short
        cache = FeatureGradientReplay(problem.loss, target_local_samples=6, gradient_local_samples=4)
        cache.add(features, gradient_selected=False)
        cache.add(features)
        if rank == 0:
            cache.add(features)
        cache.finalize()

    def nan_feature():  # rank 1 adds a NaN; checked at finalize, as on a GPU
        cache = FeatureGradientReplay(problem.loss, target_local_samples=6, gradient_local_samples=4,
                                      check_finite="finalize")  # fmt: skip
        for m in range(3):
            bad = rank == 1 and m == 2
            cache.add({n: torch.full_like(v, float("nan")) if bad else v + m for n, v in features.items()},
                      gradient_selected=m > 0)  # fmt: skip
        cache.finalize()

    def overflowing_cotangent():  # only rank 1's float16 cotangents overflow
        cache = FeatureGradientReplay(problem.loss, target_local_samples=6, gradient_local_samples=4, loss_scale=1e12)
        generator = torch.Generator().manual_seed(rank)
        for m in range(3):
            rows = {n: torch.randn(2, *s, generator=generator) for n, s in problem.loss.sample_shapes.items()}
            cache.add({n: v.half() if rank == 1 else v for n, v in rows.items()}, gradient_selected=m > 0)
        cache.finalize()

    return {name: _outcome(fn) for name, fn in
            (("incomplete", incomplete), ("nan_feature", nan_feature), ("overflow", overflowing_cotangent))}  # fmt: skip


def _replay_worker(rank: int, init_file: str, out_dir: str) -> None:
    _init(rank, init_file)
    try:
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
        torch.save(_failures(rank), f"{out_dir}/failures{rank}.pt")
    finally:
        teardown_process_group()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_rank_replay_equals_single_process_plain(tmp_path):
    _spawn(_replay_worker, tmp_path)
    for i, scenario in enumerate(SCENARIOS):
        saved = torch.load(tmp_path / f"s{i}.pt")
        problem = _problem(scenario)
        plain_loss = plain_step(problem)  # all shards, concatenated, one process
        plain = generator_gradients(problem)
        assert all(g.abs().max() > 0 for g in plain.values())
        assert torch.equal(saved["loss"], plain_loss)
        # two ranks x two replays: the sum over ranks is taken in another order than plain backprop's
        assert max_relative_error(plain, saved["grads"]) <= 1e-12, scenario
        assert int(saved["meta"]["gradcache_world_size"]) == WORLD
        assert int(saved["meta"]["gradcache_global_samples"]) == 6 * WORLD
        assert set(saved["ratios"]) == {float(WORLD)}  # fsdp cotangents = world size x local
    for rank in range(WORLD):
        outcome = torch.load(tmp_path / f"failures{rank}.pt")
        assert "incomplete distributed dual GradCache" in outcome["incomplete"], outcome
        assert "(6, 4), (4, 2)" in outcome["incomplete"], outcome
        assert NonFiniteReplayError.__name__ in outcome["nan_feature"], outcome
        assert "generated_features['motion'] of add #2 on rank 1" in outcome["nan_feature"], outcome
        assert "cotangents of branch 'motion' on rank 1 are not finite" in outcome["overflow"], outcome
        assert ("in torch.float16" in outcome["overflow"]) == (rank == 1), outcome  # the failing rank's dtype


# ---- DDP, FSDP2 and FSDP1: one reduction per bucket per step ----------------------------------
SYNC_SCENARIO = dict(mode="nystrom", attraction=True)
SYNC_B, SYNC_b = 8, 6  # three replayed microbatches per rank


def _run_steps(problem, rank: int, read_grads, counter: list) -> dict:
    """A warm-up step (DDP rebuilds its buckets after the first), then one step with gradient_sync
    and one syncing every replay: reductions counted and gradients read for each."""
    replay_step(problem, problem.shards[rank])
    problem.generator.zero_grad(set_to_none=True)
    out = {}
    for name, every in (("deferred", False), ("every", True)):
        counter.clear()
        replay_step(problem, problem.shards[rank], sync_every_replay=every)
        out[f"{name}_reductions"] = len(counter)
        out[f"{name}_grads"] = read_grads()
        problem.generator.zero_grad(set_to_none=True)
    return out


def _ddp(rank: int) -> dict:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel

    problem = _problem(SYNC_SCENARIO, SYNC_B, SYNC_b)
    ddp = DistributedDataParallel(problem.generator, bucket_cap_mb=0.002)  # a few buckets
    calls: list = []

    def counting_hook(state, bucket):
        state.append(bucket.index())
        return allreduce_hook(None, bucket)

    ddp.register_comm_hook(calls, counting_hook)
    problem.model = ddp
    out = _run_steps(problem, rank, lambda: {n: p.grad.clone() for n, p in problem.generator.named_parameters()}, calls)
    out["buckets"] = len(ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(","))
    return out


def _fsdp2(rank: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    problem = _problem(SYNC_SCENARIO, SYNC_B, SYNC_b)
    mesh = init_device_mesh("cpu", (WORLD,))
    for module in problem.generator.modules():
        if isinstance(module, torch.nn.Linear):
            fully_shard(module, mesh=mesh)
    fully_shard(problem.generator, mesh=mesh)
    calls: list = []

    class CountingReduceScatter(DefaultReduceScatter):
        def __call__(self, *args, **kwargs):
            calls.append(1)
            return super().__call__(*args, **kwargs)

    groups = [m for m in problem.generator.modules() if isinstance(m, FSDPModule) and list(m.parameters(recurse=False))]
    for module in groups:
        module.set_custom_reduce_scatter(CountingReduceScatter())
    out = _run_steps(
        problem, rank, lambda: {n: p.grad.full_tensor() for n, p in problem.generator.named_parameters()}, calls
    )
    out["buckets"] = len(groups)
    return out


def _fsdp1(rank: int) -> dict:
    from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState, reduce_scatter_hook
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    problem = _problem(SYNC_SCENARIO, SYNC_B, SYNC_b)
    fsdp = FullyShardedDataParallel(
        problem.generator, auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}), device_id=torch.device("cpu"),
        use_orig_params=True,
    )
    calls: list = []
    state = DefaultState(dist.group.WORLD)

    def counting_hook(state, grad, output):
        calls.append(1)
        return reduce_scatter_hook(state, grad, output)

    fsdp.register_comm_hook(state, counting_hook)
    problem.model = fsdp

    def full_grads():
        with FullyShardedDataParallel.summon_full_params(fsdp, with_grads=True):
            return {n.replace("_fsdp_wrapped_module.", ""): p.grad.clone() for n, p in fsdp.named_parameters()}

    out = _run_steps(problem, rank, full_grads, calls)
    out["buckets"] = len([m for m in fsdp.modules() if isinstance(m, FullyShardedDataParallel) and m._has_params])
    return out


def _sync_worker(rank: int, init_file: str, out_dir: str) -> None:
    _init(rank, init_file)
    try:
        results = {"ddp": _ddp(rank), "fsdp2": _fsdp2(rank), "fsdp1": _fsdp1(rank)}
        torch.save(results, f"{out_dir}/sync{rank}.pt")
    finally:
        teardown_process_group()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_ddp_and_fsdp_reduce_once_per_step_with_gradient_sync(tmp_path):
    _spawn(_sync_worker, tmp_path)
    problem = _problem(SYNC_SCENARIO, SYNC_B, SYNC_b)
    plain_step(problem)  # all shards, one process: the sum the averaged fsdp cotangents give
    plain = generator_gradients(problem)
    replays = SYNC_b // 2
    for rank in range(WORLD):
        for kind, out in torch.load(tmp_path / f"sync{rank}.pt").items():
            assert out["buckets"] >= 2, (kind, out["buckets"])  # so "once per bucket" means something
            assert out["deferred_reductions"] == out["buckets"], kind
            assert out["every_reductions"] == replays * out["buckets"], kind
            # the reduction is linear: reducing the sum equals summing the reductions, up to order
            assert max_relative_error(out["every_grads"], out["deferred_grads"]) <= 1e-12, kind
            assert max_relative_error(plain, out["deferred_grads"]) <= 1e-12, kind


# ---- ranks whose caches differ: one clear error on every rank ----------------------------------
MISMATCHES = {
    "branch_set": ({"appearance": (3, 4), "motion": (2, 5)}, {"appearance": (3, 4)}, torch.float32),
    "branch_order": ({"appearance": (3, 4), "motion": (3, 4)}, {"motion": (3, 4), "appearance": (3, 4)}, torch.float32),
    "branch_names": ({"appearance": (3, 4), "motion": (3, 4)}, {"appearance": (3, 4), "depth": (3, 4)}, torch.float32),
    "shapes": ({"appearance": (3, 4)}, {"appearance": (4, 3)}, torch.float32),
    "feature_dtype": ({"appearance": (3, 4)}, {"appearance": (3, 4)}, torch.float64),
}


def _mismatched_finalize(rank: int, world: int, case: str) -> str:
    """finalize with rank 1's loss module (or feature_dtype) differing from rank 0's."""
    from latentfast.replay import MultiEncoderMMD

    shapes0, shapes1, dtype1 = MISMATCHES[case]
    shapes = shapes0 if rank == 0 else shapes1
    cache = FeatureGradientReplay(MultiEncoderMMD(shapes), target_local_samples=4, gradient_local_samples=2,
                                  feature_dtype=torch.float32 if rank == 0 else dtype1)  # fmt: skip
    reference = torch.Generator().manual_seed(99)  # the same reference batch on every rank
    cache.loss_module.update_reference({n: torch.randn(8, *s, generator=reference) for n, s in shapes.items()})
    generator = torch.Generator().manual_seed(rank)
    for m in range(2):
        cache.add({n: torch.randn(2, *s, generator=generator) for n, s in shapes.items()}, gradient_selected=m > 0)
    result = cache.finalize()
    return f"finalized, loss {float(result.loss)}"


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_ranks_with_different_loss_modules_raise_on_every_rank(case):
    """Before: differing sizes aborted gloo (SIGABRT); a differing branch order or name gave each
    rank another loss, silently."""
    from latentfast.errors import InvalidArgumentError
    from latentfast.testing import spawn_gloo

    outcomes = spawn_gloo(_mismatched_finalize, WORLD, case, timeout_s=60)
    for rank, outcome in enumerate(outcomes):
        assert isinstance(outcome, InvalidArgumentError), (case, rank, outcome)
        message = str(outcome)
        assert "the ranks' dual GradCaches differ" in message, message
        assert "rank 0: branches {'appearance': (3, 4)" in message and "rank 1: branches" in message, message
    assert str(outcomes[0]) == str(outcomes[1])
