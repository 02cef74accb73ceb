"""Multi-encoder distribution loss: a mixed-RBF kernel MMD² per feature branch, plus optional
attraction of each differentiated student to its current teacher.

Notation for one branch with features ``[*, N, D]``:

* per-sample embedding ``e(x)``: ``"mean"`` -> the token mean ``(1/N) sum_n x[n]`` (``[D]``);
  ``"flatten"`` -> ``x`` reshaped to ``[N*D]``;
* bandwidth ``h``: the median squared distance between embeddings (never an absolute value), and a
  ladder of multipliers ``s_l`` (default 0.25 .. 4):
  ``k(u, v) = (1/L) sum_l exp(-|u - v|^2 / (s_l * h))``;
* the student batch ``X`` is ``student_reference`` (all B samples, values only) with the rows at
  ``gradient_student_indices`` replaced by ``gradient_students`` (the only rows with a graph);
* the reference distribution ``Y`` is what the trainer last passed to :meth:`update_reference`.

**exact** mode (unbiased U-statistic over the current reference batch, M rows)::

    MMD² = sum_{i!=j} k(x_i,x_j) / (B(B-1)) + sum_{i!=j} k(y_i,y_j) / (M(M-1)) - 2 sum_ij k(x_i,y_j) / (BM)

with ``h`` the median over the pooled ``X`` and ``Y`` (detached), recomputed each call.

**nystrom** mode (``m`` landmarks ``Z`` drawn once from the first reference batch, ``h`` frozen
then as the median over the landmarks): the feature map ``phi(v) = K_ZZ^{-1/2} k_Z(v)`` turns the
kernel into a dot product, and the reference distribution is the persistent summary
``mu = EMA_t[ mean_j phi(y_j) ]`` (``mu <- decay * mu + (1 - decay) * mean_j phi(y_j)`` at every
:meth:`update_reference`), so it spans many steps' reference batches at ``O(m)`` memory::

    MMD² = (|sum_i phi(x_i)|^2 - sum_i |phi(x_i)|^2) / (B(B-1)) - 2 mean_i phi(x_i).mu + |mu|^2

**attraction** (when ``teacher_attraction_weight > 0``): ``mean_i |e(s_i) - e(t_i)|^2`` over the
differentiated students ``s_i`` and their current teachers ``t_i``.

The loss is ``sum_k w_k * (MMD²_k + teacher_attraction_weight * attraction_k)``. ``forward`` never
changes the module's state, so evaluating it twice on the same input gives the same value.
"""
from __future__ import annotations

import functools
import operator
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ..errors import InvalidArgumentError, ReplayError

EMBEDDINGS = ("mean", "flatten")
MODES = ("exact", "nystrom")


def _embed(features: torch.Tensor, how: str) -> torch.Tensor:
    return features.mean(dim=1) if how == "mean" else features.reshape(features.shape[0], -1)


def _squared_distances(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2.0 * (a @ b.T)).clamp_min(0.0)


def _median_offdiagonal(d2: torch.Tensor) -> torch.Tensor:
    mask = ~torch.eye(d2.shape[0], dtype=torch.bool, device=d2.device)
    return d2[mask].median().clamp_min(torch.finfo(d2.dtype).tiny)


def _mixed_rbf(d2: torch.Tensor, bandwidth: torch.Tensor, ladder: torch.Tensor) -> torch.Tensor:
    return torch.exp(-d2[..., None] / (ladder * bandwidth)).mean(-1)


def _offdiagonal_mean(kernel: torch.Tensor) -> torch.Tensor:
    n = kernel.shape[0]
    eye = torch.eye(n, dtype=torch.bool, device=kernel.device)
    return kernel.masked_fill(eye, 0.0).sum() / (n * (n - 1))


