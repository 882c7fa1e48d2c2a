"""The OpenAI batch format: its request lines in, its results JSONL out.

A request line is ``{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body": {"messages", …}}``; the
body's ``max_completion_tokens`` (or ``max_tokens``), ``temperature``, ``top_p``, ``top_k`` (vLLM's extension),
``seed`` and ``stop`` override the command's options for that line. ``model``, ``user``, ``metadata`` and ``store``
are accepted and ignored (the run's model answers every line); ``n`` must be 1, ``stream`` false and the penalties
0; anything else (tools, response_format, logprobs, another endpoint …) makes the line an error row.

Each result line answers one request line, in input order, as the OpenAI batch output does: ``{"id",
"custom_id", "response": {"status_code", "request_id", "body"}, "error"}``, the body a ``chat.completion``
(``finish_reason`` "stop" for EOS and stop strings, "length" at the token limit); an error row has status 400
(500 for out_of_memory), an error body and ``error`` set.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, BinaryIO

from pipeline.generation.rows import InputRow, Options, base_row, with_messages
from pipeline.sampling import Sampling

CHAT_COMPLETIONS = "/v1/chat/completions"
ID_FIELD = "custom_id"
_IGNORED = {"model", "user", "metadata", "store"}
_OPTIONS = {"messages", "max_completion_tokens", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop"}
_ONLY = {"n": 1, "stream": False, "presence_penalty": 0, "frequency_penalty": 0, "logprobs": False}


def is_batch_line(record: Any) -> bool:
    """Whether a record has the OpenAI batch layout (the input format is detected from the first records)."""
    return isinstance(record, dict) and ID_FIELD in record and "body" in record


def from_batch_line(row: int, record: Any, options: Options, duplicate: tuple[str, int] | None) -> InputRow:
    """One request line as an InputRow, its body's options over the run's."""
    out = base_row(row, record, ID_FIELD, options, duplicate)
    if out.error_code:
        return out
    if record.get("method", "POST") != "POST" or record.get("url") != CHAT_COMPLETIONS:
        return out.failed("unsupported", f"{record.get('method')} {record.get('url')}: only POST {CHAT_COMPLETIONS} runs")
    body = record["body"]
    if not isinstance(body, dict):
        return out.failed("invalid_option", f"body is {type(body).__name__}, not an object")
    for key, value in body.items():
        if key in _ONLY and value not in (None, _ONLY[key]):
            return out.failed("unsupported", f"body.{key}={value!r}: only {_ONLY[key]!r} is supported")
        if key not in _OPTIONS | _IGNORED | set(_ONLY):
            return out.failed("unsupported", f"body.{key} is not supported")
    tokens = body.get("max_completion_tokens", body.get("max_tokens", out.max_new_tokens))
    if not (isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 1):
        return out.failed("invalid_option", f"max tokens {tokens!r}: use an integer >= 1")
    stop = body.get("stop", out.stop)
    stop = (stop,) if isinstance(stop, str) else stop
    if not (isinstance(stop, list | tuple) and all(isinstance(s, str) and s for s in stop)):
        return out.failed("invalid_option", f"stop {body.get('stop')!r}: use a string or a list of non-empty strings")
    top_k = body.get("top_k", out.sampling.top_k)
    try:
        sampling = Sampling(temperature=body.get("temperature", out.sampling.temperature),
                            top_p=body.get("top_p", out.sampling.top_p),
                            top_k=0 if top_k == -1 else top_k,  # vLLM's -1: no limit
                            seed=body.get("seed", out.sampling.seed))
    except (TypeError, ValueError) as err:
        return out.failed("invalid_option", str(err))
    return with_messages(replace(out, max_new_tokens=tokens, stop=tuple(stop), sampling=sampling),
                         body.get("messages"), "body.messages")


def write_results(out: BinaryIO, rows: Iterable[dict[str, Any]], run_id: str, model: str, created: dt.datetime) -> int:
    """Write one result line per generations row (in the order given) to ``out``; returns the lines written."""
    lines = 0
    for row in rows:
        out.write(json.dumps(result_line(row, run_id, model, created), ensure_ascii=False).encode() + b"\n")
        lines += 1
    return lines


def result_line(row: dict[str, Any], run_id: str, model: str, created: dt.datetime) -> dict[str, Any]:
    """The result of one request line from its generations row."""
    request_id = f"{run_id}-{row['row']}"
    if row["error_code"] is None:
        status = 200
        prompt, completion = row["prompt_tokens"], row["output_tokens"]
        body = {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": int(created.timestamp()),
                "model": model, "system_fingerprint": row["cache"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": row["output_text"]},
                             "logprobs": None, "finish_reason": "length" if row["finish_reason"] == "length" else "stop"}],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}}
        error = None
    else:
        status = 500 if row["error_code"] == "out_of_memory" else 400
        error = {"code": row["error_code"], "message": row["error"]}
        body = {"error": {**error, "type": "server_error" if status == 500 else "invalid_request_error"}}
    return {"id": f"batch_req_{request_id}", "custom_id": row["id"],
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": error}
