"""Fused decode attention over a KIVI cache: one query token per sequence, every segment under one softmax.

Per sequence b and KV head, positions are: n_sink sinks, then keys [n_qk quantized | residual] and values
[n_qv quantized | residual] (keys flush in blocks of R, values keep a window of R, so the two split at
different positions). Split-KV (flash-decoding): one-warp programs (b, kv head, split) share the fast tiles
of a sequence; a second kernel merges their partial results.

Fast tiles (every key and value quantized) hold ROWS key words per channel, i.e. ROWS * cpw tokens. Codes
are the tensor-core *left* operand, two code slices at a time: codes j and j + cpw/2 of each word fill rows r
and r + 8 of an mma tile, which one thread holds, so the unpacked pairs are the operand registers themselves
(a pure elementwise chain from the load, which Triton hoists into the operand layout: no shared-memory round
trip, no register copies). Keys: rows (slice, word row) = tokens, columns = channels; values: rows (slice,
word) = channels, columns = tokens, in the order the key logits come out (so p needs no reshuffle; the value
loads follow that order). Scales fold into the right operand:
- keys (per-channel groups): q . k = (q * s_g) . c + q . z_g; the right operand has one block of columns per
  key group of the tile (a hi and a lo fp16 part of q * s_g, near-fp32), each token keeps its group's
  block; the zero term is a small fp32 reduction;
- values (per-token groups of G channels): the right operand, p * s, has columns (query head, value group);
  each channel keeps its group's column when the accumulators are folded at the end.
A tile's value words are loaded once, before its keys are computed, so that they are in flight meanwhile.
One PTX sequence unpacks two codes into an exact fp16 pair (PRMT, LOP3 into the mantissa of 1024, HSUB2); a
code is taken where it lies in its 16-bit half (code * 2**lift, exact) and only the codes above bit 10 need a
shift, one per word; the power of two is undone on the fp32 results. Triton's interpreter cannot run PTX, so
on the CPU the same values come from shifts and masks (``GPU`` off); `python -m tools.kernel_check` covers the PTX
path on the GPU.

The tail (tokens after the last fast tile: residuals, partly quantized tiles) is walked in blocks of
TAIL_BLOCK tokens dealt out among the splits, the sinks on the last split, with the same folding (codes as
exact 16-bit operands, scales in the other operand), residual keys and values as stored; on the GPU every
dot is two tensor-core dots (hi and lo 16-bit parts of the fp32 operand), in the interpreter one fp32 dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kivi.kernels._triton import LOG2E, log2_cap, merge_splits, soft_cap, split_count, split_targets, store_split
from kivi.kernels.buffers import check_decode_buffers
from kivi.config import KiviConfig
from kivi.quant import StreamBuffers, codes_per_word

HEAD_DIMS = (64, 128, 256)  # head sizes checked on the GPU
TAIL_BLOCK = tl.constexpr(16)  # tokens per tail block: divides every group size (>= 16), so one key group per block


def code_lift(bits: int, j: int) -> int:
    """Where code j lands after unpacking: code * 2**lift. A code that ends at or below bit 10 of its 16-bit half is
    taken where it lies (the mantissa of 1024 holds it exactly, no shift); the others after one shift of the word,
    shared by the codes above bit 10."""
    p = bits * (j % (16 // bits))
    return p if p + bits <= 10 else p - (10 // bits) * bits


def unpack_fields(bits: int, j: int) -> tuple[bool, int, int]:
    """How the PTX unpack reaches code j of a pair of words: (take the high 16-bit halves, right shift of the
    paired halves, mask of the code in each half)."""
    lift = code_lift(bits, j)
    return bits * j >= 16, (bits * j) % 16 - lift, (((1 << bits) - 1) << lift) * 0x10001


def _unpack_asm(bits: int, j: int) -> str:
    """PTX: the fp16 pair (code j of $1, code j of $2) * 2**lift, exact. Codes sit in bits [bits*j, bits*(j+1))."""
    high, shift, mask = unpack_fields(bits, j)
    shr = f"shr.b32 t, t, {shift}; " if shift else ""
    return ("{ .reg .b32 t, c; mov.b32 c, 0x64006400; "
            f"prmt.b32 t, $1, $2, {0x7632 if high else 0x5410}; {shr}"
            f"lop3.b32 t, t, {mask}, 0x64006400, 0xea; sub.f16x2 $0, t, c; }}")


def _by_width(value, kind=lambda v: v) -> tl.constexpr:
    """A kernel-side table of kind(value(bits, j)), indexed [bits][code slot j] for 2, 4 and 8 bits."""
    return tl.constexpr(tuple(tuple(kind(value(bits, j)) for j in range(32 // bits)) if bits in (2, 4, 8) else ()
                              for bits in range(9)))


UNPACK = _by_width(_unpack_asm, tl.constexpr)  # strings inside a kernel tuple need a type: constexpr
LIFT = _by_width(code_lift)


@triton.jit
def _code_slice(words, J: tl.constexpr, BITS: tl.constexpr, GPU: tl.constexpr):
    """Code J of every int32 word times 2**lift (``code_lift``), as exact fp16."""
    if GPU:
        return tl.inline_asm_elementwise(UNPACK[BITS][J], "=r,r,r", [words], dtype=tl.float16, is_pure=True, pack=2)
    else:
        return ((words >> (BITS * J - LIFT[BITS][J])) & (((1 << BITS) - 1) << LIFT[BITS][J])).to(tl.float16)


@triton.jit
def _hi_lo(x, DTYPE: tl.constexpr):
    """fp32 x as two DTYPE (16-bit) parts, hi + lo = x to ~2^-22 (fp16) or ~2^-16 (bf16)."""
    hi = x.to(DTYPE)
    return hi, (x - hi.to(tl.float32)).to(DTYPE)


@triton.jit
def _code_rows(words, J: tl.constexpr, BITS: tl.constexpr, GPU: tl.constexpr):
    """words [N, K] -> fp16 [2 * N, K]: codes J (rows 0 .. N) and J + cpw / 2 (rows N .. 2N) of each word, the rows a
    tensor-core A operand holds in one thread (row r and r + 8 of an mma tile), so no register is copied."""
    HALF: tl.constexpr = 16 // BITS
    both = tl.join(_code_slice(words, J, BITS, GPU), _code_slice(words, J + HALF, BITS, GPU))  # [N, K, 2]
    return tl.reshape(tl.permute(both, (2, 0, 1)), (2 * words.shape[0], words.shape[1]))


@triton.jit
def _fast_tile(q, accs, accz, m_i, l_i, t, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr, cap,
               HEAD_DIM: tl.constexpr, BITS_K: tl.constexpr, BITS_V: tl.constexpr, GROUP: tl.constexpr,
               ROWS: tl.constexpr, GPU: tl.constexpr, SOFTCAP: tl.constexpr):
    """One fast tile: keys and values of tokens t * TILE .. (t + 1) * TILE (TILE = ROWS * cpw_k), all quantized.

    q [D, HP] fp32 (scaled, log2 units); accs: per value code pair i (codes i and i + cpw_v / 2 of each word),
    [2 * VW, HP * VG] fp32 (rows (code, word), columns (head, value group)); accz [HP, VG]: the value zero terms.
    """
    CPW_K: tl.constexpr = 32 // BITS_K
    CPW_V: tl.constexpr = 32 // BITS_V
    TILE: tl.constexpr = ROWS * CPW_K
    TG: tl.constexpr = TILE // GROUP  # key groups in the tile
    VG: tl.constexpr = HEAD_DIM // GROUP
    VW: tl.constexpr = HEAD_DIM // CPW_V
    HP: tl.constexpr = q.shape[1]
    d = tl.arange(0, HEAD_DIM)
    r = tl.arange(0, ROWS)
    rows = t * ROWS + r
    groups = t * TG + tl.arange(0, TG)

    # Token order within the tile: k = (s * ROWS + row) * PAIRS + j holds token row * cpw + s * PAIRS + j, the order
    # in which the key pairs leave the tensor cores, so the values need it too (and no reshuffle of the logits).
    PAIRS: tl.constexpr = CPW_K // 2
    k = tl.arange(0, TILE)
    tok = t * TILE + (k // PAIRS % ROWS) * CPW_K + k // (PAIRS * ROWS) * PAIRS + k % PAIRS

    # Values first, in one load per tile: in flight while the keys are computed.
    vwords = tl.load(vc_ptr + tok[None, :] * VW + tl.arange(0, VW)[:, None])  # [VW, TILE]
    gv = tl.arange(0, VG)
    vscale = tl.load(vs_ptr + tok[:, None] * VG + gv[None, :]).to(tl.float32)  # [TILE, VG]
    vzero = tl.load(vz_ptr + tok[:, None] * VG + gv[None, :]).to(tl.float32)

    # Keys: words [ROWS, D], right operand q * s per (group, head, hi/lo), zero terms per (row, head).
    words = tl.load(kc_ptr + rows[:, None] * HEAD_DIM + d[None, :])
    scale = tl.load(ks_ptr + groups[None, :] * HEAD_DIM + d[:, None]).to(tl.float32)  # [D, TG]
    zero = tl.load(kz_ptr + groups[None, :] * HEAD_DIM + d[:, None]).to(tl.float32)
    hi, lo = _hi_lo(scale[:, :, None] * q[:, None, :], tl.float16)  # [D, TG, HP]
    qs = tl.reshape(tl.join(hi, lo), (HEAD_DIM, TG * HP * 2))  # columns (group, head, hi/lo)
    own = (r // (GROUP // CPW_K))[:, None] == tl.arange(0, TG)[None, :]  # [ROWS, TG]: a word row's group
    qz = tl.sum(zero[:, :, None] * q[:, None, :], axis=0)  # [TG, HP]
    qz = tl.sum(tl.where(own[:, :, None], qz[None, :, :], 0.0), axis=1)  # [ROWS, HP]
    parts = ()
    for j in tl.static_range(PAIRS):
        s = tl.reshape(tl.dot(_code_rows(words, j, BITS_K, GPU), qs), (2, ROWS, TG, HP, 2))
        s = tl.sum(tl.sum(tl.where(own[None, :, :, None, None], s, 0.0), axis=4), axis=2)  # [2, ROWS, HP]
        parts = parts + (s * (1.0 / (1 << LIFT[BITS_K][j])) + qz[None, :, :],)
    logits = soft_cap(tl.reshape(tl.permute(_stack(parts), (0, 1, 3, 2)), (TILE, HP)), cap, SOFTCAP)

    m_new = tl.maximum(m_i, tl.max(logits, axis=0))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(logits - m_new[None, :])  # [TILE, HP]
    l_i = l_i * alpha + tl.sum(p, axis=0)
    accz = accz * alpha[:, None] + tl.sum(p[:, :, None] * vzero[:, None, :], axis=0)
    ps = tl.reshape(p[:, :, None] * vscale[:, None, :], (TILE, HP * VG)).to(tl.float16)
    alpha_cols = tl.reshape(tl.broadcast_to(alpha[:, None], (HP, VG)), (HP * VG,))
    updated = ()
    for i in tl.static_range(CPW_V // 2):
        updated = updated + (tl.dot(_code_rows(vwords, i, BITS_V, GPU), ps, accs[i] * alpha_cols[None, :]),)
    return updated, accz, m_new, l_i


@triton.jit
def _stack(parts):
    """A tuple of 2**n tensors [...] -> [..., 2**n], parts[j] at [..., j] (a tree of joins: no data moves)."""
    level = parts
    for _ in tl.static_range(len(parts).bit_length() - 1):
        joined = ()
        for i in tl.static_range(len(level) // 2):  # a join's new dimension is the last: pair the high bit first
            joined = joined + (tl.join(level[i], level[i + len(level) // 2]),)
        level = joined
    x = level[0]
    return tl.reshape(x, parts[0].shape + (len(parts),))


@triton.jit
def _fold(accs, accz, HEAD_DIM: tl.constexpr, BITS_V: tl.constexpr, GROUP: tl.constexpr):
    """Fast-tile accumulators -> [HP, D]: channel c = w * cpw + s * cpw/2 + i (row (s, w) of pair i) keeps the
    column (head, c // G)."""
    CPW_V: tl.constexpr = 32 // BITS_V
    VG: tl.constexpr = HEAD_DIM // GROUP
    VW: tl.constexpr = HEAD_DIM // CPW_V
    HP: tl.constexpr = accz.shape[0]
    w = tl.arange(0, VW)
    parts = ()
    for i in tl.static_range(CPW_V // 2):
        code = tl.arange(0, 2)[:, None] * (CPW_V // 2) + i  # [2, 1]
        own = tl.arange(0, VG)[None, None, :] == ((w[None, :] * CPW_V + code) // GROUP)[:, :, None]  # [2, VW, VG]
        pair = tl.sum(tl.where(own[:, :, None, :], tl.reshape(accs[i], (2, VW, HP, VG)), 0.0), axis=3)  # [2, VW, HP]
        parts = parts + (pair * (1.0 / (1 << LIFT[BITS_V][i])),)
    acc = tl.reshape(tl.permute(_stack(parts), (2, 1, 0, 3)), (HP, HEAD_DIM))
    return acc + _group_broadcast(accz, GROUP)


@triton.jit
def _dot_split(a, b, acc, GPU: tl.constexpr):
    """acc + a @ b with a [M, K] fp32 and b [K, N] exact in its 16-bit dtype. On the GPU: two tensor-core dots,
    a's high and low 16-bit parts (near fp32); in the interpreter, which has no 16-bit dots, one fp32 dot."""
    if GPU:
        hi, lo = _hi_lo(a, b.dtype)
        return tl.dot(lo, b, tl.dot(hi, b, acc))
    else:
        return tl.dot(a, b.to(tl.float32), acc, input_precision="ieee")


@triton.jit
def _softmax_step(s, valid, m_i, l_i, cap, SOFTCAP: tl.constexpr):
    """Online softmax (base 2) over logits s [HP, N] (``valid`` columns only, soft-capped at ``cap`` with SOFTCAP):
    p, the rescale factor, m, l."""
    s = tl.where(valid[None, :], soft_cap(s, cap, SOFTCAP), float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _tail_block(q, acc, accq, accz, m_i, l_i, i0, n_qk, n_qv, n_tok,
                kc_ptr, ks_ptr, kz_ptr, kr_ptr, vc_ptr, vs_ptr, vz_ptr, vr_ptr, vr_rows, cap,
                HEAD_DIM: tl.constexpr, BITS_K: tl.constexpr, BITS_V: tl.constexpr, GROUP: tl.constexpr,
                V_RING: tl.constexpr, GPU: tl.constexpr, SOFTCAP: tl.constexpr):
    """Positions i0 .. i0 + TAIL_BLOCK (after the sinks), each key and value from its codes or its residual.

    Codes enter the dots as exact 16-bit numbers and their scales fold into the other operand, as in the fast
    tiles: q . k = (q * s) . c + q . z. A block lies in one key group and its keys are all quantized or all
    residual (n_qk is a multiple of G, G a multiple of TAIL_BLOCK); values switch at n_qv, anywhere. acc [HP, D]
    takes the residual values; accq [HP * VG, D] (rows (head, value group)) and accz [HP, VG] the quantized
    ones, folded by ``_fold_groups``. V_RING: the value residual is a ring, position i in row i % vr_rows.
    """
    CPW_K: tl.constexpr = 32 // BITS_K
    CPW_V: tl.constexpr = 32 // BITS_V
    VG: tl.constexpr = HEAD_DIM // GROUP
    HP: tl.constexpr = q.shape[0]
    if GPU:
        dt = kr_ptr.dtype.element_ty  # codes as exact 16-bit operands
    else:
        dt = tl.float32  # the interpreter's integer -> bf16 casts are wrong
    d = tl.arange(0, HEAD_DIM)
    i = i0 + tl.arange(0, TAIL_BLOCK)
    valid = i < n_tok
    zero_logits = tl.zeros([HP, TAIL_BLOCK], tl.float32)
    if i0 < n_qk:
        words = tl.load(kc_ptr + (i // CPW_K)[None, :] * HEAD_DIM + d[:, None])  # [D, N]
        codes = ((words >> (BITS_K * (i % CPW_K))[None, :]) & ((1 << BITS_K) - 1)).to(dt)
        stat = (i0 // GROUP) * HEAD_DIM + d
        scale = tl.load(ks_ptr + stat).to(tl.float32)
        zero = tl.load(kz_ptr + stat).to(tl.float32)
        s = _dot_split(q * scale[None, :], codes, zero_logits + tl.sum(q * zero[None, :], axis=1)[:, None], GPU)
    else:
        k = tl.load(kr_ptr + (i - n_qk)[None, :] * HEAD_DIM + d[:, None], mask=valid[None, :], other=0.0)  # [D, N]
        s = _dot_split(q, k, zero_logits, GPU)
    p, alpha, m_i, l_i = _softmax_step(s, valid, m_i, l_i, cap, SOFTCAP)

    acc = acc * alpha[:, None]
    accq = tl.reshape(tl.reshape(accq, (HP, VG, HEAD_DIM)) * alpha[:, None, None], (HP * VG, HEAD_DIM))
    accz = accz * alpha[:, None]
    quantized = i < n_qv
    if i0 < n_qv:
        words = tl.load(vc_ptr + i[:, None] * (HEAD_DIM // CPW_V) + (d // CPW_V)[None, :], mask=quantized[:, None], other=0)
        codes = ((words >> (BITS_V * (d % CPW_V))[None, :]) & ((1 << BITS_V) - 1)).to(dt)  # [N, D]
        stat = i[None, :] * VG + tl.arange(0, VG)[:, None]  # [VG, N]
        scale = tl.load(vs_ptr + stat, mask=quantized[None, :], other=0.0).to(tl.float32)
        zero = tl.load(vz_ptr + stat, mask=quantized[None, :], other=0.0).to(tl.float32)
        pq = tl.where(quantized[None, :], p, 0.0)
        accq = _dot_split(tl.reshape(pq[:, None, :] * scale[None, :, :], (HP * VG, TAIL_BLOCK)), codes, accq, GPU)
        accz += tl.sum(pq[:, None, :] * zero[None, :, :], axis=2)
    if i0 + TAIL_BLOCK > n_qv:
        if V_RING:
            row = i % vr_rows
        else:
            row = i - n_qv
        resid = tl.load(vr_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=(valid & ~quantized)[:, None], other=0.0)
        acc = _dot_split(tl.where(quantized[None, :], 0.0, p), resid, acc, GPU)
    return acc, accq, accz, m_i, l_i


@triton.jit
def _fold_groups(accq, accz, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr):
    """Tail accumulators -> [HP, D]: channel c keeps row (head, c // G) of accq, plus its group's zero term."""
    HP: tl.constexpr = accz.shape[0]
    VG: tl.constexpr = HEAD_DIM // GROUP
    own = tl.arange(0, VG)[:, None] == (tl.arange(0, HEAD_DIM) // GROUP)[None, :]  # [VG, D]
    acc = tl.sum(tl.where(own[None, :, :], tl.reshape(accq, (HP, VG, HEAD_DIM)), 0.0), axis=1)
    return acc + _group_broadcast(accz, GROUP)


@triton.jit
def _group_broadcast(x, GROUP: tl.constexpr):
    """[HP, VG] -> [HP, VG * GROUP]: each group's value on its channels."""
    return tl.reshape(tl.broadcast_to(x[:, :, None], (x.shape[0], x.shape[1], GROUP)), (x.shape[0], x.shape[1] * GROUP))


@triton.jit(do_not_specialize=["batch", "num_splits", "sink_rows", "kc_rows", "ks_rows", "kr_rows", "vc_rows", "vr_rows"])
def _decode_kernel(
    q_ptr,  # [B, Hq, D] (query with q_len squeezed), strides stride_qb, stride_qh, 1
    out_ptr,  # SINGLE: final [B, Hq, D] (strides stride_ob, stride_oh, 1); else fp32 partials [B, Hq, num_splits, D]
    lse_ptr,  # fp32 [B, Hq, num_splits] log2-sum-exp2 of each split (unused when SINGLE)
    k_sink_ptr, v_sink_ptr,  # [B, Hkv, sink_rows, D]
    kc_ptr, ks_ptr, kz_ptr,  # keys: codes [B, Hkv, kc_rows, D] int32, scale/zero [B, Hkv, ks_rows, D]
    kr_ptr,  # key residual [B, Hkv, kr_rows, D]
    vc_ptr, vs_ptr, vz_ptr,  # values: codes [B, Hkv, vc_rows, D // cpw] int32, scale/zero [B, Hkv, vc_rows, D // G]
    vr_ptr,  # value residual [B, Hkv, vr_rows, D]: positions n_qv.. in order, or a ring (V_RING)
    counts_ptr,  # int32 [4, B]: sinks, quantized keys, quantized values, tokens after the sinks
    batch, kv_heads, num_splits, qk_scale, cap,  # cap: soft-capping threshold in log2 units (SOFTCAP)
    stride_qb, stride_qh, stride_ob, stride_oh,
    sink_rows, kc_rows, ks_rows, kr_rows, vc_rows, vr_rows,
    HG: tl.constexpr,  # query heads per KV head
    HP: tl.constexpr,  # HG padded to a power of two
    HEAD_DIM: tl.constexpr, BITS_K: tl.constexpr, BITS_V: tl.constexpr, GROUP: tl.constexpr,
    ROWS: tl.constexpr,  # key words per channel in a fast tile: the N of the key matmuls
    SINGLE: tl.constexpr,  # num_splits == 1: write the final output
    GPU: tl.constexpr,  # compiled for CUDA: PTX unpacking, 16-bit tensor-core dots (off in the interpreter)
    V_RING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    CPW_V: tl.constexpr = 32 // BITS_V
    TILE: tl.constexpr = ROWS * (32 // BITS_K)
    VG: tl.constexpr = HEAD_DIM // GROUP
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
    vc_ptr += bh64 * vc_rows * (HEAD_DIM // CPW_V)
    vs_ptr += bh64 * vc_rows * VG
    vz_ptr += bh64 * vc_rows * VG
    vr_ptr += bh64 * vr_rows * HEAD_DIM

    d = tl.arange(0, HEAD_DIM)
    m = tl.arange(0, HP)
    q_off = b.to(tl.int64) * stride_qb + (h * HG + m)[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=(m < HG)[:, None], other=0.0).to(tl.float32) * qk_scale  # [HP, D]; padding heads 0
    m_i = tl.full([HP], float("-inf"), tl.float32)
    l_i = tl.zeros([HP], tl.float32)

    # Fast tiles, shared out evenly among the splits.
    fast_tiles = tl.minimum(n_qk, n_qv) // TILE
    per_split = tl.cdiv(fast_tiles, num_splits)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, fast_tiles)
    accs = ()
    for _ in tl.static_range(CPW_V // 2):
        accs = accs + (tl.zeros([2 * (HEAD_DIM // CPW_V), HP * VG], tl.float32),)
    accz = tl.zeros([HP, VG], tl.float32)
    qt = tl.trans(q)
    for t in range(lo, hi):
        accs, accz, m_i, l_i = _fast_tile(qt, accs, accz, m_i, l_i, t, kc_ptr, ks_ptr, kz_ptr, vc_ptr, vs_ptr, vz_ptr,
                                          cap, HEAD_DIM, BITS_K, BITS_V, GROUP, ROWS, GPU, SOFTCAP)
    acc = _fold(accs, accz, HEAD_DIM, BITS_V, GROUP)

    # The tail, dealt out block by block from the last split (it owns the fewest fast tiles) backwards: on the
    # last split alone, its 2.8x-costlier tokens would make that split the slowest when there are many splits.
    accq = tl.zeros([HP * VG, HEAD_DIM], tl.float32)
    accz = tl.zeros([HP, VG], tl.float32)
    first = fast_tiles * (TILE // TAIL_BLOCK) + num_splits - 1 - split
    for t in range(first, tl.cdiv(n_tok, TAIL_BLOCK), num_splits):
        acc, accq, accz, m_i, l_i = _tail_block(
            q, acc, accq, accz, m_i, l_i, t * TAIL_BLOCK, n_qk, n_qv, n_tok, kc_ptr, ks_ptr, kz_ptr, kr_ptr,
            vc_ptr, vs_ptr, vz_ptr, vr_ptr, vr_rows, cap, HEAD_DIM, BITS_K, BITS_V, GROUP, V_RING, GPU, SOFTCAP)
    acc += _fold_groups(accq, accz, HEAD_DIM, GROUP)

    # The sinks, few, on the last split.
    if split == num_splits - 1:
        n = tl.arange(0, TAIL_BLOCK)
        for t in range(tl.cdiv(n_sink, TAIL_BLOCK)):
            i = t * TAIL_BLOCK + n
            valid = i < n_sink
            k = tl.load(k_sink_ptr + i[None, :] * HEAD_DIM + d[:, None], mask=valid[None, :], other=0.0)  # [D, N]
            v = tl.load(v_sink_ptr + i[:, None] * HEAD_DIM + d[None, :], mask=valid[:, None], other=0.0)
            p, alpha, m_i, l_i = _softmax_step(_dot_split(q, k, tl.zeros([HP, TAIL_BLOCK], tl.float32), GPU), valid, m_i,
                                               l_i, cap, SOFTCAP)
            acc = _dot_split(p, v, acc * alpha[:, None], GPU)

    store_split(acc, m_i, l_i, out_ptr, lse_ptr, b, h, split, kv_heads, num_splits, stride_ob, stride_oh, HG, SINGLE)


def tile_rows(k_bits: int, group_size: int) -> int:
    """Key words per channel in a fast tile: 8 (two code slices of 8 rows: the M of one mma), or 16 when a key group
    needs it."""
    return 8 if (8 * codes_per_word(k_bits)) % group_size == 0 else 16


def tile_tokens(k_bits: int, group_size: int) -> int:
    """Tokens per fast tile."""
    return tile_rows(k_bits, group_size) * codes_per_word(k_bits)


def default_num_splits(batch: int, kv_heads: int, max_tokens: int, config: KiviConfig, device: torch.device,
                       per_sm: int = 32) -> int:
    """Splits per sequence for about ``per_sm`` one-warp programs per multiprocessor, each with >= 2 fast tiles
    of the longest sequence."""
    return split_count(batch, kv_heads, max_tokens, 2 * tile_tokens(config.k_bits, config.group_size), 128, per_sm, device)


def default_num_stages(q_heads: int, kv_heads: int) -> int:
    """Load stages of the fast-tile loop, as the H200 sweep measured fastest (BENCHMARKS.md): 2 (the next tile's
    codes copied to shared memory while this one computes) for one query head per KV head; 1 for grouped heads,
    whose programs hold 4x the operands and spill more when pipelined."""
    return 2 if q_heads == kv_heads else 1


def decode_attention(
    query: torch.Tensor,  # [B, Hq, 1, D]
    keys: StreamBuffers,  # sinks [B, Hkv, S, D]; codes [B, Hkv, Tk // cpw_k, D] (grouped along tokens), scale/zero
                          # [B, Hkv, Tk // G, D]; residual [B, Hkv, Rk, D]
    values: StreamBuffers,  # sinks [B, Hkv, S, D]; codes [B, Hkv, Tv, D // cpw_v] (grouped along channels), scale/zero
                            # [B, Hkv, Tv, D // G]; residual [B, Hkv, Rv, D]: positions n_qv.. in order, or with
                            # v_ring position i at row i % Rv
    counts: torch.Tensor,  # int32 [4, B] on the device: n_sink, n_quant keys, n_quant values, tokens after the sinks
    config: KiviConfig,  # bit widths and group size (one layer's)
    scaling: float,
    num_splits: int,
    out: torch.Tensor | None = None,  # [B, Hq, 1, D], any float dtype (tests pass float32 to see unrounded results)
    num_stages: int | None = None,  # software pipelining; None: measured fastest (``default_num_stages``)
    v_ring: bool = False,
    softcap: float | None = None,  # logits soft-capped at softcap * tanh(logit / softcap) (Gemma 2)
) -> torch.Tensor:
    """Decode attention over KIVI buffers in the layout of ``kivi.quant``. Returns ``out``.

    Per sequence, n_quant keys must be a multiple of the group size (keys flush in whole groups).
    """
    if reason := unsupported(config, query.shape):
        raise ValueError(f"decode_attention: {reason}")
    check_decode_buffers(query, keys, values, counts, config)
    k_bits, v_bits, group_size = config.k_bits, config.v_bits, config.group_size
    batch, q_heads, _, dim = query.shape
    kv_heads = keys.resid.shape[1]
    k_groups, v_tokens, sinks = keys.packed.scale.shape[2], values.packed.codes.shape[2], keys.sink.shape[2]
    if query.stride(-1) != 1:
        query = query.contiguous()
    if out is None:
        out = torch.empty_like(query)
    if tuple(out.shape) != tuple(query.shape) or out.stride(-1) != 1:
        raise ValueError(f"decode_attention: out must be {tuple(query.shape)} with unit stride along D")
    target, lse = split_targets(out, num_splits)
    group_heads = q_heads // kv_heads
    if num_stages is None:
        num_stages = default_num_stages(q_heads, kv_heads)
    kq, vq = keys.packed, values.packed
    _decode_kernel[(batch * kv_heads, num_splits)](
        query, target, lse, keys.sink, values.sink, kq.codes, kq.scale, kq.zero, keys.resid, vq.codes, vq.scale, vq.zero,
        values.resid, counts, batch, kv_heads, num_splits, scaling * LOG2E, log2_cap(softcap),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        sinks, kq.codes.shape[2], k_groups, keys.resid.shape[2], v_tokens, values.resid.shape[2],
        HG=group_heads, HP=triton.next_power_of_2(group_heads), HEAD_DIM=dim, BITS_K=k_bits, BITS_V=v_bits,
        GROUP=group_size, ROWS=tile_rows(k_bits, group_size), SINGLE=num_splits == 1, GPU=query.is_cuda, V_RING=v_ring,
        SOFTCAP=softcap is not None, num_warps=1, num_stages=num_stages,
    )
    if num_splits > 1:
        merge_splits(target, lse, out)
    return out


def unsupported(config: KiviConfig, shape: torch.Size | tuple[int, ...]) -> str | None:
    """Why the fused kernel cannot serve a layer of ``config`` for queries of ``shape`` [B, Hq, q, D] (None when it can)."""
    if shape[2] != 1:
        return f"q_len={shape[2]} (decode only)"
    if config.key_axis != "channel" or config.value_axis != "token":
        return "needs keys grouped along tokens (axis 'channel') and values along channels (axis 'token')"
    if not (config.keys.quantizes and config.values.quantizes):
        return "both streams must be quantized (2, 4 or 8 bits)"
    dim, g, k_bits = shape[-1], config.group_size, config.k_bits
    if dim not in HEAD_DIMS:
        return f"head_dim={dim}: the kernel is checked for head_dim {HEAD_DIMS}"
    if g & (g - 1) or g < 16 or dim % g or tile_tokens(k_bits, g) % g:
        return (f"group_size={g} must be a power of two >= 16 dividing head_dim={dim} and the fast tile of "
                f"{tile_tokens(k_bits, g)} {k_bits}-bit key tokens")
    return None
