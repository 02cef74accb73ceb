"""scatter_cotangents: the reference against the formula, the compiled backends against the reference,
opcheck, the public function's layout (one copy or two, local blocks as views), arena reuse and
expiry, and every error path -- including sizes whose int64 product wraps around."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from latentfast import _ops, reference
from latentfast.errors import BackendUnavailableError, InvalidArgumentError, ReplayError
from latentfast.replay import scatter_cotangents
from latentfast.replay.scatter import SCATTER_DTYPES, arena_copies, arena_numel, arena_size
from latentfast.testing import poisoned_like, runnable_backends

OP = "scatter_cotangents_into"


def _grad(rows: int, tokens: int, channels: int, dtype, layout: str, generator, device="cpu") -> torch.Tensor:
    """A [rows, tokens, channels] gradient of ``dtype`` with the requested memory layout."""

    def rand(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype=dtype, device=device)

    if layout == "contiguous":
        return rand(rows, tokens, channels)
    if layout == "transposed":  # channels-major storage: stride(2) != 1
        return rand(rows, channels, tokens).transpose(1, 2)
    if layout == "sliced":  # every other token of a larger buffer, offset storage
        return rand(rows + 1, 2 * tokens, channels + 3)[1:, ::2, 1 : channels + 1]
    return rand(1, tokens, channels).expand(rows, -1, -1)  # "expanded": a zero batch stride


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


SCALES = ("one", "two")  # the op's two forms: [scale], and [1, scale] (a local copy and a scaled one)


def _scales(form: str, scale: float) -> list[float]:
    return [scale] if form == "one" else [1.0, scale]


def _reference_arena(grads, batch_sizes, scales, dtype=None):
    """The reference's arena (the oracle of the compiled backends), from a poisoned buffer."""
    dtype = grads[0].dtype if dtype is None else dtype
    arena = poisoned_like((arena_numel([g.shape for g in grads], batch_sizes, len(scales)),), dtype, grads[0].device)
    reference.scatter_cotangents_into(grads, batch_sizes, scales, arena)
    return arena


def _formula_arena(grads, batch_sizes, scales, dtype):
    """The layout written out block by block from its definition, independently of the reference:
    for every microbatch m (rows r0:r0+size), branch k and factor s, ``g[r0:r0+size] * s``
    computed in float32 (float64 for float64 gradients) and rounded to ``dtype``."""
    opmath = torch.float64 if grads[0].dtype == torch.float64 else torch.float32
    parts, row = [], 0
    for size in batch_sizes:
        for grad in grads:
            block = grad[row : row + size].to(opmath)
            parts += [(block * factor).to(dtype).flatten() for factor in scales]
        row += size
    return torch.cat(parts)


CROSS_DTYPES = [(torch.float32, torch.bfloat16), (torch.float32, torch.float16), (torch.float64, torch.float32),
                (torch.float64, torch.float16), (torch.float32, torch.float64), (torch.float16, torch.float32),
                (torch.bfloat16, torch.float16)]  # fmt: skip
COMPILED = [b for b in runnable_backends(OP, "cpu") if b != "torch"]  # "torch" is the reference itself


@pytest.mark.parametrize("form", SCALES)
@pytest.mark.parametrize("case", range(len(sample_inputs())))
def test_reference_matches_the_formula(case, form):
    grads, batch_sizes, scale = sample_inputs()[case]
    scales = _scales(form, scale)
    assert torch.equal(_reference_arena(grads, batch_sizes, scales), _formula_arena(grads, batch_sizes, scales, grads[0].dtype))


@pytest.mark.parametrize("in_dtype, out_dtype", CROSS_DTYPES)
def test_reference_matches_the_formula_across_dtypes(in_dtype, out_dtype):
    """Gradients of one dtype, cotangents of another (float32 gradients of bfloat16 features)."""
    grads, batch_sizes, _ = sample_inputs()[1]  # three branches, mixed layouts
    grads = [g.to(in_dtype) for g in grads]
    expected = _formula_arena(grads, batch_sizes, [1.0, 3.0], out_dtype)
    assert torch.equal(_reference_arena(grads, batch_sizes, [1.0, 3.0], out_dtype), expected)


