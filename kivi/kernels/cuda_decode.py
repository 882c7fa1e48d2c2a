"""The CUDA C++ decode attention (``csrc/kivi_decode.cu``): the GPU fast path beside the Triton kernel.

Same inputs and outputs as ``kivi.kernels.decode_attention.decode_attention`` (buffers in kivi.quant's layout,
device counts, split partials merged by the same merge kernel), for the layouts it serves (``unsupported``):
fp16, 2- or 4-bit keys and values alike, groups of 32, head sizes 128 and 256, up to 8 query heads per KV head,
no sinks, compute capability 8.0 or newer with the shared memory the layout's block takes (``fits``). Built with
nvcc for the device's architecture at first use, cached under ``$KIVI_KERNEL_CACHE`` (default
``~/.cache/kivi-eval/kernels``), loaded with ctypes and launched on the current stream, so CUDA graphs capture it
like any kernel.

``emulate=True`` builds the same source as C++ for the CPU (``csrc/emulate.h``: every thread a fiber, warp
collectives as rendezvous), which is how the CPU tests run this kernel; ``tools.kernel_check`` compares the
GPU build with the Triton kernel and the oracle on every run.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from kivi.config import KiviConfig
from kivi.kernels._triton import LOG2E, log2_cap, merge_splits, split_targets
from kivi.kernels.buffers import check_decode_buffers
from kivi.quant import StreamBuffers

SOURCES = Path(__file__).resolve().parent / "csrc"
UNIT_TOKENS = 64  # tokens a warp takes at a time (csrc/kivi_decode.cu)
# Warps per block the kernel takes: 2 and 4 for every layout, 8 where the device's shared memory holds their stages.
WARPS = (2, 4, 8)
LONG_CHAIN_UNITS = 64  # units a warp takes in turn (4,096 tokens) beyond which splitting further pays (default_launch)
MIN_CAPABILITY = (8, 0)  # mma.sync m16n8k16 with fp32 accumulators


class _Args(ctypes.Structure):
    """csrc/kivi_decode.cu's Args: same fields, same order."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("q", "out", "part", "lse", "kc", "ks", "kz", "kr", "vc", "vs", "vz",
                                                     "vr", "counts")] + \
        [(name, ctypes.c_int) for name in ("batch", "kv_heads", "q_heads", "splits", "warps")] + \
        [("qk_scale", ctypes.c_float), ("cap", ctypes.c_float)] + \
        [(name, ctypes.c_int64) for name in ("stride_qb", "stride_qh", "stride_ob", "stride_oh")] + \
        [(name, ctypes.c_int) for name in ("kc_rows", "ks_rows", "kr_rows", "vc_rows", "vr_rows", "ring", "out_f32")]


def _cache_dir() -> Path:
    return Path(os.environ.get("KIVI_KERNEL_CACHE", Path.home() / ".cache" / "kivi-eval" / "kernels"))


def build_command(output: Path, emulate: bool, arch: str = "90") -> list[str]:
    """The compiler call for the library: nvcc for compute capability ``arch`` (e.g. "90"), or the host C++
    compiler for the CPU emulation."""
    source = str(SOURCES / "kivi_decode.cu")
    if emulate:
        compiler = os.environ.get("CXX") or shutil.which("c++") or "g++"
        return [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", "-DKIVI_EMULATE", "-Wno-unknown-pragmas", "-x", "c++",
                source, "-o", str(output)]
    return [nvcc(), "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", f"-gencode=arch=compute_{arch},code=sm_{arch}",
            source, "-o", str(output)]


def nvcc() -> str:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    found = shutil.which("nvcc") or str(Path(home) / "bin" / "nvcc")
    if not Path(found).exists():
        raise RuntimeError("nvcc not found (PATH, $CUDA_HOME/bin): the CUDA decode kernel is built with it at first use")
    return found


