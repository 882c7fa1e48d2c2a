"""The generation worker: reads its shard of the input, generates every row under each cache, writes the generations.

A Ray actor (or the one in-process worker) of ``pipeline.runner.run_jobs``, loading the model once. Per shard it
reads only the shard's rows (pipeline.generation.source), turns each into an InputRow (a bad record into an error
row), renders and tokenizes the prompts and refuses those that do not fit the context; then per cache not yet in
the archive, generates the rest on the decode engine (``batch_size`` slots, refilled as rows end) and writes one
Parquet file, whole. A batch that runs out of memory is retried a row at a time, and a row that still does not fit
is recorded as such: no bad row stops the run.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import torch

from kivi.fidelity import decode_kl
from pipeline.engine import Generation, fallback_reason
from pipeline.generation import openai
from pipeline.generation.rows import InputRow, from_columns
from pipeline.generation.source import InputShard, Source, read_shard, resolve
from pipeline.workloads import Request, render_prompt
from pipeline.worker import ModelWorker

# The worker's label for KIVI_EVAL_CRASH_ONCE (pipeline.worker): "generate:<shard>" kills the actor at that shard.
CRASH_LABEL = "generate"


class GenerateWorker(ModelWorker):
    def _prepare(self) -> None:
        cfg = self.ctx.config
        self.caches = cfg.kivi_configs()
        self.source: Source = resolve(cfg.input, cfg.split)
        text = self.engine.model.config.get_text_config(decoder=True)
        self.max_context = cfg.model.max_context or text.max_position_embeddings

    def run_shard(self, shard: InputShard, record_format: str, caches: list[str]) -> dict[str, int]:
        """Generate and write the shard under each named cache not yet in the archive (a shard retried after its
        actor died keeps what that actor wrote); returns the output tokens written per cache."""
        self._maybe_crash(CRASH_LABEL, shard.index)
        todo = [c for c in caches if not self.archive.has_generations(c, shard.index)]
        if not todo:
            return {}
        rows = self._input_rows(shard, record_format)
        prompts = self._prompts(rows)
        written = {}
        for cache in todo:
            began = time.perf_counter()
            out = self._generate(rows, prompts, cache)
            seconds = time.perf_counter() - began
            self.archive.write_generations(cache, shard.index, [r | {"shard_s": seconds} for r in out])
            written[cache] = sum(r["output_tokens"] or 0 for r in out)
            # Ray forwards an actor's stdout to the driver, prefixed with the actor.
            print(f"generate shard {shard.index} {cache}: {len(out)} rows, {written[cache]} tokens in {seconds:.1f} s",
                  flush=True)
        return written

    def _input_rows(self, shard: InputShard, record_format: str) -> list[InputRow]:
        cfg, options = self.ctx.config, self.ctx.config.options()
        if record_format == "openai":
            return [openai.from_batch_line(row, record, options, shard.duplicates.get(row))
                    for row, record in read_shard(self.source, shard)]
        wanted = [cfg.id_column, cfg.messages_column or cfg.prompt_column]  # the columns a Parquet shard reads
        return [from_columns(row, record, cfg.id_column, cfg.prompt_column, cfg.messages_column, options,
                             shard.duplicates.get(row))
                for row, record in read_shard(self.source, shard, wanted)]

    def _prompts(self, rows: list[InputRow]) -> dict[int, tuple[str, list[int]]]:
        """Row -> (its prompt as the model reads it, its token ids) for each runnable row; a row whose messages the
        chat template refuses, or whose prompt does not fit the context, becomes an error row (in ``rows``)."""
        tokenizer, texts = self.engine.tokenizer, {}
        for i, row in enumerate(rows):
            if row.error_code is None:
                try:
                    texts[row.row] = (render_prompt(tokenizer, row.prompt, self.ctx.config.chat) if row.messages is None
                                      else tokenizer.apply_chat_template(list(row.messages), add_generation_prompt=True,
                                                                         tokenize=False))
                except Exception as err:  # the template's own checks (roles out of order …), whatever they raise
                    rows[i] = row.failed("invalid_prompt", f"the chat template refused the messages: {err}")
        ids = self.engine.prompt_ids([_request(row, texts[row.row]) for row in rows if row.row in texts]) if texts else []
        prompts = dict(zip(texts, zip(texts.values(), ids)))
        for i, row in enumerate(rows):
            if row.row in prompts and len(prompts[row.row][1]) + row.max_new_tokens > self.max_context:
                rows[i] = row.failed("prompt_too_long", f"{len(prompts.pop(row.row)[1])} prompt tokens + "
                                                        f"{row.max_new_tokens} new exceed the context of {self.max_context}")
        return prompts

    def _generate(self, rows: list[InputRow], prompts: dict[int, tuple[str, list[int]]], cache: str) -> list[dict]:
        kivi = self.caches[cache]
        runnable = [r for r in rows if r.error_code is None]
        if fallback_reason(self.engine.model, kivi):  # transformers.generate: draws would depend on the batch
            runnable = [r for r in runnable if r.sampling.greedy]
        requests = [_request(r, prompts[r.row][0]) for r in runnable]
        generations = dict(zip((r.row for r in runnable), self._batched(requests, cache)))
        out = []
        for row in rows:
            generation = generations.get(row.row)
            if row.error_code is None and row.row not in generations:
                row = row.failed("unsupported", f"{cache} generates with transformers.generate, where sampling is "
                                                "not reproducible: only greedy rows run there")
            elif row.error_code is None and generation is None:
                row = row.failed("out_of_memory", "the row alone does not fit in memory under this cache")
            kl = None
            if self.ctx.config.score_kl and kivi is not None and generation is not None and generation.tokens:
                kl = decode_kl(self.engine.model, prompts[row.row][1], list(generation.tokens), kivi)
            out.append(self._record(row, cache, prompts.get(row.row), generation, kl))
        return out

    def _batched(self, requests: list[Request], cache: str) -> list[Generation | None]:
        """The requests' generations in ``batch_size`` slots; after an out-of-memory error each runs alone, and one
        that still does not fit is None."""
        if not requests:
            return []
        kivi, slots = self.caches[cache], self.ctx.config.batch_size
        try:
            return self.engine.generate(requests, kivi, slots)
        except torch.OutOfMemoryError:
            print(f"{cache}: out of memory with {len(requests)} rows in {slots} slots; each row again alone", flush=True)
        out = []
        for request in requests:
            try:
                out += self.engine.generate([request], kivi, 1)
            except torch.OutOfMemoryError:
                out.append(None)
        return out

    def _record(self, row: InputRow, cache: str, prompt: tuple[str, list[int]] | None, generation: Generation | None,
                kl: float | None) -> dict[str, Any]:
        ctx, s = self.ctx, row.sampling
        record = dict(started_at=ctx.started_at, model=ctx.config.model.spec, row=row.row, id=row.id,
                      max_new_tokens=row.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                      seed=s.seed, error_code=row.error_code, error=row.error, kl_to_fp16=kl,
                      prompt_hash=prompt and hashlib.sha256(prompt[0].encode()).hexdigest()[:16],
                      prompt_tokens=prompt and len(prompt[1]))
        if generation is None:
            return record | dict(output_text=None, output_token_ids=None, output_tokens=None, finish_reason=None,
                                 latency_s=None)
        return record | dict(output_text=generation.text, output_token_ids=list(generation.tokens),
                             output_tokens=generation.output_tokens, finish_reason=generation.finish_reason,
                             latency_s=generation.latency_s)


def _request(row: InputRow, text: str) -> Request:
    """The engine's request for a row whose prompt is rendered (``text``: the chat template already applied)."""
    return Request(str(row.row), "generate", "generate", text, row.max_new_tokens, "null", stop=row.stop,
                   sampling=None if row.sampling.greedy else row.sampling)