@pytest.mark.parametrize("form", SCALES)
@pytest.mark.parametrize("case", range(len(sample_inputs())))
@pytest.mark.parametrize("backend", COMPILED)
def test_compiled_backends_match_reference(case, backend, form):
    grads, batch_sizes, scale = sample_inputs()[case]
    scales = _scales(form, scale)
    expected = _reference_arena(grads, batch_sizes, scales)
    out = poisoned_like(expected.shape, expected.dtype)
    torch.ops.latentfast.scatter_cotangents_into(grads, batch_sizes, scales, out, backend=backend)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


@pytest.mark.parametrize("in_dtype, out_dtype", CROSS_DTYPES)
@pytest.mark.parametrize("backend", COMPILED)
def test_compiled_backends_match_reference_across_dtypes(backend, in_dtype, out_dtype):
    grads, batch_sizes, _ = sample_inputs()[1]
    grads = [g.to(in_dtype) for g in grads]
    expected = _reference_arena(grads, batch_sizes, [1.0, 3.0], out_dtype)
    result = scatter_cotangents(grads, batch_sizes, scale=3.0, dtype=out_dtype, backend=backend)
    assert result.arena.dtype == out_dtype
    torch.testing.assert_close(result.arena, expected, rtol=0, atol=0)


def _rows(grad, batch_sizes, m):
    start = sum(batch_sizes[:m])
    return grad[start : start + batch_sizes[m]]


@pytest.mark.parametrize(
    "case, scale, copies, local_kind",
    [
        (1, 3.0, 2, "arena"),  # strided gradients: the local blocks need their own copy
        (12, 3.0, 2, "arena"),  # the same, equal microbatches (one strided view per branch)
        (0, 2.0, 1, "gradients"),  # contiguous, same dtype: local blocks are views of the gradients
        (3, 2.0, 1, "gradients"),  # the same in float64
        (1, 1.0, 1, "scaled"),  # scale 1: local blocks are the scaled ones
    ],
)
def test_layout_and_views(case, scale, copies, local_kind):
    grads, batch_sizes, _ = sample_inputs()[case]
    assert arena_copies(grads, scale) == copies
    result = scatter_cotangents(grads, batch_sizes, scale=scale)
    assert result.arena.numel() == arena_size(grads, batch_sizes, scale=scale) == copies * arena_numel(
        [g.shape for g in grads], batch_sizes, 1
    )
    offset = 0
    for m, size in enumerate(batch_sizes):
        for k, grad in enumerate(grads):
            local, scaled = result.local[m][k], result.scaled[m][k]
            assert local.shape == scaled.shape == (size, *grad.shape[1:])
            assert local.is_contiguous() and scaled.is_contiguous()
            # segment (m, k) of the arena, microbatch-major: [local |] scaled
            assert scaled.untyped_storage().data_ptr() == result.arena.untyped_storage().data_ptr()
            assert scaled.storage_offset() == offset + (copies - 1) * scaled.numel()
            if local_kind == "arena":
                assert local.storage_offset() == offset and local.data_ptr() != scaled.data_ptr()
            elif local_kind == "gradients":
                assert local.data_ptr() == _rows(grad, batch_sizes, m).data_ptr()  # no copy at all
            else:
                assert local is scaled
            offset += copies * scaled.numel()
            assert torch.equal(local, _rows(grad, batch_sizes, m))
            assert torch.equal(scaled, _rows(grad, batch_sizes, m) * scale)
    assert offset == result.arena.numel()
    # the blocks index like tuples
    assert result.local[-1] is result.local[len(batch_sizes) - 1]
    assert result.scaled[:2] == tuple(result.scaled[m] for m in range(min(2, len(batch_sizes))))
    with pytest.raises(IndexError):
        result.local[len(batch_sizes)]


def test_cotangents_in_another_dtype_get_their_own_local_copy():
    grads = [torch.randn(4, 3, 5), torch.randn(4, 2, 2)]
    result = scatter_cotangents(grads, [1, 3], scale=2.0, dtype=torch.bfloat16)
    assert result.arena.dtype == torch.bfloat16 and arena_copies(grads, 2.0, torch.bfloat16) == 2
    assert torch.equal(result.local[1][0], grads[0][1:].bfloat16())
    assert torch.equal(result.scaled[1][1], (grads[1][1:] * 2.0).bfloat16())


