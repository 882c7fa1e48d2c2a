"""Reference attention: over a KIVI cache (one softmax across sinks, quantized segment and residual) and exact.

``attention_over_cache`` is the oracle the Triton kernels are checked against, and the path used wherever they
do not run. ``exact_attention`` is the attention of the stock model's own tokens (prefill, 16-bit layers), with
the soft-capping some models ask for, which PyTorch's SDPA has no argument for.
"""

from __future__ import annotations

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward


def soft_cap(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma 2's attention logit soft-capping, softcap * tanh(logits / softcap); logits unchanged without one."""
    return logits if softcap is None else softcap * torch.tanh(logits / softcap)


def attention_over_cache(
    query: torch.Tensor,  # [B, Hq, q, D], the current step's queries
    keys: torch.Tensor,  # [B, Hkv, L, D] float32, positions in order (dequantized segment + full-precision tokens)
    values: torch.Tensor,  # [B, Hkv, L, D] float32
    lengths: torch.Tensor,  # [B] tokens held per sequence, the current step's q tokens last
    scaling: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's last ``q`` positions over its first ``lengths[b]`` positions.

    GQA/MQA: the query heads that share a KV head are folded into the matmul's rows, so the cache is
    never repeated per query head. Returns [B, Hq, q, D] in the query dtype.
    """
    batch, q_heads, q_len, dim = query.shape
    kv_heads, max_len = keys.shape[1], keys.shape[2]
    q = query.float().reshape(batch, kv_heads, q_heads // kv_heads, q_len, dim)
    logits = soft_cap(torch.einsum("bgrqd,bgkd->bgrqk", q, keys) * scaling, softcap)
    key_pos = torch.arange(max_len, device=query.device)
    query_pos = lengths.to(query.device)[:, None] - q_len + torch.arange(q_len, device=query.device)  # [B, q]
    visible = key_pos[None, None, :] <= query_pos[:, :, None]  # [B, q, L]: causal, and inside the sequence
    logits = logits.masked_fill(~visible[:, None, None], float("-inf"))
    probs = logits.softmax(dim=-1)
    out = torch.einsum("bgrqk,bgkd->bgrqd", probs, values)
    return out.reshape(batch, q_heads, q_len, dim).to(query.dtype)


def exact_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float, softcap: float | None = None,
                    **kwargs) -> torch.Tensor:
    """Attention of query [B, Hq, q, D] over key/value [B, Hkv, k, D] under a boolean mask (True: attend; None:
    causal), as transformers' attention functions take them. Returns [B, q, Hq, D]."""
    if softcap is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)[0]
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    logits = soft_cap(query.float() @ key.float().transpose(2, 3) * scaling, softcap)
    if attention_mask is None:
        q_len, k_len = logits.shape[-2:]
        attention_mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)
    # A padding query sees nothing: its softmax is NaN; zeroed, so no NaN reaches later layers' keys and values.
    probs = logits.masked_fill(~attention_mask, float("-inf")).softmax(-1).masked_fill(~attention_mask, 0.0)
    return (probs @ value.float()).to(query.dtype).transpose(1, 2).contiguous()


# What transformers' attention functions may be handed besides query, key, value and mask: these the KIVI
# attentions apply (a window is the mask's, or the layer's ring) ...
APPLIED = ("scaling", "dropout", "softcap", "sliding_window")
# ... these change nothing in the result of a causal decoder's attention ...
NEUTRAL = ("position_ids", "use_cache", "output_attentions", "output_router_logits", "cu_seq_lens_q", "cu_seq_lens_k",
           "max_length_q", "max_length_k", "is_causal")
# ... and these change it in ways the KIVI attentions do not follow: attention sinks (gpt-oss), position biases
# (T5-style), sparse indices.
UNAPPLIED = ("s_aux", "position_bias", "indices", "block_indices")


def unapplied_arguments(kwargs: dict) -> list[str]:
    """The attention arguments of a call that the KIVI attentions would ignore, so that a result computed without
    them would be silently wrong (a bidirectional layer among them)."""
    names = [k for k in UNAPPLIED if kwargs.get(k) is not None]
    return names + (["is_causal=False"] if kwargs.get("is_causal", True) is False else [])


def unknown_arguments(kwargs: dict) -> list[str]:
    """What a model's own forward hands its attention that is none of the above (checked once, before a model is
    driven, on a call whose other arguments the checker chose): an argument no KIVI attention knows may change the
    result."""
    return unapplied_arguments(kwargs) + [k for k, v in kwargs.items()
                                          if v is not None and k not in APPLIED + NEUTRAL + UNAPPLIED]
