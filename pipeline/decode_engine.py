"""Greedy batch decoding for throughput: the stock model on the prompts, then static decode steps in a CUDA graph.

``transformers.generate`` spends most of a decode step in Python (tens of ms per step for a 7B model at any
batch), so a throughput figure measured through it measures the host. Here:

1. prefill: the model's own forward on the prompts, right-padded, in micro-batches of similar lengths and about
   ``prefill_tokens`` tokens (exact attention, as KIVI prescribes; 4K tokens keep GEMMs efficient while the
   micro-batch's fp16 keys and values, 2 GiB for a 7B model, stay small beside the cache), each micro-batch's keys and values
   stored into a ``StaticCache`` (quantized there under KIVI) and its first greedy token taken;
2. decode: one step walks the model's own modules: embeddings and rotary tables, then per layer the
   input norm, q/k/v projections and rotation, the cache's ``step`` (store the token, attend, KIVI's flush,
   all on the device), o projection, residual, post-attention norm, MLP, residual; final norm, LM head,
   argmax, positions + 1. Every shape is fixed for the whole run, so on CUDA the step is captured once in a
   CUDA graph and replayed; elsewhere it runs eagerly.

On CUDA the parts between two attentions are compiled (torch.compile, one graph shared by every layer): a
7B model's step is otherwise about 1,300 small kernels, half of its time at batch 1. The layer structure is
the pre-norm decoder of Llama, Mistral and Qwen2; other models are refused.

Every sequence decodes the same number of tokens (EOS ignored, as throughput benchmarks do).
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from kivi import KiviConfig
from kivi.cache import FP16_BYTES, mixed_layer_types
from kivi.static_cache import StaticCache

LAYER_PARTS = ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp")
ATTENTION_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")


class UnsupportedModelError(ValueError):
    """The model's layout is not the decoder-only one the engine drives."""


@dataclass(frozen=True)
class DecodeRun:
    tokens: torch.Tensor  # [B, new_tokens] int64 on the CPU: the first from the prefill, the rest from decode steps
    prefill_s: float
    decode_s: float  # new_tokens - 1 decode steps
    capture_s: float  # warm-up and graph capture (0 without a graph)
    peak_mem_bytes: int | None  # CUDA: the run's peak allocated memory, weights included
    cache_bytes: int  # the static cache's buffers, model-dtype elements at 16 bits: that cache in a 16-bit model

    @property
    def step_s(self) -> float:
        return self.decode_s / max(self.tokens.shape[1] - 1, 1)