def test_reuse_keeps_arena_and_views_and_expires_the_old_result():
    grads, batch_sizes, scale = sample_inputs()[12]  # equal microbatches, strided: two copies
    first = scatter_cotangents(grads, batch_sizes, scale=scale)
    views = first.scaled[0]
    doubled = [(2 * g).contiguous() for g in grads]  # one copy now: a smaller arena
    with pytest.raises(InvalidArgumentError, match="reuse.arena must be a contiguous 1-D tensor of"):
        scatter_cotangents(doubled, batch_sizes, scale=scale, reuse=first)
    doubled = [(2 * g).transpose(1, 2).contiguous().transpose(1, 2) for g in grads]  # channels-major again
    assert arena_copies(doubled, scale) == 2
    second = scatter_cotangents(doubled, batch_sizes, scale=scale, reuse=first)
    assert second.arena is first.arena and second.scaled[0] is views
    torch.testing.assert_close(second.arena, _reference_arena(doubled, batch_sizes, [1.0, scale]), rtol=0, atol=0)
    assert torch.equal(second.local[7][2], doubled[2][21:24])
    assert first.expired and not second.expired
    for blocks in (first.local, first.scaled):
        with pytest.raises(ReplayError, match="overwritten"):
            blocks[0]
    # a result is reused once: reusing it again would leave two live results on one arena
    with pytest.raises(ReplayError, match="already overwritten by a later scatter_cotangents"):
        scatter_cotangents(doubled, batch_sizes, scale=scale, reuse=first)
    assert not second.expired
    # another split of the same rows: same arena, views made again for the new layout
    third = scatter_cotangents(doubled, [12, 12], scale=scale, reuse=second)
    assert third.arena is first.arena and third.scaled[1][0].shape == (12, *grads[0].shape[1:])
    assert torch.equal(third.scaled[1][0], doubled[0][12:] * scale)


def test_rebuilt_copies_are_independent():
    grads = [torch.randn(4, 3, 5), torch.randn(4, 2, 2)]
    result = scatter_cotangents(grads, [1, 3], scale=2.0)  # local blocks are views of grads
    moved = result.rebuilt([t.clone() for t in result.tensors()])
    assert len(result.tensors()) == 3  # the arena and both gradients
    grads[0].zero_()
    scatter_cotangents(grads, [1, 3], scale=2.0, reuse=result)
    assert not moved.expired and torch.equal(moved.local[1][0], moved.scaled[1][0] / 2) and moved.local[1][0].abs().sum() > 0
    with pytest.raises(ReplayError, match="cannot copy expired cotangents"):
        result.rebuilt(result.tensors())


@pytest.mark.parametrize("form", SCALES)
@pytest.mark.parametrize("case", [0, 1, 9])
def test_opcheck(case, form):
    grads, batch_sizes, scale = sample_inputs()[case]
    scales = _scales(form, scale)
    arena = torch.zeros(arena_numel([g.shape for g in grads], batch_sizes, len(scales)), dtype=grads[0].dtype)
    torch.library.opcheck(torch.ops.latentfast.scatter_cotangents_into.default, (grads, batch_sizes, scales, arena))


@pytest.mark.parametrize("backend", runnable_backends(OP, "cpu"))
def test_op_traces_under_torch_compile_fullgraph(backend):
    """The op, called as scatter_cotangents calls it, traces whole (its shape checks are its fake
    kernel); the wrapper itself returns lazy view objects and runs eagerly, around the op."""
    grads, batch_sizes, scale = sample_inputs()[1]
    numel = arena_numel([g.shape for g in grads], batch_sizes, 2)

    def f(g0, g1, g2):
        arena = torch.empty(numel, dtype=g0.dtype)
        torch.ops.latentfast.scatter_cotangents_into([g0, g1, g2], batch_sizes, [1.0, scale], arena, backend=backend)
        return arena

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*grads)
    assert torch.equal(got, _reference_arena(grads, batch_sizes, [1.0, scale]))


