"""Kernel benchmark: ``python -m tools.kernel_bench [--json PATH] [--sweep]``.

Decode attention for one new token per sequence, fp16 SDPA against the fused KIVI-2 and KIVI-4 kernels, Triton's
and the CUDA C++ one (and the static engine's fp16 kernel, ``dense ms``), at batch B and context S, for the Llama-2-7B attention shape
(32 heads, head_dim 128, MHA) and a GQA shape (32 query / 8 KV heads) at long contexts, then short contexts at large
batches (``SHORT``: the nightly model's Qwen2.5-1.5B shape, 12 query / 2 KV heads, at B = 64 and 256, S = 1,024;
the ShareGPT sweep's regime, Llama-2-7B at B = 256 and 512, S = 640 and 1,024); and quantize + pack. Every time is the
median of CUDA-graph replays (``triton.testing.do_bench_cudagraph``) over input sets rotated through more than
4x the L2 cache: GPU time as the decode engine's captured step sees it, without the host's launch overhead
(which bounds small cases launched eagerly). Effective bandwidth = bytes that must be read and written / time,
as % of a device-to-device copy measured in the same run. ``--sweep`` times the CUDA kernel at each split count
and block size (``cuda_decode.WARPS``: 2, 4 and 8 warps) instead, at ``SWEEP``'s sizes or ``--only``'s.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.testing

from kivi import backend
from kivi.kernels import cuda_decode, dense_decode
from kivi.kernels.decode_attention import decode_attention, default_num_splits
from kivi.kernels.quantize import quantize, quantize_into
from kivi.config import KiviConfig
from kivi.quant import Quantized, StreamBuffers, allocate
from tools.bandwidth import copy_bandwidth
from tools.trees import git_sha

SHAPES = {"llama2-7b": (32, 32, 128), "gqa-32/8": (32, 8, 128), "qwen2.5-1.5b": (12, 2, 128),  # query, KV heads, head_dim
          "qwen2.5-7b": (28, 4, 128)}
BATCHES = (1, 8, 32)
CONTEXTS = (4096, 16384, 32768, 131072)
# Short contexts at large batches: the nightly model's shape on GSM8K-length sequences, and the ShareGPT sweep's
# regime (Llama-2-7B, prompts of a few hundred tokens plus their answers).
SHORT = (("qwen2.5-1.5b", 64, 1024), ("qwen2.5-1.5b", 256, 1024), ("llama2-7b", 256, 640), ("llama2-7b", 512, 640),
         ("llama2-7b", 256, 1024), ("llama2-7b", 512, 1024))
GROUP, RESIDUAL = 32, 128  # KiviConfig defaults
DTYPE = torch.float16


def median_ms(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def rotated(make, set_bytes: int):
    """A function cycling over enough input sets to span 4x the L2: ``make(False)`` on the inputs themselves,
    ``make(True)`` on copies of them."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    sets = [make(i > 0) for i in range(max(1, -(-4 * l2 // set_bytes)))]
    state = itertools.count()
    return lambda: sets[next(state) % len(sets)]()


@dataclass
class DecodeCase:
    shape: str
    batch: int
    tokens: int

    @property
    def heads(self) -> tuple[int, int, int]:
        return SHAPES[self.shape]


def kivi_config(bits: int) -> KiviConfig:
    return KiviConfig(k_bits=bits, v_bits=bits, group_size=GROUP, residual_length=RESIDUAL)


def kivi_args(keys: torch.Tensor, values: torch.Tensor, config: KiviConfig) -> tuple[StreamBuffers, StreamBuffers, torch.Tensor]:
    """(key buffers, value buffers, counts) of these K/V as KiviLayer holds them while it attends to the newest token:
    the flush rule has run over the tokens before it."""
    batch, kv_heads, tokens, dim = keys.shape
    n_qk, n_qv = config.keys.quantized(tokens - 1), config.values.quantized(tokens - 1)
    kq = quantize(keys[:, :, :n_qk], config.k_bits, GROUP, "channel")
    vq = quantize(values[:, :, :n_qv], config.v_bits, GROUP, "token")
    counts = torch.tensor([[0] * batch, [n_qk] * batch, [n_qv] * batch, [tokens] * batch], dtype=torch.int32)
    sink = keys.new_empty(batch, kv_heads, 0, dim)
    return (StreamBuffers(sink, kq, keys[:, :, n_qk:].contiguous()),
            StreamBuffers(sink, vq, values[:, :, n_qv:].contiguous()), counts.cuda())


