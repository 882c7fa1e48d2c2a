"""GSM8K as lm-eval's `gsm8k` task (version 3): n-shot "Question: …\nAnswer:" prompts, exact match.

Prompt, stop strings, answer filters and the exact-match normalization follow
lm_eval/tasks/gsm8k/gsm8k.yaml, so that a score here equals lm-eval's on the same generation.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, NonNegativeInt, PositiveInt

from pipeline.workloads.base import Request, Score, Workload, WorkloadOptions
from pipeline.workloads.data import local_path, parse_records, read_lines, sample
from pipeline.workloads.registry import register_workload

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SPLITS = ("train", "test")
STOP = ("Question:", "</s>", "<|im_end|>")
FILTERS = {  # lm-eval filter name -> (regex, which match to keep)
    "strict-match": (re.compile(r"#### (\-?[0-9\.\,]+)"), 0),
    "flexible-extract": (re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)"), -1),
}
INVALID = "[invalid]"  # lm-eval's fallback when the filter finds nothing; never equals a reference
IGNORE = (",", r"\$", r"(?s).*#### ", r"\.$")  # regexes_to_ignore, removed in this order from both sides


class GSM8KOptions(WorkloadOptions):
    n: PositiveInt | None = Field(None, description="test questions to sample; None takes all 1,319")
    num_fewshot: NonNegativeInt = Field(5, description="solved train examples before each question")
    fewshot_seed: int = Field(1234, description="seed of the few-shot draws (lm-eval's default fewshot_random_seed)")
    answer_filter: Literal["strict-match", "flexible-extract"] = Field(
        "strict-match", description="lm-eval filter that extracts the answer from the generation"
    )
    max_new_tokens: PositiveInt = Field(256, description="generation limit (lm-eval's default max_gen_toks)")


def extract_answer(generation: str, answer_filter: str = "strict-match") -> str:
    """The answer lm-eval's filter takes from a generation, or "[invalid]"."""
    regex, position = FILTERS[answer_filter]
    matches = regex.findall(generation)
    if not matches:
        return INVALID
    match = matches[position]
    if isinstance(match, tuple):  # alternation: the first group that matched
        match = next((group for group in match if group), INVALID)
    return match.strip()


def normalize(text: str) -> str:
    for pattern in IGNORE:
        text = re.sub(pattern, "", text)
    return text.lower()


def exact_match(answer: str, reference: str) -> bool:
    """lm-eval's exact_match with gsm8k's settings; reference is the full solution ending in "#### N"."""
    return normalize(answer) == normalize(reference)


def cut_at_stop(generation: str, stop: Sequence[str]) -> str:
    # lm-eval cuts at each stop string in turn; harmless when the engine already stopped there.
    for term in stop:
        generation = generation.split(term)[0]
    return generation


def fewshot_prompt(shots: list[dict[str, Any]], question: str) -> str:
    examples = "".join(f"Question: {shot['question']}\nAnswer: {shot['answer']}\n\n" for shot in shots)
    return f"{examples}Question: {question}\nAnswer:"


@register_workload("gsm8k")
class GSM8K(Workload):
    version = 1
    Options = GSM8KOptions
    options: GSM8KOptions
    hub_dataset = "openai/gsm8k"

    def local_files(self) -> list[Path]:
        return [self._local_file(split) for split in SPLITS]

    def requests(self, tokenizer: PreTrainedTokenizerBase, max_context: int) -> list[Request]:
        self.check_data()
        self.skipped = Counter()
        train = [record for _, record in self._split("train")]
        test = self._split("test")
        # lm-eval draws every question's shots from one Random(fewshot_seed), question after question;
        # replaying the draws over the whole split keeps each prompt equal to lm-eval's for any sample.
        rng = random.Random(self.options.fewshot_seed)
        shots = [rng.sample(train, self.options.num_fewshot) for _ in test]
        chosen = sample(list(zip(test, shots)), self.options.n, self.options.seed)
        if not chosen:  # every test record malformed: nothing to tokenize
            return []
        prompts = [fewshot_prompt(doc_shots, doc["question"]) for (_, doc), doc_shots in chosen]
        budget = max_context - self.options.max_new_tokens
        requests = []
        for ((index, doc), _), prompt, ids in zip(chosen, prompts, tokenizer(prompts).input_ids):
            if len(ids) > budget:
                self.skipped["test: prompt longer than max_context - max_new_tokens"] += 1
                continue
            requests.append(Request(
                request_id=str(index), workload=self.name, task="gsm8k", prompt=prompt,
                max_new_tokens=self.options.max_new_tokens, reference=json.dumps(doc["answer"]), stop=STOP,
            ))
        return requests

    def score(self, request: Request, prediction: str) -> Score:
        answer = extract_answer(cut_at_stop(prediction, request.stop), self.options.answer_filter)
        return Score(float(exact_match(answer, json.loads(request.reference))),
                     f"exact_match,{self.options.answer_filter}")

    def _split(self, split: str) -> list[tuple[int, dict[str, Any]]]:
        if self.options.data_dir is None:
            import datasets  # slow to import, and only the Hub path needs it

            rows = datasets.load_dataset(self.hub_dataset, "main", split=split)
        else:
            rows = read_lines(self._local_file(split))
        return parse_records(rows, {"question": str, "answer": str}, self.skipped, split)

    def _local_file(self, split: str) -> Path:
        return local_path(self.options.data_dir, "gsm8k", f"{split}.jsonl")
