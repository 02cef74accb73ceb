"""Replay steps against plain backpropagation on the toy models (single process), and the replay
helpers: RNG capture, replay_backward, the B/b correction, gradient_sync on a plain module.

Gradient equality in float64: the cotangents are the same numbers plain backprop's autograd
computes for the features, and each replayed microbatch's backward is the same computation as
that microbatch's part of the plain backward; only the order in which the microbatches'
contributions are summed into ``.grad`` can differ. With two replayed microbatches the sum is
commutative, so the gradients are bit-equal; with more, they agree to a few ulps (<= 1e-12).
"""
from __future__ import annotations

import pytest
import torch

from latentfast.errors import ArgumentTypeError
from latentfast.replay import ReplayRNG, gradient_sync, replay_backward, selection_correction_factor
from latentfast.replay.demo import (
    build_toy_problem,
    demo_replay_step,
    generator_gradients,
    max_relative_error,
    plain_step,
    replay_step,
)


def _bit_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_replay_rng_reproduces_and_leaves_the_stream_alone():
    torch.manual_seed(5)
    rng = ReplayRNG.capture()
    first = torch.nn.functional.dropout(torch.ones(64), 0.5) + torch.randn(64)
    following = torch.randn(3)
    torch.manual_seed(5)
    torch.randn(64 + 64)
    with rng.replay():
        again = torch.nn.functional.dropout(torch.ones(64), 0.5) + torch.randn(64)
    assert torch.equal(first, again)
    torch.manual_seed(5)
    torch.randn(64 + 64)
    expected_after = torch.randn(3)
    torch.manual_seed(5)
    torch.randn(64 + 64)
    with rng.replay():
        torch.randn(1000)
    assert torch.equal(torch.randn(3), expected_after)  # the outer stream resumed where it was
    assert not torch.equal(following, expected_after)


def test_replay_backward_checks():
    w = torch.ones(3, requires_grad=True)
    features = {"a": w * 2}
    with pytest.raises(ValueError, match="keys"):
        replay_backward(features, {"b": torch.ones(3)})
    with pytest.raises(ValueError, match="shape"):
        replay_backward(features, {"a": torch.ones(4)})
    with pytest.raises(ValueError, match="no graph"):
        replay_backward({"a": torch.ones(3)}, {"a": torch.ones(3)})
    with pytest.raises(TypeError, match="mappings"):
        replay_backward([w], [w])
    replay_backward(features, {"a": torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)})
    assert torch.equal(w.grad, torch.tensor([2.0, 4.0, 6.0]))


def test_selection_correction_factor():
    assert selection_correction_factor(32, 4) == 8.0
    with pytest.raises(ValueError, match="0 < gradient_global_samples <= global_samples"):
        selection_correction_factor(4, 8)


# ---- gradient equality with plain backprop (float64) -----------------------------------------
@pytest.mark.parametrize("mode", ["exact", "nystrom"])
@pytest.mark.parametrize("attraction", [False, True])
def test_replay_gradient_equals_plain_backprop(mode, attraction):
    problem = build_toy_problem(local_samples=8, gradient_local_samples=4, microbatch=2, attraction=attraction, mode=mode)
    plain_loss = plain_step(problem)
    plain = generator_gradients(problem)
    result = replay_step(problem, offload=(mode == "nystrom"), cotangents="local")
    replayed = generator_gradients(problem)
    assert torch.equal(result.loss, plain_loss)
    assert all(g.abs().max() > 0 for g in plain.values())
    assert _bit_equal(plain, replayed)  # two replayed microbatches: exact


@pytest.mark.parametrize("mode", ["exact", "nystrom"])
@pytest.mark.parametrize("B, b", [(4, 4), (8, 8), (12, 12), (8, 6)])
def test_more_replays_and_every_row_selected_equal_plain_backprop(mode, B, b):
    """b = B is plain GradCache: bit-equal with two replays; three or more sum in another order
    than plain backprop."""
    problem = build_toy_problem(local_samples=B, gradient_local_samples=b, microbatch=2, attraction=True, mode=mode)
    plain_loss = plain_step(problem)
    plain = generator_gradients(problem)
    result = replay_step(problem, cotangents="local")
    replayed = generator_gradients(problem)
    assert torch.equal(result.loss, plain_loss) and result.gradient_local_samples == b
    if b // 2 <= 2:
        assert _bit_equal(plain, replayed)
    assert max_relative_error(plain, replayed) <= 1e-12


