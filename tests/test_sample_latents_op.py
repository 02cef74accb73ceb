"""The op ``latentfast::sample_latents_into`` (``ops.sample_latents``): every backend vs the reference,
the C++ kernel's integer stream and float math bit for bit, opcheck, errors alike on every backend, huge sizes refused.

(The definition itself -- item seeds, Philox's known answers, the normals' statistics, the reference
against numpy's float64 Box-Muller -- is tests/test_sampling.py's. The Triton cases of this module run
on CPU under Triton's interpreter through tests/test_triton_interpreter.py.)
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from latentfast import ops
from latentfast.errors import ArgumentTypeError, InvalidArgumentError
from latentfast.sampling import item_seeds, philox_words, sample_latents_reference
from latentfast.testing import assert_sampled_like_reference, poisoned_like, runnable_backends, torch_threads

OP = "sample_latents_into"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = runnable_backends(OP, "cpu")
COMPARED = [name for name in BACKENDS if name != "torch"]  # the reference is every other backend's oracle
needs_cpp = pytest.mark.skipif("cpp" not in BACKENDS, reason="the native library is not built here")


def sample_inputs(seed: int = 0):
    """(name, mean, std): fresh random values, odd sizes, 1-D to 5-D, non-contiguous layouts."""
    g = torch.Generator().manual_seed(seed)

    def pair(*shape):
        return torch.randn(shape, generator=g) * 3, torch.rand(shape, generator=g) + 0.1

    yield "one_element_items", *pair(7)
    yield "odd_2d", *pair(3, 5)
    yield "odd_4d", *pair(3, 4, 7, 9)
    yield "groups_straddle_rows", *pair(2, 3, 5, 7)  # rows of 7: groups of four cross row ends
    mean, std = pair(3, 5, 6, 11)
    other = torch.rand(3, 11, 6, 5, generator=g) + 0.1
    yield "permuted", mean.permute(0, 2, 3, 1), other.permute(0, 2, 1, 3)  # both [3, 6, 11, 5], unlike layouts
    mean, std = pair(4, 3, 9, 15)
    yield "sliced", mean[:, :, 1:8, 1::2], std[:, :, 2:9, :14:2]
    mean, std = pair(5, 2, 3, 4)
    yield "batch_transposed", mean.transpose(0, 1).contiguous().transpose(0, 1), std
    mean, std = pair(1, 4, 5, 6)
    yield "expanded_inputs", mean.expand(3, 4, 5, 6), std[:, :1].expand(3, 4, 5, 6)
    mean, std = pair(2, 3, 4, 6, 5)
    yield "channels_last_3d", mean.contiguous(memory_format=torch.channels_last_3d), std
    yield "wide_items", *pair(2, 2, 3, 1031)  # several blocks per item
    yield "empty_batch", *pair(0, 3, 4)
    yield "empty_items", *pair(3, 0, 4)


CASES = list(sample_inputs())
IDS = [case[0] for case in CASES]


def _seeds(batch: int, epoch: int = 0) -> torch.Tensor:
    return item_seeds([f"img/{i:05d}" for i in range(batch)], 1234, epoch)


@pytest.mark.parametrize("backend", COMPARED)
@pytest.mark.parametrize("dtype_in, dtype_out", [(d, d) for d in DTYPES] + [(torch.bfloat16, torch.float32),
                                                                          (torch.float32, torch.float16)], ids=str)
@pytest.mark.parametrize("name,mean,std", CASES, ids=IDS)
def test_parity_with_reference(backend, dtype_in, dtype_out, name, mean, std):
    mean, std = mean.to(dtype_in), std.to(dtype_in)
    seeds = _seeds(mean.shape[0])
    out = poisoned_like(mean.shape, dtype_out)
    result = ops.sample_latents(mean, std, seeds, out=out, backend=backend)
    assert result is out
    assert not bool(out.isnan().any()), "an element was not written"
    assert_sampled_like_reference(out, mean, std, seeds)


@pytest.mark.parametrize("backend", COMPARED)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_strided_out_and_allocated_out(backend, dtype):
    g = torch.Generator().manual_seed(9)
    mean, std = torch.randn(3, 4, 6, 5, generator=g).to(dtype), torch.rand(3, 4, 6, 5, generator=g).to(dtype)
    seeds = _seeds(3)
    allocated = ops.sample_latents(mean, std, seeds, backend=backend)
    assert allocated.dtype == dtype and allocated.shape == mean.shape and allocated.is_contiguous()
    assert_sampled_like_reference(allocated, mean, std, seeds)
    wide = poisoned_like((3, 4, 6, 10), dtype)
    ops.sample_latents(mean, std, seeds, out=wide[..., 1::2], backend=backend)
    assert torch.equal(wide[..., 1::2], allocated), "a strided out= must hold what an allocated one does"
    assert bool(wide[..., 0::2].isnan().all()), "an element beside the strided out was written"
    transposed = poisoned_like((3, 5, 6, 4), dtype).permute(0, 3, 2, 1)
    ops.sample_latents(mean, std, seeds, out=transposed, backend=backend)
    assert torch.equal(transposed, allocated)


# -- the C++ kernel: its integers bit for bit, its floats bit for bit where the math is the same -------------
@needs_cpp
def test_cpp_philox_words_equal_the_reference_bit_for_bit():
    from latentfast.backends import native

    seeds = torch.cat([_seeds(6), torch.tensor([0, -1, -(2**63), 2**63 - 1])])
    for n in (1, 3, 4, 5, 513, 10_001):
        assert torch.equal(native.sample_latents_philox_words(seeds, n), philox_words(seeds, n)), n
    for first in (2**31 - 7, 2**32 - 3, 2**40 + 11):  # the counter's high word (items of > 2**34 elements)
        got = native.sample_latents_philox_words(seeds, 64, first_group=first)
        assert torch.equal(got, philox_words(seeds, 64, first_group=first)), first
    strided = seeds.repeat_interleave(2)[::2]  # a strided item_seeds is read through its stride
    assert torch.equal(native.sample_latents_philox_words(strided, 9), philox_words(seeds, 9))


# csrc/cpu/sample_latents_kernel.cpp's float32 constants (hex there too): cephes' logf, sinf and cosf
F32 = np.float32
LOG_P = [F32(float.fromhex(h)) for h in ("0x1.204376p-4", "-0x1.d7a370p-4", "0x1.de4a34p-4", "-0x1.fcba9ep-4",
                                         "0x1.23d37ep-3", "-0x1.555ca0p-3", "0x1.999d58p-3", "-0x1.fffff8p-3",
                                         "0x1.555554p-2")]
LN2_HI, LN2_LO, SQRT_HALF = F32(float.fromhex("0x1.63p-1")), F32(float.fromhex("-0x1.bd0106p-13")), F32(float.fromhex("0x1.6a09e6p-1"))
TWO_OVER_PI, PIO2 = F32(float.fromhex("0x1.45f306p-1")), [F32(float.fromhex(h)) for h in ("0x1.92p+0", "0x1.fb4p-12", "0x1.4442d2p-24")]
SIN = [F32(float.fromhex(h)) for h in ("-0x1.9943f2p-13", "0x1.11073cp-7", "-0x1.555546p-3")]
COS = [F32(float.fromhex(h)) for h in ("0x1.99eb9cp-16", "-0x1.6c0c34p-10", "0x1.55554ap-5")]


def _kernel_log(x: np.ndarray) -> np.ndarray:
    """The kernel's log_unit, replayed in numpy float32 (IEEE operations, one rounding each, in its order)."""
    bits = x.view(np.uint32)
    mantissa = (bits & np.uint32(0x007FFFFF)) | np.uint32(0x3F000000)
    low = (mantissa < SQRT_HALF.view(np.uint32)).astype(np.uint32)
    f = (mantissa + (low << np.uint32(23))).view(F32) - F32(1)
    e = ((bits >> np.uint32(23)).astype(np.int32) - 126 - low.astype(np.int32)).astype(F32)
    z = f * f
    y = np.full_like(f, LOG_P[0])
    for p in LOG_P[1:]:
        y = y * f + p
    y = y * f * z
    y = y + LN2_LO * e
    y = y - F32(0.5) * z
    return (f + y) + LN2_HI * e


