"""A Llama-family model with its attention heads widened by zero channels: the same function at a head size a
kernel serves. ``tools.check_generation --head-dim 128`` runs SmolLM2-135M (heads of 64) on the CUDA decode kernel
this way: a real model's greedy generation on that kernel without shipping a larger model to the GPU host.

Each head's query, key and value rows go to channels 2i (first half) and d' / 2 + 2i (second half) of the wider
head, the others zero: rotary embedding pairs channel c with c + d' / 2 at frequency theta^(-2 (c mod d' / 2) / d'),
so channel 2i of the wider head turns at old channel i's frequency, with its old partner; zero channels add
nothing to q . k, and zero value channels nothing to the output, which o_proj's zero columns ignore. The softmax
scale stays the model's (``module.scaling``, which the attention interface receives). Under a KIVI cache the
widened model is a model of its own (a value group of 32 channels holds 16 old channels and 16 zeros): a check
compares two paths over the same widened model.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

WIDENS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")  # default rotary, no q/k norms


def channel_map(head_dim: int, width: int) -> torch.Tensor:
    """The wider head's channel of each of the old head's channels."""
    ratio, half = width // head_dim, head_dim // 2
    old = torch.arange(head_dim)
    return torch.where(old < half, ratio * old, width // 2 + ratio * (old - half))


def _widened_rows(linear: nn.Linear, heads: int, head_dim: int, width: int) -> nn.Linear:
    """A projection whose output rows are ``heads`` heads of ``head_dim``, its heads widened to ``width``."""
    new = nn.Linear(linear.in_features, heads * width, bias=linear.bias is not None, device=linear.weight.device,
                    dtype=linear.weight.dtype)
    where = channel_map(head_dim, width).to(linear.weight.device)
    with torch.no_grad():
        weight = torch.zeros(heads, width, linear.in_features, dtype=linear.weight.dtype, device=linear.weight.device)
        weight[:, where] = linear.weight.view(heads, head_dim, -1)
        new.weight.copy_(weight.view(heads * width, -1))
        if linear.bias is not None:
            bias = torch.zeros(heads, width, dtype=linear.bias.dtype, device=linear.bias.device)
            bias[:, where] = linear.bias.view(heads, head_dim)
            new.bias.copy_(bias.view(-1))
    return new


def _widened_columns(linear: nn.Linear, heads: int, head_dim: int, width: int) -> nn.Linear:
    """o_proj: its input columns, ``heads`` heads of ``head_dim``, widened to ``width`` (zero columns)."""
    new = nn.Linear(heads * width, linear.out_features, bias=linear.bias is not None, device=linear.weight.device,
                    dtype=linear.weight.dtype)
    where = channel_map(head_dim, width).to(linear.weight.device)
    with torch.no_grad():
        weight = torch.zeros(linear.out_features, heads, width, dtype=linear.weight.dtype, device=linear.weight.device)
        weight[:, :, where] = linear.weight.view(linear.out_features, heads, head_dim)
        new.weight.copy_(weight.view(linear.out_features, -1))
        if linear.bias is not None:
            new.bias.copy_(linear.bias)
    return new


def widen_heads(model: PreTrainedModel, width: int) -> PreTrainedModel:
    """``model`` (modified in place) with attention heads of ``width`` channels: the same logits."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if type(model).__name__ not in WIDENS:
        raise ValueError(f"widen_heads: {type(model).__name__}; widens {', '.join(WIDENS)} (default rotary, no q/k norms)")
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope != "default":
        raise ValueError(f"widen_heads: rope_type {rope!r} (default only: its frequencies follow the head size)")
    if width % head_dim or width < head_dim:
        raise ValueError(f"widen_heads: width={width} must be a multiple of the head size {head_dim}")
    q_heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.q_proj = _widened_rows(attn.q_proj, q_heads, head_dim, width)
        attn.k_proj = _widened_rows(attn.k_proj, kv_heads, head_dim, width)
        attn.v_proj = _widened_rows(attn.v_proj, kv_heads, head_dim, width)
        attn.o_proj = _widened_columns(attn.o_proj, q_heads, head_dim, width)
        attn.head_dim = width  # the attention's reshapes; its scaling stays head_dim ** -0.5
    config.head_dim = width
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=config).to(rotary.inv_freq.device)
    return model
