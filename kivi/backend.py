"""The one seam between the caches and the kernels: every call a cache makes into kivi/kernels/ passes here.

The kernels serve CUDA tensors; the PyTorch oracle (kivi.quant, kivi.attention) serves the rest and every shape
the kernels do not take (``unsupported``). KIVI decode attention runs on the CUDA C++ kernel where it serves the
layer (``kivi.kernels.cuda_decode``: fp16, 2 or 4 bits, head sizes 128 and 256, up to 8 query heads per KV head),
else on the Triton kernel. All read and write the layout of kivi.quant, so a cache holds the same codes whichever
served it.
"""

from __future__ import annotations

import functools
import warnings

import torch

from kivi.kernels import cuda_decode
from kivi.kernels import decode_attention as kivi_decode
from kivi.kernels import dense_decode
from kivi.kernels import quantize as fused_quantize
from kivi.attention import attention_over_cache
from kivi.config import KiviConfig, StreamConfig
from kivi.quant import GROUP_DIM, Quantized, StreamBuffers
from kivi.quant import quantize as quantize_oracle

unsupported = kivi_decode.unsupported  # (config, query shape) -> why no fused decode can serve, or None
dense_splits = dense_decode.default_num_splits
dense_attention = dense_decode.dense_decode_attention
dense_store = dense_decode.store_step  # a step's key and value into a dense layer's rows, one launch
oracle_attention = attention_over_cache


def dense_head_dim(dim: int) -> int:
    """The head size the dense decode kernel runs a layer of ``dim`` at (a power of two, >= 16: padded)."""
    return max(16, 1 << (dim - 1).bit_length())


def kivi_head_dim(dim: int) -> int | None:
    """The head size the KIVI decode kernel runs a layer of ``dim`` at (padded), None when it takes none that large."""
    return next((size for size in kivi_decode.HEAD_DIMS if size >= dim), None)


def quantize(x: torch.Tensor, stream: StreamConfig) -> Quantized:
    """x [B, H, T, D] quantized and packed as ``stream`` says; on CUDA by the fused kernel (same codes), which
    takes power-of-two groups."""
    g = stream.group_size
    if x.is_cuda and not g & (g - 1):
        return fused_quantize.quantize(x, stream.bits, g, stream.axis)
    return quantize_oracle(x, stream.bits, g, GROUP_DIM[stream.axis])


def decode(query: torch.Tensor, keys: StreamBuffers, values: StreamBuffers, counts: torch.Tensor, config: KiviConfig,
           scaling: float, max_tokens: int, out: torch.Tensor | None = None, v_ring: bool = False,
           softcap: float | None = None, num_splits: int | None = None, kernel: str = "auto",
           warps: int | None = None) -> torch.Tensor:
    """The fused decode attention over one layer's buffers (see ``kivi.kernels.decode_attention.decode_attention``):
    ``kernel`` "auto" takes the CUDA kernel where it serves the layer (on the H200 it beat Triton's at every size
    measured, 2 and 4 bits: BENCHMARKS.md), else Triton's; "triton" or "cuda" ask for one. ``num_splits`` None: the
    serving kernel's choice for sequences of up to ``max_tokens`` tokens; ``warps`` (per block, the CUDA kernel's
    alone) None: its choice."""
    batch, kv_heads = keys.resid.shape[:2]
    if kernel not in ("auto", "triton", "cuda"):
        raise ValueError(f"decode: kernel must be 'auto', 'triton' or 'cuda', got {kernel!r}")
    if kernel == "cuda" or (kernel == "auto" and serves_cuda(config, query, kv_heads, keys.resid.dtype)):
        shape = tuple(query.shape)
        if num_splits is None:
            splits, chosen = cuda_decode.default_launch(batch, kv_heads, max_tokens, config, shape, query.device)
        else:
            splits = num_splits
            chosen = cuda_decode.default_warps(batch, kv_heads, splits, max_tokens, config, shape, query.device)
        warps = warps or chosen
        return cuda_decode.decode_attention(query, keys, values, counts, config, scaling, splits, out, v_ring=v_ring,
                                            softcap=softcap, warps=warps)
    if warps:
        raise ValueError(f"decode: warps={warps} is the CUDA kernel's block size; the Triton kernel serves this layer")
    splits = num_splits or kivi_decode.default_num_splits(batch, kv_heads, max_tokens, config, query.device)
    return kivi_decode.decode_attention(query, keys, values, counts, config, scaling, splits, out, v_ring=v_ring,
                                        softcap=softcap)


def serves_cuda(config: KiviConfig, query: torch.Tensor, kv_heads: int, dtype: torch.dtype) -> bool:
    """Whether the CUDA kernel serves this layer's decode (builds it at the first question on a device; where it
    cannot be built, or its block does not fit the device's shared memory, warns once and the Triton kernel serves)."""
    if not query.is_cuda or cuda_decode.unsupported(config, tuple(query.shape), kv_heads, dtype):
        return False
    if reason := cuda_decode.unavailable(query.device):
        _warn_once(f"KIVI decode attention runs on the Triton kernel: the CUDA kernel is unavailable ({reason})")
        return False
    if not cuda_decode.fits(config, tuple(query.shape), kv_heads, query.device):
        _warn_once(f"KIVI decode attention of {config.k_bits}-bit head_dim {query.shape[3]} runs on the Triton kernel: the "
                   f"CUDA kernel's block takes more shared memory than {torch.cuda.get_device_name(query.device)} has")
        return False
    return True


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def append(key: torch.Tensor, value: torch.Tensor, key_resid: torch.Tensor, value_ring: torch.Tensor, keys: Quantized,
           values: Quantized, positions: torch.Tensor, config: KiviConfig) -> None:
    """A decode step's key and value stored, after KIVI's flush of what the step before completed, on the device
    in one launch (see ``kivi.kernels.quantize.append_step``)."""
    fused_quantize.append_step(key, value, key_resid, value_ring, keys, values, positions, config)


def decode_attention(query: torch.Tensor, key_stream, value_stream, scaling: float, num_splits: int | None = None,
                     out: torch.Tensor | None = None, config: KiviConfig | None = None,
                     softcap: float | None = None, kernel: str = "auto", warps: int | None = None) -> torch.Tensor:
    """The fused decode attention of query [B, Hq, 1, D] over everything two ``kivi.stream.KVStream``s hold.
    Returns [B, Hq, 1, D]. ``config``: the layer's, which the streams' configs give when omitted; ``kernel`` and
    ``warps``: as ``decode``'s."""
    config = config or KiviConfig.from_streams(key_stream.config, value_stream.config)
    if reason := unsupported(config, query.shape):
        raise ValueError(f"decode_attention: {reason}")
    if key_stream.n_sink != value_stream.n_sink or key_stream.lengths != value_stream.lengths:
        raise ValueError("decode_attention: key and value streams hold different token counts")
    g = config.group_size
    if any(n % g for n in key_stream.n_quant):
        raise ValueError(f"decode_attention: quantized key counts {key_stream.n_quant} must be multiples of group_size={g}")
    after_sink = [q + r for q, r in zip(key_stream.n_quant, key_stream.n_resid)]
    counts = torch.tensor([key_stream.n_sink, key_stream.n_quant, value_stream.n_quant, after_sink], dtype=torch.int32)
    return decode(query, key_stream.buffers, value_stream.buffers, counts.to(query.device), config, scaling,
                  max(after_sink), out, softcap=softcap, num_splits=num_splits, kernel=kernel, warps=warps)
