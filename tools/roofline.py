"""Roofline of the throughput sweep's decode steps: ``python -m tools.roofline RUN_ID --archive DIR``.

For each cache's best point (highest tokens/s) of a run's sweep, what one decode step must move and compute,
averaged over the decode: weight bytes (every matrix once), KV bytes (each sequence's stored tokens as the
attention reads them: codes, scales and zeros of the quantized part, 16-bit residual and window), FLOPs
(2 per weight per token, plus q.k and p.v). The roofline time is max(bytes / copy bandwidth, FLOPs / peak);
the measured step over it says how far the implementation is from the hardware. The run's requests are
rebuilt from its archived config (same data, same tokenizer), so the batch's real lengths are used.

On a CUDA machine the step's matmuls are also timed at the point's batch (``matmul_ms``: the model's own
projection, MLP and LM-head shapes, random weights), giving a tighter bound that no implementation running
the layers in order can beat: a layer's attention needs its projections' output and its MLP the attention's,
so matmul time + KV bytes / copy bandwidth is a floor of the step, and batch / that floor a ceiling of the
decode tokens/s. Run it on the GPU the sweep ran on.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import yaml
from transformers import PreTrainedModel
from triton.testing import do_bench

from kivi import KiviConfig
from kivi.cache import model_head_dim
from pipeline.config import RunConfig
from pipeline.models import load_model_config, load_tokenizer, meta_model, resolve_dtype
from pipeline.runner import workload_requests
from pipeline.store import Store

H200_FP16_TFLOPS = 989.0  # dense fp16 tensor-core peak (NVIDIA H200 datasheet)


@dataclass(frozen=True)
class StepCost:
    weight_bytes: int
    kv_bytes: float
    flops: float


def kv_bytes_per_token_head(context: int, kivi: KiviConfig | None, head_dim: int, item: int = 2) -> float:
    """Bytes the decode attention reads for one KV head of a sequence holding ``context`` tokens (this step's included)."""
    if kivi is None:
        return 2 * context * head_dim * item
    t = context - 1  # the position this step appended
    n_qk, n_qv = kivi.keys.quantized(t), kivi.values.quantized(t)
    quantized = lambda n, bits: n * head_dim * (bits / 8 + 2 * item / kivi.group_size)  # codes + scale + zero
    full = (context - n_qk + context - n_qv) * head_dim * item
    return quantized(n_qk, kivi.k_bits) + quantized(n_qv, kivi.v_bits) + full


def step_cost(model: PreTrainedModel, kivi: KiviConfig | None, prompt_lens: list[int], gen_len: int,
              item: int = 2) -> StepCost:
    """Mean cost of the gen_len - 1 decode steps of a batch (each sequence decodes gen_len tokens), 16-bit
    weights and activations (``item`` bytes). ``model`` may live on the meta device."""
    text = model.config.get_text_config(decoder=True)
    weights = sum(p.numel() for p in model.parameters())
    matmul_weights = weights - text.vocab_size * text.hidden_size  # the embedding is a lookup
    head_dim = model_head_dim(text)
    layers, kv_heads, q_heads = text.num_hidden_layers, text.num_key_value_heads, text.num_attention_heads
    steps = range(1, gen_len)
    contexts = [p + s for p in prompt_lens for s in steps]  # stored tokens + this step's
    kv = layers * kv_heads * sum(kv_bytes_per_token_head(n, kivi, head_dim, item) for n in contexts) / len(steps)
    attention_flops = 4 * layers * q_heads * head_dim * sum(contexts) / len(steps)
    return StepCost(item * weights, kv, 2 * matmul_weights * len(prompt_lens) + attention_flops)


def matmul_ms(model: PreTrainedModel, batch: int, dtype: torch.dtype = torch.float16) -> float:
    """Measured CUDA time of one decode step's matmuls for ``batch`` sequences: each linear layer of the first
    decoder layer times the layer count, plus the LM head, on random weights of the model's shapes (``model``
    may live on the meta device)."""
    text = model.config.get_text_config(decoder=True)
    shapes = [m.weight.shape for m in model.get_decoder().layers[0].modules() if isinstance(m, torch.nn.Linear)]
    head = model.get_output_embeddings().weight.shape
    weights = [torch.randn(s, dtype=dtype, device="cuda") for s in shapes]
    lm_head = torch.randn(head, dtype=dtype, device="cuda")
    inputs = {n: torch.randn(batch, n, dtype=dtype, device="cuda") for n in {s[1] for s in [*shapes, head]}}

    def layer():
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)

    def head_only():
        torch.nn.functional.linear(inputs[head[1]], lm_head)

    return text.num_hidden_layers * do_bench(layer) + do_bench(head_only)


