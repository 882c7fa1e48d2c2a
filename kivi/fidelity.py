"""How far a KIVI cache moves a model's next-token distributions: teacher-forced KL to fp16 and perplexity.

    python -m kivi.fidelity --model smollm2-135m --tokens 2048 --json

A long real text (the NIAH haystack of Paul Graham essays) is fed in chunks: the first chunk is the prefill,
every later chunk attends to what the cache stored, as decode steps do. For each configuration the mean
KL(p_fp16 || p_kivi) and the perplexity are taken over all positions after the prefill chunk.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from kivi.cache import KiviCache
from kivi.config import KiviConfig
from kivi.integration import enable_kivi

# The rows of the paper's comparison: fp16 baseline, KIVI-4, KIVI-2, KIVI-2 without residual, per-token keys.
DEFAULT_CONFIGS = ("fp16", "kivi-4", "kivi-2", "kivi-2-r0", "token-keys-2")


@dataclass
class FidelityRow:
    config: str
    cache: str
    mean_kl: float
    top1_agreement: float  # share of positions whose argmax token equals fp16's
    perplexity: float
    kv_ratio: float  # kv_bytes / fp16_kv_bytes after the whole text


@torch.inference_mode()
def measure_fidelity(model, input_ids: torch.Tensor, configs=DEFAULT_CONFIGS, chunk: int = 32) -> list[FidelityRow]:
    """input_ids: [1, T]. Returns one row per configuration name ("fp16" or a KiviConfig preset)."""
    enable_kivi(model)
    # Every cache is built before the first forward pass: one the model cannot hold is refused at once.
    caches = {name: KiviCache(model.config, KiviConfig.from_name(name)) for name in configs if name != "fp16"}
    reference = chunked_logprobs(model, input_ids, DynamicCache(config=model.config), chunk)
    rows = []
    for name in configs:
        if name == "fp16":
            logprobs, cache_name, ratio = reference, "fp16", 1.0
        else:
            cache = caches[name]
            logprobs = chunked_logprobs(model, input_ids, cache, chunk)
            cache_name, ratio = cache.config.name, cache.kv_bytes() / cache.fp16_kv_bytes()
        rows.append(FidelityRow(name, cache_name, **compare(reference, logprobs, input_ids, chunk), kv_ratio=ratio))
    return rows


def chunked_logprobs(model, input_ids: torch.Tensor, cache, chunk: int) -> torch.Tensor:
    """Float32 log-probabilities [T - chunk - 1, V] at positions chunk .. T-2 (the last one predicts nothing)."""
    out = []
    for start in range(0, input_ids.shape[1] - 1, chunk):
        logits = model(input_ids[:, start : start + chunk], past_key_values=cache, use_cache=True).logits[0]
        if start:
            out.append(logits.float().log_softmax(-1))
    return torch.cat(out)[:-1]


def compare(reference: torch.Tensor, logprobs: torch.Tensor, input_ids: torch.Tensor, chunk: int) -> dict[str, float]:
    """Mean KL(reference || logprobs), top-1 agreement and perplexity over the positions after the prefill chunk."""
    targets = input_ids[0, chunk + 1 :].to(logprobs.device)  # what those positions predict
    kl = (reference.exp() * (reference - logprobs)).sum(-1).mean().item()
    agreement = (reference.argmax(-1) == logprobs.argmax(-1)).float().mean().item()
    nll = -logprobs.gather(-1, targets[:, None]).mean()
    return dict(mean_kl=kl, top1_agreement=agreement, perplexity=nll.exp().item())


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=32, help="tokens per forward step after the prefill chunk")
    parser.add_argument("--configs", default=",".join(DEFAULT_CONFIGS))
    parser.add_argument("--data-dir", type=Path, default=os.environ.get("KIVI_DATA_DIR"), help="folder with niah/PaulGrahamEssays (env KIVI_DATA_DIR)")
    parser.add_argument("--text-file", type=Path, help="use this text instead of the essays")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    for name in configs:  # fail on a bad name before the model loads
        if name != "fp16":
            KiviConfig.from_name(name)
    if args.text_file is None and args.data_dir is None:
        parser.error("pass --data-dir (or set KIVI_DATA_DIR) to the shared data folder, or --text-file")
    from pipeline.models import load_model  # the CLI reuses the pipeline's model loader and haystack
    from pipeline.workloads.fidelity import haystack_text

    text = args.text_file.read_text() if args.text_file else haystack_text(Path(args.data_dir))

    model, tokenizer = load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, : args.tokens].to(args.device)
    if ids.shape[1] < args.tokens:
        parser.error(f"--tokens {args.tokens}: the text has only {ids.shape[1]} tokens")
    rows = measure_fidelity(model, ids, configs, args.chunk)
    if args.json:
        print(json.dumps({"model": args.model, "tokens": args.tokens, "chunk": args.chunk, "dtype": args.dtype,
                          "rows": [asdict(r) for r in rows]}, indent=2))
        return
    print(f"{'config':<14} {'cache':<30} {'mean KL':>10} {'top-1':>7} {'ppl':>9} {'kv ratio':>9}")
    for r in rows:
        print(f"{r.config:<14} {r.cache:<30} {r.mean_kl:>10.5f} {r.top1_agreement:>7.3f} {r.perplexity:>9.3f} {r.kv_ratio:>9.3f}")


if __name__ == "__main__":
    main()