def _checked_shapes(sample_shapes) -> dict[str, tuple[int, int]]:
    if not isinstance(sample_shapes, Mapping) or not sample_shapes:
        raise InvalidArgumentError(f"sample_shapes must be a non-empty mapping name -> (N, D), got {sample_shapes!r}")
    shapes = {}
    for name, shape in sample_shapes.items():
        shape = tuple(int(v) for v in shape)
        if len(shape) != 2 or min(shape) <= 0:
            raise InvalidArgumentError(f"sample_shapes[{name!r}] must be a positive (N, D), got {shape}")
        shapes[str(name)] = shape
    return shapes


def _per_branch_settings(branch_names: tuple[str, ...], weights, embedding) -> tuple[dict[str, float], dict[str, str]]:
    """``weights`` (default 1.0) and ``embedding`` (one name for all, or one per branch) by branch."""
    weights = dict(weights or {})
    unknown = set(weights) - set(branch_names)
    if unknown:
        raise InvalidArgumentError(f"weights name unknown branches {sorted(unknown)}; branches are {branch_names}")
    how = embedding if isinstance(embedding, Mapping) else {name: embedding for name in branch_names}
    if set(how) != set(branch_names) or any(v not in EMBEDDINGS for v in how.values()):
        raise InvalidArgumentError(f"embedding must be one of {EMBEDDINGS} or a mapping of them per branch, got {embedding!r}")
    return {name: float(weights.get(name, 1.0)) for name in branch_names}, {name: how[name] for name in branch_names}


