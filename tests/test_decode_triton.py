"""The Triton expand kernel (the device half of the GPU read path) on CPU tensors under Triton's
interpreter. TRITON_INTERPRET must be set before Triton is imported, so it runs in a subprocess."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import numpy as np
    import torch
    from latentfast import backends, ops
    from latentfast.testing import poisoned_like, random_rows

    assert backends.resolve("expand_rows_into", "cpu", "triton") == "triton"
    rng = np.random.default_rng(0)
    for channels, latent_h, w_max, n, width in [(1, 1, 1, 3, None), (3, 5, 17, 9, None), (4, 2, 300, 6, 301)]:
        rows, widths = random_rows(rng, n, channels, latent_h, w_max)
        white = rng.standard_normal((channels, latent_h, 1)).astype(np.float16)
        order = list(rng.permutation(n)) + [0, 0]  # unsorted, with a duplicate
        packed = torch.from_numpy(np.concatenate([rows[i].reshape(-1) for i in order]))
        selected = torch.from_numpy(widths[order].astype(np.int32))
        sizes = selected.to(torch.int64) * channels * latent_h
        starts = torch.cumsum(sizes, 0) - sizes
        W = width or int(selected.max())
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            out = poisoned_like((len(order), channels, latent_h, W), dtype)
            ops.expand_rows(packed, starts, selected, torch.from_numpy(white), channels=channels, latent_h=latent_h,
                            width=width, dtype=dtype, out=out, backend="triton")
            expected = np.stack([np.concatenate([rows[i], np.repeat(white, W - widths[i], axis=2)], axis=2)
                                 for i in order])
            torch.testing.assert_close(out, torch.from_numpy(expected).to(dtype), rtol=0, atol=0)
    # no white column when no row needs padding
    full = torch.from_numpy(rng.standard_normal(2 * 3 * 4).astype(np.float16))
    out = ops.expand_rows(full, torch.tensor([0, 12]), torch.tensor([4, 4], dtype=torch.int32), None,
                          channels=1, latent_h=3, dtype=torch.float32, backend="triton")
    torch.testing.assert_close(out, full.float().reshape(2, 1, 3, 4), rtol=0, atol=0)
    print("triton expand ok")
    """
)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_expand_rows_triton_interpreter():
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                            timeout=280)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "triton expand ok" in result.stdout
