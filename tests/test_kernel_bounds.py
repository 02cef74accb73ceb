"""Sizes that do not fit in int64 never reach a kernel's pointer arithmetic: a huge pitch, a channel count
whose product overflows, a row of 2**62 empty lines. Each case once crashed the process (a segfault, a
double free) or read memory before ``data``, so each runs in a child process and must end in a clear
error (or, for the empty rows, a prompt result)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from latentfast.testing import runnable_backends

SETUP = """
import sys
import torch
from latentfast import ops
from latentfast.errors import LatentfastError

backend = sys.argv[1]
data = torch.arange(64, dtype=torch.float16)
offsets = torch.tensor([0, 8], dtype=torch.int64)
widths = torch.tensor([2, 2], dtype=torch.int32)
out = torch.full((64,), 7.0, dtype=torch.float16)
try:
"""
REPORT = """
except (LatentfastError, ValueError) as exc:  # the raw compiled op raises a plain ValueError
    print("REFUSED", type(exc).__name__, exc)
    assert bool((out == 7.0).all()), "out was written before the error"
else:
    print("RETURNED")
"""

# case -> (the call, inside the try; what the refusal must say)
CASES = {
    "gather_pitch_2**62": (
        "ops.gather_rows(data, offsets, widths, 2**62, [1], channels=1, latent_h=3, white=torch.zeros(3), "
        "backend=backend)",
        "outside the data",
    ),
    "gather_pitch_2**63-10": (
        "ops.gather_rows(data, offsets, widths, 2**63 - 10, [1], channels=1, latent_h=3, backend=backend)",
        "outside the data",
    ),
    "packed_pitch_2**62": (
        "ops.gather_rows_packed(data, offsets, widths, 2**62, [1], channels=1, latent_h=5, out=out, backend=backend)",
        "outside the data",
    ),
    "packed_pitch_2**63-10": (
        "ops.gather_rows_packed(data, offsets, widths, 2**63 - 10, [1], channels=1, latent_h=3, out=out, "
        "backend=backend)",
        "outside the data",
    ),
    "pitch_beyond_int64": (
        "ops.gather_rows(data, offsets, widths, 2**63, [1], channels=1, latent_h=3, backend=backend)",
        "pitch must be an int <= 9223372036854775807, got 9223372036854775808",
    ),
    "packed_op_channels_times_h_overflows": (
        "torch.ops.latentfast.gather_rows_packed_into(data, offsets, widths, 0, torch.tensor([0, 1]), 2**32 + 1, "
        "2**32 - 1, out, backend)",
        "channels \\* latent_h = 4294967297 \\* 4294967295 does not fit in int64",
    ),
    "packed_elements_overflow": (
        "ops.gather_rows_packed(data, offsets, widths, 0, [0, 1], channels=2**61, latent_h=4, backend=backend)",
        "would hold 36893488147419103232 elements, more than int64 can count",
    ),
    "gather_out_elements_overflow": (
        "ops.gather_rows(data, offsets, widths, 0, [0, 1], channels=2**40, latent_h=2**40, width=4, "
        "backend=backend)",
        "out would hold .* elements, more than int64 can count",
    ),
}


def _run(body: str, backend: str, timeout: int = 60) -> subprocess.CompletedProcess:
    script = SETUP + textwrap.indent(body, "    ") + REPORT
    return subprocess.run([sys.executable, "-c", script, backend], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONFAULTHANDLER="1"))


@pytest.mark.parametrize("backend", runnable_backends("gather_rows_packed_into"))
@pytest.mark.parametrize("case", sorted(CASES))
def test_huge_sizes_are_refused_not_crashed(case, backend):
    import re

    call, match = CASES[case]
    proc = _run(call, backend)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stdout[-2000:]} {proc.stderr[-3000:]}"
    assert proc.stdout.startswith("REFUSED InvalidArgumentError"), proc.stdout + proc.stderr[-2000:]
    assert re.search(match, proc.stdout), proc.stdout


@pytest.mark.skipif("cpp" not in runnable_backends("gather_rows_packed_into"), reason="latentfast._C not built")
def test_compiled_kernel_checks_the_product_itself():
    # called without the op's Python checks, the C++ kernel must refuse the overflowing product too
    for call, message in (
        ("torch.ops.latentfast_compiled.gather_rows_packed_into(data, offsets, widths, 0, torch.tensor([0, 1]), "
         "2**32 + 1, 2**32 - 1, out)", "channels * latent_h = 4294967297 * 4294967295 does not fit in int64"),
        ("torch.ops.latentfast_compiled.gather_rows_into(data, offsets, widths, 2**63 - 10, torch.tensor([1]), "
         "None, torch.empty(1, 1, 3, 2, dtype=torch.float16))", "more than int64 holds: outside the data's 64 elements"),
    ):
        proc = _run(call, "cpp")
        assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
        assert message in proc.stdout, proc.stdout


@pytest.mark.parametrize("backend", runnable_backends("gather_rows_packed_into"))
def test_empty_rows_of_2_62_lines_return_at_once(backend):
    # a zero-width row copies nothing, however many lines it has: no loop over its 2**62 lines
    proc = _run(
        "packed = ops.gather_rows_packed(data, offsets, torch.tensor([0, 0], dtype=torch.int32), 3, [0, 1, 0], "
        "channels=2**31, latent_h=2**31, out=out, backend=backend)\n"
        "assert packed.numel() == 0",
        backend,
        timeout=30,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    assert "RETURNED" in proc.stdout, proc.stdout