def _build(emulate: bool, arch: str) -> Path:
    """Compile once per source, compiler and target; concurrent builders (Ray actors) each write a temporary file
    and rename it, so every reader sees a whole library."""
    command = build_command(Path("OUT"), emulate, arch)
    compiler = subprocess.run([command[0], "--version"], capture_output=True, text=True).stdout
    digest = hashlib.sha256(" ".join(command).encode() + compiler.encode())
    for path in sorted(SOURCES.iterdir()):
        digest.update(path.name.encode() + path.read_bytes())
    target = _cache_dir() / f"kivi_decode-{'cpu' if emulate else 'sm' + arch}-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        done = subprocess.run(build_command(built, emulate, arch), capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"building the CUDA decode kernel failed ({' '.join(build_command(built, emulate, arch))}):\n"
                               f"{done.stderr[-3000:]}")
        os.replace(built, target)
    return target


@functools.cache
def library(emulate: bool = False, arch: str = "90") -> ctypes.CDLL:
    lib = ctypes.CDLL(str(_build(emulate, arch)))
    lib.kivi_decode.argtypes = [ctypes.POINTER(_Args), ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.kivi_decode.restype = ctypes.c_int
    lib.kivi_decode_shared_bytes.argtypes = [ctypes.c_int] * 4
    lib.kivi_decode_shared_bytes.restype = ctypes.c_int
    lib.kivi_decode_error.argtypes = [ctypes.c_int]
    lib.kivi_decode_error.restype = ctypes.c_char_p
    return lib


@functools.cache
def _device_library(index: int) -> ctypes.CDLL | str:
    """The GPU build for device ``index``, or why there is none (the Triton kernel serves then)."""
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) < MIN_CAPABILITY:
        return f"compute capability {major}.{minor} < {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"
    try:
        return library(False, f"{major}{minor}")
    except (RuntimeError, OSError) as err:
        return str(err)


def _library_for(device: torch.device) -> ctypes.CDLL | str:
    """The build that runs on ``device``: the GPU's (or why there is none), the emulation for CPU tensors."""
    if device.type != "cuda":
        return library(emulate=True)
    return _device_library(device.index if device.index is not None else torch.cuda.current_device())


def unavailable(device: torch.device) -> str | None:
    """Why no CUDA build serves ``device`` (None when one does); builds it on first call."""
    if device.type != "cuda":
        return "not a CUDA device"
    lib = _library_for(device)
    return lib if isinstance(lib, str) else None


def shared_bytes(bits: int, head_dim: int, q_per_kv: int, warps: int, device: torch.device) -> int:
    """The shared memory of the kernel's block of ``warps`` warps for this layout; 0 where it has none."""
    lib = _library_for(device)
    return 0 if isinstance(lib, str) else lib.kivi_decode_shared_bytes(bits, head_dim, q_per_kv, warps)


def block_shared_limit(device: torch.device) -> int:
    """The most shared memory a block can take on ``device``: the multiprocessor's less the 1 KB the CUDA runtime
    reserves per block (227 KB on Hopper, 163 KB on the A100, 99 KB on compute capability 8.6 and 8.9)."""
    return torch.cuda.get_device_properties(device).shared_memory_per_multiprocessor - 1024


