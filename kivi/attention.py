"""Reference attention over a KIVI cache: one softmax across sinks, quantized segment and residual.

This is the oracle the Triton kernels are checked against, and the path used wherever they do not run.
"""

from __future__ import annotations

import torch


def attention_over_cache(
    query: torch.Tensor,  # [B, Hq, q, D], the current step's queries
    keys: torch.Tensor,  # [B, Hkv, L, D] float32, positions in order (dequantized segment + full-precision tokens)
    values: torch.Tensor,  # [B, Hkv, L, D] float32
    lengths: torch.Tensor,  # [B] tokens held per sequence, the current step's q tokens last
    scaling: float,
) -> torch.Tensor:
    """Causal attention of each sequence's last ``q`` positions over its first ``lengths[b]`` positions.

    GQA/MQA: the query heads that share a KV head are folded into the matmul's rows, so the cache is
    never repeated per query head. Returns [B, Hq, q, D] in the query dtype.
    """
    batch, q_heads, q_len, dim = query.shape
    kv_heads, max_len = keys.shape[1], keys.shape[2]
    q = query.float().reshape(batch, kv_heads, q_heads // kv_heads, q_len, dim)
    logits = torch.einsum("bgrqd,bgkd->bgrqk", q, keys) * scaling
    key_pos = torch.arange(max_len, device=query.device)
    query_pos = lengths.to(query.device)[:, None] - q_len + torch.arange(q_len, device=query.device)  # [B, q]
    visible = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, q, L]: causal, and inside the sequence
    logits = logits.masked_fill(~visible[:, None, None], float("-inf"))
    probs = logits.softmax(dim=-1)
    out = torch.einsum("bgrqk,bgkd->bgrqd", probs, values)
    return out.reshape(batch, q_heads, q_len, dim).to(query.dtype)
