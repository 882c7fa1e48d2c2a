"""KiviCache: a transformers ``Cache`` whose layers store keys and values the KIVI way."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from kivi import backend
from kivi.attention import exact_attention
from kivi.config import KiviConfig, KiviConfigError
from kivi.layout import attention_layers, model_head_dim, unsupported_layout
from kivi.quant import codes_per_word
from kivi.stream import KVStream

FP16_BYTES = 2


class KiviLayer(CacheLayerMixin):
    """One full-attention decoder layer's KIVI cache.

    ``update`` only hands the step's exact K/V to the attention; the "kivi" attention function then calls
    ``attend``, which stores them (dropping padding, which the attention mask reveals), attends, and
    flushes. So the layer's own forward always sees the exact K/V of the current step.
    """

    is_sliding = False

    def __init__(self, config: KiviConfig, use_kernels: bool = True):
        super().__init__()
        self.config, self.use_kernels = config, use_kernels
        self.key_stream, self.value_stream = KVStream(config.keys), KVStream(config.values)
        self.seen_tokens = 0  # including padding: the position frame transformers counts in
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self.pending is not None:
            raise RuntimeError(
                "KiviCache was updated twice without the KIVI attention running in between: "
                "call kivi.enable_kivi(model) so the model uses the 'kivi' attention implementation"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.pending = (key_states, value_states)
        self.seen_tokens += key_states.shape[-2]
        return key_states, value_states

    def attend(self, module: torch.nn.Module, query: torch.Tensor, attention_mask, scaling: float,
               softcap: float | None = None) -> torch.Tensor:
        """Store the pending step, attend over the whole cache, flush. Returns [B, q, Hq, D]."""
        keys, values = self.pending
        self.pending = None
        first_step = self.key_stream.resid is None
        valid = _real_tokens(attention_mask, keys.shape[-2], allow_padding=first_step)
        self.key_stream.append(keys, valid)
        self.value_stream.append(values, valid)
        if first_step:  # nothing cached before: exact attention over the prompt, padding masked as usual
            out = exact_attention(module, query, keys, values, attention_mask, scaling, softcap)
        elif self.use_kernels and query.is_cuda and backend.unsupported(self.config, query.shape) is None:
            out = backend.decode_attention(query, self.key_stream, self.value_stream, scaling, config=self.config,
                                           softcap=softcap)
            out = out.transpose(1, 2)
        else:
            lengths = torch.tensor(self.key_stream.lengths, device=query.device)
            out = backend.oracle_attention(
                query, self.key_stream.materialize(), self.value_stream.materialize(), lengths, scaling, softcap
            ).transpose(1, 2)
        self.key_stream.flush()
        self.value_stream.flush()
        return out

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("KiviCache does not support beam search; use greedy or sampling")

    def kv_bytes(self) -> int:
        return self.key_stream.nbytes() + self.value_stream.nbytes()

    def fp16_kv_bytes(self) -> int:
        if self.key_stream.resid is None:
            return 0
        heads, dim = self.key_stream.resid.shape[1], self.key_stream.resid.shape[3]
        return 2 * sum(self.key_stream.lengths) * heads * dim * FP16_BYTES


class WindowLayer(DynamicSlidingWindowLayer):
    """A sliding-window layer: its window in the model dtype, attended exactly (transformers' own layer)."""

    def kv_bytes(self) -> int:
        return 0 if not self.is_initialized else self.keys.nbytes + self.values.nbytes

    def fp16_kv_bytes(self) -> int:
        return 0 if not self.is_initialized else (self.keys.numel() + self.values.numel()) * FP16_BYTES


class KiviCache(Cache):
    """A KIVI cache for every layer of ``model_config`` (use with a model passed through ``enable_kivi``):
    full-attention layers quantized, sliding-window layers' windows in the model dtype (``kivi.layout``)."""

    def __init__(self, model_config: PretrainedConfig, config: KiviConfig | None = None, use_kernels: bool = True):
        """``use_kernels=False`` keeps CUDA tensors on the PyTorch oracle (for comparisons with the kernels)."""
        config = config or KiviConfig()
        text = model_config.get_text_config(decoder=True)
        check_fits_model(config, text)
        layers = [WindowLayer(layer.window) if layer.sliding else KiviLayer(config.for_layer(i), use_kernels)
                  for i, layer in enumerate(attention_layers(text))]
        super().__init__(layers=layers)
        self.config = config

    def kv_bytes(self) -> int:
        """Bytes held now: packed codes + scales + zeros + sinks + residuals, and sliding windows, all layers."""
        return sum(layer.kv_bytes() for layer in self.layers)

    def fp16_kv_bytes(self) -> int:
        """Bytes a 16-bit cache would hold for the same tokens."""
        return sum(layer.fp16_kv_bytes() for layer in self.layers)


def check_fits_model(config: KiviConfig, text: PretrainedConfig) -> None:
    """Raise KiviConfigError where ``config`` cannot hold the decoder of ``text`` (layout, layer indices, shapes)."""
    if reason := unsupported_layout(text):
        raise KiviConfigError(f"KiviCache: {reason}")
    head_dim = model_head_dim(text)
    for layer in config.layer_overrides:
        if layer >= text.num_hidden_layers:
            raise KiviConfigError(
                f"KiviConfig.layer_overrides[{layer}]: the model has {text.num_hidden_layers} layers (0..{text.num_hidden_layers - 1})"
            )
    for i in range(text.num_hidden_layers):
        cfg = config.for_layer(i)
        for stream in ("key", "value"):
            bits, axis = getattr(cfg, f"{stream[0]}_bits"), getattr(cfg, f"{stream}_axis")
            if bits < 16 and axis == "token" and head_dim % cfg.group_size:
                raise KiviConfigError(
                    f"KiviConfig.group_size={cfg.group_size} must divide the model's head_dim={head_dim} "
                    f"when {stream}s are grouped per token (layer {i})"
                )
            if bits < 16 and axis == "token" and head_dim % codes_per_word(bits):
                raise KiviConfigError(f"head_dim={head_dim} must be a multiple of {codes_per_word(bits)} for {bits}-bit {stream}s")


def _real_tokens(attention_mask, step_len: int, allow_padding: bool) -> torch.Tensor | None:
    """[B, step_len] bool of the step's real tokens from the 4D boolean mask, or None if all are real."""
    if attention_mask is None:
        return None
    valid = attention_mask[:, 0, -1, -step_len:].bool()  # the last query sees every real token of the step
    if bool(valid.all()):
        return None
    if not allow_padding:
        raise ValueError("KiviCache: padding is only supported in the first forward pass (left-padded prompts)")
    if bool((valid[:, :-1] & ~valid[:, 1:]).any()):
        raise ValueError("KiviCache: only left padding is supported (set tokenizer.padding_side = 'left')")
    return valid
