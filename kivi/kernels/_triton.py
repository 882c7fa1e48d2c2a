"""Small @triton.jit helpers shared by the kernels of this package."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)  # softmax in base 2: exp(x) = exp2(x * LOG2E)
_TWO_LOG2E = tl.constexpr(2 * LOG2E)


def split_count(batch: int, kv_heads: int, max_tokens: int, min_tokens: int, cap: int, per_sm: int,
                device: torch.device) -> int:
    """Splits per sequence: about ``per_sm`` programs per multiprocessor, each with >= ``min_tokens`` tokens."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    wanted = triton.cdiv(per_sm * sms, batch * kv_heads)
    return max(1, min(wanted, max_tokens // min_tokens, cap))


def log2_cap(softcap: float | None) -> float:
    """A soft-capping threshold in the kernels' log2 units (logits there are natural logits * LOG2E); 0: none."""
    return (softcap or 0.0) * LOG2E


@triton.jit
def soft_cap(s, cap, SOFTCAP: tl.constexpr):
    """cap * tanh(s / cap) (Gemma 2's attention soft-capping; s and cap in log2 units); s itself without SOFTCAP.
    tanh from exp2, which the interpreter runs too: tanh(y) = 1 - 2 / (1 + e^2y)."""
    if SOFTCAP:
        return cap - 2.0 * cap / (1.0 + tl.exp2(s * (_TWO_LOG2E / cap)))
    else:
        return s


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
def store_split(acc, m_i, l_i, out_ptr, lse_ptr, b, h, split, kv_heads, num_splits, stride_ob, stride_oh,
                HG: tl.constexpr, SINGLE: tl.constexpr):
    """Write the result of the program (sequence b, KV head h, split): acc [HP, D] = sum p * v, l_i = sum p, m_i
    the running max (log2 units), for query heads h * HG .. (rows past HG are padding). SINGLE: the final output
    in its dtype; else the split's normalized partial and its log2-sum-exp, for ``merge_splits``."""
    HP: tl.constexpr = acc.shape[0]
    HEAD_DIM: tl.constexpr = acc.shape[1]
    m = tl.arange(0, HP)
    d = tl.arange(0, HEAD_DIM)
    hq = h * HG + m
    real = (m < HG)[:, None]
    if SINGLE:
        o_off = b.to(tl.int64) * stride_ob + hq[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_off, round_to(acc / l_i[:, None], out_ptr.dtype.element_ty), mask=real)
    else:
        seen = l_i > 0  # a split can own no tokens (short sequence): weight 0 in the merge
        l_i = tl.where(seen, l_i, 1.0)
        row = (b * (kv_heads * HG) + hq).to(tl.int64) * num_splits + split
        tl.store(out_ptr + row[:, None] * HEAD_DIM + d[None, :], acc / l_i[:, None], mask=real)
        tl.store(lse_ptr + row, tl.where(seen, m_i + tl.log2(l_i), float("-inf")), mask=m < HG)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_kernel(part_ptr, lse_ptr, out_ptr, q_heads, num_splits, stride_ob, stride_oh,
                  HEAD_DIM: tl.constexpr, SPLITS_P2: tl.constexpr):
    """out[b, h] = sum_s 2^(lse_s - max) * part_s / sum_s 2^(lse_s - max); part [B, Hq, S, D] fp32, lse [B, Hq, S]."""
    bh = tl.program_id(0)
    s = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_ptr + bh * num_splits + s, mask=s < num_splits, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))
    part = tl.load(part_ptr + (bh * num_splits + s)[:, None] * HEAD_DIM + d[None, :], mask=(s < num_splits)[:, None], other=0.0)
    o = tl.sum(w[:, None] * part, axis=0) / tl.sum(w, axis=0)
    off = (bh // q_heads).to(tl.int64) * stride_ob + (bh % q_heads) * stride_oh + d
    tl.store(out_ptr + off, round_to(o, out_ptr.dtype.element_ty))


def split_targets(out: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where split-KV programs write: ``out`` [B, Hq, 1, D] itself for one split (no lse), else fp32 partials
    [B, Hq, S, D] and their log2-sum-exps [B, Hq, S] for ``merge_splits``."""
    if num_splits == 1:
        return out, out
    batch, q_heads, _, dim = out.shape
    return (torch.empty(batch, q_heads, num_splits, dim, dtype=torch.float32, device=out.device),
            torch.empty(batch, q_heads, num_splits, dtype=torch.float32, device=out.device))


def merge_splits(part: torch.Tensor, lse: torch.Tensor, out: torch.Tensor) -> None:
    """Combine split-KV partial results: part fp32 [B, Hq, S, D] (each normalized by its own sum), lse fp32
    [B, Hq, S] (log2 of each split's sum of 2^logits, -inf for a split that saw no token) into out [B, Hq, 1, D]."""
    batch, q_heads, splits, dim = part.shape
    _merge_kernel[(batch * q_heads,)](part, lse, out, q_heads, splits, out.stride(0), out.stride(1),
                                      HEAD_DIM=dim, SPLITS_P2=triton.next_power_of_2(splits))
