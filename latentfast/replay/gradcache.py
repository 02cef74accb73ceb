"""Feature gradient replay (a "dual GradCache").

A distribution loss needs many samples B to estimate cross-sample interactions, but backpropagating
a video generator through all B costs activation memory proportional to B. This cache separates the
two: the trainer runs every microbatch without a graph and ``add``s its detached encoder features;
``finalize`` evaluates the loss once over all B samples (gathered across ranks) with only this
rank's selected suffix of b rows differentiable, and returns ``dL/d feature`` for each selected
microbatch. The trainer then replays only those microbatches with a graph
(:class:`~latentfast.replay.ReplayRNG`) and pushes the cotangents through them
(:func:`~latentfast.replay.replay_backward`), so activation memory scales with b, not B. With
b = B every row is differentiated: plain GradCache.

Counts: ``target_local_samples`` (B per rank) and ``gradient_local_samples`` (b per rank) are per
rank; ``global_samples`` / ``gradient_global_samples`` multiply them by the world size.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from ..errors import ArgumentTypeError, InvalidArgumentError, NonFiniteReplayError, ReplayError
from .scatter import ScatteredCotangents, arena_size, scatter_cotangents
from ..distributed import all_gather_rows, collective_device
from .transfer import copy_tensors

FINITE_CHECKS = ("auto", "add", "finalize")


class BranchCotangents(Mapping):
    """Branch name -> cotangent block of one microbatch (a view into the cotangent arena)."""

    __slots__ = ("_names", "_blocks", "_microbatch")

    def __init__(self, names: tuple[str, ...], blocks, microbatch: int):
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
        if self._blocks.expired:
            return f"BranchCotangents(expired, branches={self._names})"
        return f"BranchCotangents({dict(self)!r})"


def _per_microbatch(names: tuple[str, ...], scattered: ScatteredCotangents):
    """(local, fsdp) tuples of :class:`BranchCotangents`, one per selected microbatch."""
    return tuple(
        tuple(BranchCotangents(names, blocks, m) for m in range(len(blocks)))
        for blocks in (scattered.local, scattered.scaled)
    )


@dataclass(frozen=True)
class FeatureGradientReplayResult:
    """What ``finalize`` hands the trainer (field names are kept from the original training logs).

    ``local_cotangents[i][branch]``: ``dL/d feature`` of the i-th selected microbatch (collection
    order, ``replay_batch_indices[i]`` is its ``add`` index), in the dtype the features were added
    in; ``fsdp_cotangents``: the same times the world size, which cancels FSDP/DDP gradient
    averaging. They live in ``cotangent_arena`` (one contiguous buffer; with world size > 1 the
    local ones may be views of the loss gradient instead), which the cache reuses: they are valid
    until its next ``finalize`` after ``commit()`` / ``discard()`` (unless offloaded to the CPU
    first); from then on reading them, or ``cotangent_arena``, raises
    :class:`~latentfast.errors.ReplayError`.
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
    cotangents: ScatteredCotangents | None = field(default=None, repr=False, compare=False)

    @property
    def expired(self) -> bool:
        """True once the cache's next ``finalize`` reused this result's arena."""
        return self.cotangents is not None and self.cotangents.expired

    @property
    def cotangent_arena(self) -> torch.Tensor | None:
        """The contiguous buffer the cotangents are views of; raises once the result expired."""
        if self.cotangents is None:
            return None
        if self.cotangents.expired:
            raise ReplayError(
                "this result's cotangent_arena was reused by a later finalize() and holds that step's values;"
                " read it before the next step, or offload_finalized_to_cpu() to keep a copy"
            )
        return self.cotangents.arena


