"""Fidelity: KIVI's effect on next-token distributions, teacher-forced over the NIAH haystack (see kivi.fidelity).

Each request is a window of `tokens` consecutive haystack tokens. The worker runs it through fp16 and
through each cache in chunks and stores, per window, the top-1 agreement with fp16 as the score (so
`max_drop` gate rules apply) and the mean KL and perplexity in `meta`.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field, PositiveInt, model_validator

from pipeline.workloads.base import Request, TeacherForcing, Workload, WorkloadOptions
from pipeline.workloads.niah import essay_paths
from pipeline.workloads.registry import register_workload

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class FidelityOptions(WorkloadOptions):
    n: PositiveInt = Field(2, description="windows of the haystack, each a request")
    tokens: PositiveInt = Field(2048, description="tokens per window (capped at the model's max_context)")
    chunk: PositiveInt = Field(32, description="tokens per forward step after the prefill chunk")

    @model_validator(mode="after")
    def _needs_local_essays(self) -> FidelityOptions:
        if self.data_dir is None:
            raise ValueError("the haystack essays are not on the Hugging Face Hub: set data_dir (niah/PaulGrahamEssays)")
        if self.chunk * 2 > self.tokens:
            raise ValueError(f"chunk={self.chunk} leaves nothing to measure in {self.tokens} tokens: use tokens >= 2 * chunk")
        return self


def haystack_text(data_dir: Path) -> str:
    """The essays joined by blank lines: the text tools.fidelity and this workload measure on."""
    return "\n\n".join(p.read_text(encoding="utf-8") for p in essay_paths(data_dir))


@register_workload("fidelity")
class Fidelity(Workload):
    version = 1
    kind = "teacher_forced"
    Options = FidelityOptions
    options: FidelityOptions

    def local_files(self) -> list[Path]:
        return essay_paths(self.options.data_dir)

    def requests(self, tokenizer: PreTrainedTokenizerBase, max_context: int) -> list[Request]:
        self.skipped = Counter()
        text = haystack_text(self.options.data_dir)
        ids = tokenizer(text, add_special_tokens=False).input_ids
        tokens = min(self.options.tokens, max_context)
        windows = [ids[start : start + tokens] for start in range(0, len(ids) - tokens + 1, tokens)]
        forcing = TeacherForcing(tokens, self.options.chunk)
        return [
            Request(request_id=f"window{i}", workload=self.name, task="fidelity", prompt=tokenizer.decode(window),
                    max_new_tokens=0, reference=json.dumps(None), teacher_forcing=forcing)
            for i, window in enumerate(windows[: self.options.n])
        ]

    def result_meta(self, request: Request) -> dict[str, Any]:
        return asdict(request.teacher_forcing) | super().result_meta(request)
