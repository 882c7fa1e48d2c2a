"""Inputs shared by the kernel tests, the GPU check and the benchmark, and the oracle they are compared with."""

from __future__ import annotations

from pathlib import Path

import torch

from kivi.attention import attention_over_cache
from kivi.config import KiviConfig
from kivi.stream import KVStream

# Real SmolLM2-135M keys, values and queries (written by ``python -m tools.capture_kv``).
REAL_KV = Path(__file__).resolve().parent.parent / "tests" / "kernels" / "data" / "smollm2_kv.pt"


def outlier_kv(batch: int, kv_heads: int, tokens: int, dim: int, dtype: torch.dtype, device, gen: torch.Generator):
    """Random keys and values [B, Hkv, T, D]; keys get a few outlier channels (large scale and offset), as KIVI
    observes in real keys, and values a few loud tokens."""
    shape = (batch, kv_heads, tokens, dim)
    keys = torch.randn(shape, generator=gen, device=device)
    loud = torch.randperm(dim, generator=gen, device=device)[: max(1, dim // 16)]
    keys[..., loud] = keys[..., loud] * 12 + 6
    values = torch.randn(shape, generator=gen, device=device)
    values[:, :, torch.randint(tokens, (max(1, tokens // 50),), generator=gen, device=device)] *= 8
    return keys.to(dtype), values.to(dtype)


def fill_streams(keys: torch.Tensor, values: torch.Tensor, lengths: list[int], config: KiviConfig, decode_steps: int = 2):
    """KVStreams for keys, values [B, Hkv, T, D] as KiviLayer leaves them when it attends: sequence b holds its
    first lengths[b] tokens, stored as a left-padded prompt, flushes, and ``decode_steps`` single-token steps
    whose last one is appended but not yet flushed."""
    streams = KVStream(config.keys), KVStream(config.values)
    prompt = [n - decode_steps for n in lengths]
    width = max(prompt)
    valid = torch.tensor([[j >= width - p for j in range(width)] for p in prompt], device=keys.device)
    for stream, x in zip(streams, (keys, values)):
        padded = torch.stack([torch.roll(x[b, :, :width], width - p, dims=1) for b, p in enumerate(prompt)])
        stream.append(padded, valid)
        for step in range(decode_steps):
            stream.flush()
            stream.append(torch.stack([x[b, :, p + step : p + step + 1] for b, p in enumerate(prompt)]), None)
    return streams


def reference_decode(query: torch.Tensor, key_stream: KVStream, value_stream: KVStream, scaling: float,
                     softcap: float | None = None) -> torch.Tensor:
    """The oracle: kivi.attention over the dequantized cache, in float32 whatever the query dtype."""
    lengths = torch.tensor(key_stream.lengths)
    return attention_over_cache(query.float(), key_stream.materialize(), value_stream.materialize(), lengths, scaling,
                                softcap)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere (an unwritten output) gives inf."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()
