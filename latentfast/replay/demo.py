"""One replay step on the toy models, next to plain backpropagation of the same loss.

The toy problem: a :class:`~latentfast.toy.ToyGenerator` (with dropout, and noise sampled inside
the rollout) renders clips, two :class:`~latentfast.toy.ToyFeatureEncoder` branches turn them into
features, and :class:`MultiEncoderMMD` compares them with a reference distribution. The tests, the
benchmark and ``latentfast demo`` all run these two paths:

* :func:`plain_step` -- forward every microbatch of every shard, evaluate the loss with the
  selected suffix rows carrying the gradient, backward. By default every microbatch keeps its
  graph (activation memory ~ B, what a direct implementation does); ``detach_unselected=True``
  runs the unselected ones under ``no_grad`` (same gradients, activation memory ~ b: the fair
  baseline for replay's memory);
* :func:`replay_step` -- collect every microbatch without a graph, ``finalize``, replay the
  selected microbatches with their captured RNG, ``replay_backward`` (activation memory ~ b),
  each replay inside :func:`~latentfast.replay.gradient_sync` so DDP/FSDP reduce once per step.

``model`` (optional) is what the forward calls -- the generator wrapped in DDP or FSDP -- while
``generator`` stays the plain module (its attributes and parameters). Both steps accept
``autocast_dtype`` to run the generator and encoders under ``torch.autocast``.

A *shard* is one rank's data: its conditions ``[B_local, cond_dim]`` and the seed its random
stream starts from. ``plain_step`` over all shards in one process equals the sum over ranks of
``replay_step`` on each shard.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from ..devices import as_device
from ..errors import InvalidArgumentError
from ..toy import ToyFeatureEncoder, ToyGenerator
from .gradcache import FeatureGradientReplay, FeatureGradientReplayResult
from .mmd import MultiEncoderMMD
from .rng import ReplayRNG, replay_backward
from .sync import gradient_sync


@dataclass
class Shard:
    condition: torch.Tensor  # [B_local, cond_dim]
    seed: int


@dataclass
class ToyReplayProblem:
    generator: ToyGenerator
    teacher: ToyGenerator | None
    encoders: dict[str, ToyFeatureEncoder]
    loss: MultiEncoderMMD
    shards: list[Shard]
    microbatch: int
    gradient_local_samples: int
    loss_scale: float = 1.0
    dtype: torch.dtype = torch.float64
    timings: dict[str, float] = field(default_factory=dict)
    model: torch.nn.Module | None = None  # the generator as the forward calls it (DDP/FSDP wrapper)

    @property
    def local_samples(self) -> int:
        return int(self.shards[0].condition.shape[0])

    @property
    def forward_module(self) -> torch.nn.Module:
        return self.generator if self.model is None else self.model

    @property
    def feature_dtype(self) -> torch.dtype:
        """The replay cache's dtype (and the dtype plain_step evaluates the loss in)."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def autocast(self, dtype: torch.dtype | None):
        """``torch.autocast`` on the problem's device with ``dtype``, or nothing for None."""
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.shards[0].condition.device.type, dtype=dtype)


