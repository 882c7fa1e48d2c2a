"""One layer's keys or values under KIVI: sink tokens, a packed quantized segment and a full-precision residual.

Each sequence of the batch is stored without its padding, starting at index 0, so quantization groups and
flushes follow the sequence's own token count: a sequence in a padded batch is stored exactly as if it ran
alone. Per sequence the tokens are, in order: ``n_sink`` sinks, ``n_quant`` quantized, ``n_resid`` residual.

Flush rules (KIVI Algorithm 1 and its reference implementation; ``kivi.config.StreamConfig`` holds them),
applied after each forward step:
- grouped along tokens (``axis="channel"``, keys): when the residual holds R tokens, all R are quantized at
  once; after a prefill of T tokens, floor(T / R) * R are quantized and T mod R stay in the residual.
- grouped along channels (``axis="token"``, values): the residual is a window of the newest R tokens;
  each token that leaves it is quantized.
With R = 0 a token-grouped stream flushes whenever a whole group of G tokens exists (a per-channel
group needs G tokens); a channel-grouped stream quantizes every token at once.
"""

from __future__ import annotations

import torch

from kivi import backend
from kivi.config import StreamConfig
from kivi.quant import GROUP_DIM, Quantized, StreamBuffers, allocate, codes_per_word, dequantize


