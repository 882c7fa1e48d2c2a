"""The next token of each sequence in a decode step: greedy, or sampled with temperature, top-k, top-p and a seed.

A sampled token is the Gumbel-max choice over the row's filtered logits, argmax(logits / T + g) over the tokens
that top-k and then top-p keep, with g = -log(-log(u)) and u a counter-based hash of (seed, position, token id):
an exact draw from the filtered softmax, with no generator state. So a row's token depends only on its logits,
its Sampling and the position of the token being chosen, not on its slot, the batch or the other rows: the same
seed gives the same text on a rerun, in one process and on another actor. It is fixed-shape tensor work without
a host synchronisation, so it runs inside a CUDA graph and under torch.compile. Temperature 0 is greedy: exactly
``logits.argmax(-1)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kivi.slot_cache import to_device

_M32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # below 2^27: a 32-bit value times it stays inside int64, so no step overflows
_SALT = 0x5BD1E995


@dataclass(frozen=True)
class Sampling:
    """How one request chooses its tokens; the default is greedy."""

    temperature: float = 0.0  # 0: greedy, the exact argmax
    top_p: float = 1.0  # the smallest set of most likely tokens whose probability reaches top_p (1: all)
    top_k: int = 0  # the k most likely tokens (0: no limit)
    seed: int = 0  # any integer; with the position of a token it decides the draw

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature}: use a finite value >= 0 (0 is greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: use a value in (0, 1] (1 keeps every token)")
        if not (isinstance(self.top_k, int) and self.top_k >= 0):
            raise ValueError(f"top_k={self.top_k}: use an integer >= 0 (0 keeps every token)")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed={self.seed!r}: use an integer")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = Sampling()


class SlotSampling:
    """Each slot's Sampling as device tensors [slots], changed in place (a captured graph keeps reading them)."""

    def __init__(self, slots: int, device: torch.device | str):
        device = torch.device(device)
        self.temperature = torch.zeros(slots, dtype=torch.float32, device=device)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=device)
        self.top_k = torch.zeros(slots, dtype=torch.int64, device=device)
        self.seed = torch.zeros(slots, dtype=torch.int64, device=device)  # the seed's 64 bits, two's complement

    def set(self, slots: torch.Tensor, params: list[Sampling]) -> None:
        """Give the sequences admitted to ``slots`` their Sampling (one per slot, in order)."""
        for name, dtype in (("temperature", torch.float32), ("top_p", torch.float32), ("top_k", torch.int64)):
            tensor = getattr(self, name)
            tensor[slots] = to_device(torch.tensor([getattr(p, name) for p in params], dtype=dtype), tensor.device)
        seeds = [(p.seed + 2**63) % 2**64 - 2**63 for p in params]  # any Python int, as its low 64 bits
        self.seed[slots] = to_device(torch.tensor(seeds, dtype=torch.int64), self.seed.device)

    def clear(self, slots: torch.Tensor) -> None:
        """Released slots go back to greedy."""
        self.set(slots, [GREEDY] * len(slots))

    def select(self, slots: torch.Tensor) -> SlotSampling:
        """The values of ``slots`` only, in their order: the rows of a prefill's logits."""
        view = SlotSampling.__new__(SlotSampling)
        for name in ("temperature", "top_p", "top_k", "seed"):
            setattr(view, name, getattr(self, name)[slots])
        return view


def next_tokens(logits: torch.Tensor, params: SlotSampling, positions: torch.Tensor) -> torch.Tensor:
    """The chosen token of each row: logits [B, V] (any float dtype), ``params`` with [B] values, ``positions`` [B]
    the index of the token being chosen within its sequence. Returns int64 [B]."""
    greedy = logits.argmax(-1)
    sampled = params.temperature > 0
    scale = torch.where(sampled, params.temperature, torch.ones_like(params.temperature))
    scores, order = (logits.float() / scale[:, None]).sort(dim=-1, descending=True, stable=True)  # [B, V] each
    rank = torch.arange(scores.shape[-1], device=scores.device)
    top_k = params.top_k[:, None]
    keep = (top_k == 0) | (rank < top_k)
    scores = scores.masked_fill(~keep, -math.inf)
    probs = scores.softmax(-1)  # the top-k distribution, renormalized: top-p applies to it
    before = probs.cumsum(-1) - probs  # probability of the more likely tokens
    top_p = params.top_p[:, None]
    keep &= (before < top_p) | (top_p >= 1)  # the most likely token always stays (before = 0)
    noisy = (scores + _gumbel(params.seed, positions, order)).masked_fill(~keep, -math.inf)
    chosen = order.gather(-1, noisy.argmax(-1, keepdim=True))[:, 0]
    return torch.where(sampled, chosen, greedy)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (a bijection) on int64 values in [0, 2^32)."""
    x = x ^ (x >> 16)
    x = (x * _MIX) & _M32
    x = x ^ (x >> 16)
    x = (x * _MIX) & _M32
    return x ^ (x >> 16)


def _gumbel(seed: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Float32 Gumbel noise [B, V] for token ids ``tokens`` [B, V], from a hash of (seed, position, token id)."""
    row = _mix(_mix((seed >> 32) & _M32) ^ (seed & _M32))
    row = _mix(row ^ (positions.long() & _M32))[:, None]
    bits = _mix(_mix(row ^ tokens) ^ _SALT)
    u = ((bits >> 8).float() + 0.5) * 2.0**-24  # 24 bits: exact in float32, strictly inside (0, 1)
    return -torch.log(-torch.log(u))
