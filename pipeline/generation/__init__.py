"""Offline batch generation (`kivi-eval generate`): a user's prompts in, one row per prompt and cache out, on Ray.

    source  SRC resolved, and planned into shards in one streaming pass (row ranges, duplicate ids)
    rows    each record as the worker generates it, or the reason it cannot run (an error row)
    openai  the OpenAI batch format: its request lines in, its results JSONL out
    config  the `generate` config kind and its command-line flags, validated before any model loads
    worker  the Ray actor: a shard × cache through the decode engine into the archive's generations table
    runner  the driver: manifest, resume, the shared Ray loop, progress, summary
    cli     `kivi-eval generate` and `python -m jobs.generate`
"""
