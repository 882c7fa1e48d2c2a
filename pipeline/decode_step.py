"""One decode step of a stock transformers decoder over a SlotCache, with fixed shapes for a CUDA graph.

``transformers.generate`` spends most of a decode step in Python (tens of ms per step for a 7B model at any
batch). Here a step walks the model's own modules: embeddings and rotary tables, then per layer the input
norm, q/k/v projections and rotation, the cache's ``step`` (store the token, attend, KIVI's flush, all on
the device), o projection, residual, post-attention norm, MLP, residual; final norm, LM head, the next token
(argmax, or pipeline.sampling where a sequence samples), then the positions of the active slots + 1. Every
shape is fixed for a cache's lifetime, so on CUDA the step is captured once in a CUDA graph and replayed;
elsewhere it runs eagerly.

On CUDA the parts between two attentions are compiled (torch.compile, one graph shared by every layer): a
7B model's step is otherwise about 1,300 small kernels, half of its time at batch 1. The layer structure is
the pre-norm decoder of Llama, Mistral and Qwen2; ``unsupported`` says why another model is not driven.
"""

from __future__ import annotations

import sys

import torch
from transformers import PreTrainedModel

from kivi.cache import mixed_layer_types
from kivi.slot_cache import SlotCache
from pipeline.sampling import SlotSampling, next_tokens

LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")


class UnsupportedModelError(ValueError):
    """The model's layout is not the decoder-only one the step drives."""


def unsupported(model: PreTrainedModel) -> str | None:
    """Why the step cannot drive this model (None when it can)."""
    base = model.get_decoder()
    missing = [n for n in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(base, n)]
    missing += [] if hasattr(model, "lm_head") else ["lm_head"]
    layer = base.layers[0] if hasattr(base, "layers") else None
    missing += [f"layers[0].{n}" for n in LAYER_PARTS if not hasattr(layer, n)]
    attn = getattr(layer, "self_attn", None)
    missing += [f"self_attn.{n}" for n in ATTENTION_PARTS if not hasattr(attn, n)]
    extra = [f"self_attn.{n}" for n in ("q_norm", "k_norm") if hasattr(attn, n)]
    if _rotation(attn) is None:
        missing.append("apply_rotary_pos_emb")
    if missing or extra:
        return (f"{type(model).__name__}: the decode engine drives pre-norm decoders laid out as Llama, Mistral or Qwen2 "
                f"({', '.join(LAYER_PARTS)}; attention {', '.join(ATTENTION_PARTS)}, apply_rotary_pos_emb); "
                f"missing {missing}, unexpected {extra}")
    if layer_types := mixed_layer_types(model.config.get_text_config(decoder=True)):
        return f"{type(model).__name__}: the decode engine supports full-attention layers only, not {layer_types}"
    return None


def _rotation(attn):
    """The attention module's own apply_rotary_pos_emb (its modeling file's)."""
    return getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)


class DecodeStep:
    """The step function of one model: ``step(cache, tokens)`` eagerly, ``capture(cache, tokens)`` as a graph."""

    def __init__(self, model: PreTrainedModel, compile_steps: bool | None = None):
        """``compile_steps`` (default: on CUDA) compiles the parts between attentions."""
        if reason := unsupported(model):
            raise UnsupportedModelError(reason)
        self.model, self.base = model, model.get_decoder()
        self.layers = list(self.base.layers)
        self.rotate = _rotation(self.layers[0].self_attn)
        compile_steps = model.device.type == "cuda" if compile_steps is None else compile_steps
        wrap = torch.compile if compile_steps else (lambda fn: fn)
        self._enter, self._between, self._exit = wrap(_enter), wrap(_between), wrap(_exit)

    def step(self, cache: SlotCache, tokens: torch.Tensor, sampling: SlotSampling | None = None) -> None:
        """One decode step for every slot: tokens [B] in, the next tokens written back into it (greedy, or chosen
        with each slot's ``sampling``)."""
        base, layers = self.base, self.layers
        hidden, rotary, (q, k, v) = self._enter(base.embed_tokens, base.rotary_emb, layers[0], tokens,
                                                cache.positions, self.rotate)
        for i, layer in enumerate(layers):
            attn = cache.layers[i].step(q, k, v, layer.self_attn.scaling)
            if i + 1 < len(layers):
                hidden, (q, k, v) = self._between(layer, layers[i + 1], hidden, attn, rotary, self.rotate)
            else:
                tokens.copy_(self._exit(layer, base.norm, self.model.lm_head, hidden, attn, sampling, cache.positions))
        cache.advance()

    def capture(self, cache: SlotCache, tokens: torch.Tensor, sampling: SlotSampling | None = None) -> torch.cuda.CUDAGraph:
        """Warm up, then capture one step. The warm-up step (it compiles the kernels and sets up cuBLAS) writes only
        what the first real step rewrites; a second one would overwrite value-ring rows that step still reads."""
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


# The step between two attentions, in the modules' own order (transformers' LlamaDecoderLayer, LlamaAttention).

def _qkv(layer, hidden: torch.Tensor, rotary, rotate):
    """Input norm, projections and rotation of ``layer``: q, k, v [B, H, 1, D]."""
    attn = layer.self_attn
    x = layer.input_layernorm(hidden)
    shape = (*x.shape[:-1], -1, attn.head_dim)
    q, k, v = (proj(x).view(shape).transpose(1, 2) for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    q, k = rotate(q, k, *rotary)
    return q, k, v


def _finish(layer, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """The rest of ``layer`` after its attention output [B, Hq, 1, D]: o projection, residuals, MLP."""
    hidden = hidden + layer.self_attn.o_proj(attn_out.transpose(1, 2).reshape(*hidden.shape[:-1], -1))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def _enter(embed, rotary_emb, layer, tokens: torch.Tensor, positions: torch.Tensor, rotate):
    hidden = embed(tokens[:, None])
    rotary = rotary_emb(hidden, position_ids=positions[:, None].long())
    return hidden, rotary, _qkv(layer, hidden, rotary, rotate)


def _between(layer, next_layer, hidden: torch.Tensor, attn_out: torch.Tensor, rotary, rotate):
    hidden = _finish(layer, hidden, attn_out)
    return hidden, _qkv(next_layer, hidden, rotary, rotate)


def _exit(layer, norm, lm_head, hidden: torch.Tensor, attn_out: torch.Tensor, sampling: SlotSampling | None,
          positions: torch.Tensor) -> torch.Tensor:
    """The next tokens [B]: greedy, or chosen with ``sampling`` for the position after each slot's input token."""
    logits = lm_head(norm(_finish(layer, hidden, attn_out)[:, -1]))
    return logits.argmax(-1) if sampling is None else next_tokens(logits, sampling, positions + 1)
