"""Fused quantize + pack: the Triton twin of ``kivi.quant.quantize`` (same codes, scales and zeros, bit for bit,
barring vanishingly rare quotients: see ``_biased_codes``).

A program reads a block of tokens x all channels of one (batch, head), computes min/max per group, the
model-dtype scale and zero, the codes from those stored values, and writes the packed int32 words and the
statistics in the layout of ``kivi.quant``:

- axis "channel" (keys): groups of G tokens per channel; codes [B, H, T // cpw, D], scale/zero [B, H, T // G, D]
- axis "token" (values): groups of G channels per token; codes [B, H, T, D // cpw], scale/zero [B, H, T, D // G]
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kivi.kernels._triton import round_to
from kivi.config import KiviConfig
from kivi.quant import Quantized, allocate, codes_per_word, packed_shapes

# Adding 2^23 to a float32 in [0, 2^22) rounds it to an integer, ties to even (torch.round's rule), and leaves
# that integer in the low mantissa bits: the sum's bits are CODE_BIAS + the integer. No float -> int
# conversion, and no libdevice call (which the CPU interpreter lacks).
ROUND_MAGIC = tl.constexpr(8388608.0)
CODE_BIAS = 0x4B000000  # the bits of 2^23


def _pack_bias(bits: int) -> int:
    """What packing biased codes adds to a word: the sum over its slots of CODE_BIAS << slot * bits, mod 2^32."""
    return sum(CODE_BIAS << (slot * bits) for slot in range(32 // bits)) % 2**32


PACK_BIAS = tl.constexpr(tuple(_pack_bias(bits) if bits in (2, 4, 8) else 0 for bits in range(9)))  # by bit width


@triton.jit
def _scale_zero(lo, hi, DTYPE: tl.constexpr, QMAX: tl.constexpr, RECIPROCAL: tl.constexpr):
    """Group min/max (fp32) -> (scale, zero) in the model dtype, as kivi.quant computes them.

    kivi.quant's `range / QMAX` is an IEEE division on the CPU but a multiplication by the fp32 reciprocal on
    CUDA (PyTorch divides by a scalar that way); RECIPROCAL follows the device.
    """
    if RECIPROCAL:
        scale = (hi - lo) * (1.0 / QMAX)
    else:
        scale = tl.math.div_rn(hi - lo, QMAX * 1.0)
    return round_to(scale, DTYPE), round_to(lo, DTYPE)


@triton.jit
def _biased_codes(x, zero, scale, inv, QMAX: tl.constexpr):
    """CODE_BIAS + round((x - zero) / scale) clamped to [0, QMAX], as uint32; x fp32, ``scale`` fp32 with 0
    replaced by 1, inv = 1 / scale.

    An IEEE division per element is a multi-instruction sequence with a slow-path branch. Instead: multiply by
    the reciprocal, then one FMA correction step, which gives the correctly rounded quotient (exact round-half
    ties included, common with bf16 inputs) except in vanishingly rare cases. x - zero >= 0, as zero is the
    group minimum, so only the top needs clamping. The bias stays: ``_pack`` removes it once per word.
    """
    num = x - zero.to(tl.float32)
    q = num * inv
    q = tl.minimum(tl.fma(tl.fma(q, -scale, num), inv, q), QMAX * 1.0)
    return (q + ROUND_MAGIC).to(tl.uint32, bitcast=True)


@triton.jit
def _pack(word, BITS: tl.constexpr):
    """int32 word from the sum over slots of biased code << slot * BITS (uint32, wrapping): the codes hold
    disjoint bits, so summing them packs them, and the biases add up to PACK_BIAS. A shift-and-add per code
    instead of a shift, a mask and an OR."""
    return (word - PACK_BIAS[BITS]).to(tl.int32, bitcast=True)


@triton.jit
def _safe_scale(scale):
    """(scale as fp32 with 0 -> 1, its reciprocal): a constant group has scale 0 and codes 0."""
    safe = tl.where(scale == 0, 1.0, scale.to(tl.float32))
    return safe, 1.0 / safe


@triton.jit
def _token_words(x, DTYPE: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, RECIPROCAL: tl.constexpr):
    """Values of x [T, D] (input dtype) in groups of GROUP channels -> (words [T, D // cpw] int32, scale, zero
    [T, D // GROUP]). Min and max are exact in the input dtype (two 16-bit elements per instruction)."""
    CPW: tl.constexpr = 32 // BITS
    QMAX: tl.constexpr = (1 << BITS) - 1
    T: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    x = tl.reshape(x, (T, D // GROUP, GROUP))
    lo, hi = tl.min(x, axis=2, keep_dims=True), tl.max(x, axis=2, keep_dims=True)
    scale, zero = _scale_zero(lo.to(tl.float32), hi.to(tl.float32), DTYPE, QMAX, RECIPROCAL)
    safe, inv = _safe_scale(scale)
    codes = tl.reshape(_biased_codes(x.to(tl.float32), zero, safe, inv, QMAX), (T, D // CPW, CPW))
    words = _pack(tl.sum(codes << (tl.arange(0, CPW) * BITS).to(tl.uint32)[None, None, :], axis=2), BITS)
    return words, tl.reshape(scale, (T, D // GROUP)), tl.reshape(zero, (T, D // GROUP))


@triton.jit
def _channel_words(x, DTYPE: tl.constexpr, BITS: tl.constexpr, RECIPROCAL: tl.constexpr):
    """Keys of one group, x [G, D] (input dtype; G tokens per channel) -> (words [G // cpw, D] int32, scale, zero [D])."""
    CPW: tl.constexpr = 32 // BITS
    QMAX: tl.constexpr = (1 << BITS) - 1
    G: tl.constexpr = x.shape[0]
    D: tl.constexpr = x.shape[1]
    scale, zero = _scale_zero(tl.min(x, axis=0).to(tl.float32), tl.max(x, axis=0).to(tl.float32), DTYPE, QMAX, RECIPROCAL)
    safe, inv = _safe_scale(scale)
    codes = tl.reshape(_biased_codes(x.to(tl.float32), zero[None, :], safe[None, :], inv[None, :], QMAX), (G // CPW, CPW, D))
    words = _pack(tl.sum(codes << (tl.arange(0, CPW) * BITS).to(tl.uint32)[None, :, None], axis=1), BITS)
    return words, scale, zero


@triton.jit(do_not_specialize=["tokens"])
def _quantize_channel_kernel(
    x_ptr,  # [B, H, T, D] any strides; T % GROUP == 0
    codes_ptr,  # int32 [B, H, T // CPW, D]
    scale_ptr,  # model dtype [B, H, T // GROUP, D]
    zero_ptr,
    heads,
    tokens,
    stride_xb,
    stride_xh,
    stride_xt,
    stride_xd,
    HEAD_DIM: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    RECIPROCAL: tl.constexpr,
    GROUPS: tl.constexpr,  # token groups per program
    BLOCK_D: tl.constexpr,
):
    """Keys: groups of GROUP tokens per channel. Each thread walks the tokens of its groups one row at a time,
    so min/max and packing stay in registers (no cross-thread reduction)."""
    CPW: tl.constexpr = 32 // BITS
    QMAX: tl.constexpr = (1 << BITS) - 1
    bh = tl.program_id(1)
    b, h = bh // heads, bh % heads
    g = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    d = tl.arange(0, BLOCK_D)
    inside = (g * GROUP < tokens)[:, None]
    if BLOCK_D != HEAD_DIM:
        inside = inside & (d < HEAD_DIM)[None, :]
    rows = x_ptr + b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh + (g * GROUP)[:, None] * stride_xt + d[None, :] * stride_xd
    lo = tl.load(rows, mask=inside, other=0.0)  # min and max in the input dtype: exact, two 16-bit per instruction
    hi = lo
    for j in tl.static_range(1, GROUP):
        v = tl.load(rows + j * stride_xt, mask=inside, other=0.0)
        lo, hi = tl.minimum(lo, v), tl.maximum(hi, v)
    scale, zero = _scale_zero(lo.to(tl.float32), hi.to(tl.float32), scale_ptr.dtype.element_ty, QMAX, RECIPROCAL)
    safe, inv = _safe_scale(scale)
    stat_off = (bh.to(tl.int64) * (tokens // GROUP) + g[:, None]) * HEAD_DIM + d[None, :]
    tl.store(scale_ptr + stat_off, scale, mask=inside)
    tl.store(zero_ptr + stat_off, zero, mask=inside)
    for w in tl.static_range(GROUP // CPW):  # the group's words: CPW consecutive tokens each
        word = tl.zeros([GROUPS, BLOCK_D], tl.uint32)
        for k in tl.static_range(CPW):
            v = tl.load(rows + (w * CPW + k) * stride_xt, mask=inside, other=0.0).to(tl.float32)  # an L1 hit
            word += _biased_codes(v, zero, safe, inv, QMAX) << (k * BITS)
        word = _pack(word, BITS)
        word_off = (bh.to(tl.int64) * (tokens // CPW) + g[:, None] * (GROUP // CPW) + w) * HEAD_DIM + d[None, :]
        tl.store(codes_ptr + word_off, word, mask=inside)


@triton.jit(do_not_specialize=["tokens"])
def _quantize_token_kernel(
    x_ptr,  # [B, H, T, D] any strides; D % GROUP == 0
    codes_ptr,  # int32 [B, H, T, D // CPW]
    scale_ptr,  # model dtype [B, H, T, D // GROUP]
    zero_ptr,
    heads,
    tokens,
    stride_xb,
    stride_xh,
    stride_xt,
    stride_xd,
    HEAD_DIM: tl.constexpr,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    RECIPROCAL: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Values: groups of GROUP channels per token; a tile of BLOCK_T tokens x all channels per program."""
    CPW: tl.constexpr = 32 // BITS
    bh = tl.program_id(1)
    b, h = bh // heads, bh % heads
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    inside = (t < tokens)[:, None]
    if BLOCK_D != HEAD_DIM:
        inside = inside & (d < HEAD_DIM)[None, :]
    base = b.to(tl.int64) * stride_xb + h.to(tl.int64) * stride_xh
    x = tl.load(x_ptr + base + t[:, None] * stride_xt + d[None, :] * stride_xd, mask=inside, other=0.0)
    words, scale, zero = _token_words(x, scale_ptr.dtype.element_ty, BITS, GROUP, RECIPROCAL)
    w_col = tl.arange(0, BLOCK_D // CPW)
    w_off = (bh.to(tl.int64) * tokens + t[:, None]) * (HEAD_DIM // CPW) + w_col[None, :]
    tl.store(codes_ptr + w_off, words, mask=(t < tokens)[:, None] & (w_col < HEAD_DIM // CPW)[None, :])
    s_col = tl.arange(0, BLOCK_D // GROUP)
    s_off = (bh.to(tl.int64) * tokens + t[:, None]) * (HEAD_DIM // GROUP) + s_col[None, :]
    s_mask = (t < tokens)[:, None] & (s_col < HEAD_DIM // GROUP)[None, :]
    tl.store(scale_ptr + s_off, scale, mask=s_mask)
    tl.store(zero_ptr + s_off, zero, mask=s_mask)


@triton.jit(do_not_specialize=["kc_rows", "vc_rows"])
def _append_kernel(
    k_ptr, v_ptr,  # the step's key and value [B, H, D], any strides
    kr_ptr,  # key residual [B, H, KEY_BLOCK, D]: position i at row i % KEY_BLOCK
    vr_ptr,  # value ring [B, H, WINDOW + 1, D]: position i at row i % (WINDOW + 1)
    kc_ptr, ks_ptr, kz_ptr,  # keys: codes [B, H, kc_rows, D], scale/zero [B, H, kc_rows * CPW_K // GROUP, D]
    vc_ptr, vs_ptr, vz_ptr,  # values: codes [B, H, vc_rows, D // CPW_V], scale/zero [B, H, vc_rows, D // GROUP]
    pos_ptr,  # int32 [B]: the position of the step's token (tokens stored before it)
    heads, kc_rows, vc_rows, stride_kb, stride_kh, stride_kd, stride_vb, stride_vh, stride_vd,
    HEAD_DIM: tl.constexpr, BITS_K: tl.constexpr, BITS_V: tl.constexpr, GROUP: tl.constexpr,
    KEY_BLOCK: tl.constexpr, WINDOW: tl.constexpr, RECIPROCAL: tl.constexpr,
):
    """One decode step's store, for one (sequence, head) and one key group of the block (program axis 1): first
    KIVI's flush of what the previous step completed, then the step's token into the rows that flush freed.

    - keys: a residual full since the last step (t a multiple of KEY_BLOCK) is quantized, group g by program g
      (one program per group, not per block: the few sequences that fill a block would otherwise quantize it
      alone, after every other program ended); the step's key then goes to row t % KEY_BLOCK.
    - values: the value that left the window with the last step (position t - WINDOW - 1) is quantized from the
      row the step's value then takes, t % (WINDOW + 1); group 0's program does both.
    A program with nothing to flush only stores."""
    CPW_K: tl.constexpr = 32 // BITS_K
    CPW_V: tl.constexpr = 32 // BITS_V
    bh, g = tl.program_id(0), tl.program_id(1)
    b, h = bh // heads, bh % heads
    t = tl.load(pos_ptr + b)
    bh64 = bh.to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    if (t % KEY_BLOCK == 0) & (t > 0):
        first = t - KEY_BLOCK
        r = g * GROUP + tl.arange(0, GROUP)
        x = tl.load(kr_ptr + (bh64 * KEY_BLOCK + r[:, None]) * HEAD_DIM + d[None, :])
        words, scale, zero = _channel_words(x, ks_ptr.dtype.element_ty, BITS_K, RECIPROCAL)
        w_row = (first + g * GROUP) // CPW_K + tl.arange(0, GROUP // CPW_K)
        tl.store(kc_ptr + (bh64 * kc_rows + w_row[:, None]) * HEAD_DIM + d[None, :], words)
        s_off = (bh64 * (kc_rows * CPW_K // GROUP) + first // GROUP + g) * HEAD_DIM + d
        tl.store(ks_ptr + s_off, scale)
        tl.store(kz_ptr + s_off, zero)
        tl.debug_barrier()  # every thread has read the group before program 0 writes its row 0
    if g == (t % KEY_BLOCK) // GROUP:
        key = tl.load(k_ptr + b.to(tl.int64) * stride_kb + h * stride_kh + d * stride_kd)
        tl.store(kr_ptr + (bh64 * KEY_BLOCK + t % KEY_BLOCK) * HEAD_DIM + d, key)
    if g == 0:
        row = t % (WINDOW + 1)
        if t > WINDOW:
            i = t - WINDOW - 1
            x = tl.load(vr_ptr + (bh64 * (WINDOW + 1) + row) * HEAD_DIM + d)
            words, scale, zero = _token_words(tl.reshape(x, (1, HEAD_DIM)), vs_ptr.dtype.element_ty, BITS_V, GROUP,
                                              RECIPROCAL)
            w = tl.arange(0, HEAD_DIM // CPW_V)
            tl.store(vc_ptr + (bh64 * vc_rows + i) * (HEAD_DIM // CPW_V) + w, tl.reshape(words, (HEAD_DIM // CPW_V,)))
            gs = tl.arange(0, HEAD_DIM // GROUP)
            s_off = (bh64 * vc_rows + i) * (HEAD_DIM // GROUP) + gs
            tl.store(vs_ptr + s_off, tl.reshape(scale, (HEAD_DIM // GROUP,)))
            tl.store(vz_ptr + s_off, tl.reshape(zero, (HEAD_DIM // GROUP,)))
            tl.debug_barrier()  # the row is read before the step's value overwrites it
        value = tl.load(v_ptr + b.to(tl.int64) * stride_vb + h * stride_vh + d * stride_vd)
        tl.store(vr_ptr + (bh64 * (WINDOW + 1) + row) * HEAD_DIM + d, value)


def append_step(key: torch.Tensor, value: torch.Tensor, key_resid: torch.Tensor, value_ring: torch.Tensor,
                keys: Quantized, values: Quantized, positions: torch.Tensor, config: KiviConfig) -> None:
    """A decode step's key and value [B, H, D] stored at ``positions`` (int32 [B]) of every sequence, in one launch
    with KIVI's flush of what the step before completed (it frees the rows they take).

    Keys: the residual ``key_resid`` [B, H, KB, D] holds position i in row i % KB (KB = ``config.keys.block``);
    once full (the position a multiple of KB), its KB tokens are quantized per channel at rows of their positions.
    Values: the ring ``value_ring`` [B, H, R + 1, D] (R = ``config.values.window``) holds the window and the last
    step's token; the one that left the window (position - R - 1) is quantized per token. Every index is read on
    the device, so a CUDA graph can capture the call.
    """
    batch, heads, key_block, dim = key_resid.shape
    if (key_block, value_ring.shape[2]) != (config.keys.block, config.values.window + 1):
        raise ValueError(f"append_step: key residual and value ring need {config.keys.block} and "
                         f"{config.values.window + 1} rows for {config.name}, got {key_block} and {value_ring.shape[2]}")
    if key.shape != (batch, heads, dim) or value.shape != key.shape:
        raise ValueError(f"append_step: key and value must be [{batch}, {heads}, {dim}], got {tuple(key.shape)} and "
                         f"{tuple(value.shape)}")
    _append_kernel[(batch * heads, key_block // config.group_size)](
        key, value, key_resid, value_ring, keys.codes, keys.scale, keys.zero, values.codes, values.scale, values.zero,
        positions, heads, keys.codes.shape[2], values.codes.shape[2], *key.stride(), *value.stride(),
        HEAD_DIM=dim, BITS_K=config.k_bits, BITS_V=config.v_bits, GROUP=config.group_size, KEY_BLOCK=config.keys.block,
        WINDOW=config.values.window, RECIPROCAL=key_resid.device.type == "cuda",
        num_warps=2,  # the H200, 64 slots of Qwen2.5-1.5B: 3.8 us a launch, 6.6 at 4 warps (BENCHMARKS.md)
    )


def quantize_into(x: torch.Tensor, out: Quantized, bits: int, group_size: int, axis: str, block_t: int | None = None) -> Quantized:
    """Quantize x [B, H, T, D] into preallocated contiguous ``out`` buffers (shapes of ``kivi.quant.quantize``).

    ``block_t``: tokens per program (a power of two; for axis "channel" a multiple of ``group_size``).
    """
    batch, heads, tokens, dim = x.shape
    cpw, per_channel = codes_per_word(bits), axis == "channel"
    if bits not in (2, 4, 8) or axis not in ("channel", "token"):
        raise ValueError(f"quantize: bits must be 2, 4 or 8 and axis 'channel' or 'token'; got {bits}, {axis!r}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"quantize: x must be float16, bfloat16 or float32, got {x.dtype}")
    if group_size & (group_size - 1) or group_size % cpw:
        raise ValueError(f"quantize: group_size={group_size} must be a power of two and a multiple of {cpw}")
    if per_channel and tokens % group_size:
        raise ValueError(f"quantize: axis 'channel' needs T % group_size == 0, got T={tokens}, group_size={group_size}")
    if not per_channel and dim % group_size:
        raise ValueError(f"quantize: axis 'token' needs D % group_size == 0, got D={dim}, group_size={group_size}")
    code_shape, stat_shape = packed_shapes(tuple(x.shape), bits, group_size, axis)
    for name, buf, shape, dtype in (
        ("codes", out.codes, code_shape, torch.int32),
        ("scale", out.scale, stat_shape, x.dtype),
        ("zero", out.zero, stat_shape, x.dtype),
    ):
        if tuple(buf.shape) != shape or buf.dtype != dtype or not buf.is_contiguous() or buf.device != x.device:
            raise ValueError(f"quantize: {name} must be a contiguous {dtype} tensor of shape {shape} on {x.device}")
    block_d = triton.next_power_of_2(dim)
    if tokens == 0:
        return out
    common = dict(HEAD_DIM=dim, BITS=bits, GROUP=group_size, RECIPROCAL=x.device.type == "cuda", BLOCK_D=block_d)
    if per_channel:
        groups = block_t // group_size if block_t else max(1, 512 // block_d)  # 4 groups at D=128: fastest on the H200
        if groups & (groups - 1):
            raise ValueError(f"quantize: block_t={block_t} must be a power-of-two multiple of group_size={group_size}")
        grid = (triton.cdiv(tokens // group_size, groups), batch * heads)
        _quantize_channel_kernel[grid](x, out.codes, out.scale, out.zero, heads, tokens, *x.stride(), GROUPS=groups, **common)
    else:
        block_t = block_t or max(1, 8192 // block_d)  # 64 tokens at D=128: fastest on the H200
        grid = (triton.cdiv(tokens, block_t), batch * heads)
        _quantize_token_kernel[grid](x, out.codes, out.scale, out.zero, heads, tokens, *x.stride(), BLOCK_T=block_t, **common)
    return out


def quantize(x: torch.Tensor, bits: int, group_size: int, axis: str) -> Quantized:
    """``kivi.quant.quantize(x, bits, group_size, GROUP_DIM[axis])`` on the GPU: x [B, H, T, D] -> Quantized."""
    out = allocate(tuple(x.shape), bits, group_size, axis, x.dtype, x.device, fill=torch.empty)
    return quantize_into(x, out, bits, group_size, axis)
