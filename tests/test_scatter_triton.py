"""The Triton kernel of scatter_cotangents_into (latentfast/kernels/scatter_cotangents.py) against the reference,
bit for bit: on CPU tensors under Triton's interpreter (a child process, as TRITON_INTERPRET must be
set before Triton is imported), and on CUDA tensors when there is a device."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

# grads of every layout (contiguous, transposed, sliced, expanded) and dtype, odd sizes, one and two
# copies, arena dtypes other than the grads', a poisoned arena: the result must equal the reference's.
CASES = """
import sys
import torch
from latentfast import reference
from latentfast.kernels import scatter_cotangents as kernel

device = sys.argv[1]
launches = []
real_launch = kernel.launch
kernel.launch = lambda *args, **kw: launches.append(1) or real_launch(*args, **kw)
g = torch.Generator().manual_seed(0)

def grad(rows, tokens, channels, dtype, layout):
    rand = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).to(device)
    if layout == "contiguous":
        return rand(rows, tokens, channels)
    if layout == "transposed":
        return rand(rows, channels, tokens).transpose(1, 2)
    if layout == "sliced":
        return rand(rows + 1, 2 * tokens, channels + 3)[1:, ::2, 1 : channels + 1]
    return rand(1, tokens, channels).expand(rows, -1, -1)

dtypes = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
checked = 0
for in_dtype in dtypes:
    for out_dtype in dtypes:
        for scales in ([0.37], [1.0, 3.0], [2.0, -1.0 / 3.0]):
            for grads, sizes in (
                ([grad(4, 3, 5, in_dtype, "contiguous")], [4]),
                ([grad(7, 5, 3, in_dtype, "contiguous"), grad(7, 1, 9, in_dtype, "transposed"),
                  grad(7, 4, 2, in_dtype, "sliced")], [2, 1, 3, 1]),
                ([grad(5, 2, 7, in_dtype, "expanded"), grad(5, 3, 3, in_dtype, "sliced")], [5]),
                ([grad(3, 700, 7, in_dtype, "contiguous")], [1, 2]),  # segments of several tiles
            ):
                n = len(scales) * sum(t.shape[0] * t.shape[1] * t.shape[2] for t in grads)
                expected = torch.empty(n, dtype=out_dtype)
                reference.scatter_cotangents_into([t.cpu() for t in grads], sizes, scales, expected)
                arena = torch.full((n,), float("nan"), dtype=out_dtype, device=device)
                before = len(launches)
                kernel.scatter_cotangents_into(grads, sizes, scales, arena)
                assert len(launches) == before + 1, "one launch for every segment"
                assert torch.equal(arena.cpu(), expected), (in_dtype, out_dtype, scales, sizes)
                checked += 1
print("CHECKED", checked)
"""


def _run(device: str, interpret: bool) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0")
    proc = subprocess.run([sys.executable, "-c", CASES, device], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-4000:]
    return proc.stdout


@pytest.mark.slow
def test_interpreted_kernel_matches_reference_bit_for_bit():
    assert "CHECKED 192" in _run("cpu", interpret=True)


@pytest.mark.gpu
def test_cuda_kernel_matches_reference_bit_for_bit():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    assert "CHECKED 192" in _run("cuda", interpret=False)