def _kernel_sincos(t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's sincos_quadrant, replayed in numpy float32: (cos t, sin t)."""
    q = (t * TWO_OVER_PI + F32(0.5)).astype(np.int32)
    fq = q.astype(F32)
    x = ((t - fq * PIO2[0]) - fq * PIO2[1]) - fq * PIO2[2]
    z = x * x
    sin_x = ((SIN[0] * z + SIN[1]) * z + SIN[2]) * z * x + x
    cos_x = (((COS[0] * z + COS[1]) * z + COS[2]) * z * z - F32(0.5) * z) + F32(1)
    odd = (q & 1) == 1
    s, c = np.where(odd, cos_x, sin_x), np.where(odd, sin_x, cos_x)
    return np.where((q + 1) & 2, -c, c), np.where(q & 2, -s, s)


def _kernel_float32_sample(mean: np.ndarray, std: np.ndarray, seeds: torch.Tensor) -> np.ndarray:
    """The definition in float32 with the kernel's own log / cos / sin, replayed in numpy: the C++ kernel's
    float math, operation for operation (sqrt and the products are IEEE float32 in both)."""
    n = mean[0].size
    words = philox_words(seeds, n).numpy().astype(np.uint32)
    a, b = words[:, 0::2], words[:, 1::2]
    u1 = ((a >> 8) + 1).astype(np.int32).astype(F32) * F32(2**-24)
    u2 = (b >> 8).astype(np.int32).astype(F32) * F32(2**-24)
    r = np.sqrt(F32(-2) * _kernel_log(u1))
    cos_t, sin_t = _kernel_sincos(u2 * F32(6.2831854820251465))
    eps = np.stack([r * cos_t, r * sin_t], -1).reshape(len(seeds), -1)[:, :n]
    return mean + std * eps.reshape(mean.shape)


@needs_cpp
def test_cpp_float32_output_is_bit_exact_with_its_math_replayed_in_numpy():
    # float32 in and out: no rounding but the float32 operations themselves, so every bit must agree
    # (on every CPU and vector path: the kernel's math is multiplies, adds and bit operations only)
    g = torch.Generator().manual_seed(11)
    mean, std = torch.randn(5, 2, 7, 1041, generator=g), torch.rand(5, 2, 7, 1041, generator=g)
    seeds = _seeds(5, epoch=5)
    for threads in (1, 2):
        with torch_threads(threads):
            got = ops.sample_latents(mean, std, seeds, backend="cpp").numpy()
        want = _kernel_float32_sample(mean.numpy(), std.numpy(), seeds)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), int((got != want).sum())


