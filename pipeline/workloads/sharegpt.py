"""ShareGPT conversations as throughput requests, sampled as vLLM's benchmark_dataset.ShareGPTDataset does
(pipeline.sharegpt_pairs): turn 0 the prompt, turn 1's token count the output length, EOS ignored.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import Field, PositiveInt

from pipeline.sharegpt_pairs import LOCAL_PATTERN, LengthLimits, length_filter, sample_pairs
from pipeline.workloads.base import Request, Workload, WorkloadOptions
from pipeline.workloads.data import DataSourceError, hub_file, local_path
from pipeline.workloads.registry import register_workload

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["ShareGPT", "ShareGPTOptions", "length_filter"]

HUB_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


class ShareGPTOptions(WorkloadOptions):
    n: PositiveInt = Field(256, description="requests to sample")
    filename: str | None = Field(
        None, description=f"file under data_dir/sharegpt; default the one file matching {LOCAL_PATTERN}"
    )
    min_len: PositiveInt = Field(4, description="fewest tokens of prompt and of output (vLLM's min_len)")
    max_prompt_len: PositiveInt = Field(1024, description="most prompt tokens (vLLM's max_prompt_len)")
    max_total_len: PositiveInt = Field(2048, description="most prompt + output tokens (vLLM's max_total_len)")


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
        o = self.options
        pairs = sample_pairs(json.loads(path.read_text(encoding="utf-8")), tokenizer, o.n, o.seed,
                             LengthLimits(o.min_len, o.max_prompt_len, o.max_total_len), max_context, self.skipped)
        # vLLM's throughput benchmark ignores EOS, so every request decodes exactly its output length.
        return [Request(request_id=str(p.index), workload=self.name, task="sharegpt", prompt=p.prompt,
                        max_new_tokens=p.output_len, reference=json.dumps(None), ignore_eos=True,
                        prompt_tokens=p.prompt_len) for p in pairs]

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