def kivi_bytes(args: tuple, query: torch.Tensor) -> int:
    keys, values, counts = args
    tensors = (keys.sink, *keys.packed, keys.resid, values.sink, *values.packed, values.resid, counts)
    return sum(t.nbytes for t in tensors) + 2 * query.nbytes


def sdpa_decode(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):  # -> () -> [B, Hkv, Hq/Hkv, D]
    """fp16 SDPA for one token; GQA folds the query heads of a KV head into q_len (no mask is needed at decode),
    the usual way to run grouped decode on the flash kernels without repeating K/V."""
    batch, q_heads, _, dim = query.shape
    folded = query.view(batch, keys.shape[1], q_heads // keys.shape[1], dim)
    return lambda: F.scaled_dot_product_attention(folded, keys, values)


def time_sdpa(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> tuple[float, int]:
    nbytes = keys.nbytes + values.nbytes + 2 * query.nbytes
    fn = rotated(lambda copy: sdpa_decode(query, *((keys.clone(), values.clone()) if copy else (keys, values))), nbytes)
    return median_ms(fn), nbytes


def time_dense(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> float:
    """The static engine's fp16 kernel (per-sequence lengths; here every sequence is full)."""
    batch, kv_heads, tokens, dim = keys.shape
    lengths = torch.full((batch,), tokens, dtype=torch.int32, device=query.device)
    splits = dense_decode.default_num_splits(batch, kv_heads, tokens, query.device)
    nbytes = keys.nbytes + values.nbytes + 2 * query.nbytes

    def make(copy: bool):
        k, v = (keys.clone(), values.clone()) if copy else (keys, values)
        return lambda: dense_decode.dense_decode_attention(query, k, v, lengths, dim**-0.5, splits)

    return median_ms(rotated(make, nbytes))


def time_kivi(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bits: int, per_sm: int = 32,
              num_stages: int | None = None) -> tuple[float, int, int]:
    """(median ms, bytes, splits) of the fused Triton kernel."""
    batch, kv_heads, tokens, dim = keys.shape
    config = kivi_config(bits)
    splits = default_num_splits(batch, kv_heads, tokens, config, query.device, per_sm)
    call = lambda q, k, v, counts: decode_attention(q, k, v, counts, config, dim**-0.5, splits,  # noqa: E731
                                                    num_stages=num_stages)
    return (*time_kivi_call(query, keys, values, config, call), splits)


def time_cuda(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bits: int,
              splits: int | None = None, warps: int | None = None) -> tuple[float, int, int]:
    """(median ms, bytes, splits) of the CUDA kernel; ``warps`` (per block) None: as kivi.backend launches it for
    ``splits`` splits (None: its choice of both)."""
    batch, kv_heads, tokens, dim = keys.shape
    config = kivi_config(bits)
    if warps is None:
        if splits is None:
            splits, _ = cuda_decode.default_launch(batch, kv_heads, tokens, config, tuple(query.shape), query.device)
        call = lambda q, k, v, counts: backend.decode(q, k, v, counts, config, dim**-0.5, tokens,  # noqa: E731
                                                      num_splits=splits, kernel="cuda")
    else:
        call = lambda q, k, v, counts: cuda_decode.decode_attention(q, k, v, counts, config, dim**-0.5,  # noqa: E731
                                                                    splits, warps=warps)
    return (*time_kivi_call(query, keys, values, config, call), splits)


def time_kivi_call(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, config: KiviConfig, call) -> tuple[float, int]:
    """(median ms, bytes) of ``call(query, key buffers, value buffers, counts)`` over rotated copies of the buffers."""
    args = kivi_args(keys, values, config)
    nbytes = kivi_bytes(args, query)

    def make(copy: bool):
        (k, v, counts) = args
        if copy:
            k, v = (StreamBuffers(b.sink, Quantized(*(t.clone() for t in b.packed)), b.resid.clone()) for b in (k, v))
        return lambda: call(query, k, v, counts)

    return median_ms(rotated(make, nbytes)), nbytes


def decode_inputs(case: DecodeCase, gen: torch.Generator):
    """query [B, Hq, 1, D] and random fp16 keys (a few outlier channels) and values [B, Hkv, S, D], drawn
    directly in fp16 so that the largest cases fit."""
    q_heads, kv_heads, dim = case.heads
    shape = (case.batch, kv_heads, case.tokens, dim)
    keys = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
    keys[..., :: dim // 8] *= 10
    values = torch.randn(shape, generator=gen, device="cuda", dtype=DTYPE)
    return torch.randn(case.batch, q_heads, 1, dim, generator=gen, device="cuda", dtype=DTYPE), keys, values


def time_decode(case: DecodeCase, gen: torch.Generator) -> dict:
    query, keys, values = decode_inputs(case, gen)
    row = {"shape": case.shape, "batch": case.batch, "tokens": case.tokens}
    row["sdpa_ms"], row["sdpa_bytes"] = time_sdpa(query, keys, values)
    row["dense_ms"] = time_dense(query, keys, values)
    for bits in (2, 4):
        row[f"kivi{bits}_ms"], row[f"kivi{bits}_bytes"], row[f"kivi{bits}_splits"] = time_kivi(query, keys, values, bits)
        if not cuda_decode.unsupported(kivi_config(bits), tuple(query.shape), keys.shape[1], query.dtype):
            row[f"cuda{bits}_ms"], _, row[f"cuda{bits}_splits"] = time_cuda(query, keys, values, bits)
    return row


def time_quantize(copy_bw: float) -> list[dict]:
    rows = []
    x = torch.randn(8, 32, 4096, 128, device="cuda", dtype=DTYPE)
    for bits, axis in itertools.product((2, 4), ("channel", "token")):
        out = allocate(tuple(x.shape), bits, GROUP, axis, x.dtype, x.device, fill=torch.empty)
        ms = median_ms(lambda: quantize_into(x, out, bits, GROUP, axis))
        nbytes = x.nbytes + sum(t.nbytes for t in out)
        rows.append({"bits": bits, "axis": axis, "shape": list(x.shape), "ms": ms, "bytes": nbytes,
                     "copy_pct": 100 * nbytes / (ms * 1e-3) / copy_bw})
    return rows


def fits(case: DecodeCase) -> bool:
    """fp16 K/V plus the KIVI buffers within ~100 GB of the 141 GB card."""
    _, kv_heads, dim = case.heads
    return 2 * case.batch * kv_heads * case.tokens * dim * 2 <= 70e9


SWEEP = (("llama2-7b", 8, 32768), ("gqa-32/8", 8, 32768), ("llama2-7b", 512, 640), ("llama2-7b", 256, 1024),
         ("qwen2.5-1.5b", 64, 1024), ("qwen2.5-1.5b", 256, 1024))
SWEEP_SPLITS = (1, 2, 3, 4, 6, 8, 12, 17, 24, 33)


def sweep(gen: torch.Generator, cases: list[tuple[str, int, int]], save) -> list[dict]:
    """CUDA KIVI-2 time per split count and block size at ``cases`` (and the defaults' choice); the log gets every
    row, the screen the best per size; ``save(rows)`` after each size, so that a run cut at a time limit keeps what
    it timed."""
    rows = []
    config = kivi_config(2)
    for case in (DecodeCase(*c) for c in cases):
        query, keys, values = decode_inputs(case, gen)
        sdpa_ms, _ = time_sdpa(query, keys, values)
        default, default_warps = cuda_decode.default_launch(case.batch, case.heads[1], case.tokens, config,
                                                            tuple(query.shape), query.device)
        units = -(-case.tokens // cuda_decode.UNIT_TOKENS)
        warps = [w for w in cuda_decode.WARPS if cuda_decode.fits(config, tuple(query.shape), case.heads[1], query.device, w)]
        timed = []
        for splits, block in itertools.product(sorted({default, *(n for n in SWEEP_SPLITS if n <= units)}), warps):
            ms, _, _ = time_cuda(query, keys, values, 2, splits, block)
            chosen = (splits, block) == (default, default_warps)
            timed.append({"shape": case.shape, "batch": case.batch, "tokens": case.tokens, "sdpa_ms": sdpa_ms,
                          "cuda2_ms": ms, "splits": splits, "warps": block, "default": chosen})
            print(f"  splits={splits} warps={block}{' (default)' if chosen else ''}: {ms:.4f} ms", flush=True)
        best = min(timed, key=lambda r: r["cuda2_ms"])
        mine = next(r for r in timed if r["default"])
        print(f"sweep {case.shape} B={case.batch} S={case.tokens}: best splits={best['splits']} warps={best['warps']} "
              f"{best['cuda2_ms']:.4f} ms (x{sdpa_ms / best['cuda2_ms']:.2f} sdpa), default splits={default} "
              f"warps={default_warps} {mine['cuda2_ms']:.4f} ms (x{sdpa_ms / mine['cuda2_ms']:.2f}), sdpa {sdpa_ms:.4f} ms",
              flush=True)
        rows += timed
        save(rows)
        del query, keys, values
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default="kernels_bench.json")
    parser.add_argument("--sweep", action="store_true", help="time the CUDA kernel at each split count and block size at a few sizes instead")
    parser.add_argument("--only", metavar="SHAPE:B:S[,...]", help="time (or sweep) these decode cases, e.g. llama2-7b:8:32768")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    meta = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "git": git_sha(),
            "torch": torch.__version__, "triton": triton.__version__, "group_size": GROUP, "residual_length": RESIDUAL}
    copy_bw = copy_bandwidth()
    meta["copy_GBps"] = copy_bw / 1e9
    only = args.only and [(shape, int(batch), int(tokens)) for shape, batch, tokens in (c.split(":") for c in args.only.split(","))]
    if args.sweep:
        def save(rows: list[dict]) -> None:
            with open(args.json, "w") as f:
                json.dump({**meta, "sweep": rows}, f, indent=1)

        sweep(gen, only or SWEEP, save)
        return
    rows = []
    cases = only or [*itertools.product(("llama2-7b", "gqa-32/8"), BATCHES, CONTEXTS), *SHORT]
    for shape, batch, tokens in cases:
        case = DecodeCase(shape, batch, tokens)
        if fits(case):
            rows.append(time_decode(case, gen))
            torch.cuda.empty_cache()
    quant = time_quantize(copy_bw)
    with open(args.json, "w") as f:
        json.dump({**meta, "decode": rows, "quantize": quant}, f, indent=1)
    print_tables(meta, rows, quant, copy_bw)


def print_tables(meta: dict, rows: list[dict], quant: list[dict], copy_bw: float) -> None:
    pct = lambda nbytes, ms: 100 * nbytes / (ms * 1e-3) / copy_bw  # noqa: E731
    ratio = lambda r, key: f"{r['sdpa_ms'] / r[key]:7.2f}x" if key in r else f"{'-':>8}"  # noqa: E731
    ms = lambda r, key: f"{r[key]:9.4f}" if key in r else f"{'-':>9}"  # noqa: E731
    print(f"{meta['device']}, copy {copy_bw / 1e12:.2f} TB/s (read + write), torch {meta['torch']}, triton {meta['triton']}, "
          f"G={GROUP} R={RESIDUAL}; x: SDPA / kernel; bw: % of copy")
    print(f"{'shape':12} {'B':>3} {'S':>6} {'sdpa ms':>9} {'dense ms':>9} {'triton2':>9} {'cuda2':>9} {'x triton2':>9} "
          f"{'x cuda2':>8} {'bw cuda2':>8} {'triton4':>9} {'cuda4':>9} {'x triton4':>9} {'x cuda4':>8} splits")
    for r in rows:
        bw = f"{pct(r['kivi2_bytes'], r['cuda2_ms']):7.1f}%" if "cuda2_ms" in r else f"{'-':>8}"
        print(f"{r['shape']:12} {r['batch']:3d} {r['tokens']:6d} {r['sdpa_ms']:9.4f} {r['dense_ms']:9.4f} {ms(r, 'kivi2_ms')} "
              f"{ms(r, 'cuda2_ms')} {ratio(r, 'kivi2_ms'):>9} {ratio(r, 'cuda2_ms')} {bw} {ms(r, 'kivi4_ms')} "
              f"{ms(r, 'cuda4_ms')} {ratio(r, 'kivi4_ms'):>9} {ratio(r, 'cuda4_ms')} {r['kivi2_splits']}/{r.get('cuda2_splits', '-')}")
    for q in quant:
        print(f"quantize+pack {q['bits']}-bit axis={q['axis']:7} {q['shape']}: {q['ms']:.4f} ms, {q['copy_pct']:.1f}% of copy")


if __name__ == "__main__":
    main()
