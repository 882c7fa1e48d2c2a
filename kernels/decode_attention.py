"""Fused decode attention over a KIVI cache: one query token per sequence, every segment under one softmax.

Per sequence b and KV head, positions are: n_sink sinks, then keys [n_qk quantized | residual] and values
[n_qv quantized | residual] (keys flush in blocks of R, values keep a window of R, so the two split at
different positions). The kernel walks the positions after the sinks in tiles of BLOCK_N = 64 tokens: a tile
whose keys and values are all quantized takes the fast path (no masks); the few tiles around the splits and
in the residual mix sources per token. Split-KV (flash-decoding): programs (b, kv head, split) share the tiles
of a sequence; a second kernel merges their partial results.

Dequantization is folded into the tensor-core matmuls, so per cached element only the code is unpacked:
- keys (per-channel groups): q . k = (q * s_g) . c + q . z_g, so the key codes [tokens, D] meet the queries
  scaled per group, one block of columns per group in the tile; the zero term is a small fp32 reduction;
- values (per-token groups of G channels): the accumulator has one column per (query head, value channel
  group); column (m, g) is fed p_m * s_n,g, and only its group-g channels are kept at the end (block-diagonal
  readout). The VG = D / G columns of a head also fill the 16 columns a matmul needs, instead of padding.
The codes enter the matmuls as their left operand, transposed (MN-major); Triton 3.6 stages them through
shared memory (a register operand needs a loop-invariant right operand, and q * s, p * s change per tile),
which with the unpack dominates the instruction count (BENCHMARKS.md). Operands are fp16: codes are
exact; q * s, the queries and the probabilities of full-precision tokens are split into two fp16
parts (near-fp32; one part alone gives ~1e-3 relative error on keys with outlier channels); p * s is rounded
once (~1e-4). Full-precision keys and values must lie in the fp16 range (|x| < 65504), as real models' do.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels._triton import round_to, unpack_codes
from kivi.quant import codes_per_word

LOG2E = math.log2(math.e)
MIN_DOT = 16  # tl.dot needs every dimension >= 16
# (num_warps, num_stages) per head_dim, the launches checked on an H200 with Triton 3.6. Others are not
# safe there: head_dim 64 with 4 warps returns wrong values, and 1 or 3 stages (or 8 warps, 1 stage at
# head_dim 128) fault, while the interpreter agrees with the oracle in every case (see BENCHMARKS.md).
LAUNCH = {64: (8, 2), 128: (4, 2)}
BLOCK_N = tl.constexpr(64)  # tokens per tile: the M of one Hopper wgmma


@triton.jit
def _split16(x):
    """fp32 [D, C] -> fp16 [D, 2 * C]: a hi block of columns and a lo block, hi + lo = x to ~2^-22.

    Both parts go in one matmul operand; ``_sum_halves`` of the product adds them.
    """
    hi = x.to(tl.float16)
    lo = (x - hi.to(tl.float32)).to(tl.float16)
    both = tl.where((tl.arange(0, 2) == 0)[None, :, None], hi[:, None, :], lo[:, None, :])  # [D, 2, C]
    return tl.reshape(both, (x.shape[0], 2 * x.shape[1]))


@triton.jit
def _sum_halves(x):
    """[N, 2 * C] -> [N, C]: add the hi and lo blocks of a product with a ``_split16`` operand."""
    return tl.sum(tl.reshape(x, (x.shape[0], 2, x.shape[1] // 2)), axis=1)


@triton.jit
def _per_value_group(x, VG: tl.constexpr):
    """[N, HGP] -> [N, HGP * VG]: column (m, g) repeats column m (the value-side column layout)."""
    return tl.reshape(tl.broadcast_to(x[:, :, None], (x.shape[0], x.shape[1], VG)), (x.shape[0], x.shape[1] * VG))


@triton.jit
def _quant_key_logits(q_k, mask_k, kc_ptr, ks_ptr, kz_ptr, i0, limit,
                      HEAD_DIM: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, MASKED: tl.constexpr):
    """Logits [BLOCK_N, HGP] of quantized keys i0 .. i0 + BLOCK_N (those < ``limit`` when MASKED), for the
    scaled queries q_k [D, HGP] (fp32, one column per query head)."""
    CPW: tl.constexpr = 32 // BITS
    TG: tl.constexpr = (BLOCK_N + GROUP - 1) // GROUP  # key groups in a tile
    HGP: tl.constexpr = q_k.shape[1]
    d = tl.arange(0, HEAD_DIM)
    word_rows = i0 // CPW + tl.arange(0, BLOCK_N // CPW)
    groups = i0 // GROUP + tl.arange(0, TG)
    words_ptr = kc_ptr + word_rows[None, :] * HEAD_DIM + d[:, None]  # [D, BLOCK_N // CPW]
    stat_off = groups[None, :] * HEAD_DIM + d[:, None]  # [D, TG]
    if MASKED:
        words = tl.load(words_ptr, mask=(word_rows * CPW < limit)[None, :], other=0)
        scale = tl.load(ks_ptr + stat_off, mask=(groups * GROUP < limit)[None, :], other=0.0)
        zero = tl.load(kz_ptr + stat_off, mask=(groups * GROUP < limit)[None, :], other=0.0)
    else:
        words = tl.load(words_ptr)
        scale = tl.load(ks_ptr + stat_off)
        zero = tl.load(kz_ptr + stat_off)
    codes_t = unpack_codes(words, mask_k, BITS).to(tl.float16)  # [D, BLOCK_N], token i0 + n
    qs = tl.reshape(q_k[:, None, :] * scale.to(tl.float32)[:, :, None], (HEAD_DIM, TG * HGP))  # column (t, m)
    logits = _sum_halves(tl.dot(tl.trans(codes_t), _split16(qs)))  # [BLOCK_N, TG * HGP]
    qz = tl.sum(zero.to(tl.float32)[:, :, None] * q_k[:, None, :], axis=0)  # [TG, HGP]
    logits = tl.reshape(logits, (BLOCK_N, TG, HGP)) + qz[None, :, :]
    own = (tl.arange(0, BLOCK_N) // GROUP)[:, None, None] == tl.arange(0, TG)[None, :, None]
    return tl.sum(tl.where(own, logits, 0.0), axis=1)  # each token keeps its group's block


@triton.jit
def _full_key_logits(q_full, k_ptr, rows, valid, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr):
    """Logits [BLOCK_N, HGP] of full-precision keys at ``rows`` of a [*, D] buffer (0 where not ``valid``).

    q_full: ``_split16`` of the scaled queries in the quantized path's columns (t, m), zero for t > 0, so
    that the matmul keeps a legal width of >= 16 columns.
    """
    TG: tl.constexpr = (BLOCK_N + GROUP - 1) // GROUP
    d = tl.arange(0, HEAD_DIM)
    k = tl.load(k_ptr + rows[:, None] * HEAD_DIM + d[None, :], mask=valid[:, None], other=0.0)
    logits = _sum_halves(tl.dot(k.to(tl.float16), q_full))  # [BLOCK_N, TG * HGP]
    return tl.sum(tl.reshape(logits, (BLOCK_N, TG, logits.shape[1] // TG)), axis=1)


@triton.jit
def _quant_value_update(acc_t, accz, p_v, mask_v, vc_ptr, vs_ptr, vz_ptr, rows, valid,
                        HEAD_DIM: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, MASKED: tl.constexpr):
    """acc_t [D, ROWS] += codes^T @ (p_v * s), accz [BLOCK_N, ROWS] += p_v * z, for quantized values at ``rows``.

    p_v [BLOCK_N, ROWS = HGP * VG]: probabilities in the value-side columns (m, g), 0 where not ``valid`` (used
    only when MASKED). accz is summed over tokens at the end.
    """
    CPW: tl.constexpr = 32 // BITS
    VG: tl.constexpr = HEAD_DIM // GROUP
    words_ptr = vc_ptr + rows[:, None] * (HEAD_DIM // CPW) + tl.arange(0, HEAD_DIM // CPW)[None, :]
    stat_off = rows[:, None] * VG + (tl.arange(0, p_v.shape[1]) % VG)[None, :]  # column (m, g) reads group g
    if MASKED:
        words = tl.load(words_ptr, mask=valid[:, None], other=0)
        scale = tl.load(vs_ptr + stat_off, mask=valid[:, None], other=0.0)
        zero = tl.load(vz_ptr + stat_off, mask=valid[:, None], other=0.0)
    else:
        words = tl.load(words_ptr)  # [BLOCK_N, D // CPW]
        scale = tl.load(vs_ptr + stat_off)
        zero = tl.load(vz_ptr + stat_off)
    codes = unpack_codes(words, mask_v, BITS).to(tl.float16)  # [BLOCK_N, D]
    acc_t = tl.dot(tl.trans(codes), (p_v * scale.to(tl.float32)).to(tl.float16), acc_t)
    return acc_t, accz + p_v * zero.to(tl.float32)


@triton.jit
def _full_value_update(acc_t, p_v, v_ptr, rows, valid, HEAD_DIM: tl.constexpr):
    """acc_t [D, ROWS] += v^T @ p_v for full-precision values at ``rows`` (p_v must be 0 where not ``valid``)."""
    d = tl.arange(0, HEAD_DIM)
    v = tl.load(v_ptr + rows[:, None] * HEAD_DIM + d[None, :], mask=valid[:, None], other=0.0)
    return acc_t + _sum_halves(tl.dot(tl.trans(v.to(tl.float16)), _split16(p_v)))


@triton.jit
def _softmax_step(logits, m_i):
    """Online softmax (base 2) over a tile's tokens (axis 0): probabilities, new max, rescale factor."""
    m_new = tl.maximum(m_i, tl.max(logits, axis=0))
    return tl.exp2(logits - m_new[None, :]), m_new, tl.exp2(m_i - m_new)


