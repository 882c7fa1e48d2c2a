"""Batch generation on the cluster the job was submitted to, with the flags of `kivi-eval generate`:

    ray job submit --working-dir . -- python -m jobs.generate --input s3://bucket/prompts/ \
        --output s3://bucket/generations --model qwen2.5-coder-1.5b --cache fp16 --cache kivi-2

Rerun with the same --run-id to resume: only the missing shard × cache files are generated. The exit code is
the gate's with --gate, 3 when the run stopped, 2 for bad input.
"""

import sys

from pipeline.cli import main

if __name__ == "__main__":
    sys.exit(main(["generate", *sys.argv[1:]]))
