"""Fused uint8 -> [-1, 1] normalize with camera-major view splitting: parity, opcheck, errors."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from latentfast import ops, reference
from latentfast.backends import BackendUnavailableError
from latentfast.errors import InvalidArgumentError
from latentfast.testing import poisoned_like, runnable_backends, torch_threads

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
    out = [poisoned_like(shape, dtype) for _ in range(num_views)]
    reference.normalize_uint8_into(x, out)
    return out


def _numpy_formula(x, num_views, dtype):
    """The definition, computed without torch: float32 ``x / 127.5 - 1`` per view (numpy slicing),
    rounded to nearest even to the output dtype (bfloat16 by hand on the float32 bits)."""
    array = x.numpy()
    frames = array.shape[-3] // num_views
    views = []
    for v in range(num_views):
        y = array[..., v * frames : (v + 1) * frames, :, :].astype(np.float32) / np.float32(127.5) - np.float32(1)
        if dtype == torch.float32:
            views.append(torch.from_numpy(np.ascontiguousarray(y)))
        elif dtype == torch.float16:
            views.append(torch.from_numpy(y.astype(np.float16)))
        else:
            bits = y.view(np.uint32).astype(np.uint64)
            rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
            views.append(torch.from_numpy(rounded.view(np.int16)).view(torch.bfloat16))
    return views


# the reference computes every other backend's ``expected``: it is checked against the formula, and
# the parity tests below compare only the other backends with it
COMPARED = [name for name in runnable_backends(OP, "cpu") if name != "torch"]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name,x,num_views", CASES, ids=[c[0] for c in CASES])
def test_reference_matches_the_numpy_formula(dtype, name, x, num_views):
    got = _reference(x, num_views, dtype)
    for view, (g, want) in enumerate(zip(got, _numpy_formula(x, num_views, dtype))):
        assert torch.equal(g.view(-1).view(torch.int16 if dtype != torch.float32 else torch.int32),
                           want.reshape(-1).view(torch.int16 if dtype != torch.float32 else torch.int32)), (view, name)


@pytest.mark.parametrize("backend", COMPARED)
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


@pytest.mark.parametrize("backend", COMPARED)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_uint8_value_bit_exact(backend, dtype):
    # each of the 256 inputs, in runs long enough for the vector path, against the numpy formula
    x = torch.arange(256, dtype=torch.uint8).repeat(3 * 2 * 4).reshape(3, 2, 4, 256)[:, :, :, torch.randperm(256)]
    got = ops.normalize_uint8(x, num_views=2, dtype=dtype, backend=backend)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for g, want in zip(got, _numpy_formula(x, 2, dtype)):
        assert torch.equal(g.reshape(-1).view(bits), want.reshape(-1).view(bits))


LARGE = [name for name in COMPARED if name != "triton"]  # the interpreter would take minutes


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("backend", LARGE)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_large_outputs_misaligned_and_split_between_threads(backend, dtype, threads):
    """Outputs of >= 8 MiB (the streamed path), each starting one element past a 32-byte boundary (the
    scalar head before the vector stores), rows that do not end on a vector (tails), and a guard after
    every output that must stay untouched; contiguous planes and strided rows."""
    g = torch.Generator().manual_seed(7)
    contiguous = torch.randint(0, 256, (2, 3, 4, 361, 1203), dtype=torch.uint8, generator=g)
    strided = torch.randint(0, 256, (3, 4, 1203, 361), dtype=torch.uint8, generator=g).transpose(-1, -2)
    with torch_threads(threads):
        for x, num_views in ((contiguous, 2), (strided, 4)):
            expected = _reference(x, num_views, dtype)
            numel = expected[0].numel()
            buffers = [torch.full((numel + 64,), 7.0, dtype=dtype) for _ in range(num_views)]
            out = [buffer[1 : 1 + numel].view(expected[0].shape) for buffer in buffers]
            ops.normalize_uint8(x, num_views=num_views, dtype=dtype, backend=backend, out=out)
            for got, want, buffer in zip(out, expected, buffers):
                torch.testing.assert_close(got, want, rtol=0, atol=0)
                assert buffer[0].item() == 7.0 and bool((buffer[1 + numel :] == 7.0).all()), "a store left out"


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


@pytest.mark.parametrize("backend", runnable_backends(OP, "cpu"))
def test_out_overlapping_x_is_refused(backend):
    # out[0] reinterprets x's bytes: writing it would change pixels not yet read
    buffer = torch.zeros(768, dtype=torch.float32)
    x = buffer.view(torch.uint8)[:768].view(3, 4, 8, 8)
    x.random_(0, 256)
    before = x.clone()
    for out in ([buffer[:384].view(3, 2, 8, 8), torch.empty(3, 2, 8, 8)],
                [torch.empty(3, 2, 8, 8), buffer[100:484].view(3, 2, 8, 8)]):
        view = 0 if out[0].data_ptr() == buffer.data_ptr() else 1
        with pytest.raises(InvalidArgumentError, match=rf"out\[{view}\] overlaps x in memory"):
            ops.normalize_uint8(x, num_views=2, out=out, backend=backend)
        assert torch.equal(x, before), "x was written before the overlap was found"


def test_meta_tensors_give_shapes_only():
    # like every torch op: a meta input gives meta outputs of the right shapes, computing nothing
    x = torch.empty(2, 3, 6, 5, 7, dtype=torch.uint8, device="meta")
    views = ops.normalize_uint8(x, num_views=np.int64(3), dtype=torch.bfloat16)
    assert [(v.device.type, tuple(v.shape), v.dtype) for v in views] == [("meta", (2, 3, 2, 5, 7), torch.bfloat16)] * 3
    with pytest.raises(InvalidArgumentError, match="out\\[0\\] must be on meta, got cpu"):
        ops.normalize_uint8(x, num_views=3, out=[torch.empty(2, 3, 2, 5, 7)] * 3)


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
