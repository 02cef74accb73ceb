"""scatter_cotangents: every backend vs the reference, opcheck, layout, and every error path."""
from __future__ import annotations

import pytest
import torch

from latentfast import _ops, reference
from latentfast.replay import scatter_cotangents
from latentfast.replay.scatter import SCATTER_DTYPES, arena_numel
from latentfast.testing import poisoned_like, runnable_backends

OP = "scatter_cotangents_into"


def _grad(rows: int, tokens: int, channels: int, dtype, layout: str, generator, device="cpu") -> torch.Tensor:
    """A [rows, tokens, channels] gradient with the requested memory layout."""
    if layout == "contiguous":
        base = torch.randn(rows, tokens, channels, generator=generator, dtype=torch.float64)
        out = base
    elif layout == "transposed":  # channels-major storage: stride(2) != 1
        out = torch.randn(rows, channels, tokens, generator=generator, dtype=torch.float64).transpose(1, 2)
    elif layout == "sliced":  # every other token of a larger buffer, offset storage
        out = torch.randn(rows + 1, 2 * tokens, channels + 3, generator=generator, dtype=torch.float64)
        out = out[1:, ::2, 1 : channels + 1]
    else:  # "expanded": a zero batch stride
        out = torch.randn(1, tokens, channels, generator=generator, dtype=torch.float64).expand(rows, -1, -1)
    return out.to(dtype=dtype, device=device)


def sample_inputs(device="cpu"):
    """(grads, batch_sizes, scale) cases: odd sizes, mixed layouts, every dtype."""
    generator = torch.Generator().manual_seed(0)
    cases = []
    for dtype in SCATTER_DTYPES:
        cases.append(([_grad(4, 3, 5, dtype, "contiguous", generator, device)], [4], 2.0))
        cases.append(
            (
                [
                    _grad(7, 5, 3, dtype, "contiguous", generator, device),
                    _grad(7, 1, 9, dtype, "transposed", generator, device),
                    _grad(7, 4, 2, dtype, "sliced", generator, device),
                ],
                [2, 1, 3, 1],
                3.0,
            )
        )
        cases.append(
            (
                [_grad(5, 2, 7, dtype, "expanded", generator, device), _grad(5, 3, 3, dtype, "sliced", generator, device)],
                [5],
                0.37,
            )
        )
    # a larger case that spans several threads / thread blocks
    cases.append(
        (
            [
                _grad(24, 64, 48, torch.float32, "contiguous", generator, device),
                _grad(24, 16, 96, torch.float32, "transposed", generator, device),
                _grad(24, 1, 128, torch.float32, "sliced", generator, device),
            ],
            [3] * 8,
            8.0,
        )
    )
    # slabs larger than the CPU kernel's chunk (16384 elements): split mid-slab across threads
    cases.append(
        (
            [
                _grad(4, 700, 40, torch.float32, "transposed", generator, device),
                _grad(4, 600, 33, torch.float32, "contiguous", generator, device),
                _grad(4, 300, 70, torch.float32, "sliced", generator, device),
            ],
            [1, 3],
            -1.5,
        )
    )
    return cases


def _expected_arena(grads, batch_sizes, scale):
    arena = poisoned_like((arena_numel([g.shape for g in grads], batch_sizes),), grads[0].dtype, grads[0].device)
    reference.scatter_cotangents_into(grads, batch_sizes, scale, arena)
    return arena