def test_kernel_log_and_sincos_are_within_2_ulp_of_float64_libm():
    # u1 = k * 2**-24 for k in [1, 2**24] and t = (k - 1) * 2**-24 * 2pi: every 61st k, and all of both ends
    k = np.unique(np.concatenate([np.arange(1, 2**24 + 1, 61), np.arange(1, 4097), np.arange(2**24 - 4095, 2**24 + 1)]))
    u = k.astype(F32) * F32(2**-24)
    log = _kernel_log(u)
    exact = np.log(u.astype(np.float64))
    ulp = np.spacing(np.abs(exact).astype(F32)).astype(np.float64)
    assert float(np.max(np.abs(log - exact) / ulp)) <= 2, "log"
    t = (k - 1).astype(F32) * F32(2**-24) * F32(6.2831854820251465)
    cos_t, sin_t = _kernel_sincos(t)
    for name, got, want in (("cos", cos_t, np.cos(t.astype(np.float64))), ("sin", sin_t, np.sin(t.astype(np.float64)))):
        # absolute error against ulp(1) / 2: near a zero of cos or sin a relative bound means nothing, and
        # eps = r * cos(t) is compared absolutely (|d eps| <= 1e-5 against the reference)
        assert float(np.max(np.abs(got - want))) <= 2 * 2**-24, name
    # r = sqrt(-2 ln u1) <= 5.8: eps then stays within 5e-6 of the exact Box-Muller value
    r = np.sqrt(F32(-2) * log)
    assert float(np.max(np.abs(r - np.sqrt(-2 * exact)))) < 2e-6


