"""Feature gradient replay (a "dual GradCache").

A distribution loss needs many samples B to estimate cross-sample interactions, but backpropagating
a video generator through all B costs activation memory proportional to B. This cache separates the
two: the trainer runs every microbatch without a graph and ``add``s its detached encoder features;
``finalize`` evaluates the loss once over all B samples (gathered across ranks) with only this
rank's selected suffix of b rows differentiable, and returns ``dL/d feature`` for each selected
microbatch. The trainer then replays only those microbatches with a graph
(:class:`~latentfast.replay.ReplayRNG`) and pushes the cotangents through them
(:func:`~latentfast.replay.replay_backward`), so activation memory scales with b, not B.

Counts: ``target_local_samples`` (B per rank) and ``gradient_local_samples`` (b per rank) are per
rank; ``global_samples`` / ``gradient_global_samples`` multiply them by the world size.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .scatter import CotangentBlocks, ScatteredCotangents, arena_numel, arena_views, scatter_cotangents


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu")
    if isinstance(value, Mapping):
        return {key: _to_cpu(item) for key, item in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_to_cpu(item) for item in value)
    return value


class BranchCotangents(Mapping):
    """Branch name -> cotangent block of one microbatch (a view into the cotangent arena)."""

    __slots__ = ("_names", "_blocks", "_microbatch")

    def __init__(self, names: tuple[str, ...], blocks: CotangentBlocks, microbatch: int):
        self._names, self._blocks, self._microbatch = names, blocks, microbatch

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            branch = self._names.index(name)
        except ValueError:
            raise KeyError(name) from None
        return self._blocks[self._microbatch][branch]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return f"BranchCotangents({dict(self)!r})"


@dataclass(frozen=True)
class FeatureGradientReplayResult:
    """What ``finalize`` hands the trainer (field names are kept from the original training logs).

    ``local_cotangents[i][branch]``: ``dL/d feature`` of the i-th selected microbatch (collection
    order, ``replay_batch_indices[i]`` is its ``add`` index); ``fsdp_cotangents``: the same times the
    world size, which cancels FSDP/DDP gradient averaging. All of them are views of
    ``cotangent_arena`` (one contiguous buffer), which the cache reuses: they are valid until its
    next ``finalize`` after ``commit()`` / ``discard()`` (unless offloaded to the CPU first).
    """

    loss: torch.Tensor
    optimized_loss: torch.Tensor
    metadata: Mapping[str, Any]
    local_cotangents: tuple[Mapping[str, torch.Tensor], ...]
    fsdp_cotangents: tuple[Mapping[str, torch.Tensor], ...]
    replay_batch_indices: tuple[int, ...]
    replay_sample_ids: tuple[tuple[str, ...] | None, ...]
    local_samples: int
    global_samples: int
    gradient_local_samples: int
    gradient_global_samples: int
    current_teacher_local_samples: int
    current_teacher_global_samples: int
    world_size: int
    cotangent_arena: torch.Tensor | None = None


class FeatureGradientReplay:
    """Cache B samples' features per rank, differentiate a suffix of b, return cotangents.

    Args:
        loss_module: anything with ``branch_names``, ``sample_shapes`` (name -> ``(N, D)``),
            ``current_teacher_attraction_enabled`` and ``forward(gradient_students,
            student_reference, current_teacher, gradient_student_indices) -> (loss, metadata)``,
            e.g. :class:`~latentfast.replay.MultiEncoderMMD`.
        target_local_samples: B per rank (all collected rows).
        gradient_local_samples: b per rank, ``0 < b < B``: the rows replayed with a graph.
        loss_scale: multiplies the loss before differentiation (``optimized_loss``).
        require_sample_id_alignment: with attraction on, selected microbatches must carry
            ``sample_ids`` equal to ``current_teacher_sample_ids``.
        full_student_partial_gradient: must be True (all B rows enter the loss, b carry gradient).
        feature_dtype: dtype of the stored copies (float32; float64 keeps double inputs exact).

    Every rank must call ``finalize`` (it runs collectives), after adding exactly B rows of which
    the last b were ``gradient_selected``.

    The cotangent arena and its views are made by the first ``finalize`` and reused by every later
    step of the same size, dtype and device (fresh pages of a large buffer cost more than the
    scatter itself, and making the views costs as much as a small scatter). So a result's
    cotangents are valid until the next ``finalize`` after ``commit()`` / ``discard()``: from then
    on reading them through the result raises ``RuntimeError``, and tensors taken out of it earlier
    hold the new step's values. ``offload_finalized_to_cpu`` copies them out; the offloaded result
    stays valid.
    """

    def __init__(
        self,
        loss_module,
        *,
        target_local_samples: int,
        gradient_local_samples: int,
        loss_scale: float = 1.0,
        require_sample_id_alignment: bool = True,
        full_student_partial_gradient: bool = True,
        feature_dtype: torch.dtype = torch.float32,
    ) -> None:
        missing = [
            attr
            for attr in ("branch_names", "sample_shapes", "current_teacher_attraction_enabled")
            if not hasattr(loss_module, attr)
        ]
        if missing or not callable(loss_module):
            raise TypeError(
                "loss_module must be callable with branch_names, sample_shapes and"
                f" current_teacher_attraction_enabled (e.g. MultiEncoderMMD); {type(loss_module).__name__}"
                f" lacks {missing or ['__call__']}"
            )
        if not 0 < int(gradient_local_samples) < int(target_local_samples):
            raise ValueError(
                "dual GradCache needs 0 < gradient_local_samples < target_local_samples, got"
                f" {gradient_local_samples} and {target_local_samples}"
            )
        if not full_student_partial_gradient:
            raise ValueError("dual GradCache requires full_student_partial_gradient=True")
        if feature_dtype not in (torch.float32, torch.float64):
            raise ValueError(f"feature_dtype must be torch.float32 or torch.float64, got {feature_dtype}")
        self.loss_module = loss_module
        self.branch_names: tuple[str, ...] = tuple(loss_module.branch_names)
        self.sample_shapes = {name: tuple(loss_module.sample_shapes[name]) for name in self.branch_names}
        self.target_local_samples = int(target_local_samples)
        self.gradient_local_samples = int(gradient_local_samples)
        self.loss_scale = float(loss_scale)
        self.require_sample_id_alignment = bool(require_sample_id_alignment)
        self.full_student_partial_gradient = True
        self.partial_gradient_enabled = True
        self.current_teacher_attraction_enabled = bool(loss_module.current_teacher_attraction_enabled)
        self.feature_dtype = feature_dtype
        self._scattered: ScatteredCotangents | None = None  # the arena, kept across steps
        self._clear()

    # ---- state ---------------------------------------------------------------------------
    def _clear(self) -> None:
        # One flat buffer per rank holds every branch's features (B rows each) followed by the
        # teacher features of the selected rows (b rows each, attraction only): finalize gathers
        # it with one collective and offload moves it with one transfer.
        self._store: torch.Tensor | None = None
        self._batch_sizes: list[int] = []
        self._gradient_batch_indices: list[int] = []
        self._gradient_batch_sizes: list[int] = []
        self._gradient_sample_ids: list[tuple[str, ...] | None] = []
        self._device: torch.device | None = None
        self._result: FeatureGradientReplayResult | None = None

    @property
    def local_samples(self) -> int:
        return sum(self._batch_sizes)

    @property
    def selected_local_samples(self) -> int:
        return sum(self._gradient_batch_sizes)

    @property
    def finalized(self) -> bool:
        return self._result is not None

    @staticmethod
    def _world_size() -> int:
        return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    @staticmethod
    def _rank() -> int:
        return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def _slab(self, name: str) -> int:
        tokens, channels = self.sample_shapes[name]
        return tokens * channels

    def _store_views(self, store: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(features ``[B, N, D]``, teacher ``[b, N, D]``) views of a flat store, per branch."""
        features, teacher, offset = {}, {}, 0
        for rows, target in ((self.target_local_samples, features), (self.gradient_local_samples, teacher)):
            if target is teacher and not self.current_teacher_attraction_enabled:
                break
            for name in self.branch_names:
                count = rows * self._slab(name)
                target[name] = store[offset : offset + count].view(rows, *self.sample_shapes[name])
                offset += count
        return features, teacher

    def _store_numel(self) -> int:
        rows = self.target_local_samples + (
            self.gradient_local_samples if self.current_teacher_attraction_enabled else 0
        )
        return rows * sum(self._slab(name) for name in self.branch_names)

    # ---- collection ------------------------------------------------------------------------
    def _validate_mapping(self, value, label: str, *, expected_batch: int | None = None) -> tuple[int, torch.device]:
        if not isinstance(value, Mapping):
            raise TypeError(f"{label} must be a mapping branch name -> tensor, got {type(value).__name__}")
        if set(value) != set(self.branch_names):
            raise ValueError(f"{label} keys must be {self.branch_names}, got {tuple(value)}")
        batch_size = device = None
        for name in self.branch_names:
            tensor = value[name]
            if (
                not isinstance(tensor, torch.Tensor)
                or tensor.ndim != 3
                or not tensor.is_floating_point()
                or min(tensor.shape) <= 0
            ):
                got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
                raise ValueError(f"{label}[{name!r}] must be a non-empty floating [B, N, D] tensor, got {got}")
            if tuple(tensor.shape[1:]) != self.sample_shapes[name]:
                raise ValueError(
                    f"{label}[{name!r}] geometry {tuple(tensor.shape[1:])} != expected {self.sample_shapes[name]}"
                )
            if not bool(torch.isfinite(tensor).all()):
                raise FloatingPointError(f"{label}[{name!r}] holds non-finite values")
            if batch_size is None:
                batch_size, device = int(tensor.shape[0]), tensor.device
            elif int(tensor.shape[0]) != batch_size or tensor.device != device:
                raise ValueError(
                    f"all {label} branches must share batch size and device: {name!r} is"
                    f" [{tensor.shape[0]}, ...] on {tensor.device}, the first branch [{batch_size}, ...] on {device}"
                )
        if expected_batch is not None and batch_size != expected_batch:
            raise ValueError(f"{label} batch size {batch_size} != generated batch size {expected_batch}")
        return batch_size, device

    def add(
        self,
        generated_features: Mapping[str, torch.Tensor],
        current_teacher_features: Mapping[str, torch.Tensor] | None = None,
        *,
        gradient_selected: bool = True,
        sample_ids: Sequence[str] | None = None,
        current_teacher_sample_ids: Sequence[str] | None = None,
    ) -> int:
        """Store one microbatch's features (detached copies, no graph); returns its index.

        ``generated_features``: branch -> ``[b_m, N_k, D_k]`` floating, finite. Selected
        microbatches (``gradient_selected=True``) must come last (a suffix). With teacher
        attraction on, a selected microbatch needs ``current_teacher_features`` of the same shape
        and (with ``require_sample_id_alignment``) ``sample_ids == current_teacher_sample_ids``;
        teacher payloads are refused otherwise. Nothing is stored when validation fails.
        """
        if self.finalized:
            raise RuntimeError("cannot add after finalize; commit() or discard() first")
        batch_size, device = self._validate_mapping(generated_features, "generated_features")
        if self._device is not None and device != self._device:
            raise ValueError(f"all microbatches must share a device: this one is on {device}, earlier on {self._device}")
        if self.local_samples + batch_size > self.target_local_samples:
            raise ValueError(
                f"dual GradCache exceeds target_local_samples={self.target_local_samples}:"
                f" {self.local_samples} stored + {batch_size} added"
            )
        if gradient_selected:
            if self.selected_local_samples + batch_size > self.gradient_local_samples:
                raise ValueError(
                    f"dual GradCache exceeds the gradient suffix gradient_local_samples={self.gradient_local_samples}:"
                    f" {self.selected_local_samples} selected + {batch_size} added"
                )
        elif self._gradient_batch_sizes:
            raise ValueError("gradient-selected microbatches must form a suffix: an unselected one came after them")
        ids = None
        if sample_ids is not None:
            ids = tuple(str(value) for value in sample_ids)
            if len(ids) != batch_size or any(not value for value in ids):
                raise ValueError(f"sample_ids must hold one non-empty ID per row ({batch_size}), got {ids!r}")
        if not self.current_teacher_attraction_enabled and current_teacher_sample_ids is not None:
            raise ValueError("current_teacher_sample_ids were given while current-teacher attraction is disabled")
        if gradient_selected and self.require_sample_id_alignment and self.current_teacher_attraction_enabled:
            if ids is None:
                raise ValueError("selected microbatches need sample_ids while teacher attraction is on")
            teacher_ids = (
                tuple(str(value) for value in current_teacher_sample_ids)
                if current_teacher_sample_ids is not None
                else None
            )
            if teacher_ids != ids:
                raise ValueError(f"student and teacher sample IDs/order differ: {ids!r} vs {teacher_ids!r}")
        if gradient_selected and self.current_teacher_attraction_enabled:
            if current_teacher_features is None:
                raise ValueError("selected microbatches need current_teacher_features while teacher attraction is on")
            self._validate_mapping(current_teacher_features, "current_teacher_features", expected_batch=batch_size)
        elif current_teacher_features is not None:
            raise ValueError(
                "current_teacher_features are only accepted for selected microbatches with teacher attraction on"
            )

        if self._store is None:
            self._store = torch.empty(self._store_numel(), dtype=self.feature_dtype, device=device)
            self._device = device
        features, teacher = self._store_views(self._store)
        start = self.local_samples
        with torch.no_grad():
            for name in self.branch_names:
                features[name][start : start + batch_size].copy_(generated_features[name].detach())
            if gradient_selected and self.current_teacher_attraction_enabled:
                row = self.selected_local_samples
                for name in self.branch_names:
                    teacher[name][row : row + batch_size].copy_(current_teacher_features[name].detach())
        index = len(self._batch_sizes)
        self._batch_sizes.append(batch_size)
        if gradient_selected:
            self._gradient_batch_indices.append(index)
            self._gradient_batch_sizes.append(batch_size)
            self._gradient_sample_ids.append(ids)
        return index

    # ---- finalize --------------------------------------------------------------------------
    def _collective_device(self) -> torch.device:
        if self._device is not None:
            return self._device
        if self._world_size() > 1 and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _validate_ready(self) -> None:
        """Every rank learns every rank's counts (one collective), so all raise together."""
        expected = (self.target_local_samples, self.gradient_local_samples)
        counts = torch.tensor(
            [self.local_samples, self.selected_local_samples], dtype=torch.long, device=self._collective_device()
        )
        if self._world_size() == 1:
            observed = tuple(int(v) for v in counts.tolist())
            if observed != expected:
                raise RuntimeError(f"incomplete dual GradCache: (stored, selected) = {observed}, expected {expected}")
            return
        gathered = [torch.empty_like(counts) for _ in range(self._world_size())]
        dist.all_gather(gathered, counts)
        observed = [tuple(int(v) for v in item.tolist()) for item in gathered]
        if any(item != expected for item in observed):
            raise RuntimeError(
                f"incomplete distributed dual GradCache: (stored, selected) per rank = {observed}, expected {expected}"
            )

    def finalize(self) -> FeatureGradientReplayResult:
        """Evaluate the loss over all ranks' B samples and return the selected rows' cotangents.

        Calling it again returns the same result object.
        """
        if self._result is not None:
            return self._result
        self._validate_ready()
        world_size, rank = self._world_size(), self._rank()
        if world_size > 1:
            stores = [torch.empty_like(self._store) for _ in range(world_size)]
            dist.all_gather(stores, self._store)
            stores[rank] = self._store
        else:
            stores = [self._store]
        per_rank = [self._store_views(store) for store in stores]

        # Rank r's selected suffix sits at rows [r*B + B - b, (r+1)*B) of the global batch. All
        # B*world rows enter the loss; only this rank's suffix rows are autograd leaves -- the
        # other ranks differentiate their own.
        suffix_start = self.target_local_samples - self.gradient_local_samples
        gradient_indices = torch.cat(
            [
                torch.arange(r * self.target_local_samples + suffix_start, (r + 1) * self.target_local_samples)
                for r in range(world_size)
            ]
        ).to(self._device)
        leaves, distribution, differentiation = {}, {}, {}
        teacher = {} if self.current_teacher_attraction_enabled else None
        for name in self.branch_names:
            leaves[name] = per_rank[rank][0][name][suffix_start:].detach().requires_grad_(True)
            distribution[name] = torch.cat([features[name] for features, _ in per_rank])
            differentiation[name] = torch.cat(
                [leaves[name] if r == rank else per_rank[r][0][name][suffix_start:] for r in range(world_size)]
            )
            if teacher is not None:
                teacher[name] = torch.cat([teachers[name] for _, teachers in per_rank])

        with torch.enable_grad():
            raw_loss, metadata = self.loss_module(
                gradient_students=differentiation,
                student_reference=distribution,
                current_teacher=teacher,
                gradient_student_indices=gradient_indices,
            )
            optimized = raw_loss * self.loss_scale
            grads = torch.autograd.grad(optimized, [leaves[name] for name in self.branch_names], allow_unused=True)
        grads = [torch.zeros_like(leaves[name]) if g is None else g for name, g in zip(self.branch_names, grads)]
        scattered = self._scattered = scatter_cotangents(
            grads, self._gradient_batch_sizes, scale=float(world_size), reuse=self._reusable_arena(grads)
        )
        local = tuple(BranchCotangents(self.branch_names, scattered.local, m) for m in range(len(scattered.local)))
        fsdp = tuple(BranchCotangents(self.branch_names, scattered.scaled, m) for m in range(len(scattered.scaled)))

        global_samples = self.target_local_samples * world_size
        gradient_global = self.gradient_local_samples * world_size
        teacher_local = self.gradient_local_samples if self.current_teacher_attraction_enabled else 0
        teacher_global = teacher_local * world_size

        def count(value: int) -> torch.Tensor:
            return torch.tensor(value, dtype=torch.long, device=raw_loss.device)

        meta = {key: value.detach() if isinstance(value, torch.Tensor) else value for key, value in metadata.items()}
        meta.update(
            {
                "raw_loss": raw_loss.detach(),
                "optimized_loss": optimized.detach(),
                "loss_scale": raw_loss.new_tensor(self.loss_scale).detach(),
                "gradcache_local_samples": count(self.target_local_samples),
                "gradcache_global_samples": count(global_samples),
                "gradcache_forward_local_samples": count(self.target_local_samples),
                "gradcache_forward_global_samples": count(global_samples),
                "gradcache_gradient_local_samples": count(self.gradient_local_samples),
                "gradcache_gradient_global_samples": count(gradient_global),
                "gradcache_current_teacher_local_samples": count(teacher_local),
                "gradcache_current_teacher_global_samples": count(teacher_global),
                "gradcache_kss_denominator": count(global_samples * global_samples),
                "gradcache_partial_gradient_enabled": count(1),
                "gradcache_full_student_partial_gradient": count(1),
                "gradcache_world_size": count(world_size),
                "gradcache_fsdp_cotangent_scale": raw_loss.new_tensor(float(world_size)).detach(),
                "gradcache_branch_names": self.branch_names,
            }
        )
        self._result = FeatureGradientReplayResult(
            loss=raw_loss.detach(),
            optimized_loss=optimized.detach(),
            metadata=meta,
            local_cotangents=local,
            fsdp_cotangents=fsdp,
            replay_batch_indices=tuple(self._gradient_batch_indices),
            replay_sample_ids=tuple(self._gradient_sample_ids),
            local_samples=self.target_local_samples,
            global_samples=global_samples,
            gradient_local_samples=self.gradient_local_samples,
            gradient_global_samples=gradient_global,
            current_teacher_local_samples=teacher_local,
            current_teacher_global_samples=teacher_global,
            world_size=world_size,
            cotangent_arena=scattered.arena,
        )
        return self._result

    def _reusable_arena(self, grads: list[torch.Tensor]) -> ScatteredCotangents | None:
        """The previous step's scatter if its arena fits this one (it always does, unless the
        features moved to another device); otherwise a new arena is allocated and the old result
        keeps its own."""
        previous = self._scattered
        if previous is None:
            return None
        arena = previous.arena
        numel = arena_numel([g.shape for g in grads], self._gradient_batch_sizes)
        if arena.numel() != numel or arena.dtype != grads[0].dtype or arena.device != grads[0].device:
            return None
        return previous

    # ---- after the update --------------------------------------------------------------------
    def offload_finalized_to_cpu(self) -> FeatureGradientReplayResult:
        """Move the cached features and the result to the CPU (the cotangents move as one arena
        transfer and come back as views of the CPU copy). Returns the new result. The copy is
        always a new buffer (also for CPU tensors), so it stays valid after later steps."""
        if self._result is None:
            raise RuntimeError("cannot offload the dual GradCache before finalize")
        result = self._result
        arena = result.cotangent_arena.to("cpu", copy=True)
        slabs = [self.sample_shapes[name] for name in self.branch_names]
        local, scaled = arena_views(arena, slabs, self._gradient_batch_sizes)
        store = self._store.to("cpu")
        self._store, self._device = store, torch.device("cpu")
        self._result = FeatureGradientReplayResult(
            loss=result.loss.to("cpu"),
            optimized_loss=result.optimized_loss.to("cpu"),
            metadata=_to_cpu(result.metadata),
            local_cotangents=tuple(BranchCotangents(self.branch_names, local, m) for m in range(len(local))),
            fsdp_cotangents=tuple(BranchCotangents(self.branch_names, scaled, m) for m in range(len(scaled))),
            replay_batch_indices=result.replay_batch_indices,
            replay_sample_ids=result.replay_sample_ids,
            local_samples=result.local_samples,
            global_samples=result.global_samples,
            gradient_local_samples=result.gradient_local_samples,
            gradient_global_samples=result.gradient_global_samples,
            current_teacher_local_samples=result.current_teacher_local_samples,
            current_teacher_global_samples=result.current_teacher_global_samples,
            world_size=result.world_size,
            cotangent_arena=arena,
        )
        return self._result

    def commit(self) -> None:
        """Release everything after the optimizer update that used this result (the cotangent
        arena is kept for the next step)."""
        if self._result is None:
            raise RuntimeError("cannot commit the dual GradCache before finalize")
        self._clear()

    def discard(self) -> None:
        """Release everything without an update (an abandoned or failed step); the cotangent arena
        is kept for the next step."""
        self._clear()


# Names the original training code used; kept so old imports and pickled references still resolve.
MultiRepresentationFreshVideoGradCache = FeatureGradientReplay
MultiRepresentationFreshVideoGradCacheResult = FeatureGradientReplayResult
