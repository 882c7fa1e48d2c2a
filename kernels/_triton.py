"""Small @triton.jit helpers shared by the kernels of this package."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """fp32 -> DTYPE, round to nearest even.

    bf16 is rounded with integer ops because Triton's interpreter truncates fp32 -> bf16 casts; on the GPU
    this gives the same bits as the hardware cast, so CPU tests check the code that runs there.
    """
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)
