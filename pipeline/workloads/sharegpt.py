"""ShareGPT conversations as throughput requests, sampled as vLLM's benchmark_dataset.ShareGPTDataset does.

Entries with fewer than two turns are dropped, the rest shuffled with the seed; then, in that order,
turn 0 is the prompt and turn 1's token count the output length, keeping pairs that pass vLLM's
is_valid_sequence thresholds until n are found. Like vLLM, turn roles are not checked.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field, PositiveInt

from pipeline.workloads.base import Request, Workload, WorkloadOptions
from pipeline.workloads.data import DataSourceError, hub_file, local_path
from pipeline.workloads.registry import register_workload

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

HUB_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
LOCAL_PATTERN = "ShareGPT_V3_unfiltered_cleaned_split*.json"  # the full file or a prefix of it


class ShareGPTOptions(WorkloadOptions):
    n: PositiveInt = Field(256, description="requests to sample")
    filename: str | None = Field(
        None, description=f"file under data_dir/sharegpt; default the one file matching {LOCAL_PATTERN}"
    )
    min_len: PositiveInt = Field(4, description="fewest tokens of prompt and of output (vLLM's min_len)")
    max_prompt_len: PositiveInt = Field(1024, description="most prompt tokens (vLLM's max_prompt_len)")
    max_total_len: PositiveInt = Field(2048, description="most prompt + output tokens (vLLM's max_total_len)")


def length_filter(prompt_len: int, output_len: int, options: ShareGPTOptions, max_context: int) -> str | None:
    """Why vLLM's is_valid_sequence (plus the model's context) rejects a pair, or None when it passes."""
    if prompt_len < options.min_len:
        return f"prompt < {options.min_len} tokens"
    if output_len < options.min_len:
        return f"output < {options.min_len} tokens"
    if prompt_len > options.max_prompt_len:
        return f"prompt > {options.max_prompt_len} tokens"
    if prompt_len + output_len > options.max_total_len:
        return f"prompt + output > {options.max_total_len} tokens"
    if prompt_len + output_len > max_context:
        return "prompt + output > max_context"
    return None


@register_workload("sharegpt")
class ShareGPT(Workload):
    version = 1
    kind = "throughput"
    Options = ShareGPTOptions
    options: ShareGPTOptions
    hub_dataset = "anon8231489123/ShareGPT_Vicuna_unfiltered"

    def local_files(self) -> list[Path]:
        return [self._local_file()]

    def requests(self, tokenizer: PreTrainedTokenizerBase, max_context: int) -> list[Request]:
        self.check_data()
        self.skipped = Counter()
        path = self._local_file() if self.options.data_dir is not None else hub_file(self.hub_dataset, HUB_FILE)
        entries = [(index, entry) for index, entry in enumerate(json.loads(path.read_text(encoding="utf-8")))
                   if self._has_two_turns(entry)]
        random.Random(self.options.seed).shuffle(entries)
        requests = []
        for index, entry in entries:
            if len(requests) == self.options.n:
                break
            prompt, completion = entry["conversations"][0]["value"], entry["conversations"][1]["value"]
            prompt_len, output_len = (len(ids) for ids in tokenizer([prompt, completion]).input_ids)
            reason = length_filter(prompt_len, output_len, self.options, max_context)
            if reason:
                self.skipped[f"filtered: {reason}"] += 1
                continue
            requests.append(Request(
                request_id=str(index), workload=self.name, task="sharegpt", prompt=prompt,
                max_new_tokens=output_len, reference=json.dumps(None),
                # vLLM's throughput benchmark ignores EOS, so every request decodes exactly its output length.
                ignore_eos=True, prompt_tokens=prompt_len,
            ))
        return requests

    def _has_two_turns(self, entry: object) -> bool:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            self.skipped["filtered: fewer than two turns"] += 1
            return False
        if not all(isinstance(turn, dict) and isinstance(turn.get("value"), str) for turn in turns[:2]):
            self.skipped["malformed: turn without a text 'value'"] += 1
            return False
        return True

    def _local_file(self) -> Path:
        folder = local_path(self.options.data_dir, "sharegpt")
        if self.options.filename is not None:
            return local_path(self.options.data_dir, "sharegpt", self.options.filename)
        matches = sorted(folder.glob(LOCAL_PATTERN))
        if len(matches) != 1:
            found = ", ".join(p.name for p in matches) or "none"
            raise DataSourceError(f"{folder}: expected one file matching {LOCAL_PATTERN} (found {found}); "
                                  "set the workload option filename")
        return matches[0]
