"""Decode attention over a dense 16-bit cache with per-sequence lengths: the fp16 side of the static engine.

A static cache holds every sequence from row 0 up to the batch's capacity; each sequence reads only its own
tokens (SDPA with a mask would read the whole capacity, padding included, and so would HF's StaticCache).
Split-KV like the KIVI kernel: programs (b, kv head, split) walk BLOCK_N-token blocks with an online softmax
(fp16 tensor-core dots, fp32 accumulation, as flash attention), and ``merge_splits`` combines the splits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kivi.kernels._triton import LOG2E, log2_cap, merge_splits, soft_cap, split_count, split_targets, store_split

BLOCK_N = 64


@triton.jit(do_not_specialize=["num_splits", "capacity"])
def _dense_decode_kernel(
    q_ptr,  # [B, Hq, D] (q_len squeezed), strides stride_qb, stride_qh, 1
    k_ptr, v_ptr,  # [B, Hkv, capacity, D] contiguous
    len_ptr,  # int32 [B]: tokens to attend per sequence
    out_ptr,  # SINGLE: [B, Hq, D] (strides stride_ob, stride_oh, 1); else fp32 partials [B, Hq, num_splits, D]
    lse_ptr,  # fp32 [B, Hq, num_splits]
    kv_heads, num_splits, capacity, qk_scale, cap,  # cap: soft-capping threshold in log2 units (SOFTCAP)
    stride_qb, stride_qh, stride_ob, stride_oh,
    HG: tl.constexpr, HP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    bh, split = tl.program_id(0), tl.program_id(1)
    b, h = bh // kv_heads, bh % kv_heads
    n = tl.load(len_ptr + b)
    blocks = tl.cdiv(n, BLOCK_N)
    per_split = tl.cdiv(blocks, num_splits)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, blocks)
    base = bh.to(tl.int64) * capacity * HEAD_DIM
    d = tl.arange(0, HEAD_DIM)
    m = tl.arange(0, HP)
    q_off = b.to(tl.int64) * stride_qb + (h * HG + m)[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=(m < HG)[:, None], other=0.0)  # [HP, D]; padding heads 0
    m_i = tl.full([HP], float("-inf"), tl.float32)
    l_i = tl.zeros([HP], tl.float32)
    acc = tl.zeros([HP, HEAD_DIM], tl.float32)
    for blk in range(lo, hi):
        tok = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = tok < n
        rows = base + tok[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(k_ptr + rows, mask=inside[:, None], other=0.0)
        v = tl.load(v_ptr + rows, mask=inside[:, None], other=0.0)
        s = soft_cap(tl.dot(q, tl.trans(k)) * qk_scale, cap, SOFTCAP)  # [HP, BLOCK_N] log2 units
        s = tl.where(inside[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    store_split(acc, m_i, l_i, out_ptr, lse_ptr, b, h, split, kv_heads, num_splits, stride_ob, stride_oh, HG, SINGLE)


@triton.jit
def _store_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, row_ptr, heads, rows, stride_kb, stride_kh, stride_kd, stride_vb,
                  stride_vh, stride_vd, HEAD_DIM: tl.constexpr):
    """Program (b, head): the step's key and value [B, H, D] (any strides) into row row[b] of the layer's keys and
    values [B, H, rows, D] (contiguous)."""
    bh = tl.program_id(0)
    b, h = bh // heads, bh % heads
    d = tl.arange(0, HEAD_DIM)
    at = (bh.to(tl.int64) * rows + tl.load(row_ptr + b)) * HEAD_DIM + d
    tl.store(kc_ptr + at, tl.load(k_ptr + b.to(tl.int64) * stride_kb + h * stride_kh + d * stride_kd))
    tl.store(vc_ptr + at, tl.load(v_ptr + b.to(tl.int64) * stride_vb + h * stride_vh + d * stride_vd))


def store_step(key: torch.Tensor, value: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               rows: torch.Tensor) -> None:
    """A decode step's key and value [B, H, D] stored at row ``rows[b]`` (int32 [B], on the device) of keys and
    values [B, H, capacity, D] (contiguous), both in one launch."""
    batch, heads, capacity, dim = keys.shape
    if key.shape != (batch, heads, dim) or value.shape != key.shape or values.shape != keys.shape:
        raise ValueError(f"store_step: key and value must be [{batch}, {heads}, {dim}] for a layer of "
                         f"{tuple(keys.shape)}, got {tuple(key.shape)}, {tuple(value.shape)} and {tuple(values.shape)}")
    if not keys.is_contiguous() or not values.is_contiguous():
        raise ValueError("store_step: the layer's keys and values must be contiguous")
    _store_kernel[(batch * heads,)](key, value, keys, values, rows, heads, capacity, *key.stride(), *value.stride(),
                                    HEAD_DIM=dim, num_warps=1)


def default_num_splits(batch: int, kv_heads: int, capacity: int, device: torch.device, per_sm: int = 4) -> int:
    """Splits per sequence for about ``per_sm`` programs per multiprocessor, each with >= 2 blocks of the capacity."""
    return split_count(batch, kv_heads, capacity, 2 * BLOCK_N, 64, per_sm, device)


def dense_decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor,
                           scaling: float, num_splits: int, out: torch.Tensor | None = None,
                           softcap: float | None = None) -> torch.Tensor:
    """Attention of query [B, Hq, 1, D] over the first ``lengths[b]`` (>= 1) rows of keys/values
    [B, Hkv, capacity, D] (16-bit, contiguous; any order of positions: a window's ring too); lengths int32 [B] on
    the device; logits soft-capped at ``softcap`` where given. Returns out [B, Hq, 1, D]."""
    batch, q_heads, q_len, dim = query.shape
    kv_heads, capacity = keys.shape[1], keys.shape[2]
    if q_len != 1 or q_heads % kv_heads or dim & (dim - 1):
        raise ValueError(f"dense_decode_attention: query must be [B, Hq, 1, D] with Hq % Hkv == 0 and D a power "
                         f"of two, got {tuple(query.shape)}, Hkv={kv_heads}")
    for name, t in (("keys", keys), ("values", values)):
        if t.shape != (batch, kv_heads, capacity, dim) or t.dtype != query.dtype or not t.is_contiguous():
            raise ValueError(f"dense_decode_attention: {name} must be contiguous {query.dtype} {(batch, kv_heads, capacity, dim)}, "
                             f"got {t.dtype} {tuple(t.shape)}")
    if lengths.shape != (batch,) or lengths.dtype != torch.int32 or lengths.device != query.device:
        raise ValueError(f"dense_decode_attention: lengths must be int32 [{batch}] on {query.device}")
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty_like(query) if out is None else out
    if out.shape != query.shape or out.stride(-1) != 1:
        raise ValueError(f"dense_decode_attention: out must be {tuple(query.shape)} with unit stride along D")
    target, lse = split_targets(out, num_splits)
    group_heads = q_heads // kv_heads
    _dense_decode_kernel[(batch * kv_heads, num_splits)](
        query, keys, values, lengths, target, lse, kv_heads, num_splits, capacity, scaling * LOG2E, log2_cap(softcap),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        HG=group_heads, HP=max(16, triton.next_power_of_2(group_heads)),  # tl.dot needs M >= 16
        HEAD_DIM=dim, BLOCK_N=BLOCK_N, SINGLE=num_splits == 1, SOFTCAP=softcap is not None, num_warps=4,
    )
    if num_splits > 1:
        merge_splits(target, lse, out)
    return out
