"""Needle in a haystack over a (context length × depth) grid, and the 5-digit passkey variant.

niah follows gkamradt/LLMTest_NeedleInAHaystack: Paul Graham essays (sorted, concatenated, repeated
when short) cut to the context length, the needle inserted at the start of the sentence that the
depth falls in. Upstream grades answers with an LLM judge; here the score is deterministic: the share
of the needle's key phrases ("sandwich", "Dolores Park") in the answer. passkey follows Mohtashami &
Jaggi (2023): a key hidden in repeated filler sentences, scored by exact match of the first number.
The essays are on GitHub, not the Hugging Face Hub, so niah needs data_dir/niah/PaulGrahamEssays.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from pipeline.workloads.base import Request, Score, Workload, WorkloadOptions, prompt_tokens
from pipeline.workloads.data import DataSourceError, local_path
from pipeline.workloads.registry import register_workload

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

NEEDLE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
KEY_PHRASES = ("sandwich", "dolores park")
NIAH_PROMPT = (
    "You are a helpful AI bot that answers questions for a user. Keep your response short and direct.\n\n"
    "{context}\n\nWhat is the best thing to do in San Francisco? "
    "Don't give information outside the document or repeat your findings."
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_PROMPT = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. "
    "I will quiz you about the important information there.\n\n{context}\n\nWhat is the pass key? The pass key is"
)


class NIAHOptions(WorkloadOptions):
    tasks: tuple[Literal["niah", "passkey"], ...] = Field(("niah", "passkey"), min_length=1, description="variants")
    lengths: tuple[PositiveInt, ...] = Field(
        (1024, 2048, 4096, 8192, 16384, 32768), min_length=1,
        description="context lengths in tokens (prompt + generation); those above max_context become max_context",
    )
    depths: tuple[float, ...] = Field((0.0, 0.25, 0.5, 0.75, 1.0), description="needle depths, fractions in [0, 1]")
    max_new_tokens: PositiveInt = Field(32, description="generation limit per cell")

    @field_validator("depths")
    @classmethod
    def _fractions(cls, depths: tuple[float, ...]) -> tuple[float, ...]:
        bad = [d for d in depths if not 0.0 <= d <= 1.0]
        if bad or not depths:
            raise ValueError(f"depths are fractions in [0, 1] (0.5 is the middle); got {list(depths)}")
        return depths

    @model_validator(mode="after")
    def _haystack_source(self) -> NIAHOptions:
        if "niah" in self.tasks and self.data_dir is None:
            raise ValueError(
                "the niah haystack (Paul Graham essays from gkamradt/LLMTest_NeedleInAHaystack on GitHub) "
                "is not on the Hugging Face Hub: set data_dir to a folder with niah/PaulGrahamEssays/*.txt"
            )
        return self


@dataclass(frozen=True)
class Haystack:
    """Background text tokenized once, so that each grid cell only slices it."""

    text: str
    offsets: list[tuple[int, int]]  # character span of each token

    @classmethod
    def build(cls, tokenizer: PreTrainedTokenizerBase, text: str, min_tokens: int) -> Haystack:
        copies = 1
        while True:  # repeat the text until it covers min_tokens, as upstream does with the essays
            encoding = tokenizer(text * copies, add_special_tokens=False, return_offsets_mapping=True)
            if len(encoding.input_ids) >= min_tokens:
                return cls(text * copies, [tuple(span) for span in encoding["offset_mapping"]])
            # Grow in proportion, plus one copy: tokens merge across joins, so copies do not add up exactly.
            copies = copies * min_tokens // len(encoding.input_ids) + 1

    def with_needle(self, needle: str, tokens: int, depth: float) -> str:
        """The first `tokens` tokens of the haystack with the needle placed at depth (a fraction)."""
        end = self.offsets[tokens - 1][1] if tokens > 0 else 0
        if depth >= 1.0:
            cut = end
        else:  # back to the end of the previous sentence, so that the needle does not split one
            cut = self.text.rfind(".", 0, self.offsets[int(tokens * depth)][0]) + 1
        return self.text[:cut] + needle + self.text[cut:end]


def keyword_recall(prediction: str) -> float:
    answer = prediction.lower()
    return sum(phrase in answer for phrase in KEY_PHRASES) / len(KEY_PHRASES)


def passkey_match(prediction: str, passkey: str) -> bool:
    # The whole first number must equal the key: "276111" does not answer 27611.
    number = re.search(r"\d+", prediction)
    return number is not None and number.group() == passkey


@register_workload("niah")
class NeedleInAHaystack(Workload):
    version = 1
    Options = NIAHOptions
    options: NIAHOptions

    def tasks(self) -> tuple[str, ...]:
        return tuple(self.options.tasks)

    def local_files(self) -> list[Path]:
        return self._essays() if "niah" in self.options.tasks else []

    def requests(self, tokenizer: PreTrainedTokenizerBase, max_context: int) -> list[Request]:
        self.check_data()
        self.skipped = Counter()
        lengths = sorted({min(length, max_context) for length in self.options.lengths})
        requests = []
        for task in self.options.tasks:
            text = "".join(p.read_text(encoding="utf-8") for p in self._essays()) if task == "niah" else FILLER
            haystack = Haystack.build(tokenizer, text, max(lengths))
            for length in lengths:
                for depth in self.options.depths:
                    requests.append(self._cell(tokenizer, haystack, task, length, depth))
        return requests

    def score(self, request: Request, prediction: str) -> Score:
        if request.task == "passkey":
            return Score(float(passkey_match(prediction, json.loads(request.reference))), "passkey_exact_match")
        return Score(keyword_recall(prediction), "needle_keyword_recall")

    def _cell(
        self, tokenizer: PreTrainedTokenizerBase, haystack: Haystack, task: str, length: int, depth: float
    ) -> Request:
        if task == "niah":
            template, needle, reference = NIAH_PROMPT, NEEDLE, NEEDLE.strip()
        else:  # each cell its own key, reproducible from the seed
            key = str(random.Random(f"{self.options.seed}:{length}:{depth}").randint(10000, 99999))
            template, needle, reference = PASSKEY_PROMPT, PASSKEY_NEEDLE.format(key=key), key
        # The cell's length is what the model sees: the prompt inside the chat template where the engine applies
        # it, plus the answer's tokens.
        chat = task == "niah"
        budget = length - self.options.max_new_tokens
        tokens = budget - prompt_tokens(tokenizer, [template.format(context=needle)], [chat])[0]
        while True:  # token counts do not add up exactly across the joins: shrink until it fits
            if tokens < 0:
                raise ValueError(f"{task}: context length {length} is too short for the prompt and "
                                 f"{self.options.max_new_tokens} new tokens")
            prompt = template.format(context=haystack.with_needle(needle, tokens, depth))
            excess = prompt_tokens(tokenizer, [prompt], [chat])[0] - budget
            if excess <= 0:
                break
            tokens -= excess
        return Request(
            request_id=f"L{length}-d{depth:g}", workload=self.name, task=task, prompt=prompt,
            max_new_tokens=self.options.max_new_tokens, reference=json.dumps(reference),
            meta={"context_length": length, "depth": depth}, chat=chat,
        )

    def _essays(self) -> list[Path]:
        return essay_paths(self.options.data_dir)


def essay_paths(data_dir: Path) -> list[Path]:
    """The haystack essays in upstream's (sorted) order."""
    folder = local_path(data_dir, "niah", "PaulGrahamEssays")
    essays = sorted(folder.glob("*.txt"))
    if not essays:
        raise DataSourceError(f"{folder} holds no .txt essays")
    return essays
