"""One attention layer's decode step on the slot cache, in parts: ``python -m tools.bench_layer_step [--json PATH]``.

The engine's step is the model's forward over a ``SlotCache``; per attention layer that is: store the step's key
and value ((KIVI) after the flush of what the step before completed, in the same launch), then attend. This times
each part for one layer of the nightly model's shape (Qwen2.5-1.5B: 12 query / 2 KV heads, head_dim 128, fp16) at
``--slots`` sequences of ``--min-tokens..--max-tokens`` tokens (uniform, seeded) in slots of ``--capacity``: the
fp16 layer whole, its store and its decode; the KIVI-2 layer whole, its flush and store, the step's counts (once
per step for every layer), its decode on the CUDA kernel at several split counts (the default marked *) and on the
Triton kernel. CUDA-graph medians (``triton.testing.do_bench_cudagraph``), microseconds. The positions stay fixed
across replays, so a sequence whose key block is full flushes it in every replay (as some sequence does in most
steps of a large batch).
"""

from __future__ import annotations

import argparse
import datetime
import json

import torch
import triton
import triton.testing
from transformers import Qwen2Config

from kivi import backend
from kivi.config import KiviConfig
from kivi.kernels import cuda_decode
from kivi.layout import model_head_dim
from kivi.slot_cache import SlotCache
from tools.trees import git_sha

SHAPE = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=1, num_attention_heads=12,
                    num_key_value_heads=2, vocab_size=1000)


def us(fn) -> float:
    return 1000 * triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def layer_parts(slots: int, capacity: int, lengths: torch.Tensor) -> dict[str, float]:
    q_heads, kv_heads, dim = SHAPE.num_attention_heads, SHAPE.num_key_value_heads, model_head_dim(SHAPE)
    keys = torch.randn(slots, kv_heads, int(lengths.max()), dim, device="cuda", dtype=torch.float16)
    keys[..., :: dim // 8] *= 10  # outlier channels, as tools.kernel_data draws them
    values = torch.randn_like(keys)
    query = torch.randn(slots, q_heads, 1, dim, device="cuda", dtype=torch.float16)
    key, value = (torch.randn(slots, kv_heads, 1, dim, device="cuda", dtype=torch.float16) for _ in range(2))
    rows, scaling, parts = torch.arange(slots, device="cuda"), dim**-0.5, {}
    for name, kivi in (("fp16", None), ("kivi-2", KiviConfig())):
        cache = SlotCache(SHAPE, slots, capacity, torch.float16, "cuda", kivi)
        cache.load(rows, [(keys, values)], lengths.cuda())
        layer, state = cache.layers[0], cache.state
        parts[f"{name} layer (store, attend)"] = us(lambda: layer.attend(query, key, value, scaling, None))
        if kivi is None:
            row, lengths_now = state.ring(layer.rows)
            parts["fp16 store"] = us(lambda: backend.dense_store(key[:, :, 0], value[:, :, 0], layer.keys, layer.values, row))
            parts["fp16 decode"] = us(lambda: backend.dense_attention(query, layer.keys, layer.values, lengths_now, scaling,
                                                                      layer.num_splits))
            continue
        config, counts = layer.config, state.counts(layer.config)

        def step_counts():
            state._derived.clear()
            state.counts(config)

        parts["kivi-2 flush and store"] = us(lambda: backend.append(key[:, :, 0], value[:, :, 0], layer.key_resid,
                                                                    layer.value_ring, layer.keys, layer.values,
                                                                    state.positions, config))
        parts["kivi-2 counts (once per step)"] = us(step_counts)
        default, _ = cuda_decode.default_launch(slots, kv_heads, capacity, config, tuple(query.shape), query.device)
        for splits in sorted({default, 1, 2, 3, 4, 6}):  # each at the backend's block size for it
            parts[f"kivi-2 CUDA decode, {splits} splits{' *' if splits == default else ''}"] = us(
                lambda: backend.decode(query, layer.key_buffers, layer.value_buffers, counts, config, scaling, capacity,
                                       v_ring=True, num_splits=splits, kernel="cuda"))
        parts["kivi-2 Triton decode *"] = us(
            lambda: backend.decode(query, layer.key_buffers, layer.value_buffers, counts, config, scaling, capacity,
                                   v_ring=True, kernel="triton"))
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--capacity", type=int, default=1712, help="the nightly load's longest prompt + answer")
    parser.add_argument("--min-tokens", type=int, default=500)
    parser.add_argument("--max-tokens", type=int, default=1300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default="bench_layer_step.json")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    runs = []
    print(f"{'slots':>5} {'part':40} {'us':>8}")
    for slots in args.slots:
        lengths = torch.randint(args.min_tokens, args.max_tokens, (slots,), generator=gen)
        parts = layer_parts(slots, args.capacity, lengths)
        runs.append({"slots": slots, "us": parts})
        for part, value in parts.items():
            print(f"{slots:5d} {part:40} {value:8.2f}", flush=True)
    with open(args.json, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "git": git_sha(),
                   "torch": torch.__version__, "triton": triton.__version__, "args": vars(args), "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
