"""One decode step of a transformers decoder over a SlotCache: the model's own forward, with fixed shapes.

A step is the stock model's ``forward`` on one token per slot: ``position_ids`` from the slot positions (a device
buffer), the SlotCache as ``past_key_values``, ``logits_to_keep=1``, every attention layer through "kivi-slots"
(``kivi.slot_attention``: KIVI's flush, the step's key and value stored, attention, all on the device); then the
next tokens are chosen (greedy, or sampled per slot: ``pipeline.sampling``) and the active slots' positions
advance. Whatever the model does around its attention
(q/k norms, soft-capping, fused projections, post-norms, embedding and residual multipliers, sliding-window
layers) is its own code, so every decoder transformers implements with the attention interface is driven the
same way. Shapes are fixed for a cache's lifetime: on CUDA one step is captured in a CUDA graph and replayed, and
the forward is compiled (the slot attention is one opaque operator, so torch.compile fuses everything between
two attentions); elsewhere it runs eagerly.

``unsupported`` says, before any weights load (the model may live on the meta device), why a model cannot be
driven: its config (kivi.layout: full and sliding-window layers only; rotary frequencies fixed), then one
forward with a probe attention that records what each layer hands its attention function.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.cache_utils import Cache, CacheLayerMixin

from kivi.attention import unknown_arguments
from kivi.layout import attention_layers, dynamic_rope, model_head_dim, unsupported_layout
from kivi.slot_attention import stepping
from kivi.slot_cache import SlotCache
from pipeline.sampling import SlotSampling, next_tokens

PROBE = "kivi-probe"


class UnsupportedModelError(ValueError):
    """The model cannot be driven by the decode step."""


def unsupported(model: PreTrainedModel) -> str | None:
    """Why the step cannot drive this model (None when it can)."""
    text = model.config.get_text_config(decoder=True)
    name = type(model).__name__
    if reason := unsupported_layout(text):
        return f"{name}: {reason}"
    if rope := dynamic_rope(text):
        return (f"{name}: {rope!r} rotary scaling sets its frequencies from the current length, which differs per slot; "
                f"a batch would not give each sequence the frequencies it has alone")
    try:
        calls = _probe(model)
    except Exception as err:  # noqa: BLE001 - whatever the forward raised is the reason it cannot be driven
        return f"{name}: a decode step of its forward failed on the {model.device.type} device: {type(err).__name__}: {err}"
    layers = attention_layers(text)
    if [c.layer for c in calls] != list(range(len(layers))):
        return (f"{name}: its forward called the attention interface for layers {[c.layer for c in calls]}, not once "
                f"for each of its {len(layers)} layers in order (layers without standard attention)")
    for call, layer in zip(calls, layers):
        if problem := call.problem(text, layer):
            return f"{name}: layer {call.layer}: {problem}"
    return None


class _ProbeCall:
    def __init__(self, layer: int, stored: bool, query, key, value, kwargs: dict):
        self.layer, self.stored, self.kwargs = layer, stored, kwargs
        self.shapes = tuple(tuple(t.shape) for t in (query, key, value))

    def problem(self, text, layer) -> str | None:
        (_, q_heads, q_len, dim), key, value = self.shapes
        if not self.stored:
            return "its keys and values are not stored in the cache (shared from another layer?)"
        if key != value or key[1:] != (text.num_key_value_heads, q_len, model_head_dim(text)) or dim != key[3]:
            return f"query {self.shapes[0]}, key {key} and value {value} are not [B, H, 1, head_dim] of one head size"
        if q_heads % key[1]:
            return f"{q_heads} query heads do not share {key[1]} KV heads evenly"
        if unknown := unknown_arguments(self.kwargs):
            return f"its attention takes {unknown}, which the KIVI attentions do not apply"
        if self.kwargs.get("sliding_window") != layer.window:
            return (f"its attention slides over {self.kwargs.get('sliding_window')} tokens where its config declares "
                    f"{layer.window}")
        return None


class _ProbeLayer(CacheLayerMixin):
    is_sliding = False

    def __init__(self, stored: list[int], layer: int):
        super().__init__()
        self.stored, self.layer = stored, layer

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        self.stored.append(self.layer)
        return key_states, value_states

    def get_seq_length(self) -> int:
        raise NotImplementedError("the forward reads the cache's length, which differs per slot")

    def get_mask_sizes(self, query_length: int):
        raise NotImplementedError("the forward builds a mask from the cache")

    def get_max_length(self) -> int:
        return -1


def _probe(model: PreTrainedModel) -> list[_ProbeCall]:
    """Run one decode step of two slots through the model's forward with a recording attention."""
    text = model.config.get_text_config(decoder=True)
    stored: list[int] = []
    cache = Cache(layers=[_ProbeLayer(stored, i) for i in range(text.num_hidden_layers)])
    calls: list[_ProbeCall] = []

    def record(module, query, key, value, attention_mask, **kwargs):
        calls.append(_ProbeCall(module.layer_idx, module.layer_idx in stored, query, key, value, kwargs))
        return torch.zeros_like(query).transpose(1, 2), None

    AttentionInterface.register(PROBE, record)
    before = model.config._attn_implementation
    model.config._attn_implementation = PROBE
    try:
        tokens = torch.zeros(2, 1, dtype=torch.long, device=model.device)
        with torch.inference_mode():
            model(input_ids=tokens, position_ids=tokens + 3, past_key_values=cache, use_cache=True, logits_to_keep=1)
    finally:
        model.config._attn_implementation = before
    return calls


def _next_logits(model: PreTrainedModel, tokens: torch.Tensor, positions: torch.Tensor, cache: SlotCache) -> torch.Tensor:
    """The model's forward on one token per slot: logits [B, V] of the next token."""
    out = model(input_ids=tokens[:, None], position_ids=positions[:, None].long(), past_key_values=cache,
                use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


class DecodeStep:
    """The step function of one model: ``step(cache, tokens)`` eagerly, ``capture(cache, tokens)`` as a graph."""

    def __init__(self, model: PreTrainedModel, compile_steps: bool | None = None):
        """``compile_steps`` (default: on CUDA) compiles the forward."""
        if reason := unsupported(model):
            raise UnsupportedModelError(reason)
        self.model = model
        self.compiled = model.device.type == "cuda" if compile_steps is None else compile_steps
        self._logits: Callable = torch.compile(_next_logits, fullgraph=True) if self.compiled else _next_logits

    def step(self, cache: SlotCache, tokens: torch.Tensor, sampling: SlotSampling | None = None) -> None:
        """One decode step for every slot: tokens [B] in, the next tokens written back into it (greedy, or chosen
        with each slot's ``sampling`` for the position after its input token)."""
        with stepping(self.model, cache):
            logits = self._logits(self.model, tokens, cache.positions, cache)
        tokens.copy_(logits.argmax(-1) if sampling is None else next_tokens(logits, sampling, cache.positions + 1))
        cache.advance()

    def capture(self, cache: SlotCache, tokens: torch.Tensor, sampling: SlotSampling | None = None) -> torch.cuda.CUDAGraph:
        """Warm up, then capture one step. The warm-up step (it compiles the forward and the kernels and sets up
        cuBLAS) writes only what the first real step rewrites; a second one would overwrite value-ring rows that
        step still reads."""
        device = tokens.device
        saved = cache.positions.clone(), tokens.clone()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self.step(cache, tokens, sampling)
        torch.cuda.current_stream(device).wait_stream(side)
        cache.positions.copy_(saved[0])
        tokens.copy_(saved[1])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.step(cache, tokens, sampling)
        return graph