def test_plain_step_with_unselected_microbatches_detached_gives_the_same_gradients():
    """The fair memory baseline (unselected microbatches under no_grad) is the same computation."""
    problem = build_toy_problem(local_samples=8, gradient_local_samples=4, microbatch=2, attraction=True)
    plain_step(problem)
    plain = generator_gradients(problem)
    plain_step(problem, detach_unselected=True)
    assert _bit_equal(plain, generator_gradients(problem))


def test_autocast_bf16_replay_is_plain_autocast_and_close_to_float32():
    """Under torch.autocast(bfloat16) the replayed step equals plain backprop under the same autocast
    with its loss in float32 (bit for bit: the cotangents are the float32 gradient rounded to
    bfloat16, as autograd rounds it into the bfloat16 features), and both are within 1.6e-2 of the
    float32 gradients: bfloat16 keeps 8 significant bits (2**-8 = 3.9e-3 relative per rounding) and
    the toy generator's gradient passes a few rounded layers (measured 7e-3); 4 * 2**-8 leaves a 2x
    margin."""
    problem = build_toy_problem(local_samples=8, gradient_local_samples=4, microbatch=2, dtype=torch.float32,
                                mode="nystrom", attraction=True, dropout=0.1)  # fmt: skip
    plain_step(problem)
    float32 = generator_gradients(problem)
    plain_step(problem, autocast_dtype=torch.bfloat16)
    plain_bf16 = generator_gradients(problem)
    result = replay_step(problem, autocast_dtype=torch.bfloat16, cotangents="local")
    replay_bf16 = generator_gradients(problem)
    assert result.loss.dtype == torch.float32
    assert all(c.dtype == torch.bfloat16 for part in result.local_cotangents for c in part.values())
    assert _bit_equal(plain_bf16, replay_bf16)
    error = max_relative_error(float32, replay_bf16)
    assert 1e-4 < error <= 4 * 2**-8, error  # really half precision, and close


@pytest.mark.gpu
def test_replay_gradient_equals_plain_backprop_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    problem = build_toy_problem(attraction=True, mode="nystrom", device="cuda")
    plain_step(problem)
    plain = generator_gradients(problem)
    result = replay_step(problem, offload=True)
    assert result.cotangent_arena.device.type == "cpu"  # replay_backward moves each block back
    assert max_relative_error(plain, generator_gradients(problem)) <= 1e-12


@pytest.mark.gpu
def test_autocast_replay_on_cuda_matches_plain_autocast():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    problem = build_toy_problem(dtype=torch.float32, mode="nystrom", attraction=True, device="cuda")
    plain_step(problem, autocast_dtype=torch.bfloat16)
    plain = generator_gradients(problem)
    result = replay_step(problem, autocast_dtype=torch.bfloat16)
    assert result.cotangent_arena.dtype == torch.bfloat16 and result.cotangent_arena.is_cuda
    assert max_relative_error(plain, generator_gradients(problem)) <= 1e-6


def test_replay_without_rng_restore_differs():
    """The equality above depends on ReplayRNG: without it dropout and noise differ."""
    problem = build_toy_problem(attraction=True)
    plain_step(problem)
    plain = generator_gradients(problem)
    replay_step(problem, restore_rng=False)
    assert max_relative_error(plain, generator_gradients(problem)) > 1e-3


def test_replay_backward_under_autocast_casts_the_cotangent():
    w = torch.ones(3, 3, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        features = {"a": torch.ones(2, 3) @ w}  # bfloat16 under autocast
        assert features["a"].dtype == torch.bfloat16
        replay_backward(features, {"a": torch.full((2, 3), 0.5, dtype=torch.float32)})
    assert torch.equal(w.grad, torch.ones(3, 3))


def test_gradient_sync_on_a_plain_module_and_errors():
    model = torch.nn.Linear(2, 2)
    for enabled in (True, False):
        with gradient_sync(model, enabled):
            model(torch.ones(1, 2)).sum().backward()
    assert torch.equal(model.weight.grad, 2 * torch.ones(2, 2))
    with pytest.raises(ArgumentTypeError, match="model must be a torch.nn.Module"):
        with gradient_sync(object(), True):
            pass
    with pytest.raises(ArgumentTypeError, match="enabled must be a bool"):
        with gradient_sync(model, 1):
            pass


def test_demo_replay_step():
    report = demo_replay_step()
    assert report["max_relative_error"] == 0.0  # two replays, float64: bit-equal
    assert report["plain_loss"] == report["replay_loss"]
    assert set(report["timings_s"]) == {"plain_s", "collect_s", "finalize_s", "replay_s"}
