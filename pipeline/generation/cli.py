"""The flags of `kivi-eval generate` and `python -m jobs.generate`, and the summary a run prints (the command itself is
pipeline.cli's, as every command is).

Imports nothing heavy at module level: `kivi-eval`'s other commands build this parser too.
"""

from __future__ import annotations

import argparse

# Each config field (dotted): its flag and what it does (the fields of a `kind: generate` YAML file are the same).
FLAGS = {
    "input": ("--input", "SRC: JSON lines or Parquet, a file, a folder or glob of them, or a URI (s3://…); or a "
                         "Hugging Face dataset id (owner/name)"),
    "output": ("--output", "archive root, a folder or a URI: the generations, the manifest and the OpenAI results"),
    "model.spec": ("--model", "packaged name (smollm2-135m), random:<shape>, .gguf file, folder or Hub id"),
    "caches": ("--cache", "fp16 or a KIVI preset (kivi-2 …), once per cache (default: fp16)"),
    "prompt_column": ("--prompt-column", "the prompt text's column (default: prompt)"),
    "messages_column": ("--messages-column", "a column of chat messages [{role, content}] instead of a prompt"),
    "id_column": ("--id-column", "the row id's column (default: id)"),
    "input_format": ("--input-format", "columns, openai (batch request lines) or auto (default: openai where the "
                                       "first records have custom_id and body)"),
    "split": ("--split", "the split of a Hugging Face dataset (default: train)"),
    "chat": ("--chat", "put each prompt into the model's chat template as a user message"),
    "max_new_tokens": ("--max-new-tokens", "tokens to generate at most per row (default: 256)"),
    "temperature": ("--temperature", "0 (the default) is greedy, the exact argmax"),
    "top_p": ("--top-p", "keep the most likely tokens up to this probability (default: 1, all)"),
    "top_k": ("--top-k", "keep the k most likely tokens (default: 0, no limit)"),
    "seed": ("--seed", "each row draws with a seed from this and its id (default: 0)"),
    "stop": ("--stop", "a stop string, once per string: a row ends with the token that completes one"),
    "score_kl": ("--score-kl", "score KIVI outputs by their teacher-forced KL under fp16"),
    "batch_size": ("--batch-size", "decode slots per actor (default: 32)"),
    "model.tokenizer": ("--tokenizer", "another tokenizer spec (random:<shape> models need one)"),
    "model.dtype": ("--dtype", "auto, float32, bfloat16 or float16"),
    "model.max_context": ("--max-context", "prompt + new tokens per row (default: the model's context)"),
    "ray.address": ("--address", "Ray cluster address (default: RAY_ADDRESS or a local Ray)"),
    "ray.num_actors": ("--num-actors", "actors (default: one per GPU, or one CPU actor)"),
    "ray.shard_size": ("--shard-size", "input rows per shard, the unit of resume and retry (default: 256)"),
    "reports": ("--reports", "where reports/<run_id>/report.md goes (default: reports)"),
    "gate": ("--gate", "gate rules YAML (min_exact_match …) to check the run with"),
}
_SWITCHES = {"chat", "score_kl"}  # flags without a value
_REPEATED = {"caches", "stop"}  # given once per value


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="a YAML config of kind generate; flags override its fields")
    for field, (flag, text) in FLAGS.items():
        metavar = flag.removeprefix("--").upper().replace("-", "_")
        kind = (dict(action="store_const", const=True) if field in _SWITCHES
                else dict(action="append", metavar=metavar) if field in _REPEATED else dict(metavar=metavar))
        # Values stay text here: the config validates them, naming the flag of a bad one.
        parser.add_argument(flag, dest=field, default=None, help=text.replace("%", "%%"), **kind)
    parser.add_argument("--run-id", help="resume this run: only the missing shard × cache files are generated")
    parser.add_argument("--no-ray", action="store_true", help="one worker in this process, without Ray")


def summary_lines(summary, archive: str, seconds: float) -> list[str]:
    """The run in a few lines: rows, error rows and tokens/s per cache, and each KIVI cache against fp16."""
    from pipeline.store import Store

    head = (f"generate {summary.run_id}: {summary.input['rows']} rows × {len(summary.caches)} caches in {seconds:.1f} s; "
            f"{len(summary.computed)} shard × cache files computed, {summary.reused} reused")
    lines = [head]
    with Store(archive) as store:
        rates = {r["cache"]: r["tokens_per_s"] for r in store.records(
            "SELECT cache, tokens_per_s FROM generation_summary WHERE run_id = $1", [summary.run_id])}
        for cache, counts in summary.counts.items():
            errors = sum(counts["errors"].values())
            codes = ", ".join(f"{n} {code}" for code, n in counts["errors"].items())
            rate = "" if rates.get(cache) is None else f", {rates[cache]:,.1f} tokens/s per actor"
            lines.append(f"  {cache}: {counts['rows'] - errors} rows generated, {errors} error rows"
                         f"{f' ({codes})' if codes else ''}, {counts['output_tokens']} output tokens{rate}")
        for a in store.records("SELECT * FROM generation_agreement WHERE run_id = $1 ORDER BY cache", [summary.run_id]):
            first = "" if a["mean_first_diff"] is None else f", differing rows part at token {a['mean_first_diff']:.1f} on average"
            kl = "" if a["mean_kl"] is None else f", mean KL to fp16 {a['mean_kl']:.4f}"
            lines.append(f"  {a['cache']} vs fp16: {a['exact']} of {a['greedy_rows']} greedy rows identical{first}{kl}")
    return lines + [f"  OpenAI results, {cache}: {where}" for cache, where in summary.openai_results.items()]
