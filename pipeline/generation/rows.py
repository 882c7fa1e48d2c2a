"""Each input record as the worker generates it, or the reason it cannot run.

A record becomes an InputRow: its id, its prompt (a text, or chat messages), how many tokens to generate and how to
choose them. A record that cannot run becomes an InputRow too, with an error code and message: it is written as an
error row, counted, and the run goes on. Records come from columns (``--id-column``, ``--prompt-column`` or
``--messages-column``) or from OpenAI batch lines (pipeline.generation.openai).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, replace
from typing import Any

from pipeline.generation.source import row_id
from pipeline.sampling import GREEDY, Sampling

# Every error_code an error row can carry, with what it means (README's table is this one).
ERROR_CODES = {
    "invalid_json": "the line is not a JSON object",
    "missing_id": "the record has no id",
    "invalid_id": "the id is neither text nor an integer",
    "duplicate_id": "an earlier row has the same id (that one is generated)",
    "missing_prompt": "the record has no prompt or messages",
    "invalid_prompt": "the prompt is not text, or the messages are not a list of {role, content} texts",
    "empty_prompt": "the prompt or every message is empty",
    "invalid_option": "a per-row option has a bad value (max_tokens, temperature, top_p, top_k, seed, stop)",
    "unsupported": "something this command does not do (another endpoint, n > 1, tools, sampling without the "
                   "decode engine …)",
    "prompt_too_long": "prompt tokens + max new tokens exceed the model's context",
    "out_of_memory": "the row alone did not fit in memory (after its batch did not)",
}


@dataclass(frozen=True)
class Options:
    """The run's generation options (the command's flags); an OpenAI batch line overrides them for its row."""

    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0  # the run's seed: each row draws with a seed derived from it and the row's id
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class InputRow:
    row: int  # the run-wide row number
    id: str | None
    prompt: str | None = None  # a text, fed as it is (or inside the chat template with --chat)
    messages: tuple[dict[str, str], ...] | None = None  # chat messages, put into the model's chat template
    max_new_tokens: int = 0
    sampling: Sampling = GREEDY
    stop: tuple[str, ...] = ()
    error_code: str | None = None
    error: str | None = None

    def failed(self, code: str, message: str) -> InputRow:
        assert code in ERROR_CODES, code
        return replace(self, error_code=code, error=message)


def row_seed(run_seed: int, row_key: str) -> int:
    """A row's seed from the run's and its id: rows draw independently, and a row draws the same in every run."""
    digest = hashlib.blake2b(f"{run_seed}\0{row_key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def base_row(row: int, record: Any, id_field: str, options: Options, duplicate: tuple[str, int] | None) -> InputRow:
    """The row with its id and the run's options; failed where the record or its id cannot be used."""
    if not isinstance(record, dict):
        return InputRow(row, None).failed("invalid_json", f"not a JSON object: {str(record)[:80]!r}")
    key = row_id(record.get(id_field))
    sampling = Sampling(options.temperature, options.top_p, options.top_k, row_seed(options.seed, key or str(row)))
    out = InputRow(row, key, max_new_tokens=options.max_new_tokens, sampling=sampling, stop=options.stop)
    if record.get(id_field) is None:
        return out.failed("missing_id", f"no {id_field!r} field")
    if key is None:
        return out.failed("invalid_id", f"{id_field!r} is {type(record[id_field]).__name__}, not text or an integer")
    if duplicate is not None:
        return out.failed("duplicate_id", f"id {key!r} is also on row {duplicate[1]}, the first row with it, which "
                                          "keeps it")
    return out


def from_columns(row: int, record: Any, id_column: str, prompt_column: str, messages_column: str | None,
                 options: Options, duplicate: tuple[str, int] | None) -> InputRow:
    """A record of columns: its id and its prompt text, or its chat messages."""
    out = base_row(row, record, id_column, options, duplicate)
    if out.error_code:
        return out
    if messages_column:
        return with_messages(out, record.get(messages_column), messages_column)
    return with_prompt(out, record.get(prompt_column), prompt_column)


def with_prompt(row: InputRow, value: Any, name: str) -> InputRow:
    if value is None:
        return row.failed("missing_prompt", f"no {name!r} field")
    if not isinstance(value, str):
        return row.failed("invalid_prompt", f"{name!r} is {type(value).__name__}, not text")
    if not value.strip():
        return row.failed("empty_prompt", f"{name!r} is empty")
    return replace(row, prompt=value)


def with_messages(row: InputRow, value: Any, name: str) -> InputRow:
    if value is None:
        return row.failed("missing_prompt", f"no {name!r} field")
    if not isinstance(value, list):
        return row.failed("invalid_prompt", f"{name!r} is {type(value).__name__}, not a list of messages")
    for i, message in enumerate(value):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)):
            return row.failed("invalid_prompt", f"{name}[{i}] is not a message with a role")
        if not isinstance(message.get("content"), str):
            return row.failed("invalid_prompt", f"{name}[{i}].content is not text (only text messages are supported)")
    if not any(m["content"].strip() for m in value):
        return row.failed("empty_prompt", f"{name!r} holds no text")
    return replace(row, messages=tuple({"role": m["role"], "content": m["content"]} for m in value))
