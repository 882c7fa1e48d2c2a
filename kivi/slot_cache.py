"""SlotCache: preallocated KIVI (or 16-bit) buffers for a decode loop that a CUDA graph can capture.

Every buffer is sized at construction for a number of slots and a capacity per slot; per slot only one count
lives on the device, ``positions`` (tokens stored before the current step), and a flag, ``active`` (whether a
sequence decodes there: an idle slot's step writes at position 0 and goes nowhere, so a slot can be released
and loaded again between steps, as continuous batching does). Every other count follows from the position and
KIVI's flush rules, so a decode step never asks the host anything:

- keys (groups of G tokens per channel) flush in blocks of KB = R tokens (G when R = 0): the step that
  appends position t attends over floor(t / KB) * KB quantized keys and the rest in a residual of KB rows,
  position i at row i % KB.
- values (groups of G channels per token) keep the newest R tokens, plus the one just appended, in a ring
  of R + 1 rows (position i at row i % (R + 1)): the step attends over t - R quantized values.

A step flushes what the step before completed before it stores its token in the rows that frees: a full key
block (t ≡ 0 mod KB), the value that left the window (position t - R - 1); on CUDA one kernel launch a layer does
both (``kivi.kernels.quantize.append_step``). These are KVStream's rules (kivi.stream), so a step attends over the
codes a KiviCache would hold.

The prompt is not run here: the engine runs the stock model on it (exact attention) and ``load`` stores the
keys and values. A decode step is the model's own forward with this cache as its ``past_key_values``; each
attention layer calls its slot layer's ``attend`` (``kivi.slot_attention``): flush and store the step's token,
attend. On CUDA the kernels do both; on the CPU (tests, smoke runs) the kivi/ oracle does, with the same results.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from kivi import backend
from kivi.cache import check_fits_model
from kivi.config import KiviConfig, KiviConfigError, slot_unsupported
from kivi.layout import attention_layers, model_head_dim, unsupported_layout
from kivi.quant import GROUP_DIM, Quantized, StreamBuffers, allocate, codes_per_word, dequantize, quantize
from kivi.stream import round_up


class StepState:
    """What every layer of a SlotCache shares: the positions and what a step derives from them once."""

    def __init__(self, batch: int, capacity: int, dtype: torch.dtype, device: torch.device, use_kernels: bool):
        self.batch, self.capacity, self.dtype, self.device, self.use_kernels = batch, capacity, dtype, device, use_kernels
        self.positions = torch.zeros(batch, dtype=torch.int32, device=device)  # tokens stored before this step
        self.active = torch.zeros(batch, dtype=torch.int32, device=device)  # 1 where a sequence decodes
        self.batch_index = torch.arange(batch, device=device)
        self._derived: dict = {}

    def advance(self) -> None:
        self.positions += self.active
        self._derived.clear()

    def lengths(self) -> torch.Tensor:
        """int32 [B]: tokens attended in this step (the stored ones and the step's own)."""
        if "lengths" not in self._derived:
            self._derived["lengths"] = self.positions + 1
        return self._derived["lengths"]

    def ring(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row of this step's token in a dense layer of ``rows`` rows (position % rows) and the rows it attends
        (min(position + 1, rows)), [B] each: for a full layer (rows = capacity) its position and length."""
        if ("ring", rows) not in self._derived:
            self._derived[("ring", rows)] = (self.positions % rows, (self.positions + 1).clamp(max=rows))
        return self._derived[("ring", rows)]

    def slots(self, config: KiviConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of this step's token in the key residual and in the value ring, [B] each (the oracle's stores)."""
        key = ("slots", config.keys.block, config.values.window)
        if key not in self._derived:
            self._derived[key] = (self.positions % config.keys.block, self.positions % (config.values.window + 1))
        return self._derived[key]

    def counts(self, config: KiviConfig) -> torch.Tensor:
        """int32 [4, B] for the decode kernel: sinks, quantized keys, quantized values, tokens."""
        key = ("counts", config.keys.block, config.values.window)
        if key not in self._derived:
            pos = self.positions
            self._derived[key] = torch.stack([torch.zeros_like(pos), config.keys.quantized(pos),
                                              config.values.quantized(pos), pos + 1])
        return self._derived[key]


class _SlotLayer(CacheLayerMixin):
    """One layer of a SlotCache. As a transformers cache layer, ``update`` only hands the step's keys and values on:
    the "kivi-slots" attention (``kivi.slot_attention``) flushes, stores them and attends in one call of ``attend``.

    Kernels take head sizes of a few powers of two; another size (Phi-3's 96) is stored zero-padded to the next one
    they take: zero channels add nothing to q . k, quantize to exact zeros, and are cut from the output.
    """

    is_sliding = False

    def __init__(self, state: StepState, head_dim: int, kernel_dim: int | None):
        super().__init__()
        self.state, self.head_dim = state, head_dim
        self.stored_dim = kernel_dim if state.use_kernels and kernel_dim else head_dim
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return key_states, value_states

    def get_seq_length(self) -> int:
        raise NotImplementedError("SlotCache: every slot has its own length; pass position_ids (SlotCache.positions)")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise NotImplementedError("SlotCache: the kivi-slots attention needs no mask")

    def get_max_length(self) -> int:
        return self.state.capacity

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float,
               softcap: float | None) -> torch.Tensor:
        """Flush what the step before completed, store the step's key/value [B, Hkv, 1, D] at each sequence's
        position, attend with query [B, Hq, 1, D]. Returns [B, Hq, 1, D]."""
        query, key, value = (self._padded(x) for x in (query, key, value))
        out = self._attend(query, key[:, :, 0], value[:, :, 0], scaling, softcap)
        return out[..., : self.head_dim].contiguous() if self.stored_dim != self.head_dim else out

    def load(self, rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, lengths: torch.Tensor) -> None:
        """Store prompts: keys/values [b, Hkv, T, D] right-padded, sequence j real at [0, lengths[j])."""
        self._load(rows, self._padded(keys), self._padded(values), lengths)

    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.stored_dim == self.head_dim else torch.nn.functional.pad(x, (0, self.stored_dim - self.head_dim))

    def nbytes(self, float_bytes: int | None = None) -> int:
        return sum(t.numel() * (float_bytes or t.element_size()) if t.is_floating_point() else t.nbytes
                   for t in self._buffers())


class DenseSlotLayer(_SlotLayer):
    """Keys and values in the model dtype: the fp16 baseline's layers, and every sliding-window layer.

    A full-attention layer holds the whole capacity, position i at row i. A sliding layer holds a ring of the
    window, position i at row i % rows: the step's token overwrites the one that leaves the window, and the layer
    attends over the first min(position + 1, rows) rows, in any order (attention does not depend on it).
    """

    def __init__(self, state: StepState, kv_heads: int, head_dim: int, window: int | None = None):
        super().__init__(state, head_dim, backend.dense_head_dim(head_dim))
        self.window, self.is_sliding = window, window is not None
        self.rows = state.capacity if window is None else min(window, state.capacity)
        shape = (state.batch, kv_heads, self.rows, self.stored_dim)
        self.keys = torch.zeros(shape, dtype=state.dtype, device=state.device)
        self.values = torch.zeros_like(self.keys)
        if state.use_kernels:
            self.num_splits = backend.dense_splits(state.batch, kv_heads, self.rows, state.device)

    def _load(self, rows, keys, values, lengths):
        if self.window is None:
            self.keys[rows, :, : keys.shape[2]] = keys
            self.values[rows, :, : keys.shape[2]] = values
            return
        # ring row r <- the newest position p < length with p % rows == r (rows past a short prompt: never read)
        last = lengths[:, None].long() - 1
        position = last - (last - torch.arange(self.rows, device=keys.device)) % self.rows
        at = position.clamp(0, keys.shape[2] - 1)[:, None, :, None].expand(-1, keys.shape[1], -1, keys.shape[3])
        self.keys[rows], self.values[rows] = keys.gather(2, at), values.gather(2, at)

    def _attend(self, query, key, value, scaling, softcap):
        row, lengths = self.state.ring(self.rows)
        if self.state.use_kernels:
            backend.dense_store(key, value, self.keys, self.values, row)
            return backend.dense_attention(query, self.keys, self.values, lengths, scaling, self.num_splits,
                                           _output(query), softcap=softcap)
        index = self.state.batch_index
        self.keys[index, :, row] = key
        self.values[index, :, row] = value
        longest = int(lengths.max())  # the oracle reads what is stored, not the whole capacity
        return backend.oracle_attention(query, self.keys[:, :, :longest].float(), self.values[:, :, :longest].float(),
                                        lengths, scaling, softcap)

    def _buffers(self):
        return (self.keys, self.values)


class KiviSlotLayer(_SlotLayer):
    """Packed codes, scales and zeros for the whole capacity, a key residual of KB rows, a value ring of R + 1."""

    def __init__(self, state: StepState, config: KiviConfig, kv_heads: int, head_dim: int):
        super().__init__(state, head_dim, backend.kivi_head_dim(head_dim))
        self.config = config
        head_dim = self.stored_dim
        g = config.group_size
        self.key_block, self.window = config.keys.block, config.values.window
        batch, capacity, dtype, device = state.batch, state.capacity, state.dtype, state.device
        key_tokens = round_up(capacity, self.key_block)
        self.keys = allocate((batch, kv_heads, key_tokens, head_dim), config.k_bits, g, config.key_axis, dtype, device)
        self.values = allocate((batch, kv_heads, capacity, head_dim), config.v_bits, g, config.value_axis, dtype, device)
        self.key_resid = torch.zeros(batch, kv_heads, self.key_block, head_dim, dtype=dtype, device=device)
        self.value_ring = torch.zeros(batch, kv_heads, self.window + 1, head_dim, dtype=dtype, device=device)
        self.view: torch.Tensor | None = None  # oracle path: float32 [2, B, Hkv, capacity, D], keys then values
        if state.use_kernels:
            no_sinks = torch.empty(batch, kv_heads, 0, head_dim, dtype=dtype, device=device)
            self.key_buffers = StreamBuffers(no_sinks, self.keys, self.key_resid)
            self.value_buffers = StreamBuffers(no_sinks, self.values, self.value_ring)
            self.num_splits: int | None = None  # the serving kernel's choice for the capacity (tests set others)

    def _load(self, rows, keys, values, lengths):
        """Whole key blocks and every value are quantized at once; a group that mixes a sequence's tail with
        padding is never read (it lies past that sequence's quantized keys) and is overwritten by its flush."""
        cfg, kb, w = self.config, self.key_block, self.window
        tokens = keys.shape[2]
        whole = cfg.keys.quantized(tokens)
        if whole:
            q = backend.quantize(keys[:, :, :whole], cfg.keys)
            for buf, part in zip(self.keys, q):
                buf[rows, :, : part.shape[2]] = part
        q = backend.quantize(values, cfg.values)
        for buf, part in zip(self.values, q):
            buf[rows, :, :tokens] = part
        seq = torch.arange(len(lengths), device=keys.device)[:, None]
        # key residual row s <- position s of the block the prompt's last token lies in (a full one is quantized
        # again, to the same codes, by the first step's flush); value ring row s <- the position of the last R + 1
        # with i % (R + 1) = s
        key_pos = cfg.keys.quantized(lengths[:, None] - 1) + torch.arange(kb, device=keys.device)
        first = lengths[:, None] - w - 1
        ring_pos = first + (torch.arange(w + 1, device=keys.device) - first) % (w + 1)
        self.key_resid[rows] = keys[seq, :, key_pos.clamp(0, tokens - 1)].transpose(1, 2)
        self.value_ring[rows] = values[seq, :, ring_pos.clamp(0, tokens - 1)].transpose(1, 2)
        self.view = None  # the oracle's float32 view is rebuilt at the next step

    def _attend(self, query, key, value, scaling, softcap):
        cfg = self.config
        if self.state.use_kernels:
            backend.append(key, value, self.key_resid, self.value_ring, self.keys, self.values, self.state.positions, cfg)
            return backend.decode(query, self.key_buffers, self.value_buffers, self.state.counts(cfg), cfg, scaling,
                                  self.state.capacity, _output(query), v_ring=True, softcap=softcap,
                                  num_splits=self.num_splits)
        self._flush_oracle()
        index = self.state.batch_index
        key_slot, value_slot = self.state.slots(cfg)
        self.key_resid[index, :, key_slot] = key
        self.value_ring[index, :, value_slot] = value
        lengths = self.state.lengths()
        if self.view is None:  # every stored token as attention reads it, built once per load and kept current
            keys, values = self._materialize()
            self.view = torch.zeros(2, *keys.shape[:2], self.state.capacity, keys.shape[3], device=keys.device)
            self.view[0, :, :, : keys.shape[2]], self.view[1, :, :, : keys.shape[2]] = keys, values
        else:
            self.view[0, index, :, self.state.positions.long()] = key.float()
            self.view[1, index, :, self.state.positions.long()] = value.float()
        longest = int(lengths.max())
        return backend.oracle_attention(query, self.view[0, :, :, :longest], self.view[1, :, :, :longest], lengths,
                                        scaling, softcap)

    def _materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every stored token of every sequence as attention reads it: float32 [B, Hkv, max length, D]."""
        cfg, kb, w = self.config, self.key_block, self.window
        _, n_qk, n_qv, lengths = self.state.counts(cfg)[:, :, None, None, None]
        i = torch.arange(int(lengths.max()), device=lengths.device)
        from_resid = i[:, None] >= n_qk  # [B, 1, L, 1]: keys past the last full block
        from_ring = i[:, None] >= n_qv  # values inside the window
        # Only the stored prefix is dequantized: whole key groups, the values' tokens.
        key_groups = round_up(len(i), cfg.group_size) // cfg.group_size
        keys = Quantized(self.keys.codes[:, :, : key_groups * cfg.group_size // codes_per_word(cfg.k_bits)],
                         self.keys.scale[:, :, :key_groups], self.keys.zero[:, :, :key_groups])
        values = Quantized(*(buf[:, :, : len(i)] for buf in self.values))
        deq_k = dequantize(keys, cfg.k_bits, cfg.group_size, GROUP_DIM["channel"])[:, :, : len(i)]
        deq_v = dequantize(values, cfg.v_bits, cfg.group_size, GROUP_DIM["token"])
        keys = torch.where(from_resid, self.key_resid[:, :, i % kb].float(), deq_k)
        values = torch.where(from_ring, self.value_ring[:, :, i % (w + 1)].float(), deq_v)
        return keys, values

    def _flush_oracle(self) -> None:
        """KIVI's flush of what the step before completed (``append_step``'s, on the oracle); the float32 view, once
        built, follows."""
        cfg, kb, w, g = self.config, self.key_block, self.window, self.config.group_size
        kw = codes_per_word(cfg.k_bits)
        pos = self.state.positions.long()
        for b in ((pos % kb == 0) & (pos > 0)).nonzero()[:, 0].tolist():  # a full key block: rare, one sequence at a time
            q = quantize(self.key_resid[b : b + 1], cfg.k_bits, g, GROUP_DIM["channel"])
            first = int(pos[b]) - kb
            for buf, part, row in zip(self.keys, q, (first // kw, first // g, first // g)):
                buf[b, :, row : row + part.shape[2]] = part[0]
            if self.view is not None:
                self.view[0, b, :, first : first + kb] = dequantize(q, cfg.k_bits, g, GROUP_DIM["channel"])[0]
        leaving = (pos > w).nonzero()[:, 0]  # each of these sequences quantizes the value at position t - R - 1
        if len(leaving):
            i = pos[leaving] - w - 1
            q = quantize(self.value_ring[leaving, :, i % (w + 1)][:, :, None], cfg.v_bits, g, GROUP_DIM["token"])
            for buf, part in zip(self.values, q):
                buf[leaving, :, i] = part[:, :, 0]
            if self.view is not None:
                self.view[1, leaving, :, i] = dequantize(q, cfg.v_bits, g, GROUP_DIM["token"])[:, :, 0]

    def _buffers(self):
        return (*self.keys, *self.values, self.key_resid, self.value_ring)


class SlotCache(Cache):
    """A slot cache for every layer, handed to the model's forward in decode steps (``past_key_values``): KIVI's
    full-attention layers when ``kivi`` is given, else the model dtype (the fp16 baseline); sliding-window layers
    keep their window in the model dtype under either (``kivi.layout``).

    ``use_kernels`` (default: on CUDA) runs the Triton kernels, which a CUDA graph can capture; off, the
    kivi/ oracle serves (it reads counts on the host).
    """

    def __init__(self, model_config: PretrainedConfig, batch: int, capacity: int, dtype: torch.dtype,
                 device: torch.device | str, kivi: KiviConfig | None = None, use_kernels: bool | None = None):
        text = model_config.get_text_config(decoder=True)
        if kivi is not None:
            if reason := slot_unsupported(kivi):
                raise KiviConfigError(f"KiviConfig: {reason}")
            check_fits_model(kivi, text)
        elif reason := unsupported_layout(text):
            raise KiviConfigError(f"SlotCache: {reason}")
        device = torch.device(device)
        self.state = StepState(batch, capacity, dtype, device, device.type == "cuda" if use_kernels is None else use_kernels)
        kv_heads, head_dim = text.num_key_value_heads, model_head_dim(text)
        layers = attention_layers(text)
        super().__init__(layers=[
            DenseSlotLayer(self.state, kv_heads, head_dim, layer.window) if kivi is None or layer.sliding
            else KiviSlotLayer(self.state, kivi.for_layer(i), kv_heads, head_dim)
            for i, layer in enumerate(layers)
        ])
        self._sliding = [layer.sliding for layer in layers]

    @property
    def is_sliding(self) -> list[bool]:
        """As transformers' masks read it; from the layout, not the layers, so a compiled forward guards on these
        values only (the fp16 and KIVI caches of a model share them)."""
        return self._sliding

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Hands the step's keys and values on to the "kivi-slots" attention, which stores them (as every layer's
        ``update`` does). Written here, reading no layer, so that a compiled forward depends on no layer's type:
        one compiled step serves fp16 and KIVI caches alike."""
        return key_states, value_states

    @property
    def positions(self) -> torch.Tensor:
        return self.state.positions

    @property
    def capacity(self) -> int:
        return self.state.capacity

    @property
    def use_kernels(self) -> bool:
        return self.state.use_kernels

    def load(self, rows: torch.Tensor, layer_kv: list[tuple[torch.Tensor, torch.Tensor]], lengths: torch.Tensor) -> None:
        """Store the prompts of sequences in slots ``rows``: per layer (keys, values) [b, Hkv, T, D], right-padded,
        every position of the prompt (a sliding layer keeps its window of them). The slots become active."""
        if lengths.device.type == "cpu" and int(lengths.max()) > self.capacity:  # (read on the device, it would sync)
            raise ValueError(f"SlotCache: a prompt of {int(lengths.max())} tokens exceeds the capacity {self.capacity}")
        lengths = to_device(lengths.to(torch.int32), self.state.device)
        for layer, (keys, values) in zip(self.layers, layer_kv, strict=True):
            layer.load(rows, keys.to(self.state.dtype), values.to(self.state.dtype), lengths)
        self.positions[rows] = lengths
        self.state.active[rows] = 1

    def release(self, rows: torch.Tensor) -> None:
        """Slots ``rows`` go idle (their sequences ended): position 0, no longer advanced, free for ``load``."""
        self.positions[rows] = 0
        self.state.active[rows] = 0

    def advance(self) -> None:
        """End of a decode step: every sequence holds one more token."""
        self.state.advance()

    def kv_bytes(self, float_bytes: int | None = None) -> int:
        """Bytes of every cache buffer (allocated for the whole capacity). ``float_bytes`` counts each element in
        the model dtype (dense K/V, scales, zeros, residuals) at that size: 2 gives the cache of a 16-bit model."""
        return sum(layer.nbytes(float_bytes) for layer in self.layers)


def _output(query: torch.Tensor) -> torch.Tensor:
    """The attention output [B, Hq, 1, D] with standard strides, as the slot attention operator declares it (the
    kernels' default, ``empty_like(query)``, would keep a transposed query's strides)."""
    return torch.empty(query.shape, dtype=query.dtype, device=query.device)


def to_device(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without waiting for the work queued there: a copy from pageable memory
    would drain the stream first, so every such copy would idle the GPU while the host prepares the next step."""
    if device.type != "cuda" or x.device.type == "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)
