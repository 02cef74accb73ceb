"""MultiEncoderMMD: formulas against brute force, bandwidth scaling, Nyström summary, errors."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from latentfast.replay import MultiEncoderMMD

SHAPES = {"x": (3, 4), "y": (2, 2)}


def _batch(rows, seed, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(rows, *s, generator=g, dtype=torch.float64) * scale + shift for n, s in SHAPES.items()}


def _brute_mixed_rbf(u, v, h, ladder):
    d2 = float(((u - v) ** 2).sum())
    return sum(math.exp(-d2 / (s * h)) for s in ladder) / len(ladder)


def _brute_exact_mmd(x, y, ladder):
    pooled = torch.cat([x, y])
    d2 = [float(((a - b) ** 2).sum()) for (i, a), (j, b) in itertools.product(enumerate(pooled), repeat=2) if i != j]
    h = float(torch.tensor(d2, dtype=torch.float64).median())
    B, M = len(x), len(y)
    xx = sum(_brute_mixed_rbf(x[i], x[j], h, ladder) for i in range(B) for j in range(B) if i != j) / (B * (B - 1))
    yy = sum(_brute_mixed_rbf(y[i], y[j], h, ladder) for i in range(M) for j in range(M) if i != j) / (M * (M - 1))
    xy = sum(_brute_mixed_rbf(a, b, h, ladder) for a in x for b in y) / (B * M)
    return xx + yy - 2 * xy, h


def _call(loss, students, rows_with_grad, teacher=None):
    index = torch.tensor(rows_with_grad)
    grads = {n: v[index].clone().requires_grad_(True) for n, v in students.items()}
    value, meta = loss(grads, students, teacher, index)
    return value, meta, grads


def test_exact_mode_matches_brute_force():
    ladder = (0.5, 1.0, 3.0)
    loss = MultiEncoderMMD(SHAPES, weights={"y": 0.25}, embedding={"x": "mean", "y": "flatten"}, bandwidth_ladder=ladder)
    reference = _batch(5, seed=1, shift=0.5)
    loss.update_reference(reference)
    students = _batch(6, seed=2)
    value, meta, _ = _call(loss, students, [4, 5])
    expected_x, hx = _brute_exact_mmd(students["x"].mean(1), reference["x"].mean(1), ladder)
    expected_y, _ = _brute_exact_mmd(students["y"].flatten(1), reference["y"].flatten(1), ladder)
    assert float(meta["mmd2/x"]) == pytest.approx(expected_x, rel=1e-10)
    assert float(meta["mmd2/y"]) == pytest.approx(expected_y, rel=1e-10)
    assert float(meta["bandwidth/x"]) == pytest.approx(hx, rel=1e-12)
    assert float(value.detach()) == pytest.approx(expected_x + 0.25 * expected_y, rel=1e-10)
    assert float(meta["loss/y"]) == pytest.approx(0.25 * expected_y, rel=1e-10)


def _kernel_matrix(a, b, h, ladder):
    return torch.tensor([[_brute_mixed_rbf(u, v, h, ladder) for v in b] for u in a], dtype=torch.float64)


@pytest.mark.parametrize("embedding", ["mean", "flatten"])
def test_nystrom_terms_match_brute_force_when_landmarks_are_the_reference(embedding):
    """With every reference row a landmark, phi(x).phi(y_j) = k(x, y_j) exactly, so the cross term
    and |mu|^2 equal their kernel sums; the student term is the Nyström kernel
    k_Z(x)^T K_ZZ^-1 k_Z(x'), computed here with a linear solve instead of the eigen-whitening."""
    ladder = (0.25, 0.5, 1.0, 2.0, 4.0)
    loss = MultiEncoderMMD(SHAPES, mode="nystrom", num_landmarks=50, embedding=embedding, landmark_seed=1)
    reference = _batch(7, seed=1, shift=0.4)
    loss.update_reference(reference)  # one update: mu = mean_j phi(y_j)
    students = _batch(6, seed=2, scale=1.3)
    value, meta, _ = _call(loss, students, [3, 5])
    embed = (lambda v: v.mean(1)) if embedding == "mean" else (lambda v: v.flatten(1))
    expected_total = 0.0
    for name in SHAPES:
        x, y = embed(students[name]), embed(reference[name])
        d2 = [float(((a - b) ** 2).sum()) for i, a in enumerate(y) for j, b in enumerate(y) if i != j]
        h = float(torch.tensor(d2, dtype=torch.float64).median())
        assert float(meta[f"bandwidth/{name}"]) == pytest.approx(h, rel=1e-12)
        gram = _kernel_matrix(y, y, h, ladder)
        eigenvalues = torch.linalg.eigvalsh(gram)
        assert eigenvalues.min() > eigenvalues.max() * 1e-6 * len(y)  # no landmark direction dropped
        k_xz = _kernel_matrix(x, y, h, ladder)
        nystrom_xx = k_xz @ torch.linalg.solve(gram, k_xz.T)
        B, M = len(x), len(y)
        xx = float(nystrom_xx.sum() - nystrom_xx.diagonal().sum()) / (B * (B - 1))
        cross = float(k_xz.sum()) / (B * M)
        yy = float(gram.sum()) / (M * M)
        expected = xx - 2 * cross + yy
        assert float(meta[f"mmd2/{name}"]) == pytest.approx(expected, rel=1e-9, abs=1e-12)
        expected_total += expected
    assert float(value.detach()) == pytest.approx(expected_total, rel=1e-9)


def test_only_indexed_rows_get_gradients_and_values_use_all_rows():
    loss = MultiEncoderMMD(SHAPES)
    loss.update_reference(_batch(5, seed=1))
    students = _batch(6, seed=2)
    full, _, _ = _call(loss, students, list(range(6)))
    partial, _, grads = _call(loss, students, [1, 4])
    assert float(partial.detach()) == pytest.approx(float(full.detach()), rel=1e-14)  # same value whatever rows carry grad
    partial.backward()
    # gradient of row 1 via the partial call equals that row's gradient in the all-rows call
    every = {n: v.clone().requires_grad_(True) for n, v in students.items()}
    loss(every, students, None, torch.arange(6))[0].backward()
    torch.testing.assert_close(grads["x"].grad, every["x"].grad[[1, 4]], rtol=1e-12, atol=1e-14)


def test_bandwidth_is_median_scaled():
    """Scaling every feature by c leaves MMD² unchanged: bandwidths follow the data."""
    values = []
    for c in (1.0, 10.0):
        for mode in ("exact", "nystrom"):
            loss = MultiEncoderMMD(SHAPES, mode=mode, num_landmarks=6)
            loss.update_reference({n: v * c for n, v in _batch(8, seed=1, shift=0.3).items()})
            values.append((mode, float(_call(loss, {n: v * c for n, v in _batch(6, seed=2).items()}, [5])[0].detach())))
    assert values[0][1] == pytest.approx(values[2][1], rel=1e-9)
    assert values[1][1] == pytest.approx(values[3][1], rel=1e-9)


def test_nystrom_summary_is_an_ema_and_forward_is_pure():
    loss = MultiEncoderMMD(SHAPES, mode="nystrom", num_landmarks=5, ema_decay=0.75, landmark_seed=3)
    first, second = _batch(7, seed=1), _batch(7, seed=4, shift=1.0)
    loss.update_reference(first)
    summary_first = loss._state("summary", "x").clone()
    landmarks = loss._state("landmarks", "x").clone()
    assert landmarks.shape == (5, 4)
    loss.update_reference(second)
    assert torch.equal(loss._state("landmarks", "x"), landmarks)  # drawn once
    phi_second = loss._feature_map(second["x"].mean(1), "x").mean(0)
    torch.testing.assert_close(loss._state("summary", "x"), 0.75 * summary_first + 0.25 * phi_second)
    # the Nyström kernel is exact on the landmarks: phi(z_i) . phi(z_j) = k(z_i, z_j)
    phi = loss._feature_map(landmarks, "x")
    h = loss._state("bandwidth", "x")
    gram = torch.tensor([[_brute_mixed_rbf(a, b, float(h), (0.25, 0.5, 1.0, 2.0, 4.0)) for b in landmarks] for a in landmarks])
    torch.testing.assert_close(phi @ phi.T, gram.to(phi.dtype), rtol=1e-6, atol=1e-8)
    # the same seed draws the same landmarks; forward leaves the state alone
    twin = MultiEncoderMMD(SHAPES, mode="nystrom", num_landmarks=5, ema_decay=0.75, landmark_seed=3)
    twin.update_reference(first)
    assert torch.equal(twin._state("landmarks", "x"), landmarks)
    students = _batch(6, seed=2)
    a = _call(loss, students, [5])[0]
    b = _call(loss, students, [5])[0]
    assert torch.equal(a, b)
    assert set(loss.state_dict()) >= {"landmarks_branch0", "summary_branch1", "whitening_branch0", "bandwidth_branch1"}
    # a checkpoint resumes the summary in a fresh module
    resumed = MultiEncoderMMD(SHAPES, mode="nystrom", num_landmarks=5, ema_decay=0.75, landmark_seed=3)
    resumed.load_state_dict(loss.state_dict())
    assert torch.equal(_call(resumed, students, [5])[0], a)


def test_attraction_term():
    loss = MultiEncoderMMD(SHAPES, teacher_attraction_weight=2.0, embedding="flatten")
    assert loss.current_teacher_attraction_enabled
    loss.update_reference(_batch(5, seed=1))
    students, teacher = _batch(6, seed=2), _batch(2, seed=3)
    value, meta, _ = _call(loss, students, [0, 3], teacher)
    expected = ((students["x"][[0, 3]] - teacher["x"]) ** 2).flatten(1).sum(1).mean()
    assert float(meta["attraction/x"]) == pytest.approx(float(expected), rel=1e-12)
    assert float(value.detach()) == pytest.approx(
        sum(float(meta[f"mmd2/{n}"]) + 2.0 * float(meta[f"attraction/{n}"]) for n in SHAPES), rel=1e-12
    )


def test_errors():
    with pytest.raises(ValueError, match="sample_shapes"):
        MultiEncoderMMD({})
    with pytest.raises(ValueError, match="positive"):
        MultiEncoderMMD({"x": (0, 3)})
    with pytest.raises(ValueError, match="unknown branches"):
        MultiEncoderMMD(SHAPES, weights={"z": 1.0})
    with pytest.raises(ValueError, match="embedding"):
        MultiEncoderMMD(SHAPES, embedding="max")
    with pytest.raises(ValueError, match="mode"):
        MultiEncoderMMD(SHAPES, mode="rff")
    with pytest.raises(ValueError, match="ema_decay"):
        MultiEncoderMMD(SHAPES, ema_decay=1.0)
    with pytest.raises(ValueError, match="bandwidth_ladder"):
        MultiEncoderMMD(SHAPES, bandwidth_ladder=(1.0, -1.0))
    loss = MultiEncoderMMD(SHAPES)
    students = _batch(6, seed=2)
    with pytest.raises(RuntimeError, match="update_reference"):
        _call(loss, students, [5])
    with pytest.raises(ValueError, match="at least 2 rows"):
        loss.update_reference(_batch(1, seed=1))
    loss.update_reference(_batch(4, seed=1))
    with pytest.raises(ValueError, match=r"must lie in \[0, 6\)"):
        loss({n: v[:1] for n, v in students.items()}, students, None, torch.tensor([6]))
    with pytest.raises(ValueError, match="distinct"):
        _call(loss, students, [1, 1])
    with pytest.raises(ValueError, match="current_teacher was given"):
        _call(loss, students, [1], _batch(1, seed=3))
    with pytest.raises(ValueError, match="geometry"):
        loss.update_reference({"x": torch.randn(4, 3, 5), "y": torch.randn(4, 2, 2)})
    with pytest.raises(ValueError, match="int64"):
        loss(students, students, None, torch.tensor([1.0]))
    attract = MultiEncoderMMD(SHAPES, teacher_attraction_weight=1.0)
    attract.update_reference(_batch(4, seed=1))
    with pytest.raises(ValueError, match="current_teacher is required"):
        _call(attract, students, [1])