class DecodeEngine:
    def __init__(self, model: PreTrainedModel, prefill_tokens: int = 4096, cuda_graph: bool = True,
                 compile_steps: bool | None = None):
        """``compile_steps`` (default: on CUDA) compiles the parts between attentions."""
        self.rotate = _check_supported(model)
        self.model, self.base = model, model.get_decoder()
        self.layers = list(self.base.layers)
        self.prefill_tokens, self.cuda_graph = prefill_tokens, cuda_graph
        self.device, self.dtype = model.device, model.dtype
        compile_steps = self.device.type == "cuda" if compile_steps is None else compile_steps
        wrap = torch.compile if compile_steps else (lambda fn: fn)
        self._enter, self._between, self._exit = wrap(_enter), wrap(_between), wrap(_exit)

    @torch.inference_mode()
    def run(self, prompts: list[list[int]], new_tokens: int, kivi: KiviConfig | None) -> DecodeRun:
        """Greedy ``new_tokens`` tokens for every prompt (token ids), batched together; fp16 cache when kivi is None.

        Raises torch.OutOfMemoryError when the batch does not fit.
        """
        if not prompts or min(map(len, prompts)) == 0 or new_tokens < 1:
            raise ValueError("DecodeEngine.run: needs non-empty prompts and new_tokens >= 1")
        cuda = self.device.type == "cuda"
        gc.collect()  # the last run's buffers, if an exception kept them alive
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        lengths = torch.tensor([len(p) for p in prompts])
        # the last generated token is never stored
        cache = StaticCache(self.model.config, len(prompts), int(lengths.max()) + new_tokens - 1, self.dtype, self.device, kivi)
        out = torch.empty(len(prompts), new_tokens, dtype=torch.long, device=self.device)
        began = time.perf_counter()
        out[:, 0] = self._prefill(prompts, lengths, cache)
        self._sync()
        prefill_s = time.perf_counter() - began

        tokens = out[:, 0].clone()  # the step's input and, after it, its output
        began = time.perf_counter()
        step = self._capture(cache, tokens) if cuda and self.cuda_graph and cache.use_kernels else None
        self._sync()
        capture_s = time.perf_counter() - began if step else 0.0
        began = time.perf_counter()
        for i in range(1, new_tokens):
            step.replay() if step else self._step(cache, tokens)
            out[:, i] = tokens
        self._sync()
        decode_s = time.perf_counter() - began
        return DecodeRun(out.cpu(), prefill_s, decode_s, capture_s,
                         torch.cuda.max_memory_allocated(self.device) if cuda else None, cache.kv_bytes(FP16_BYTES))

    def _prefill(self, prompts: list[list[int]], lengths: torch.Tensor, cache: StaticCache) -> torch.Tensor:
        """Run the model on the prompts in micro-batches, store their K/V; returns the first greedy tokens [B]."""
        first = torch.empty(len(prompts), dtype=torch.long, device=self.device)
        for rows in _micro_batches(lengths.tolist(), self.prefill_tokens):
            rows_lengths = lengths[rows]
            width = int(rows_lengths.max())
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            for j, row in enumerate(rows):
                ids[j, : len(prompts[row])] = torch.as_tensor(prompts[row])
            mask = torch.arange(width)[None, :] < rows_lengths[:, None]
            kv = DynamicCache(config=self.model.config)
            hidden = self.base(input_ids=ids.to(self.device), attention_mask=mask.to(self.device), past_key_values=kv,
                               use_cache=True).last_hidden_state
            last = hidden[torch.arange(len(rows), device=self.device), rows_lengths.to(self.device) - 1]
            index = torch.tensor(rows, device=self.device)
            first[index] = self.model.lm_head(last).argmax(-1)
            cache.load(index, [(layer.keys, layer.values) for layer in kv.layers], rows_lengths)
        return first

    def _step(self, cache: StaticCache, tokens: torch.Tensor) -> None:
        """One decode step for every sequence: tokens [B] in, the next greedy tokens written back into it."""
        base, layers = self.base, self.layers
        hidden, rotary, (q, k, v) = self._enter(base.embed_tokens, base.rotary_emb, layers[0], tokens,
                                                cache.positions, self.rotate)
        for i, layer in enumerate(layers):
            attn = cache.layers[i].step(q, k, v, layer.self_attn.scaling)
            if i + 1 < len(layers):
                hidden, (q, k, v) = self._between(layer, layers[i + 1], hidden, attn, rotary, self.rotate)
            else:
                tokens.copy_(self._exit(layer, base.norm, self.model.lm_head, hidden, attn))
        cache.advance()

    def _capture(self, cache: StaticCache, tokens: torch.Tensor) -> torch.cuda.CUDAGraph:
        """Warm up, then capture one step. The warm-up step (it compiles the kernels and sets up cuBLAS) writes only
        what the first real step rewrites; a second one would overwrite value-ring rows that step still reads."""
        saved = cache.positions.clone(), tokens.clone()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step(cache, tokens)
        torch.cuda.current_stream(self.device).wait_stream(side)
        cache.positions.copy_(saved[0])
        tokens.copy_(saved[1])
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step(cache, tokens)
        return graph

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _check_supported(model: PreTrainedModel):
    """Refuse a model whose layout the step does not follow; returns its module's apply_rotary_pos_emb."""
    base = model.get_decoder()
    missing = [n for n in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(base, n)]
    missing += [] if hasattr(model, "lm_head") else ["lm_head"]
    layer = base.layers[0] if hasattr(base, "layers") else None
    missing += [f"layers[0].{n}" for n in LAYER_PARTS if not hasattr(layer, n)]
    attn = getattr(layer, "self_attn", None)
    missing += [f"self_attn.{n}" for n in ATTENTION_PARTS if not hasattr(attn, n)]
    extra = [f"self_attn.{n}" for n in ("q_norm", "k_norm") if hasattr(attn, n)]
    rotate = getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)
    if missing or extra or rotate is None:
        raise UnsupportedModelError(
            f"{type(model).__name__}: the decode engine drives pre-norm decoders laid out as Llama, Mistral or Qwen2 "
            f"({', '.join(LAYER_PARTS)}; attention {', '.join(ATTENTION_PARTS)}, apply_rotary_pos_emb); "
            f"missing {missing + ([] if rotate else ['apply_rotary_pos_emb'])}, unexpected {extra}")
    if layer_types := mixed_layer_types(model.config.get_text_config(decoder=True)):
        raise UnsupportedModelError(f"{type(model).__name__}: the decode engine supports full-attention layers only, not {layer_types}")
    return rotate


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


def _exit(layer, norm, lm_head, hidden: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
    """The greedy next tokens [B]."""
    return lm_head(norm(_finish(layer, hidden, attn_out)[:, -1])).argmax(-1)


def _micro_batches(lengths: list[int], budget: int) -> Iterator[list[int]]:
    """Row indices, shortest prompt first, cut where the padded size (rows x longest prompt) would pass ``budget``
    tokens: prompts of similar length share a micro-batch, so little of the prefill goes to padding."""
    batch: list[int] = []
    for row in sorted(range(len(lengths)), key=lengths.__getitem__):
        if batch and lengths[row] * (len(batch) + 1) > budget:
            yield batch
            batch = []
        batch.append(row)
    yield batch
