"""Fused uint8 -> [-1, 1] normalize with camera-major view splitting: parity, opcheck, errors."""
from __future__ import annotations

import itertools

import pytest
import torch

from latentfast import ops, reference
from latentfast.backends import BackendUnavailableError
from latentfast.testing import poisoned_like, runnable_backends

OP = "normalize_uint8_into"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def sample_inputs(seed: int = 0):
    """(name, x, num_views): fresh random uint8, odd sizes, 4-D/5-D/6-D, non-contiguous layouts."""
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)

    yield "4d_odd", rand(3, 6, 7, 13), 3
    yield "5d_odd", rand(3, 5, 6, 7, 13), 2
    yield "5d_single_view", rand(2, 3, 5, 7, 13), 1
    yield "transposed_hw", rand(2, 3, 6, 13, 7).transpose(-1, -2), 3
    yield "sliced_w", rand(2, 3, 4, 7, 29)[..., 3:20:2], 2
    yield "sliced_t", rand(3, 9, 5, 11)[:, 1:7], 3
    yield "expanded_batch", rand(1, 3, 4, 5, 9).expand(3, 3, 4, 5, 9), 2
    yield "channels_last_3d", rand(2, 3, 6, 5, 7).contiguous(memory_format=torch.channels_last_3d), 3
    yield "6d_noncollapsible", rand(2, 3, 2, 6, 5, 7).transpose(0, 1), 2
    yield "permuted_lead", rand(3, 2, 4, 5, 9).permute(1, 0, 2, 3, 4), 4
    yield "wide_rows", rand(1, 3, 2, 3, 1031), 2
    yield "empty_batch", rand(0, 3, 4, 5, 6), 2


CASES = list(sample_inputs())


def _reference(x, num_views, dtype):
    frames = x.shape[-3] // num_views
    shape = (*x.shape[:-3], frames, *x.shape[-2:])
    out = [torch.empty(shape, dtype=dtype) for _ in range(num_views)]
    reference.normalize_uint8_into(x, out)
    return out


@pytest.mark.parametrize("backend", runnable_backends(OP, "cpu"))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,x,num_views", CASES, ids=[c[0] for c in CASES])
def test_parity_with_reference(backend, dtype, name, x, num_views):
    expected = _reference(x, num_views, dtype)
    shape = expected[0].shape
    out = [poisoned_like(shape, dtype) for _ in range(num_views)]
    result = ops.normalize_uint8(x, num_views=num_views, dtype=dtype, backend=backend, out=out if num_views > 1 else out[0])
    result = result if num_views > 1 else [result]
    for view, (got, want) in enumerate(zip(result, expected)):
        assert got.data_ptr() == out[view].data_ptr(), "out= buffer was not used"
        assert got.is_contiguous()
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m: f"view {view}: {m}")


@pytest.mark.parametrize("backend", runnable_backends(OP, "cpu"))
def test_reference_formula_and_view_order(backend):
    # frame t of view v must be input frame v*F + t, with value x / 127.5 - 1
    x = torch.arange(256, dtype=torch.uint8).repeat(6).reshape(3, 4, 8, 16)  # C=3, T=4
    views = ops.normalize_uint8(x, num_views=2, backend=backend)
    for v, view in enumerate(views):
        want = x[:, 2 * v : 2 * v + 2].double() / 127.5 - 1
        torch.testing.assert_close(view.double(), want, rtol=0, atol=1e-7)
    assert views[0][0, 0, 0, 0].item() == -1.0 and views[1][2, 1, 7, 15].item() == 1.0


@pytest.mark.parametrize("backend", runnable_backends(OP, "cpu"))
def test_low_precision_error_bounded_by_torch_rounding(backend):
    # evidence-based tolerance: a 16-bit output may differ from float64 by at most what plain
    # torch's own rounding of the float32 value does (here it is exactly equal)
    x = torch.randint(0, 256, (2, 3, 4, 5, 17), dtype=torch.uint8)
    exact = x.double() / 127.5 - 1
    for dtype in (torch.bfloat16, torch.float16):
        got = ops.normalize_uint8(x, dtype=dtype, backend=backend).double()
        torch_err = ((x.float() / 127.5 - 1).to(dtype).double() - exact).abs().max()
        assert (got - exact).abs().max() <= torch_err


def test_auto_backend_is_compiled_when_built():
    if "cpp" not in runnable_backends(OP, "cpu"):
        pytest.skip("latentfast._C not built")
    from latentfast import backends

    assert backends.resolve(OP, "cpu", "auto") == "cpp"


def test_env_override(monkeypatch):
    from latentfast import backends

    monkeypatch.setenv("LATENTFAST_BACKEND", "torch")
    assert backends.resolve(OP, "cpu", "auto") == "torch"
    assert backends.resolve(OP, "cpu", "cpp" if "cpp" in runnable_backends(OP) else "torch") in ("cpp", "torch")
    monkeypatch.setenv("LATENTFAST_BACKEND", "bogus")
    with pytest.raises(ValueError, match="LATENTFAST_BACKEND"):
        backends.resolve(OP, "cpu", "auto")


