"""LongBench v1, the 16 English and code tasks, prompted and truncated as the official pred.py does.

Data: data_dir/longbench/data/<task>.jsonl (the official data.zip layout; subset "full") or
data_dir/longbench/minilongbench_parsed/<task>.jsonl (subset "mini"); without data_dir, the official
data.zip of the Hub dataset THUDM/LongBench (its loading script no longer runs under datasets >= 4,
so the zip it reads is read directly). Prompt templates and generation lengths are the official
config/dataset2prompt.json and dataset2maxlen.json: they are not on the Hub, so they come from
config_dir, or data_dir/longbench/config by default.
"""

from __future__ import annotations

import json
import re
import zipfile
from collections import Counter
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, PositiveInt, field_validator, model_validator

from kivi.config import did_you_mean
from pipeline.workloads.base import Request, Score, Workload, WorkloadOptions, prompt_tokens
from pipeline.workloads.data import DataSourceError, hub_file, local_path, parse_records, read_lines, sample
from pipeline.workloads.longbench_metrics import TASK_METRICS, score_prediction
from pipeline.workloads.registry import register_workload

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TASKS = tuple(TASK_METRICS)
# pred.py leaves these few-shot and code prompts raw: chat models do better on them without a template.
NO_CHAT_TEMPLATE = frozenset({"trec", "triviaqa", "samsum", "lcc", "repobench-p"})
SUBSET_FOLDERS = {"full": "data", "mini": "minilongbench_parsed"}
REQUIRED = {"input": str, "context": str, "answers": list}
CONFIG_FILES = ("dataset2prompt.json", "dataset2maxlen.json")  # the official prompt templates and generation lengths


class LongBenchOptions(WorkloadOptions):
    tasks: tuple[str, ...] = Field(TASKS, description="LongBench tasks to run")
    n: PositiveInt | None = Field(None, description="records to sample per task; None takes all")
    subset: Literal["full", "mini"] = Field(
        "full", description="full: official records; mini: the MiniLongBench subset (local data_dir only)"
    )
    config_dir: Path | None = Field(
        None, description="folder with the official dataset2prompt.json and dataset2maxlen.json; "
        "default data_dir/longbench/config"
    )

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, tasks: tuple[str, ...]) -> tuple[str, ...]:
        unknown = [task for task in tasks if task not in TASK_METRICS]
        if unknown or not tasks:
            hints = "".join(did_you_mean(task, TASKS) for task in unknown)
            raise ValueError(f"unknown LongBench tasks {unknown}{hints}; known: {', '.join(TASKS)}")
        return tasks

    @model_validator(mode="after")
    def _sources(self) -> LongBenchOptions:
        if self.data_dir is None and self.subset == "mini":
            raise ValueError("subset 'mini' (MiniLongBench) has no Hub copy: set data_dir")
        if self.data_dir is None and self.config_dir is None:
            raise ValueError("the official prompt templates are not on the Hub: set config_dir or data_dir")
        return self


