"""The workload contract: requests in, one score per prediction out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pipeline.errors import validation_problem, validation_text
from pipeline.workloads.data import require_hub

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from pipeline.sampling import Sampling


class WorkloadOptionError(ValueError):
    """A workload option has a bad value, or is not an option of that workload."""


@dataclass(frozen=True)
class TeacherForcing:
    """How a teacher-forced request runs: its first `tokens` token ids, fed `chunk` at a time after the prefill."""

    tokens: int
    chunk: int


@dataclass(frozen=True)
class Request:
    request_id: str  # unique within (workload, task); derived from the data, so reruns agree
    workload: str
    task: str
    prompt: str  # chat template not applied; `chat` says whether the engine applies it
    max_new_tokens: int
    reference: str  # JSON text, so that every workload fits one Parquet column
    meta: dict[str, Any] = field(default_factory=dict, hash=False)  # JSON-able description stored with results (depth …)
    chat: bool = False  # the engine puts the prompt into the model's chat template (where the tokenizer has one)
    stop: tuple[str, ...] = ()  # generation ends before the first of these
    ignore_eos: bool = False  # decode all max_new_tokens (throughput requests, as vLLM's benchmark)
    prompt_tokens: int | None = None  # the prompt's length as the workload sampled it (ShareGPT)
    all_classes: tuple[str, ...] | None = None  # the label set a classification metric scores against (LongBench)
    teacher_forcing: TeacherForcing | None = None  # set on the requests of teacher_forced workloads
    sampling: Sampling | None = None  # how its tokens are chosen (pipeline.sampling); None: greedy


def render_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str, chat: bool) -> str:
    """The text the engine tokenizes (without special tokens): the prompt, inside the chat template if asked."""
    if chat and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return prompt


def prompt_tokens(tokenizer: PreTrainedTokenizerBase, prompts: list[str], chats: list[bool]) -> list[int]:
    """Tokens each prompt takes as the engine feeds it to the model (chat template included where asked)."""
    texts = [render_prompt(tokenizer, p, c) for p, c in zip(prompts, chats, strict=True)]
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids] if texts else []


def chat_template_tokens(tokenizer: PreTrainedTokenizerBase) -> int:
    """Tokens the chat template adds around a prompt (0 for a tokenizer without one)."""
    return prompt_tokens(tokenizer, [""], [True])[0]


class BudgetError(AssertionError):
    """A workload built a request that does not fit the model's context: a bug in that workload."""


def check_budget(requests: list[Request], tokenizer: PreTrainedTokenizerBase, max_context: int) -> None:
    """Every request's prompt, as the engine tokenizes it, plus its max_new_tokens fits in ``max_context``."""
    used = prompt_tokens(tokenizer, [r.prompt for r in requests], [r.chat for r in requests])
    for request, tokens in zip(requests, used):
        if tokens + request.max_new_tokens > max_context:
            raise BudgetError(f"{request.workload}/{request.task}/{request.request_id}: {tokens} prompt tokens + "
                              f"{request.max_new_tokens} new exceed max_context {max_context}")


@dataclass(frozen=True)
class Score:
    value: float  # in [0, 1] for every metric here; reports show 100 × value as "points"
    metric: str


class WorkloadOptions(BaseModel):
    """Options every workload takes; subclasses add their own fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = Field(0, description="seed of every random choice (sampling, few-shot, passkeys)")
    data_dir: Path | None = Field(
        None, description="root of local data copies (e.g. ../shared/data); None reads the Hugging Face Hub"
    )


class Workload(ABC):
    """Produces requests from a data set and scores the model's predictions for them."""

    name: ClassVar[str]  # set by @register_workload
    version: ClassVar[int]  # bumped when prompts or the metric change: gates compare equal versions only
    # accuracy: generate and score; throughput: a timed batch sweep; teacher_forced: compare distributions to fp16
    kind: ClassVar[Literal["accuracy", "throughput", "teacher_forced"]] = "accuracy"
    Options: ClassVar[type[WorkloadOptions]] = WorkloadOptions
    options: WorkloadOptions  # validated; subclasses narrow the type
    # The Hub dataset read where data_dir is None; None: there is no Hub copy (the options then require data_dir).
    hub_dataset: ClassVar[str | None] = None

    def __init__(self, **options: Any) -> None:
        try:
            self.options = self.Options(**options)
        except ValidationError as error:
            problems = validation_text(error, partial(_option_problem, options=self.Options))
            known = ", ".join(self.Options.model_fields)
            raise WorkloadOptionError(f"workload '{self.name}': {problems} (options: {known})") from None
        # Records dropped by the last requests() call, counted per reason (malformed or filtered).
        self.skipped: Counter[str] = Counter()

    def check_data(self) -> None:
        """Raise DataSourceError if the data cannot be read; cheap, so configs call it before models load."""
        if self.options.data_dir is not None:
            self.local_files()
        elif self.hub_dataset is not None:
            require_hub(self.hub_dataset)

    @abstractmethod
    def local_files(self) -> list[Path]:
        """The files it reads under data_dir; DataSourceError names the first one missing."""

    @abstractmethod
    def requests(self, tokenizer: PreTrainedTokenizerBase, max_context: int) -> list[Request]:
        """The sampled requests; each prompt as the engine renders it (``render_prompt``) plus its max_new_tokens
        fits in max_context tokens."""

    def tasks(self) -> tuple[str, ...]:
        """The `task` values its requests carry (gate rules name them); one task named as the workload by default."""
        return (self.name,)

    def score(self, request: Request, prediction: str) -> Score:
        raise TypeError(f"workload '{self.name}' is a {self.kind} workload: it has no score")

    def result_meta(self, request: Request) -> dict[str, Any]:
        """The JSON-able `meta` its results store for request: the description, then the chat flag."""
        return request.meta | {"apply_chat_template": request.chat}


def _option_problem(error: Any, options: type[WorkloadOptions]) -> tuple[str, str]:
    where, message = validation_problem(error, options)
    return (f"option '{where}'" if where else ""), message  # no where: a rule across several options