def build_toy_problem(
    *,
    local_samples: int = 8,
    gradient_local_samples: int = 4,
    microbatch: int = 2,
    num_shards: int = 1,
    attraction: bool = False,
    mode: str = "exact",
    dtype: torch.dtype = torch.float64,
    dropout: float = 0.2,
    generator_kwargs: dict | None = None,
    reference_samples: int = 16,
    loss_scale: float = 1.0,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> ToyReplayProblem:
    """A deterministic toy problem (same arguments -> same models, data and reference state),
    built on the CPU and then moved to ``device``."""
    if local_samples % microbatch or gradient_local_samples % microbatch:
        raise InvalidArgumentError("local_samples and gradient_local_samples must be multiples of microbatch")
    gen_kwargs = dict(noise_dim=8, cond_dim=4, hidden=16, depth=2, frames=4, height=4, width=4)
    gen_kwargs.update(generator_kwargs or {})
    generator = ToyGenerator(dropout=dropout, seed=seed, **gen_kwargs).to(dtype).train()
    teacher = ToyGenerator(dropout=0.0, seed=seed + 7, **gen_kwargs).to(dtype).eval() if attraction else None
    if teacher is not None:
        teacher.requires_grad_(False)
    encoders = {
        "motion": ToyFeatureEncoder(num_tokens=6, dim=5, hidden=8, seed=seed + 1).to(dtype),
        "appearance": ToyFeatureEncoder(num_tokens=3, dim=7, hidden=8, seed=seed + 2).to(dtype),
    }
    loss = MultiEncoderMMD(
        {name: enc.sample_shape for name, enc in encoders.items()},
        weights={"motion": 1.0, "appearance": 0.5},
        embedding={"motion": "mean", "appearance": "flatten"},
        mode=mode,
        num_landmarks=8,
        teacher_attraction_weight=0.3 if attraction else 0.0,
        landmark_seed=seed,
    )
    data = torch.Generator().manual_seed(seed + 100)
    for _ in range(2):  # two updates: the Nyström summary is an EMA over both
        clips = torch.rand(reference_samples, *generator.out_shape, generator=data, dtype=dtype) * 2 - 1
        with torch.no_grad():
            loss.update_reference({name: enc(clips) for name, enc in encoders.items()})
    shards = [
        Shard(torch.randn(local_samples, generator.cond_dim, generator=data, dtype=dtype), seed=seed + 1000 + r)
        for r in range(num_shards)
    ]
    device = as_device(device)
    for module in (generator, teacher, loss, *encoders.values()):
        if module is not None:
            module.to(device)
    for shard in shards:
        shard.condition = shard.condition.to(device)
    return ToyReplayProblem(
        generator, teacher, encoders, loss, shards, microbatch, gradient_local_samples, loss_scale, dtype
    )


def rollout(problem: ToyReplayProblem, condition: torch.Tensor) -> dict[str, torch.Tensor]:
    """Generator + encoders on one microbatch; the noise is sampled here (the RNG must replay)."""
    noise = torch.randn(
        condition.shape[0], problem.generator.noise_dim, dtype=condition.dtype, device=condition.device
    )
    clip = problem.forward_module(noise, condition)
    return {name: encoder(clip) for name, encoder in problem.encoders.items()}


@torch.no_grad()
def teacher_features(problem: ToyReplayProblem, condition: torch.Tensor) -> dict[str, torch.Tensor]:
    """The current teacher's features for a microbatch (deterministic: no RNG is drawn)."""
    noise = torch.zeros(condition.shape[0], problem.teacher.noise_dim, dtype=condition.dtype, device=condition.device)
    clip = problem.teacher(noise, condition)
    return {name: encoder(clip) for name, encoder in problem.encoders.items()}


def _microbatches(problem: ToyReplayProblem, shard: Shard):
    """(index, condition, selected, sample_ids) in collection order."""
    count = problem.local_samples // problem.microbatch
    first_selected = count - problem.gradient_local_samples // problem.microbatch
    for m in range(count):
        rows = slice(m * problem.microbatch, (m + 1) * problem.microbatch)
        ids = [f"s{shard.seed}-{i}" for i in range(rows.start, rows.stop)]
        yield m, shard.condition[rows], m >= first_selected, ids


def plain_step(
    problem: ToyReplayProblem,
    shards: list[Shard] | None = None,
    *,
    detach_unselected: bool = False,
    autocast_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Plain backprop over all ``shards`` in this process; returns the (detached) loss.

    Every microbatch keeps its graph until the backward, as a direct implementation would, unless
    ``detach_unselected`` (the unselected ones run under ``no_grad``: they enter the loss as
    values only, so the gradients are the same). The loss is evaluated in the replay cache's dtype.
    """
    shards = problem.shards if shards is None else shards
    started = time.perf_counter()
    all_features, selected_features, teachers, indices = [], [], [], []
    offset = 0
    for shard in shards:
        torch.manual_seed(shard.seed)
        for m, condition, selected, _ in _microbatches(problem, shard):
            graph = torch.enable_grad() if selected or not detach_unselected else torch.no_grad()
            with graph, problem.autocast(autocast_dtype):
                features = rollout(problem, condition)
            features = {name: value.to(problem.feature_dtype) for name, value in features.items()}
            all_features.append(features)
            if selected:
                selected_features.append(features)
                indices.append(torch.arange(offset, offset + condition.shape[0]))
                if problem.teacher is not None:
                    teachers.append(teacher_features(problem, condition))
            offset += condition.shape[0]
    names = problem.loss.branch_names
    loss, _ = problem.loss(
        gradient_students={n: torch.cat([f[n] for f in selected_features]) for n in names},
        student_reference={n: torch.cat([f[n] for f in all_features]).detach() for n in names},
        current_teacher={n: torch.cat([t[n] for t in teachers]) for n in names} if teachers else None,
        gradient_student_indices=torch.cat(indices),
    )
    (loss * problem.loss_scale).backward()
    problem.timings["plain_s"] = time.perf_counter() - started
    return loss.detach()


def replay_step(
    problem: ToyReplayProblem,
    shard: Shard | None = None,
    *,
    restore_rng: bool = True,
    offload: bool = False,
    cotangents: str = "fsdp",
    sync_every_replay: bool = False,
    autocast_dtype: torch.dtype | None = None,
) -> FeatureGradientReplayResult:
    """One replay step on ``shard`` (this rank's data); gradients accumulate into the generator.

    Each replay runs inside ``gradient_sync(problem.forward_module, enabled=<last replay>)`` (or
    enabled for every replay with ``sync_every_replay``, the way to compare).
    """
    shard = problem.shards[0] if shard is None else shard
    cache = FeatureGradientReplay(
        problem.loss,
        target_local_samples=problem.local_samples,
        gradient_local_samples=problem.gradient_local_samples,
        loss_scale=problem.loss_scale,
        feature_dtype=problem.feature_dtype,
    )
    started = time.perf_counter()
    replays = _collect(problem, shard, cache, autocast_dtype)
    collected = time.perf_counter()
    result = cache.finalize()
    if offload:
        result = cache.offload_finalized_to_cpu()
    finalized = time.perf_counter()
    chosen = result.fsdp_cotangents if cotangents == "fsdp" else result.local_cotangents
    for i, ((condition, rng), cotangent) in enumerate(zip(replays, chosen)):
        last = i == len(replays) - 1
        with gradient_sync(problem.forward_module, enabled=last or sync_every_replay):
            with rng.replay() if restore_rng else contextlib.nullcontext(), problem.autocast(autocast_dtype):
                features = rollout(problem, condition)
                replay_backward(features, cotangent)
    cache.commit()
    problem.timings.update(
        collect_s=collected - started, finalize_s=finalized - collected, replay_s=time.perf_counter() - finalized
    )
    return result


def _collect(problem: ToyReplayProblem, shard: Shard, cache: FeatureGradientReplay, autocast_dtype):
    """Run every microbatch of ``shard`` without a graph into ``cache``; returns the selected ones'
    ``(condition, captured RNG)`` for the replay."""
    torch.manual_seed(shard.seed)
    replays = []
    for m, condition, selected, ids in _microbatches(problem, shard):
        rng = ReplayRNG.capture() if selected else None
        with torch.no_grad(), problem.autocast(autocast_dtype):
            features = rollout(problem, condition)
        teacher = teacher_features(problem, condition) if selected and problem.teacher is not None else None
        cache.add(
            features,
            teacher,
            gradient_selected=selected,
            sample_ids=ids,
            current_teacher_sample_ids=ids if teacher is not None else None,
        )
        if selected:
            replays.append((condition, rng))
    return replays


def generator_gradients(problem: ToyReplayProblem) -> dict[str, torch.Tensor]:
    """A copy of the generator's parameter gradients, then zeroed (set to None)."""
    grads = {name: p.grad.detach().clone() for name, p in problem.generator.named_parameters()}
    problem.generator.zero_grad(set_to_none=True)
    return grads


def max_relative_error(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor]) -> float:
    """max over parameters of ``max|other - reference| / max|reference|``."""
    return max(
        float((other[name] - ref).abs().max()) / max(float(ref.abs().max()), 1e-300) for name, ref in reference.items()
    )


def demo_replay_step(
    *,
    local_samples: int = 8,
    gradient_local_samples: int = 4,
    microbatch: int = 2,
    attraction: bool = True,
    mode: str = "nystrom",
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> dict:
    """Run one replay step on the toys and check its generator gradient against plain backprop.

    Returns a JSON-able dict: the loss of both paths, ``max_relative_error`` of the replayed
    generator gradient, and the timings of each stage (seconds).
    """
    problem = build_toy_problem(
        local_samples=local_samples,
        gradient_local_samples=gradient_local_samples,
        microbatch=microbatch,
        attraction=attraction,
        mode=mode,
        dtype=dtype,
        seed=seed,
    )
    plain_loss = plain_step(problem)
    plain = generator_gradients(problem)
    result = replay_step(problem)
    replayed = generator_gradients(problem)
    return {
        "B": local_samples,
        "b": gradient_local_samples,
        "microbatch": microbatch,
        "mode": mode,
        "attraction": attraction,
        "dtype": str(dtype).removeprefix("torch."),
        "plain_loss": float(plain_loss),
        "replay_loss": float(result.loss),
        "max_relative_error": max_relative_error(plain, replayed),
        "selection_correction": result.global_samples / result.gradient_global_samples,
        "timings_s": dict(problem.timings),
    }
