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


@triton.jit
def unpack_codes(words, mask, BITS: tl.constexpr):
    """int32 words [R, C] -> their codes [R, C * 32 // BITS] as exact float32; column c * cpw + k holds code k of
    word (r, c). ``mask`` is 2^BITS - 1, passed as a run-time kernel argument (see below).

    Each 16-bit half of a word is split off once; code j of a half is masked in place and OR-ed into the
    mantissa of 2^23 (one LOP3: ptxas fuses AND + OR, which LLVM would turn into a bit-field extract if the
    mask were a constant), then one FMA scales by 2^-(BITS*j) and removes the 2^23, exactly. No int -> float
    conversion (1/8 of the FMA rate on Hopper) and no per-code shift of the word.
    """
    CPW: tl.constexpr = 32 // BITS
    HALF: tl.constexpr = CPW // 2
    rows: tl.constexpr = words.shape[0]
    cols: tl.constexpr = words.shape[1]
    j = tl.arange(0, HALF)
    step = ((127 - BITS * j) << 23).to(tl.float32, bitcast=True)  # 2^-(BITS*j)
    bias = -(((150 - BITS * j) << 23).to(tl.float32, bitcast=True))  # -2^(23 - BITS*j)
    halves = words[:, :, None] >> (16 * tl.arange(0, 2))[None, None, :]  # [R, C, 2]
    bits = (halves[:, :, :, None] & (mask << (BITS * j))[None, None, None, :]) | 0x4B000000  # [R, C, 2, HALF]
    codes = tl.fma(bits.to(tl.float32, bitcast=True), step[None, None, None, :], bias[None, None, None, :])
    return tl.reshape(codes, (rows, cols * CPW))
