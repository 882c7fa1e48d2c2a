"""GPU correctness check at realistic sizes: ``python -m tools.kernel_check [--only CHECK ...] [--json PATH]``.

The CPU tests (tests/kernels, Triton interpreter) cover odd shapes on small inputs; this runs the compiled
kernels on the GPU against the same oracles at serving sizes, on random K/V with outlier channels and on the
real SmolLM2-135M K/V: MHA, GQA, one KV head (MQA), head sizes 64, 128 and 256, soft-capped logits, and the slot
cache's steps (dense and KIVI, a sliding window's ring, a head size of 96 stored padded, key blocks flushed).
``--only`` runs some of the checks (``CHECKS``). Prints one table; exits non-zero if any case fails.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

import torch

from transformers import MistralConfig

from kivi.backend import decode_attention, serves_cuda
from kivi.kernels import cuda_decode
from kivi.kernels.quantize import quantize
from kivi.config import KiviConfig
from kivi.slot_cache import SlotCache
from kivi.quant import GROUP_DIM, unpack
from kivi.quant import quantize as reference_quantize
from tools.kernel_data import REAL_KV, fill_streams, outlier_kv, reference_decode, relative_error
from tools.trees import git_sha

TOLERANCE = 1e-3
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def check_quantize(rows: list[dict], gen: torch.Generator) -> None:
    for dtype_name, dtype in DTYPES.items():
        keys, values = outlier_kv(8, 32, 4096, 128, dtype, "cuda", gen)
        for bits in (2, 4, 8):
            for axis, x in (("channel", keys), ("token", values)):
                got, ref = quantize(x, bits, 32, axis), reference_quantize(x, bits, 32, GROUP_DIM[axis])
                diff = (unpack(got.codes, bits, GROUP_DIM[axis]) - unpack(ref.codes, bits, GROUP_DIM[axis])).abs()
                stats_equal = torch.equal(got.scale, ref.scale) and torch.equal(got.zero, ref.zero)
                frac = (diff > 0).float().mean().item()
                rows.append({
                    "check": "quantize", "case": f"{axis} {bits}-bit {dtype_name} [8,32,4096,128]",
                    "metric": "codes differing", "value": frac,
                    "ok": stats_equal and diff.max().item() <= 1 and frac <= 1e-4,
                })


def decode_rows(rows: list[dict], name: str, query, ks, vs, softcap: float | None = None, warps: int | None = None,
                **kwargs) -> None:
    """The Triton kernel against the oracle and, where it serves the case, the CUDA kernel (at ``warps`` per block,
    None: the backend's choice) against the oracle and against the Triton kernel (the path the CPU tests run in the
    interpreter)."""
    scaling = query.shape[-1] ** -0.5
    ref = reference_decode(query, ks, vs, scaling, softcap)
    outs = {}
    for kernel in ("triton", "cuda"):
        if kernel == "cuda" and not serves_cuda(KiviConfig.from_streams(ks.config, vs.config), query, ks.resid.shape[1],
                                                ks.resid.dtype):
            break
        outs[kernel] = torch.full(query.shape, float("nan"), dtype=torch.float32, device="cuda")
        decode_attention(query, ks, vs, scaling, out=outs[kernel], softcap=softcap, kernel=kernel,
                         warps=warps if kernel == "cuda" else None, **kwargs)
        err = relative_error(outs[kernel], ref)
        rows.append({"check": "decode" if kernel == "triton" else "cuda", "case": name, "metric": "rel. error",
                     "value": err, "ok": err <= TOLERANCE})
    if "cuda" in outs:
        diff = relative_error(outs["cuda"], outs["triton"])
        rows.append({"check": "cuda", "case": name, "metric": "rel. diff. Triton", "value": diff, "ok": diff <= TOLERANCE})


def check_decode_random(rows: list[dict], gen: torch.Generator) -> None:
    configs = {
        "kivi-2": KiviConfig.from_name("kivi-2"),
        "kivi-4": KiviConfig.from_name("kivi-4"),
        "kivi-2 4 sinks": KiviConfig(sink_tokens=4),
    }
    lengths = [8191, 5000, 1234, 131]  # ragged, multiples of neither G nor R
    for (q_heads, kv_heads, dim), shape in (((32, 32, 128), "MHA 32x128"), ((32, 8, 128), "GQA 32/8x128"),
                                            ((9, 3, 64), "GQA 9/3x64")):
        for dtype_name, dtype in DTYPES.items():
            keys, values = outlier_kv(len(lengths), kv_heads, max(lengths), dim, dtype, "cuda", gen)
            query = torch.randn(len(lengths), q_heads, 1, dim, generator=gen, device="cuda").to(dtype)
            streams = {name: fill_streams(keys, values, lengths, cfg) for name, cfg in configs.items()}
            for cfg_name, (ks, vs) in streams.items():
                decode_rows(rows, f"{shape} {dtype_name} {cfg_name} L={lengths}", query, ks, vs)
            decode_rows(rows, f"{shape} {dtype_name} kivi-2 one split", query, *streams["kivi-2"], num_splits=1)
    # The layouts of current small models: one KV head, head_dim 256, and soft-capped logits (fp16: one build each).
    for (q_heads, kv_heads, dim), shape in (((12, 2, 128), "GQA 12/2x128 (Qwen2.5-1.5B)"),
                                            ((4, 1, 256), "MQA 4/1x256 (Gemma 3 1B)"), ((8, 4, 256), "GQA 8/4x256 (Gemma 2 2B)")):
        keys, values = outlier_kv(len(lengths), kv_heads, max(lengths), dim, torch.float16, "cuda", gen)
        query = torch.randn(len(lengths), q_heads, 1, dim, generator=gen, device="cuda").half()
        ks, vs = fill_streams(keys, values, lengths, configs["kivi-2"])
        decode_rows(rows, f"{shape} fp16 kivi-2 L={lengths}", query, ks, vs)
        decode_rows(rows, f"{shape} fp16 kivi-2 soft-capped at 8", query, ks, vs, softcap=8.0)
    check_block_sizes(rows, gen)


def check_block_sizes(rows: list[dict], gen: torch.Generator) -> None:
    """The CUDA kernel's blocks of two and of eight warps (four: every other row), every layout that takes them, at
    sequences of two units a warp or more (eight warps: the backend's choice for few blocks of such sequences,
    Qwen2.5-1.5B's shape at 64 slots) and of a few units a block (two warps: short contexts of many sequences)."""
    for warps, lengths in ((8, [1024, 1000, 1290, 800] * 16), (2, [330, 64, 200, 97] * 16)):  # B = 64
        for (q_heads, kv_heads, dim), shape in (((12, 2, 128), "GQA 12/2x128"), ((32, 32, 128), "MHA 32x128"),
                                                ((4, 1, 256), "MQA 4/1x256")):
            keys, values = outlier_kv(len(lengths), kv_heads, max(lengths), dim, torch.float16, "cuda", gen)
            query = torch.randn(len(lengths), q_heads, 1, dim, generator=gen, device="cuda").half()
            for name in ("kivi-2", "kivi-4"):
                config = KiviConfig.from_name(name)
                if not cuda_decode.fits(config, tuple(query.shape), kv_heads, query.device, warps=warps):
                    continue
                ks, vs = fill_streams(keys, values, lengths, config)
                decode_rows(rows, f"{shape} fp16 {name} B=64 L~{max(lengths)} {warps} warps", query, ks, vs,
                            warps=warps, num_splits=1)


def check_slot_steps(rows: list[dict], gen: torch.Generator) -> None:
    """SlotCache steps on the kernels against the same steps on the oracle (prompts loaded, four decode steps):
    dense and KIVI layers, a sliding window's ring, soft-capping, a head size the kernels take padded, and 160
    short sequences of 12 / 2 heads (the default launch's blocks of 2 warps, over the value ring); the prompt of
    1,280 tokens ends a key block (flushed by the first step) and the one of 510 completes one at its second step
    (flushed by the third)."""
    mixed, short = [3000, 510, 1280, 64], [330, 510, 200, 97] * 40
    cases = {"MHA 32x128 window 1024": ((32, 32, 128), 1024, None, mixed),
             "GQA 12/2x128 soft-capped at 8": ((12, 2, 128), None, 8.0, mixed),
             "MQA 4/1x256 window 512": ((4, 1, 256), 512, None, mixed),
             "MHA 32x96 (Phi-3, padded to 128)": ((32, 32, 96), None, None, mixed),
             "GQA 12/2x128 B=160": ((12, 2, 128), None, None, short)}
    for name, ((q_heads, kv_heads, dim), window, softcap, lengths) in cases.items():
        config = MistralConfig(hidden_size=q_heads * dim, num_attention_heads=q_heads, num_key_value_heads=kv_heads,
                               head_dim=dim, num_hidden_layers=1, intermediate_size=16, vocab_size=16, sliding_window=window)
        keys, values = outlier_kv(len(lengths), kv_heads, max(lengths), dim, torch.float16, "cuda", gen)
        for cache_name, kivi in (("fp16", None), ("kivi-2", KiviConfig())):
            caches = [SlotCache(config, len(lengths), max(lengths) + 8, torch.float16, "cuda", kivi, use_kernels)
                      for use_kernels in (True, False)]
            for cache in caches:
                cache.load(torch.arange(len(lengths), device="cuda"), [(keys, values)], torch.tensor(lengths))
            worst = 0.0
            for _ in range(4):
                query = torch.randn(len(lengths), q_heads, 1, dim, generator=gen, device="cuda").half()
                key, value = outlier_kv(len(lengths), kv_heads, 1, dim, torch.float16, "cuda", gen)
                outs = [cache.layers[0].attend(query, key, value, dim**-0.5, softcap) for cache in caches]
                for cache in caches:
                    cache.advance()
                worst = max(worst, relative_error(*outs))
            shown = f"L={lengths}" if len(lengths) <= 4 else f"L~{max(lengths)}"
            rows.append({"check": "slots", "case": f"{name} {cache_name} {shown}", "metric": "rel. error",
                         "value": worst, "ok": worst <= TOLERANCE})


def check_decode_real(rows: list[dict]) -> None:
    data = torch.load(REAL_KV)
    lengths = [256, 229, 197]
    for dtype_name, dtype in DTYPES.items():
        keys, values, queries = (data[k].to("cuda", dtype) for k in ("keys", "values", "queries"))
        first = keys.shape[2] - queries.shape[2]
        query = torch.stack([queries[b, :, n - 1 - first] for b, n in enumerate(lengths)]).unsqueeze(2)
        for cfg_name in ("kivi-2", "kivi-4", "kivi-2-r32"):
            ks, vs = fill_streams(keys, values, lengths, KiviConfig.from_name(cfg_name))
            decode_rows(rows, f"SmolLM2 layers {data['layers']} {dtype_name} {cfg_name}", query, ks, vs)
            padded = [torch.nn.functional.pad(x, (0, 64)) for x in (keys, values, query)]  # zero channels: the same attention
            pks, pvs = fill_streams(*padded[:2], lengths, KiviConfig.from_name(cfg_name))
            decode_rows(rows, f"SmolLM2 layers {data['layers']} {dtype_name} {cfg_name} padded to 128", padded[2], pks, pvs)


CHECKS = {"quantize": check_quantize, "random": check_decode_random, "real": lambda rows, gen: check_decode_real(rows),
          "slots": check_slot_steps}


class _Printed(list):
    """The rows, each printed as it is appended and, given a path, the JSON rewritten with it: a run stopped at a time
    limit still shows and keeps what it checked."""

    def __init__(self, json_path: str | None) -> None:
        super().__init__()
        self.json_path = json_path
        self.meta = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "git": git_sha()}

    def append(self, row: dict) -> None:
        super().append(row)
        print(f"{row['check']:8} {row['case']} {row['metric']} {row['value']:.2e} {'ok' if row['ok'] else 'FAILED'}", flush=True)
        if self.json_path:
            with open(self.json_path, "w") as f:
                json.dump(self.meta | {"rows": list(self)}, f, indent=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=CHECKS, help="these checks alone (default: all, in this order)")
    parser.add_argument("--json", help="also write the rows here, as each is checked")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("tools.kernel_check needs CUDA; the CPU tests are `pytest tests/kernels`", file=sys.stderr)
        return 2
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = _Printed(args.json)
    for name in args.only or CHECKS:
        CHECKS[name](rows, gen)
    width = max(len(r["case"]) for r in rows)
    print(f"{'check':8} {'case':{width}} {'metric':16} {'value':>9}  ok")
    for r in rows:
        print(f"{r['check']:8} {r['case']:{width}} {r['metric']:16} {r['value']:9.2e}  {'yes' if r['ok'] else 'NO'}")
    failed = sum(not r["ok"] for r in rows)
    print(f"{len(rows) - failed}/{len(rows)} passed on {torch.cuda.get_device_name()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