@needs_cpp
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpp_large_batch_split_between_threads(dtype, threads):
    # enough elements for the thread pool; an item's draw is the same alone and inside a batch
    g = torch.Generator().manual_seed(12)
    mean, std = torch.randn(9, 4, 61, 67, generator=g).to(dtype), torch.rand(9, 4, 61, 67, generator=g).to(dtype)
    seeds = _seeds(9)
    with torch_threads(threads):
        got = ops.sample_latents(mean, std, seeds, out=poisoned_like(mean.shape, dtype), backend="cpp")
        alone = ops.sample_latents(mean[5:6], std[5:6], seeds[5:6], backend="cpp")
    assert_sampled_like_reference(got, mean, std, seeds)
    assert torch.equal(got[5:6], alone)
    with torch_threads(1 if threads == 2 else 2):
        assert torch.equal(ops.sample_latents(mean, std, seeds, backend="cpp"), got), "depends on the thread count"


# -- the op's contract -----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_opcheck(dtype):
    g = torch.Generator().manual_seed(13)
    mean = torch.randn(3, 4, 5, generator=g).to(dtype)
    std = torch.rand(3, 5, 4, generator=g).to(dtype).transpose(1, 2)
    out = torch.empty(3, 4, 5, dtype=torch.float32)
    torch.library.opcheck(torch.ops.latentfast.sample_latents_into.default, (mean, std, _seeds(3), out))


def test_reference_backend_is_the_sampling_reference():
    # the op's torch backend is sampling.sample_latents_reference itself, bit for bit
    g = torch.Generator().manual_seed(14)
    mean, std = torch.randn(4, 3, 10, generator=g), torch.rand(4, 3, 10, generator=g)
    got = ops.sample_latents(mean, std, _seeds(4), backend="torch")
    assert torch.equal(got, sample_latents_reference(mean, std, _seeds(4)))


def _bad_arguments():
    """(name, mean, std, item_seeds, out, message): each refused with InvalidArgumentError on every backend."""
    mean, std, seeds = torch.zeros(2, 3, 4), torch.ones(2, 3, 4), _seeds(2)
    out = torch.empty(2, 3, 4)
    base = torch.empty(2, 3, 8)
    return [
        ("mean_float64", mean.double(), std, seeds, out, "mean must be float16, bfloat16 or float32"),
        ("std_int", mean, std.int(), seeds, out, "std must be float16, bfloat16 or float32"),
        ("out_float64", mean, std, seeds, out.double(), "out must be float16, bfloat16 or float32"),
        ("std_shape", mean, torch.ones(2, 4, 3), seeds, out, r"std must match mean's shape \[2, 3, 4\]"),
        ("out_shape", mean, std, seeds, torch.empty(2, 3, 5), r"out must match mean's shape \[2, 3, 4\]"),
        ("seeds_length", mean, std, _seeds(3), out, r"item_seeds must be (an )?int64 (CPU tensor )?\[2\]"),
        ("seeds_dtype", mean, std, seeds.int(), out, r"item_seeds must be (an )?int64 (CPU tensor )?\[2\]"),
        ("seeds_2d", mean, std, seeds.view(2, 1), out, r"item_seeds must be (an )?int64 (CPU tensor )?\[2\]"),
        ("zero_dim", torch.zeros(()), torch.ones(()), seeds, torch.empty(()), r"mean must be a \[B, ...\] batch"),
        ("out_is_mean", mean, std, seeds, mean, "out overlaps mean"),
        ("out_overlaps_std", mean, base[..., :4], seeds, base[..., 2:6], "out overlaps std"),
        ("out_shares_memory", mean, std, seeds, torch.empty(2, 1, 4).expand(2, 3, 4), "out has elements that share memory"),
    ]


