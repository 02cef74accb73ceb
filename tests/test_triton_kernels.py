"""What the Triton kernels promise beyond parity, checked on CPU under Triton's interpreter:

- every launch runs under its tensor's device (a spy on the guard: on a CPU it has nothing to switch);
- a new batch width compiles nothing new (Triton's own specialization key of each launch, counted);
- bfloat16 rounding keeps NaN as NaN and inf as inf;
- program offsets are int64 before multiplying (the last program of a grid past 2**31 elements);
- the CPU path checks row values on the host (no value reaches the kernel unchecked).

TRITON_INTERPRET must be set before Triton is imported, so each case runs a script in a child process
(the script is a file: Triton reads a kernel's source). ``gpu`` tests run the same promises on CUDA.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from latentfast import ops
from latentfast.testing import poisoned_like

pytest.importorskip("triton")

PRELUDE = """
import contextlib
import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime import interpreter
from latentfast import ops
from latentfast.kernels import _launch
"""


def run_script(tmp_path, body: str, *, setup: str = "", interpret: bool = True, timeout: int = 300) -> str:
    """Run ``setup`` then ``body`` (indented like the test's code) in a fresh interpreter; its stdout."""
    script = tmp_path / "case.py"
    script.write_text(PRELUDE + setup + textwrap.dedent(body))
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


# ---- the device guard ------------------------------------------------------------------------------
def test_device_guard_enters_the_tensors_cuda_device(monkeypatch):
    from latentfast.kernels import _launch

    entered = []

    @__import__("contextlib").contextmanager
    def fake_cuda_device(device):
        entered.append(device)
        yield

    monkeypatch.setattr(torch.cuda, "device", fake_cuda_device)
    with _launch.device_guard(torch.device("cuda", 1)):
        assert entered == [torch.device("cuda", 1)]
    with _launch.device_guard(torch.device("cpu")):
        pass
    assert entered == [torch.device("cuda", 1)], "a CPU tensor must not switch the CUDA device"


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_launch_refuses_a_device_triton_cannot_run_on(device):
    # without the interpreter, Triton would fail with "0 active drivers"; the launch names the argument
    from latentfast.errors import InvalidArgumentError
    from latentfast.kernels import _launch, expand_rows

    with pytest.raises(InvalidArgumentError, match=f"out is on {device}: the Triton kernels run on CUDA tensors"):
        _launch.launch(expand_rows._expand_rows_kernel, (1, 1), "out", torch.empty(4, device=device))


def test_every_launch_runs_under_the_guard(tmp_path):
    out = run_script(tmp_path, """
        launches, current = [], [None]

        @contextlib.contextmanager
        def spy_guard(device):
            current[0] = device
            yield
            current[0] = None

        _launch.device_guard = spy_guard
        real_run = interpreter.InterpretedFunction.run

        def run(self, *args, **kwargs):
            launches.append(current[0])
            return real_run(self, *args, **kwargs)

        interpreter.InterpretedFunction.run = run
        x = torch.randint(0, 256, (2, 3, 4, 5, 7), dtype=torch.uint8).transpose(0, 1)  # peeled into parts
        ops.normalize_uint8(x, num_views=2, backend="triton")
        packed = torch.randn(12).half()
        ops.expand_rows(packed, torch.tensor([0, 6]), torch.tensor([2, 1], dtype=torch.int32), torch.zeros(3),
                        channels=1, latent_h=3, backend="triton")
        assert len(launches) >= 3 and all(d == torch.device("cpu") for d in launches), launches
        print("guarded", len(launches))
    """)
    assert "guarded" in out


# ---- compiles: count Triton's own specialization keys ----------------------------------------------
COUNT_KEYS = """
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

def count_keys(interpreted):
    '''Spy on an interpreted kernel: the set of JIT cache keys its launches would compile on an H100.'''
    options = {k: v for k, v in interpreted.kwargs.items() if k.startswith("do_not_specialize")}
    jit = JITFunction(interpreted.fn, **options)
    binder = create_function_from_signature(jit.signature, jit.params, make_backend(GPUTarget("cuda", 90, 32)))
    keys = set()
    real_run = interpreted.run

    def run(*args, grid, warmup, **kwargs):
        _, specialization, opts = binder(*args, **kwargs)
        keys.add(str(specialization) + str(opts))
        return real_run(*args, grid=grid, warmup=warmup, **kwargs)

    interpreted.run = run
    return keys
"""


def test_expand_rows_compiles_once_per_dtype_whatever_the_batch(tmp_path):
    out = run_script(tmp_path, setup=COUNT_KEYS, body="""
        from latentfast.kernels import expand_rows
        keys = count_keys(expand_rows._expand_rows_kernel)
        rng = np.random.default_rng(5)
        buffer = torch.from_numpy(rng.standard_normal(40_000).astype(np.float16))
        for B, C, h, W, shift in [(1, 4, 4, 1, 0), (3, 4, 4, 5, 1), (7, 4, 4, 16, 3), (2, 4, 4, 17, 0),
                                  (5, 1, 3, 33, 2), (4, 4, 4, 64, 0), (2, 3, 5, 100, 1), (3, 4, 4, 300, 0)]:
            widths = torch.from_numpy(rng.integers(0, W + 1, size=B).astype(np.int32))
            widths[0] = W
            sizes = widths.to(torch.int64) * C * h
            offsets = torch.cumsum(sizes, 0) - sizes
            packed = buffer[shift : shift + int(sizes.sum())]  # rows start at any alignment
            white = torch.from_numpy(rng.standard_normal(C * h).astype(np.float16))
            got = ops.expand_rows(packed, offsets, widths, white, channels=C, latent_h=h, dtype=torch.float16,
                                  backend="triton")
            want = ops.expand_rows(packed, offsets, widths, white, channels=C, latent_h=h, dtype=torch.float16,
                                   backend="torch")
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert len(keys) == 1, sorted(keys)
        for dtype in (torch.bfloat16, torch.float32):
            ops.expand_rows(packed, offsets, widths, white, channels=C, latent_h=h, dtype=dtype, backend="triton")
        assert len(keys) == 3, sorted(keys)  # one kernel per output dtype, none per width
        print("keys", len(keys))
    """)
    assert "keys 3" in out


def test_normalize_compiles_once_per_resolution(tmp_path):
    # batch size, views and frames change from call to call; H, W (the resolution) and the layout do not
    out = run_script(tmp_path, setup=COUNT_KEYS, body="""
        from latentfast.kernels import normalize_uint8
        keys = count_keys(normalize_uint8._normalize_view_kernel)
        for batch, frames, views in [(1, 2, 1), (2, 4, 2), (3, 6, 3), (5, 8, 2), (4, 16, 4)]:
            x = torch.randint(0, 256, (batch, 3, frames, 8, 32), dtype=torch.uint8)
            ops.normalize_uint8(x, num_views=views, backend="triton")
        assert len(keys) == 1, sorted(keys)
        print("keys", len(keys))
    """)
    assert "keys 1" in out


def test_sample_latents_compiles_once_per_dtype_whatever_the_batch(tmp_path):
    # batch size, item shape and strides change from batch to batch (aspect buckets); only the dtypes
    # select a kernel
    out = run_script(tmp_path, setup=COUNT_KEYS, body="""
        from latentfast.kernels import sample_latents
        from latentfast.sampling import item_seeds
        keys = count_keys(sample_latents._sample_latents_kernel)
        for shape in [(1, 4, 8, 8), (3, 4, 8, 12), (7, 4, 5, 9), (2, 16, 32, 32), (5, 3), (64, 4, 2, 1, 3)]:
            mean = torch.randn(shape)
            seeds = item_seeds([str(i) for i in range(shape[0])], 0, 1)
            sample_latents.sample_latents_into(mean, mean.abs(), seeds, torch.empty(shape))
            sample_latents.sample_latents_into(mean[:, ..., 1:], mean[:, ..., 1:], seeds, torch.empty(mean[..., 1:].shape))
        assert len(keys) == 1, sorted(keys)
        half = torch.randn(3, 4, 5, 6).half()
        sample_latents.sample_latents_into(half, half, item_seeds(["a", "b", "c"], 0, 0), torch.empty(3, 4, 5, 6))
        assert len(keys) == 2, sorted(keys)
        print("keys", len(keys))
    """)
    assert "keys 2" in out


# ---- rounding of special values ------------------------------------------------------------------
def test_bfloat16_rounding_keeps_nan_and_inf(tmp_path):
    out = run_script(tmp_path, """
        from latentfast.kernels._rounding import cast_rounded

        @triton.jit
        def _cast(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            y = tl.load(x_ptr + offs, mask=offs < n)
            tl.store(out_ptr + offs, cast_rounded(y, tl.bfloat16), mask=offs < n)

        special = [0x7F800001, 0x7F80FFFF, 0x7FBFFFFF, 0x7FC00000, 0x7FFFFFFF, 0xFF800001, 0xFFBFFFFF, 0xFFFFFFFF,
                   0xFFC00001, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F7FFF, 0x3F808000, 0x3F818000,
                   0x00000001, 0x80008000, 0x00000000, 0x80000000]
        rng = np.random.default_rng(0)
        bits = np.concatenate([np.array(special, dtype=np.uint32), rng.integers(0, 2**32, 5000, dtype=np.uint32)])
        x = torch.from_numpy(bits.view(np.int32)).view(torch.float32)
        got = torch.empty(x.numel(), dtype=torch.bfloat16)
        _cast[(triton.cdiv(x.numel(), 1024),)](x, got, x.numel(), BLOCK=1024)
        want = x.to(torch.bfloat16)
        nan = x.isnan()
        assert bool(got[nan].isnan().all()), got[nan][~got[nan].isnan()]
        assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
        assert got[9].item() == float("inf") and got[10].item() == float("-inf") and got[11].item() == float("inf")

        # the whole kernel: every float16 bit pattern through expand_rows, white column NaN
        every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
        widths = torch.full((64,), 1024, dtype=torch.int32)
        offsets = torch.arange(64, dtype=torch.int64) * 1024
        white = torch.tensor([float("nan")], dtype=torch.float16)
        for dtype in (torch.bfloat16, torch.float32, torch.float16):
            batch = ops.expand_rows(every, offsets, widths, white, channels=1, latent_h=1, width=1030,
                                    dtype=dtype, backend="triton")
            torch.testing.assert_close(batch[..., :1024], every.reshape(64, 1, 1, 1024).to(dtype), rtol=0, atol=0,
                                       equal_nan=True)
            assert bool(batch[..., 1024:].isnan().all())
        print("special values ok")
    """)
    assert "special values ok" in out


# ---- int64 program offsets ----------------------------------------------------------------------------
# Only the grid's last program along axis 0 runs, with its real program id: its tile starts past 2**31
# elements, inside an output of 4 GiB that is allocated (virtual memory) but never touched elsewhere.
LAST_PROGRAM_ONLY = """
last = {}
real_run = interpreter.InterpretedFunction.run

def run_last_program(self, *args, grid, warmup, **kwargs):
    last["pid"] = grid[0] - 1
    return real_run(self, *args, grid=(1, *grid[1:]), warmup=warmup, **kwargs)

real_pid = interpreter.InterpreterBuilder.create_get_program_id

def shifted_pid(self, axis):
    if axis == 0:
        return interpreter.TensorHandle(np.array([self.grid_idx[0] + last["pid"]], dtype=np.int32), tl.int32)
    return real_pid(self, axis)

interpreter.InterpretedFunction.run = run_last_program
interpreter.InterpreterBuilder.create_get_program_id = shifted_pid
"""


def test_program_offsets_past_2_31_normalize(tmp_path):
    out = run_script(tmp_path, setup=LAST_PROGRAM_ONLY, body="""
        L0, L1 = 2**21 + 1, 1024  # rows = L0 * L1 = 2**31 + 1024; lead dim 0 has stride 0 (an expanded view)
        small = torch.randint(0, 256, (L1,), dtype=torch.uint8)
        x = small.as_strided((L0, L1, 1, 1, 1), (0, 1, 1, 1, 1))
        out = torch.empty((L0, L1, 1, 1, 1), dtype=torch.float16)
        flat = out.view(-1)
        flat[-4096:].fill_(float("nan"))
        ops.normalize_uint8(x, out=out, dtype=torch.float16, backend="triton")
        block_r = _launch.tile(1, 512)[0]
        first = last["pid"] * block_r
        assert first > 2**31, first
        n = L0 * L1 - first
        want = (small[first % L1 :].float() / 127.5 - 1).half()
        torch.testing.assert_close(flat[-n:], want, rtol=0, atol=0)
        assert bool(flat[-4096:-n].isnan().all()), "the last program wrote outside its rows"
        print("rows from", first)
    """)
    assert "rows from" in out


def test_program_offsets_past_2_31_expand(tmp_path):
    out = run_script(tmp_path, setup=LAST_PROGRAM_ONLY, body="""
        from latentfast.kernels import expand_rows
        B, h = 2**11 + 1, 2**20  # lines = B * h = 2**31 + 2**20, one column each
        packed = torch.randn(h).half()
        offsets = torch.zeros(B, dtype=torch.int64)  # every row is the same packed row
        widths = torch.ones(B, dtype=torch.int32)
        out = torch.empty((B, 1, h, 1), dtype=torch.float16)
        flat = out.view(-1)
        flat[-4096:].fill_(float("nan"))
        ops.expand_rows(packed, offsets, widths, torch.zeros(h), channels=1, latent_h=h, width=1, out=out,
                        backend="triton")
        first = last["pid"] * expand_rows.BLOCK_R
        assert first > 2**31, first
        n = B * h - first
        torch.testing.assert_close(flat[-n:], packed[-n:], rtol=0, atol=0)
        assert bool(flat[-4096:-n].isnan().all()), "the last program wrote outside its lines"
        print("lines from", first)
    """)
    assert "lines from" in out


# ---- value checks of the CPU path ----------------------------------------------------------------------
def test_cpu_path_checks_rows_on_the_host(tmp_path):
    out = run_script(tmp_path, """
        from latentfast.errors import InvalidArgumentError
        packed = torch.randn(30).half()
        cases = [
            (dict(widths=[2, 1], white=None), "row 1 \\\\(width 1\\\\) needs padding to W=2 but no white column"),
            (dict(widths=[2, 3], white=None, width=2), "row 1 .*needs 0 <= width <= W=2"),
            (dict(widths=[2, 2], offsets=[0, 28], white=torch.zeros(3)), "inside packed's 30 elements"),
            (dict(widths=[2, 2], offsets=[-1, 0], white=torch.zeros(3)), "row 0 \\\\(offset -1"),
        ]
        import re
        for case, match in cases:
            out = torch.full((2, 1, 3, case.get("width", 2)), 7.0)
            try:
                ops.expand_rows(packed, torch.tensor(case.get("offsets", [0, 6])),
                                torch.tensor(case["widths"], dtype=torch.int32), case["white"], channels=1,
                                latent_h=3, width=case.get("width"), dtype=torch.float32, out=out, backend="triton")
            except InvalidArgumentError as exc:
                assert re.search(match, str(exc)), (match, str(exc))
                assert bool((out == 7.0).all()), "written before the check"
            else:
                raise AssertionError(f"no error for {case}")
        print("checked")
    """)
    assert "checked" in out


# ---- the same promises on CUDA --------------------------------------------------------------------------
def _cuda_devices(count: int):
    if not torch.cuda.is_available() or torch.cuda.device_count() < count:
        pytest.skip(f"needs {count} CUDA device(s)")


@pytest.mark.gpu
@pytest.mark.multigpu
def test_launch_on_a_device_that_is_not_current():
    # Triton queues on the current device's stream: without the guard these run on cuda:0's stream
    # with cuda:1 pointers, unordered with the producer of x on cuda:1
    _cuda_devices(2)
    torch.cuda.set_device(0)
    x_cpu = torch.randint(0, 256, (4, 3, 8, 64, 96), dtype=torch.uint8)
    with torch.cuda.device(1):
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            x = x_cpu.to("cuda:1", non_blocking=True)
        torch.cuda.current_stream().wait_stream(side)
    views = ops.normalize_uint8(x, num_views=2, backend="triton")
    assert all(v.device == torch.device("cuda", 1) for v in views)
    for v, view in enumerate(views):
        want = x_cpu[:, :, 4 * v : 4 * v + 4].float() / 127.5 - 1
        torch.testing.assert_close(view.cpu(), want, rtol=0, atol=torch.finfo(torch.float32).eps)
    packed = torch.randn(2 * 3 * 40, dtype=torch.float16, device="cuda:1")
    out = poisoned_like((2, 3, 1, 40), torch.float16, device="cuda:1")
    ops.expand_rows(packed, torch.tensor([0, 120], device="cuda:1"), torch.tensor([40, 40], dtype=torch.int32,
                    device="cuda:1"), None, channels=3, latent_h=1, out=out, backend="triton")
    torch.testing.assert_close(out.cpu(), packed.cpu().reshape(2, 3, 1, 40), rtol=0, atol=0)


@pytest.mark.gpu
def test_expand_rows_cuda_compiles_once_per_dtype():
    _cuda_devices(1)
    from latentfast.kernels import expand_rows

    device = torch.device("cuda", torch.cuda.current_device())
    cache = expand_rows._expand_rows_kernel.device_caches[device.index][0]
    before = len(cache)
    for B, W in [(2, 7), (5, 16), (3, 33), (8, 64), (4, 100), (6, 301)]:
        widths = torch.randint(1, W + 1, (B,), dtype=torch.int32)
        widths[0] = W
        sizes = widths.to(torch.int64) * 12
        offsets = torch.cumsum(sizes, 0) - sizes
        packed = torch.randn(int(sizes.sum()), dtype=torch.float16)
        white = torch.randn(12, dtype=torch.float16)
        got = ops.expand_rows(packed.to(device), offsets.to(device), widths.to(device), white.to(device), channels=3,
                              latent_h=4, backend="triton")
        want = ops.expand_rows(packed, offsets, widths, white, channels=3, latent_h=4, backend="torch")
        torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
    assert len(cache) - before <= 1, f"{len(cache) - before} compiles for one dtype"


@pytest.mark.gpu
def test_program_offsets_past_2_31_on_cuda():
    # the whole grid this time: outputs of 2**31 + 1024 float16 elements (4 GiB), every one checked
    _cuda_devices(1)
    L0, L1 = 2**21 + 1, 1024
    small = torch.randint(0, 256, (L1,), dtype=torch.uint8, device="cuda")
    x = small.as_strided((L0, L1, 1, 1, 1), (0, 1, 1, 1, 1))
    out = torch.full((L0, L1, 1, 1, 1), float("nan"), dtype=torch.float16, device="cuda")
    ops.normalize_uint8(x, out=out, dtype=torch.float16, backend="triton")
    want = (small.float() / 127.5 - 1).half()
    torch.testing.assert_close(out.view(L0, L1)[-3:], want.expand(3, L1), rtol=0, atol=torch.finfo(torch.float16).eps)
    assert not bool(out.isnan().any()), "rows past 2**31 were not written"
    del out
    B, h = 2**11 + 1, 2**20
    packed = torch.randn(h, dtype=torch.float16, device="cuda")
    out = torch.full((B, 1, h, 1), float("nan"), dtype=torch.float16, device="cuda")
    ops.expand_rows(packed, torch.zeros(B, dtype=torch.int64, device="cuda"),
                    torch.ones(B, dtype=torch.int32, device="cuda"), None, channels=1, latent_h=h, width=1, out=out,
                    backend="triton")
    assert torch.equal(out[-1].view(-1), packed) and not bool(out.isnan().any())
