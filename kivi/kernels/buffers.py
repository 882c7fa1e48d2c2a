"""The decode kernels' inputs, checked once for both (Triton and CUDA): buffers in kivi.quant's layout."""

from __future__ import annotations

import torch

from kivi.config import KiviConfig
from kivi.quant import StreamBuffers, codes_per_word


def check_decode_buffers(query: torch.Tensor, keys: StreamBuffers, values: StreamBuffers, counts: torch.Tensor,
                         config: KiviConfig) -> None:
    """Raise ValueError naming the first buffer that is not a contiguous tensor of the layout's shape and dtype on
    the query's device: query [B, Hq, 1, D]; keys grouped along tokens, values along channels; counts int32 [4, B]."""
    group_size = config.group_size
    batch, q_heads, _, dim = query.shape
    kv_heads = keys.resid.shape[1]
    dtype = keys.resid.dtype
    if q_heads % kv_heads:
        raise ValueError(f"decode_attention: query must be [B, Hq, 1, D] with Hq % Hkv == 0, got {tuple(query.shape)}, Hkv={kv_heads}")
    cpw_k, cpw_v, vg = codes_per_word(config.k_bits), codes_per_word(config.v_bits), dim // group_size
    k_groups, v_tokens, sinks = keys.packed.scale.shape[2], values.packed.codes.shape[2], keys.sink.shape[2]
    expected = {
        "keys.sink": (keys.sink, (batch, kv_heads, sinks, dim), dtype),
        "values.sink": (values.sink, (batch, kv_heads, sinks, dim), dtype),
        "keys.codes": (keys.packed.codes, (batch, kv_heads, k_groups * group_size // cpw_k, dim), torch.int32),
        "keys.scale": (keys.packed.scale, (batch, kv_heads, k_groups, dim), dtype),
        "keys.zero": (keys.packed.zero, (batch, kv_heads, k_groups, dim), dtype),
        "keys.resid": (keys.resid, (batch, kv_heads, keys.resid.shape[2], dim), dtype),
        "values.codes": (values.packed.codes, (batch, kv_heads, v_tokens, dim // cpw_v), torch.int32),
        "values.scale": (values.packed.scale, (batch, kv_heads, v_tokens, vg), dtype),
        "values.zero": (values.packed.zero, (batch, kv_heads, v_tokens, vg), dtype),
        "values.resid": (values.resid, (batch, kv_heads, values.resid.shape[2], dim), dtype),
        "counts": (counts, (4, batch), torch.int32),
    }
    for name, (t, shape, want) in expected.items():
        if tuple(t.shape) != shape or t.dtype != want or not t.is_contiguous() or t.device != query.device:
            raise ValueError(f"decode_attention: {name} must be a contiguous {want} tensor of shape {shape} on "
                             f"{query.device}, got {t.dtype} {tuple(t.shape)} contiguous={t.is_contiguous()} on {t.device}")
