"""The op layer: import without the compiled library, describe(), backend selection errors."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

import latentfast
from latentfast.errors import InvalidArgumentError
from latentfast.testing import runnable_backends


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_import_and_ops_work_without_compiled_library():
    proc = _run(
        """
        import torch, latentfast
        from latentfast import backends, ops
        x = torch.randint(0, 256, (3, 4, 8, 8), dtype=torch.uint8)
        a, b = ops.normalize_uint8(x, num_views=2)
        assert torch.equal(a, x[:, :2].float() / 127.5 - 1)
        assert backends.resolve("normalize_uint8_into", "cpu") == "torch"
        try:
            ops.normalize_uint8(x, backend="cpp")
        except backends.BackendUnavailableError as exc:
            print("ERR", exc)
        print(latentfast.describe())
        """,
        LATENTFAST_DISABLE_C="1",
    )
    assert proc.returncode == 0, proc.stderr
    assert "ERR argument backend='cpp' cannot run latentfast::normalize_uint8_into on cpu tensors" in proc.stdout
    assert "native library: NOT loaded" in proc.stdout


def test_describe_lists_every_op_and_device():
    report = latentfast.describe(verbose=True)
    for op in latentfast._ops.SCHEMAS:
        assert f"{op}" in report
    assert " cpu " in report and " cuda " in report


def test_every_schema_has_a_reference_and_one_dispatch_kernel_per_device():
    import torch

    for op in latentfast._ops.SCHEMAS:
        assert callable(getattr(latentfast.reference, op)), op
        for key in ("CPU", "CUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"latentfast::{op}", key), (op, key)


def _compiled_sources(device_dir: str, suffix: str) -> set[str]:
    root = pathlib.Path(__file__).resolve().parent.parent / "csrc" / device_dir
    return {path.name.removesuffix(f"_kernel{suffix}") for path in root.glob(f"*_kernel{suffix}")}


def test_compiled_kernels_are_what_auto_runs():
    # every op with a csrc/cpu source must run the native library's kernel under "auto", not a fallback
    from latentfast import _ops, backends
    from latentfast.backends import native

    if native.LOAD_ERROR is not None:
        if os.environ.get("CI"):  # CI installs with the build: a missing library there is a broken build, not a skip
            pytest.fail(f"the native library did not load under CI: {native.LOAD_ERROR}")
        pytest.skip(f"the native library is not built here: {native.LOAD_ERROR}")
    for name in _compiled_sources("cpu", ".cpp"):
        ops_in_file = [op for op in _ops.SCHEMAS if op.startswith(name)]
        assert ops_in_file, name
        for op in ops_in_file:
            assert _ops.compiled_kernel_registered(op, "CPU"), op
            assert backends.resolve(op, "cpu") == "cpp", op
            assert backends.implementation(op, "cpu")[0] is native.KERNELS[op], op


def test_without_compiled_library_no_compiled_backend_is_offered():
    proc = _run(
        """
        from latentfast import _ops, backends
        for op in _ops.SCHEMAS:
            for device in ("cpu", "cuda"):
                reasons = backends.availability(op, device)
                assert reasons["cpp"] and reasons["cuda"], (op, device, reasons)
                assert backends.resolve(op, "cpu") == "torch"
        print("ok")
        """,
        LATENTFAST_DISABLE_C="1",
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr


@pytest.mark.parametrize("backend", runnable_backends("normalize_uint8_into", "cpu"))
def test_every_backend_raises_the_same_error_class(backend):
    import torch

    x = torch.zeros(3, 4, 8, 8, dtype=torch.uint8)
    with pytest.raises(InvalidArgumentError, match="shape"):
        torch.ops.latentfast.normalize_uint8_into(x, [torch.empty(3, 4, 8, 7)], backend)
    with pytest.raises(InvalidArgumentError, match="overlaps"):
        torch.ops.latentfast.normalize_uint8_into(x, [torch.empty(3, 2, 8, 8)] * 2, backend)
    with pytest.raises(InvalidArgumentError, match="backend must be one of"):
        torch.ops.latentfast.normalize_uint8_into(x, [torch.empty(3, 4, 8, 8)], "fortran")


def test_forced_backend_reaches_the_op():
    # the public function passes backend= to the op; the op (not Python around it) picks the kernel
    import torch

    from latentfast import backends, ops

    calls = []
    fn, checks = backends.implementation("normalize_uint8_into", "cpu", "torch")
    spy = lambda *args: calls.append(True) or fn(*args)  # noqa: E731
    backends.register_kernel("normalize_uint8_into", "cpu", "torch", checks_arguments=checks)(spy)
    try:
        ops.normalize_uint8(torch.zeros(3, 2, 4, 4, dtype=torch.uint8), backend="torch")
        assert calls == [True]
        if "cpp" in runnable_backends("normalize_uint8_into", "cpu"):
            ops.normalize_uint8(torch.zeros(3, 2, 4, 4, dtype=torch.uint8), backend="cpp")
            assert calls == [True]
    finally:
        backends.register_kernel("normalize_uint8_into", "cpu", "torch", checks_arguments=checks)(fn)
