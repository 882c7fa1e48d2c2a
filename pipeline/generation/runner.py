"""The driver of a generate run: the input planned into shards, the manifest, resume, the Ray loop, progress, counts.

    plan (one streaming pass; pipeline.generation.source) ─► shard × cache jobs not yet in the archive
       ─► pipeline.runner.run_jobs: GenerateWorker actors (or one in process), a lost actor's shard retried elsewhere
       ─► generations/run_id=…/cache=…/shard-NNNNN.parquet, each written whole as it finishes
       ─► the counts read back from the archive (resumed shards included) ─► manifest; OpenAI results JSONL

The driver loads the tokenizer and the model's config, never its weights; it holds the plan (offsets and ids),
never the prompts or the outputs.
"""

from __future__ import annotations

import io
import json
import sys
import time
from contextlib import nullcontext, redirect_stdout
from dataclasses import dataclass, field
from typing import Any

import pyarrow.compute as pc
import pyarrow.dataset as ds
from tqdm import tqdm

from pipeline.archive import GENERATIONS, ArchiveWriter, read_table
from pipeline.errors import ConfigError
from pipeline.generation import openai
from pipeline.generation.config import RESUME_FIELDS, GenerateConfig, check_fallback_sampling, record_format
from pipeline.generation.source import InputPlan, SourceError, plan, resolve, sample_records
from pipeline.generation.worker import GenerateWorker
from pipeline.models import load_tokenizer
from pipeline.names import GENERATE
from pipeline.runner import (ResumeError, check_model, check_resumable, manifest_row, new_run_id, recorded,
                             run_context, run_jobs)


@dataclass
class GenerateSummary:
    run_id: str
    input: dict[str, Any]  # the plan, as the manifest keeps it
    caches: list[str]
    computed: list[tuple[int, str]] = field(default_factory=list)  # (shard, cache) files written by this driver
    reused: int = 0  # shard × cache files already in the archive (a resumed run)
    placements: list[dict] = field(default_factory=list)
    fallbacks: dict[str, str] = field(default_factory=dict)  # cache -> why it generates with transformers.generate
    counts: dict[str, dict[str, Any]] = field(default_factory=dict)  # cache -> rows, output_tokens, errors per code
    openai_results: dict[str, str] = field(default_factory=dict)  # cache -> where its OpenAI results JSONL is

    def manifest(self) -> dict[str, Any]:
        return dict(input=self.input, caches=self.counts or None, openai_results=self.openai_results or None)


def generate(config: GenerateConfig, run_id: str | None = None, progress: bool = True,
             in_process: bool = False) -> GenerateSummary:
    """Generate every input row under every cache (or resume ``run_id``: only its missing shard × cache files)."""
    run_id = run_id or new_run_id(GENERATE)
    config_yaml = config.as_yaml()
    archive = ArchiveWriter(config.output, run_id)
    manifest = archive.read_run()
    if manifest is not None:
        check_resumable(run_id, config.output, manifest, config.kind, config_yaml, RESUME_FIELDS)
    source = resolve(config.input, config.split)
    layout = record_format(config, sample_records(source))
    _check_tokenizer(config, layout)
    fallbacks = check_model(config)  # from the model's config alone, before any weights load
    check_fallback_sampling(config, fallbacks)
    fields = (openai.ID_FIELD, "body") if layout == "openai" else (config.id_column,
                                                                     config.messages_column or config.prompt_column)
    planned = plan(source, layout, fields[0], config.ray.shard_size, fields[1:])
    if not planned.rows:
        raise SourceError(f"input {config.input}: no rows")
    if manifest is not None:
        _check_same_input(run_id, manifest, planned)
    ctx = run_context(run_id, config, manifest)
    summary = GenerateSummary(run_id, planned.describe(), list(config.kivi_configs()), fallbacks=fallbacks)
    for cache, reason in fallbacks.items():
        print(f"{cache}: generating with transformers.generate, not the decode engine: {reason}", flush=True)
    row = manifest_row(ctx, GENERATE, config_yaml, fallbacks=fallbacks, generation=summary.manifest())
    with recorded(archive, manifest, row, lambda: dict(placements=summary.placements, fallbacks=fallbacks,
                                                       generation=summary.manifest())):
        _execute(config, ctx, planned, archive, summary, progress, in_process)
        summary.counts = _counts(archive, summary.caches)
        if layout == "openai":
            summary.openai_results = {cache: _write_openai(archive, cache, ctx) for cache in summary.caches}
    return summary


def _check_tokenizer(config: GenerateConfig, layout: str) -> None:
    """Messages and --chat need a chat template: refused here, not on every row."""
    tokenizer = load_tokenizer(config.model.tokenizer or config.model.spec)  # a bad spec fails before any write
    if (layout == "openai" or config.messages_column or config.chat) and not getattr(tokenizer, "chat_template", None):
        what = "--chat" if config.chat else "chat messages"
        raise ConfigError(f"kivi-eval generate: {what} need a chat template, and the tokenizer of "
                          f"{config.model.tokenizer or config.model.spec} has none: use a prompt column without "
                          "--chat, or set --tokenizer to one with a template")