@pytest.mark.gpu
def test_cuda_matches_reference_in_one_launch():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from torch.profiler import ProfilerActivity, profile

    for grads, batch_sizes, scale in sample_inputs("cuda"):
        for form in SCALES:
            scales = _scales(form, scale)
            expected = _reference_arena([g.cpu() for g in grads], batch_sizes, scales)
            for backend in runnable_backends(OP, "cuda"):
                out = poisoned_like(expected.shape, expected.dtype, "cuda")
                torch.ops.latentfast.scatter_cotangents_into(grads, batch_sizes, scales, out, backend=backend)
                torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=0)
    # the GPU kernel: the CUDA C++ one of older builds, else Triton's (latentfast/kernels/scatter_cotangents.py)
    gpu = next((b for b in ("cuda", "triton") if b in runnable_backends(OP, "cuda")), None)
    if gpu is None:
        pytest.skip("no GPU kernel for scatter_cotangents here (Triton is not installed)")
    for in_dtype, out_dtype in CROSS_DTYPES:
        grads, batch_sizes, _ = sample_inputs("cuda")[1]
        grads = [g.to(in_dtype) for g in grads]
        expected = _reference_arena([g.cpu() for g in grads], batch_sizes, [1.0, 3.0], out_dtype)
        result = scatter_cotangents(grads, batch_sizes, scale=3.0, dtype=out_dtype, backend=gpu)
        torch.testing.assert_close(result.arena.cpu(), expected, rtol=0, atol=0)
    grads, batch_sizes, scale = sample_inputs("cuda")[-2]  # 3 branches x 8 microbatches
    for copies in (1, 2):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.ops.latentfast.scatter_cotangents_into(
                grads, batch_sizes, _scales(SCALES[copies - 1], scale),
                torch.empty(arena_numel([g.shape for g in grads], batch_sizes, copies), device="cuda"), backend=gpu,
            )  # fmt: skip
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA" and "memcpy" not in e.name.lower()]
        assert len(kernels) == 1 and "scatter_cotangents" in kernels[0], kernels


@pytest.mark.gpu
def test_cuda_kernel_64_bit_index_path_matches_reference():
    """A source block spanning more than 2**31 elements (a view of a 4 GiB half buffer) takes the
    kernel's int64 index path; small blocks take the int32 one."""
    gpu = next((b for b in ("cuda", "triton") if b in runnable_backends(OP, "cuda")), None)
    if not torch.cuda.is_available() or gpu is None:
        pytest.skip("needs a CUDA device and a GPU kernel")
    buffer = torch.zeros(2**31 + 2**20, dtype=torch.float16, device="cuda")
    rows = buffer.as_strided((3, 16, 8), (2**30, 8, 1))  # row stride 2**30: extent > 2**31
    rows.copy_(torch.randn(3, 16, 8, device="cuda").half())
    expected = _reference_arena([rows.cpu()], [1, 2], [1.0, 3.0])
    result = scatter_cotangents([rows], [1, 2], scale=3.0, backend=gpu)
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
        (dict(dtype=torch.int8), ValueError, "dtype must be one of"),
        (dict(out=torch.empty(3)), ValueError, "out must be a contiguous 1-D tensor of 44"),
        (dict(out=torch.empty(44, dtype=torch.float64)), ValueError, "out must be torch.float32"),
        (dict(out=torch.empty(88)[::2]), ValueError, "contiguous"),
        (dict(out=torch.empty(44), reuse=object()), ValueError, "out or reuse, not both"),
        (dict(reuse=torch.empty(44)), TypeError, "reuse must be a ScatteredCotangents"),
        (
            dict(reuse=scatter_cotangents([torch.randn(2, 3, 2)], [2], scale=1.0)),
            ValueError,
            "reuse.arena must be a contiguous 1-D tensor of 44",
        ),
        (dict(backend="cuda"), BackendUnavailableError, "cannot run"),
        (dict(backend="nope"), ValueError, "backend must be one of"),
    ],
)
def test_errors(kwargs, error, message):
    args = dict(grads=_grads(), batch_sizes=[1, 3], scale=2.0)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        scatter_cotangents(args.pop("grads"), args.pop("batch_sizes"), **args)


