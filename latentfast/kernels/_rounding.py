"""Rounding helpers shared by the Triton kernels."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def cast_rounded(y, dtype: tl.constexpr):
    """float32 ``y`` -> ``dtype`` with round-to-nearest-even, the same values as torch's ``.to``.

    bfloat16 is rounded by hand on the bit pattern: Triton's interpreter (how CI runs these
    kernels on CPU) truncates a plain float32 -> bfloat16 cast, while the GPU rounds to nearest
    even. The rounding carry would turn a NaN whose payload sits in the low bits into inf (or, for a
    negative NaN, wrap to zero), so NaN is mapped to bfloat16's quiet NaN as c10::BFloat16 does;
    +-inf and overflow to inf come out of the carry as they should.
    """
    if dtype == tl.bfloat16:
        bits = y.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(y != y, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return y.to(dtype)