BAD = _bad_arguments()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,mean,std,seeds,out,message", BAD, ids=[case[0] for case in BAD])
def test_bad_arguments_raise_the_same_error_on_every_backend(backend, name, mean, std, seeds, out, message):
    before = out.clone()
    with pytest.raises(InvalidArgumentError, match=message):
        torch.ops.latentfast.sample_latents_into(mean, std, seeds, out, backend)
    # out holds torch.empty's garbage, NaNs included: equal NaNs count as unchanged
    torch.testing.assert_close(out, before, rtol=0, atol=0, equal_nan=True, msg="out was written before the error")


@needs_cpp
@pytest.mark.parametrize("name,mean,std,seeds,out,message", BAD, ids=[case[0] for case in BAD])
def test_compiled_kernel_checks_its_arguments_itself(name, mean, std, seeds, out, message):
    # past the op's Python checks, the C++ kernel refuses the same arguments (as a plain ValueError)
    with pytest.raises(ValueError, match=message):
        torch.ops.latentfast_compiled.sample_latents_into(mean, std, seeds, out)


def test_public_function_errors():
    mean = torch.zeros(2, 3)
    with pytest.raises(ArgumentTypeError, match="std must be a torch.Tensor, got list"):
        ops.sample_latents(mean, [1.0], _seeds(2))
    with pytest.raises(ArgumentTypeError, match="out must be a torch.Tensor, got ndarray"):
        ops.sample_latents(mean, mean, _seeds(2), out=np.zeros((2, 3)))
    with pytest.raises(InvalidArgumentError, match="mean must be float16, bfloat16 or float32"):
        ops.sample_latents(mean.double(), mean, _seeds(2))
    with pytest.raises(InvalidArgumentError, match="backend must be one of"):
        ops.sample_latents(mean, mean, _seeds(2), backend="fortran")


HUGE = """
import sys
import torch
from latentfast import ops
from latentfast.errors import LatentfastError
backend = sys.argv[1]
# 2**62 elements that exist (expanded views of one value): their float32 output would take 2**64 bytes
mean = torch.zeros(1, 1).expand(2**31, 2**31)
half = torch.zeros(1, 1, dtype=torch.float16).expand(2**31, 2**31)  # 2**63 bytes out
seeds = torch.zeros(1, dtype=torch.int64).expand(2**31)
for call in (lambda: ops.sample_latents(mean, mean, seeds, backend=backend),
             lambda: ops.sample_latents(half, half, seeds, backend=backend),
             lambda: ops.sample_latents(mean, mean, seeds, out=torch.zeros(2**31, 1).expand(2**31, 2**31), backend=backend)):
    try:
        call()
    except LatentfastError as exc:
        print("REFUSED", type(exc).__name__, exc)
    else:
        print("RETURNED")
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_sizes_are_refused_not_crashed(backend):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(HUGE), backend], capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, PYTHONFAULTHANDLER="1"))
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stdout[-2000:]} {proc.stderr[-3000:]}"
    lines = proc.stdout.splitlines()
    assert len(lines) == 3 and all(line.startswith("REFUSED InvalidArgumentError") for line in lines), proc.stdout
    assert "bytes, more than int64 counts" in lines[0] and "bytes, more than int64 counts" in lines[1]
    assert "out has elements that share memory" in lines[2]
