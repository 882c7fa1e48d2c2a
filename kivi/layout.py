"""A decoder's attention layers as its config declares them, and what a KIVI cache cannot hold.

Layer kinds are read the way transformers' own caches read them (``get_layer_types_and_kwargs``: ``layer_types``,
else every layer slides when ``sliding_window`` is set), so a cache built here has the layers the model's
forward expects. A sliding layer lets each token see itself and the ``window - 1`` tokens before it
(transformers' ``kv_idx > q_idx - sliding_window``). KIVI caches keep that window in 16 bits, as transformers
does: it is short next to the contexts KIVI is for, and it holds exactly the tokens the layer attends to;
full-attention layers are quantized.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

FULL, SLIDING = "full_attention", "sliding_attention"
DYNAMIC_ROPE = ("dynamic", "longrope")  # rotary frequencies that follow the sequence length at run time


@dataclass(frozen=True)
class AttentionLayer:
    window: int | None = None  # sliding window in tokens; None: full attention

    @property
    def sliding(self) -> bool:
        return self.window is not None


def attention_layers(text: PretrainedConfig) -> list[AttentionLayer]:
    """One entry per decoder layer of a text config (``unsupported_layout`` is None for it)."""
    types, kwargs = get_layer_types_and_kwargs(text)
    return [AttentionLayer(kwargs["sliding_window"] if kind == SLIDING else None) for kind in types]


def unsupported_layout(text: PretrainedConfig) -> str | None:
    """Why no KIVI cache can hold the decoder of this text config (None when one can)."""
    name = getattr(text, "model_type", type(text).__name__)
    if getattr(text, "is_encoder_decoder", False):
        return f"{name} is an encoder-decoder; KIVI caches hold decoder-only models"
    if getattr(text, "kv_lora_rank", None):
        return f"{name} uses multi-head latent attention (kv_lora_rank={text.kv_lora_rank}): its cache holds a latent, not keys and values"
    if getattr(text, "num_kv_shared_layers", None):
        return f"{name} shares keys and values across layers (num_kv_shared_layers={text.num_kv_shared_layers})"
    declared = getattr(text, "layer_types", None) or ()
    if SLIDING in declared and not getattr(text, "sliding_window", None):
        return f"{name} declares sliding-window layers and no sliding_window"
    types, _ = get_layer_types_and_kwargs(text)
    if len(types) != text.num_hidden_layers:
        return f"{name} declares {len(types)} cached layers for {text.num_hidden_layers} decoder layers"
    if others := sorted(set(types) - {FULL, SLIDING}):
        return f"{name} has {others} layers; KIVI caches hold full and sliding-window attention layers only"
    return None


def dynamic_rope(text: PretrainedConfig) -> str | None:
    """The rope type of a decoder whose rotary frequencies depend on the current sequence length, else None."""
    params = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    per_type = params.values() if all(isinstance(v, dict) for v in params.values()) and params else [params]
    kinds = {p.get("rope_type", p.get("type", "default")) for p in per_type}
    return next((kind for kind in DYNAMIC_ROPE if kind in kinds), None)


def model_head_dim(text: PretrainedConfig) -> int:
    """Per-head size of a decoder's text config (``head_dim`` where the config names it)."""
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