def _check_same_input(run_id: str, manifest: dict, planned: InputPlan) -> None:
    started = json.loads(manifest.get("generation") or "{}").get("input", {})
    if started.get("fingerprint") != planned.fingerprint:
        raise ResumeError(f"run {run_id} was started on other input contents ({started.get('rows')} rows, fingerprint "
                          f"{started.get('fingerprint')}; now {planned.rows} rows, {planned.fingerprint}): its files "
                          "would not match these rows; start a new run id")


def _execute(config: GenerateConfig, ctx, planned: InputPlan, archive: ArchiveWriter, summary: GenerateSummary,
             progress: bool, in_process: bool) -> None:
    done = {cache: archive.done_generation_shards(cache) for cache in summary.caches}
    jobs, reused_rows = [], 0
    for shard in planned.shards:
        todo = [c for c in summary.caches if shard.index not in done[c]]
        summary.reused += len(summary.caches) - len(todo)
        reused_rows += shard.rows * (len(summary.caches) - len(todo))
        if todo:
            jobs.append(("run_shard", (shard, planned.record_format, todo)))
    pending = f"{sum(len(job[1][2]) for job in jobs)} shard × cache files to compute"
    resumed = f", {summary.reused} reused from the archive" if summary.reused else ""
    print(f"generate {ctx.run_id}: {planned.rows} rows in {len(planned.shards)} shards × {len(summary.caches)} caches"
          f"{resumed}, {pending}", flush=True)
    if not jobs:
        return
    bar = tqdm(total=planned.rows * len(summary.caches), initial=reused_rows, desc=f"generate {ctx.run_id}",
               unit="row", disable=not progress)
    tokens, first = 0, None  # the rate counts from the first finished job: the actors' start-up is not generation
    # A worker in this process prints its shard lines to this terminal, not to an actor's log: above the bar.
    above = redirect_stdout(_AboveTheBar(bar, sys.stdout)) if in_process and progress else nullcontext()
    with bar, above:
        for actor, (_, (shard, _, _)), written in run_jobs(GenerateWorker, ctx, config.ray, jobs, summary.placements,
                                                           in_process):
            summary.placements[actor]["jobs"] += 1
            summary.computed += [(shard.index, cache) for cache in written]
            tokens += sum(written.values())
            now = time.perf_counter()
            if first is None:
                first = (now, tokens)
            elif now > first[0]:
                bar.set_postfix_str(f"{(tokens - first[1]) / (now - first[0]):,.1f} tokens/s", refresh=False)
            bar.update(shard.rows * len(written))


class _AboveTheBar(io.TextIOBase):
    """A stream whose whole lines are written to ``out`` with the progress bar cleared first and drawn again after."""

    def __init__(self, bar: tqdm, out: io.TextIOBase) -> None:
        self.bar, self.out, self.pending = bar, out, ""

    def write(self, text: str) -> int:
        lines, _, self.pending = (self.pending + text).rpartition("\n")
        if lines:
            with tqdm.external_write_mode(file=self.bar.fp):
                self.out.write(lines + "\n")
                self.out.flush()
        return len(text)


def _counts(archive: ArchiveWriter, caches: list[str]) -> dict[str, dict[str, Any]]:
    """Per cache, from the archive: rows, output tokens and error rows per error_code (resumed shards included)."""
    counts = {}
    for cache in caches:
        files = archive.root.glob(f"{archive.generations_dir(cache)}/shard-*.parquet")
        table = ds.dataset([archive.root.path(f) for f in files], format="parquet", filesystem=archive.root.fs,
                           schema=GENERATIONS.file_schema).to_table(columns=["error_code", "output_tokens"])
        errors = {e["values"]: e["counts"] for e in pc.value_counts(table["error_code"]).to_pylist()
                  if e["values"] is not None}
        counts[cache] = dict(rows=table.num_rows, output_tokens=pc.sum(table["output_tokens"]).as_py() or 0,
                             errors=dict(sorted(errors.items())))
    return counts


def _write_openai(archive: ArchiveWriter, cache: str, ctx) -> str:
    """The cache's OpenAI batch results, one line per input line in input order, streamed shard by shard."""
    relative = archive.openai_results_path(cache)
    with archive.root.open_whole(relative) as out:
        for file in archive.root.glob(f"{archive.generations_dir(cache)}/shard-*.parquet"):  # shard order
            rows = read_table(archive.root, file, GENERATIONS).sort_by("row").to_pylist()
            openai.write_results(out, rows, ctx.run_id, ctx.config.model.spec, ctx.started_at)
    return archive.root.location(relative)
