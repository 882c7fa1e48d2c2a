"""ShareGPT's first turns as (prompt, output length) pairs, sampled as vLLM's benchmark_dataset.ShareGPTDataset does.

Entries with fewer than two turns are dropped, the rest shuffled with the seed; then, in that order, turn 0 is the
prompt and turn 1's token count the output length, keeping pairs that pass vLLM's is_valid_sequence thresholds
until n are found. Like vLLM, turn roles are not checked. The sharegpt workload's requests and the prompts of
tools.bench_generate both come from here; it needs neither pydantic nor datasets (GPU hosts may lack them).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

LOCAL_PATTERN = "ShareGPT_V3_unfiltered_cleaned_split*.json"  # the full file or a prefix of it, under data_dir/sharegpt


@dataclass(frozen=True)
class LengthLimits:
    min_len: int = 4  # fewest tokens of prompt and of output (vLLM's min_len)
    max_prompt_len: int = 1024
    max_total_len: int = 2048


@dataclass(frozen=True)
class Pair:
    index: int  # the entry's place in the file
    prompt: str
    prompt_len: int
    output_len: int


def length_filter(prompt_len: int, output_len: int, limits: LengthLimits, max_context: int) -> str | None:
    """Why vLLM's is_valid_sequence (plus the model's context) rejects a pair, or None when it passes."""
    if prompt_len < limits.min_len:
        return f"prompt < {limits.min_len} tokens"
    if output_len < limits.min_len:
        return f"output < {limits.min_len} tokens"
    if prompt_len > limits.max_prompt_len:
        return f"prompt > {limits.max_prompt_len} tokens"
    if prompt_len + output_len > limits.max_total_len:
        return f"prompt + output > {limits.max_total_len} tokens"
    if prompt_len + output_len > max_context:
        return "prompt + output > max_context"
    return None


def sample_pairs(entries: list[Any], tokenizer, n: int | None, seed: int, limits: LengthLimits, max_context: int,
                 skipped: Counter[str]) -> list[Pair]:
    """The first ``n`` pairs (every one for None) in the seed's order; what is left out is counted in ``skipped``."""
    candidates = [(index, entry) for index, entry in enumerate(entries) if _has_two_turns(entry, skipped)]
    random.Random(seed).shuffle(candidates)
    pairs = []
    for index, entry in candidates:
        if len(pairs) == n:
            break
        prompt, completion = entry["conversations"][0]["value"], entry["conversations"][1]["value"]
        prompt_len, output_len = (len(ids) for ids in tokenizer([prompt, completion]).input_ids)
        reason = length_filter(prompt_len, output_len, limits, max_context)
        if reason:
            skipped[f"filtered: {reason}"] += 1
            continue
        pairs.append(Pair(index, prompt, prompt_len, output_len))
    return pairs


def _has_two_turns(entry: object, skipped: Counter[str]) -> bool:
    turns = entry.get("conversations") if isinstance(entry, dict) else None
    if not isinstance(turns, list) or len(turns) < 2:
        skipped["filtered: fewer than two turns"] += 1
        return False
    if not all(isinstance(turn, dict) and isinstance(turn.get("value"), str) for turn in turns[:2]):
        skipped["malformed: turn without a text 'value'"] += 1
        return False
    return True
