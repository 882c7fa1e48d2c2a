"""Greedy generation on a real model with the Triton path against the PyTorch oracle path (CUDA).

    python -m tools.check_generation --model SmolLM2-135M-Instruct.Q4_1.gguf --text essay.txt

Each prompt runs twice under KIVI-2 (G = 32, R = 128): KiviCache(use_kernels=True), whose decode steps
use kivi.kernels.decode_attention and kivi.kernels.quantize, and use_kernels=False, the kivi/ oracle. Where the
tokens first differ, the gap between the oracle's two best logits at that step shows whether it was a tie,
and the quantized keys and values of the two caches (positions before that token) whether rounding-level
differences in earlier steps already flipped codes: a block flushed during generation holds generated
tokens, whose keys differ slightly between the paths, and a key at a rounding boundary (or a group's new
minimum or maximum) then takes another code, a change of a whole quantization step.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kivi import KiviCache, KiviConfig, enable_kivi
from pipeline.models import load_model


def _generate(model, ids, use_kernels: bool, new_tokens: int):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, past_key_values=KiviCache(model.config, KiviConfig(), use_kernels),
                         output_scores=True, return_dict_in_generate=True)
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--text", required=True, help="a long text; prompts are its first 300, 600, 900, 1200 tokens")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model, device="cuda", dtype=torch.float16)
    enable_kivi(model)
    text_ids = tokenizer(Path(args.text).read_text(), return_tensors="pt").input_ids.cuda()
    same = 0
    print(f"{'prompt':>7} {'equal':>6} {'first diff':>10} {'oracle top-2 gap':>17} {'quantized K/V differing before it':>34}")
    with torch.inference_mode():
        for length in (300, 600, 900, 1200):
            ids = text_ids[:, :length]
            fused, _, fused_cache = _generate(model, ids, True, args.tokens)
            oracle, scores, oracle_cache = _generate(model, ids, False, args.tokens)
            diff = (fused != oracle).nonzero()
            if len(diff) == 0:
                same += 1
                print(f"{length:>7} {'yes':>6} {'-':>10} {'-':>17}")
                continue
            step = int(diff[0])
            top2 = scores[step][0].float().topk(2).values
            differing, compared = _quantized_differences(fused_cache, oracle_cache, length + step)
            print(f"{length:>7} {'no':>6} {step:>10} {float(top2[0] - top2[1]):>17.4f} {f'{differing} of {compared}':>34}")
    print(f"{same}/4 prompts give identical {args.tokens}-token greedy continuations")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
