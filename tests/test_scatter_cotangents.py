"""scatter_cotangents: every backend vs the reference, opcheck, layout, and every error path."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from latentfast import reference
from latentfast.errors import ReplayError
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


def _expected_arena(grads, batch_sizes, scale, dtype=None):
    """The reference's arena (the oracle of the compiled backends)."""
    dtype = grads[0].dtype if dtype is None else dtype
    arena = poisoned_like((arena_numel([g.shape for g in grads], batch_sizes),), dtype, grads[0].device)
    reference.scatter_cotangents_into(grads, batch_sizes, scale, arena)
    return arena


def _formula_arena(grads, batch_sizes, scale, dtype):
    """The layout written out block by block from its definition, independently of the reference:
    for every microbatch m (rows r0:r0+size) and branch k, ``g[r0:r0+size]`` rounded to ``dtype``
    and then ``g[r0:r0+size] * scale`` computed in float32 (float64 for float64 gradients) and
    rounded to ``dtype``."""
    opmath = torch.float64 if grads[0].dtype == torch.float64 else torch.float32
    parts, row = [], 0
    for size in batch_sizes:
        for grad in grads:
            block = grad[row : row + size]
            parts += [block.to(dtype).flatten(), (block.to(opmath) * scale).to(dtype).flatten()]
        row += size
    return torch.cat(parts)


CROSS_DTYPES = [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.float64, torch.float32),
                (torch.float32, torch.float64)]  # fmt: skip


@pytest.mark.parametrize("case", range(len(sample_inputs())))
def test_reference_matches_the_formula(case):
    grads, batch_sizes, scale = sample_inputs()[case]
    expected = _formula_arena(grads, batch_sizes, scale, grads[0].dtype)
    assert torch.equal(_expected_arena(grads, batch_sizes, scale), expected)


@pytest.mark.parametrize("in_dtype, out_dtype", CROSS_DTYPES)
def test_reference_matches_the_formula_across_dtypes(in_dtype, out_dtype):
    """Gradients of one dtype, cotangents of another (float32 gradients of bfloat16 features)."""
    grads, batch_sizes, _ = sample_inputs()[1]  # three branches, mixed layouts
    grads = [g.to(in_dtype) for g in grads]
    expected = _formula_arena(grads, batch_sizes, 3.0, out_dtype)
    assert torch.equal(_expected_arena(grads, batch_sizes, 3.0, out_dtype), expected)


COMPILED = [b for b in runnable_backends(OP, "cpu") if b != "torch"]  # "torch" is the reference itself


@pytest.mark.parametrize("case", range(len(sample_inputs())))
@pytest.mark.parametrize("backend", COMPILED)
def test_compiled_backends_match_reference(case, backend):
    grads, batch_sizes, scale = sample_inputs()[case]
    expected = _expected_arena(grads, batch_sizes, scale)
    out = poisoned_like(expected.shape, expected.dtype)
    result = scatter_cotangents(grads, batch_sizes, scale=scale, backend=backend, out=out)
    assert result.arena is out
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("in_dtype, out_dtype", CROSS_DTYPES)
@pytest.mark.parametrize("backend", COMPILED)
def test_compiled_backends_match_reference_across_dtypes(backend, in_dtype, out_dtype):
    grads, batch_sizes, _ = sample_inputs()[1]
    grads = [g.to(in_dtype) for g in grads]
    expected = _expected_arena(grads, batch_sizes, 3.0, out_dtype)
    result = scatter_cotangents(grads, batch_sizes, scale=3.0, dtype=out_dtype, backend=backend)
    assert result.arena.dtype == out_dtype
    torch.testing.assert_close(result.arena, expected, rtol=0, atol=0)


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
    assert first.expired and not second.expired
    for blocks in (first.local, first.scaled):
        with pytest.raises(ReplayError, match="overwritten"):
            blocks[0]
    # a result is reused once: reusing it again would leave two live results on one arena
    with pytest.raises(ReplayError, match="already overwritten by a later scatter_cotangents"):
        scatter_cotangents(grads, batch_sizes, scale=scale, reuse=first)
    assert not second.expired
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


@pytest.mark.gpu
def test_cuda_kernel_64_bit_index_path_matches_reference():
    """A source block spanning more than 2**31 elements (a slice of a 4 GiB half buffer) takes the
    kernel's int64 index path; small blocks take the int32 one."""
    if not torch.cuda.is_available() or "cuda" not in runnable_backends(OP, "cuda"):
        pytest.skip("needs a CUDA device and the CUDA kernel")
    buffer = torch.zeros(2**31 + 2**20, dtype=torch.float16, device="cuda")
    rows = buffer.as_strided((3, 16, 8), (2**30, 8, 1))  # row stride 2**30: extent > 2**31
    rows.copy_(torch.randn(3, 16, 8, device="cuda").half())
    expected = _expected_arena([rows.cpu()], [1, 2], 3.0)
    result = scatter_cotangents([rows], [1, 2], scale=3.0, backend="cuda")
    torch.testing.assert_close(result.arena.cpu(), expected, rtol=0, atol=0)


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
    op = torch.ops.latentfast.scatter_cotangents_into.default
    grads = _grads()
    good = torch.empty(88)
    cases = [
        ((grads, [1, 3], 2.0, torch.empty(87)), "arena must hold"),
        ((grads, [1, 2], 2.0, good), "batch_sizes sum to 3"),
        ((grads, [1, -1, 4], 2.0, good), "must be positive"),
        ((grads, [4], 2.0, torch.empty(44, 2)), "contiguous 1-D"),
        ((grads, [4], 2.0, torch.empty(88, dtype=torch.int32)), "arena dtype must be float32"),
        (([grads[0], grads[1].double()], [4], 2.0, good), r"grads\[1\] dtype Double differs"),
        (([g.int() for g in grads], [4], 2.0, torch.empty(88, dtype=torch.int32)), "arena dtype"),
        (([torch.randn(4, 6)], [4], 2.0, good), r"must be \[b_local, N, D\]"),
        (([], [4], 2.0, good), "at least one tensor"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            op(*args)
    overlapping = torch.zeros(2 * 4 * 6)
    with pytest.raises(RuntimeError, match="single memory location"):
        op([overlapping[: 4 * 6].view(4, 3, 2)], [4], 2.0, overlapping)


# Two expanded gradients of 2**62 elements: sum(N*D) = 2**60 + 1, so 2 * b_local * sum(N*D) with
# b_local = 8 wraps int64 around to exactly 16, the arena's size, unless the kernel checks it.
_WRAPPING_CALL = """
import torch, latentfast
first = torch.zeros(1, 1, 1).expand(8, 2**30, 2**29)
second = torch.zeros(1, 1, 1).expand(8, 2**59 + 1, 1)
try:
    torch.ops.latentfast.scatter_cotangents_into.default([first, second], [8], 2.0, torch.empty(16))
except RuntimeError as exc:
    print("REFUSED", exc)
"""


@pytest.mark.parametrize("backend", COMPILED)
def test_compiled_kernel_refuses_sizes_that_overflow_int64(backend):
    """Regression: the unchecked product wrapped to 16 elements and the kernel wrote 2**64 elements
    past a 16-element arena (a crash, hence the subprocess)."""
    run = subprocess.run([sys.executable, "-c", _WRAPPING_CALL], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "REFUSED" in run.stdout and "overflows int64" in run.stdout, run.stdout
