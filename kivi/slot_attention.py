"""The attention a decode step runs over a SlotCache: the model's own forward, attention implementation "kivi-slots".

A decode step is one call of the stock model's ``forward`` with the SlotCache as ``past_key_values``; every
attention layer calls the registered function below instead of its SDPA. That function is one custom operator,
``kivi::slot_attention`` (flush, store the step's key and value at each slot's position, attend), so that
torch.compile sees the rest of the forward whole (norms, projections, rotary, MLP fused between attentions) and
treats the cache's work as one opaque call. The operator takes only tensors and constants: the cache it works on
is the one ``stepping`` made current, so one compiled forward serves every SlotCache of the same batch size (one
SlotCache steps at a time in a process).

No mask is built: "kivi-slots" registers no mask function, so transformers passes none, and each slot layer
knows from its positions which of its rows a sequence attends to.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import AttentionInterface, PreTrainedModel

from kivi.slot_cache import SlotCache

ATTENTION_NAME = "kivi-slots"
_current: list[SlotCache] = []


@contextmanager
def stepping(model: PreTrainedModel, cache: SlotCache) -> Iterator[None]:
    """Within: ``model``'s attention layers run "kivi-slots" over ``cache``."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = ATTENTION_NAME
    _current.append(cache)
    try:
        yield
    finally:
        _current.pop()
        config._attn_implementation = before


@torch.library.custom_op("kivi::slot_attention", mutates_args=())
def slot_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int, scaling: float,
                   softcap: float) -> torch.Tensor:
    """query [B, Hq, 1, D], the step's key/value [B, Hkv, 1, D] of decoder layer ``layer`` -> [B, Hq, 1, D];
    softcap 0: none. Writes the current SlotCache's layer (hidden from the compiler: nothing else reads it)."""
    return _current[-1].layers[layer].attend(query, key, value, scaling, softcap or None)


@slot_attention.register_fake
def _(query, key, value, layer, scaling, softcap):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


def slot_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                           **kwargs):
    """transformers' attention-function signature; returns ([B, 1, Hq, D], no weights). The window of a sliding
    layer is its ring's; the arguments a model may pass were checked before it was driven
    (``pipeline.decode_step.unsupported``)."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = torch.ops.kivi.slot_attention(query, key, value, module.layer_idx, float(scaling), float(softcap or 0.0))
    return out.transpose(1, 2), None


AttentionInterface.register(ATTENTION_NAME, slot_attention_forward)
