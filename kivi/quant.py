"""Asymmetric min/max quantization and the packed layout shared by the PyTorch oracle and the Triton kernels.

Quantization (KIVI §3): for each group of G elements, scale = (max - min) / (2^b - 1), zero = min,
q = clamp(round((x - zero) / scale), 0, 2^b - 1), x̂ = q * scale + zero. Scale and zero are stored in the
model dtype and the codes are computed from the stored (rounded) values, so x̂ is exactly what a reader
reconstructs. A constant group has scale 0: its codes are 0 and x̂ = zero = x.

Packed layout. Codes are packed into int32 words along the axis they are grouped on, code j of a word
in bits [j*b, (j+1)*b), cpw = 32 // b codes per word:

- grouped along tokens (``axis="channel"``, KIVI keys), x: [B, H, T, D]
    codes [B, H, T // cpw, D]   word (w, d) holds tokens w*cpw .. w*cpw+cpw-1 of channel d
    scale, zero [B, H, T // G, D]
- grouped along channels (``axis="token"``, KIVI values), x: [B, H, T, D]
    codes [B, H, T, D // cpw]   word (t, w) holds channels w*cpw .. w*cpw+cpw-1 of token t
    scale, zero [B, H, T, D // G]

Both keep the channel dimension (or the words of one token) contiguous, so a kernel reading a tile of
tokens issues 16-byte, coalesced loads.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kivi.config import WORD_BITS

# The tensor dimension a stream is grouped and packed along, by KiviConfig axis name.
GROUP_DIM = {"channel": -2, "token": -1}


class Quantized(NamedTuple):
    codes: torch.Tensor  # int32, packed along the grouped dimension
    scale: torch.Tensor  # model dtype, one per group
    zero: torch.Tensor  # model dtype, one per group


class StreamBuffers(NamedTuple):
    """One stream as a decode kernel reads it: sinks, the packed quantized segment, the full-precision residual."""

    sink: torch.Tensor  # [B, H, S, D] model dtype
    packed: Quantized
    resid: torch.Tensor  # [B, H, rows, D] model dtype


def codes_per_word(bits: int) -> int:
    return WORD_BITS // bits


def packed_shapes(shape: tuple[int, ...], bits: int, group_size: int, axis: str) -> tuple[tuple, tuple]:
    """(codes shape, scale/zero shape) of x [..., T, D] quantized along ``axis`` in the layout above."""
    *lead, tokens, dim = shape
    cpw = codes_per_word(bits)
    if axis == "channel":
        return (*lead, tokens // cpw, dim), (*lead, tokens // group_size, dim)
    return (*lead, tokens, dim // cpw), (*lead, tokens, dim // group_size)


def allocate(shape: tuple[int, ...], bits: int, group_size: int, axis: str, dtype: torch.dtype, device,
             fill=torch.zeros) -> Quantized:
    """Buffers for x of ``shape`` [..., T, D] in the packed layout: int32 codes, scale and zero in ``dtype``."""
    code_shape, stat_shape = packed_shapes(shape, bits, group_size, axis)
    return Quantized(fill(code_shape, dtype=torch.int32, device=device), fill(stat_shape, dtype=dtype, device=device),
                     fill(stat_shape, dtype=dtype, device=device))


def pack(codes: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Pack integer codes in [0, 2^bits) into int32 words along ``dim`` (its size must divide by 32 // bits)."""
    cpw = codes_per_word(bits)
    c = codes.movedim(dim, -1).to(torch.int64)
    c = c.reshape(*c.shape[:-1], c.shape[-1] // cpw, cpw)
    shifts = torch.arange(cpw, device=c.device, dtype=torch.int64) * bits
    words = (c << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement into int32
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def unpack(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Inverse of ``pack``: int32 words -> int64 codes, ``32 // bits`` times longer along ``dim``."""
    cpw = codes_per_word(bits)
    w = words.movedim(dim, -1).to(torch.int64)
    shifts = torch.arange(cpw, device=w.device, dtype=torch.int64) * bits
    codes = (w.unsqueeze(-1) >> shifts) & (2**bits - 1)
    return codes.reshape(*w.shape[:-1], w.shape[-1] * cpw).movedim(-1, dim)


def quantize(x: torch.Tensor, bits: int, group_size: int, dim: int) -> Quantized:
    """Quantize ``x`` in groups of ``group_size`` consecutive elements along ``dim``; pack along ``dim``."""
    xf = x.movedim(dim, -1).float()
    groups = xf.reshape(*xf.shape[:-1], xf.shape[-1] // group_size, group_size)
    lo, hi = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((hi - lo) / (2**bits - 1)).to(x.dtype)
    zero = lo.to(x.dtype)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale).float()
    codes = ((groups - zero.float()) / safe).round_().clamp_(0, 2**bits - 1)
    codes = codes.reshape(xf.shape).movedim(-1, dim)
    return Quantized(pack(codes, bits, dim), scale.squeeze(-1).movedim(-1, dim), zero.squeeze(-1).movedim(-1, dim))


def dequantize(q: Quantized, bits: int, group_size: int, dim: int) -> torch.Tensor:
    """x̂ = code * scale + zero, computed and returned in float32 (as the kernels accumulate)."""
    codes = unpack(q.codes, bits, dim).movedim(dim, -1)
    codes = codes.reshape(*codes.shape[:-1], codes.shape[-1] // group_size, group_size).float()
    scale = q.scale.movedim(dim, -1).unsqueeze(-1).float()
    zero = q.zero.movedim(dim, -1).unsqueeze(-1).float()
    return (codes * scale + zero).flatten(-2).movedim(-1, dim)