@pytest.mark.parametrize("case", range(len(sample_inputs())))
@pytest.mark.parametrize("backend", runnable_backends(OP, "cpu"))
def test_backends_match_reference(case, backend):
    grads, batch_sizes, scale = sample_inputs()[case]
    expected = _expected_arena(grads, batch_sizes, scale)
    out = poisoned_like(expected.shape, expected.dtype)
    result = scatter_cotangents(grads, batch_sizes, scale=scale, backend=backend, out=out)
    assert result.arena is out
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("case", [1, 12])  # float32, 3 branches: unequal / equal microbatches
def test_layout_and_views(case):
    grads, batch_sizes, scale = sample_inputs()[case]
    result = scatter_cotangents(grads, batch_sizes, scale=scale)
    starts = [sum(batch_sizes[:m]) for m in range(len(batch_sizes))]
    expected_offset = 0
    for m, (start, size) in enumerate(zip(starts, batch_sizes)):
        for k, grad in enumerate(grads):
            local, scaled = result.local[m][k], result.scaled[m][k]
            assert local.shape == scaled.shape == (size, *grad.shape[1:])
            assert local.is_contiguous() and scaled.is_contiguous()
            # views into one arena, [local | scaled] per (microbatch, branch), microbatch-major
            assert local.untyped_storage().data_ptr() == result.arena.untyped_storage().data_ptr()
            assert local.storage_offset() == expected_offset
            assert scaled.storage_offset() == expected_offset + local.numel()
            expected_offset += 2 * local.numel()
            torch.testing.assert_close(local, grad[start : start + size], rtol=0, atol=0)
            torch.testing.assert_close(scaled, grad[start : start + size] * scale, rtol=0, atol=0)
    assert expected_offset == result.arena.numel()
    # the blocks index like tuples
    assert result.local[-1] is result.local[len(batch_sizes) - 1]
    assert len(result.scaled[:2]) == 2 and result.scaled[:2][1] is result.scaled[1]
    with pytest.raises(IndexError):
        result.local[len(batch_sizes)]


def test_reuse_keeps_arena_and_views_and_expires_the_old_result():
    grads, batch_sizes, scale = sample_inputs()[12]  # equal microbatches
    first = scatter_cotangents(grads, batch_sizes, scale=scale)
    views = first.scaled[0]
    doubled = [2 * g for g in grads]
    second = scatter_cotangents(doubled, batch_sizes, scale=scale, reuse=first)
    assert second.arena is first.arena and second.scaled[0] is views
    expected = _expected_arena(doubled, batch_sizes, scale)
    torch.testing.assert_close(second.arena, expected, rtol=0, atol=0)
    torch.testing.assert_close(second.local[7][2], doubled[2][21:24], rtol=0, atol=0)
    for blocks in (first.local, first.scaled):
        with pytest.raises(RuntimeError, match="overwritten"):
            blocks[0]
    # another split of the same rows: same arena, views made again for the new layout
    third = scatter_cotangents(grads, [12, 12], scale=scale, reuse=second)
    assert third.arena is first.arena and third.scaled[1][0].shape == (12, *grads[0].shape[1:])
    torch.testing.assert_close(third.scaled[1][0], grads[0][12:] * scale, rtol=0, atol=0)


@pytest.mark.parametrize("case", [0, 1, 9])
def test_opcheck(case):
    grads, batch_sizes, scale = sample_inputs()[case]
    arena = torch.zeros(arena_numel([g.shape for g in grads], batch_sizes), dtype=grads[0].dtype)
    torch.library.opcheck(torch.ops.latentfast.scatter_cotangents_into.default, (grads, batch_sizes, scale, arena))


@pytest.mark.gpu
def test_cuda_matches_reference_in_one_launch():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from torch.profiler import ProfilerActivity, profile

    for grads, batch_sizes, scale in sample_inputs("cuda"):
        expected = _expected_arena([g.cpu() for g in grads], batch_sizes, scale)
        for backend in runnable_backends(OP, "cuda"):
            out = poisoned_like(expected.shape, expected.dtype, "cuda")
            scatter_cotangents(grads, batch_sizes, scale=scale, backend=backend, out=out)
            torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)
    if "cuda" not in runnable_backends(OP, "cuda"):
        pytest.skip("latentfast._C was built without the CUDA kernel")
    grads, batch_sizes, scale = sample_inputs("cuda")[-1]  # 3 branches x 8 microbatches
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        scatter_cotangents(grads, batch_sizes, scale=scale, backend="cuda")
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()]
    assert len(kernels) == 1 and "scatter_cotangents" in kernels[0], kernels


