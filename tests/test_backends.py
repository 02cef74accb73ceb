"""The op layer: import without the compiled library, describe(), backend selection errors."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import latentfast


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
    assert "_C: NOT loaded" in proc.stdout


def test_describe_lists_every_op_and_device():
    report = latentfast.describe()
    for op in latentfast._ops.SCHEMAS:
        assert f"{op}" in report
    assert " cpu " in report and " cuda " in report


def test_every_schema_has_a_reference_and_kernels_on_both_devices():
    import torch

    for op in latentfast._ops.SCHEMAS:
        assert callable(getattr(latentfast.reference, op)), op
        for key in ("CPU", "CUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"latentfast::{op}", key), (op, key)