class FeatureGradientReplay:
    """Cache B samples' features per rank, differentiate a suffix of b, return cotangents.

    Args:
        loss_module: anything with ``branch_names``, ``sample_shapes`` (name -> ``(N, D)``),
            ``current_teacher_attraction_enabled`` and ``forward(gradient_students,
            student_reference, current_teacher, gradient_student_indices) -> (loss, metadata)``,
            e.g. :class:`~latentfast.replay.MultiEncoderMMD`.
        target_local_samples: B per rank (all collected rows).
        gradient_local_samples: b per rank, ``0 < b <= B``: the rows replayed with a graph
            (b = B: every row, plain GradCache).
        loss_scale: multiplies the loss before differentiation (``optimized_loss``).
        require_sample_id_alignment: with attraction on, selected microbatches must carry
            ``sample_ids`` equal to ``current_teacher_sample_ids``.
        full_student_partial_gradient: must be True (all B rows enter the loss, b carry gradient).
        feature_dtype: dtype of the stored copies (float32; float64 keeps double inputs exact).
            The loss is evaluated in it with autocast off, whatever the caller's autocast.
        check_finite: when the stored features are checked for NaN/inf (a finite float64 value
            beyond float32's range becomes inf in a float32 cache): ``"add"`` -- in ``add``, one
            host sync per add; ``"finalize"`` -- flags stay on the device and ``finalize`` reads
            them with its first collective (no sync per microbatch; a GPU keeps running ahead);
            ``"auto"`` (default) -- ``"add"`` for CPU features, ``"finalize"`` otherwise.

    Every rank must call ``finalize`` (it runs collectives), after adding exactly B rows of which
    the last b were ``gradient_selected``. It raises on every rank together (no hang) when a rank is
    incomplete or holds non-finite features, and when the loss or a cotangent is not finite
    (:class:`~latentfast.errors.NonFiniteReplayError`, naming the branch and rank).

    The cotangent arena and its views are made by the first ``finalize`` and reused by every later
    step of the same size, dtype and device (fresh pages of a large buffer cost more than the
    scatter itself, and making the views costs as much as a small scatter). So a result's
    cotangents are valid until the next ``finalize`` after ``commit()`` / ``discard()``: from then
    on reading them through the result raises, and tensors taken out of it earlier hold the new
    step's values. ``offload_finalized_to_cpu`` copies them out; the offloaded result stays valid.
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
        check_finite: str = "auto",
    ) -> None:
        _check_loss_module(loss_module)
        if not 0 < int(gradient_local_samples) <= int(target_local_samples):
            raise InvalidArgumentError(
                "FeatureGradientReplay needs 0 < gradient_local_samples <= target_local_samples, got"
                f" {gradient_local_samples} and {target_local_samples}"
            )
        if not full_student_partial_gradient:
            raise InvalidArgumentError("FeatureGradientReplay requires full_student_partial_gradient=True")
        if feature_dtype not in (torch.float32, torch.float64):
            raise InvalidArgumentError(f"feature_dtype must be torch.float32 or torch.float64, got {feature_dtype}")
        if check_finite not in FINITE_CHECKS:
            raise InvalidArgumentError(f"check_finite must be one of {FINITE_CHECKS}, got {check_finite!r}")
        self.loss_module = loss_module
        self.branch_names: tuple[str, ...] = tuple(loss_module.branch_names)
        self.sample_shapes = {name: tuple(loss_module.sample_shapes[name]) for name in self.branch_names}
        self.target_local_samples = int(target_local_samples)
        self.gradient_local_samples = int(gradient_local_samples)
        self.loss_scale = float(loss_scale)
        self.require_sample_id_alignment = bool(require_sample_id_alignment)
        self.current_teacher_attraction_enabled = bool(loss_module.current_teacher_attraction_enabled)
        self.feature_dtype = feature_dtype
        self.check_finite = check_finite
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
        self._cotangent_dtype: torch.dtype | None = None  # of the selected features, promoted
        self._finite_flags: list[torch.Tensor] = []  # "finalize" checks: per add, per stored branch
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

    def _defer_finite_check(self, device: torch.device) -> bool:
        return self.check_finite == "finalize" or (self.check_finite == "auto" and device.type != "cpu")

    # ---- collection ------------------------------------------------------------------------
    def _validate_mapping(self, value, label: str, *, expected_batch: int | None = None) -> tuple[int, torch.device]:
        if not isinstance(value, Mapping):
            raise ArgumentTypeError(f"{label} must be a mapping branch name -> tensor, got {type(value).__name__}")
        if set(value) != set(self.branch_names):
            raise InvalidArgumentError(f"{label} keys must be {self.branch_names}, got {tuple(value)}")
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
                raise InvalidArgumentError(f"{label}[{name!r}] must be a non-empty floating [B, N, D] tensor, got {got}")
            if tuple(tensor.shape[1:]) != self.sample_shapes[name]:
                raise InvalidArgumentError(
                    f"{label}[{name!r}] geometry {tuple(tensor.shape[1:])} != expected {self.sample_shapes[name]}"
                )
            if batch_size is None:
                batch_size, device = int(tensor.shape[0]), tensor.device
            elif int(tensor.shape[0]) != batch_size or tensor.device != device:
                raise InvalidArgumentError(
                    f"all {label} branches must share batch size and device: {name!r} is"
                    f" [{tensor.shape[0]}, ...] on {tensor.device}, the first branch [{batch_size}, ...] on {device}"
                )
        if expected_batch is not None and batch_size != expected_batch:
            raise InvalidArgumentError(f"{label} batch size {batch_size} != generated batch size {expected_batch}")
        return batch_size, device

    def _check_capacity(self, batch_size: int, device: torch.device, gradient_selected: bool) -> None:
        if self._device is not None and device != self._device:
            raise InvalidArgumentError(
                f"all microbatches must share a device: this one is on {device}, earlier ones on {self._device}"
            )
        if self.local_samples + batch_size > self.target_local_samples:
            raise InvalidArgumentError(
                f"the cache exceeds target_local_samples={self.target_local_samples}:"
                f" {self.local_samples} stored + {batch_size} added"
            )
        if gradient_selected and self.selected_local_samples + batch_size > self.gradient_local_samples:
            raise InvalidArgumentError(
                f"the cache exceeds the gradient suffix gradient_local_samples={self.gradient_local_samples}:"
                f" {self.selected_local_samples} selected + {batch_size} added"
            )
        unselected_rows = self.target_local_samples - self.gradient_local_samples
        if not gradient_selected and self._gradient_batch_sizes:
            raise InvalidArgumentError("gradient-selected microbatches must form a suffix: an unselected one came after them")
        if not gradient_selected and self.local_samples + batch_size > unselected_rows:
            raise InvalidArgumentError(
                f"unselected microbatches fill only the first target_local_samples - gradient_local_samples ="
                f" {unselected_rows} rows: {self.local_samples} stored + {batch_size} added"
            )

    def _check_ids(self, batch_size, gradient_selected, sample_ids, current_teacher_sample_ids):
        """This microbatch's sample IDs (a tuple of str, or None), checked against the teacher's."""
        ids = None
        if sample_ids is not None:
            ids = tuple(str(value) for value in sample_ids)
            if len(ids) != batch_size or any(not value for value in ids):
                raise InvalidArgumentError(f"sample_ids must hold one non-empty ID per row ({batch_size}), got {ids!r}")
        if not self.current_teacher_attraction_enabled and current_teacher_sample_ids is not None:
            raise InvalidArgumentError("current_teacher_sample_ids were given while current-teacher attraction is disabled")
        if gradient_selected and self.require_sample_id_alignment and self.current_teacher_attraction_enabled:
            if ids is None:
                raise InvalidArgumentError("selected microbatches need sample_ids while teacher attraction is on")
            teacher_ids = None
            if current_teacher_sample_ids is not None:
                teacher_ids = tuple(str(value) for value in current_teacher_sample_ids)
            if teacher_ids != ids:
                raise InvalidArgumentError(f"student and teacher sample IDs/order differ: {ids!r} vs {teacher_ids!r}")
        return ids

    def _check_teacher(self, batch_size: int, gradient_selected: bool, current_teacher_features) -> bool:
        """Whether this microbatch stores teacher features (validated here)."""
        if gradient_selected and self.current_teacher_attraction_enabled:
            if current_teacher_features is None:
                raise InvalidArgumentError("selected microbatches need current_teacher_features while teacher attraction is on")
            self._validate_mapping(current_teacher_features, "current_teacher_features", expected_batch=batch_size)
            return True
        if current_teacher_features is not None:
            raise InvalidArgumentError(
                "current_teacher_features are only accepted for selected microbatches with teacher attraction on"
            )
        return False

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

        ``generated_features``: branch -> ``[b_m, N_k, D_k]`` floating, finite (in any floating
        dtype, e.g. bfloat16 under autocast: the cotangents come back in that dtype). Selected
        microbatches (``gradient_selected=True``) must come last (a suffix). With teacher
        attraction on, a selected microbatch needs ``current_teacher_features`` of the same shape
        and (with ``require_sample_id_alignment``) ``sample_ids == current_teacher_sample_ids``;
        teacher payloads are refused otherwise. Nothing is stored when validation fails (with
        ``check_finite="finalize"`` a non-finite value is reported by ``finalize`` instead).
        """
        if self.finalized:
            raise ReplayError("cannot add after finalize; commit() or discard() first")
        batch_size, device = self._validate_mapping(generated_features, "generated_features")
        self._check_capacity(batch_size, device, gradient_selected)
        ids = self._check_ids(batch_size, gradient_selected, sample_ids, current_teacher_sample_ids)
        stores_teacher = self._check_teacher(batch_size, gradient_selected, current_teacher_features)
        self._store_rows(generated_features, current_teacher_features if stores_teacher else None, batch_size, device)
        index = len(self._batch_sizes)
        self._batch_sizes.append(batch_size)
        if gradient_selected:
            self._gradient_batch_indices.append(index)
            self._gradient_batch_sizes.append(batch_size)
            self._gradient_sample_ids.append(ids)
            for name in self.branch_names:  # the cotangents' dtype: the features', promoted
                dtype = generated_features[name].dtype
                self._cotangent_dtype = torch.promote_types(self._cotangent_dtype or dtype, dtype)
        return index

    def _store_rows(self, generated, teacher, batch_size: int, device: torch.device) -> None:
        """Copy a microbatch into the store and check that the stored values are finite."""
        if self._store is None:
            self._store = torch.empty(self._store_numel(), dtype=self.feature_dtype, device=device)
            self._device = device
        features, teachers = self._store_views(self._store)
        start, row = self.local_samples, self.selected_local_samples
        stored = []
        with torch.no_grad():
            for name in self.branch_names:
                stored.append(features[name][start : start + batch_size])
                stored[-1].copy_(generated[name].detach())
            for name in self.branch_names if teacher is not None else ():
                stored.append(teachers[name][row : row + batch_size])
                stored[-1].copy_(teacher[name].detach())
            flags = torch.stack([torch.isfinite(part).all() for part in stored])
        if self._defer_finite_check(device):
            padded = torch.ones(2 * len(self.branch_names), dtype=torch.bool, device=device)
            padded[: flags.numel()] = flags
            self._finite_flags.append(padded)
            return
        ok = flags.tolist()  # one host sync for every branch of this microbatch
        if not all(ok):
            if self.local_samples == 0:  # nothing else stored: the next add may pick another device
                self._store = self._device = None
            column = ok.index(False)
            sources = [generated] * len(self.branch_names) + [teacher] * len(self.branch_names)
            raise _non_finite_feature(column, sources[column], self.branch_names, self.feature_dtype)

    # ---- finalize --------------------------------------------------------------------------
    def _collective_device(self) -> torch.device:
        data = self._device if self._device is not None else torch.device("cpu")
        if self._world_size() == 1:
            return data
        return collective_device(data, dist.get_backend())

    def _all_rows(self, status: torch.Tensor) -> list[list[int]]:
        """Every rank's ``status`` row, in rank order: one collective and one host sync."""
        world = self._world_size()
        if world == 1:
            return [status.tolist()]
        return all_gather_rows(status.to(self._collective_device()))

    def _settings(self) -> str:
        """What must be equal on every rank for the gathered stores to line up: branch names in
        order, their shapes, the stored dtype, attraction and the row counts."""
        shapes = ", ".join(f"{name!r}: {self.sample_shapes[name]}" for name in self.branch_names)
        return (
            f"branches {{{shapes}}}, feature_dtype={self.feature_dtype},"
            f" current_teacher_attraction={self.current_teacher_attraction_enabled},"
            f" (B, b)=({self.target_local_samples}, {self.gradient_local_samples})"
        )

    def _settings_digest(self) -> int:
        """A signed 64-bit digest of :meth:`_settings`, sent in finalize's first collective."""
        digest = hashlib.blake2b(self._settings().encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little", signed=True)

    def _check_same_settings(self, digests: list[int]) -> None:
        """Raise on every rank when the ranks' settings differ (each rank saw every digest, so all
        take this branch together; the settings travel in a second collective for the message)."""
        if len(set(digests)) == 1:
            return
        described = [None] * len(digests)
        dist.all_gather_object(described, self._settings())
        lines = "; ".join(f"rank {rank}: {text}" for rank, text in enumerate(described))
        raise InvalidArgumentError(
            "the ranks' dual GradCaches differ (their loss modules' branch names, order or shapes, or"
            f" feature_dtype, attraction or sample counts); every rank must build the same: {lines}"
        )

    def _validate_ready(self) -> None:
        """Every rank learns every rank's counts and deferred finiteness (one collective), so all
        raise together."""
        expected = (self.target_local_samples, self.gradient_local_samples)
        device = self._collective_device()
        status = torch.tensor([self.local_samples, self.selected_local_samples, 1, 0, self._settings_digest()])
        status = status.to(device)
        if self._finite_flags:
            flags = torch.stack(self._finite_flags).flatten().to(device)
            status[2], status[3] = flags.all().long(), flags.long().argmin()
        world = self._world_size()
        observed = self._all_rows(status)
        self._check_same_settings([row[4] for row in observed])
        counts = [tuple(row[:2]) for row in observed]
        if world == 1 and counts[0] != expected:
            raise ReplayError(f"incomplete dual GradCache: (stored, selected) = {counts[0]}, expected {expected}")
        if any(item != expected for item in counts):
            raise ReplayError(
                f"incomplete distributed dual GradCache: (stored, selected) per rank = {counts}, expected {expected}"
            )
        bad = [(rank, row[3]) for rank, row in enumerate(observed) if not row[2]]
        if bad:
            rank, flat = bad[0]
            add, column = divmod(flat, 2 * len(self.branch_names))
            label = "generated_features" if column < len(self.branch_names) else "current_teacher_features"
            name = self.branch_names[column % len(self.branch_names)]
            raise NonFiniteReplayError(
                f"{label}[{name!r}] of add #{add} on rank {rank} is not finite in the {self.feature_dtype} cache"
                f" (NaN/inf, or finite values beyond its range; feature_dtype=torch.float64 holds those)"
            )

    def finalize(self) -> FeatureGradientReplayResult:
        """Evaluate the loss over all ranks' B samples and return the selected rows' cotangents.

        Steps: check every rank is complete and finite; gather the stores; evaluate the loss with
        this rank's suffix as autograd leaves; check loss and cotangents are finite on every rank;
        scatter the gradients into per-microbatch cotangents. Calling it again returns the same
        result object.
        """
        if self._result is not None:
            return self._result
        self._validate_ready()
        leaves, inputs = self._loss_inputs(self._gather_stores())
        raw_loss, optimized, metadata, grads = self._differentiate(leaves, inputs)
        scale = float(self._world_size())
        self._check_finite_outputs(raw_loss, metadata, grads, scale)
        previous = self._reusable_scatter(grads, scale)
        scattered = self._scattered = scatter_cotangents(
            grads, self._gradient_batch_sizes, scale=scale, dtype=self._cotangent_dtype, reuse=previous
        )
        self._result = self._make_result(raw_loss, optimized, metadata, scattered)
        return self._result

    def _gather_stores(self) -> list[torch.Tensor]:
        """Every rank's flat store (this rank's is its own buffer), on this rank's device."""
        world = self._world_size()
        if world == 1:
            return [self._store]
        device = self._collective_device()
        local = self._store.to(device)
        gathered = torch.empty(world * local.numel(), dtype=local.dtype, device=device)
        _all_gather_single(gathered, local)
        stores = list(gathered.to(self._device).chunk(world))
        stores[self._rank()] = self._store
        return stores

    def _loss_inputs(self, stores: list[torch.Tensor]):
        """(this rank's leaves per branch, the loss module's keyword arguments).

        Rank r's selected suffix sits at rows ``[r*B + B - b, (r+1)*B)`` of the global batch. All
        B*world rows enter the loss; only this rank's suffix rows are autograd leaves -- the other
        ranks differentiate their own.
        """
        world, rank = len(stores), self._rank()
        per_rank = [self._store_views(store) for store in stores]
        suffix = self.target_local_samples - self.gradient_local_samples
        B = self.target_local_samples
        indices = torch.cat([torch.arange(r * B + suffix, (r + 1) * B) for r in range(world)]).to(self._device)
        leaves, distribution, differentiation = {}, {}, {}
        teacher = {} if self.current_teacher_attraction_enabled else None
        for name in self.branch_names:
            leaves[name] = per_rank[rank][0][name][suffix:].detach().requires_grad_(True)
            distribution[name] = torch.cat([features[name] for features, _ in per_rank])
            differentiation[name] = torch.cat(
                [leaves[name] if r == rank else per_rank[r][0][name][suffix:] for r in range(world)]
            )
            if teacher is not None:
                teacher[name] = torch.cat([teachers[name] for _, teachers in per_rank])
        inputs = dict(
            gradient_students=differentiation,
            student_reference=distribution,
            current_teacher=teacher,
            gradient_student_indices=indices,
        )
        return leaves, inputs

    def _differentiate(self, leaves: dict[str, torch.Tensor], inputs: dict):
        """(raw loss, optimized loss, metadata, per-branch leaf gradients), evaluated in the cache's
        dtype: a caller's autocast would run the kernel sums in half precision."""
        device_type = self._device.type
        no_autocast = (
            torch.autocast(device_type, enabled=False)
            if torch.amp.is_autocast_available(device_type)
            else contextlib.nullcontext()
        )
        with torch.enable_grad(), no_autocast:
            raw_loss, metadata = self.loss_module(**inputs)
            optimized = raw_loss * self.loss_scale
            grads = torch.autograd.grad(optimized, [leaves[name] for name in self.branch_names], allow_unused=True)
        grads = [torch.zeros_like(leaves[name]) if g is None else g for name, g in zip(self.branch_names, grads)]
        return raw_loss, optimized, metadata, grads

    def _check_finite_outputs(self, raw_loss, metadata, grads, scale: float) -> None:
        """Raise on every rank if any rank's loss or cotangent is not finite (one collective)."""
        out_dtype = self._cotangent_dtype
        flags = [torch.isfinite(raw_loss.detach()).all()]
        for grad in grads:
            low, high = torch.aminmax(grad)  # NaN propagates
            peak = torch.maximum(high, -low)
            flags.append(torch.isfinite((peak * scale).to(out_dtype)))  # as the scatter rounds it
        world = self._world_size()
        rows = self._all_rows(torch.stack(flags).long())
        for rank, row in enumerate(rows):
            if all(row):
                continue
            where = f" on rank {rank}" if world > 1 else ""
            if not row[0]:
                terms = _nonfinite_terms(metadata, self.branch_names)
                raise NonFiniteReplayError(f"the replay loss is not finite{where}: {terms}")
            names = [name for name, ok in zip(self.branch_names, row[1:]) if not ok]
            dtype = f" in {out_dtype}" if rank == self._rank() else ""
            raise NonFiniteReplayError(
                f"the cotangents of branch {names[0]!r}{where} are not finite{dtype} (all failing: {names}); the"
                " loss is finite, so its gradient overflowed the cotangents' dtype: scale the loss down or add"
                " float32 features"
            )

    def _reusable_scatter(self, grads: list[torch.Tensor], scale: float) -> ScatteredCotangents | None:
        """The previous step's scatter if its arena fits this one (it does unless the features moved
        to another device or changed dtype); otherwise a new arena is allocated and the old result
        keeps its own."""
        previous = self._scattered
        if previous is None or previous.expired:
            return None
        arena = previous.arena
        numel = arena_size(grads, self._gradient_batch_sizes, scale=scale, dtype=self._cotangent_dtype)
        if arena.numel() != numel or arena.dtype != self._cotangent_dtype or arena.device != grads[0].device:
            return None
        return previous

    def _make_result(self, raw_loss, optimized, metadata, scattered) -> FeatureGradientReplayResult:
        world = self._world_size()
        local, fsdp = _per_microbatch(self.branch_names, scattered)
        teacher_local = self.gradient_local_samples if self.current_teacher_attraction_enabled else 0
        return FeatureGradientReplayResult(
            loss=raw_loss.detach(),
            optimized_loss=optimized.detach(),
            metadata=self._metadata(raw_loss, optimized, metadata, teacher_local),
            local_cotangents=local,
            fsdp_cotangents=fsdp,
            replay_batch_indices=tuple(self._gradient_batch_indices),
            replay_sample_ids=tuple(self._gradient_sample_ids),
            local_samples=self.target_local_samples,
            global_samples=self.target_local_samples * world,
            gradient_local_samples=self.gradient_local_samples,
            gradient_global_samples=self.gradient_local_samples * world,
            current_teacher_local_samples=teacher_local,
            current_teacher_global_samples=teacher_local * world,
            world_size=world,
            cotangents=scattered,
        )

    def _metadata(self, raw_loss, optimized, metadata, teacher_local: int) -> dict[str, Any]:
        """The loss module's metadata plus the bookkeeping names of the original training logs.
        The counters are views of one tensor, made with one host-to-device copy."""
        world = self._world_size()
        B, b = self.target_local_samples, self.gradient_local_samples
        counts = {
            "gradcache_local_samples": B,
            "gradcache_global_samples": B * world,
            "gradcache_forward_local_samples": B,
            "gradcache_forward_global_samples": B * world,
            "gradcache_gradient_local_samples": b,
            "gradcache_gradient_global_samples": b * world,
            "gradcache_current_teacher_local_samples": teacher_local,
            "gradcache_current_teacher_global_samples": teacher_local * world,
            "gradcache_kss_denominator": (B * world) ** 2,
            "gradcache_partial_gradient_enabled": 1,
            "gradcache_full_student_partial_gradient": 1,
            "gradcache_world_size": world,
        }
        values = torch.tensor(list(counts.values()), dtype=torch.long).to(raw_loss.device)
        scales = torch.tensor([self.loss_scale, float(world)], dtype=raw_loss.dtype).to(raw_loss.device)
        meta = {key: value.detach() if isinstance(value, torch.Tensor) else value for key, value in metadata.items()}
        meta.update(raw_loss=raw_loss.detach(), optimized_loss=optimized.detach(), loss_scale=scales[0])
        meta.update(zip(counts, values.unbind()))
        meta.update(gradcache_fsdp_cotangent_scale=scales[1], gradcache_branch_names=self.branch_names)
        return meta

    # ---- after the update --------------------------------------------------------------------
    def offload_finalized_to_cpu(self) -> FeatureGradientReplayResult:
        """Move the cached features and the result to the CPU, with one host sync: the small
        tensors (loss, metadata) travel as one packed transfer, the feature store and the
        cotangent buffers as one copy each, and the cotangents come back as views of the CPU copy.
        Returns the new result. The copies are always new buffers (also from CPU tensors), so the
        result stays valid after later steps."""
        if self._result is None:
            raise ReplayError("cannot offload the dual GradCache before finalize")
        result = self._result
        small, spec = pytree.tree_flatten((result.loss, result.optimized_loss, dict(result.metadata)))
        where = [i for i, value in enumerate(small) if isinstance(value, torch.Tensor)]
        buffers = result.cotangents.tensors()
        moved = copy_tensors([self._store, *buffers, *(small[i] for i in where)], "cpu")
        self._store, self._device = moved[0], torch.device("cpu")
        for i, tensor in zip(where, moved[1 + len(buffers) :]):
            small[i] = tensor
        loss, optimized, metadata = pytree.tree_unflatten(small, spec)
        scattered = result.cotangents.rebuilt(moved[1 : 1 + len(buffers)])
        local, fsdp = _per_microbatch(self.branch_names, scattered)
        self._result = dataclasses.replace(
            result, loss=loss, optimized_loss=optimized, metadata=metadata,
            local_cotangents=local, fsdp_cotangents=fsdp, cotangents=scattered,
        )  # fmt: skip
        return self._result

    def commit(self) -> None:
        """Release everything after the optimizer update that used this result (the cotangent
        arena is kept for the next step)."""
        if self._result is None:
            raise ReplayError("cannot commit the dual GradCache before finalize")
        self._clear()

    def discard(self) -> None:
        """Release everything without an update (an abandoned or failed step); the cotangent arena
        is kept for the next step."""
        self._clear()


# newer torch renamed all_gather_into_tensor to all_gather_single (the old name warns)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _check_loss_module(loss_module) -> None:
    missing = [
        attr
        for attr in ("branch_names", "sample_shapes", "current_teacher_attraction_enabled")
        if not hasattr(loss_module, attr)
    ]
    if missing or not callable(loss_module):
        raise ArgumentTypeError(
            "loss_module must be callable with branch_names, sample_shapes and"
            f" current_teacher_attraction_enabled (e.g. MultiEncoderMMD); {type(loss_module).__name__}"
            f" lacks {missing or ['__call__']}"
        )


def _non_finite_feature(column: int, source, names, feature_dtype) -> NonFiniteReplayError:
    """The error for stored column ``column`` (generated branches, then teacher branches)."""
    label = "generated_features" if column < len(names) else "current_teacher_features"
    name = names[column % len(names)]
    value = source[name].detach()
    if bool(torch.isfinite(value).all()):
        peak = float(value.abs().max())
        return NonFiniteReplayError(
            f"{label}[{name!r}] is finite but exceeds the range of the {feature_dtype} cache (|x| up to {peak:.3g}):"
            " it would be stored as inf; pass feature_dtype=torch.float64 or rescale the features"
        )
    return NonFiniteReplayError(f"{label}[{name!r}] holds non-finite values (NaN or inf)")


def _nonfinite_terms(metadata, branch_names) -> str:
    """Which per-branch terms of the loss metadata (``<term>/<branch>``) are not finite."""
    bad = []
    for key, value in metadata.items():
        branch = key.rsplit("/", 1)[-1] if isinstance(key, str) and "/" in key else None
        if branch in branch_names and isinstance(value, torch.Tensor) and not bool(torch.isfinite(value).all()):
            bad.append(f"{key}={value.detach().cpu().tolist()}")
    if not bad:
        return "no per-branch term of the loss metadata names a branch"
    first = bad[0].split("=")[0].rsplit("/", 1)[-1]
    return f"branch {first!r} ({', '.join(bad)}); features of very large magnitude overflow the kernel"
