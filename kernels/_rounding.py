"""Rounding helpers shared by the Triton kernels."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cast_rounded(y, dtype: tl.constexpr):
    """float32 ``y`` -> ``dtype`` with round-to-nearest-even, the same bits as torch's ``.to``.

    bfloat16 is rounded by hand on the bit pattern: Triton's interpreter (how CI runs these
    kernels on CPU) truncates a plain float32 -> bfloat16 cast, while the GPU rounds to nearest
    even. ``y`` must be finite (true for every caller: pixels and finite latents).
    """
    if dtype == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return y.to(dtype)