def best_points(run_id: str, archive: str) -> tuple[RunConfig, list[dict]]:
    store = Store(archive)
    run = store.records("SELECT config_yaml FROM runs WHERE run_id = $1", [run_id])
    if not run:
        raise SystemExit(f"no run {run_id} in {archive}")
    points = store.records("""
        SELECT * FROM perf WHERE run_id = $1 AND NOT oom
        QUALIFY row_number() OVER (PARTITION BY workload, cache ORDER BY tokens_per_s DESC) = 1
        ORDER BY workload, cache""", [run_id])
    return RunConfig(**yaml.safe_load(run[0]["config_yaml"])), points  # data_dir resolved as load_config resolves it


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_id")
    parser.add_argument("--archive", default="archive")
    parser.add_argument("--tokenizer", help="override the config's tokenizer spec (e.g. a local folder)")
    parser.add_argument("--copy-tbps", type=float, required=True, help="device-to-device copy bandwidth measured on the GPU")
    parser.add_argument("--peak-tflops", type=float, default=H200_FP16_TFLOPS)
    args = parser.parse_args(argv)
    config, points = best_points(args.run_id, args.archive)
    tokenizer = load_tokenizer(args.tokenizer or config.model.tokenizer or config.model.spec)
    model = meta_model(load_model_config(config.model.spec))
    caches, workloads = config.kivi_configs(), config.build_workloads()
    requests = {name: workload_requests(w, tokenizer, config.model.max_context)
                for name, w in workloads.items() if w.kind == "throughput"}
    cuda = torch.cuda.is_available()
    dtype = resolve_dtype(config.model.dtype, "cuda")
    print(f"{'cache':20} {'B':>5} {'step ms':>8} {'weights GB':>10} {'KV GB':>7} {'TFLOP':>6} {'bytes ms':>8} "
          f"{'FLOP ms':>8} {'roofline':>8} {'measured/roofline':>17}"
          + (f" {'matmul ms':>9} {'floor ms':>8} {'decode tok/s ceiling':>20}" if cuda else ""))
    for point in points:
        batch = requests[point["workload"]][: point["batch_size"]]
        cost = step_cost(model, caches[point["cache"]], [r.prompt_tokens for r in batch], point["gen_len"])
        bytes_ms = (cost.weight_bytes + cost.kv_bytes) / (args.copy_tbps * 1e9)
        flop_ms = cost.flops / (args.peak_tflops * 1e9)
        roof = max(bytes_ms, flop_ms)
        print(f"{point['cache']:20} {point['batch_size']:5d} {point['step_ms']:8.2f} {cost.weight_bytes / 1e9:10.2f} "
              f"{cost.kv_bytes / 1e9:7.2f} {cost.flops / 1e12:6.2f} {bytes_ms:8.2f} {flop_ms:8.2f} {roof:8.2f} "
              f"{point['step_ms'] / roof:17.2f}", end="")
        if cuda:
            matmuls = matmul_ms(model, point["batch_size"], dtype)
            floor = matmuls + cost.kv_bytes / (args.copy_tbps * 1e9)
            print(f" {matmuls:9.2f} {floor:8.2f} {point['batch_size'] * 1e3 / floor:20,.0f}", end="")
        print()


if __name__ == "__main__":
    main()