class KVStream:
    def __init__(self, config: StreamConfig):
        self.config = config
        self.dim = GROUP_DIM[config.axis]
        self.n_sink: list[int] = []
        self.n_quant: list[int] = []
        self.n_resid: list[int] = []
        self.sink = self.resid = None  # [B, H, S, D], [B, H, capacity, D] in the model dtype
        self.packed: Quantized | None = None  # capacity buffers in the layout of kivi.quant
        # float32 [B, H, capacity, D]: every stored token as attention reads it, in position order. Built on the
        # first materialize() (the PyTorch path) and kept current, so each token is dequantized once, at flush.
        self.view: torch.Tensor | None = None

    @property
    def quantizes(self) -> bool:
        return self.config.quantizes

    @property
    def buffers(self) -> StreamBuffers:
        return StreamBuffers(self.sink, self.packed, self.resid)

    @property
    def lengths(self) -> list[int]:
        return [s + q + r for s, q, r in zip(self.n_sink, self.n_quant, self.n_resid)]

    # -- writing ---------------------------------------------------------------------------------

    def append(self, x: torch.Tensor, valid: torch.Tensor | None) -> None:
        """Store new tokens x: [B, H, t, D]; ``valid`` [B, t] marks the real (non-padding) tokens."""
        if self.resid is None:
            self._allocate(x)
        for b in range(x.shape[0]):
            tokens = x[b] if valid is None else x[b][:, valid[b]]  # [H, t_b, D]
            self._view_write(b, self.lengths[b], tokens)
            take = min(self.config.sink_tokens - self.n_sink[b], tokens.shape[1])
            if take:
                self.sink[b, :, self.n_sink[b] : self.n_sink[b] + take] = tokens[:, :take]
                self.n_sink[b] += take
                tokens = tokens[:, take:]
            start = self.n_resid[b]
            self._grow_residual(start + tokens.shape[1])
            self.resid[b, :, start : start + tokens.shape[1]] = tokens
            self.n_resid[b] += tokens.shape[1]

    def flush(self) -> None:
        """Quantize what the flush rules say leaves the residual, for every sequence."""
        if not self.quantizes:
            return
        for b, n_resid in enumerate(self.n_resid):
            n = self.config.quantized(n_resid)
            if n == 0:
                continue
            q = backend.quantize(self.resid[b : b + 1, :, :n], self.config)
            if self.view is not None:
                self._view_write(b, self.n_sink[b] + self.n_quant[b], self._dequantize(q)[0])
            self._write_quantized(b, q)
            self.resid[b, :, : n_resid - n] = self.resid[b, :, n:n_resid].clone()
            self.n_resid[b] -= n

    def _dequantize(self, q: Quantized) -> torch.Tensor:
        return dequantize(q, self.config.bits, self.config.group_size, self.dim)

    def _allocate(self, x: torch.Tensor) -> None:
        batch, heads, _, dim = x.shape
        self.n_sink, self.n_quant, self.n_resid = [0] * batch, [0] * batch, [0] * batch
        self.sink = x.new_zeros(batch, heads, self.config.sink_tokens, dim)
        self.resid = x.new_zeros(batch, heads, 0, dim)
        if self.quantizes:
            self.packed = self._empty_packed(batch, heads, 0, dim, x)

    def _empty_packed(self, batch: int, heads: int, tokens: int, dim: int, like: torch.Tensor) -> Quantized:
        cfg = self.config
        return allocate((batch, heads, tokens, dim), cfg.bits, cfg.group_size, cfg.axis, like.dtype, like.device)

    def _grow_residual(self, needed: int) -> None:
        if needed > self.resid.shape[2]:
            grown = self.resid.new_zeros(*self.resid.shape[:2], max(needed, 2 * self.resid.shape[2]), self.resid.shape[3])
            grown[:, :, : self.resid.shape[2]] = self.resid
            self.resid = grown

    def _write_quantized(self, b: int, q: Quantized) -> None:
        start, n = self.n_quant[b], self._token_count(q)
        capacity = self._token_count(self.packed)
        if start + n > capacity:
            batch, heads, _, dim = self.resid.shape
            tokens = round_up(max(start + n, 2 * capacity), self.config.group_size)
            grown = self._empty_packed(batch, heads, tokens, dim, self.resid)
            for old, new in zip(self.packed, grown):
                new[:, :, : old.shape[2]] = old
            self.packed = grown
        for buf, part in zip(self.packed, q):
            at = self._rows(start, buf is self.packed.codes)
            buf[b, :, at : at + part.shape[2]] = part[0]
        self.n_quant[b] += n

    def _rows(self, tokens: int, codes: bool) -> int:
        """Row index (dim 2) of a token count in the packed buffers."""
        if self.config.axis == "token":
            return tokens
        return tokens // (codes_per_word(self.config.bits) if codes else self.config.group_size)

    def _token_count(self, q: Quantized) -> int:
        return q.scale.shape[2] * (self.config.group_size if self.config.axis == "channel" else 1)

    # -- reading ---------------------------------------------------------------------------------

    def dequantized(self) -> torch.Tensor:
        """The quantized segment dequantized in float32: [B, H, max n_quant, D] (rows past n_quant[b] are junk)."""
        n = max(self.n_quant, default=0)
        q = Quantized(*(buf[:, :, : self._rows(n, buf is self.packed.codes)] for buf in self.packed))
        return self._dequantize(q)

    def materialize(self) -> torch.Tensor:
        """All stored tokens in position order, float32 [B, H, max length, D] (rows past a length are junk)."""
        if self.view is None:
            deq = self.dequantized() if any(self.n_quant) else None
            batch, heads, _, dim = self.resid.shape
            self.view = self.resid.new_zeros(batch, heads, max(self.lengths), dim, dtype=torch.float32)
            for b, (s, q, r) in enumerate(zip(self.n_sink, self.n_quant, self.n_resid)):
                self.view[b, :, :s] = self.sink[b, :, :s]
                if q:
                    self.view[b, :, s : s + q] = deq[b, :, :q]
                self.view[b, :, s + q : s + q + r] = self.resid[b, :, :r]
        return self.view[:, :, : max(self.lengths)]

    def _view_write(self, b: int, start: int, tokens: torch.Tensor) -> None:
        """Keep the float32 view current: tokens [H, t, D] now read as these values from position start."""
        if self.view is None:
            return
        end = start + tokens.shape[1]
        if end > self.view.shape[2]:
            grown = self.view.new_zeros(*self.view.shape[:2], max(end, 2 * self.view.shape[2]), self.view.shape[3])
            grown[:, :, : self.view.shape[2]] = self.view
            self.view = grown
        self.view[b, :, start:end] = tokens

    def nbytes(self) -> int:
        """Bytes held for the stored tokens: packed codes + scales + zeros + sinks + residual."""
        if self.resid is None:
            return 0
        heads, dim = self.resid.shape[1], self.resid.shape[3]
        item = self.resid.element_size()
        full = (sum(self.n_sink) + sum(self.n_resid)) * heads * dim * item
        quant = sum(self.n_quant) * heads * dim
        if not quant:
            return full
        return full + quant * self.config.bits // 8 + 2 * quant // self.config.group_size * item


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
