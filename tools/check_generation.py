"""Greedy generation on a real model through the kernels and through the decode engine, against the PyTorch
oracle path.

    python -m tools.check_generation --model smollm2-135m --text essay.txt [--head-dim 128] [--json out.json]

Each prompt runs under KIVI-2 (G = 32, R = 128) through ``generate`` with KiviCache(use_kernels=False), the kivi/
oracle, the reference; ``generate`` with use_kernels=True, whose decode steps go through kivi.backend (the CUDA kernel
where it serves the layer, else Triton's) and kivi.kernels.quantize; and the decode engine (pipeline.decode_engine:
every prompt in one batch, one slot each, CUDA-graph steps on the slot cache and the same kernels, as ``kivi-eval
generate`` runs a shard), with its steps compiled as it serves them (``engine``) and with the model's modules run
eagerly in the graph (``engine eager``), each against the engine on the oracle (``engine oracle``: the same prefill
and slot cache, the kivi/ oracle's attention and flush, no graph), which is checked against ``generate``'s oracle
in turn. ``engine fp16`` against ``generate`` with no KIVI cache shows what the engine's own arithmetic (compiled
regions, its prefill) moves without KIVI. The engine reports no logits: the top-2 gap where an engine path parts
from the engine oracle is ``generate``'s oracle's, where its tokens are the engine oracle's up to there. EOS ends
nothing: every path makes ``--tokens`` tokens from the unmodified logits. ``--head-dim`` widens the model's heads
first (tools.widen_heads: the same function), so that a kernel of that head size serves it: SmolLM2-135M's heads of
64 at 128 run on the CUDA kernel. ``--device cpu`` runs the same on the oracle (a check of the tool, not of the
kernels).

Where a path's tokens first part from its reference's, the gap between the reference's two best logits at that
step shows whether it was a tie, and for ``generate`` the quantized keys and values of the two caches (positions
before that token) whether rounding-level differences in earlier steps already flipped codes: a block flushed during
generation holds generated tokens, whose keys differ slightly between the paths, and a key at a rounding boundary
(or a group's new minimum or maximum) then takes another code, a change of a whole quantization step.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kivi import KiviCache, KiviConfig, enable_kivi
from kivi.backend import serves_cuda
from pipeline.decode_engine import DecodeEngine, Sequence
from pipeline.models import load_model
from tools.kernel_bench import git_sha
from tools.widen_heads import widen_heads

PROMPT_LENGTHS = (300, 600, 900, 1200)


def _generate(model, ids, use_kernels: bool, new_tokens: int):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                         past_key_values=KiviCache(model.config, KiviConfig(), use_kernels), output_scores=True,
                         return_dict_in_generate=True)
    return out.sequences[0, ids.shape[1]:], out.scores, out.past_key_values


def _quantized_differences(fused: KiviCache, oracle: KiviCache, positions: int) -> tuple[int, int]:
    """(differing, compared) dequantized key and value elements of the two caches among the first
    ``positions`` tokens that both quantized."""
    differing = compared = 0
    for a, b in zip(fused.layers, oracle.layers):
        for x, y in ((a.key_stream, b.key_stream), (a.value_stream, b.value_stream)):
            n = min(x.n_quant[0], y.n_quant[0], positions - x.n_sink[0])
            if n > 0:
                dx, dy = x.dequantized()[:, :, :n], y.dequantized()[:, :, :n]
                differing += int((dx != dy).sum())
                compared += dx.numel()
    return differing, compared


def _decode_kernel(model) -> str:
    """The kernel kivi.backend gives this model's KIVI-2 decode steps (its layers share one shape)."""
    if model.device.type != "cuda":
        return "the oracle (CPU)"
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    query = torch.empty(1, config.num_attention_heads, 1, head_dim, dtype=model.dtype, device=model.device)
    cuda = serves_cuda(KiviConfig(), query, config.num_key_value_heads, model.dtype)
    return "the CUDA kernel" if cuda else "the Triton kernel"


