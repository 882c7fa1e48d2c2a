"""Putting KIVI into a stock transformers model: the "kivi" attention implementation."""

from __future__ import annotations

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask

from kivi.attention import exact_attention, unapplied_arguments
from kivi.cache import KiviCache, KiviLayer

ATTENTION_NAME = "kivi"


def kivi_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """Attention through the KiviCache of the current call (its full-attention layers); exact attention, soft-capped
    where the model asks, for every other layer and cache."""
    if unapplied := unapplied_arguments(kwargs):
        raise NotImplementedError(f"{type(module).__name__}: the kivi attention does not apply {unapplied}")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    cache = getattr(module, "_kivi_cache", None)
    layer = cache.layers[module.layer_idx] if isinstance(cache, KiviCache) else None
    if isinstance(layer, KiviLayer):
        return layer.attend(module, query, attention_mask, scaling, softcap), None
    kwargs.pop("sliding_window", None)  # the mask holds the window
    return exact_attention(module, query, key, value, attention_mask, scaling, softcap, dropout=dropout, **kwargs), None


def kivi_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
              mask_function=causal_mask_function, attention_mask: torch.Tensor | None = None,
              local_size: int | None = None, allow_is_causal_skip: bool = True, **kwargs) -> torch.Tensor | None:
    """transformers' SDPA mask, except that a plainly causal one over a whole unpadded sequence (no padding, no past,
    no window, no other pattern) is left to SDPA's is_causal even when traced. Traced (torch.compile), transformers
    always builds the mask, as a traced graph might later meet padding; here shapes alone decide, and the graph is
    guarded on them. Without a mask, a compiled prefill runs the flash kernel, not the memory-efficient one over
    a [B, 1, q, q] mask."""
    if (allow_is_causal_skip and mask_function is causal_mask_function and attention_mask is None
            and local_size is None and not isinstance(q_offset, torch.Tensor) and q_offset == 0 and kv_offset == 0
            and kv_length == q_length):
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                     local_size=local_size, allow_is_causal_skip=allow_is_causal_skip, **kwargs)


AttentionInterface.register(ATTENTION_NAME, kivi_attention_forward)
AttentionMaskInterface.register(ATTENTION_NAME, kivi_mask)


def enable_kivi(model: PreTrainedModel) -> PreTrainedModel:
    """Select the "kivi" attention implementation; the model then works with KiviCache and any other cache."""
    model.set_attn_implementation(ATTENTION_NAME)
    if not getattr(model, "_kivi_hooks", False):
        attention_modules = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")]
        if not attention_modules:
            raise ValueError(f"enable_kivi: found no attention modules with a layer_idx in {type(model).__name__}")
        for m in attention_modules:
            # The attention function receives no cache argument; the module's forward does.
            m.register_forward_pre_hook(_remember_cache, with_kwargs=True)
            m.register_forward_hook(_forget_cache, always_call=True)
        model._kivi_hooks = True
    return model


def _remember_cache(module: torch.nn.Module, args, kwargs):
    module._kivi_cache = kwargs.get("past_key_values")


def _forget_cache(module: torch.nn.Module, args, output):
    module._kivi_cache = None