class MultiEncoderMMD(nn.Module):
    """Distribution loss over several encoders' features (see the module docstring for formulas).

    Args:
        sample_shapes: branch name -> per-sample feature geometry ``(N, D)``; the order of the
            mapping is the branch order.
        weights: branch name -> weight ``w_k`` (default 1 for every branch).
        embedding: ``"mean"`` or ``"flatten"``, or a mapping per branch.
        mode: ``"exact"`` (unbiased MMD² against the current reference batch) or ``"nystrom"``.
        num_landmarks: ``m`` of the Nyström mode (at most the first reference batch's size).
        ema_decay: decay of the Nyström reference summary across :meth:`update_reference` calls.
        bandwidth_ladder: multipliers ``s_l`` of the median squared distance.
        teacher_attraction_weight: weight of the current-teacher attraction; > 0 turns it on
            (``current_teacher_attraction_enabled``).
        landmark_seed: seed of the landmark draw (deterministic, identical on every rank).
    """

    def __init__(
        self,
        sample_shapes: Mapping[str, Sequence[int]],
        *,
        weights: Mapping[str, float] | None = None,
        embedding: str | Mapping[str, str] = "mean",
        mode: str = "exact",
        num_landmarks: int = 64,
        ema_decay: float = 0.9,
        bandwidth_ladder: Sequence[float] = (0.25, 0.5, 1.0, 2.0, 4.0),
        teacher_attraction_weight: float = 0.0,
        landmark_seed: int = 0,
    ):
        super().__init__()
        self.sample_shapes: dict[str, tuple[int, int]] = _checked_shapes(sample_shapes)
        self.branch_names: tuple[str, ...] = tuple(self.sample_shapes)
        self.weights, self.embedding = _per_branch_settings(self.branch_names, weights, embedding)
        if mode not in MODES:
            raise InvalidArgumentError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        if int(num_landmarks) < 2:
            raise InvalidArgumentError(f"num_landmarks must be >= 2, got {num_landmarks}")
        self.num_landmarks = int(num_landmarks)
        if not 0.0 <= float(ema_decay) < 1.0:
            raise InvalidArgumentError(f"ema_decay must be in [0, 1), got {ema_decay}")
        self.ema_decay = float(ema_decay)
        ladder = [float(s) for s in bandwidth_ladder]
        if not ladder or min(ladder) <= 0:
            raise InvalidArgumentError(f"bandwidth_ladder must be positive multipliers, got {bandwidth_ladder!r}")
        self.register_buffer("bandwidth_ladder", torch.tensor(ladder, dtype=torch.float64))
        if float(teacher_attraction_weight) < 0:
            raise InvalidArgumentError(f"teacher_attraction_weight must be >= 0, got {teacher_attraction_weight}")
        self.teacher_attraction_weight = float(teacher_attraction_weight)
        self.current_teacher_attraction_enabled = self.teacher_attraction_weight > 0
        self.landmark_seed = int(landmark_seed)
        # Reference state per branch (see update_reference). Exact mode keeps the last batch's
        # embeddings (not persistent: its size varies); Nyström keeps landmarks, K_ZZ^{-1/2},
        # the frozen bandwidth and the EMA summary (persistent, so checkpoints resume it).
        self.reference_updates = 0
        for name in self.branch_names:
            key = self._key(name)  # buffers are named by branch position: any branch name works
            self.register_buffer(f"reference_{key}", None, persistent=False)
            if mode == "nystrom":
                self.register_buffer(f"landmarks_{key}", None)
                self.register_buffer(f"whitening_{key}", None)
                self.register_buffer(f"bandwidth_{key}", None)
                self.register_buffer(f"summary_{key}", None)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A fresh module holds no Nyström state yet (None buffers are skipped by the loader), so
        # give each saved buffer a slot of the saved shape before the normal load fills it.
        for name in self.branch_names if self.mode == "nystrom" else ():
            for kind in ("landmarks", "whitening", "bandwidth", "summary"):
                saved = state_dict.get(f"{prefix}{kind}_{self._key(name)}")
                if saved is not None and self._state(kind, name) is None:
                    self._set_state(kind, name, torch.empty_like(saved))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _key(self, name: str) -> str:
        return f"branch{self.branch_names.index(name)}"

    def _state(self, kind: str, name: str):
        return getattr(self, f"{kind}_{self._key(name)}")

    def _set_state(self, kind: str, name: str, value: torch.Tensor) -> None:
        setattr(self, f"{kind}_{self._key(name)}", value)

    def _check_branches(self, features, label: str, rows: int | None = None) -> None:
        if not isinstance(features, Mapping) or set(features) != set(self.branch_names):
            got = sorted(features) if isinstance(features, Mapping) else type(features).__name__
            raise InvalidArgumentError(f"{label} must map exactly the branches {self.branch_names}, got {got}")
        for name in self.branch_names:
            value = features[name]
            if not isinstance(value, torch.Tensor) or value.ndim != 3 or not value.is_floating_point():
                raise InvalidArgumentError(f"{label}[{name!r}] must be a floating [B, N, D] tensor")
            if tuple(value.shape[1:]) != self.sample_shapes[name]:
                raise InvalidArgumentError(
                    f"{label}[{name!r}] geometry {tuple(value.shape[1:])} != expected {self.sample_shapes[name]}"
                )
            if rows is not None and value.shape[0] != rows:
                raise InvalidArgumentError(f"{label}[{name!r}] has {value.shape[0]} rows, expected {rows}")

    def _feature_map(self, embedded: torch.Tensor, name: str) -> torch.Tensor:
        landmarks = self._state("landmarks", name).to(embedded.dtype)
        bandwidth = self._state("bandwidth", name).to(embedded.dtype)
        kernel = _mixed_rbf(_squared_distances(embedded, landmarks), bandwidth, self.bandwidth_ladder.to(embedded.dtype))
        return kernel @ self._state("whitening", name).to(embedded.dtype)

    @torch.no_grad()
    def update_reference(self, reference_features: Mapping[str, torch.Tensor]) -> None:
        """Feed this step's reference (target-distribution) features ``[M, N_k, D_k]`` per branch.

        Call it before ``finalize`` with the same (globally gathered) batch on every rank, so every
        rank holds the same reference state. Exact mode replaces the reference batch; Nyström mode
        draws its landmarks on the first call and folds every call into the EMA summary.
        """
        self._check_branches(reference_features, "reference_features")
        for name in self.branch_names:
            embedded = _embed(reference_features[name].detach(), self.embedding[name])
            if embedded.shape[0] < 2:
                raise InvalidArgumentError(f"reference_features[{name!r}] needs at least 2 rows, got {embedded.shape[0]}")
            if self.mode == "exact":
                self._set_state("reference", name, embedded.clone())
                continue
            if self._state("landmarks", name) is None:
                self._init_landmarks(name, embedded)
            mean_phi = self._feature_map(embedded, name).mean(0)
            summary = self._state("summary", name)
            if summary is None:
                self._set_state("summary", name, mean_phi.clone())
            else:
                summary.mul_(self.ema_decay).add_(mean_phi.to(summary.dtype), alpha=1.0 - self.ema_decay)
        self.reference_updates += 1

    def _init_landmarks(self, name: str, embedded: torch.Tensor) -> None:
        m = min(self.num_landmarks, embedded.shape[0])
        generator = torch.Generator().manual_seed(self.landmark_seed)
        pick = torch.randperm(embedded.shape[0], generator=generator)[:m].to(embedded.device)
        landmarks = embedded[pick].clone()
        d2 = _squared_distances(landmarks, landmarks)
        bandwidth = _median_offdiagonal(d2)
        gram = _mixed_rbf(d2, bandwidth, self.bandwidth_ladder.to(d2.dtype))
        eigenvalues, eigenvectors = torch.linalg.eigh(gram)
        # pseudo-inverse square root: directions the landmarks cannot resolve are dropped
        keep = eigenvalues > eigenvalues.max() * 1e-6 * m
        inv_sqrt = torch.where(keep, eigenvalues.clamp_min(torch.finfo(gram.dtype).tiny).rsqrt(), 0.0)
        self._set_state("landmarks", name, landmarks)
        self._set_state("bandwidth", name, bandwidth)
        self._set_state("whitening", name, (eigenvectors * inv_sqrt) @ eigenvectors.T)

    def forward(
        self,
        gradient_students: Mapping[str, torch.Tensor],
        student_reference: Mapping[str, torch.Tensor],
        current_teacher: Mapping[str, torch.Tensor] | None,
        gradient_student_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Loss over the B students and per-branch terms.

        Args:
            gradient_students: branch -> ``[b, N, D]`` rows carrying the gradient.
            student_reference: branch -> ``[B, N, D]`` all students (values; rows at the indices are
                replaced by ``gradient_students``).
            current_teacher: branch -> ``[b, N, D]`` teacher of each gradient row (attraction on),
                else None.
            gradient_student_indices: ``[b]`` distinct int64 row indices into the B students.

        Returns:
            ``(loss, metadata)``; metadata has ``mmd2/<branch>``, ``bandwidth/<branch>``,
            ``attraction/<branch>`` (attraction on), ``loss/<branch>`` (weighted term), ``mmd2``.
        """
        index = self._check_forward(gradient_students, student_reference, current_teacher, gradient_student_indices)
        metadata: dict[str, torch.Tensor] = {}
        terms, mmds = [], []
        for name in self.branch_names:
            differentiable = gradient_students[name]
            x = self._students(name, differentiable, student_reference[name], index)
            mmd2, bandwidth = self._exact_mmd2(name, x) if self.mode == "exact" else self._nystrom_mmd2(name, x)
            metadata[f"mmd2/{name}"] = mmd2.detach()
            metadata[f"bandwidth/{name}"] = bandwidth.detach()
            term = mmd2
            if self.current_teacher_attraction_enabled:
                attraction = self._attraction(name, differentiable, current_teacher[name])
                metadata[f"attraction/{name}"] = attraction.detach()
                term = term + self.teacher_attraction_weight * attraction
            terms.append(self.weights[name] * term)
            metadata[f"loss/{name}"] = terms[-1].detach()
            mmds.append(mmd2.detach())
        metadata["mmd2"] = functools.reduce(operator.add, mmds)
        return functools.reduce(operator.add, terms), metadata

    def _check_forward(self, gradient_students, student_reference, current_teacher, index) -> torch.Tensor:
        """Validate ``forward``'s arguments; returns the index tensor."""
        self._check_branches(student_reference, "student_reference")
        total_rows = student_reference[self.branch_names[0]].shape[0]
        self._check_branches(student_reference, "student_reference", rows=total_rows)
        if total_rows < 2:
            raise InvalidArgumentError(f"student_reference needs at least 2 rows, got {total_rows}")
        if not isinstance(index, torch.Tensor) or index.ndim != 1 or index.dtype != torch.long:
            raise InvalidArgumentError("gradient_student_indices must be a 1-D int64 tensor")
        self._check_branches(gradient_students, "gradient_students", rows=index.numel())
        if index.numel():
            low, high = torch.stack(torch.aminmax(index)).tolist()
            if low < 0 or high >= total_rows:
                raise InvalidArgumentError(f"gradient_student_indices must lie in [0, {total_rows}), got {index.tolist()}")
        if index.unique().numel() != index.numel():
            raise InvalidArgumentError("gradient_student_indices must be distinct")
        if self.current_teacher_attraction_enabled:
            if current_teacher is None:
                raise InvalidArgumentError("current_teacher is required while current-teacher attraction is enabled")
            self._check_branches(current_teacher, "current_teacher", rows=index.numel())
        elif current_teacher is not None:
            raise InvalidArgumentError("current_teacher was given while current-teacher attraction is disabled")
        return index

    def _students(self, name: str, differentiable, reference, index) -> torch.Tensor:
        """Embedded students ``X``: all rows' values, with the indexed rows carrying the graph."""
        students = reference.detach().to(differentiable.dtype)
        students = students.index_copy(0, index.to(students.device), differentiable)
        return _embed(students, self.embedding[name])

    def _exact_mmd2(self, name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unbiased MMD² against the current reference batch; bandwidth from the pooled median."""
        reference = self._state("reference", name)
        if reference is None:
            raise ReplayError("call update_reference(...) before evaluating the loss")
        y = reference.to(device=x.device, dtype=x.dtype)
        ladder = self.bandwidth_ladder.to(x.dtype)
        pooled = torch.cat([x.detach(), y])
        bandwidth = _median_offdiagonal(_squared_distances(pooled, pooled))
        mmd2 = (
            _offdiagonal_mean(_mixed_rbf(_squared_distances(x, x), bandwidth, ladder))
            + _offdiagonal_mean(_mixed_rbf(_squared_distances(y, y), bandwidth, ladder))
            - 2.0 * _mixed_rbf(_squared_distances(x, y), bandwidth, ladder).mean()
        )
        return mmd2, bandwidth

    def _nystrom_mmd2(self, name: str, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """MMD² of the students' Nyström features against the persistent summary ``mu``."""
        summary = self._state("summary", name)
        if summary is None:
            raise ReplayError("call update_reference(...) before evaluating the loss")
        mu = summary.to(device=x.device, dtype=x.dtype)
        phi = self._feature_map(x, name)
        total, rows = phi.sum(0), phi.shape[0]
        xx = (total.dot(total) - (phi * phi).sum()) / (rows * (rows - 1))
        mmd2 = xx - 2.0 * phi.mean(0).dot(mu) + mu.dot(mu)
        return mmd2, self._state("bandwidth", name).to(x.dtype)

    def _attraction(self, name: str, differentiable, teacher) -> torch.Tensor:
        """Mean squared distance between each differentiated student's embedding and its teacher's."""
        how = self.embedding[name]
        target = _embed(teacher.detach().to(differentiable.dtype), how)
        return (_embed(differentiable, how) - target).pow(2).sum(1).mean()