def _first_difference(tokens: list[int], reference: list[int], scores) -> dict:
    """Where ``tokens`` first part from ``reference``, and the reference's top-2 logit gap there."""
    if tokens == reference:
        return dict(equal=True, first_difference=None, top2_gap=None)
    step = next(i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b)
    if step >= len(scores):  # no logits of that context (see the engine oracle)
        return dict(equal=False, first_difference=step, top2_gap=None)
    top2 = scores[step][0].float().topk(2).values
    return dict(equal=False, first_difference=step, top2_gap=float(top2[0] - top2[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a packaged model's name, a .gguf file or a model folder")
    parser.add_argument("--text", required=True, help="a long text; prompts are its first 300, 600, 900, 1200 tokens")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--head-dim", type=int, help="widen the attention heads to this size first")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args(argv)
    dtype = torch.float16 if args.device == "cuda" else torch.float32
    model, tokenizer = load_model(args.model, device=args.device, dtype=dtype)
    if args.head_dim:
        widen_heads(model, args.head_dim)
    model.generation_config.eos_token_id = None  # every path runs to --tokens on the unmodified logits
    enable_kivi(model)
    text_ids = tokenizer(Path(args.text).read_text(), return_tensors="pt").input_ids.to(model.device)
    prompts = [text_ids[:, :length] for length in PROMPT_LENGTHS]
    sequences = [Sequence(ids[0].tolist(), args.tokens) for ids in prompts]
    rows = []
    with torch.inference_mode():
        for ids in prompts:
            fused, _, fused_cache = _generate(model, ids, True, args.tokens)
            oracle, oracle_scores, oracle_cache = _generate(model, ids, False, args.tokens)
            fp16 = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=args.tokens,
                                  output_scores=True, return_dict_in_generate=True)
            row = dict(prompt=ids.shape[1], caches=(fused_cache, oracle_cache),
                       references={"oracle": (oracle.tolist(), oracle_scores),
                                   "fp16": (fp16.sequences[0, ids.shape[1]:].tolist(), fp16.scores)},
                       paths={"generate": ("oracle", fused.tolist())})
            rows.append(row)
        engines = {"engine oracle": (DecodeEngine(model, cuda_graph=False, compile_steps=False, use_kernels=False),
                                     KiviConfig(), "oracle"),
                   "engine": (DecodeEngine(model), KiviConfig(), "engine oracle"),
                   "engine eager": (DecodeEngine(model, compile_steps=False), KiviConfig(), "engine oracle"),
                   "engine fp16": (DecodeEngine(model), None, "fp16")}
        for name, (engine, kivi, reference) in engines.items():
            run = engine.generate(sequences, kivi, slots=len(sequences))
            for row, completion in zip(rows, run.completions):
                row["paths"][name] = (reference, completion.tokens)
        for row in rows:  # the engine oracle's gaps: generate's oracle's, as far as their tokens agree
            tokens, oracle_scores = row["paths"]["engine oracle"][1], row["references"]["oracle"][1]
            agree = _first_difference(tokens, row["references"]["oracle"][0], oracle_scores)["first_difference"]
            row["references"]["engine oracle"] = (tokens, oracle_scores if agree is None else oracle_scores[: agree + 1])
    kernel = _decode_kernel(model)
    print(f"KIVI-2 decode attention: {kernel}")
    print(f"{'prompt':>7} {'path':>13} {'against':>13} {'equal':>6} {'first diff':>10} {'top-2 gap there':>16} "
          f"{'quantized K/V differing before it':>34}")
    results = []
    for row in rows:
        for path, (reference, tokens) in row["paths"].items():
            result = dict(prompt=row["prompt"], path=path, reference=reference,
                          **_first_difference(tokens, *row["references"][reference]))
            if path == "generate" and not result["equal"]:  # only generate's cache is a KiviCache beside the oracle's
                result["quantized_differing"] = _quantized_differences(*row["caches"], row["prompt"] + result["first_difference"])
            results.append(result)
            diff = "-" if result["equal"] else result["first_difference"]
            gap = "-" if result["top2_gap"] is None else f"{result['top2_gap']:.4f}"
            cache = result.get("quantized_differing")
            print(f"{row['prompt']:>7} {path:>13} {reference:>13} {'yes' if result['equal'] else 'no':>6} {diff:>10} "
                  f"{gap:>16} {f'{cache[0]} of {cache[1]}' if cache else '-':>34}")
    for path in rows[0]["paths"]:
        same = sum(r["equal"] for r in results if r["path"] == path)
        print(f"{path}: {same}/{len(prompts)} prompts give the {rows[0]['paths'][path][0]} path's {args.tokens}-token "
              "greedy continuation")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(model=args.model, head_dim=args.head_dim, tokens=args.tokens, kernel=kernel,
                                                   git_sha=git_sha(),
                                                   device=torch.cuda.get_device_name() if model.device.type == "cuda" else "cpu",
                                                   rows=results), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