def test_forcing_unavailable_backend_raises():
    x = torch.zeros(3, 2, 8, 8, dtype=torch.uint8)
    with pytest.raises(BackendUnavailableError, match="cuda.*cpu"):
        ops.normalize_uint8(x, backend="cuda")
    with pytest.raises(ValueError, match="backend must be one of"):
        ops.normalize_uint8(x, backend="fortran")


@pytest.mark.parametrize("name,x,num_views", CASES[:6], ids=[c[0] for c in CASES[:6]])
def test_opcheck(name, x, num_views):
    for dtype in DTYPES:
        shape = (*x.shape[:-3], x.shape[-3] // num_views, *x.shape[-2:])
        out = [torch.empty(shape, dtype=dtype) for _ in range(num_views)]
        torch.library.opcheck(torch.ops.latentfast.normalize_uint8_into.default, (x, out))


def test_compiles_under_torch_compile():
    x = torch.randint(0, 256, (3, 4, 8, 8), dtype=torch.uint8)

    def f(t):
        out = [torch.empty(3, 2, 8, 8) for _ in range(2)]
        torch.ops.latentfast.normalize_uint8_into(t, out)
        return out[0] + out[1]

    torch.testing.assert_close(torch.compile(f, backend="aot_eager", fullgraph=True)(x), f(x))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(x=torch.zeros(3, 4, 8, 8)), ValueError, "uint8.*float32"),
        (dict(x=torch.zeros(4, 8, 8, dtype=torch.uint8)), ValueError, "at least 4-D.*\\(4, 8, 8\\)"),
        (dict(x=torch.zeros(3, 5, 8, 8, dtype=torch.uint8), num_views=2), ValueError, "T=5.*num_views=2"),
        (dict(x=torch.zeros(3, 4, 8, 8, dtype=torch.uint8), num_views=0), ValueError, "num_views"),
        (dict(x=torch.zeros(3, 4, 8, 8, dtype=torch.uint8), dtype=torch.int32), ValueError, "dtype must be one of"),
        (dict(x=[1, 2, 3]), TypeError, "x must be a torch.Tensor"),
        (dict(x=torch.zeros(3, 4, 8, 8, dtype=torch.uint8), out=torch.empty(3, 4, 8, 7)), ValueError, "out\\[0\\].*shape"),
        (dict(x=torch.zeros(3, 4, 8, 8, dtype=torch.uint8), out=torch.empty(3, 4, 8, 8, dtype=torch.half)), ValueError, "out\\[0\\].*dtype"),
        (dict(x=torch.zeros(3, 4, 8, 8, dtype=torch.uint8), out=torch.empty(3, 4, 8, 16)[..., ::2]), ValueError, "out\\[0\\].*contiguous"),
        (dict(x=torch.zeros(3, 4, 8, 8, dtype=torch.uint8), num_views=2, out=torch.empty(3, 2, 8, 8)), ValueError, "sequence of 2"),
        (dict(x=torch.zeros(3, 4, 8, 8, dtype=torch.uint8), num_views=2, out=[torch.empty(3, 2, 8, 8)]), ValueError, "hold num_views=2"),
        (dict(x=torch.zeros(3, 4, 8, 8, dtype=torch.uint8), out=torch.empty(3, 4, 8, 8, device="meta")), ValueError, "out\\[0\\] must be on cpu"),
    ],
)
def test_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        ops.normalize_uint8(**kwargs)


def test_aliasing_outputs_rejected():
    x = torch.zeros(3, 4, 8, 8, dtype=torch.uint8)
    buf = torch.empty(3, 2, 8, 8)
    with pytest.raises(ValueError, match="alias"):
        ops.normalize_uint8(x, num_views=2, out=[buf, buf])


@pytest.mark.skipif("cpp" not in runnable_backends(OP, "cpu"), reason="latentfast._C not built")
def test_compiled_kernel_checks_bounds_itself():
    # called past the Python checks, the C++ kernel must still refuse bad shapes (no overrun)
    from latentfast import _ops

    x = torch.zeros(3, 4, 8, 8, dtype=torch.uint8)
    kernel = _ops.compiled_op(OP)
    with pytest.raises(ValueError, match="must have shape"):
        kernel(x, [torch.empty(3, 4, 8, 7)])
    with pytest.raises(ValueError, match="not divisible"):
        kernel(x, [torch.empty(3, 1, 8, 8)] * 3)
    with pytest.raises(ValueError, match="overlaps"):
        kernel(x, [x[:, :2].float()] * 2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_parity(dtype):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for (name, x, num_views), backend in itertools.product(CASES, runnable_backends(OP, "cuda")):
        xc = x.cuda()
        got = ops.normalize_uint8(xc, num_views=num_views, dtype=dtype, backend=backend)
        got = got if num_views > 1 else [got]
        want = _reference(x, num_views, dtype)  # CPU float32 true division is the definition
        for g, w in zip(got, want):
            # torch's CUDA division rounds via a reciprocal: allow one output ulp
            torch.testing.assert_close(g.cpu(), w, rtol=0, atol=torch.finfo(dtype).eps, msg=f"{name} {backend}")
