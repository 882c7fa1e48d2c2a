"""How far a KIVI cache moves a model's next-token distributions: teacher-forced KL to fp16 and perplexity.

A long real text (the NIAH haystack of Paul Graham essays) is fed in chunks: the first chunk is the prefill,
every later chunk attends to what the cache stored, as decode steps do. For each configuration the mean
KL(p_fp16 || p_kivi) and the perplexity are taken over all positions after the prefill chunk.
The command line is tools/fidelity.py (``python -m tools.fidelity --model smollm2-135m --tokens 2048 --json``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from kivi.cache import KiviCache
from kivi.config import FP16, KiviConfig
from kivi.integration import enable_kivi

# The rows of the paper's comparison: fp16 baseline, KIVI-4, KIVI-2, KIVI-2 without residual, per-token keys.
DEFAULT_CONFIGS = (FP16, "kivi-4", "kivi-2", "kivi-2-r0", "token-keys-2")


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
    caches = {name: KiviCache(model.config, KiviConfig.from_name(name)) for name in configs if name != FP16}
    reference = chunked_logprobs(model, input_ids, DynamicCache(config=model.config), chunk)
    rows = []
    for name in configs:
        if name == FP16:
            logprobs, cache_name, ratio = reference, FP16, 1.0
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
    kl = mean_kl(reference, logprobs)
    agreement = (reference.argmax(-1) == logprobs.argmax(-1)).float().mean().item()
    nll = -logprobs.gather(-1, targets[:, None]).mean()
    return dict(mean_kl=kl, top1_agreement=agreement, perplexity=nll.exp().item())


def mean_kl(reference: torch.Tensor, logprobs: torch.Tensor) -> float:
    """Mean over positions of KL(reference || logprobs), both log-probabilities [positions, V]."""
    return (reference.exp() * (reference - logprobs)).sum(-1).mean().item()


@torch.inference_mode()
def decode_kl(model, prompt: list[int], output: list[int], config: KiviConfig) -> float:
    """Mean KL(p_fp16 || p_kivi) over the distributions that chose ``output`` (a generation) after ``prompt``: fp16 in
    one exact forward pass, KIVI as decoding ran it, the prompt's prefill, then a token at a time over its cache."""
    enable_kivi(model)
    ids = torch.tensor([prompt + output[:-1]], device=model.device)
    reference = model(ids, past_key_values=DynamicCache(config=model.config)).logits[0, len(prompt) - 1 :]
    cache = KiviCache(model.config, config)
    steps = [model(ids[:, : len(prompt)], past_key_values=cache, use_cache=True).logits[0, -1:]]
    steps += [model(ids[:, i : i + 1], past_key_values=cache, use_cache=True).logits[0] for i in range(len(prompt), ids.shape[1])]
    return mean_kl(reference.float().log_softmax(-1), torch.cat(steps).float().log_softmax(-1))
