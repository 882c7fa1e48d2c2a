"""Greedy generation on a real model with the Triton path against the PyTorch oracle path (CUDA).

    python -m kernels.check_generation --model SmolLM2-135M-Instruct.Q4_1.gguf --text essay.txt

Each prompt runs twice under KIVI-2 (G = 32, R = 128): KiviCache(use_kernels=True), whose decode steps
use kernels.decode_attention and kernels.quantize, and use_kernels=False, the kivi/ oracle. Where the
tokens first differ, the gap between the oracle's two best logits at that step shows whether it was a tie.
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
    return out.sequences[0, ids.shape[1]:], out.scores


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
    print(f"{'prompt':>7} {'equal':>6} {'first diff':>10} {'oracle top-2 gap':>17}")
    with torch.inference_mode():
        for length in (300, 600, 900, 1200):
            ids = text_ids[:, :length]
            fused, _ = _generate(model, ids, True, args.tokens)
            oracle, scores = _generate(model, ids, False, args.tokens)
            diff = (fused != oracle).nonzero()
            if len(diff) == 0:
                same += 1
                print(f"{length:>7} {'yes':>6} {'-':>10} {'-':>17}")
                continue
            step = int(diff[0])
            top2 = scores[step][0].float().topk(2).values
            print(f"{length:>7} {'no':>6} {step:>10} {float(top2[0] - top2[1]):>17.4f}")
    print(f"{same}/4 prompts give identical {args.tokens}-token greedy continuations")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