def _bad_calls():
    """(arguments of the kernel form, message): every call both the compiled kernel's C++ checks
    and the op's own schema checks must refuse before touching memory."""
    grads, good = _grads(), torch.empty(88)
    return [
        ((grads, [1, 3], [1.0, 2.0], torch.empty(87)), "arena must hold"),
        ((grads, [1, 2], [1.0, 2.0], good), "batch_sizes sum to 3"),
        ((grads, [1, -1, 4], [1.0, 2.0], good), "must be positive"),
        ((grads, [4], [1.0, 2.0], torch.empty(44, 2)), "contiguous 1-D"),
        ((grads, [4], [1.0, 2.0, 3.0], torch.empty(132)), "scales must hold 1 or 2 factors"),
        ((grads, [4], [], torch.empty(0)), "scales must hold 1 or 2 factors"),
        ((grads, [4], [1.0, 2.0], torch.empty(88, dtype=torch.int32)), "arena dtype must be"),
        (([grads[0], grads[1].double()], [4], [1.0, 2.0], good), r"grads\[1\] dtype .* differs"),
        (([g.int() for g in grads], [4], [2.0], torch.empty(44)), "grads dtype must be"),
        (([torch.randn(4, 6)], [4], [1.0, 2.0], good), r"must be \[b_local, N, D\]"),
        (([], [4], [1.0, 2.0], good), "at least one tensor"),
    ]


@pytest.mark.parametrize("backend", COMPILED)
def test_compiled_kernel_checks_bounds(backend):
    """Direct calls of the compiled kernel (no Python checks) are refused before it touches memory."""
    op = _ops.compiled_op(OP)
    for args, message in _bad_calls():
        with pytest.raises(ValueError, match=message):
            op(*args)
    overlapping = torch.zeros(2 * 4 * 6)
    with pytest.raises(ValueError, match="overlaps"):
        op([overlapping[: 4 * 6].view(4, 3, 2)], [4], [1.0, 2.0], overlapping)


def test_op_schema_checks_refuse_the_same_calls():
    """The public op's own checks (its fake kernel, run before the reference) refuse them too, with
    the library's error class; so does the fake kernel under meta tensors."""
    for args, message in _bad_calls():
        with pytest.raises(InvalidArgumentError, match=message):
            torch.ops.latentfast.scatter_cotangents_into(*args, backend="torch")
    grads, _ = _grads(), None
    with pytest.raises(ValueError, match="arena must hold"):
        torch.ops.latentfast.scatter_cotangents_into([g.to("meta") for g in grads], [4], [2.0], torch.empty(45, device="meta"))


# Two expanded gradients of 2**62 elements: sum(N*D) = 2**60 + 1, so 2 * b_local * sum(N*D) with
# b_local = 8 wraps int64 around to exactly 16, the arena's size, unless the size arithmetic is checked.
_WRAPPING_CALL = """
import sys, torch, latentfast
from latentfast import _ops
first = torch.zeros(1, 1, 1).expand(8, 2**30, 2**29)
second = torch.zeros(1, 1, 1).expand(8, 2**59 + 1, 1)
op = _ops.compiled_op("scatter_cotangents_into") if sys.argv[1] == "compiled" else (
    lambda *a: torch.ops.latentfast.scatter_cotangents_into(*a, backend=sys.argv[1]))
try:
    op([first, second], [8], [1.0, 2.0], torch.empty(16))
except ValueError as exc:
    print("REFUSED", exc)
"""


@pytest.mark.slow
@pytest.mark.parametrize("path", [*(["compiled"] if COMPILED else []), "torch", "auto"])
def test_sizes_that_overflow_int64_are_refused(path):
    """Regression: the unchecked product wrapped to 16 elements and the compiled kernel wrote
    2**64 elements past a 16-element arena (a crash, hence the subprocess). Refused by the C++
    checks (a direct call of the compiled kernel) and by the op's own checks (every backend)."""
    run = subprocess.run([sys.executable, "-c", _WRAPPING_CALL, path], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "REFUSED" in run.stdout and "overflows int64" in run.stdout, run.stdout