def middle_truncate(tokenizer: PreTrainedTokenizerBase, prompt: str, max_tokens: int, chat: bool = False) -> str:
    """Keep the first and last max_tokens // 2 tokens, as pred.py does: the question sits at both ends.

    Unlike pred.py, the result is guaranteed to fit as the engine feeds it (inside the chat template where
    ``chat``): halves shrink while the re-encoded text is too long.
    """
    def excess(text: str) -> int:
        return prompt_tokens(tokenizer, [text], [chat])[0] - max_tokens

    if excess(prompt) <= 0:
        return prompt
    ids = tokenizer(prompt, add_special_tokens=False).input_ids
    # No space clean-up, as Llama tokenizers default to: the decoded halves keep their original spacing.
    decode = partial(tokenizer.decode, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    half = max_tokens // 2
    while True:
        text = decode(ids[:half]) + decode(ids[-half:])
        over = excess(text)
        if over <= 0:
            return text
        half -= (over + 1) // 2  # the template, or the join re-encoded to more than 2 * half tokens


@register_workload("longbench")
class LongBench(Workload):
    version = 1
    Options = LongBenchOptions
    options: LongBenchOptions
    hub_dataset = "THUDM/LongBench"

    def tasks(self) -> tuple[str, ...]:
        return tuple(self.options.tasks)

    def check_data(self) -> None:
        for name in CONFIG_FILES:  # needed with the Hub too: they are not on it
            self._config(name)
        super().check_data()

    def local_files(self) -> list[Path]:
        return [self._local_file(task) for task in self.options.tasks]

    def requests(self, tokenizer: PreTrainedTokenizerBase, max_context: int) -> list[Request]:
        self.check_data()
        self.skipped = Counter()
        templates, max_lengths = (json.loads(self._config(name).read_text()) for name in CONFIG_FILES)
        archive = hub_file(self.hub_dataset, "data.zip") if self.options.data_dir is None else None
        requests = []
        for task in self.options.tasks:
            max_new = max_lengths[task]
            if max_context <= max_new:
                raise ValueError(f"max_context {max_context} leaves no room for {task}'s {max_new} new tokens")
            records = [(i, r) for i, r in parse_records(self._rows(task, archive), REQUIRED, self.skipped, task)
                       if self._well_formed(task, r)]
            for index, record in sample(records, self.options.n, self.options.seed):
                prompt = templates[task].format(context=record["context"], input=record["input"])
                chat = task not in NO_CHAT_TEMPLATE
                requests.append(Request(
                    request_id=record.get("_id") or str(index), workload=self.name, task=task,
                    prompt=middle_truncate(tokenizer, prompt, max_context - max_new, chat), max_new_tokens=max_new,
                    reference=json.dumps(record["answers"]), chat=chat, all_classes=_classes(record),
                ))
        return requests

    def score(self, request: Request, prediction: str) -> Score:
        answers = json.loads(request.reference)
        value = score_prediction(request.task, prediction, answers, request.all_classes)
        return Score(value, TASK_METRICS[request.task].__name__)

    def result_meta(self, request: Request) -> dict[str, Any]:
        return {"all_classes": request.all_classes} | super().result_meta(request)

    def _well_formed(self, task: str, record: dict[str, Any]) -> bool:
        problem, answers = None, record["answers"]
        if not answers or not all(isinstance(answer, str) for answer in answers):
            problem = "field 'answers' is not a list of strings"
        elif task == "trec" and not isinstance(record.get("all_classes"), list):
            problem = "missing field 'all_classes'"
        elif task == "passage_retrieval_en" and not all(re.search(r"Paragraph \d+", a) for a in answers):
            problem = "answer is not 'Paragraph N'"
        if problem:
            self.skipped[f"{task}: {problem}"] += 1
        return problem is None

    def _config(self, name: str) -> Path:
        if self.options.config_dir is not None:
            path = self.options.config_dir / name
            if not path.is_file():
                raise DataSourceError(f"{path} does not exist (workload option config_dir)")
            return path
        return local_path(self.options.data_dir, "longbench", "config", name)

    def _local_file(self, task: str) -> Path:
        return local_path(self.options.data_dir, "longbench", SUBSET_FOLDERS[self.options.subset], f"{task}.jsonl")

    def _rows(self, task: str, archive: Path | None) -> list[str]:
        if archive is None:
            return read_lines(self._local_file(task))
        with zipfile.ZipFile(archive) as files:  # the official data.zip holds data/<task>.jsonl
            return files.read(f"data/{task}.jsonl").decode("utf-8").split("\n")


def _classes(record: dict[str, Any]) -> tuple[str, ...] | None:
    """The record's label set: a list in the classification tasks (trec), null in the others."""
    classes = record.get("all_classes")
    return tuple(classes) if isinstance(classes, list) else None