@triton.jit
def _decode_kernel(
    q_ptr,  # [B, Hq, D] (query with q_len squeezed), strides stride_qb, stride_qh, 1
    out_ptr,  # NUM_SPLITS == 1: final [B, Hq, D] (strides stride_ob, stride_oh, 1); else fp32 partials [B, Hq, NUM_SPLITS, D]
    lse_ptr,  # fp32 [B, Hq, NUM_SPLITS] log2-sum-exp2 of each split (unused when NUM_SPLITS == 1)
    k_sink_ptr, v_sink_ptr,  # [B, Hkv, sink_rows, D]
    kc_ptr, ks_ptr, kz_ptr,  # keys: codes [B, Hkv, kc_rows, D] int32, scale/zero [B, Hkv, ks_rows, D]
    kr_ptr,  # key residual [B, Hkv, kr_rows, D]
    vc_ptr, vs_ptr, vz_ptr,  # values: codes [B, Hkv, vc_rows, D // cpw] int32, scale/zero [B, Hkv, vc_rows, D // G]
    vr_ptr,  # value residual [B, Hkv, vr_rows, D]
    counts_ptr,  # int32 [4, B]: sinks, quantized keys, quantized values, tokens after the sinks
    batch, kv_heads, qk_scale,
    mask_k, mask_v,  # 2^bits - 1 of keys and values, at run time (see unpack_codes)
    stride_qb, stride_qh, stride_ob, stride_oh,
    sink_rows, kc_rows, ks_rows, kr_rows, vc_rows, vr_rows,
    HG: tl.constexpr,  # query heads per KV head
    HGP: tl.constexpr,  # HG padded (see _padded_heads)
    HEAD_DIM: tl.constexpr, BITS_K: tl.constexpr, BITS_V: tl.constexpr, GROUP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    VG: tl.constexpr = HEAD_DIM // GROUP
    TG: tl.constexpr = (BLOCK_N + GROUP - 1) // GROUP
    bh, split = tl.program_id(0), tl.program_id(1)
    b, h = bh // kv_heads, bh % kv_heads
    n_sink = tl.load(counts_ptr + b)
    n_qk = tl.load(counts_ptr + batch + b)
    n_qv = tl.load(counts_ptr + 2 * batch + b)
    n_tok = tl.load(counts_ptr + 3 * batch + b)
    bh64 = bh.to(tl.int64)
    k_sink_ptr += bh64 * sink_rows * HEAD_DIM
    v_sink_ptr += bh64 * sink_rows * HEAD_DIM
    kc_ptr += bh64 * kc_rows * HEAD_DIM
    ks_ptr += bh64 * ks_rows * HEAD_DIM
    kz_ptr += bh64 * ks_rows * HEAD_DIM
    kr_ptr += bh64 * kr_rows * HEAD_DIM
    vc_ptr += bh64 * vc_rows * (HEAD_DIM // (32 // BITS_V))
    vs_ptr += bh64 * vc_rows * VG
    vz_ptr += bh64 * vc_rows * VG
    vr_ptr += bh64 * vr_rows * HEAD_DIM

    # Queries as columns: q_k [D, HGP], one per query head of this KV head (padding heads are 0).
    d = tl.arange(0, HEAD_DIM)
    m = tl.arange(0, HGP)
    q_off = b.to(tl.int64) * stride_qb + (h * HG + m)[None, :] * stride_qh + d[:, None]
    q_k = tl.load(q_ptr + q_off, mask=(m < HG)[None, :], other=0.0).to(tl.float32) * qk_scale
    first_block = (tl.arange(0, TG) == 0)[None, :, None]
    q_full = _split16(tl.reshape(tl.where(first_block, q_k[:, None, :], 0.0), (HEAD_DIM, TG * HGP)))
    m_i = tl.full([HGP], float("-inf"), tl.float32)
    l_acc = tl.zeros([BLOCK_N, HGP], tl.float32)  # softmax sums per token slot, summed at the end
    accz = tl.zeros([BLOCK_N, HGP * VG], tl.float32)  # value zero terms per token slot, likewise
    acc_t = tl.zeros([HEAD_DIM, HGP * VG], tl.float32)
    n = tl.arange(0, BLOCK_N)

    # Tiles of the positions after the sinks, shared out evenly among the splits.
    fast_tiles = tl.minimum(n_qk, n_qv) // BLOCK_N  # keys and values all quantized
    tiles = tl.cdiv(n_tok, BLOCK_N)
    per_split = tl.cdiv(tiles, NUM_SPLITS)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, tiles)
    for t in range(lo, tl.minimum(hi, fast_tiles)):
        i = t * BLOCK_N + n
        logits = _quant_key_logits(q_k, mask_k, kc_ptr, ks_ptr, kz_ptr, t * BLOCK_N, n_qk, HEAD_DIM, BITS_K, GROUP, False)
        p, m_i, alpha = _softmax_step(logits, m_i)
        l_acc = l_acc * alpha[None, :] + p
        alpha_v = _per_value_group(alpha[None, :], VG)
        acc_t, accz = _quant_value_update(acc_t * alpha_v, accz * alpha_v, _per_value_group(p, VG), mask_v, vc_ptr,
                                          vs_ptr, vz_ptr, i, i < n_qv, HEAD_DIM, BITS_V, GROUP, False)
    for t in range(tl.maximum(lo, fast_tiles), hi):
        i = t * BLOCK_N + n
        logits = tl.where((i < n_qk)[:, None],
                          _quant_key_logits(q_k, mask_k, kc_ptr, ks_ptr, kz_ptr, t * BLOCK_N, n_qk, HEAD_DIM, BITS_K, GROUP, True),
                          _full_key_logits(q_full, kr_ptr, i - n_qk, (i >= n_qk) & (i < n_tok), HEAD_DIM, GROUP))
        p, m_i, alpha = _softmax_step(tl.where((i < n_tok)[:, None], logits, float("-inf")), m_i)
        l_acc = l_acc * alpha[None, :] + p
        alpha_v = _per_value_group(alpha[None, :], VG)
        p_v = _per_value_group(p, VG)
        quant_v = (i < n_qv)[:, None]
        acc_t, accz = _quant_value_update(acc_t * alpha_v, accz * alpha_v, tl.where(quant_v, p_v, 0.0), mask_v, vc_ptr,
                                          vs_ptr, vz_ptr, i, i < n_qv, HEAD_DIM, BITS_V, GROUP, True)
        acc_t = _full_value_update(acc_t, tl.where(quant_v, 0.0, p_v), vr_ptr, i - n_qv, (i >= n_qv) & (i < n_tok), HEAD_DIM)
    if split == 0:
        for t in range(0, tl.cdiv(n_sink, BLOCK_N)):
            i = t * BLOCK_N + n
            logits = _full_key_logits(q_full, k_sink_ptr, i, i < n_sink, HEAD_DIM, GROUP)
            p, m_i, alpha = _softmax_step(tl.where((i < n_sink)[:, None], logits, float("-inf")), m_i)
            l_acc = l_acc * alpha[None, :] + p
            alpha_v = _per_value_group(alpha[None, :], VG)
            accz = accz * alpha_v
            acc_t = _full_value_update(acc_t * alpha_v, _per_value_group(p, VG), v_sink_ptr, i, i < n_sink, HEAD_DIM)

    # Block-diagonal readout: channel d of head m lives in column (m, d // G); the zero terms likewise.
    in_group = (d // GROUP)[:, None, None] == tl.arange(0, VG)[None, None, :]  # [D, 1, VG]
    zero_terms = tl.reshape(tl.sum(accz, axis=0), (1, HGP, VG))
    o_t = tl.sum(tl.where(in_group, tl.reshape(acc_t, (HEAD_DIM, HGP, VG)) + zero_terms, 0.0), axis=2)  # [D, HGP]
    l_h = tl.sum(l_acc, axis=0)
    hq = h * HG + m
    real = (m < HG)[None, :]
    if NUM_SPLITS == 1:
        o_off = b.to(tl.int64) * stride_ob + hq[None, :] * stride_oh + d[:, None]
        tl.store(out_ptr + o_off, round_to(o_t / l_h[None, :], out_ptr.dtype.element_ty), mask=real)
    else:
        seen = l_h > 0  # a split can own no tiles (short sequence): weight 0 in the merge
        l_h = tl.where(seen, l_h, 1.0)
        row = (b * (kv_heads * HG) + hq).to(tl.int64) * NUM_SPLITS + split
        tl.store(out_ptr + row[None, :] * HEAD_DIM + d[:, None], o_t / l_h[None, :], mask=real)
        tl.store(lse_ptr + row, tl.where(seen, m_i + tl.log2(l_h), float("-inf")), mask=m < HG)


@triton.jit
def _merge_kernel(part_ptr, lse_ptr, out_ptr, q_heads, stride_ob, stride_oh,
                  HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr):
    """out[b, h] = sum_s 2^(lse_s - max) * part_s / sum_s 2^(lse_s - max); part [B, Hq, S, D] fp32, lse [B, Hq, S]."""
    bh = tl.program_id(0)
    s = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_ptr + bh * NUM_SPLITS + s, mask=s < NUM_SPLITS, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))
    part = tl.load(part_ptr + (bh * NUM_SPLITS + s)[:, None] * HEAD_DIM + d[None, :], mask=(s < NUM_SPLITS)[:, None], other=0.0)
    o = tl.sum(w[:, None] * part, axis=0) / tl.sum(w, axis=0)
    off = (bh // q_heads).to(tl.int64) * stride_ob + (bh % q_heads) * stride_oh + d
    tl.store(out_ptr + off, round_to(o, out_ptr.dtype.element_ty))


def _padded_heads(head_dim: int, group_size: int, group_heads: int) -> int:
    """HGP: query heads per KV head padded to a power of two that gives every matmul >= 16 columns:
    HGP * D / G value columns and 2 * ceil(BLOCK_N / G) * HGP key columns."""
    key_blocks = 2 * triton.cdiv(BLOCK_N.value, group_size)
    return max(triton.next_power_of_2(group_heads), triton.cdiv(MIN_DOT, head_dim // group_size), triton.cdiv(MIN_DOT, key_blocks))


def default_num_splits(batch: int, kv_heads: int, max_tokens: int, device: torch.device, per_sm: int = 4) -> int:
    """Splits per sequence for about ``per_sm`` programs per multiprocessor, each with >= 4 tiles of the longest."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    wanted = triton.cdiv(per_sm * sms, batch * kv_heads)
    return max(1, min(wanted, max_tokens // (4 * BLOCK_N.value), 128))


def decode_attention_tensors(
    query: torch.Tensor,  # [B, Hq, 1, D]
    k_sink: torch.Tensor,  # [B, Hkv, S, D] model dtype
    k_codes: torch.Tensor,  # [B, Hkv, Tk // cpw_k, D] int32 (keys grouped along tokens)
    k_scale: torch.Tensor,  # [B, Hkv, Tk // G, D]
    k_zero: torch.Tensor,
    k_resid: torch.Tensor,  # [B, Hkv, Rk, D]
    v_sink: torch.Tensor,  # [B, Hkv, S, D]
    v_codes: torch.Tensor,  # [B, Hkv, Tv, D // cpw_v] int32 (values grouped along channels)
    v_scale: torch.Tensor,  # [B, Hkv, Tv, D // G]
    v_zero: torch.Tensor,
    v_resid: torch.Tensor,  # [B, Hkv, Rv, D]
    counts: torch.Tensor,  # int32 [4, B] on the device: n_sink, n_quant keys, n_quant values, tokens after the sinks
    k_bits: int,
    v_bits: int,
    group_size: int,
    scaling: float,
    num_splits: int,
    out: torch.Tensor | None = None,  # [B, Hq, 1, D], any float dtype (tests pass float32 to see unrounded results)
    launch: tuple[int, int] | None = None,  # (num_warps, num_stages); default LAUNCH[head_dim]
) -> torch.Tensor:
    """Decode attention over KIVI buffers laid out as ``kivi.stream.KVStream`` holds them. Returns ``out``.

    Per sequence, n_quant keys must be a multiple of ``group_size`` (KVStream flushes keys in whole groups).
    """
    batch, q_heads, q_len, dim = query.shape
    kv_heads = k_resid.shape[1]
    dtype = k_resid.dtype
    if q_len != 1 or q_heads % kv_heads:
        raise ValueError(f"decode_attention: query must be [B, Hq, 1, D] with Hq % Hkv == 0, got {tuple(query.shape)}, Hkv={kv_heads}")
    if dim not in LAUNCH or group_size & (group_size - 1) or group_size < MIN_DOT or dim % group_size:
        raise ValueError(f"decode_attention: head_dim={dim} must be one of {sorted(LAUNCH)} and group_size={group_size} "
                         "a power of two >= 16 dividing it")
    if k_bits not in (2, 4, 8) or v_bits not in (2, 4, 8):
        raise ValueError(f"decode_attention: k_bits and v_bits must be 2, 4 or 8, got {k_bits}, {v_bits}")
    cpw_k, cpw_v, vg = codes_per_word(k_bits), codes_per_word(v_bits), dim // group_size
    expected = {
        "k_sink": (k_sink, (batch, kv_heads, k_sink.shape[2], dim), dtype),
        "v_sink": (v_sink, (batch, kv_heads, k_sink.shape[2], dim), dtype),
        "k_codes": (k_codes, (batch, kv_heads, k_scale.shape[2] * group_size // cpw_k, dim), torch.int32),
        "k_scale": (k_scale, (batch, kv_heads, k_scale.shape[2], dim), dtype),
        "k_zero": (k_zero, (batch, kv_heads, k_scale.shape[2], dim), dtype),
        "k_resid": (k_resid, (batch, kv_heads, k_resid.shape[2], dim), dtype),
        "v_codes": (v_codes, (batch, kv_heads, v_codes.shape[2], dim // cpw_v), torch.int32),
        "v_scale": (v_scale, (batch, kv_heads, v_codes.shape[2], vg), dtype),
        "v_zero": (v_zero, (batch, kv_heads, v_codes.shape[2], vg), dtype),
        "v_resid": (v_resid, (batch, kv_heads, v_resid.shape[2], dim), dtype),
        "counts": (counts, (4, batch), torch.int32),
    }
    for name, (t, shape, want) in expected.items():
        if tuple(t.shape) != shape or t.dtype != want or not t.is_contiguous() or t.device != query.device:
            raise ValueError(f"decode_attention: {name} must be a contiguous {want} tensor of shape {shape} on "
                             f"{query.device}, got {t.dtype} {tuple(t.shape)} contiguous={t.is_contiguous()} on {t.device}")
    if query.stride(-1) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty_like(query)
    if tuple(out.shape) != tuple(query.shape) or out.stride(-1) != 1:
        raise ValueError(f"decode_attention: out must be {tuple(query.shape)} with unit stride along D")
    if num_splits == 1:
        target, lse = out, out  # lse is unused on this path
    else:
        target = torch.empty(batch, q_heads, num_splits, dim, dtype=torch.float32, device=query.device)
        lse = torch.empty(batch, q_heads, num_splits, dtype=torch.float32, device=query.device)
    num_warps, num_stages = launch or LAUNCH[dim]
    group_heads = q_heads // kv_heads
    _decode_kernel[(batch * kv_heads, num_splits)](
        query, target, lse, k_sink, v_sink, k_codes, k_scale, k_zero, k_resid, v_codes, v_scale, v_zero, v_resid, counts,
        batch, kv_heads, scaling * LOG2E, (1 << k_bits) - 1, (1 << v_bits) - 1,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_sink.shape[2], k_codes.shape[2], k_scale.shape[2], k_resid.shape[2], v_codes.shape[2], v_resid.shape[2],
        HG=group_heads, HGP=_padded_heads(dim, group_size, group_heads), HEAD_DIM=dim, BITS_K=k_bits, BITS_V=v_bits,
        GROUP=group_size, NUM_SPLITS=num_splits, num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _merge_kernel[(batch * q_heads,)](
            target, lse, out, q_heads, out.stride(0), out.stride(1),
            HEAD_DIM=dim, NUM_SPLITS=num_splits, SPLITS_P2=triton.next_power_of_2(num_splits),
        )
    return out


def unsupported(query: torch.Tensor, key_stream, value_stream) -> str | None:
    """Why the fused kernel cannot serve this layer's streams (None when it can)."""
    if query.shape[2] != 1:
        return f"q_len={query.shape[2]} (decode only)"
    if key_stream.axis != "channel" or value_stream.axis != "token":
        return "needs keys grouped along tokens (axis 'channel') and values along channels (axis 'token')"
    if not (key_stream.quantizes and value_stream.quantizes):
        return "both streams must be quantized (2, 4 or 8 bits)"
    g, dim = key_stream.group_size, query.shape[-1]
    if dim not in LAUNCH:
        return f"head_dim={dim}: launches are validated for head_dim {sorted(LAUNCH)}"
    if value_stream.group_size != g or g & (g - 1) or dim % g or g < MIN_DOT:
        return f"group_size={g} must be a power of two >= 16 dividing head_dim={dim}"
    return None


def decode_attention(query: torch.Tensor, key_stream, value_stream, scaling: float, num_splits: int | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of query [B, Hq, 1, D] over everything the two ``KVStream``s hold. Returns [B, Hq, 1, D]."""
    reason = unsupported(query, key_stream, value_stream)
    if reason:
        raise ValueError(f"decode_attention: {reason}")
    if key_stream.n_sink != value_stream.n_sink or key_stream.lengths != value_stream.lengths:
        raise ValueError("decode_attention: key and value streams hold different token counts")
    g = key_stream.group_size
    if any(n % g for n in key_stream.n_quant):
        raise ValueError(f"decode_attention: quantized key counts {key_stream.n_quant} must be multiples of group_size={g}")
    after_sink = [q + r for q, r in zip(key_stream.n_quant, key_stream.n_resid)]
    counts = torch.tensor([key_stream.n_sink, key_stream.n_quant, value_stream.n_quant, after_sink], dtype=torch.int32)
    batch, kv_heads = key_stream.resid.shape[:2]
    if num_splits is None:
        num_splits = default_num_splits(batch, kv_heads, max(after_sink), query.device)
    kq, vq = key_stream.packed, value_stream.packed
    return decode_attention_tensors(
        query, key_stream.sink, kq.codes, kq.scale, kq.zero, key_stream.resid,
        value_stream.sink, vq.codes, vq.scale, vq.zero, value_stream.resid, counts.to(query.device),
        key_stream.bits, value_stream.bits, g, scaling, num_splits, out,
    )