def _grads():
    return [torch.randn(4, 3, 2), torch.randn(4, 1, 5)]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(grads=torch.randn(4, 3, 2)), TypeError, "grads must be a sequence"),
        (dict(grads=[]), ValueError, "at least one"),
        (dict(grads=[torch.randn(4, 3, 2), "x"]), TypeError, r"grads\[1\] must be a torch.Tensor"),
        (dict(grads=[torch.randn(4, 6)]), ValueError, r"grads\[0\] must be \[b_local, N, D\]"),
        (dict(grads=[torch.ones(4, 3, 2, dtype=torch.int32)]), ValueError, r"grads\[0\] dtype"),
        (dict(grads=[torch.randn(4, 3, 2), torch.randn(4, 3, 2, dtype=torch.float64)]), ValueError, r"grads\[1\] is"),
        (dict(grads=[torch.randn(4, 3, 2), torch.randn(5, 3, 2)]), ValueError, r"grads\[1\] has 5 rows"),
        (dict(batch_sizes=[]), ValueError, "batch_sizes must be a non-empty"),
        (dict(batch_sizes=[2, 0, 2]), ValueError, r"batch_sizes\[1\] must be a positive int"),
        (dict(batch_sizes=[2, 1.5]), ValueError, r"batch_sizes\[1\]"),
        (dict(batch_sizes=[1, 2]), ValueError, "sum to 3"),
        (dict(scale="2"), TypeError, "scale must be a float"),
        (dict(out=torch.empty(3)), ValueError, "out must be a contiguous 1-D tensor of 88"),
        (dict(out=torch.empty(88, dtype=torch.float64)), ValueError, "out must be torch.float32"),
        (dict(out=torch.empty(176)[::2]), ValueError, "contiguous"),
        (dict(out=torch.empty(88), reuse=object()), ValueError, "out or reuse, not both"),
        (dict(reuse=torch.empty(88)), TypeError, "reuse must be a ScatteredCotangents"),
        (
            dict(reuse=scatter_cotangents([torch.randn(2, 3, 2)], [2], scale=1.0)),
            ValueError,
            "reuse.arena must be a contiguous 1-D tensor of 88",
        ),
        (dict(backend="cuda"), RuntimeError, "cannot run"),
        (dict(backend="nope"), ValueError, "backend must be one of"),
    ],
)
def test_errors(kwargs, error, message):
    args = dict(grads=_grads(), batch_sizes=[1, 3], scale=2.0)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        scatter_cotangents(args.pop("grads"), args.pop("batch_sizes"), **args)


@pytest.mark.parametrize("backend", [b for b in runnable_backends(OP, "cpu") if b == "cpp"])
def test_compiled_kernel_checks_bounds(backend):
    """Direct op calls (no Python checks) are refused by the kernel before it touches memory."""
    op = _ops.compiled_op(OP)
    grads = _grads()
    good = torch.empty(88)
    cases = [
        ((grads, [1, 3], 2.0, torch.empty(87)), "arena must hold"),
        ((grads, [1, 2], 2.0, good), "batch_sizes sum to 3"),
        ((grads, [1, -1, 4], 2.0, good), "must be positive"),
        ((grads, [4], 2.0, torch.empty(44, 2)), "contiguous 1-D"),
        ((grads, [4], 2.0, torch.empty(88, dtype=torch.float64)), "differs from arena dtype"),
        (([torch.randn(4, 6)], [4], 2.0, good), r"must be \[b_local, N, D\]"),
        (([], [4], 2.0, good), "at least one tensor"),
    ]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            op(*args)
    overlapping = torch.zeros(2 * 4 * 6)
    with pytest.raises(ValueError, match="overlaps"):
        op([overlapping[: 4 * 6].view(4, 3, 2)], [4], 2.0, overlapping)