def fits(config: KiviConfig, query_shape: tuple[int, ...], kv_heads: int, device: torch.device, warps: int = 4) -> bool:
    """Whether a block of ``warps`` warps of a layout the kernel serves (``unsupported``) fits ``device``'s shared
    memory (4-bit head_dim 256 takes 160 KB at 4 warps: too much for compute capability 8.6 and 8.9)."""
    needed = shared_bytes(config.k_bits, query_shape[3], query_shape[1] // kv_heads, warps, device)
    return 0 < needed <= block_shared_limit(device)


def unsupported(config: KiviConfig, query_shape: tuple[int, ...], kv_heads: int, dtype: torch.dtype) -> str | None:
    """Why the CUDA kernel cannot serve a layer of ``config`` for queries of ``query_shape`` [B, Hq, q, D] (None
    when it can; the device is ``unavailable``'s question)."""
    q_heads, q_len, dim = query_shape[1], query_shape[2], query_shape[3]
    if dtype != torch.float16:
        return f"{dtype} (fp16 only)"
    if q_len != 1:
        return f"q_len={q_len} (decode only)"
    if config.key_axis != "channel" or config.value_axis != "token":
        return "keys grouped along tokens and values along channels only"
    if config.k_bits != config.v_bits or config.k_bits not in (2, 4):
        return f"k_bits={config.k_bits}, v_bits={config.v_bits} (2 or 4 bits, the same for both)"
    if config.group_size != 32:
        return f"group_size={config.group_size} (32 only)"
    if config.sink_tokens:
        return "sink tokens"
    if dim not in (128, 256):
        return f"head_dim={dim} (128 or 256)"
    if q_heads % kv_heads or q_heads // kv_heads > 8:
        return f"{q_heads} query heads on {kv_heads} KV heads (at most 8 per KV head)"
    return None


def default_num_splits(batch: int, kv_heads: int, max_tokens: int, device: torch.device) -> int:
    """Splits per sequence: enough for one block per multiprocessor, and up to eight where each split still holds
    16 units (4 per warp). Measured on the H200 (``tools.kernel_bench --sweep``, BENCHMARKS.md): at short contexts
    more blocks only add waves and merging, and a warp of a single unit waits for all its loads (its copies overlap
    its computing from its second unit on): at 45b4c7f Qwen2.5-1.5B's shape at B = 64, S = 1,024 ran in 0.0193 ms at
    1 split against 0.0198 at 2 and 0.0262 at 4 (two blocks per multiprocessor, the rule before, chose 2), at
    B = 256 in 0.0499 at 1 against 0.0574 at 2; at long contexts with few sequences more splits fill the GPU (GQA
    32 / 8, B = 8, S = 32K: 0.2302 ms at 1, 0.0935 at 4, 0.0884-0.0912 from 6 to 24)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    pairs, units = batch * kv_heads, -(-max_tokens // UNIT_TOKENS)
    return max(1, sms // pairs, min(-(-8 * sms // pairs), units // 16))  # 16: 4 units for each of 4 warps


def default_warps(batch: int, kv_heads: int, splits: int, max_tokens: int, config: KiviConfig,
                  query_shape: tuple[int, ...], device: torch.device) -> int:
    """Warps per block for ``splits`` splits: 8 where the blocks are no more than the multiprocessors (one block each:
    at 4 warps, one warp per scheduler, a latency chain with nothing to hide it, Nsight Compute at Qwen2.5-1.5B's
    shape, B = 64, S = 1,024), each split holds a unit per warp and the block fits; 2 for layouts of more than 4
    query heads per KV head (two column tiles) at more than two blocks per multiprocessor; else 4 (a second block
    of 8 warps does not fit beside the first: more blocks than multiprocessors ran slower at 8 than at 4 in every
    case of the H200 sweep). ``tools.kernel_bench --sweep`` on the H100 at 2c28ce7 (BENCHMARKS.md, 2026-12-07):
    at 12 / 2 and 28 / 4 heads, S = 384-1,024, 2 warps took 11-19% less time than 4 from 512 blocks (B = 256 and
    512 of Qwen2.5-1.5B's shape, 256 of Qwen2.5-7B's) and 19-20% more at 256 (B = 128; 64 of Qwen2.5-7B's); MHA
    and 32 / 8 heads ran slower at 2 in every case measured."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    blocks, units_per_split = batch * kv_heads * splits, -(-max_tokens // UNIT_TOKENS) / splits
    if blocks <= sms and units_per_split >= 8 and fits(config, query_shape, kv_heads, device, 8):
        return 8
    return 2 if query_shape[1] // kv_heads > 4 and blocks > 2 * sms else 4


def default_launch(batch: int, kv_heads: int, max_tokens: int, config: KiviConfig, query_shape: tuple[int, ...],
                   device: torch.device) -> tuple[int, int]:
    """(splits, warps per block): a sequence split only as far as one block per multiprocessor needs (where the
    sequences' KV heads leave some idle), with ``default_warps``' block; ``default_num_splits`` where that leaves a
    warp a chain of more than ``LONG_CHAIN_UNITS`` units. ``tools.kernel_bench --sweep`` on the H100 at ad68753
    (BENCHMARKS.md, "Split a sequence only to fill the GPU"): over 64-512 sequence heads of 2K-32K tokens, more
    splits than that filled nothing and cost up to 29% (Qwen2.5-1.5B's shape at B = 128, S = 4,096: 1 split 55.4 us,
    the 4 of the rule before 70.1; B = 64, S = 16,384: 1 split of 8 warps 99.3, the rule before's 9 splits 123.7);
    at 64 units a warp more splits gained 1-3%, at 128 7% (Llama-2-7B's B = 8, S = 32K; H200, 45b4c7f)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    units = -(-max_tokens // UNIT_TOKENS)
    splits = max(1, sms // (batch * kv_heads))
    warps = default_warps(batch, kv_heads, splits, max_tokens, config, query_shape, device)
    if units > LONG_CHAIN_UNITS * splits * warps:
        splits = default_num_splits(batch, kv_heads, max_tokens, device)
        warps = default_warps(batch, kv_heads, splits, max_tokens, config, query_shape, device)
    return splits, warps


def decode_attention(query: torch.Tensor, keys: StreamBuffers, values: StreamBuffers, counts: torch.Tensor,
                     config: KiviConfig, scaling: float, num_splits: int, out: torch.Tensor | None = None,
                     v_ring: bool = False, softcap: float | None = None, emulate: bool = False,
                     warps: int = 4) -> torch.Tensor:
    """Decode attention over KIVI buffers (the arguments of the Triton ``decode_attention``). Returns ``out``.

    ``warps``: per block, one of ``WARPS`` (``default_warps``); ``emulate``: run the CPU build on CPU tensors
    (tests)."""
    kv_heads = keys.resid.shape[1]
    if reason := unsupported(config, tuple(query.shape), kv_heads, keys.resid.dtype):
        raise ValueError(f"cuda decode_attention: {reason}")
    if emulate != (query.device.type == "cpu"):
        raise ValueError(f"cuda decode_attention: {query.device} tensors {'with' if emulate else 'without'} emulate "
                         "(the GPU build takes CUDA tensors, the emulation CPU tensors)")
    check_decode_buffers(query, keys, values, counts, config)
    lib = _library_for(query.device)
    if isinstance(lib, str):
        raise RuntimeError(f"cuda decode_attention: {lib}")
    layout = (config.k_bits, query.shape[3], query.shape[1] // kv_heads)
    if warps not in WARPS or not lib.kivi_decode_shared_bytes(*layout, warps):
        raise ValueError(f"cuda decode_attention: warps={warps}; this layout takes "
                         f"{[w for w in WARPS if lib.kivi_decode_shared_bytes(*layout, w)]}")
    if query.stride(-1) != 1 or query.stride(0) % 4 or query.stride(1) % 4 or query.data_ptr() % 16:
        query = query.contiguous()
    out = torch.empty_like(query) if out is None else out
    if tuple(out.shape) != tuple(query.shape) or out.stride(-1) != 1 or out.dtype not in (torch.float16, torch.float32):
        raise ValueError(f"cuda decode_attention: out must be fp16 or fp32 {tuple(query.shape)} with unit stride along D")
    tensors = (*keys.packed, keys.resid, *values.packed, values.resid)
    if any(t.data_ptr() % 16 for t in tensors):
        raise ValueError("cuda decode_attention: cache buffers must be 16-byte aligned")
    part, lse = split_targets(out, num_splits)
    batch, q_heads, _, dim = query.shape
    kq, vq = keys.packed, values.packed
    args = _Args(
        query.data_ptr(), out.data_ptr(), part.data_ptr(), lse.data_ptr(),
        kq.codes.data_ptr(), kq.scale.data_ptr(), kq.zero.data_ptr(), keys.resid.data_ptr(),
        vq.codes.data_ptr(), vq.scale.data_ptr(), vq.zero.data_ptr(), values.resid.data_ptr(), counts.data_ptr(),
        batch, kv_heads, q_heads, num_splits, warps, scaling * LOG2E, log2_cap(softcap),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kq.codes.shape[2], kq.scale.shape[2], keys.resid.shape[2], vq.codes.shape[2], values.resid.shape[2],
        int(v_ring), int(out.dtype == torch.float32))
    stream = None if emulate else torch.cuda.current_stream(query.device).cuda_stream
    code = lib.kivi_decode(ctypes.byref(args), config.k_bits, dim, stream)
    if code:
        reason = "a shape it does not serve" if code == -1 else lib.kivi_decode_error(code).decode()
        raise RuntimeError(f"cuda decode_attention: launch failed: {reason}")
    if num_splits > 1:
        merge_splits(part, lse, out)
    return out
